"""ds4sci.kernels: Evoformer attention kernels (Triton, chunked PyTorch, reference).

The public API, backend parsing and validation live in :mod:`ds4sci.kernels.evoformer`; the head-dim limits in
:mod:`ds4sci.kernels.limits`. Importing this package does not import Triton (the triton backend loads on first use).
"""
from .evoformer import Backend, DS4Sci_EvoformerAttention, evoformer_attention, parse_backend

__all__ = ["Backend", "DS4Sci_EvoformerAttention", "evoformer_attention", "parse_backend"]
