"""Triton helpers shared by ds4sci's kernels: the exponent base and dtype handling that the CPU interpreter needs.

Kernels call :func:`cast` for every fp32 -> fp16/bf16 cast and :func:`dot` for every matmul, so that a kernel run under
``TRITON_INTERPRET=1`` rounds like the compiled kernel on a GPU (up to the order of fp32 additions, which the GPU's
MMA and fused multiply-adds change anyway). On the GPU path the interpreter branches are compiled out.
"""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) = exp2(x * log2 e)
# Two bf16 operations the Triton interpreter (TRITON_INTERPRET=1) computes unlike a GPU, worked around here so that
# the interpreter's bf16 results are the GPU's up to summation order:
# - ``tl.dot`` on bf16 multiplies the raw uint16 bit patterns (triton-lang/triton#11584, "not supported yet"): bf16
#   operands are widened to fp32 first (exact: a product of two bf16 values is exact in fp32, and the GPU's bf16
#   MMA accumulates in fp32 too);
# - fp32 -> bf16 casts truncate, where the GPU rounds to nearest even (``cvt.rn.bf16.f32``), ``fp_downcast_rounding``
#   included: :func:`cast` rounds the fp32 value to nearest even first, after which truncation is exact.
# Read at import, when ``@triton.jit`` itself reads the variable; on the GPU path both branches are compiled out.
INTERPRETED = tl.constexpr(bool(triton.knobs.runtime.interpret))


@triton.jit
def cast(x, dtype: tl.constexpr):
    """``x.to(dtype)`` for fp32 ``x``, rounding to nearest even into bf16 under the interpreter as on the GPU.

    Rounds the bit pattern: adds ``0x7FFF`` plus the lowest kept bit and keeps the upper 16 bits (ties go to the even
    neighbour; a carry moves into the exponent, so values past the bf16 maximum become inf, and subnormals round
    like normal numbers, as on the GPU). Inputs here are never NaN (probabilities, their gradients and fp32
    accumulators of finite values)."""
    if INTERPRETED:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
            return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def dot(a, b):
    # fp32 operands: IEEE fp32 products (no TF32). fp16/bf16 operands: the flag has no effect; fp32 accumulation.
    if INTERPRETED:
        if a.dtype == tl.bfloat16:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")
