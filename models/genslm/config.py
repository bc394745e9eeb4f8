"""GenSLM model configuration and presets (Zvyagin et al. 2022, "GenSLMs: Genome-scale language models reveal
SARS-CoV-2 evolutionary dynamics")."""
from __future__ import annotations

import dataclasses
import math
import numbers
import re
from dataclasses import dataclass

from ds4sci.kernels.backends import LocalBackend  # torch-free: this module imports no torch
from ds4sci.kernels.backends import parse_backend  # torch-free: this module imports no torch

POSITION_EMBEDDINGS = ("learned", "rotary", "alibi")
# The GELU MLP's activation. "gelu": exact (erf) GELU, GPT-NeoX's default; "gelu_tanh": its tanh approximation
# (Hendrycks & Gimpel 2016), which GenSLM's released models use (Hugging Face hidden_act "gelu_fast")
ACTIVATIONS = ("gelu", "gelu_tanh")
# The MLP's kind. "gelu": GPT-NeoX's up(x) -> activation -> down, two matrices; "swiglu": Llama's gated
# down(silu(gate(x)) * up(x)) (Shazeer 2020, "GLU Variants Improve Transformer"), three matrices of intermediate_size
MLPS = ("gelu", "swiglu")
# "layernorm": GPT-NeoX's (weight and bias); "rmsnorm": Llama's root-mean-square norm, weight only (Zhang & Sennrich
# 2019, "Root Mean Square Layer Normalization"). Both use layer_norm_eps.
NORMS = ("layernorm", "rmsnorm")


# GenSLMConfig's integer fields -> the least value each takes (intermediate_size 0: 4 * hidden_size; num_kv_heads 0:
# num_heads)
_INT_FIELDS = {"vocab_size": 1, "hidden_size": 1, "num_layers": 1, "num_heads": 1, "num_kv_heads": 0,
               "intermediate_size": 0, "max_position_embeddings": 1, "pad_token_id": 0,
               "rotary_original_max_positions": 1}
# its real-valued fields -> (least, greatest, whether the least is allowed); all must be finite
_REAL_FIELDS = {"rotary_pct": (0.0, 1.0, True), "rotary_base": (0.0, math.inf, False),
                "rotary_scaling_factor": (1.0, math.inf, True), "rotary_low_freq_factor": (0.0, math.inf, False),
                "rotary_high_freq_factor": (0.0, math.inf, False),
                "layer_norm_eps": (0.0, math.inf, False), "dropout": (0.0, 1.0, True),
                "init_std": (0.0, math.inf, True)}
# its string fields -> their values
_CHOICE_FIELDS = {"position_embedding": POSITION_EMBEDDINGS, "activation": ACTIVATIONS, "mlp": MLPS, "norm": NORMS}
# its true/false fields
_BOOL_FIELDS = ("parallel_residual", "bias", "tie_word_embeddings")


