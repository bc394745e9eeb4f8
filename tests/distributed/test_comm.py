"""ds4sci.distributed.comm: every collective's values, gradients and counted bytes, one process and on gloo.

Multi-process recipe: every rank builds the same full tensors (same seed), runs the collective on its piece and
compares with what one process computes from the full tensors; the cases share one spawn.
"""
import pytest
import torch
import torch.distributed as dist

from ds4sci.distributed.comm import CommCounter
from ds4sci.distributed.comm import RingShift
from ds4sci.distributed.comm import all_gather
from ds4sci.distributed.comm import all_reduce
from ds4sci.distributed.comm import all_to_all
from ds4sci.distributed.comm import group_rank
from ds4sci.distributed.comm import group_size
from ds4sci.distributed.comm import move
from ds4sci.distributed.comm import nbytes
from ds4sci.distributed.comm import reduce_from_tensor_region
from ds4sci.distributed.comm import reduce_scatter
from ds4sci.distributed.comm import reduce_scatter_sequence_region
from ds4sci.distributed.comm import send_recv
from ds4sci.distributed.comm import split
from ds4sci.distributed.comm import split_sequence_region
from ds4sci.distributed.comm import sync_grad
from ds4sci.spawn import run_workers


def test_a_missing_group_is_one_rank_and_collectives_pass_through():
    counter = CommCounter()
    x = torch.randn(2, 6, 4, requires_grad=True)
    assert (group_size(None), group_rank(None)) == (1, 0)
    for y in (all_gather(x, None, 1, counter), all_to_all(x, None, 2, 1, counter),
              reduce_scatter_sequence_region(x, None, 1, counter), split_sequence_region(x, None, 1, counter),
              reduce_from_tensor_region(x, None, counter), sync_grad(x, None, counter)):
        assert y is x
    assert not counter.calls and counter.total_sent() == counter.total_received() == 0


def test_counter_sums_bytes_and_calls_per_kind():
    counter = CommCounter()
    counter.record("p2p", 8, 8)
    counter.record("p2p", 4, 4)
    counter.record("all_gather", 3, 6)
    assert counter.calls == {"p2p": 2, "all_gather": 1}
    assert (counter.total_sent(), counter.total_received()) == (15, 18)
    counter.reset()
    assert not counter.calls and counter.total_sent() == 0
    assert nbytes(torch.zeros(3, 5, dtype=torch.float64)) == 120
    assert nbytes(torch.zeros(4, 4)[:, :2]) == 32  # the elements, not the storage


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-12,
                               msg=lambda m: f"rank {dist.get_rank()} {what}: {m}")


def _worker(rank, world):
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(2, 4 * world, 3, generator=gen, dtype=torch.float64) for _ in range(world)]  # rank r's x
    mine, total = full[rank], sum(full)
    e = mine.element_size()

    # plain collectives: values and bytes
    counter = CommCounter()
    for dim in (0, 1, -1):
        gathered = all_gather(mine, group, dim, counter)
        _close(gathered, torch.cat(full, dim=dim), f"all_gather dim {dim}")
        assert gathered.is_contiguous(), dim
    assert counter.bytes_sent["all_gather"] == 3 * mine.numel() * e * (world - 1)
    piece = reduce_scatter(mine, group, 1, counter)
    _close(piece, total.chunk(world, 1)[rank], "reduce_scatter")
    assert counter.bytes_sent["reduce_scatter"] == mine.numel() * e * (world - 1) // world
    summed = all_reduce(mine, group, counter)
    _close(summed, total, "all_reduce")
    assert summed is not mine and torch.equal(mine, full[rank])  # not in place
    assert counter.bytes_sent["all_reduce"] == 2 * mine.numel() * e * (world - 1) // world
    own = split(mine, group, 1)
    _close(own, mine.chunk(world, 1)[rank], "split")
    assert own.untyped_storage().data_ptr() != mine.untyped_storage().data_ptr()  # a copy, not a view
    with pytest.raises(ValueError, match="not divisible by the group size"):
        reduce_scatter(torch.zeros(2, 2 * world + 1), group, 1)

    # differentiable ones: backward is the adjoint
    x = mine.clone().requires_grad_()
    g = torch.randn(2, 4, 3, generator=gen, dtype=torch.float64)  # the same upstream gradient on every rank
    (reduce_scatter_sequence_region(x, group, 1) * g).sum().backward()
    _close(x.grad, torch.cat([g] * world, dim=1), "reduce_scatter_sequence_region backward")  # every rank's g
    x.grad = None
    (split_sequence_region(x, group, 1) * g).sum().backward()
    _close(x.grad, torch.cat([g] * world, dim=1), "split_sequence_region backward")
    x.grad = None
    (reduce_from_tensor_region(x, group) * mine).sum().backward()
    _close(x.grad, mine, "reduce_from_tensor_region backward (identity)")
    x.grad = None
    (sync_grad(x, group) * mine).sum().backward()
    _close(x.grad, total, "sync_grad backward (summed)")
    x.grad = None
    heads = torch.randn(2, 4, 2 * world, 3, generator=gen, dtype=torch.float64).requires_grad_()  # [B, s, H, D]
    seq = all_to_all(heads, group, 2, 1)  # [B, P s, H/P, D]
    assert seq.shape == (2, 4 * world, 2, 3)
    assert torch.equal(all_to_all(seq, group, 1, 2), heads)

    # point to point
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    counter.reset()
    received = RingShift([mine, mine[:, :1]], group, counter, tag=3).wait()
    _close(received[0], full[prev], "RingShift")
    _close(received[1], full[prev][:, :1], "RingShift second tensor")
    assert counter.bytes_sent["p2p"] == nbytes(mine) + nbytes(mine[:, :1])
    _close(send_recv(mine, nxt, prev, group), full[prev], "send_recv")
    assert send_recv(mine, rank, rank, group) is mine
    moved = move(x, nxt, prev, group)
    _close(moved, full[prev], "move")
    (moved * full[prev]).sum().backward()
    _close(x.grad, mine, "move backward: the gradient goes back to its tensor's rank")
    return True


@pytest.mark.distributed
def test_collectives_on_gloo():
    assert run_workers(_worker, 3) == [True] * 3
