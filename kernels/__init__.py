"""ds4sci.kernels: attention kernels and their PyTorch paths; no nn.Module.

Two families, each laid out reference -> chunked PyTorch path -> Triton kernel -> API:

- Evoformer attention: :mod:`~ds4sci.kernels.evoformer_reference`, :mod:`~ds4sci.kernels.evoformer_chunked`,
  :mod:`~ds4sci.kernels.triton_evoformer`, and the API :mod:`~ds4sci.kernels.evoformer` (``evoformer_attention``,
  ``DS4Sci_EvoformerAttention``).
- Local attention (GenSLM, sequence parallelism): :mod:`~ds4sci.kernels.local_reference` (protocol checks, masks, the
  ``sdpa_attention`` oracle), :mod:`~ds4sci.kernels.local_chunked`, :mod:`~ds4sci.kernels.triton_local_attention`,
  and the API :mod:`~ds4sci.kernels.local_attention` (the protocol, ``memory_efficient_attention``).

The triangle multiplicative update (AF2 Algorithms 11/12): :mod:`~ds4sci.kernels.trimul`
(``triangle_multiplicative_update``, its weights ``TriMulParams``, the torch and chunked paths).

The MLP's memory-efficient path, :mod:`~ds4sci.kernels.tiled_mlp` (``tiled_mlp``: ALST's TiledMLP), and the output
projection and loss's, :mod:`~ds4sci.kernels.tiled_loss` (``tiled_loss``: ALST's tiled loss), both token tiles
recomputed in backward (:mod:`~ds4sci.kernels.token_tiles`), serve GenSLM's ``activation_checkpointing.tiled_mlp``
and ``tiled_loss``; :mod:`~ds4sci.kernels.rotary` (``apply_rotary_qkv_``) rotates the query and key heads of GenSLM's
fused qkv projection in place, so attention saves no rotated copies.

Backend enums, their parser and the plain limits are in :mod:`ds4sci.kernels.backends`; Triton helpers shared by both
kernels in :mod:`ds4sci.kernels.triton_common`. Importing this package imports neither torch nor Triton: the names
below that need torch load on first access (PEP 562), and the Triton backends load on first use.
"""
from __future__ import annotations

from .backends import EvoformerBackend
from .backends import LocalBackend
from .backends import TriMulBackend
from .backends import parse_backend
from .lazy import lazy_exports

__all__ = ["DS4Sci_EvoformerAttention", "EvoformerBackend", "LocalBackend", "TriMulBackend", "TriMulParams",
           "evoformer_attention", "parse_backend", "triangle_multiplicative_update"]

# name -> submodule defining it, imported (with torch) on first access
_LAZY = {"evoformer_attention": "evoformer", "DS4Sci_EvoformerAttention": "evoformer",
         "triangle_multiplicative_update": "trimul", "TriMulParams": "trimul"}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
