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
        """``"debug"`` (tiny, for CI) or GenSLM's ``"25M"``, ``"250M"``, ``"2.5B"``, ``"25B"`` shapes as GenSLM lists
        them; with GPT-NeoX's 4x MLP the last three have about twice the parameters their names say
        (:func:`describe_preset`, :func:`describe_presets`)."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


# Shapes as GenSLM lists them. DISCREPANCY: with GPT-NeoX's 4x MLP only the 25M shape reproduces its name
# (25,290,752 parameters); the listed 250M / 2.5B / 25B shapes count about 0.49B / 4.96B / 51.5B parameters.
# describe_preset and describe_presets say so wherever a user picks a preset.
PRESETS: dict[str, dict] = {
    "debug": dict(hidden_size=64, num_layers=2, num_heads=4, max_position_embeddings=512),
    "25M": dict(hidden_size=512, num_layers=8, num_heads=8),
    "250M": dict(hidden_size=1840, num_layers=12, num_heads=16),
    "2.5B": dict(hidden_size=3840, num_layers=28, num_heads=32),
    # DISCREPANCY: the GenSLM paper lists hidden 8196 for 25B, which 64 heads do not divide; 8192 keeps
    # 64 heads of 128 dims.
    "25B": dict(hidden_size=8192, num_layers=64, num_heads=64),
}


def format_parameters(n: int) -> str:
    """A parameter count to 3 significant digits: ``"109K"``, ``"25.3M"``, ``"488M"``, ``"4.96B"``, ``"51.5B"``."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


def _named_count(name: str) -> float | None:
    """The parameter count a preset's name states (``"2.5B"`` -> 2.5e9), None for a name that states none."""
    scale = {"M": 1e6, "B": 1e9}.get(name[-1:])
    try:
        return float(name[:-1]) * scale if scale else None
    except ValueError:
        return None


def describe_preset(name: str, config: GenSLMConfig | None = None) -> str:
    """What preset ``name`` is, for a user choosing one: its shape and the parameters it really has, counted by
    :meth:`GenSLMConfig.num_parameters` of ``config`` (the preset as built, e.g. with a tokenizer's vocabulary;
    default ``GenSLMConfig.preset(name)``), and why that is not the named size where it is not, e.g.
    ``"GenSLM's 25B shape (hidden 8192, 64 layers, 64 heads): 51.5B parameters with GPT-NeoX's 4x MLP, not 25B"``.
    ``ValueError`` names an unknown preset."""
    config = config or GenSLMConfig.preset(name)
    count = config.num_parameters()
    shape = f"hidden {config.hidden_size}, {config.num_layers} layers, {config.num_heads} heads"
    what = "the tiny debug shape" if name == "debug" else f"GenSLM's {name} shape"
    text = f"{what} ({shape}): {format_parameters(count)} parameters"
    named = _named_count(name)
    if named is not None and not 0.8 <= count / named <= 1.25:
        mlp = config.intermediate_size / config.hidden_size
        text += f" with GPT-NeoX's {mlp:g}x MLP, not {name}"
    return text


def describe_presets() -> str:
    """Every preset and its real parameter count, for an option's help: ``'"debug" (109K parameters), "25M" (25.3M),
    ... "25B" (51.5B): GenSLM's listed shapes with GPT-NeoX's 4x MLP, so 250M, 2.5B and 25B count more than their
    names'``."""
    counts = {name: GenSLMConfig.preset(name).num_parameters() for name in PRESETS}
    listed = ", ".join(f'"{name}" ({format_parameters(n)}{" parameters" if i == 0 else ""})'
                       for i, (name, n) in enumerate(counts.items()))
    larger = [name for name, n in counts.items() if _named_count(name) and n / _named_count(name) > 1.25]
    if not larger:
        return listed
    names = larger[0] if len(larger) == 1 else f"{', '.join(larger[:-1])} and {larger[-1]}"
    return f"{listed}: GenSLM's listed shapes with GPT-NeoX's 4x MLP, so {names} count more than their names"
