"""Head-dim limits of the Evoformer attention backends, the one place they are defined.

Plain constants with no imports, so that the public API (:mod:`ds4sci.kernels.evoformer`, which validates every
call) and the Triton backend (:mod:`ds4sci.kernels.triton_evoformer`, whose tile table covers exactly these head
dims) read the same numbers without the API importing Triton.
"""

#: Head dims D accepted by ``evoformer_attention`` (the torch and reference backends): 1..MAX_HEAD_DIM.
MAX_HEAD_DIM = 256
#: Head dims D the fused Triton kernel supports: 1..TRITON_MAX_HEAD_DIM (``auto`` falls back to torch above it).
TRITON_MAX_HEAD_DIM = 128
