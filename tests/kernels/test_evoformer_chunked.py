"""The "torch" backend (ds4sci.kernels.evoformer_chunked) against the reference, through the backend contract
directly."""
import math

import pytest
import torch

from ds4sci.kernels import evoformer_chunked
from ds4sci.kernels import evoformer_reference


def _inputs(z=2, n=3, s=7, h=2, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(z, n, s, h, d, generator=g).to(dtype) for _ in range(3))
    mask = torch.randn(z, n, s, generator=g).to(dtype)
    pair = torch.randn(z, h, s, s, generator=g).to(dtype)
    do = torch.randn(z, n, s, h, d, generator=g).to(dtype)
    return q, k, v, mask, pair, do


def _queries_per_chunk(monkeypatch, queries, z, n, s, dtype=torch.float32):
    """Shrink the logits budget so a chunk holds ``queries`` query rows."""
    monkeypatch.setattr(evoformer_chunked, "LOGITS_CHUNK_BYTES", queries * z * n * s * torch.finfo(dtype).bits // 8)


@pytest.mark.parametrize("queries", [1, 3, 7])  # 7 chunks, uneven chunks (3+3+1), one chunk
@pytest.mark.parametrize("use_mask,use_pair", [(False, False), (True, False), (False, True), (True, True)])
def test_matches_reference_fp64(monkeypatch, queries, use_mask, use_pair):
    q, k, v, mask, pair, do = _inputs()
    _queries_per_chunk(monkeypatch, queries, 2, 3, 7, torch.float64)
    assert evoformer_chunked._chunk_size(2, 3, 7, torch.float64) == queries
    mask = mask[:, :1].expand(-1, 3, -1) if use_mask else None  # broadcast over N, stride 0
    pair = pair[:1].expand(2, -1, -1, -1) if use_pair else None  # broadcast over Z, stride 0
    o, lse = evoformer_chunked.forward(q, k, v, mask, pair)
    o_ref, lse_ref = evoformer_reference.forward(q, k, v, mask, pair)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-13)
    torch.testing.assert_close(lse, lse_ref, rtol=0, atol=1e-13)
    got = evoformer_chunked.backward(do, q, k, v, o, lse, mask, pair, use_mask, use_pair)
    want = evoformer_reference.backward(do, q, k, v, o_ref, lse_ref, mask, pair, use_mask, use_pair)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
        else:
            assert g.dtype == w.dtype and g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_error_within_3x_pytorch_same_dtype(monkeypatch, dtype):
    q, k, v, mask, pair, do = _inputs(s=17, d=24)
    _queries_per_chunk(monkeypatch, 5, 2, 3, 17)
    ref = (evoformer_reference.forward(q, k, v, mask, pair)[0],
           *evoformer_reference.backward(do, q, k, v, None, None, mask, pair, True, True))
    low = [t.to(dtype) for t in (q, k, v, mask, pair, do)]
    o, lse = evoformer_chunked.forward(*low[:5])
    assert o.dtype == dtype and lse.dtype == torch.float32
    ours = o, *evoformer_chunked.backward(low[5], *low[:3], o, lse, low[3], low[4], True, True)
    o_pt, lse_pt = evoformer_reference.forward(*low[:5])
    pt = o_pt, *evoformer_reference.backward(low[5], *low[:3], o_pt, lse_pt, low[3], low[4], True, True)
    for name, a, b, r in zip(("o", "dq", "dk", "dv", "dmask", "dpair"), ours, pt, ref):
        err = (a.double() - r).abs().max().item()
        err_pt = (b.double() - r).abs().max().item()
        floor = 10 * torch.finfo(dtype).eps * max(1.0, r.abs().max().item())
        assert err <= 3 * err_pt + floor, f"{name}: error {err:.3g} vs PyTorch {dtype} {err_pt:.3g}"
    assert ours[1].dtype == dtype and ours[4].dtype == torch.float32 and ours[5].dtype == torch.float32


def test_fully_masked_rows(monkeypatch):
    q, k, v, mask, pair, do = _inputs()
    _queries_per_chunk(monkeypatch, 2, 2, 3, 7, torch.float64)
    mask[0, 2, :] = -math.inf
    pair[1, 1, 4, :] = -math.inf
    o, lse = evoformer_chunked.forward(q, k, v, mask, pair)
    assert torch.all(o[0, 2] == 0) and torch.all(o[1, :, 4, 1] == 0)
    assert torch.all(lse[0, 2] == math.inf) and torch.all(lse[1, :, 1, 4] == math.inf)
    grads = evoformer_chunked.backward(do, q, k, v, o, lse, mask, pair, True, True)
    for g in grads:
        assert not torch.isnan(g).any()
    o_ref, lse_ref = evoformer_reference.forward(q, k, v, mask, pair)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-13)
    for g, w in zip(grads, evoformer_reference.backward(do, q, k, v, o_ref, lse_ref, mask, pair, True, True)):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_finite_minus_1e9_fully_masked_row_is_plain_attention(dtype):
    q, k, v, mask, pair, do = _inputs(dtype=dtype)
    mask[1, 0, :] = -1e9  # OpenFold's padding bias: a constant over the row, cancels in the softmax
    o, lse = evoformer_chunked.forward(q, k, v, mask, None)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    grads = evoformer_chunked.backward(do, q, k, v, o, lse, mask, None, True, False)
    assert all(torch.isfinite(g).all() for g in grads[:4])
    if dtype == torch.float64:  # 1e9 has a spacing of 1.2e-7 in fp64: the row is plain attention to ~1e-6
        o_plain, _ = evoformer_reference.forward(q[1:, :1], k[1:, :1], v[1:, :1], None, None)
        torch.testing.assert_close(o[1:, :1], o_plain, rtol=0, atol=1e-5)


def test_backward_is_deterministic(monkeypatch):
    q, k, v, mask, pair, do = _inputs(dtype=torch.float32, s=9)
    _queries_per_chunk(monkeypatch, 4, 2, 3, 9)
    o, lse = evoformer_chunked.forward(q, k, v, mask, pair)
    first = evoformer_chunked.backward(do, q, k, v, o, lse, mask, pair, True, True)
    second = evoformer_chunked.backward(do, q, k, v, o, lse, mask, pair, True, True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_chunk_size_bounds_the_logits_block():
    z, n, s = 1, 128, 256
    c = evoformer_chunked._chunk_size(z, n, s, torch.float32)
    assert z * n * c * s * 4 <= evoformer_chunked.LOGITS_CHUNK_BYTES < z * n * (c + 1) * s * 4
    assert evoformer_chunked._chunk_size(4, 4096, 4096, torch.float32) == 1  # never below one query
    assert evoformer_chunked._chunk_size(1, 1, 5, torch.float32) == 5  # never above S
