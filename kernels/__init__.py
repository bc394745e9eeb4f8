"""ds4sci.kernels: Evoformer attention kernels (Triton, chunked PyTorch, reference)."""
from .evoformer import Backend, DS4Sci_EvoformerAttention, evoformer_attention

__all__ = ["Backend", "DS4Sci_EvoformerAttention", "evoformer_attention"]
