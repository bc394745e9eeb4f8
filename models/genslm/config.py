"""GenSLM model configuration and presets (Zvyagin et al. 2022, "GenSLMs: Genome-scale language models reveal
SARS-CoV-2 evolutionary dynamics")."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ds4sci.kernels.backends import LocalBackend, parse_backend  # torch-free: this module imports no torch

POSITION_EMBEDDINGS = ("learned", "rotary", "alibi")
# "gelu": exact (erf) GELU, GPT-NeoX's default; "gelu_tanh": its tanh approximation (Hendrycks & Gimpel 2016), which
# GenSLM's released models use (Hugging Face hidden_act "gelu_fast")
ACTIVATIONS = ("gelu", "gelu_tanh")


@dataclass
class GenSLMConfig:
    """A GPT-NeoX-style causal LM over nucleotide or codon tokens.

    The defaults are GenSLM's 25M model on its 69-word codon vocabulary.
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
        if self.position_embedding not in POSITION_EMBEDDINGS:
            raise ValueError(f"position_embedding must be one of {POSITION_EMBEDDINGS}, got {self.position_embedding!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        try:
            self.attention_backend = parse_backend(self.attention_backend, LocalBackend).value
        except ValueError as err:
            raise ValueError(f"attention_backend: {err}") from None
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}")
        if not 0.0 <= self.rotary_pct <= 1.0:
            raise ValueError(f"rotary_pct must be in [0, 1], got {self.rotary_pct}")
        if not 0 <= self.pad_token_id < self.vocab_size:
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
