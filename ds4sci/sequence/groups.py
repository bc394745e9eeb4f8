"""Parallel degrees and the process groups of Unified sequence parallelism (Ulysses x Ring).

One validated object, :class:`ParallelDims`, holds the data-parallel, Ulysses and ring degrees and the sequence
layout, and derives every rank coordinate; its product is the world size. :func:`build_groups` turns it into explicit process groups (no global singleton: callers pass the
returned :class:`SequenceParallelGroups` where it is needed), and :class:`DeepSpeedMPU` exposes them through the
``mpu`` interface that ``deepspeed.initialize(mpu=...)`` reads.

Rank layout (innermost first), chosen so that sequence-parallel (SP) groups are contiguous blocks of ranks
``[i*sp, (i+1)*sp)`` as DeepSpeed's ``parallel_state_sp`` helper makes them, and so that the Ulysses all-to-all,
the most bandwidth-hungry collective, runs between neighbouring ranks (same node), as the USP paper
(Fang & Zhao 2024, "USP: A Unified Sequence Parallelism Approach for Long Context Generative AI") recommends::

    rank = dp_rank * sp + sp_rank,      sp_rank = ring_rank * ulysses + ulysses_rank

The sequence is sharded over the SP group in ``sp_rank`` order (see :mod:`ds4sci.sequence.sharding`).
``ring_rank`` and ``ulysses_rank`` are a rank's index in its ring and Ulysses groups.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.distributed as dist

from ds4sci.sequence.sharding import Layout

logger = logging.getLogger(__name__)

__all__ = ["ParallelDims", "SequenceParallelGroups", "build_groups", "DeepSpeedMPU"]


@dataclass(frozen=True)
class ParallelDims:
    """Validated parallel degrees and the sequence layout; the one place a degree or a rank is derived.

    Args:
        dp: data-parallel degree (replicas of the model that see different batches).
        ulysses: Ulysses degree (all-to-all between sequence-sharded and head-sharded layouts).
        ring: ring-attention degree (key/value blocks passed around a ring; carries what the heads cannot).
        layout: how the sequence is cut over the ``sp = ulysses * ring`` shards (:class:`Layout` or its name;
            ``"auto"``: zigzag with a ring, contiguous without).

    ``world_size = dp * ulysses * ring``; :meth:`for_world` infers ``dp`` from a world size.
    """

    dp: int
    ulysses: int = 1
    ring: int = 1
    layout: Layout | str = "auto"

    def __post_init__(self) -> None:
        for name in ("dp", "ulysses", "ring"):
            _check_degree(name, getattr(self, name))
        object.__setattr__(self, "layout", Layout.parse(self.layout, self.ring))

    @classmethod
    def for_world(cls, world_size: int, *, ulysses: int = 1, ring: int = 1, layout: str | Layout = "auto") -> ParallelDims:
        """The dims of ``world_size`` processes: ``dp = world_size / (ulysses * ring)``.

        Raises:
            ValueError: the world size is not a multiple of ``ulysses * ring`` (the message names both and how
                to launch).
        """
        for name, value in (("world_size", world_size), ("ulysses", ulysses), ("ring", ring)):
            _check_degree(name, value)
        dp, rest = divmod(world_size, ulysses * ring)
        if rest or dp == 0:
            raise ValueError(
                f"world size {world_size} is not a multiple of ulysses={ulysses} x ring={ring} = {ulysses * ring}; "
                f"launch a multiple of {ulysses * ring} processes (torchrun --nproc-per-node N)"
            )
        return cls(dp=dp, ulysses=ulysses, ring=ring, layout=layout)

    @property
    def sp(self) -> int:
        """Sequence-parallel degree (number of sequence shards): ``ulysses * ring``."""
        return self.ulysses * self.ring

    @property
    def world_size(self) -> int:
        return self.dp * self.sp

    @property
    def sequence_multiple(self) -> int:
        """Sequence lengths must be a multiple of this to shard evenly (``sp``, or ``2*sp`` for zigzag)."""
        return self.layout.multiple(self.sp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(dp_rank, ring_rank, ulysses_rank)`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside [0, world_size={self.world_size})")
        dp_rank, sp_rank = divmod(rank, self.sp)
        ring_rank, ulysses_rank = divmod(sp_rank, self.ulysses)
        return dp_rank, ring_rank, ulysses_rank

    def sp_rank(self, rank: int) -> int:
        """The sequence shard a global rank holds: ``ring_rank * ulysses + ulysses_rank``."""
        _, ring_rank, ulysses_rank = self.coords(rank)
        return ring_rank * self.ulysses + ulysses_rank

    def check_heads(self, num_heads: int) -> None:
        """Ulysses scatters heads: ``ulysses`` must divide ``num_heads`` (a ring degree carries the rest)."""
        if num_heads % self.ulysses:
            raise ValueError(
                f"ulysses={self.ulysses} must divide the number of heads {num_heads} (Ulysses scatters heads); "
                f"use a Ulysses degree that divides {num_heads} and let the ring degree carry the rest"
            )

    def group_ranks(self) -> dict[str, list[list[int]]]:
        """Global ranks of every group of each kind (pure arithmetic, no processes needed).

        Kinds: ``sp`` (Ulysses x ring, contiguous blocks), ``ulysses``, ``ring``, ``dp`` (same SP rank across
        replicas), ``sdp`` (sequence x data: all ranks, the group ZeRO partitions over), ``mp`` (model
        parallel: one rank each, for DeepSpeed's ``mpu`` interface).
        """
        sp, u, r = self.sp, self.ulysses, self.ring
        kinds: dict[str, list[list[int]]] = {
            "sp": [list(range(i * sp, (i + 1) * sp)) for i in range(self.dp)],
            "ulysses": [
                [i * sp + ring_rank * u + j for j in range(u)] for i in range(self.dp) for ring_rank in range(r)
            ],
            "ring": [[i * sp + k * u + j for k in range(r)] for i in range(self.dp) for j in range(u)],
            "dp": [[i * sp + s for i in range(self.dp)] for s in range(sp)],
            "sdp": [list(range(self.world_size))],
            "mp": [[rank] for rank in range(self.world_size)],
        }
        return kinds


def _check_degree(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"ParallelDims.{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"ParallelDims.{name} must be >= 1, got {name}={value}")


@dataclass(frozen=True)
class SequenceParallelGroups:
    """The process groups this rank belongs to, as built by :func:`build_groups`; ranks come from ``dims``."""

    dims: ParallelDims
    rank: int
    ulysses: dist.ProcessGroup
    ring: dist.ProcessGroup
    sp: dist.ProcessGroup
    dp: dist.ProcessGroup
    sdp: dist.ProcessGroup
    mp: dist.ProcessGroup

    @property
    def sp_rank(self) -> int:
        """Index of the sequence shard this rank holds (pass it to :func:`~ds4sci.sequence.shard_sequence`)."""
        return self.dims.sp_rank(self.rank)

    @property
    def dp_rank(self) -> int:
        return self.dims.coords(self.rank)[0]


def build_groups(dims: ParallelDims, backend: str | None = None) -> SequenceParallelGroups:
    """Create the process groups of ``dims`` on the initialized default process group.

    Collective: every rank must call it, with the same ``dims``. Each kind's groups are created in the order of
    :meth:`ParallelDims.group_ranks`, as ``torch.distributed.new_group`` requires.

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
            group = dist.new_group(ranks, backend=backend)
            if rank in ranks:
                mine[kind] = group
    logger.debug("rank %d: built groups for %s", rank, dims)
    return SequenceParallelGroups(dims=dims, rank=rank, **mine)


class DeepSpeedMPU:
    """The ``mpu`` object ``deepspeed.initialize(mpu=...)`` reads, backed by explicit groups.

    DeepSpeed's engine broadcasts parameters, reduces gradients and partitions ZeRO state over the
    sequence-data-parallel group when the mpu exposes the ``get_sequence_*`` methods; model (tensor) parallelism
    is not used here, so its world size is 1.
    """

    def __init__(self, groups: SequenceParallelGroups) -> None:
        self.groups = groups

    # sequence parallel (Ulysses x ring)
    def get_sequence_parallel_group(self) -> dist.ProcessGroup:
        return self.groups.sp

    def get_sequence_parallel_world_size(self) -> int:
        return self.groups.dims.sp

    def get_sequence_parallel_rank(self) -> int:
        return self.groups.sp_rank

    # sequence x data parallel (the group ZeRO works over)
    def get_sequence_data_parallel_group(self) -> dist.ProcessGroup:
        return self.groups.sdp

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.groups.dims.world_size

    def get_sequence_data_parallel_rank(self) -> int:
        return self.groups.rank

    # data parallel
    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.groups.dp

    def get_data_parallel_world_size(self) -> int:
        return self.groups.dims.dp

    def get_data_parallel_rank(self) -> int:
        return self.groups.dp_rank

    def get_data_parallel_group_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.groups.dp)

    # model (tensor) parallel: not used, one rank each
    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self.groups.mp

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0
