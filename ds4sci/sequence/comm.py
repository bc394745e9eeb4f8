"""Communication primitives of sequence parallelism, with byte accounting.

- :func:`all_to_all`: differentiable all-to-all (``torch.autograd.Function``) whose backward is the inverse
  all-to-all; the Ulysses layout switch ``[B, S/P, H, D] <-> [B, S, H/P, D]`` (Jacobs et al. 2023,
  "DeepSpeed Ulysses"). Built on ``all_to_all_single`` with equal splits, which gloo, NCCL and MPI all implement
  (gloo's list form ``all_to_all`` rejects it here: "input and output tensors must have the same size").
- :class:`RingShift`: asynchronous send to the next ring rank and receive from the previous one (ring
  attention's key/value rotation, Liu et al. 2023, "Ring Attention with Blockwise Transformers").
- :func:`all_gather_seq`: non-differentiable all-gather along a dim (document ids, shape checks).
- :class:`CommCounter`: bytes each rank sends and receives, per collective kind.

Each primitive is a pass-through (no communication, nothing recorded) when the group has one rank.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["CommCounter", "all_to_all", "RingShift", "all_gather_seq", "group_size", "group_rank"]


def group_size(group: dist.ProcessGroup | None) -> int:
    """World size of ``group``; 1 for ``None`` (no parallelism along that axis)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """Rank of this process in ``group``; 0 for ``None``."""
    return 0 if group is None else dist.get_rank(group)


@dataclass
class CommCounter:
    """Bytes this rank sends and receives, and the number of calls, per collective kind.

    Kinds recorded by ds4sci: ``"all_to_all"`` (sent = received = the ``(P-1)/P`` of the tensor that leaves the
    rank), ``"p2p"`` (ring shifts: the bytes of every tensor sent and received), ``"all_gather"`` (this rank's
    tensor to ``P-1`` peers; received: the ``P-1`` other tensors). Pass one counter to the primitives (or to
    :class:`~ds4sci.sequence.DistributedAttention`); it is a plain object, never global state.
    """

    calls: Counter = field(default_factory=Counter)
    bytes_sent: Counter = field(default_factory=Counter)
    bytes_received: Counter = field(default_factory=Counter)

    def record(self, kind: str, sent: int, received: int) -> None:
        self.calls[kind] += 1
        self.bytes_sent[kind] += int(sent)
        self.bytes_received[kind] += int(received)

    def reset(self) -> None:
        self.calls.clear()
        self.bytes_sent.clear()
        self.bytes_received.clear()

    def total_sent(self) -> int:
        return sum(self.bytes_sent.values())

    def total_received(self) -> int:
        return sum(self.bytes_received.values())


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _all_to_all_forward(
    x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int, counter: CommCounter | None
) -> torch.Tensor:
    world = dist.get_world_size(group)
    if x.size(scatter_dim) % world != 0:
        raise ValueError(
            f"all_to_all: dim {scatter_dim} of shape {tuple(x.shape)} has size {x.size(scatter_dim)}, "
            f"not divisible by the group size {world}"
        )
    # [..., X, ...] -> [P, ..., X/P, ...]: chunk j (destined for rank j) leads.
    send = torch.stack(x.chunk(world, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    if counter is not None:
        leaving = _nbytes(send) // world * (world - 1)
        counter.record("all_to_all", leaving, leaving)
    # [P, ..., Y, ..., X/P, ...] -> [..., P*Y, ..., X/P, ...]: chunk j came from rank j, concatenated in rank order.
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim, counter):
        ctx.group, ctx.scatter_dim, ctx.gather_dim, ctx.counter = group, scatter_dim, gather_dim, counter
        return _all_to_all_forward(x, group, scatter_dim, gather_dim, counter)

    @staticmethod
    def backward(ctx, grad):
        # The inverse all-to-all: scatter along the gathered dim, gather along the scattered dim.
        return _all_to_all_forward(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim, ctx.counter), None, None, None, None


def all_to_all(
    x: torch.Tensor,
    group: dist.ProcessGroup | None,
    scatter_dim: int,
    gather_dim: int,
    counter: CommCounter | None = None,
) -> torch.Tensor:
    """Differentiable all-to-all: split ``x`` along ``scatter_dim`` over the group, concatenate the pieces
    received from ranks 0..P-1 along ``gather_dim``. Backward is the inverse all-to-all.

    Ulysses uses ``scatter_dim=2, gather_dim=1``: ``[B, S/P, H, D] -> [B, S, H/P, D]``, and the inverse
    ``scatter_dim=1, gather_dim=2``: ``[B, S, H/P, D] -> [B, S/P, H, D]``.
    ``group=None`` or a one-rank group returns ``x`` unchanged.

    Raises:
        ValueError: ``x.size(scatter_dim)`` is not divisible by the group size.
    """
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, scatter_dim, gather_dim, counter)


def all_gather_seq(
    x: torch.Tensor, group: dist.ProcessGroup | None, dim: int, counter: CommCounter | None = None
) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in group-rank order (no autograd; all ranks' shapes equal)."""
    world = group_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    if counter is not None:
        counter.record("all_gather", _nbytes(x) * (world - 1), _nbytes(x) * (world - 1))
    return torch.cat(parts, dim=dim)


class RingShift:
    """Send tensors to the next rank of a ring group and receive same-shaped tensors from the previous one.

    Asynchronous: construct to post the sends and receives, compute, then :meth:`wait` for the received tensors.
    Shifts in flight at the same time on one group need distinct ``tag`` values.
    """

    def __init__(
        self,
        tensors: list[torch.Tensor],
        group: dist.ProcessGroup,
        counter: CommCounter | None = None,
        tag: int = 0,
    ) -> None:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        dst = dist.get_global_rank(group, (rank + 1) % world)
        src = dist.get_global_rank(group, (rank - 1) % world)
        self._send = [t.contiguous() for t in tensors]
        self.received = [torch.empty_like(t) for t in self._send]
        # one batch: NCCL runs the sends and receives as a group, so neither side waits on the other's order
        ops = [dist.P2POp(dist.isend, t, dst, group, tag) for t in self._send]
        ops += [dist.P2POp(dist.irecv, t, src, group, tag) for t in self.received]
        self._works = dist.batch_isend_irecv(ops)
        if counter is not None:
            moved = sum(_nbytes(t) for t in self._send)
            counter.record("p2p", moved, moved)

    def wait(self) -> list[torch.Tensor]:
        for work in self._works:
            work.wait()
        return self.received
