"""ds4sci.parallel: the parallel degrees and what is not sequence parallelism (tensor parallelism, process groups,
applying parallelism to a model from outside).

Where each concept lives:

- :mod:`~ds4sci.parallel.dims`: :class:`ParallelDims` (every degree, the sequence layout, every rank coordinate)
  and the sequence layout's arithmetic (:class:`~ds4sci.parallel.dims.Layout`: contiguous / zigzag, exported as
  ``ds4sci.sequence.Layout``); no torch, so the planner (:mod:`ds4sci.planning`) computes with the same definitions
  as the trainer;
- :mod:`~ds4sci.parallel.groups`: :func:`~ds4sci.parallel.groups.build_groups` (explicit process groups, no global
  singleton) and DeepSpeed's ``mpu`` adapter;
- :mod:`~ds4sci.parallel.tensor_parallel`: Megatron tensor parallelism with sequence-parallel norms and a
  vocabulary-parallel embedding, output and loss (``token_loss_for``), and TP state-dict consolidation;
- :mod:`~ds4sci.parallel.parallelize`: ``parallelize``, applying tensor parallelism and the sequence-parallel
  attention of :mod:`ds4sci.sequence` to a GenSLM from outside, and ``materialize_``.

This package's own import is torch-free (it exports only the dims); import the other modules by name, e.g.
``from ds4sci.parallel.groups import build_groups``. Importing has no side effects (no process group, no
environment edits).
"""
from ds4sci.parallel.dims import Coords, ParallelDims

__all__ = ["Coords", "ParallelDims"]
