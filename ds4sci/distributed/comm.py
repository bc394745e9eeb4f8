"""Collectives of every parallelism, each under one public name, with one byte counter (:class:`CommCounter`).

- Plain collectives (no autograd): :func:`all_gather`, :func:`reduce_scatter`, :func:`all_reduce`, :func:`split`
  (this rank's piece, no communication), :func:`send_recv` and :class:`RingShift` (ring attention's rotation, Liu et
  al. 2023, "Ring Attention with Blockwise Transformers").
- Differentiable ones, each a collective forward and its adjoint backward: :func:`all_to_all` (the Ulysses layout
  switch ``[B, S/P, H, D] <-> [B, S, H/P, D]``, Jacobs et al. 2023, "DeepSpeed Ulysses"), :class:`SequenceRegion`
  (any pair of the plain collectives, e.g. Megatron sequence parallelism's reduce-scatter / all-gather, Korthikanti
  et al. 2022) with its wrappers :func:`reduce_scatter_sequence_region` and :func:`split_sequence_region`,
  :func:`reduce_from_tensor_region`, :func:`sync_grad` and :func:`move` (a point-to-point permutation of tensors).

Collectives take the process group explicitly (``None`` or a group of one: no parallelism along that axis). The
all-to-all and reduce-scatter use ``all_to_all_single`` with equal splits where they need an exchange: gloo, NCCL and
MPI all implement it (gloo's list form ``all_to_all`` does not take equal-size lists of different shapes).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from dataclasses import field
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "CommCounter", "group_size", "group_rank", "nbytes", "all_gather", "reduce_scatter", "all_reduce", "split",
    "all_to_all", "SequenceRegion", "reduce_scatter_sequence_region", "split_sequence_region",
    "reduce_from_tensor_region", "sync_grad", "RingShift", "send_recv", "move",
]


def group_size(group: dist.ProcessGroup | None) -> int:
    """World size of ``group``; 1 for ``None`` (no parallelism along that axis)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """Rank of this process in ``group``; 0 for ``None``."""
    return 0 if group is None else dist.get_rank(group)


@dataclass
class CommCounter:
    """Bytes this rank sends and receives, and the number of calls, per collective kind.

    Kinds: ``"all_to_all"`` (sent = received = the ``(P-1)/P`` of the tensor that leaves the rank), ``"p2p"`` (ring
    shifts and moves: the bytes of every tensor sent and received), ``"all_gather"`` (this rank's tensor to ``P-1``
    peers; received: the ``P-1`` other tensors), ``"reduce_scatter"`` (the ``P-1`` pieces of the other ranks),
    ``"all_reduce"`` (a ring all-reduce's ``2 (P-1)/P`` of the tensor). Pass one counter to the collectives (or to
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


def nbytes(x: Tensor) -> int:
    """Bytes of ``x``'s elements (not of its storage)."""
    return x.numel() * x.element_size()


def _record(counter: CommCounter | None, kind: str, moved: int) -> None:
    if counter is not None:
        counter.record(kind, moved, moved)


# ------------------------------------------------------------------------------------------ plain collectives
#: every rank's tensor gathered into one output tensor: torch 2.13 names it ``all_gather_single`` (the old name,
#: ``all_gather_into_tensor``, warns there); the torch versions before have the old name only
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather(x: Tensor, group: dist.ProcessGroup | None, dim: int, counter: CommCounter | None = None) -> Tensor:
    """Every rank's ``x`` (one shape on every rank) concatenated along ``dim`` in group-rank order: ``[.., X, ..] ->
    [.., P X, ..]``; ``x`` itself for a group of one.

    The pieces are received into one buffer viewed ``[P, *x.shape]`` (NCCL's list ``all_gather`` would stage them in
    a flat buffer of its own and copy them out). When every dim before ``dim`` has size 1 (``dim`` leads in memory)
    the result is that buffer: nothing is alive beside it but ``x``. Otherwise it is copied once into a contiguous
    result, so the buffer and the result are alive together; a caller that can take a permuted result gathers along
    a leading dim instead (the Evoformer stack's exit).
    """
    world = group_size(group)
    if world == 1:
        return x
    dim = dim % x.ndim
    x = x.contiguous()
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))  # the pieces stacked on dim 0 (gloo's one layout)
    _gather_into(out, x, group=group)
    _record(counter, "all_gather", nbytes(x) * (world - 1))
    return out.view(world, *x.shape).movedim(0, dim).flatten(dim, dim + 1)


def reduce_scatter(x: Tensor, group: dist.ProcessGroup, dim: int, counter: CommCounter | None = None) -> Tensor:
    """``x [.., X, ..]`` summed over the group, this rank's ``1/P`` piece kept: ``[.., X/P, ..]``.

    NCCL runs ``reduce_scatter_tensor``; gloo has no reduce-scatter, so there it is an all-to-all of the pieces
    followed by a local sum (the same bytes leave each rank: ``(P-1)/P`` of ``x``).

    Raises:
        ValueError: ``x.size(dim)`` is not divisible by the group size.
    """
    world = dist.get_world_size(group)
    if x.size(dim) % world:
        raise ValueError(f"reduce-scatter: dim {dim} of shape {tuple(x.shape)} is not divisible by the group size "
                         f"{world}")
    send = torch.stack(x.chunk(world, dim=dim)).contiguous()  # [P, ..., X/P, ...]: piece j goes to rank j
    if dist.get_backend(group) == "nccl":
        out = torch.empty_like(send[0])
        dist.reduce_scatter_tensor(out, send.reshape(-1), group=group)
    else:
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)  # recv[j]: rank j's partial sum of my piece
        out = recv.sum(0)
    _record(counter, "reduce_scatter", nbytes(send[0]) * (world - 1))
    return out


def all_reduce(x: Tensor, group: dist.ProcessGroup, counter: CommCounter | None = None,
               op=dist.ReduceOp.SUM) -> Tensor:
    """``x`` reduced over the group (``op``, a sum by default) into a new tensor of its shape; ``x`` is left as is."""
    x = x.clone().contiguous()
    dist.all_reduce(x, op=op, group=group)
    world = dist.get_world_size(group)
    _record(counter, "all_reduce", 2 * nbytes(x) * (world - 1) // world)  # a ring all-reduce's bytes per rank
    return x


def split(x: Tensor, group: dist.ProcessGroup, dim: int, counter: CommCounter | None = None) -> Tensor:
    """This rank's contiguous ``1/P`` piece of ``x`` along ``dim``, ``[.., X, ..] -> [.., X/P, ..]`` (no
    communication; ``counter`` is unused, for the signature :class:`SequenceRegion` calls). A copy that owns its
    storage: a view would keep the whole of ``x`` alive wherever it is saved for backward."""
    return x.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)].clone(
        memory_format=torch.contiguous_format)


# -------------------------------------------------------------------------------------- differentiable ones
def _all_to_all_forward(x: Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup,
                        counter: CommCounter | None) -> Tensor:
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
        leaving = nbytes(send) // world * (world - 1)
        counter.record("all_to_all", leaving, leaving)
    # [P, ..., Y, ..., X/P, ...] -> [..., P*Y, ..., X/P, ...]: chunk j came from rank j, concatenated in rank order.
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _Reversed(torch.autograd.Function):
    """``_Reversed.apply(x, op, there, back, group, counter)``: ``op(x, there, back, group, counter)`` in forward and
    ``op(grad, back, there, group, counter)`` in backward, the same exchange the other way: the inverse all-to-all
    scatters along the gathered dim and gathers along the scattered one; a move's gradient goes to its source, from its
    destination."""

    @staticmethod
    def forward(ctx, x, op, there, back, group, counter):
        ctx.op, ctx.there, ctx.back, ctx.group, ctx.counter = op, there, back, group, counter
        return op(x, there, back, group, counter)

    @staticmethod
    def backward(ctx, grad):
        return ctx.op(grad, ctx.back, ctx.there, ctx.group, ctx.counter), None, None, None, None, None


def all_to_all(x: Tensor, group: dist.ProcessGroup | None, scatter_dim: int, gather_dim: int,
               counter: CommCounter | None = None) -> Tensor:
    """Differentiable all-to-all: split ``x`` along ``scatter_dim`` over the group, concatenate the pieces
    received from ranks 0..P-1 along ``gather_dim``. Backward is the inverse all-to-all.

    Ulysses uses ``scatter_dim=2, gather_dim=1``: ``[B, S/P, H, D] -> [B, S, H/P, D]``, and the inverse
    ``scatter_dim=1, gather_dim=2``: ``[B, S, H/P, D] -> [B, S/P, H, D]``. A group of one returns ``x`` unchanged.

    Raises:
        ValueError: ``x.size(scatter_dim)`` is not divisible by the group size.
    """
    if group_size(group) == 1:
        return x
    return _Reversed.apply(x, _all_to_all_forward, scatter_dim, gather_dim, group, counter)


Collective = Callable[[Tensor, dist.ProcessGroup, int, "CommCounter | None"], Tensor]


class SequenceRegion(torch.autograd.Function):
    """``SequenceRegion.apply(x, group, dim, counter, collective, adjoint)``: ``collective(x, group, dim, counter)``
    in forward and ``adjoint`` on the gradient in backward, each one of the plain collectives above. On the sequence
    dim of Megatron sequence parallelism (Korthikanti et al. 2022): :func:`reduce_scatter` / :func:`all_gather`
    (partial sums ``[B, T, h]`` -> summed region ``[B, T/P, h]``, their ``g-bar``), :func:`split` /
    :func:`all_gather` (a replicated tensor to a region), :func:`all_gather` / :func:`reduce_scatter` (a region to
    the whole, every rank's use contributing) and :func:`all_gather` / :func:`split` (the whole, every rank's use the
    same)."""

    @staticmethod
    def forward(ctx, x, group, dim, counter, collective: Collective, adjoint: Collective):
        ctx.group, ctx.dim, ctx.counter, ctx.adjoint = group, dim, counter, adjoint
        return collective(x, group, dim, counter)

    @staticmethod
    def backward(ctx, grad):
        return ctx.adjoint(grad, ctx.group, ctx.dim, ctx.counter), None, None, None, None, None