def check_field(name: str, value):
    """``value`` as GenSLMConfig's field ``name`` (an int, a float, a bool, or the canonical string), if its type and
    range fit that field alone. Integers must be integers (a bool or a float such as ``2.0`` is refused); reals must be
    finite numbers; true/false fields must be bools (not ``0``/``1``). The fields' joint rules (``hidden_size``
    divisible by ``num_heads``, ``pad_token_id`` inside the vocabulary) are checked by the config.

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
    if name in _BOOL_FIELDS:
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {type(value).__name__}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {type(value).__name__}")
    if name == "attention_backend":
        return parse_backend(value, LocalBackend).value
    if value not in _CHOICE_FIELDS[name]:
        raise ValueError(f"expected one of {_CHOICE_FIELDS[name]}")
    return value


@dataclass
class GenSLMConfig:
    """A GPT-NeoX- or Llama-shaped causal LM over nucleotide or codon tokens.

    The defaults are GenSLM's 25M model on its 69-word codon vocabulary, GPT-NeoX-shaped (Black et al. 2022): one
    key/value head per query head, GELU MLP, LayerNorm, biases, parallel residual, untied output head. The Llama shape
    (Touvron et al. 2023; Llama-3: Grattafiori et al. 2024) is ``num_kv_heads < num_heads`` (grouped-query attention,
    Ainslie et al. 2023), ``mlp="swiglu"``, ``norm="rmsnorm"``, ``bias=False``, ``parallel_residual=False``,
    ``rotary_pct=1.0`` and, for Llama-3.1, ``rotary_scaling_factor=8`` (see the ``llama3-8B`` preset).

    Construction checks every field (:func:`check_field`: integers are integers, reals finite and in range, bools
    bools, strings known) and normalises numbers to the field's type; a ValueError names the field and the value.
    """

    vocab_size: int = 69  # GenSLM's codon vocabulary: 5 specials + 64 codons
    hidden_size: int = 512
    num_layers: int = 8
    num_heads: int = 8
    # key/value heads: 0 -> num_heads (multi-head attention); fewer: grouped-query attention, query head h reads
    # key/value head h // (num_heads / num_kv_heads); 1: multi-query attention. Must divide num_heads.
    num_kv_heads: int = 0
    # width of the MLP's hidden layer (of each of SwiGLU's gate and up projections); 0 -> 4 * hidden_size (GPT-NeoX's
    # ratio, whatever the activation)
    intermediate_size: int = 0
    max_position_embeddings: int = 2048  # 2,048 codons; 10,240 for GenSLM's covid model
    # "learned" is the DeepSpeed4Science GenSLM setting (absolute table, sequence-partitioned under SP);
    # "rotary" is GPT-NeoX's (GenSLM's released models); "alibi" trains short and infers longer.
    position_embedding: str = "rotary"
    rotary_pct: float = 0.25  # GPT-NeoX rotates 25% of each head's dims
    rotary_base: float = 10000.0  # transformers' rope_theta
    # Llama-3.1's rotary frequency scaling (transformers' rope_type "llama3"): 1.0 -> none. Wavelengths longer than
    # rotary_original_max_positions / rotary_low_freq_factor are stretched by the factor, those shorter than
    # rotary_original_max_positions / rotary_high_freq_factor kept, those between interpolated.
    rotary_scaling_factor: float = 1.0
    rotary_low_freq_factor: float = 1.0
    rotary_high_freq_factor: float = 4.0
    rotary_original_max_positions: int = 8192
    # A LocalBackend value. "auto": flash-attn or the Triton kernel on GPUs, the chunked PyTorch path elsewhere (never
    # an S x S tensor; a decode step's one query row runs sdpa); "sdpa" is the readable O(S^2) reference.
    attention_backend: str = "auto"
    layer_norm_eps: float = 1e-5  # epsilon of either norm
    norm: str = "layernorm"  # see NORMS
    mlp: str = "gelu"  # see MLPS
    activation: str = "gelu"  # the GELU MLP's: see ACTIVATIONS (SwiGLU's is SiLU, fixed)
    bias: bool = True  # biases in the attention and MLP projections (GPT-NeoX's; Llama has none)
    # True: GPT-NeoX's x + attn(ln1(x)) + mlp(ln2(x)); False: Llama's pre-norm sequential residual,
    # x' = x + attn(ln1(x)), then x' + mlp(ln2(x'))
    parallel_residual: bool = True
    tie_word_embeddings: bool = False  # the output head is the input embedding's matrix
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
        if self.num_kv_heads == 0:
            self.num_kv_heads = self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads={self.num_kv_heads} does not divide num_heads={self.num_heads}")
        if self.mlp == "swiglu" and self.activation != "gelu":
            raise ValueError(f"activation={self.activation!r} applies to mlp='gelu' only (SwiGLU's activation is "
                             f"SiLU); leave it 'gelu' with mlp='swiglu'")
        if self.rotary_high_freq_factor <= self.rotary_low_freq_factor:
            raise ValueError(f"rotary_high_freq_factor={self.rotary_high_freq_factor} must exceed "
                             f"rotary_low_freq_factor={self.rotary_low_freq_factor}")
        if self.pad_token_id >= self.vocab_size:
            raise ValueError(f"pad_token_id={self.pad_token_id} is outside the vocabulary of {self.vocab_size}")
        if self.intermediate_size == 0:
            self.intermediate_size = 4 * self.hidden_size

    def check_gpt_neox_shape(self, what: str) -> None:
        """GPT-NeoX's shape: one key/value head per query head, GELU MLP, LayerNorm, biases, parallel residual,
        untied head, unscaled rotary frequencies.

        Raises:
            ValueError: ``"{field}={value}: {what} GPT-NeoX-shaped GenSLMs only ({field}={GPT-NeoX's value})"`` for
                the first field that differs.
        """
        self._check_shape("GPT-NeoX", what, num_kv_heads=self.num_heads, mlp="gelu", norm="layernorm", bias=True,
                          parallel_residual=True, tie_word_embeddings=False, rotary_scaling_factor=1.0)

    def check_llama_shape(self, what: str) -> None:
        """Llama's shape: rotary positions on every head dim, SwiGLU MLP, RMSNorm, sequential residual (any number of
        key/value heads, biases or not, tied or untied head, Llama-3 rotary scaling or not).

        Raises:
            ValueError: ``"{field}={value}: {what} Llama-shaped GenSLMs only ({field}={Llama's value})"`` for the
                first field that differs.
        """
        self._check_shape("Llama", what, position_embedding="rotary", rotary_pct=1.0, mlp="swiglu", norm="rmsnorm",
                          parallel_residual=False)

    def _check_shape(self, family: str, what: str, **supported) -> None:
        for field, value in supported.items():
            if getattr(self, field) != value:
                raise ValueError(f"{field}={getattr(self, field)!r}: {what} {family}-shaped GenSLMs only "
                                 f"({field}={value!r})")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that rotary embeddings rotate (``rotary_pct`` of the head, even); 0 without them."""
        if self.position_embedding != "rotary":
            return 0
        return int(self.head_dim * self.rotary_pct) // 2 * 2

    def norm_parameters(self) -> int:
        """Parameters of one norm: weight and bias (LayerNorm) or weight (RMSNorm), ``hidden_size`` each."""
        return (2 if self.norm == "layernorm" else 1) * self.hidden_size

    def block_parameters(self) -> int:
        """Parameters of one block: two norms (:meth:`norm_parameters`), fused q/k/v (``num_heads`` query and
        ``2 * num_kv_heads`` key/value heads), attention output projection, MLP (two matrices, SwiGLU three), the
        projections' biases where ``bias``."""
        h, f = self.hidden_size, self.intermediate_size
        qkv = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        norms = 2 * self.norm_parameters()
        mlp_in = 2 if self.mlp == "swiglu" else 1
        weights = qkv * h + h * h + mlp_in * h * f + f * h
        biases = qkv + h + mlp_in * f + h if self.bias else 0
        return norms + weights + biases

    def position_table_parameters(self) -> int:
        """Parameters of the learned position table (``max_position_embeddings x hidden``); 0 for rotary and ALiBi."""
        return self.max_position_embeddings * self.hidden_size if self.position_embedding == "learned" else 0

    def num_parameters(self) -> int:
        """Parameter count computed from the shapes, without allocating the model: input embedding, position
        table, blocks, final norm, output head (none of its own when tied to the embedding)."""
        h, v = self.hidden_size, self.vocab_size
        head = 0 if self.tie_word_embeddings else h * v
        return (v * h + self.position_table_parameters() + self.num_layers * self.block_parameters()
                + self.norm_parameters() + head)

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


