"""Tensor-parallel state dicts consolidated and split again: the single-device state dict from each TP rank's pieces
(:func:`gather_tensor_parallel`, for exports and checkpoints) and back (:func:`shard_tensor_parallel`,
:func:`load_full_state_dict`).

Which parameters are split, along which dim, padded how and in what row order is each parameter's
:class:`~ds4sci.parallel.tensor_parallel.TPShard`, read from the model by
:func:`~ds4sci.parallel.tensor_parallel.tensor_parallel_plan`; the names are the single-device model's.
"""
from __future__ import annotations

from typing import Mapping

from torch import Tensor
from torch import nn

from ds4sci.distributed.comm import all_gather
from ds4sci.distributed.comm import group_rank
from ds4sci.distributed.comm import group_size
from ds4sci.distributed.groups import SequenceParallelGroups
from ds4sci.parallel.tensor_parallel import TPShard
from ds4sci.parallel.tensor_parallel import tensor_parallel_plan

__all__ = ["gather_tensor_parallel", "shard_tensor_parallel", "load_full_state_dict"]


def gather_tensor_parallel(state: nn.Module | Mapping[str, Tensor], groups: SequenceParallelGroups,
                           plan: Mapping[str, TPShard] | None = None) -> dict[str, Tensor]:
    """The single-device state dict from this TP rank's (collective over ``groups.tp``; every rank gets it).

    ``state``: a tensor-parallel model (its ``state_dict()`` and plan are used), or a state dict with the same keys
    (e.g. gradients, Adam moments or ZeRO-3 gathered weights) together with ``plan`` (:func:`tensor_parallel_plan`
    of the model). Split entries are all-gathered along their dim, cut back to the unpadded size and put back in
    the single-device order (:meth:`TPShard.restore`); the others are returned as they are.
    """
    if isinstance(state, nn.Module):
        plan = tensor_parallel_plan(state) if plan is None else plan
        state = state.state_dict()
    if plan is None:
        raise ValueError("gather_tensor_parallel: pass the plan (tensor_parallel_plan(model)) with a state dict")
    group = groups.tp
    full = {}
    for name, value in state.items():
        shard = plan.get(name)
        if shard is None or group_size(group) == 1:
            full[name] = value
            continue
        full[name] = shard.restore(all_gather(value.detach(), group, shard.dim, None))
    return full


def shard_tensor_parallel(full: Mapping[str, Tensor], plan: Mapping[str, TPShard], rank: int,
                          world: int) -> dict[str, Tensor]:
    """Inverse of :func:`gather_tensor_parallel`: TP rank ``rank``'s state dict from the single-device one (local,
    no communication)."""
    out = {}
    for name, value in full.items():
        shard = plan.get(name)
        if shard is None:
            out[name] = value
            continue
        try:
            out[name] = shard.piece(value, rank, world)
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
    return out


def load_full_state_dict(model: nn.Module, full: Mapping[str, Tensor], groups: SequenceParallelGroups,
                         strict: bool = True):
    """Load a single-device state dict into a tensor-parallel model (each rank keeps its pieces; local)."""
    local = shard_tensor_parallel(full, tensor_parallel_plan(model), group_rank(groups.tp), groups.dims.tp)
    return model.load_state_dict(local, strict=strict)
