"""Single-process tests of ds4sci.sequence: dims validation, group layout, sharding, local attentions, merging."""
import functools
import math

import pytest
import torch

from ds4sci.sequence import (
    PAD_DOC_ID,
    CommCounter,
    DistributedAttention,
    ParallelDims,
    all_to_all,
    attention_mask,
    flash_causal_mode,
    flex_attention,
    pad_to_multiple,
    sdpa_attention,
    shard_positions,
    shard_sequence,
    unshard_sequence,
)
from ds4sci.sequence.attention import _merge


# ---------------------------------------------------------------- ParallelDims
def test_parallel_dims_valid():
    dims = ParallelDims(dp=2, ulysses=2, ring=3, world_size=12)
    assert dims.sp == 6
    assert dims.coords(0) == (0, 0, 0)
    assert dims.coords(7) == (1, 0, 1)  # 7 = 1*6 + 0*2 + 1
    assert dims.coords(11) == (1, 2, 1)


def test_parallel_dims_product_mismatch_names_numbers():
    with pytest.raises(ValueError, match=r"dp=2 x ulysses=2 x ring=2 = 8, but world_size=10"):
        ParallelDims(dp=2, ulysses=2, ring=2, world_size=10)


@pytest.mark.parametrize("field", ["dp", "ulysses", "ring", "world_size"])
def test_parallel_dims_rejects_non_positive(field):
    kwargs = dict(dp=1, ulysses=1, ring=1, world_size=1)
    kwargs[field] = 0
    with pytest.raises(ValueError, match=f"{field}=0"):
        ParallelDims(**kwargs)


def test_parallel_dims_rejects_non_int():
    with pytest.raises(TypeError, match="ulysses"):
        ParallelDims(dp=1, ulysses=2.0, ring=1, world_size=2)
    with pytest.raises(TypeError, match="ring"):
        ParallelDims(dp=1, ulysses=1, ring=True, world_size=1)