# What every Llama-shaped preset shares (see GenSLMConfig's docstring)
_LLAMA = dict(mlp="swiglu", norm="rmsnorm", bias=False, parallel_residual=False, rotary_pct=1.0,
              rotary_base=500000.0, layer_norm_eps=1e-5)

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
    # Llama-shaped genome LMs (Touvron et al. 2023): grouped-query attention, SwiGLU, RMSNorm, no biases, sequential
    # residual, rotary on every head dim with Llama-3's base
    "llama-debug": dict(_LLAMA, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                        max_position_embeddings=512),
    "llama-100M": dict(_LLAMA, hidden_size=768, num_layers=16, num_heads=12, num_kv_heads=4, intermediate_size=2048,
                       max_position_embeddings=8192),
    # Llama-3.1-8B's shape (Grattafiori et al. 2024, "The Llama 3 Herd of Models"; its config.json on the Hugging Face
    # Hub): 8 key/value heads, SwiGLU 14336, rope_theta 500000 with "llama3" scaling (factor 8, low 1, high 4,
    # original 8192 positions) and 131072 positions. On a 69- or 10-id genome vocabulary it counts 6.98B parameters
    # (the 8.03B of the original are 1.05B of 128256-word embedding and head).
    "llama3-8B": dict(_LLAMA, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, intermediate_size=14336,
                      max_position_embeddings=131072, rotary_scaling_factor=8.0, rotary_low_freq_factor=1.0,
                      rotary_high_freq_factor=4.0, rotary_original_max_positions=8192),
}


