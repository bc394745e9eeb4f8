"""ds4sci.distributed: the base of everything parallel, below :mod:`ds4sci.sequence` and :mod:`ds4sci.parallel`.

- :mod:`~ds4sci.distributed.dims`: :class:`ParallelDims` (every degree, the sequence layout, every rank coordinate)
  and the sequence layout's arithmetic (:class:`~ds4sci.distributed.dims.Layout`: contiguous / zigzag); no torch, so
  the planner computes with the same definitions as the trainer;
- :mod:`~ds4sci.distributed.nodes`: which node each rank runs on and whether a dimension's groups stay inside one
  (:func:`~ds4sci.distributed.nodes.inside_node`), torch-free: the trainer, inference and the planner share it;
- :mod:`~ds4sci.distributed.groups`: :func:`~ds4sci.distributed.groups.build_groups` (explicit process groups, no
  global singleton) and DeepSpeed's ``mpu`` adapter;
- :mod:`~ds4sci.distributed.comm`: every differentiable collective (all-to-all, all-gather, reduce-scatter,
  all-reduce, split, ring shifts and point-to-point moves) and one byte counter, :class:`CommCounter`.

This package's own import is torch-free (it exports only the dims); import the other modules by name, e.g.
``from ds4sci.distributed.groups import build_groups``. Importing has no side effects (no process group, no
environment edits).
"""
from ds4sci.distributed.dims import Coords
from ds4sci.distributed.dims import ParallelDims

__all__ = ["Coords", "ParallelDims"]
