"""Which node each rank runs on, and whether a parallel dimension's groups stay inside one node (no torch).

Launchers place ranks node by node in blocks of the processes per node (``per_node``): torchrun's agents,
``srun``'s default block distribution and ``mpiexec``'s default all give ranks ``[k*per_node, (k+1)*per_node)`` to
node ``k`` (:func:`node_of`; a last node may hold fewer). The trainer (refusing tensor- and Ulysses-parallel groups
that span nodes, :func:`cross_node_error`; its start-up block, :func:`describe_nodes`), the inference commands and
the planner (intra- or inter-node bandwidth per group) all ask :func:`inside_node`.

A group kind of :meth:`~ds4sci.distributed.dims.ParallelDims.group_ranks` spans consecutive axes of the rank order,
so each of its groups is ``degree`` ranks ``stride`` apart, and together a block of them fills the aligned run of
``stride * degree`` consecutive ranks. With ``degree > 1`` two groups of one run overlap in rank range, so every group
stays inside a node exactly when every run does: when ``stride * degree`` divides ``per_node``, or when there is
one node (``world_size <= per_node``), whatever the sizes (6 per node with ``tp=4``: the run ``[4, 8)`` spans nodes
0 and 1).
"""
from __future__ import annotations

import math
from typing import Callable

from ds4sci.distributed.dims import ParallelDims

__all__ = ["cross_node_error", "describe_nodes", "inside_node", "node_of", "node_safe_dims"]

#: Parallel dimensions, innermost first (the rank order), as the start-up block names them.
_DIMENSIONS = ("tp", "ulysses", "ring", "dp", "pp")

#: Each group kind's axes, outermost first (:meth:`ParallelDims.group_ranks`'s kinds).
_SPANS = {"tp": ("tp",), "ulysses": ("ulysses",), "ring": ("ring",), "sp": ("ring", "ulysses"), "dp": ("dp",),
          "sdp": ("dp", "ring", "ulysses"), "pp": ("pp",)}

#: The dimensions whose groups must stay inside a node unless allowed: their collectives run every layer.
_NODE_LOCAL = ("tp", "ulysses")


def node_of(rank: int, per_node: int) -> int:
    """The node of global ``rank`` when every node runs ``per_node`` processes, in rank order."""
    if per_node < 1 or rank < 0:
        raise ValueError(f"rank={rank}, per_node={per_node}: need rank >= 0 and per_node >= 1")
    return rank // per_node


def inside_node(dims: ParallelDims, kind: str, per_node: int) -> bool:
    """Whether every group of ``kind`` (``tp``, ``ulysses``, ``ring``, ``sp``, ``dp``, ``sdp`` or ``pp``) of ``dims``
    has all its ranks on one node (:func:`node_of`); degree-1 groups always do.

    Raises:
        ValueError: an unknown kind, or ``per_node < 1``.
    """
    if kind not in _SPANS:
        raise ValueError(f"kind={kind!r} is not one of {tuple(_SPANS)}")
    if per_node < 1:
        raise ValueError(f"per_node={per_node} must be >= 1")
    axes = _SPANS[kind]
    degree = math.prod(getattr(dims, axis) for axis in axes)
    run = dims.stride(axes[-1]) * degree  # the consecutive ranks a block of this kind's groups fills
    return degree == 1 or dims.world_size <= per_node or per_node % run == 0


def describe_nodes(dims: ParallelDims, per_node: int) -> str:
    """Each dimension of degree > 1, innermost first, and where its groups lie: ``tp 2 inside a node, ulysses 2
    across nodes``; ``no parallel dimension`` in a world of one."""
    parts = [f"{axis} {getattr(dims, axis)} {'inside a node' if inside_node(dims, axis, per_node) else 'across nodes'}"
             for axis in _DIMENSIONS if getattr(dims, axis) > 1]
    return ", ".join(parts) or "no parallel dimension"


def node_safe_dims(dims: ParallelDims, per_node: int) -> ParallelDims:
    """The layout nearest ``dims`` on the same world whose tensor- and Ulysses-parallel groups stay inside a node:
    ``tp`` lowered to its largest divisor that divides ``per_node`` (the rest of it goes to ``dp``), then ``ulysses``
    lowered to its largest divisor ``u`` with ``tp * u`` dividing ``per_node`` (the rest goes to ``ring``). ``dims``
    itself when they already do. The heads that ``tp * ulysses`` divided, the smaller degrees divide too."""
    if all(inside_node(dims, axis, per_node) for axis in _NODE_LOCAL):
        return dims
    tp = max(d for d in _divisors(dims.tp) if per_node % d == 0)
    ulysses = max(d for d in _divisors(dims.ulysses) if per_node % (tp * d) == 0)
    return ParallelDims(dp=dims.dp * dims.tp // tp, ulysses=ulysses, ring=dims.ring * dims.ulysses // ulysses,
                        layout=dims.layout, tp=tp, pp=dims.pp)


def cross_node_error(dims: ParallelDims, nodes: int, per_node: int, *,
                     option: Callable[[str, int], str] = lambda key, value: f"parallel.{key}={value}",
                     force: str = "") -> str | None:
    """The one-line refusal of tensor- or Ulysses-parallel groups that span nodes, or None when they stay inside
    one: it names the dimensions, ``nodes x per_node``, and the :func:`node_safe_dims` settings (``option(key,
    value)`` spells each changed one, ``parallel.ring=2`` by default) that keep them inside a node; ``force``, when
    given, is how to go on anyway (``or set parallel.allow_cross_node=true``)."""
    crossing = [axis for axis in _NODE_LOCAL if getattr(dims, axis) > 1 and not inside_node(dims, axis, per_node)]
    if not crossing:
        return None
    safe = node_safe_dims(dims, per_node)
    changed = " ".join(option(axis, getattr(safe, axis)) for axis in ("tp", "ulysses", "ring", "dp")
                       if getattr(safe, axis) != getattr(dims, axis))
    named = " and ".join(f"{axis}={getattr(dims, axis)}" for axis in crossing)
    return (f"{named} groups would span nodes on {nodes} node(s) x {per_node} process(es) per node; {changed} keeps "
            f"them inside a node on the same {dims.world_size} processes{', ' + force if force else ''}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
