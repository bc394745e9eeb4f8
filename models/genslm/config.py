"""GenSLM model configuration and presets (Zvyagin et al. 2022, "GenSLMs: Genome-scale language models reveal
SARS-CoV-2 evolutionary dynamics")."""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

from ds4sci.kernels.backends import LocalBackend, parse_backend  # torch-free: this module imports no torch

POSITION_EMBEDDINGS = ("learned", "rotary", "alibi")
# "gelu": exact (erf) GELU, GPT-NeoX's default; "gelu_tanh": its tanh approximation (Hendrycks & Gimpel 2016), which
# GenSLM's released models use (Hugging Face hidden_act "gelu_fast")
ACTIVATIONS = ("gelu", "gelu_tanh")


# GenSLMConfig's integer fields -> the least value each takes (intermediate_size 0: 4 * hidden_size)
_INT_FIELDS = {"vocab_size": 1, "hidden_size": 1, "num_layers": 1, "num_heads": 1, "intermediate_size": 0,
               "max_position_embeddings": 1, "pad_token_id": 0}
# its real-valued fields -> (least, greatest, whether the least is allowed); all must be finite
_REAL_FIELDS = {"rotary_pct": (0.0, 1.0, True), "rotary_base": (0.0, math.inf, False),
                "layer_norm_eps": (0.0, math.inf, False), "dropout": (0.0, 1.0, True),
                "init_std": (0.0, math.inf, True)}
# its string fields -> their values
_CHOICE_FIELDS = {"position_embedding": POSITION_EMBEDDINGS, "activation": ACTIVATIONS}


def check_field(name: str, value):
    """``value`` as GenSLMConfig's field ``name`` (an int, a float, or the canonical string), if its type and range
    fit that field alone. Integers must be integers (a bool or a float such as ``2.0`` is refused); reals must be
    finite numbers. The fields' joint rules (``hidden_size`` divisible by ``num_heads``, ``pad_token_id`` inside the
    vocabulary) are checked by the config.

    Raises:
        ValueError: why ``value`` does not fit (without the field's name, which the caller adds).
    """
    if name in _INT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"expected an integer, got {type(value).__name__}")
        if value < _INT_FIELDS[name]:
            raise ValueError(f"must be >= {_INT_FIELDS[name]}")
        return int(value)
    if name in _REAL_FIELDS:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"expected a number, got {type(value).__name__}")
        low, high, low_ok = _REAL_FIELDS[name]
        if not (math.isfinite(value) and (low <= value if low_ok else low < value) and value <= high):
            interval = f"{'[' if low_ok else '('}{low:g}, {high:g}{']' if math.isfinite(high) else ')'}"
            raise ValueError(f"must be a finite number in {interval}")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {type(value).__name__}")
    if name == "attention_backend":
        return parse_backend(value, LocalBackend).value
    if value not in _CHOICE_FIELDS[name]:
        raise ValueError(f"expected one of {_CHOICE_FIELDS[name]}")
    return value


@dataclass
class GenSLMConfig:
    """A GPT-NeoX-style causal LM over nucleotide or codon tokens.

    The defaults are GenSLM's 25M model on its 69-word codon vocabulary. Construction checks every field
    (:func:`check_field`: integers are integers, reals finite and in range, strings known) and normalises numbers to
    the field's type; a ValueError names the field and the value.
    """

    vocab_size: int = 69  # GenSLM's codon vocabulary: 5 specials + 64 codons
    hidden_size: int = 512
    num_layers: int = 8
    num_heads: int = 8
    intermediate_size: int = 0  # 0 -> 4 * hidden_size (GPT-NeoX's MLP ratio)
    max_position_embeddings: int = 2048  # 2,048 codons; 10,240 for GenSLM's covid model
    # "learned" is the DeepSpeed4Science GenSLM setting (absolute table, sequence-partitioned under SP);
    # "rotary" is GPT-NeoX's (GenSLM's released models); "alibi" trains short and infers longer.
    position_embedding: str = "rotary"
    rotary_pct: float = 0.25  # GPT-NeoX rotates 25% of each head's dims
    rotary_base: float = 10000.0
    # A LocalBackend value. "auto": flash-attn or the Triton kernel on GPUs, the chunked PyTorch path elsewhere (never
    # an S x S tensor); "sdpa" is the readable O(S^2) reference.
    attention_backend: str = "auto"
    layer_norm_eps: float = 1e-5
    activation: str = "gelu"  # the MLP's: see ACTIVATIONS
    dropout: float = 0.0
    pad_token_id: int = 3  # [PAD] in both ds4sci tokenizers and GenSLM's vocabulary
    init_std: float = 0.02

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            try:
                setattr(self, field.name, check_field(field.name, value))
            except ValueError as err:
                raise ValueError(f"{field.name}={value!r}: {err}") from None
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}")
        if self.pad_token_id >= self.vocab_size:
            raise ValueError(f"pad_token_id={self.pad_token_id} is outside the vocabulary of {self.vocab_size}")
        if self.intermediate_size == 0:
            self.intermediate_size = 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that rotary embeddings rotate (``rotary_pct`` of the head, even); 0 without them."""
        if self.position_embedding != "rotary":
            return 0
        return int(self.head_dim * self.rotary_pct) // 2 * 2

    def block_parameters(self) -> int:
        """Parameters of one block: two layer norms, fused qkv, attention output projection, MLP (with biases)."""
        h, f = self.hidden_size, self.intermediate_size
        return 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)

    def position_table_parameters(self) -> int:
        """Parameters of the learned position table (``max_position_embeddings x hidden``); 0 for rotary and ALiBi."""
        return self.max_position_embeddings * self.hidden_size if self.position_embedding == "learned" else 0

    def num_parameters(self) -> int:
        """Parameter count computed from the shapes, without allocating the model: input embedding, position
        table, blocks, final layer norm, output head."""
        h, v = self.hidden_size, self.vocab_size
        return v * h + self.position_table_parameters() + self.num_layers * self.block_parameters() + 2 * h + h * v

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "GenSLMConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown GenSLMConfig field(s) {unknown}; known: {sorted(names)}")
        return cls(**data)

    @classmethod
    def preset(cls, name: str, **overrides) -> "GenSLMConfig":
        """``"debug"`` (tiny, for CI) or GenSLM's ``"25M"``, ``"250M"``, ``"2.5B"``, ``"25B"`` shapes."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


# Shapes as GenSLM lists them. DISCREPANCY: with GPT-NeoX's 4x MLP only the 25M shape reproduces its name
# (25,290,752 parameters); the listed 250M / 2.5B / 25B shapes count about 0.49B / 4.96B / 51.6B parameters.
PRESETS: dict[str, dict] = {
    "debug": dict(hidden_size=64, num_layers=2, num_heads=4, max_position_embeddings=512),
    "25M": dict(hidden_size=512, num_layers=8, num_heads=8),
    "250M": dict(hidden_size=1840, num_layers=12, num_heads=16),
    "2.5B": dict(hidden_size=3840, num_layers=28, num_heads=32),
    # DISCREPANCY: the GenSLM paper lists hidden 8196 for 25B, which 64 heads do not divide; 8192 keeps
    # 64 heads of 128 dims.
    "25B": dict(hidden_size=8192, num_layers=64, num_heads=64),
}
