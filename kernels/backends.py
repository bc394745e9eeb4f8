"""Backend names and plain limits of ds4sci's two attention families, importable without torch or Triton.

One enum per family, one parser for both (:func:`parse_backend`), and the constants the dispatchers, the kernels'
tile tables and torch-free callers (GenSLM's config, ``ds4sci plan``, ``ds4sci info``) read:

- Evoformer attention (:mod:`ds4sci.kernels.evoformer`): :class:`EvoformerBackend`, :data:`EVOFORMER_MAX_HEAD_DIM`.
- Local attention (:mod:`ds4sci.kernels.local_attention`): :class:`LocalBackend`, :data:`LOCAL_CHUNK_SIZE`,
  :data:`FLASH_MAX_HEAD_DIM`.
- The triangle multiplicative update (:mod:`ds4sci.kernels.trimul`): :class:`TriMulBackend`,
  :data:`TRIMUL_CHUNK_BYTES`.
- Both fused Triton kernels: :data:`TRITON_MAX_HEAD_DIM` (their tile tables cover exactly 1..128), and
  :func:`import_error`, how each dispatcher learns (once) whether its Triton module imports.

This module imports nothing beyond the standard library, so that ``import ds4sci.kernels.backends`` stays cheap.
"""
from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from typing import TypeVar
from typing import Union

__all__ = [
    "EvoformerBackend",
    "LocalBackend",
    "TriMulBackend",
    "parse_backend",
    "EVOFORMER_MAX_HEAD_DIM",
    "TRITON_MAX_HEAD_DIM",
    "FLASH_MAX_HEAD_DIM",
    "LOCAL_CHUNK_SIZE",
    "TRIMUL_CHUNK_BYTES",
    "import_error",
]


class EvoformerBackend(str, enum.Enum):
    """Which implementation runs ``evoformer_attention``."""

    AUTO = "auto"  # triton for CUDA tensors it supports (when Triton imports), torch otherwise
    TRITON = "triton"  # the fused kernel (ds4sci.kernels.triton_evoformer)
    TORCH = "torch"  # chunked PyTorch with a recomputing backward (ds4sci.kernels.evoformer_chunked)
    REFERENCE = "reference"  # plain PyTorch autograd, the oracle (ds4sci.kernels.evoformer_reference)


class LocalBackend(str, enum.Enum):
    """Which implementation runs ``memory_efficient_attention`` (and GenSLM's ``attention_backend``)."""

    AUTO = "auto"  # flash-attn where it can express the call, else the Triton kernel on CUDA, else chunked (sdpa off
    # CUDA for a decode step, one query row, and for a causal pass without gradients)
    CHUNKED = "chunked"  # online softmax in PyTorch, any device (ds4sci.kernels.local_chunked)
    TRITON = "triton"  # the fused kernel (ds4sci.kernels.triton_local_attention)
    FLASH = "flash"  # flash-attn's flash_attn_func (GPU, fp16/bf16)
    SDPA = "sdpa"  # the readable O(S^2) oracle (ds4sci.kernels.local_reference.sdpa_attention); off CUDA auto picks
    # it for a decode step (Sq == 1) and a causal pass without gradients (SDPA's causal kernel)


class TriMulBackend(str, enum.Enum):
    """Which implementation runs ``triangle_multiplicative_update``."""

    AUTO = "auto"  # triton for CUDA tensors it supports (when Triton imports), chunked otherwise
    TRITON = "triton"  # the fused kernels (ds4sci.kernels.triton_trimul)
    CHUNKED = "chunked"  # row blocks of the product, recomputing backward (ds4sci.kernels.trimul)
    TORCH = "torch"  # the plain autograd graph, the oracle (ds4sci.kernels.trimul.trimul_torch)


Family = TypeVar("Family", EvoformerBackend, LocalBackend, TriMulBackend)


def parse_backend(backend: Union[str, Family], family: type[Family]) -> Family:
    """``backend`` (a member of ``family`` or its value) as a member of ``family``; the one place names are parsed.

    Raises:
        ValueError: naming the unknown value and listing the family's choices.
    """
    try:
        return family(backend)
    except ValueError:
        raise ValueError(f"unknown backend {backend!r}; choose one of {[b.value for b in family]}") from None


def import_error(load: Callable[[], object], logger: logging.Logger, what: str, instead: str) -> str:
    """Empty if ``load()`` (a dispatcher's lazy import of its Triton module) succeeds, else the ``ImportError`` as
    text, logged as a warning on the caller's ``logger``: "``what`` is unavailable (error); ``instead``". Each
    dispatcher caches the answer (``functools.lru_cache``), so the warning appears once per process."""
    try:
        load()
    except ImportError as err:
        logger.warning("%s is unavailable (%s); %s", what, err, instead)
        return str(err)
    return ""


#: Head dims D accepted by ``evoformer_attention`` (the torch and reference backends): 1..EVOFORMER_MAX_HEAD_DIM.
EVOFORMER_MAX_HEAD_DIM = 256
#: Head dims D the fused Triton kernels (Evoformer and local) support: 1..TRITON_MAX_HEAD_DIM; each family's
#: ``auto`` falls back to its PyTorch path above it.
TRITON_MAX_HEAD_DIM = 128
#: flash-attn 2 supports head dims up to 256.
FLASH_MAX_HEAD_DIM = 256
#: Queries and keys per block of ``chunked_attention`` (and ``memory_efficient_attention``'s default): one block's
#: fp32 logits are ``B*H*256*256`` floats, 16 MiB at ``B*H = 64``, per temporary.
LOCAL_CHUNK_SIZE = 256
#: The chunked triangle update's default block: rows whose widest tensor (``[*, R, N, max(C_z, c)]``) fits in 4 MiB.
TRIMUL_CHUNK_BYTES = 4 * 2**20
