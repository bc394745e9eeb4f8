"""Parallel degrees and process groups: tensor (Megatron), Ulysses, ring, data and pipeline parallelism.

One validated object, :class:`ParallelDims`, holds the five degrees and the sequence layout, and derives every rank
coordinate; their product is the world size. :func:`build_groups` turns it into explicit process groups (no global
singleton: callers pass the returned :class:`SequenceParallelGroups` where it is needed), and :class:`DeepSpeedMPU`
exposes them through the ``mpu`` interface that ``deepspeed.initialize(mpu=...)`` reads.

Rank layout, innermost first, in the order of the USP paper (Fang & Zhao 2024, "USP: A Unified Sequence
Parallelism Approach for Long Context Generative AI", section 5): TP < Ulysses < Ring < DP < PP, so the
chattiest groups (tensor parallelism's per-layer collectives, then the Ulysses all-to-all) span neighbouring
ranks, i.e. the GPUs of one node::

    rank = (((pp_rank * dp + dp_rank) * ring + ring_rank) * ulysses + ulysses_rank) * tp + tp_rank
    sp_rank = ring_rank * ulysses + ulysses_rank

The sequence is sharded over the SP (Ulysses x ring) group in ``sp_rank`` order (see
:mod:`ds4sci.sequence.sharding`); with ``tp = 1`` the SP groups are the contiguous blocks ``[i*sp, (i+1)*sp)``
that DeepSpeed's ``parallel_state_sp`` helper makes.
"""
from __future__ import annotations

import datetime
import itertools
import logging
from dataclasses import dataclass
from typing import NamedTuple

import torch.distributed as dist

from ds4sci.sequence.sharding import Layout

logger = logging.getLogger(__name__)

__all__ = ["ParallelDims", "Coords", "SequenceParallelGroups", "build_groups", "DeepSpeedMPU"]

_AXES = ("pp", "dp", "ring", "ulysses", "tp")
"""Mesh axes, outermost first (the rank layout above)."""


class Coords(NamedTuple):
    """A rank's index along each mesh axis."""

    pp: int
    dp: int
    ring: int
    ulysses: int
    tp: int


