"""Evoformer and Pairformer blocks and stacks across ranks with single-process semantics: the axial (1-D, FastFold's
DAP) layout in :mod:`~ds4sci.parallel.evoformer.axial`, the p x p mesh of tiles (2-D, Fold-CP's) in
:mod:`~ds4sci.parallel.evoformer.mesh2d` on the tile rings of :mod:`~ds4sci.parallel.evoformer.ring`, what both share
in :mod:`~ds4sci.parallel.evoformer.common`, and the entry that chooses, :func:`evoformer_context_parallel`."""
from ds4sci.parallel.evoformer.axial import EvoformerContextParallel
from ds4sci.parallel.evoformer.dispatch import evoformer_context_parallel
from ds4sci.parallel.evoformer.mesh2d import EvoformerContextParallel2D

__all__ = ["EvoformerContextParallel", "EvoformerContextParallel2D", "evoformer_context_parallel"]
