"""ds4sci.kernels.evoformer.evoformer_attention_fwd / _bwd, the kernel entry with its softmax statistics: output and
statistics (row max, row sum) against the fp64 reference, gradients against autograd, and the property ring attention
relies on: the backward of one key tile against the whole softmax's output and statistics is that tile's exact share
of the gradients."""
import importlib.util
import os

import pytest
import torch

from ds4sci.kernels import evoformer_attention
from ds4sci.kernels import evoformer_reference
from ds4sci.kernels.evoformer import evoformer_attention_bwd
from ds4sci.kernels.evoformer import evoformer_attention_fwd

HAS_TRITON = importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1"
BACKENDS = ["torch", "reference"] + (["triton"] if HAS_TRITON else [])
SHAPE, MASK, PAIR = (2, 3, 9, 2, 8), (2, 3, 1, 1, 9), (2, 1, 2, 9, 9)  # q [B, N, S, H, D], mask, pair


def _inputs(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(SHAPE, generator=g, dtype=torch.float64).to(dtype) for _ in range(4))
    mask = torch.where(torch.rand(MASK, generator=g) > 0.3, 0.0, -1e9).to(dtype)  # OpenFold's finite mask
    pair = torch.randn(PAIR, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, mask, pair, do


def _reference(q, k, v, mask, pair):
    """Output ``[B, N, S, H, D]`` and statistics ``[Z, N, H, S, 2]`` of the fp64 oracle."""
    b, n, s, h, d = q.shape
    canon = [t.double().reshape(b, n, s, h, d) for t in (q, k, v)]
    o, stats = evoformer_reference.forward(*canon, mask.double()[:, :, 0, 0, :], pair.double()[:, 0])
    return o.reshape(q.shape), stats


@pytest.mark.parametrize("backend", BACKENDS)
def test_output_and_statistics_match_the_reference(backend):
    dtype = torch.float32 if backend == "triton" else torch.float64
    q, k, v, mask, pair, _ = _inputs(dtype)
    o, stats = evoformer_attention_fwd(q, k, v, mask, pair, backend=backend)
    o_ref, stats_ref = _reference(q, k, v, mask, pair)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)
    assert o.shape == q.shape and stats.shape == (2, 3, 2, 9, 2) and not o.requires_grad
    torch.testing.assert_close(o.double(), o_ref, **tol)
    torch.testing.assert_close(stats[..., 0].double(), stats_ref[..., 0], **tol)  # row max
    torch.testing.assert_close(stats[..., 1].double(), stats_ref[..., 1], **tol)  # row sum
    # the differentiable public function's output (bitwise: the same kernel, but for the reference, run as torch)
    exact = dict(rtol=0, atol=0) if backend != "reference" else tol
    torch.testing.assert_close(o, evoformer_attention(q, k, v, [mask, pair], backend=backend), **exact)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_matches_autograd(backend):
    dtype = torch.float32 if backend == "triton" else torch.float64
    q, k, v, mask, pair, do = _inputs(dtype)
    leaves = [t.double().clone().requires_grad_() for t in (q, k, v, mask, pair)]
    evoformer_attention(*leaves[:3], leaves[3:], backend="reference").backward(do.double())
    o, stats = evoformer_attention_fwd(q, k, v, mask, pair, backend=backend)
    grads = evoformer_attention_bwd(do, q, k, v, o, stats, mask, pair, need_mask_grad=True, need_pair_grad=True,
                                    backend=backend)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-9, atol=1e-9)
    for name, got, leaf in zip(("dq", "dk", "dv", "dmask", "dpair"), grads, leaves):
        assert got.shape == leaf.shape and got.dtype == dtype, name
        torch.testing.assert_close(got.double(), leaf.grad, **tol, msg=name)
    dq, dk, dv, dmask, dpair = evoformer_attention_bwd(do, q, k, v, o, stats, mask, pair, backend=backend)
    assert dmask is None and dpair is None


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_tile_backward_against_the_whole_statistics_is_the_tiles_share(backend):
    """Keys in two tiles: each tile's backward against the whole softmax's output and statistics gives its keys'
    dk, dv, its columns of dpair, and a dq that sums over the tiles to the whole dq (ring attention's backward)."""
    q, k, v, mask, pair, do = _inputs()
    o, stats = evoformer_attention_fwd(q, k, v, mask, pair, backend=backend)
    whole = evoformer_attention_bwd(do, q, k, v, o, stats, mask, pair, need_pair_grad=True, backend=backend)
    dq = torch.zeros_like(q)
    for keys in (slice(0, 4), slice(4, 9)):
        # a tile of the keys is q against k[..., keys] of the same length: pad it with -inf keys to q's length
        width = keys.stop - keys.start
        k_t, v_t = (torch.cat([t[..., keys, :, :], torch.zeros_like(t[..., width:, :, :])], dim=-3) for t in (k, v))
        mask_t = torch.cat([mask[..., keys], torch.full_like(mask[..., width:], -torch.inf)], dim=-1)
        pair_t = torch.cat([pair[..., keys], torch.zeros_like(pair[..., width:])], dim=-1)
        dq_t, dk_t, dv_t, _, dpair_t = evoformer_attention_bwd(do, q, k_t, v_t, o, stats, mask_t, pair_t,
                                                               need_pair_grad=True, backend=backend)
        dq += dq_t
        torch.testing.assert_close(dk_t[..., :width, :, :], whole[1][..., keys, :, :], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(dv_t[..., :width, :, :], whole[2][..., keys, :, :], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(dpair_t[..., :width], whole[4][..., keys], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dq, whole[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_merged_statistics_of_two_key_tiles_are_the_whole_softmax(backend):
    """The 2-D ring's merge (``merge_stats``, the kernel's statistics given to ``merge_softmax``): two key tiles'
    outputs and statistics merge into the whole softmax's, also where one tile's keys are all masked with -inf (its
    rows have no key: statistics ``(+inf, +inf)``, weighing nothing)."""
    from ds4sci.parallel.evoformer.ring import merge_stats

    q, k, v, mask, pair, _ = _inputs()
    mask[0, 0, ..., :4] = -torch.inf  # (b 0, n 0): the first tile's keys all masked
    o, stats = evoformer_attention_fwd(q, k, v, mask, pair, backend=backend)
    parts = []
    for keys in (slice(0, 4), slice(4, 9)):  # padded to q's length with -inf keys, as above
        width = keys.stop - keys.start
        k_t, v_t = (torch.cat([t[..., keys, :, :], torch.zeros_like(t[..., width:, :, :])], dim=-3) for t in (k, v))
        mask_t = torch.cat([mask[..., keys], torch.full_like(mask[..., width:], -torch.inf)], dim=-1)
        pair_t = torch.cat([pair[..., keys], torch.zeros_like(pair[..., width:])], dim=-1)
        parts.append(evoformer_attention_fwd(q, k_t, v_t, mask_t, pair_t, backend=backend))
    assert bool(torch.isposinf(parts[0][1][0, 0]).all())
    merged, merged_stats = merge_stats(*parts[0], *parts[1])
    torch.testing.assert_close(merged, o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(merged_stats, stats, rtol=1e-10, atol=1e-10)


def test_bad_biases_and_statistics_are_refused():
    q, k, v, mask, pair, do = _inputs()
    with pytest.raises(ValueError, match=r"mask must be \[\*, N\|1, 1, 1, S\] of q's rank"):
        evoformer_attention_fwd(q, k, v, mask[0])
    with pytest.raises(ValueError, match=r"pair must be \[\*, 1, H, S, S\]"):
        evoformer_attention_fwd(q, k, v, None, pair.transpose(-1, -2)[..., :5])
    o, stats = evoformer_attention_fwd(q, k, v, mask, pair)
    with pytest.raises(ValueError, match=r"stats \[Z, N, H, S, 2\]"):
        evoformer_attention_bwd(do, q, k, v, o, stats[..., :1], mask, pair)