def format_parameters(n: int) -> str:
    """A parameter count to 3 significant digits: ``"109K"``, ``"25.3M"``, ``"488M"``, ``"4.96B"``, ``"51.5B"``."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


def _named_count(name: str) -> float | None:
    """The parameter count a preset's name states (``"2.5B"`` -> 2.5e9, ``"llama3-8B"`` -> 8e9), None for a name
    that states none (``"debug"``)."""
    stated = re.search(r"(?:^|-)(\d+(?:\.\d+)?)([MB])$", name)
    return float(stated[1]) * {"M": 1e6, "B": 1e9}[stated[2]] if stated else None


def describe_preset(name: str, config: GenSLMConfig | None = None) -> str:
    """What preset ``name`` is, for a user choosing one: its shape and the parameters it really has, counted by
    :meth:`GenSLMConfig.num_parameters` of ``config`` (the preset as built, e.g. with a tokenizer's vocabulary;
    default ``GenSLMConfig.preset(name)``), and why that is not the named size where it is not, e.g.
    ``"GenSLM's 25B shape (hidden 8192, 64 layers, 64 heads): 51.5B parameters with GPT-NeoX's 4x MLP, not 25B"``.
    ``ValueError`` names an unknown preset."""
    config = config or GenSLMConfig.preset(name)
    count = config.num_parameters()
    shape = f"hidden {config.hidden_size}, {config.num_layers} layers, {config.num_heads} heads"
    if config.num_kv_heads != config.num_heads:
        shape += f" ({config.num_kv_heads} key/value)"
    if config.mlp == "swiglu":
        shape += f", SwiGLU {config.intermediate_size}"
    llama = name.startswith("llama")
    if name in ("debug", "llama-debug"):
        what = f"the tiny {'Llama-shaped ' if llama else ''}debug shape"
    elif name == "llama3-8B":
        what = "Llama-3.1-8B's shape"
    else:
        what = f"a {name[len('llama-'):]} Llama-shaped genome LM" if llama else f"GenSLM's {name} shape"
    text = f"{what} ({shape}): {format_parameters(count)} parameters"
    named = _named_count(name)
    if named is not None and not 0.8 <= count / named <= 1.25:
        mlp = config.intermediate_size / config.hidden_size
        whose = "a" if llama else "GPT-NeoX's"
        text += f" with {whose} {mlp:g}x MLP, not {name}"
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
