"""Parallel degrees, the sequence layout and every rank coordinate, as arithmetic (no torch, no processes).

One validated object, :class:`ParallelDims`, holds the five degrees (tensor, Ulysses, ring, data, pipeline) and the
sequence :class:`Layout`, and derives every rank coordinate; their product is the world size. The process groups
(:mod:`ds4sci.distributed.groups`), the sequence-parallel layers (:mod:`ds4sci.sequence`) and the planner
(:mod:`ds4sci.planning`) all read it, so this module imports nothing heavier than the standard library.

Rank layout, innermost first, in the order of the USP paper (Fang & Zhao 2024, "USP: A Unified Sequence
Parallelism Approach for Long Context Generative AI", section 5): TP < Ulysses < Ring < DP < PP, so the
chattiest groups (tensor parallelism's per-layer collectives, then the Ulysses all-to-all) span neighbouring
ranks, i.e. the GPUs of one node::

    rank = (((pp_rank * dp + dp_rank) * ring + ring_rank) * ulysses + ulysses_rank) * tp + tp_rank
    sp_rank = ring_rank * ulysses + ulysses_rank

The sequence is sharded over the SP (Ulysses x ring) group in ``sp_rank`` order by a :class:`Layout`:

- ``contiguous``: shard ``r`` of ``W`` holds ``[r*S/W, (r+1)*S/W)``.
- ``zigzag`` (load-balanced, for causal attention; Brandon et al. 2023 "Striped Attention" and the USP paper's
  load-balanced ring): the sequence is cut into ``2W`` chunks and shard ``r`` holds chunks ``r`` and
  ``2W-1-r``, so every shard holds one early and one late chunk and does the same causal work.

With ``tp = 1`` the SP groups are the contiguous blocks ``[i*sp, (i+1)*sp)`` that DeepSpeed's ``parallel_state_sp``
helper makes. :mod:`ds4sci.sequence.sharding` applies a layout to tensors.
"""
from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["Layout", "Piece", "Coords", "ParallelDims"]

_AXES = ("pp", "dp", "ring", "ulysses", "tp")
"""Mesh axes, outermost first (the rank layout above)."""


@dataclass(frozen=True)
class Piece:
    """A run of rows of a local block: local rows ``[start, start+length)`` hold global positions
    ``[offset, offset+length)``."""

    start: int
    length: int
    offset: int


class Layout(str, enum.Enum):
    """How a sequence is cut over sequence-parallel shards (see the module docstring)."""

    CONTIGUOUS = "contiguous"
    ZIGZAG = "zigzag"

    @classmethod
    def parse(cls, name: str | Layout, ring: int = 1) -> Layout:
        """A layout from its name; ``"auto"`` is zigzag when there is a ring (``ring > 1``), else contiguous."""
        if name == "auto":
            return cls.ZIGZAG if ring > 1 else cls.CONTIGUOUS
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"layout={name!r} is not one of {['auto'] + [m.value for m in cls]}") from None

    def multiple(self, world: int) -> int:
        """The sequence length must be a multiple of this: ``world`` (contiguous) or ``2*world`` (zigzag)."""
        return world if self is Layout.CONTIGUOUS else 2 * world

    def chunks(self, rank: int, world: int) -> tuple[int, ...]:
        """Indices of the :meth:`multiple` equal chunks that shard ``rank`` of ``world`` holds, in order."""
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank={rank} is outside [0, world={world})")
        return (rank,) if self is Layout.CONTIGUOUS else (rank, 2 * world - 1 - rank)

    def pieces(self, ring_rank: int, ring: int, block_len: int) -> list[Piece]:
        """Runs of the ``block_len`` rows a ring rank holds after the Ulysses all-to-all (``S = ring*block_len``)."""
        held = self.chunks(ring_rank, ring)
        if ring == 1:  # the whole sequence, in order (zigzag: chunks 0 and 1 of 2)
            return [Piece(0, block_len, 0)]
        chunk = block_len // len(held)
        return [Piece(i * chunk, chunk, c * chunk) for i, c in enumerate(held)]


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
    def sdp(self) -> int:
        """Sequence x data degree, the ranks ZeRO partitions over: ``sp * dp``."""
        return self.sp * self.dp

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

    def stride(self, axis: str) -> int:
        """Rank distance between neighbours along ``axis``: the product of the degrees inside it in the rank order
        (``tp``: 1, ``ulysses``: ``tp``, ..., ``pp``: ``tp * ulysses * ring * dp``). A group of ``d`` ranks along
        ``axis`` (or along it and the axes outside it, as the sequence x data group from ``ulysses`` to ``dp``) lies
        within an aligned block of ``stride(axis) * d`` consecutive ranks."""
        if axis not in _AXES:
            raise ValueError(f"axis={axis!r} is not one of {_AXES}")
        return math.prod(self._sizes()[_AXES.index(axis) + 1:])

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

    def check_model(self, *, num_heads: int, num_layers: int, intermediate_size: int,
                    num_kv_heads: int | None = None) -> None:
        """Every degree can split the model: heads (:meth:`check_heads`), key/value heads by ``tp`` or ``tp`` by them
        (``None``: one per query head; fewer than ``tp`` are shared by ``tp / num_kv_heads`` ranks each), MLP columns
        by ``tp``, layers by ``pp``.

        Raises:
            ValueError: naming the degree and the model size it cannot split.
        """
        self.check_heads(num_heads)
        kv = num_heads if num_kv_heads is None else num_kv_heads
        if kv % self.tp and self.tp % kv:
            raise ValueError(f"tp={self.tp} and num_kv_heads={kv}: one must divide the other (each rank holds "
                             f"num_kv_heads/tp key/value heads, or one shared by tp/num_kv_heads ranks)")
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
