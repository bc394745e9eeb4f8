"""The "triton" backend (ds4sci.kernels.triton_evoformer): the fused Triton kernel against the fp64 reference.

On the CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set in tests/conftest.py): exact kernel
semantics, slow, so shapes stay small (S <= 65, N <= 3, H <= 4, Z <= 2) and the cases below are a covering set, not a
cartesian product. With ``TRITON_INTERPRET=0`` on a CUDA machine the same tests run on the GPU. The public-API
numerics tests of test_evoformer_api.py (every bias combination in fp32 at six shapes, fp16/bf16, broadcasts, bias
gradient dtypes) also run this backend; this file adds the backend contract, strides, the remaining dtype/shape/bias
cases, -inf rows, -1e9 masks, determinism, the four Evoformer variants and the tile table.
"""
import os
from types import SimpleNamespace

import pytest
import torch

from ds4sci.kernels import EvoformerBackend
from ds4sci.kernels import evoformer as evo
from ds4sci.kernels import evoformer_attention
from ds4sci.kernels import evoformer_reference
from ds4sci.kernels.backends import TRITON_MAX_HEAD_DIM

from test_evoformer_api import (  # shared helpers (tests/kernels is on sys.path under pytest's rootdir import mode)
    HAS_TRITON_BACKEND,
)
from test_evoformer_api import (  # shared helpers (tests/kernels is on sys.path under pytest's rootdir import mode)
    _assert_within_3x_pytorch,
)
from test_evoformer_api import (  # shared helpers (tests/kernels is on sys.path under pytest's rootdir import mode)
    _leaves,
)
from test_evoformer_api import _run  # shared helpers (tests/kernels is on sys.path under pytest's rootdir import mode)
from test_evoformer_api import (  # shared helpers (tests/kernels is on sys.path under pytest's rootdir import mode)
    _variant,
)
from test_evoformer_api import (  # shared helpers (tests/kernels is on sys.path under pytest's rootdir import mode)
    _variant_params,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = [
    pytest.mark.skipif(not HAS_TRITON_BACKEND, reason="triton backend not present"),
    pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="needs TRITON_INTERPRET=1 or CUDA"),
]

if HAS_TRITON_BACKEND:
    import triton

    from ds4sci.kernels import triton_evoformer as te

HALF = [torch.float16, torch.bfloat16]


