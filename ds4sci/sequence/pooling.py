"""Reductions over a record's sequence shards for the pooled task heads (:class:`ds4sci.models.genslm.task.TaskHead`):
:class:`ShardReduction` is set as a head's ``reduction`` when the record is split over the sequence-parallel
(Ulysses x ring) group, so mean, last-token and attention pooling see the whole record.

Gradients: the pooled vector is replicated on every shard and each shard computes the same head loss. The sum's
backward all-reduces the gradient (the adjoint of "every rank receives the sum"), so with each rank's loss scaled by
``1 / sp`` (:func:`sequence_share`) a shard's backbone gradient is the single-process one for its tokens and the
replicated head's gradients, summed over the group, are the single-process ones too.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ds4sci.distributed.comm import all_reduce
from ds4sci.distributed.comm import group_size


class _SumEverywhere(torch.autograd.Function):
    """All-reduce (sum) forward, all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous(), ctx.group), None


class ShardReduction:
    """Sums (differentiable) and maxima (not) over ``group``, the sequence-parallel group; a group of one (or None)
    is the identity, as :class:`ds4sci.models.genslm.task.LocalReduction`."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group

    def sum(self, x: Tensor) -> Tensor:
        return x if group_size(self.group) == 1 else _SumEverywhere.apply(x, self.group)

    def max(self, x: Tensor) -> Tensor:
        if group_size(self.group) == 1:
            return x
        return all_reduce(x.detach(), self.group, op=dist.ReduceOp.MAX)


def sequence_share(group: dist.ProcessGroup | None) -> float:
    """The factor of a pooled head's loss on each shard: ``1 / sp`` (see the module docstring)."""
    return 1.0 / group_size(group)
