"""Shared Triton helpers (ds4sci.kernels.triton_common): casts that round like the GPU, under the interpreter too."""
import os

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from ds4sci.kernels.triton_common import cast  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="needs TRITON_INTERPRET=1 or CUDA")


@triton.jit
def _cast_kernel(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, cast(tl.load(X + offs), Y.dtype.element_ty))


def _fp32_cases() -> torch.Tensor:
    """fp32 values that exercise every rounding case of a cast to bf16 and fp16."""
    g = torch.Generator().manual_seed(0)
    bits = torch.tensor([
        0x3F808000,  # 1 + 2^-8: a tie between bf16 1.0 (even) and 1 + 2^-7 -> 1.0
        0x3F818000,  # 1 + 3 * 2^-8: a tie between 1 + 2^-7 (odd) and 1 + 2^-6 (even) -> up
        0x3F808001,  # just above a tie -> up
        0x3F807FFF,  # just below a tie -> down
        0xBF818000,  # negative tie -> away to the even neighbour
        0x7F7FFFFF,  # fp32 max: past bf16 max + half an ulp -> inf
        0x7F7F7FFF,  # just under the bf16 rounding boundary of the maximum -> bf16 max
        0x00008000,  # subnormal tie
        0x00018000,  # subnormal tie, odd neighbour -> up
        0x80000000,  # -0
    ], dtype=torch.int64).to(torch.int32).view(torch.float32)
    return torch.cat([bits, torch.randn(1014, generator=g) * 8, torch.randn(1024, generator=g) * 1e-3])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_cast_rounds_to_nearest_even_like_torch_and_the_gpu(dtype):
    # The interpreter's own fp32 -> bf16 cast truncates (about half of random values would differ by one ulp);
    # PyTorch's cast, like the GPU's cvt.rn, rounds to nearest even.
    x = _fp32_cases().to(DEVICE)
    y = torch.empty(x.shape, dtype=dtype, device=DEVICE)
    _cast_kernel[(1,)](x, y, x.numel())
    want = x.to(dtype)
    assert torch.equal(y.view(torch.int16) if dtype != torch.float32 else y.view(torch.int32),
                       want.view(torch.int16) if dtype != torch.float32 else want.view(torch.int32))


@pytest.mark.parametrize("module, kernels, casts", [
    ("triton_evoformer", {"_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel", "_bwd_dpair_kernel"}, 1),
    ("triton_local_attention", {"_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel", "_logits"}, 8),
])
def test_kernels_downcast_only_through_cast(module, kernels, casts):
    """A raw ``x.to(<half dtype>)`` in a kernel truncates under the interpreter (the GPU rounds to nearest even):
    every cast in the jit functions is widening or index arithmetic (fp32, int64), or goes through ``cast``."""
    import importlib
    import inspect
    import re

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    mod = importlib.import_module(f"ds4sci.kernels.{module}")
    jitted = [f for f in vars(mod).values()
              if isinstance(f, (JITFunction, InterpretedFunction)) and f.fn.__module__ == mod.__name__]
    assert {f.fn.__name__ for f in jitted} >= kernels
    source = "\n".join(inspect.getsource(f.fn) for f in jitted)
    targets = set(re.findall(r"\.to\(([^,)]+)", source))
    assert targets <= {"tl.float32", "tl.int64"}, targets
    assert source.count("cast(") >= casts
