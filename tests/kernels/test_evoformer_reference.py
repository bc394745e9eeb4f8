"""The oracle itself: ds4sci.kernels.evoformer_reference against a loop-by-loop formula, -inf rows, LSE, backward
contract."""
import math

import pytest
import torch

from ds4sci.kernels import evoformer_reference


def _inputs(z=2, n=3, s=5, h=2, d=4, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(z, n, s, h, d, generator=g, dtype=dtype) for _ in range(3))
    mask = torch.randn(z, n, s, generator=g, dtype=dtype)
    pair = torch.randn(z, h, s, s, generator=g, dtype=dtype)
    return q, k, v, mask, pair


def _loop_attention(q, k, v, mask, pair):
    """Scalar-by-scalar definition: one (z, n, h, i) row at a time."""
    z, n, s, h, d = q.shape
    o = torch.zeros_like(q)
    lse = torch.zeros(z, n, h, s, dtype=q.dtype)
    for zi in range(z):
        for ni in range(n):
            for hi in range(h):
                for i in range(s):
                    row = torch.stack([
                        q[zi, ni, i, hi] @ k[zi, ni, j, hi] / math.sqrt(d)
                        + (0 if mask is None else mask[zi, ni, j])
                        + (0 if pair is None else pair[zi, hi, i, j])
                        for j in range(s)
                    ])
                    lse[zi, ni, hi, i] = torch.logsumexp(row, 0)
                    o[zi, ni, i, hi] = torch.softmax(row, 0) @ v[zi, ni, :, hi]
    return o, lse


@pytest.mark.parametrize("use_mask", [False, True])
@pytest.mark.parametrize("use_pair", [False, True])
def test_reference_matches_loop_definition(use_mask, use_pair):
    q, k, v, mask, pair = _inputs()
    mask = mask if use_mask else None
    pair = pair if use_pair else None
    o, stats = evoformer_reference.forward(q, k, v, mask, pair)  # stats [Z, N, H, S, (row max, row sum)]
    o_loop, lse_loop = _loop_attention(q, k, v, mask, pair)
    torch.testing.assert_close(o, o_loop, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(stats[..., 0] + stats[..., 1].log(), lse_loop, rtol=1e-12, atol=1e-12)
    assert stats.dtype == torch.float64 and stats.shape == (*lse_loop.shape, 2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_reference_computes_in_given_dtype(dtype):
    q, k, v, mask, pair = _inputs(dtype=dtype)
    o, lse = evoformer_reference.forward(q, k, v, mask, pair)
    assert o.dtype == dtype and lse.dtype == torch.float32
    o64, _ = evoformer_reference.forward(*(t.double() for t in (q, k, v, mask, pair)))
    err = (o.double() - o64).abs().max().item()
    assert 0 < err < 50 * torch.finfo(dtype).eps  # same-dtype rounding, not an fp64 computation


def test_fully_masked_rows_are_zero_with_inf_lse_and_zero_grads():
    q, k, v, mask, pair = _inputs()
    o_clean, _ = evoformer_reference.forward(q, k, v, mask, pair)
    mask, pair = mask.clone(), pair.clone()
    mask[0, 1, :] = -math.inf  # every key of (z=0, n=1) masked
    pair[1, 0, 2, :] = -math.inf  # every key of query 2, head 0, z=1 masked
    leaves = [t.clone().requires_grad_() for t in (q, k, v, mask, pair)]
    o, lse = evoformer_reference.forward(*leaves)
    assert torch.all(o[0, 1] == 0) and torch.all(o[1, :, 2, 0] == 0)
    assert torch.all(lse[0, 1] == math.inf) and torch.all(lse[1, :, 0, 2] == math.inf)
    assert torch.isfinite(o).all()
    o.backward(torch.randn_like(o))
    for t in leaves:
        assert not torch.isnan(t.grad).any()
    assert torch.all(leaves[0].grad[0, 1] == 0) and torch.all(leaves[0].grad[1, :, 2, 0] == 0)
    # rows that keep at least one key are unchanged: (z=1, head 1) and (z=0, n=0)
    torch.testing.assert_close(o[1, :, :, 1], o_clean[1, :, :, 1], rtol=0, atol=1e-14)
    torch.testing.assert_close(o[0, 0], o_clean[0, 0], rtol=0, atol=1e-14)


def test_backward_contract_matches_autograd():
    q, k, v, mask, pair = _inputs()
    # broadcast views as the API hands them over: mask over N, pair over Z (stride 0)
    mask_b = mask[:, :1].expand(-1, 3, -1)
    pair_b = pair[:1].expand(2, -1, -1, -1)
    o, lse = evoformer_reference.forward(q, k, v, mask_b, pair_b)
    do = torch.randn_like(o)
    dq, dk, dv, dmask, dpair = evoformer_reference.backward(do, q, k, v, o, lse, mask_b, pair_b, True, True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    m_leaf = mask_b.clone().requires_grad_()  # per (z, n)
    p_leaf = pair_b.clone().requires_grad_()  # per z
    o2, _ = evoformer_reference.forward(*leaves, m_leaf, p_leaf)
    o2.backward(do)
    for got, want in zip((dq, dk, dv, dmask, dpair), (*[t.grad for t in leaves], m_leaf.grad, p_leaf.grad)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert dmask.shape == (2, 3, 5) and dpair.shape == (2, 2, 5, 5)
    none = evoformer_reference.backward(do, q, k, v, o, lse, mask_b, pair_b, False, False)
    assert none[3] is None and none[4] is None