def reduce_scatter_sequence_region(x: Tensor, group, dim: int = 1, counter: CommCounter | None = None) -> Tensor:
    """Partial sums ``[B, T, ...]`` -> this rank's summed piece ``[B, T/P, ...]`` (backward: all-gather)."""
    return x if group_size(group) == 1 else SequenceRegion.apply(x, group, dim, counter, reduce_scatter, all_gather)


def split_sequence_region(x: Tensor, group, dim: int = 1, counter: CommCounter | None = None) -> Tensor:
    """Replicated ``[B, T, ...]`` -> this rank's contiguous piece ``[B, T/P, ...]`` (backward: all-gather)."""
    return x if group_size(group) == 1 else SequenceRegion.apply(x, group, dim, counter, split, all_gather)


class _ReduceFromTensor(torch.autograd.Function):
    """Partial results -> replicated sum: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group, counter):
        return all_reduce(x, group, counter)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def reduce_from_tensor_region(x: Tensor, group, counter: CommCounter | None = None) -> Tensor:
    """Partial results ``[...]`` summed over the group (all-reduce); backward passes the (replicated) gradient
    through (Megatron-LM's ``g`` of a vocabulary-parallel embedding)."""
    return x if group_size(group) == 1 else _ReduceFromTensor.apply(x, group, counter)


class _SyncGrad(torch.autograd.Function):
    """A replicated parameter used on sequence shards: identity forward, gradient all-reduced in backward."""

    @staticmethod
    def forward(ctx, p, group, counter):
        ctx.group, ctx.counter = group, counter
        return p.view_as(p)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group, ctx.counter), None, None


def sync_grad(p: Tensor, group, counter: CommCounter | None = None) -> Tensor:
    """``p`` unchanged; its gradient is summed over the group (a norm's weights used on sequence shards)."""
    return p if group_size(group) == 1 else _SyncGrad.apply(p, group, counter)


# -------------------------------------------------------------------------------------------- point to point
def _post(tensors: list[Tensor], dst: int, src: int, group, counter: CommCounter | None, tag: int):
    """Send ``tensors`` to global rank ``dst`` and receive same-shaped ones from ``src``, posted as one batch (NCCL
    runs the sends and receives as a group, so neither side waits on the other's order): (sent, received, works);
    the sent tensors must stay alive until the works are done."""
    sends = [t.contiguous() for t in tensors]
    received = [torch.empty_like(t) for t in sends]
    ops = [dist.P2POp(dist.isend, t, dst, group, tag) for t in sends]
    ops += [dist.P2POp(dist.irecv, t, src, group, tag) for t in received]
    works = dist.batch_isend_irecv(ops)
    _record(counter, "p2p", sum(nbytes(t) for t in sends))
    return sends, received, works


class RingShift:
    """Send tensors to the next rank of a ring group and receive same-shaped tensors from the previous one.

    Asynchronous: construct to post the sends and receives, compute, then :meth:`wait` for the received tensors.
    Shifts in flight at the same time on one group need distinct ``tag`` values.
    """

    def __init__(self, tensors: list[Tensor], group: dist.ProcessGroup, counter: CommCounter | None = None,
                 tag: int = 0) -> None:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        dst = dist.get_global_rank(group, (rank + 1) % world)
        src = dist.get_global_rank(group, (rank - 1) % world)
        self._send, self.received, self._works = _post(tensors, dst, src, group, counter, tag)

    def wait(self) -> list[Tensor]:
        for work in self._works:
            work.wait()
        return self.received


def send_recv(x: Tensor, dst: int, src: int, group, counter: CommCounter | None = None, tag: int = 0) -> Tensor:
    """Send ``x`` to global rank ``dst`` and receive a tensor of its shape from global rank ``src`` (blocking);
    ``x`` itself when both are this rank."""
    if dst == src == dist.get_rank():
        return x
    _sent, (received,), works = _post([x], dst, src, group, counter, tag)  # _sent: alive until the works are done
    for work in works:
        work.wait()
    return received


def move(x: Tensor, dst: int, src: int, group, counter: CommCounter | None = None) -> Tensor:
    """Differentiable :func:`send_recv`: a permutation of tensors over ranks (``x`` to ``dst``, this rank's from
    ``src``); backward sends the gradient the inverse way (to ``src``, from ``dst``)."""
    return _Reversed.apply(x, send_recv, dst, src, group, counter)