def test_group_ranks_layout():
    groups = ParallelDims(dp=2, ulysses=2, ring=2, world_size=8).group_ranks()
    assert groups["sp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # contiguous, as DeepSpeed's parallel_state_sp
    assert groups["ulysses"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["ring"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["sdp"] == [list(range(8))]
    # every rank is in exactly one group of each kind
    for kind, lists in groups.items():
        assert sorted(r for ranks in lists for r in ranks) == list(range(8)), kind


# ---------------------------------------------------------------- sharding
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_unshard_roundtrip(layout, world):
    S = 24
    x = torch.randn(2, S, 3)
    shards = [shard_sequence(x, 1, r, world, layout) for r in range(world)]
    assert all(s.shape == (2, S // world, 3) for s in shards)
    torch.testing.assert_close(unshard_sequence(shards, 1, layout), x, rtol=0, atol=0)
    positions = torch.cat([shard_positions(S, r, world, layout) for r in range(world)])
    assert sorted(positions.tolist()) == list(range(S))
    for r in range(world):  # positions follow the tokens
        pos = shard_positions(S, r, world, layout)
        torch.testing.assert_close(shards[r], x[:, pos], rtol=0, atol=0)


def test_zigzag_chunks():
    # S=16, W=2: 4 chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert shard_positions(16, 0, 2, "zigzag").tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert shard_positions(16, 1, 2, "zigzag").tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def test_shard_errors():
    x = torch.zeros(1, 10, 2)
    with pytest.raises(ValueError, match=r"sequence length 10 .* not divisible by 4"):
        shard_sequence(x, 1, 0, 4)
    with pytest.raises(ValueError, match=r"not divisible by 8 \(zigzag"):
        shard_sequence(torch.zeros(1, 12, 2), 1, 0, 4, "zigzag")
    with pytest.raises(ValueError, match="layout='striped'"):
        shard_sequence(x, 1, 0, 2, "striped")
    with pytest.raises(ValueError, match="rank=2"):
        shard_sequence(x, 1, 2, 2)


def test_pad_to_multiple():
    doc = torch.tensor([[3, 3, 4, 4, 4]])
    padded = pad_to_multiple(doc, 1, 4, PAD_DOC_ID)
    assert padded.tolist() == [[3, 3, 4, 4, 4, -1, -1, -1]]
    assert pad_to_multiple(doc, 1, 5) is doc


# ---------------------------------------------------------------- local attention
def naive_attention(q, k, v, visible):
    """Independent oracle: fp64 loops-free softmax with a [B, H, Sq, Sk] boolean visibility."""
    B, Sq, H, D = q.shape
    rep = H // k.shape[2]
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)))
    logits = qd @ kd.transpose(-1, -2) / math.sqrt(D)
    logits = logits.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(logits, -1)
    probs = torch.nan_to_num(torch.exp(logits - lse[..., None]), nan=0.0)
    return (probs @ vd).transpose(1, 2), lse


def global_visible(Sq, Sk, qo, ko, B, H, causal=False, window=None, q_doc=None, k_doc=None, mask=None, ho=0):
    vis = torch.ones(B, H, Sq, Sk, dtype=torch.bool)
    for a in range(Sq):
        for b in range(Sk):
            i, j = qo + a, ko + b
            ok = True
            if causal and j > i:
                ok = False
            if window is not None and abs(i - j) >= window:
                ok = False
            if not ok:
                vis[:, :, a, b] = False
    if q_doc is not None:
        vis &= (q_doc[:, None, :, None] == k_doc[:, None, None, :])
    if mask is not None:
        m = mask[..., qo:qo + Sq, ko:ko + Sk]
        vis &= m[:, ho:ho + H] if m.dim() == 4 and m.shape[1] > 1 else m
    return vis


CASES = [
    dict(causal=False),
    dict(causal=True),
    dict(causal=True, window=3),
    dict(causal=False, window=4),
    dict(causal=True, docs=True),
    dict(causal=False, mask=True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("offsets", [(0, 0), (8, 3), (5, 9)])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_sdpa_attention_matches_oracle(case, offsets, kv_heads):
    torch.manual_seed(0)
    B, Sq, Sk, H, D, S = 2, 7, 6, 4, 8, 20
    qo, ko = offsets
    q = torch.randn(B, Sq, H, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Sk, kv_heads, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, Sk, kv_heads, D, dtype=torch.float64, requires_grad=True)
    kw = dict(causal=case.get("causal", False), window=case.get("window"))
    q_doc = k_doc = mask = None
    if case.get("docs"):
        doc = torch.randint(0, 2, (B, S)).cumsum(1)
        q_doc, k_doc = doc[:, qo:qo + Sq], doc[:, ko:ko + Sk]
    if case.get("mask"):
        mask = torch.rand(1, 8, S, S) > 0.4
    vis = global_visible(Sq, Sk, qo, ko, B, H, q_doc=q_doc, k_doc=k_doc, mask=mask, ho=2, **kw)
    ref_out, ref_lse = naive_attention(q, k, v, vis)
    common = dict(q_offset=qo, k_offset=ko, head_offset=2, q_doc=q_doc, k_doc=k_doc, mask=mask, **kw)
    out_fast = sdpa_attention(q, k, v, **common)
    out, lse = sdpa_attention(q, k, v, return_lse=True, **common)
    torch.testing.assert_close(out_fast, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)
    assert lse.dtype == torch.float64
    if not vis.any():
        return
    g = torch.randn_like(ref_out)
    ref_grads = torch.autograd.grad((ref_out * g).sum(), (q, k, v))
    for o in (out_fast, out):
        grads = torch.autograd.grad((o * g).sum(), (q, k, v), retain_graph=True)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-11)
            assert torch.isfinite(a).all()


def test_sdpa_attention_empty_rows_and_blocks():
    q = torch.randn(1, 4, 2, 8)
    k = torch.randn(1, 4, 2, 8)
    out, lse = sdpa_attention(q, k, k, q_offset=0, k_offset=4, causal=True, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all() and lse.dtype == torch.float32
    # queries 0..3 against keys 2..5: rows 0 and 1 see nothing
    out, lse = sdpa_attention(q, k, k, q_offset=0, k_offset=2, causal=True, return_lse=True)
    assert (out[:, :2] == 0).all() and torch.isneginf(lse[..., :2]).all() and torch.isfinite(lse[..., 2:]).all()
    torch.testing.assert_close(sdpa_attention(q, k, k, q_offset=0, k_offset=2, causal=True), out)


def test_attention_mask_errors():
    with pytest.raises(ValueError, match="window=0"):
        attention_mask(4, 4, window=0)
    with pytest.raises(ValueError, match="does not cover"):
        attention_mask(4, 4, q_offset=6, mask=torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="must be bool"):
        attention_mask(4, 4, mask=torch.ones(8, 8))
    with pytest.raises(ValueError, match="multiple of key/value heads 3"):
        sdpa_attention(torch.randn(1, 4, 4, 8), torch.randn(1, 4, 3, 8), torch.randn(1, 4, 3, 8))


def test_lse_merge_over_key_blocks_equals_full():
    """Online-softmax merging of key blocks (ring attention's forward) reproduces attention over all keys."""
    torch.manual_seed(1)
    B, S, H, D = 1, 12, 2, 4
    q, k, v = (torch.randn(B, S, H, D, dtype=torch.float64) for _ in range(3))
    ref, ref_lse = sdpa_attention(q, k, v, causal=True, return_lse=True)
    out = torch.zeros_like(q)
    lse = torch.full((B, H, S), -math.inf, dtype=torch.float64)
    for start in (8, 0, 4):  # any order
        o, l = sdpa_attention(q, k[:, start:start + 4], v[:, start:start + 4], k_offset=start, causal=True,
                              return_lse=True)
        out, lse = _merge(out, lse, o, l)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-13)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-13)


@pytest.mark.parametrize("case", [dict(causal=True), dict(causal=True, window=5), dict(docs=True)],
                         ids=["causal", "window", "docs"])
def test_flex_attention_forward_matches_sdpa(case):
    torch.manual_seed(2)
    B, H, D = 2, 4, 8
    q = torch.randn(B, 8, H, D)
    k, v = torch.randn(B, 12, 2, D), torch.randn(B, 12, 2, D)
    q_doc = k_doc = None
    if case.get("docs"):
        doc = torch.randint(0, 2, (B, 20)).cumsum(1)
        q_doc, k_doc = doc[:, 8:16], doc[:, 2:14]
    kw = dict(q_offset=8, k_offset=2, q_doc=q_doc, k_doc=k_doc, causal=case.get("causal", False),
              window=case.get("window"), return_lse=True)
    out, lse = flex_attention(q, k, v, block_size=8, **kw)
    ref, ref_lse = sdpa_attention(q, k, v, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)


def test_flex_attention_backward_on_cpu_is_unsupported():
    q = torch.randn(1, 8, 2, 8, requires_grad=True)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        flex_attention(q, q.detach(), q.detach(), causal=True, block_size=8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention backward needs a GPU (CPU raises)")
def test_flex_attention_gradients_match_sdpa_on_gpu():
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 64, 2, 16, device="cuda", requires_grad=True) for _ in range(3))
    g = torch.randn(1, 64, 2, 16, device="cuda")
    grads = torch.autograd.grad((flex_attention(q, k, v, causal=True, window=9) * g).sum(), (q, k, v))
    ref = torch.autograd.grad((sdpa_attention(q, k, v, causal=True, window=9) * g).sum(), (q, k, v))
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_flash_causal_mode():
    assert flash_causal_mode(0, 4, 4, 4) == "empty"
    assert flash_causal_mode(8, 4, 0, 8) == "full"
    assert flash_causal_mode(4, 4, 4, 4) == "causal"
    assert flash_causal_mode(4, 4, 0, 8) == "causal"
    assert flash_causal_mode(0, 8, 0, 4) == "unsupported"


# ---------------------------------------------------------------- world size 1
def test_world_size_one_passes_through():
    counter = CommCounter()
    x = torch.randn(2, 6, 4, 3, requires_grad=True)
    assert all_to_all(x, None, 2, 1, counter) is x
    attn = DistributedAttention(functools.partial(sdpa_attention, causal=True), None, counter=counter)
    out = attn(x, x, x)
    torch.testing.assert_close(out, sdpa_attention(x, x, x, causal=True))
    assert counter.total_sent() == 0 and not counter.calls
    assert (attn.shard_rank, attn.shard_world) == (0, 1)


def test_heads_error_names_everything():
    with pytest.raises(ValueError, match="heads=3 is not a multiple of kv heads=2"):
        DistributedAttention(sdpa_attention, None)(torch.randn(1, 4, 3, 2), torch.randn(1, 4, 2, 2),
                                                   torch.randn(1, 4, 2, 2))