def _contract_inputs(z=2, n=3, s=17, h=2, d=24, dtype=torch.float32, seed=0):
    """Canonical backend inputs q, k, v, do ``[Z, N, S, H, D]``, mask ``[Z, N, S]``, pair ``[Z, H, S, S]``."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(z, n, s, h, d, generator=g).to(DEVICE, dtype) for _ in range(4))
    mask = torch.randn(z, n, s, generator=g).to(DEVICE, dtype)
    pair = torch.randn(z, h, s, s, generator=g).to(DEVICE, dtype)
    return q, k, v, do, mask, pair


def _fwd_bwd(q, k, v, do, mask, pair, need_mask=True, need_pair=True):
    """Backend contract forward then backward: (o, lse, dq, dk, dv, dmask, dpair)."""
    o, lse = te.forward(q, k, v, mask, pair)
    return (o, lse, *te.backward(do, q, k, v, o, lse, mask, pair, need_mask, need_pair))


def _assert_bitwise_equal(got, want):
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------------------
# Numerics through the public API: dtypes x S x D x N x H x biases not already covered by test_evoformer_api
# ----------------------------------------------------------------------------------------------------------

# (dtype, (B, N, S, H, D), mask, pair): with the API tests every S in {1, 7, 16, 17, 33, 65} and D in
# {8, 16, 24, 32, 64, 128} runs in each dtype, both N in {1, 3}, both H in {1, 4}, each bias combination.
CASES = [
    (torch.float32, (2, 1, 16, 4, 16), True, True),
    (torch.float32, (1, 3, 17, 1, 32), True, False),
    (torch.float16, (1, 3, 65, 4, 32), True, True),
    (torch.float16, (1, 1, 7, 1, 128), False, True),
    (torch.float16, (1, 3, 1, 4, 8), True, False),
    (torch.float16, (2, 1, 16, 1, 16), False, False),
    (torch.bfloat16, (1, 3, 33, 1, 128), True, True),
    (torch.bfloat16, (2, 1, 16, 4, 16), True, False),
    (torch.bfloat16, (1, 1, 65, 1, 8), False, True),
    (torch.bfloat16, (1, 3, 7, 4, 32), False, False),
    (torch.bfloat16, (1, 1, 1, 1, 64), True, True),
]


@pytest.mark.parametrize(
    "dtype,shape,use_mask,use_pair", CASES,
    ids=[f"{str(c[0])[6:]}-{'x'.join(map(str, c[1]))}-{'m' if c[2] else ''}{'p' if c[3] else ''}" for c in CASES],
)
def test_matches_fp64_reference_within_3x_pytorch(dtype, shape, use_mask, use_pair):
    b, n, s, h, d = shape
    tensors, do = _leaves(shape, (b, n, 1, 1, s) if use_mask else None, (b, 1, h, s, s) if use_pair else None, seed=1)
    _assert_within_3x_pytorch(tensors, do, "triton", dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", HALF)
def test_broadcast_mask_over_n_and_pair_over_batch(dtype):
    # mask [B, 1, 1, 1, S] (stride 0 over N after canonicalisation), pair [1, 1, H, S, S] (stride 0 over B)
    tensors, do = _leaves((2, 3, 17, 4, 16), (2, 1, 1, 1, 17), (1, 1, 4, 17, 17), seed=2)
    _assert_within_3x_pytorch(tensors, do, "triton", dtype, device=DEVICE)


def test_mixed_bias_dtypes_are_read_in_their_own_dtype():
    # fp16 q/k/v with an fp32 mask and a bf16 pair bias: the kernel loads each bias in its dtype and adds in fp32
    tensors, do = _leaves((1, 3, 17, 2, 16), (1, 3, 1, 1, 17), (1, 1, 2, 17, 17), seed=3)
    dtypes = [torch.float16] * 3 + [torch.float32, torch.bfloat16]

    def run(backend, device, cast):
        leaves = [t.to(device, dt if cast else torch.float64).requires_grad_() for t, dt in zip(tensors, dtypes)]
        o = evoformer_attention(*leaves[:3], leaves[3:], backend=backend)
        o.backward(do.to(device, o.dtype))
        return [o.detach().cpu()] + [t.grad.cpu() for t in leaves]

    ours, pt = run("triton", DEVICE, True), run("reference", "cpu", True)
    same_values = [t.to(dt).double() for t, dt in zip(tensors, dtypes)]  # the rounded values the kernel sees
    ref = _run(same_values, do, "reference", torch.float64)
    assert ours[4].dtype == torch.float32 and ours[5].dtype == torch.bfloat16
    for name, a, b, r in zip(("o", "dq", "dk", "dv", "dmask", "dpair"), ours, pt, ref):
        assert a.dtype == b.dtype, name
        err, err_pt = (a.double() - r).abs().max().item(), (b.double() - r).abs().max().item()
        assert err <= 3 * err_pt + 10 * torch.finfo(a.dtype).eps * max(1.0, r.abs().max().item()), name


# ----------------------------------------------------------------------------------------------------------
# Masks: -inf rows and OpenFold's -1e9
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fully_masked_rows_give_zeros_inf_lse_and_finite_grads(dtype):
    q, k, v, do, mask, pair = _contract_inputs(z=2, n=3, s=17, h=2, d=16, dtype=dtype)
    mask[1, 2] = float("-inf")  # every key of (z=1, n=2): all its query rows are empty
    mask[0, 0, :5] = float("-inf")  # some keys only
    pair[0, 1, 3] = float("-inf")  # query row 3 of (z=0, h=1): empty through the pair bias, for every n
    o, lse, dq, dk, dv, dmask, dpair = _fwd_bwd(q, k, v, do, mask, pair)
    for t in (o, dq, dk, dv, dmask, dpair):
        assert torch.isfinite(t).all()
    assert torch.all(o[1, 2] == 0) and torch.all(lse[1, 2] == float("inf"))
    assert torch.all(o[0, :, 3, 1] == 0) and torch.all(lse[0, :, 1, 3] == float("inf"))
    assert torch.isfinite(lse[0, :, 0]).all()
    assert torch.all(dq[1, 2] == 0) and torch.all(dk[1, 2] == 0) and torch.all(dv[1, 2] == 0)
    assert torch.all(dmask[1, 2] == 0) and torch.all(dmask[0, 0, :5] == 0)
    assert torch.all(dpair[0, 1, 3] == 0)
    # everything else against the fp64 reference, with PyTorch's own error in this dtype as the yardstick
    cast = [t.double().cpu() for t in (q, k, v, do, mask, pair)]
    o_ref, lse_ref = evoformer_reference.forward(*cast[:3], cast[4], cast[5])
    want = (o_ref, lse_ref,
            *evoformer_reference.backward(cast[3], *cast[:3], o_ref, lse_ref, cast[4], cast[5], True, True))
    low = [t.cpu() for t in (q, k, v, do, mask, pair)]
    o_pt, lse_pt = evoformer_reference.forward(*low[:3], low[4], low[5])
    pt = (o_pt, lse_pt, *evoformer_reference.backward(low[3], *low[:3], o_pt, lse_pt, low[4], low[5], True, True))
    ours = (o, lse, dq, dk, dv, dmask, dpair)
    for name, a, b, r in zip(("o", "lse", "dq", "dk", "dv", "dmask", "dpair"), ours, pt, want):
        a, b = a.double().cpu(), b.double()
        finite = torch.isfinite(r)
        assert torch.equal(torch.isfinite(a), finite), name
        err = (a[finite] - r[finite]).abs().max().item()
        err_pt = (b[finite] - r[finite]).abs().max().item()
        assert err <= 3 * err_pt + 10 * torch.finfo(dtype).eps * max(1.0, r[finite].abs().max().item()), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_openfold_minus_1e9_mask_matches_outside_padding(dtype):
    # OpenFold's mask bias 1e9 * (mask - 1): padded keys, and one (z, n) that is all padding (finite, not compared:
    # with every key at -1e9 the logits are dominated by the rounding of 1e9, see DESIGN.md)
    g = torch.Generator().manual_seed(5)
    keep = torch.ones(2, 3, 33, dtype=torch.float64)
    keep[0, :, 20:] = 0
    keep[1, 1] = 0
    keep[1, 0, torch.randperm(33, generator=g)[:10]] = 0
    tensors, do = _leaves((2, 3, 33, 2, 16), None, (2, 1, 2, 33, 33), seed=6)
    tensors[3] = (1e9 * (keep - 1))[:, :, None, None, :]
    got = _run(tensors, do, "triton", dtype, device=DEVICE)
    for t in got:
        assert torch.isfinite(t).all()
    ref = _run(tensors, do, "reference", torch.float64)
    pt = _run(tensors, do, "reference", dtype)
    rows = keep.amax(-1).bool()  # [B, N]: sequences with at least one real key
    for name, a, b, r in zip(("o", "dq", "dk", "dv"), got, pt, ref):
        err = (a.double()[rows] - r[rows]).abs().max().item()
        err_pt = (b.double()[rows] - r[rows]).abs().max().item()
        assert err <= 3 * err_pt + 10 * torch.finfo(dtype).eps * max(1.0, r[rows].abs().max().item()), name


# ----------------------------------------------------------------------------------------------------------
# Backend contract: strides, broadcasts, flags, determinism, validation
# ----------------------------------------------------------------------------------------------------------


def test_strided_views_give_the_result_of_contiguous_copies():
    """MSA column attention hands over transposed views; the kernel reads strides, never copies: bitwise the same
    result under the interpreter, the same to rounding when compiled."""
    g = torch.Generator().manual_seed(7)
    z, n, s, h, d = 2, 3, 17, 2, 24
    base = torch.randn(4, z, s, n, h, 2 * d, generator=g).to(DEVICE)  # [4, Z, S, N, H, 2D]
    # q, k, v, do [Z, N, S, H, D]: N and S swapped (column attention) and every other channel (D stride 2)
    q, k, v, do = (base[i].transpose(1, 2)[..., ::2] for i in range(4))
    mask_full = torch.randn(z, 1, s, generator=g).to(DEVICE)
    pair_full = torch.randn(1, s, s, h, generator=g).to(DEVICE)
    mask = mask_full.expand(z, n, s)  # stride 0 over N
    pair = pair_full.permute(0, 3, 1, 2).expand(z, h, s, s)  # stride 0 over Z, heads last in memory
    assert not q.is_contiguous() and q.stride(-1) == 2 and mask.stride(1) == 0 and pair.stride(0) == 0
    strided = _fwd_bwd(q, k, v, do, mask, pair)
    dense = _fwd_bwd(*(t.contiguous() for t in (q, k, v, do, mask, pair)))
    if INTERPRET:
        _assert_bitwise_equal(strided, dense)
    else:  # compiled, a tile's register layout follows the strides, and so does a reduction's order: rounding only
        for a, b in zip(strided, dense):
            torch.testing.assert_close(a, b)
    assert strided[5].shape == (z, n, s) and strided[6].shape == (z, h, s, s)  # dmask per n, dpair summed over N
    assert strided[5].dtype == torch.float32 and strided[6].dtype == torch.float32
    # and the per-n mask gradient is the reference's (not reduced over the broadcast N)
    cast = [t.double().cpu() for t in (q, k, v, do, mask, pair)]
    o_ref, lse_ref = evoformer_reference.forward(*cast[:3], cast[4], cast[5])
    _, _, _, dmask_ref, dpair_ref = evoformer_reference.backward(cast[3], *cast[:3], o_ref, lse_ref, cast[4], cast[5],
                                                                 True, True)
    torch.testing.assert_close(strided[5].double().cpu(), dmask_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(strided[6].double().cpu(), dpair_ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("need_mask,need_pair", [(False, False), (True, False), (False, True)])
def test_bias_grads_only_when_asked_and_other_grads_unchanged(need_mask, need_pair):
    q, k, v, do, mask, pair = _contract_inputs(z=1, n=2, s=7, h=2, d=8, dtype=torch.bfloat16)
    full = _fwd_bwd(q, k, v, do, mask, pair, True, True)
    part = _fwd_bwd(q, k, v, do, mask, pair, need_mask, need_pair)
    _assert_bitwise_equal(part[:5], full[:5])
    assert (part[5] is not None) == need_mask and (part[6] is not None) == need_pair
    if need_mask:
        assert torch.equal(part[5], full[5])
    if need_pair:
        assert torch.equal(part[6], full[6])
    # no bias at all: no bias gradient even when asked
    none = te.backward(do, q, k, v, *te.forward(q, k, v, None, None), None, None, True, True)
    assert none[3] is None and none[4] is None


def test_backward_is_bitwise_deterministic_including_bias_grads():
    args = _contract_inputs(z=2, n=3, s=33, h=2, d=16, dtype=torch.bfloat16, seed=9)
    _assert_bitwise_equal(_fwd_bwd(*args), _fwd_bwd(*args))


def test_dpair_chunks_fill_the_grid_at_extra_msa_shapes_with_bounded_memory():
    # Extra-MSA row attention (OpenFold: N = 5120 sequences, S = 384 crop, H = 8, c = 8 -> BLOCK_D 16), bf16
    tiles = te._config(torch.bfloat16, 8).bwd
    programs = 8 * triton.cdiv(384, tiles.block_m) * triton.cdiv(384, tiles.block_n)
    chunk = te.dpair_chunk(1, 5120, 8, 384, tiles)
    chunks = triton.cdiv(5120, chunk)
    assert programs < te.DPAIR_TARGET_PROGRAMS <= programs * chunks  # unsplit under target, split reaches it
    assert chunks * 8 * 384 * 384 * 4 <= 2 * te.DPAIR_TARGET_PROGRAMS * tiles.block_m * tiles.block_n * 4
    # a grid that is full already, or a small N, is not split (no extra buffer)
    assert te.dpair_chunk(1, 5120, 8, 4096, tiles) == 5120
    assert te.dpair_chunk(1, te.DPAIR_MIN_CHUNK * 2 - 1, 1, 16, tiles) == te.DPAIR_MIN_CHUNK * 2 - 1
    assert te.dpair_chunk(1, 7, 1, 16, tiles) == 7


def test_dpair_split_over_n_chunks_matches_the_reference_and_is_deterministic():
    # N = 50 rows at a tiny S: the grid is one (z, h, tile) program per head, so N is cut into ragged chunks
    # (17, 17, 16; DPAIR_MIN_CHUNK = 16 rows at least), each summed by its own program, then added over the chunks.
    args = _contract_inputs(z=1, n=50, s=9, h=1, d=8, dtype=torch.float32, seed=4)
    chunk = te.dpair_chunk(1, 50, 1, 9, te._config(torch.float32, 8).bwd)
    assert chunk == 17
    got = _fwd_bwd(*args)
    q, k, v, do, mask, pair = args
    assert torch.equal(got[6], te.backward(do, q, k, v, *got[:2], mask, pair, True, True)[4])  # the same forward
    cast = [t.double().cpu() for t in args]
    o_ref, stats_ref = evoformer_reference.forward(*cast[:3], cast[4], cast[5])
    want = evoformer_reference.backward(cast[3], *cast[:3], o_ref, stats_ref, cast[4], cast[5], True, True)[4]
    torch.testing.assert_close(got[6].double().cpu(), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "args,error,match",
    [
        (lambda q: (q.double(), q.double(), q.double(), None, None), TypeError, "float64"),
        (lambda q: (q[..., :0].new_empty(1, 3, 7, 2, 136),) * 3 + (None, None), ValueError, "D=136"),
    ],
)
def test_backend_checks_only_its_tile_table_domain(args, error, match):
    # Shapes, devices and dtype agreement are validated once, by the public functions (tests/kernels/
    # test_evoformer_api.py::test_bad_input_errors); the backend itself refuses only what its tile table lacks.
    q = _contract_inputs(z=1, n=3, s=7, h=2, d=8)[0]
    with pytest.raises(error, match=match):
        te.forward(*args(q))


# ----------------------------------------------------------------------------------------------------------
# The four Evoformer variants through their layouts (OpenFold's formulation, fp32 kernel vs fp64)
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["msa_row", "msa_col", "tri_start", "tri_end"])
def test_evoformer_variants_match_openfold_formulation(variant):
    p64 = _variant_params(torch.float64)
    p32, p_kernel = ({key: t.detach().to(device, torch.float32).requires_grad_(t.requires_grad)
                      for key, t in p64.items()} for device in ("cpu", DEVICE))
    got, _ = _variant(variant, "triton", p_kernel)
    pt, want = _variant(variant, "reference", p32)[1], _variant(variant, "reference", p64)[1]
    do = torch.randn(want.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    names = [key for key, t in p64.items() if t.requires_grad]
    grads = [torch.autograd.grad(out, [p[key] for key in names], do.to(out.device, out.dtype), allow_unused=True)
             for out, p in ((got, p_kernel), (pt, p32), (want, p64))]
    for name, a, b, r in zip(["out"] + names, [got, *grads[0]], [pt, *grads[1]], [want, *grads[2]]):
        assert (a is None) == (r is None), name
        if r is None:
            continue
        err = (a.double().cpu() - r).abs().max().item()
        err_pt = (b.double() - r).abs().max().item()
        assert err <= 3 * err_pt + 1e-6 * max(1.0, r.abs().max().item()), f"{variant} {name}: {err:.3g} vs {err_pt:.3g}"


# ----------------------------------------------------------------------------------------------------------
# Backend selection and the tile table
# ----------------------------------------------------------------------------------------------------------


def test_auto_picks_triton_only_for_cuda_tensors():
    def fake(is_cuda, dtype=torch.float16, d=64):
        return SimpleNamespace(is_cuda=is_cuda, dtype=dtype, shape=(1, 1, 4, 1, d))

    assert evo._choose_backend("auto", fake(True)) is EvoformerBackend.TRITON
    assert evo._choose_backend("auto", fake(True, torch.float32, 128)) is EvoformerBackend.TRITON
    assert evo._choose_backend("auto", fake(True, torch.float64)) is EvoformerBackend.TORCH
    assert evo._choose_backend("auto", fake(True, d=136)) is EvoformerBackend.TORCH
    assert evo._choose_backend("auto", fake(False)) is EvoformerBackend.TORCH  # CPU, even under TRITON_INTERPRET=1
    assert evo._choose_backend("auto", torch.randn(1, 1, 4, 1, 8)) is EvoformerBackend.TORCH


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_config_table_covers_every_head_dim(dtype):
    seen = set()
    for d in range(1, TRITON_MAX_HEAD_DIM + 1):
        cfg = te._config(dtype, d)
        assert cfg.block_d in te.BLOCK_D_BUCKETS and cfg.block_d >= max(16, d) and cfg.block_d < max(32, 2 * d)
        for tiles in (cfg.fwd, cfg.bwd, cfg.dq):
            assert tiles.block_m % 16 == 0 and tiles.block_n % 16 == 0  # tl.dot's minimum
            assert tiles.num_warps in (4, 8) and tiles.num_stages >= 1
        seen.add(cfg.block_d)
    assert seen == set(te.BLOCK_D_BUCKETS)
    assert te._config(dtype, 24).block_d == 32 and te._config(dtype, 8).block_d == 16
    with pytest.raises(ValueError, match="head dim"):
        te._config(dtype, 129)
    with pytest.raises(TypeError, match="dtype"):
        te._config(torch.float64, 32)


@pytest.mark.skipif(not INTERPRET, reason="interpreter only")
def test_kernels_are_interpreted_under_triton_interpret():
    from triton.runtime.interpreter import InterpretedFunction

    kernels = (te._fwd_kernel, te._bwd_preprocess_kernel, te._bwd_dkdv_kernel, te._bwd_dq_kernel, te._bwd_dpair_kernel)
    for kernel in kernels:
        assert isinstance(kernel, InterpretedFunction)
