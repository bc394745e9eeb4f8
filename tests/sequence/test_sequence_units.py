"""Single-process tests of ds4sci.sequence: sharding, local attentions, merging."""
import functools
import math

import pytest
import torch

from ds4sci.distributed.comm import CommCounter
from ds4sci.distributed.comm import all_to_all
from ds4sci.kernels.local_chunked import chunked_attention
from ds4sci.kernels.local_reference import PAD_DOC_ID
from ds4sci.kernels.local_reference import sdpa_attention
from ds4sci.sequence import DistributedAttention
from ds4sci.sequence import merge_attention
from ds4sci.sequence import merge_softmax
from ds4sci.sequence import pad_to_multiple
from ds4sci.sequence import shard_positions
from ds4sci.sequence import shard_sequence
from ds4sci.sequence import unshard_sequence


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


LOCALS = {
    "sdpa": functools.partial(sdpa_attention, causal=True),
    # the default local attention, with ALiBi and several chunks per block
    "chunked alibi": functools.partial(chunked_attention, causal=True, chunk_size=3,
                                       alibi_slopes=torch.tensor([0.5, 0.25], dtype=torch.float64)),
}


@pytest.mark.parametrize("name", list(LOCALS))
def test_lse_merge_over_key_blocks_equals_full(name):
    """Online-softmax merging of key blocks (ring attention's forward) reproduces attention over all keys, and
    backpropagating through the merge (through every block's lse, as ring attention's backward does) gives the
    full attention's gradients."""
    local = LOCALS[name]
    torch.manual_seed(1)
    B, S, H, D = 1, 12, 2, 4
    q, k, v = (torch.randn(B, S, H, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    doc = torch.tensor([[0] * 5 + [1] * 4 + [PAD_DOC_ID] * 3])
    ref, ref_lse = local(q, k, v, q_doc=doc, k_doc=doc, return_lse=True)
    out = torch.zeros_like(q)
    lse = torch.full((B, H, S), -math.inf, dtype=torch.float64)
    for start in (8, 0, 4):  # any order
        o, l = local(q, k[:, start:start + 4], v[:, start:start + 4], k_offset=start, q_doc=doc,
                     k_doc=doc[:, start:start + 4], return_lse=True)
        out, lse = merge_attention(out, lse, o, l)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-13)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-13)
    g = torch.randn_like(ref)
    want = torch.autograd.grad((ref * g).sum(), (q, k, v))
    got = torch.autograd.grad((out * g).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_merge_attention_takes_any_leading_dims():
    """``merge_attention`` on ``[Z, N, S, H, D]`` (the Evoformer's layout) equals the merge of each ``[N, S, H, D]``
    slice; rows no key reached (``lse = -inf`` on both sides) stay ``out = 0, lse = -inf``."""
    torch.manual_seed(2)
    Z, N, S, H, D = 2, 3, 5, 2, 4
    out, block = torch.randn(Z, N, S, H, D), torch.randn(Z, N, S, H, D)
    lse, block_lse = torch.randn(Z, N, H, S), torch.randn(Z, N, H, S)
    lse[..., 0] = block_lse[..., 0] = -math.inf
    out[..., 0, :, :] = 0
    merged, merged_lse = merge_attention(out, lse, block, block_lse)
    for z in range(Z):
        o, m = merge_attention(out[z], lse[z], block[z], block_lse[z])
        torch.testing.assert_close(merged[z], o, rtol=0, atol=0)
        torch.testing.assert_close(merged_lse[z], m, rtol=0, atol=0)
    assert bool((merged[..., 0, :, :] == 0).all()) and bool(torch.isneginf(merged_lse[..., 0]).all())
    weight = torch.sigmoid(lse - block_lse).transpose(-1, -2).unsqueeze(-1)  # [Z, N, S, H, 1]: e^a / (e^a + e^b)
    torch.testing.assert_close(merged[..., 1:, :, :], (weight * out + (1 - weight) * block)[..., 1:, :, :])
    torch.testing.assert_close(merged_lse[..., 1:], torch.logaddexp(lse, block_lse)[..., 1:])


def test_merge_softmax_keeps_max_and_sum_apart_under_a_finite_mask():
    """Two fp32 blocks whose row maxima sit near OpenFold's finite mask bias ``-1e9`` (every key masked) and whose row
    sums are 1 and 3 weigh 1/4 and 3/4, as the key counts say; their log-sum-exps would round to the same number
    (fp32's spacing there is 64) and weigh 1/2 each."""
    out, block = torch.zeros(1, 1, 1, 2), torch.ones(1, 1, 1, 2)  # [B, S, H, D]
    top = torch.full((1, 1, 1), -1e9)  # [B, H, S]
    merged, row_max, row_sum = merge_softmax(out, top, torch.ones(1, 1, 1), block, top, torch.full((1, 1, 1), 3.0))
    torch.testing.assert_close(merged, torch.full((1, 1, 1, 2), 0.75))
    assert (row_max.item(), row_sum.item()) == (-1e9, 4.0)
    assert (top + math.log(1.0)).item() == (top + math.log(3.0)).item()  # what a log-sum-exp would have kept
    empty = torch.full((1, 1, 1), -math.inf)
    merged, row_max, row_sum = merge_softmax(out, empty, 0.0, block, empty, 0.0)  # no key on either side
    assert bool((merged == 0).all()) and row_max.item() == -math.inf and row_sum.item() == 0


# ---------------------------------------------------------------- world size 1
def test_world_size_one_passes_through():
    counter = CommCounter()
    x = torch.randn(2, 6, 4, 3, requires_grad=True)
    assert all_to_all(x, None, 2, 1, counter) is x
    attn = DistributedAttention(functools.partial(sdpa_attention, causal=True), None, counter=counter)
    out = attn(x, x, x)
    torch.testing.assert_close(out, sdpa_attention(x, x, x, causal=True))
    assert counter.total_sent() == 0 and not counter.calls


def test_heads_error_names_everything():
    with pytest.raises(ValueError, match="heads=3 is not a multiple of kv heads=2"):
        DistributedAttention(sdpa_attention, None)(torch.randn(1, 4, 3, 2), torch.randn(1, 4, 2, 2),
                                                   torch.randn(1, 4, 2, 2))
