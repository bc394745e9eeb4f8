"""Multi-process (gloo) tests of Ulysses, ring and Unified (Ulysses x Ring) attention.

Recipe: every rank builds the same full q, k, v (same seed), computes single-process attention and its
gradients as the reference, shards q, k, v (and document ids), runs DistributedAttention, and compares its
output and the gradients of its local q, k, v with the matching shard of the reference. Many cases share one
spawn (spawning costs seconds); each failure names its case.
"""
import functools

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from ds4sci.distributed import ParallelDims
from ds4sci.distributed.comm import CommCounter
from ds4sci.distributed.comm import all_to_all
from ds4sci.distributed.comm import group_rank
from ds4sci.distributed.comm import group_size
from ds4sci.distributed.groups import DeepSpeedMPU
from ds4sci.distributed.groups import build_groups
from ds4sci.kernels.local_attention import flex_attention
from ds4sci.kernels.local_attention import memory_efficient_attention
from ds4sci.kernels.local_reference import PAD_DOC_ID
from ds4sci.kernels.local_reference import sdpa_attention
from ds4sci.models.genslm import AttentionCore
from ds4sci.sequence import DistributedAttention
from ds4sci.sequence import Layout
from ds4sci.sequence import gather_sequence
from ds4sci.sequence import pad_to_multiple
from ds4sci.sequence import shard_sequence
from ds4sci.spawn import run_workers

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def _inputs(seed, B, S, H, Hkv, D, dtype, docs):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=gen, dtype=dtype)
    k = torch.randn(B, S, Hkv, D, generator=gen, dtype=dtype)
    v = torch.randn(B, S, Hkv, D, generator=gen, dtype=dtype)
    g = torch.randn(B, S, H, D, generator=gen, dtype=dtype)  # upstream gradient
    doc = None
    if docs:  # packed documents: ids increase along the sequence, several documents per row
        doc = (torch.rand(B, S, generator=gen) < 0.15).long().cumsum(1)
    return q, k, v, g, doc


def check_attention(label, local, ulysses, ring, *, layout="contiguous", B=2, S=16, H=4, Hkv=None, D=8,
                    dtype=torch.float64, docs=False, seed=0, grads=True, counter=None):
    """Compare DistributedAttention(local, ulysses, ring) with single-process ``local`` on full tensors."""
    Hkv = H if Hkv is None else Hkv
    q, k, v, g, doc = _inputs(seed, B, S, H, Hkv, D, dtype, docs)
    attn = DistributedAttention(local, ulysses, ring, layout=layout, counter=counter)

    index, count = _shard_index(ulysses, ring)

    def shard(x):
        return None if x is None else shard_sequence(x, 1, index, count, layout)

    ql, kl, vl = (shard(t).clone().requires_grad_(grads) for t in (q, k, v))
    out = attn(ql, kl, vl, q_doc=shard(doc), k_doc=shard(doc))
    tol = TOL[dtype]

    def close(actual, expected, what):
        torch.testing.assert_close(actual, expected, rtol=tol, atol=tol,
                                   msg=lambda m: f"[{label}] rank {dist.get_rank()} {what}: {m}")

    q.requires_grad_(grads), k.requires_grad_(grads), v.requires_grad_(grads)
    ref = local(q, k, v, q_doc=doc, k_doc=doc)
    close(out, shard(ref), "output")
    assert out.dtype == dtype, label
    if not grads:
        return
    ref_grads = torch.autograd.grad((ref * g).sum(), (q, k, v))
    got = torch.autograd.grad((out * shard(g)).sum(), (ql, kl, vl))
    for name, a, b in zip("qkv", got, ref_grads):
        close(a, shard(b), f"grad {name}")


SDPA = functools.partial(sdpa_attention)
CAUSAL = functools.partial(sdpa_attention, causal=True)
# The default local attention (chunked on the CPU), with ALiBi on global heads and several chunks per ring block.
ALIBI = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
CHUNKED = functools.partial(memory_efficient_attention, causal=True, alibi_slopes=ALIBI, chunk_size=3)


def _random_mask(S, H, seed):
    """A per-head explicit mask [1, H, S, S] on global indices (every row keeps its diagonal)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(1, H, S, S, generator=gen) < 0.5) | torch.eye(S, dtype=torch.bool)


def _expect_value_error(label, match, fn):
    try:
        fn()
    except ValueError as err:
        assert match in str(err), f"[{label}] error message {str(err)!r} lacks {match!r}"
        return str(err)
    raise AssertionError(f"[{label}] no ValueError")


# ---------------------------------------------------------------------------- world size 2
class _OpNames(TorchDispatchMode):
    """The names of the ops dispatched inside."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


def _worker_two(rank, world):
    W = dist.group.WORLD

    # all-to-all: [B, S/P, H, D] -> [B, S, H/P, D] is a permutation of the full tensor; backward the inverse.
    X = torch.randn(2, 8, 4, 3, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    Wt = torch.randn(2, 8, 4, 3, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    x = X[:, 4 * rank:4 * rank + 4].clone().requires_grad_()
    y = all_to_all(x, W, scatter_dim=2, gather_dim=1)
    torch.testing.assert_close(y, X[:, :, 2 * rank:2 * rank + 2], rtol=0, atol=0)
    (gx,) = torch.autograd.grad((y * Wt[:, :, 2 * rank:2 * rank + 2]).sum(), x)
    torch.testing.assert_close(gx, Wt[:, 4 * rank:4 * rank + 4], rtol=0, atol=0)

    # the inverse gather of both layouts
    for layout in ("contiguous", "zigzag"):
        counter = CommCounter()
        full = gather_sequence(shard_sequence(X, 1, rank, world, layout), 1, W, layout, counter=counter)
        torch.testing.assert_close(full, X, rtol=0, atol=0)
        assert counter.bytes_sent["all_gather"] == X.numel() // world * 8 * (world - 1)

    # Ulysses, P = 2
    check_attention("U2 causal", CAUSAL, W, None)
    check_attention("U2 full zigzag", SDPA, W, None, layout="zigzag")
    check_attention("U2 causal zigzag", CAUSAL, W, None, layout="zigzag")
    check_attention("U2 causal fp32", CAUSAL, W, None, dtype=torch.float32)
    check_attention("U2 GQA kv=2 split", CAUSAL, W, None, Hkv=2)
    check_attention("U2 MQA kv=1 replicated", CAUSAL, W, None, Hkv=1)
    check_attention("U2 docs", CAUSAL, W, None, docs=True)
    check_attention("U2 window", functools.partial(sdpa_attention, causal=True, window=5), W, None)
    check_attention("U2 explicit per-head mask", functools.partial(sdpa_attention, mask=_random_mask(16, 4, 1)),
                    W, None)
    # ring, R = 2
    for layout in ("contiguous", "zigzag"):
        for name, local in (("causal", CAUSAL), ("full", SDPA)):
            check_attention(f"R2 {name} {layout}", local, None, W, layout=layout)
    check_attention("R2 causal zigzag fp32", CAUSAL, None, W, layout="zigzag", dtype=torch.float32)
    check_attention("R2 MQA zigzag", CAUSAL, None, W, layout="zigzag", Hkv=1)
    check_attention("R2 docs", CAUSAL, None, W, docs=True)
    check_attention("R2 window+docs zigzag", functools.partial(sdpa_attention, causal=True, window=3), None, W,
                    layout="zigzag", docs=True, S=24)
    check_attention("R2 explicit mask", functools.partial(sdpa_attention, mask=_random_mask(16, 4, 2)), None, W)
    # the default path: chunked attention with ALiBi and packed documents, and GenSLM's own core
    check_attention("U2 chunked alibi docs GQA", CHUNKED, W, None, docs=True, Hkv=2)
    check_attention("R2 chunked alibi docs zigzag", CHUNKED, None, W, layout="zigzag", docs=True)
    check_attention("R2 GenSLM alibi core docs", AttentionCore(4, alibi=True).double(), None, W, docs=True)
    # FlexAttention through the ring (forward: no backward on the CPU)
    check_attention("R2 flex causal zigzag docs", functools.partial(flex_attention, causal=True, block_size=8),
                    None, W, layout="zigzag", docs=True, dtype=torch.float32, grads=False)

    # Ulysses moves 4 tensors of B*S*H*D/P elements per rank, (P-1)/P of each leaving the rank.
    counter = CommCounter()
    B, S, H, D, P = 2, 16, 4, 8, 2
    attn = DistributedAttention(CAUSAL, W, counter=counter, check_shapes=False)
    q = torch.randn(B, S // P, H, D, dtype=torch.float64, requires_grad=True)
    out = attn(q, q, q)
    per_tensor = B * S * H * D // P * 8
    assert counter.calls["all_to_all"] == 4, counter
    assert counter.bytes_sent["all_to_all"] == 4 * per_tensor * (P - 1) // P, counter
    assert counter.bytes_received["all_to_all"] == counter.bytes_sent["all_to_all"]
    out.sum().backward()  # backward: the inverse all-to-all of each, same volume again
    assert counter.calls["all_to_all"] == 8 and counter.bytes_sent["all_to_all"] == 8 * per_tensor * (P - 1) // P
    assert set(counter.calls) == {"all_to_all"}, counter

    # ring: R-1 rotations of k and v forward; backward R-1 of k, v and R of their gradients
    counter = CommCounter()
    attn = DistributedAttention(CAUSAL, None, W, counter=counter, check_shapes=False)
    x = torch.randn(B, S // P, H, D, dtype=torch.float64, requires_grad=True)
    attn(x, x, x).sum().backward()
    kv_bytes = 2 * x.numel() * 8
    assert counter.bytes_sent["p2p"] == (P - 1) * kv_bytes + (P - 1) * kv_bytes + P * kv_bytes, counter
    # the ring's backward recomputes each block on its pieces of q, k, v (zigzag: two per rank), so their gradients
    # are piece-sized: no gradient of a slice, whose backward makes a zero tensor of the whole local length
    attn = DistributedAttention(CHUNKED, None, W, layout="zigzag", check_shapes=False)
    out = attn(x, x, x)
    with _OpNames() as ops:
        out.sum().backward()
    assert "aten.slice_backward.default" not in ops.names and "aten.zeros_like.default" in ops.names, ops.names

    # heads that the Ulysses degree does not divide
    x = torch.randn(1, 4, 3, 8)
    _expect_value_error("U2 heads=3", "heads=3 (kv heads=3) cannot be split over the Ulysses degree 2",
                        lambda: DistributedAttention(CAUSAL, W)(x, x, x))
    # uneven shards (a length P does not divide, sharded by hand): an error on every rank, no hang
    y = torch.randn(1, 5 if rank == 0 else 4, 4, 8)
    _expect_value_error("U2 uneven", "ranks hold different local shapes",
                        lambda: DistributedAttention(CAUSAL, W)(y, y, y))
    _expect_value_error("R2 uneven", "ranks hold different local shapes",
                        lambda: DistributedAttention(CAUSAL, None, W)(y, y, y))
    # ... or padded and masked: S=10 padded to 12, padding in its own document
    check_padded(rank, W, None, S=10, layout="contiguous")
    check_padded(rank, None, W, S=10, layout="zigzag")
    return True


def _shard_index(ulysses, ring):
    """(shard this rank holds, number of shards): ``ring_rank * U + ulysses_rank`` of ``U * R``."""
    return group_rank(ring) * group_size(ulysses) + group_rank(ulysses), group_size(ulysses) * group_size(ring)


def check_padded(rank, ulysses, ring, S, layout, local=SDPA):
    """A length the shards do not divide: pad with PAD_DOC_ID documents; real rows equal the unpadded result."""
    attn = DistributedAttention(local, ulysses, ring, layout=layout)
    q, k, v, g, doc = _inputs(5, 2, S, 4, 4, 8, torch.float64, docs=True)
    for t in (q, k, v):
        t.requires_grad_()
    ref = local(q, k, v, q_doc=doc, k_doc=doc)
    ref_grads = torch.autograd.grad((ref * g).sum(), (q, k, v))
    index, count = _shard_index(ulysses, ring)
    multiple = Layout(layout).multiple(count)

    def shard(x, value=0):
        return shard_sequence(pad_to_multiple(x, 1, multiple, value), 1, index, count, layout)

    real = shard(torch.arange(S)[None].expand(2, S), -1)[0] >= 0  # [S_local] rows that are not padding
    ql, kl, vl = (shard(t.detach()).requires_grad_() for t in (q, k, v))
    d = shard(doc, PAD_DOC_ID)
    out = attn(ql, kl, vl, q_doc=d, k_doc=d)
    got = torch.autograd.grad((out * shard(g)).sum(), (ql, kl, vl))
    label = f"padded S={S} {layout} U={attn.ulysses_size} R={attn.ring_size}"
    torch.testing.assert_close(out[:, real], shard(ref)[:, real], rtol=1e-10, atol=1e-10, msg=lambda m: f"{label}: {m}")
    for a, b in zip(got, ref_grads):
        torch.testing.assert_close(a[:, real], shard(b)[:, real], rtol=1e-10, atol=1e-10,
                                   msg=lambda m: f"{label} grad: {m}")


@pytest.mark.distributed
def test_sequence_parallel_world_2():
    assert run_workers(_worker_two, 2) == [True, True]


# ---------------------------------------------------------------------------- world size 4
def _worker_four(rank, world):
    W = dist.group.WORLD

    # groups: dp=1 x ulysses=2 x ring=2, and dp=2 x ulysses=2 x ring=1
    usp = build_groups(ParallelDims(dp=1, ulysses=2, ring=2))
    ranks = dist.get_process_group_ranks
    assert ranks(usp.ulysses) == [rank // 2 * 2, rank // 2 * 2 + 1]
    assert ranks(usp.ring) == [rank % 2, rank % 2 + 2]
    assert ranks(usp.sp) == [0, 1, 2, 3] and ranks(usp.sdp) == [0, 1, 2, 3] and ranks(usp.dp) == [rank]
    assert usp.sp_rank == rank
    dpg = build_groups(ParallelDims(dp=2, ulysses=2, ring=1))
    mpu = DeepSpeedMPU(dpg)
    assert ranks(mpu.get_sequence_parallel_group()) == [rank // 2 * 2, rank // 2 * 2 + 1]
    assert (mpu.get_sequence_parallel_world_size(), mpu.get_sequence_parallel_rank()) == (2, rank % 2)
    assert ranks(mpu.get_data_parallel_group()) == [rank % 2, rank % 2 + 2]
    assert (mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()) == (2, rank // 2)
    assert mpu.get_data_parallel_group_ranks() == [rank % 2, rank % 2 + 2]
    assert ranks(mpu.get_sequence_data_parallel_group()) == [0, 1, 2, 3]
    assert (mpu.get_sequence_data_parallel_world_size(), mpu.get_sequence_data_parallel_rank()) == (4, rank)
    assert (mpu.get_model_parallel_world_size(), mpu.get_model_parallel_rank()) == (1, 0)
    assert ranks(mpu.get_model_parallel_group()) == [rank]
    tpg = build_groups(ParallelDims(dp=1, ulysses=2, tp=2))  # tensor pairs innermost, ZeRO per tensor rank
    mpu = DeepSpeedMPU(tpg)
    assert ranks(mpu.get_model_parallel_group()) == [rank // 2 * 2, rank // 2 * 2 + 1]
    assert (mpu.get_model_parallel_world_size(), mpu.get_model_parallel_rank()) == (2, rank % 2)
    assert ranks(mpu.get_sequence_data_parallel_group()) == [rank % 2, rank % 2 + 2]
    assert (mpu.get_sequence_data_parallel_world_size(), mpu.get_sequence_data_parallel_rank()) == (2, rank // 2)
    assert ranks(tpg.ulysses) == ranks(tpg.sp) == [rank % 2, rank % 2 + 2] and tpg.sp_rank == rank // 2
    _expect_value_error("groups mismatch", "world_size=8",
                        lambda: build_groups(ParallelDims(dp=2, ulysses=2, ring=2)))

    # Ulysses, P = 4
    check_attention("U4 causal", CAUSAL, W, None)
    check_attention("U4 full zigzag fp32", SDPA, W, None, layout="zigzag", dtype=torch.float32)
    check_attention("U4 GQA kv=2 replicated", CAUSAL, W, None, Hkv=2)
    check_attention("U4 docs zigzag", CAUSAL, W, None, layout="zigzag", docs=True)
    # ring, R = 4
    for layout in ("contiguous", "zigzag"):
        for name, local in (("causal", CAUSAL), ("full", SDPA)):
            check_attention(f"R4 {name} {layout}", local, None, W, layout=layout)
    check_attention("R4 causal fp32", CAUSAL, None, W, dtype=torch.float32)
    check_attention("R4 window+docs zigzag", functools.partial(sdpa_attention, causal=True, window=4), None, W,
                    layout="zigzag", docs=True)
    # Unified 2 x 2
    U, R = usp.ulysses, usp.ring
    for layout in ("contiguous", "zigzag"):
        check_attention(f"USP2x2 causal {layout}", CAUSAL, U, R, layout=layout)
    check_attention("USP2x2 full", SDPA, U, R)
    check_attention("USP2x2 causal zigzag fp32", CAUSAL, U, R, layout="zigzag", dtype=torch.float32)
    check_attention("USP2x2 GQA kv=2 split", CAUSAL, U, R, layout="zigzag", Hkv=2)
    check_attention("USP2x2 MQA kv=1 replicated", CAUSAL, U, R, Hkv=1)
    check_attention("USP2x2 docs+window zigzag", functools.partial(sdpa_attention, causal=True, window=6), U, R,
                    layout="zigzag", docs=True)
    check_attention("USP2x2 explicit per-head mask", functools.partial(sdpa_attention, mask=_random_mask(16, 4, 3)),
                    U, R)
    # heads=2 at P=4: Ulysses 4 cannot split them; Ulysses 2 x ring 2 can
    check_attention("USP2x2 heads=2", CAUSAL, U, R, layout="zigzag", H=2)
    check_attention("USP2x2 heads=2 kv=1", CAUSAL, U, R, H=2, Hkv=1)
    x = torch.randn(1, 4, 2, 8)
    _expect_value_error("U4 heads=2", "heads=2 (kv heads=2) cannot be split over the Ulysses degree 4 (ring degree 1)",
                        lambda: DistributedAttention(CAUSAL, W)(x, x, x))
    _expect_value_error("sp group as ulysses group", "pass SequenceParallelGroups.ulysses as ulysses_group",
                        lambda: DistributedAttention(CAUSAL, usp.sp, usp.ring))
    check_padded(rank, U, R, S=13, layout="zigzag", local=CHUNKED)
    check_attention("USP2x2 chunked alibi docs+window zigzag GQA",
                    functools.partial(CHUNKED, window=6), U, R, layout="zigzag", docs=True, Hkv=2)

    # Ulysses volume per rank: 4 tensors of B*S*H*D/P elements, (P-1)/P leaving; the tensors are the same size
    # when S and P grow together (S=16 at P=2 on the dp=2 groups, S=32 at P=4).
    B, H, D = 1, 4, 8
    volumes = {}
    for P, S, group in ((2, 16, dpg.ulysses), (4, 32, W)):
        counter = CommCounter()
        x = torch.randn(B, S // P, H, D, dtype=torch.float32)
        DistributedAttention(CAUSAL, group, counter=counter, check_shapes=False)(x, x, x)
        per_tensor = B * S * H * D // P * 4
        assert counter.calls["all_to_all"] == 4
        assert counter.bytes_sent["all_to_all"] == 4 * per_tensor * (P - 1) // P, (P, counter)
        volumes[P] = counter.bytes_sent["all_to_all"] * P // (P - 1)  # bytes handed to the all-to-all
    assert volumes[2] == volumes[4] == 4 * B * 8 * H * D * 4, volumes
    return True


@pytest.mark.distributed
def test_sequence_parallel_world_4():
    assert run_workers(_worker_four, 4) == [True] * 4


# ---------------------------------------------------------------------------- DeepSpeed agreement
def _worker_deepspeed(rank, world):
    from deepspeed.sequence.layer import DistributedAttention as DSDistributedAttention

    from ds4sci.train.engine import init_distributed

    init_distributed()
    W = dist.group.WORLD
    results = []
    for causal, H in ((True, 4), (False, 2)):
        local = functools.partial(sdpa_attention, causal=causal)
        q, k, v, g, _ = _inputs(11, 2, 16, H, H, 8, torch.float64, docs=False)
        ours = DistributedAttention(local, W)
        theirs = DSDistributedAttention(lambda a, b, c: local(a, b, c), W, scatter_idx=2, gather_idx=1)
        outs = []
        for module, call in ((ours, lambda m, a, b, c: m(a, b, c)), (theirs, lambda m, a, b, c: m(a, b, c, 0))):
            ql, kl, vl = (shard_sequence(t, 1, rank, world).clone().requires_grad_() for t in (q, k, v))
            out = call(module, ql, kl, vl)
            grads = torch.autograd.grad((out * shard_sequence(g, 1, rank, world)).sum(), (ql, kl, vl))
            outs.append((out, *grads))
        for a, b in zip(*outs):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        results.append(max(float((a - b).detach().abs().max()) for a, b in zip(*outs)))
    return results


@pytest.mark.distributed
@pytest.mark.slow
def test_agrees_with_deepspeed_distributed_attention():
    diffs = run_workers(_worker_deepspeed, 2, env={"DS_ACCELERATOR": "cpu"})
    assert all(d <= 1e-12 for per_rank in diffs for d in per_rank), diffs
