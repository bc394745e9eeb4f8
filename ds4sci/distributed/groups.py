"""Process groups of a :class:`~ds4sci.distributed.dims.ParallelDims`: tensor (Megatron), Ulysses, ring, data and
pipeline parallelism.

:func:`build_groups` turns the dims into explicit process groups (no global singleton: callers pass the returned
:class:`SequenceParallelGroups` where it is needed), and :class:`DeepSpeedMPU` exposes them through the ``mpu``
interface that ``deepspeed.initialize(mpu=...)`` reads. Which ranks form each group, and every rank coordinate, is
the dims' arithmetic (:meth:`~ds4sci.distributed.dims.ParallelDims.group_ranks`; rank order TP < Ulysses < Ring < DP <
PP, innermost first).
"""
from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

import torch.distributed as dist

from ds4sci.distributed.dims import Coords
from ds4sci.distributed.dims import ParallelDims

logger = logging.getLogger(__name__)

__all__ = ["SequenceParallelGroups", "build_groups", "DeepSpeedMPU"]


@dataclass(frozen=True)
class SequenceParallelGroups:
    """The process groups this rank belongs to, as built by :func:`build_groups`; ranks come from ``dims``."""

    dims: ParallelDims
    rank: int
    tp: dist.ProcessGroup
    ulysses: dist.ProcessGroup
    ring: dist.ProcessGroup
    sp: dist.ProcessGroup
    dp: dist.ProcessGroup
    sdp: dist.ProcessGroup
    pp: dist.ProcessGroup

    @property
    def coords(self) -> Coords:
        return self.dims.coords(self.rank)

    @property
    def sp_rank(self) -> int:
        """Index of the sequence shard this rank holds (pass it to :func:`~ds4sci.sequence.shard_sequence`)."""
        return self.dims.sp_rank(self.rank)

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    @property
    def tp_rank(self) -> int:
        return self.coords.tp

    @property
    def sdp_rank(self) -> int:
        """This rank's index in its sequence x data group: ``dp_rank * sp + sp_rank``."""
        return self.dp_rank * self.dims.sp + self.sp_rank


def build_groups(dims: ParallelDims, backend: str | None = None, timeout: datetime.timedelta | None = None
                 ) -> SequenceParallelGroups:
    """Create the process groups of ``dims`` on the initialized default process group.

    Collective: every rank must call it, with the same ``dims``. Each kind's groups are created in the order of
    :meth:`ParallelDims.group_ranks`, as ``torch.distributed.new_group`` requires. ``timeout``: how long their
    collectives wait for a peer (``None``: torch's default, 30 min on gloo; ``new_group`` does not inherit the
    default group's).

    Raises:
        RuntimeError: torch.distributed is not initialized.
        ValueError: ``dims.world_size`` differs from the default group's world size.
    """
    if not dist.is_initialized():
        raise RuntimeError("build_groups: torch.distributed is not initialized (call init_process_group first)")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != dims.world_size:
        raise ValueError(f"build_groups: dims.world_size={dims.world_size} but the process group has {world} ranks")
    mine: dict[str, dist.ProcessGroup] = {}
    for kind, rank_lists in dims.group_ranks().items():
        for ranks in rank_lists:
            group = dist.new_group(ranks, backend=backend, timeout=timeout)
            if rank in ranks:
                mine[kind] = group
    logger.debug("rank %d: built groups for %s", rank, dims)
    return SequenceParallelGroups(dims=dims, rank=rank, **mine)


def _mpu_getters(kind: str):
    """DeepSpeed's three getters of one kind of group: the group ``groups.<kind>``, its world size ``dims.<kind>`` and
    this rank's index in it ``groups.<kind>_rank`` (``kind``: a group field of :class:`SequenceParallelGroups`)."""

    def get_group(self: DeepSpeedMPU) -> dist.ProcessGroup:
        return getattr(self.groups, kind)

    def get_world_size(self: DeepSpeedMPU) -> int:
        return getattr(self.groups.dims, kind)

    def get_rank(self: DeepSpeedMPU) -> int:
        return getattr(self.groups, f"{kind}_rank")

    return get_group, get_world_size, get_rank


class DeepSpeedMPU:
    """The ``mpu`` object ``deepspeed.initialize(mpu=...)`` reads, backed by explicit groups.

    DeepSpeed's engine broadcasts parameters, reduces gradients and partitions ZeRO state over the
    sequence-data-parallel group when the mpu exposes the ``get_sequence_*`` methods; its model-parallel group is
    the tensor-parallel group (parameters differ across it; gradient norms are summed over it). DeepSpeed looks the
    methods up by name: ``get_<kind>_group``, ``get_<kind>_world_size`` and ``get_<kind>_rank`` per kind below.
    """

    def __init__(self, groups: SequenceParallelGroups) -> None:
        self.groups = groups

    # sequence parallel (Ulysses x ring)
    get_sequence_parallel_group, get_sequence_parallel_world_size, get_sequence_parallel_rank = _mpu_getters("sp")
    # sequence x data parallel (the group ZeRO works over)
    (get_sequence_data_parallel_group, get_sequence_data_parallel_world_size,
     get_sequence_data_parallel_rank) = _mpu_getters("sdp")
    # data parallel
    get_data_parallel_group, get_data_parallel_world_size, get_data_parallel_rank = _mpu_getters("dp")

    def get_data_parallel_group_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.groups.dp)

    # model (tensor) parallel
    get_model_parallel_group, get_model_parallel_world_size, get_model_parallel_rank = _mpu_getters("tp")
    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank
