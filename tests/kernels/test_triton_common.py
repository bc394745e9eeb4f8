"""Shared Triton code (ds4sci.kernels.triton_common): casts that round like the GPU, under the interpreter too; the
online-softmax step both forward kernels use (and only it); downcasts only through ``cast`` in every kernel module."""
import importlib
import inspect
import math
import os
import re

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from ds4sci.kernels.triton_common import cast  # noqa: E402
from ds4sci.kernels.triton_common import online_softmax_update  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 or CUDA")


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


@triton.jit
def _softmax_kernel(S, V, O, L, M, N: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """Rows of S ``[16, N]`` through online_softmax_update tile by tile; stores acc / l, l and m."""
    rows = tl.arange(0, 16)
    cols = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    m_i = tl.full([16], float("-inf"), tl.float32)
    l_i = tl.zeros([16], tl.float32)
    acc = tl.zeros([16, D], tl.float32)
    for start in range(0, N, BLOCK_N):
        s = tl.load(S + rows[:, None] * N + start + cols[None, :])
        v = tl.load(V + (start + cols[:, None]) * D + offs_d[None, :])
        m_i, l_i, acc = online_softmax_update(s, v, m_i, l_i, acc)
    tl.store(O + rows[:, None] * D + offs_d[None, :], acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None])
    tl.store(L + rows, l_i)
    tl.store(M + rows, m_i)


def test_online_softmax_update_is_softmax_over_tiles():
    """Four key tiles: softmax(s) @ v in fp64 for finite rows, at any magnitude (a row at -1e9, OpenFold's mask, and
    one whose max arrives only in the last tile); a row of -inf gives 0 with sum 0 and max -inf, never NaN."""
    g = torch.Generator().manual_seed(0)
    N, D = 64, 16
    s = torch.randn(16, N, generator=g) * 3
    s[1] -= 1e9  # finite mask: uniform-ish attention at a huge magnitude
    s[2] = float("-inf")  # every key masked
    s[3, :48] = float("-inf")  # the first three tiles masked: the max arrives late
    s[4, -1] = 40.0  # a new max in the last tile rescales everything before it
    v = torch.randn(N, D, generator=g)
    o, l, m = (torch.empty(shape, device=DEVICE) for shape in ((16, D), (16,), (16,)))
    _softmax_kernel[(1,)](s.to(DEVICE), v.to(DEVICE), o, l, m, N, 16, D)
    finite = torch.isfinite(s).any(1)
    want = torch.softmax(s[finite].double(), -1) @ v.double()
    torch.testing.assert_close(o.cpu()[finite].double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m.cpu()[finite], s[finite].amax(-1))
    lse = m.cpu()[finite].double() + l.cpu()[finite].double().log()
    torch.testing.assert_close(lse, torch.logsumexp(s[finite].double(), -1), rtol=1e-6, atol=1e-5)
    assert (o.cpu()[2] == 0).all() and l.cpu()[2] == 0 and m.cpu()[2] == -math.inf


@pytest.mark.parametrize("module, kernels, casts", [
    ("triton_evoformer", {"_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel", "_bwd_dpair_kernel"}, 1),
    ("triton_local_attention", {"_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel", "_logits"}, 7),
    ("triton_trimul", {"_in_fwd_kernel", "_product_kernel", "_out_fwd_kernel", "_out_bwd_kernel", "_in_bwd_kernel",
                       "_wgrad_kernel"}, 10),
    ("triton_common", {"dot", "online_softmax_update"}, 1),  # cast itself is the one raw downcast
])
def test_kernels_downcast_only_through_cast(module, kernels, casts):
    """A raw ``x.to(<half dtype>)`` in a kernel truncates under the interpreter (the GPU rounds to nearest even):
    every cast in the jit functions is widening or index arithmetic (fp32, int64), or goes through ``cast``."""
    source = "\n".join(inspect.getsource(f.fn) for f in _jit_functions(module) if f.fn.__name__ != "cast")
    assert {f.fn.__name__ for f in _jit_functions(module)} >= kernels
    targets = set(re.findall(r"\.to\(([^,)]+)", source))
    assert targets <= {"tl.float32", "tl.int64"}, targets
    assert source.count("cast(") >= casts


@pytest.mark.parametrize("module", ["triton_evoformer", "triton_local_attention"])
def test_forward_kernels_share_the_online_softmax_step(module):
    """The per-tile update is written once (triton_common) and each forward kernel calls it, once per key tile."""
    source = inspect.getsource(getattr(importlib.import_module(f"ds4sci.kernels.{module}"), "_fwd_kernel").fn)
    assert source.count("online_softmax_update(") == 1
    assert "exp2((m_i - " not in source  # no second copy of the rescale factor


def _jit_functions(module: str) -> list:
    """The @triton.jit functions ``ds4sci.kernels.<module>`` defines (not those it imports)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    mod = importlib.import_module(f"ds4sci.kernels.{module}")
    return [f for f in vars(mod).values()
            if isinstance(f, (JITFunction, InterpretedFunction)) and f.fn.__module__ == mod.__name__]


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's patching of triton.language")
def test_interpreter_patches_the_language_once_per_launch_and_restores_it(monkeypatch):
    """tests/conftest.py's ``_patching_once``: a launch's helper calls (``cast``, once per program) patch
    triton.language no more than the launch itself does, so eight programs patch as much as one, and the launch
    leaves the language as it found it (a first launch's helpers may patch ``triton.language.core`` for good, as
    Triton's own interpreter does, hence the launch before the snapshot)."""
    from triton.runtime import interpreter

    walks = []
    walk = interpreter._patch_builtin  # what every patching of the language runs
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *args: walks.append(args[0]) or walk(*args))
    x, y = torch.randn(16, device=DEVICE), torch.empty(16, device=DEVICE)
    counts = []
    for programs in (1, 8):
        before = {name: getattr(tl, name) for name in ("program_id", "load", "store", "range", "where")}
        tensor_before = dict(vars(tl.tensor))
        walks.clear()
        _cast_kernel[(programs,)](x, y, 16)
        counts.append(len(walks))
    assert counts[0] > 0 and counts[1] == counts[0], counts
    assert {name: getattr(tl, name) for name in before} == before
    assert dict(vars(tl.tensor)) == tensor_before