@dataclass(frozen=True)
class ParallelDims:
    """Validated parallel degrees and the sequence layout; the one place a degree or a rank is derived.

    Args:
        dp: data-parallel degree (replicas of the model that see different batches).
        ulysses: Ulysses degree (all-to-all between sequence-sharded and head-sharded layouts).
        ring: ring-attention degree (key/value blocks passed around a ring; carries what the heads cannot).
        layout: how the sequence is cut over the ``sp = ulysses * ring`` shards (:class:`Layout` or its name;
            ``"auto"``: zigzag with a ring, contiguous without).
        tp: tensor-parallel degree (Megatron-LM: heads and MLP columns split, sequence-parallel norms).
        pp: pipeline-parallel degree (consecutive layers on consecutive stages).

    ``world_size = tp * ulysses * ring * dp * pp``; :meth:`for_world` infers ``dp`` from a world size.
    """

    dp: int
    ulysses: int = 1
    ring: int = 1
    layout: Layout | str = "auto"
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in _AXES:
            _check_degree(name, getattr(self, name))
        object.__setattr__(self, "layout", Layout.parse(self.layout, self.ring))

    @classmethod
    def for_world(cls, world_size: int, *, ulysses: int = 1, ring: int = 1, layout: str | Layout = "auto",
                  tp: int = 1, pp: int = 1) -> ParallelDims:
        """The dims of ``world_size`` processes: ``dp = world_size / (tp * ulysses * ring * pp)``.

        Raises:
            ValueError: the world size is not a multiple of the other degrees' product (the message names each
                degree and how to launch).
        """
        for name, value in (("world_size", world_size), ("tp", tp), ("ulysses", ulysses), ("ring", ring),
                            ("pp", pp)):
            _check_degree(name, value)
        model = tp * ulysses * ring * pp
        dp, rest = divmod(world_size, model)
        if rest or dp == 0:
            raise ValueError(
                f"world size {world_size} is not a multiple of tp={tp} x ulysses={ulysses} x ring={ring} x pp={pp} "
                f"= {model}; launch a multiple of {model} processes (torchrun --nproc-per-node N)"
            )
        return cls(dp=dp, ulysses=ulysses, ring=ring, layout=layout, tp=tp, pp=pp)

    @property
    def sp(self) -> int:
        """Sequence-parallel degree (number of sequence shards): ``ulysses * ring``."""
        return self.ulysses * self.ring

    @property
    def world_size(self) -> int:
        return self.tp * self.sp * self.dp * self.pp

    @property
    def sequence_multiple(self) -> int:
        """Sequence lengths must be a multiple of this to shard evenly: ``sp`` (or ``2*sp`` for zigzag) sequence
        shards, each cut again into ``tp`` pieces by tensor parallelism's sequence-parallel regions."""
        return self.layout.multiple(self.sp) * self.tp

    def _sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, axis) for axis in _AXES)

    def coords(self, rank: int) -> Coords:
        """The :class:`Coords` ``(pp, dp, ring, ulysses, tp)`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside [0, world_size={self.world_size})")
        index = []
        for size in reversed(self._sizes()):
            rank, i = divmod(rank, size)
            index.append(i)
        return Coords(*reversed(index))

    def rank_of(self, coords: Coords) -> int:
        """The global rank at ``coords`` (inverse of :meth:`coords`)."""
        rank = 0
        for i, size in zip(coords, self._sizes()):
            rank = rank * size + i
        return rank

    def sp_rank(self, rank: int) -> int:
        """The sequence shard a global rank holds: ``ring_rank * ulysses + ulysses_rank``."""
        c = self.coords(rank)
        return c.ring * self.ulysses + c.ulysses

    def check_heads(self, num_heads: int) -> None:
        """Tensor parallelism, then Ulysses, scatter heads: ``tp * ulysses`` must divide ``num_heads`` (a ring
        degree carries the rest)."""
        if num_heads % (self.tp * self.ulysses):
            raise ValueError(
                f"tp={self.tp} x ulysses={self.ulysses} = {self.tp * self.ulysses} must divide the number of heads "
                f"{num_heads} (both scatter heads); use degrees whose product divides {num_heads} and let the ring "
                f"degree carry the rest"
            )

    def check_model(self, *, num_heads: int, num_layers: int, intermediate_size: int) -> None:
        """Every degree can split the model: heads (:meth:`check_heads`), MLP columns by ``tp``, layers by ``pp``.

        Raises:
            ValueError: naming the degree and the model size it cannot split.
        """
        self.check_heads(num_heads)
        if intermediate_size % self.tp:
            raise ValueError(f"tp={self.tp} must divide the MLP width intermediate_size={intermediate_size}")
        if num_layers < self.pp:
            raise ValueError(f"pp={self.pp} pipeline stages need at least {self.pp} layers, the model has {num_layers}")

    def group_ranks(self) -> dict[str, list[list[int]]]:
        """Global ranks of every group of each kind (pure arithmetic, no processes needed).

        Kinds: ``tp``, ``ulysses``, ``ring``, ``sp`` (Ulysses x ring), ``dp`` (same position in every other
        axis across replicas), ``sdp`` (sequence x data: the group ZeRO partitions over, one per tensor and
        pipeline rank), ``pp`` (the stages of one pipeline). Within a group, ranks are ordered by their index along
        the group's axes.
        """
        spans = {"tp": ("tp",), "ulysses": ("ulysses",), "ring": ("ring",), "sp": ("ring", "ulysses"),
                 "dp": ("dp",), "sdp": ("dp", "ring", "ulysses"), "pp": ("pp",)}
        return {kind: self._groups_along(axes) for kind, axes in spans.items()}

    def _groups_along(self, axes: tuple[str, ...]) -> list[list[int]]:
        fixed = [a for a in _AXES if a not in axes]
        groups = []
        for outer in itertools.product(*(range(getattr(self, a)) for a in fixed)):
            base = dict(zip(fixed, outer))
            ranks = []
            for inner in itertools.product(*(range(getattr(self, a)) for a in axes)):
                index = {**base, **dict(zip(axes, inner))}
                ranks.append(self.rank_of(Coords(**index)))
            groups.append(ranks)
        return sorted(groups)


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


class DeepSpeedMPU:
    """The ``mpu`` object ``deepspeed.initialize(mpu=...)`` reads, backed by explicit groups.

    DeepSpeed's engine broadcasts parameters, reduces gradients and partitions ZeRO state over the
    sequence-data-parallel group when the mpu exposes the ``get_sequence_*`` methods; its model-parallel group is
    the tensor-parallel group (parameters differ across it; gradient norms are summed over it).
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
        return self.groups.dims.sp * self.groups.dims.dp

    def get_sequence_data_parallel_rank(self) -> int:
        return self.groups.sdp_rank

    # data parallel
    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.groups.dp

    def get_data_parallel_world_size(self) -> int:
        return self.groups.dims.dp

    def get_data_parallel_rank(self) -> int:
        return self.groups.dp_rank

    def get_data_parallel_group_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.groups.dp)

    # model (tensor) parallel
    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self.groups.tp

    def get_model_parallel_world_size(self) -> int:
        return self.groups.dims.tp

    def get_model_parallel_rank(self) -> int:
        return self.groups.tp_rank

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank
