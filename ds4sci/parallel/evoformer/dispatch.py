"""``evoformer_context_parallel``: the one entry to Evoformer context parallelism, choosing the axial (1-D) layout
(:mod:`ds4sci.parallel.evoformer.axial`) or the p x p mesh of tiles (:mod:`ds4sci.parallel.evoformer.mesh2d`)."""
from __future__ import annotations

from torch import nn

from ds4sci.distributed.comm import CommCounter
from ds4sci.distributed.comm import group_size
from ds4sci.parallel.evoformer.axial import EvoformerContextParallel
from ds4sci.parallel.evoformer.common import Blocks
from ds4sci.parallel.evoformer.common import default_group
from ds4sci.parallel.evoformer.mesh2d import EvoformerContextParallel2D
from ds4sci.parallel.evoformer.mesh2d import check_mesh

__all__ = ["evoformer_context_parallel"]


def evoformer_context_parallel(block_or_stack: Blocks, group=None, mesh: tuple[int, int] | None = None, *,
                               sharded: bool = False, counter: CommCounter | None = None) -> nn.Module:
    """``block_or_stack`` (an Evoformer or Pairformer block, or a sequence of blocks of one kind) run across
    ``group`` (default: every rank of the default process group) by axial context parallelism
    (:class:`~ds4sci.parallel.evoformer.axial.EvoformerContextParallel`); with ``mesh=(p, p)``, on a p x p mesh of
    the group's ranks by 2-D tiles (:class:`~ds4sci.parallel.evoformer.mesh2d.EvoformerContextParallel2D`). Either
    is called as the block is, by position or by the block's own argument names (``m, z, msa_mask, pair_mask,
    chunk_size`` or ``s, z, single_mask, pair_mask, chunk_size``), with single-process outputs and gradients.
    ``sharded``: a stack keeps m and z split (1-D) or tiled (2-D) between its blocks; ``counter`` records this
    rank's collectives."""
    group = default_group(group)
    if mesh is None:
        return EvoformerContextParallel(block_or_stack, group, sharded=sharded, counter=counter)
    p = check_mesh(mesh, group_size(group))
    return (EvoformerContextParallel(block_or_stack, group, sharded=sharded, counter=counter) if p == 1
            else EvoformerContextParallel2D(block_or_stack, group, p, sharded=sharded, counter=counter))
