"""ds4sci.kernels: Evoformer attention kernels (Triton, chunked PyTorch, reference)."""
