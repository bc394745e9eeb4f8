"""One Evoformer block across ranks: axial (1-D) context parallelism with single-process semantics.

FastFold's Dynamic Axial Parallelism (Cheng et al. 2022) splits the MSA ``m [*, N_seq, N_res, C_m]`` and the pair
representation ``z [*, N_res, N_res, C_z]`` along one axis over P ranks and switches the axis with all-to-alls
between the sub-modules that need the other one whole. Here, per block (AF2 supplement Algorithm 6):

============================  ==================  ==============================================================
sub-module                    layout              what is gathered (its backward: a reduce-scatter)
============================  ==================  ==============================================================
MSA row attention, pair bias  m by sequences      the pair bias ``[N_res, N_res, H]`` from z's rows
MSA column attention          m by residues       -
MSA transition                m by residues       -
outer product mean            m by residues       ``b [N_seq, N_res, c]`` (z's rows i come out of m's columns i)
triangle mult. outgoing       z by rows           ``b [N_res, N_res, c]``
triangle mult. incoming       z by columns        ``a [N_res, N_res, c]``
triangle attention, start     z by rows           the triangle bias ``[N_res, N_res, H]``
triangle attention, end       z by columns        the triangle bias ``[N_res, N_res, H]``
pair transition               z by columns        -
============================  ==================  ==============================================================

with all-to-alls m: sequences -> residues, z: rows -> columns -> rows -> columns. Every collective is ds4sci's
differentiable one (:mod:`ds4sci.parallel.tensor_parallel`, :mod:`ds4sci.sequence.comm`) with its adjoint in
backward: an internal all-gather's backward reduce-scatters, so the gradient of a gathered tensor sums what every
rank's part of the computation contributed (FastFold's gather splits instead, dropping the other ranks' terms).

Entry and exit: the block takes and returns full tensors on every rank. The entry split's backward all-gathers, the
exit gather's backward takes this rank's piece, and the parameters are used through an identity whose backward
all-reduces their gradient over the group (as DDP would), so when every rank computes the same loss on the full
outputs, every rank's input gradients and parameter ``.grad`` equal the single process's.

N_seq and N_res of any length: both are padded at their end to a multiple of P with masked (zero-mask) rows,
which no real position attends to or sums over (attention masks them, the outer product mean and the triangle
multiplications multiply them by their zero mask), and cut off again at the exit. Dropout draws its masks per rank
in training; exact single-process equality holds in eval mode (or at rate 0).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ds4sci.models.evoformer import EvoformerBlock
from ds4sci.parallel.tensor_parallel import _all_gather, _reduce_scatter, _SequenceRegion, _split, \
    split_sequence_region, sync_grad
from ds4sci.sequence.comm import all_to_all, group_rank, group_size
from ds4sci.sequence.sharding import pad_to_multiple

__all__ = ["evoformer_context_parallel", "EvoformerContextParallel"]


def _gather(x: Tensor, group, dim: int) -> Tensor:
    """An internal gather: all-gather along ``dim``; backward reduce-scatters (every rank's use contributes)."""
    return _SequenceRegion.apply(x, group, dim, None, _all_gather, _reduce_scatter)


def _gather_out(x: Tensor, group, dim: int) -> Tensor:
    """The exit gather: all-gather along ``dim``; backward keeps this rank's piece (the loss is every rank's)."""
    return _SequenceRegion.apply(x, group, dim, None, _all_gather, _split)


class _AxialEvoformer(nn.Module):
    """The sharded computation of one :class:`EvoformerBlock` (module docstring); ``block`` is the caller's."""

    def __init__(self, block: EvoformerBlock, group):
        super().__init__()
        self.block, self.group = block, group

    def forward(self, m: Tensor, z: Tensor, msa_mask: Tensor | None, pair_mask: Tensor | None,
                chunk_size: int | None) -> tuple[Tensor, Tensor]:
        g, blk = self.group, self.block
        p, r = group_size(g), group_rank(g)
        n_seq, n_res = m.shape[-3], m.shape[-2]
        msa_mask = m.new_ones(m.shape[:-1]) if msa_mask is None else msa_mask.to(m.dtype).expand(m.shape[:-1])
        pair_mask = z.new_ones(z.shape[:-1]) if pair_mask is None else pair_mask.to(z.dtype).expand(z.shape[:-1])
        # [*, S, N, C] -> [*, S', N', C], S' and N' multiples of p; the pad rows are masked out
        m = pad_to_multiple(pad_to_multiple(m, -3, p), -2, p)
        z = pad_to_multiple(pad_to_multiple(z, -3, p), -2, p)
        msa_mask = pad_to_multiple(pad_to_multiple(msa_mask, -2, p), -1, p)  # [*, S', N']
        pair_mask = pad_to_multiple(pad_to_multiple(pair_mask, -2, p), -1, p)  # [*, N', N']
        seqs, res = msa_mask.shape[-2] // p, msa_mask.shape[-1] // p
        mine_s, mine_n = slice(r * seqs, (r + 1) * seqs), slice(r * res, (r + 1) * res)
        mask_s, mask_c = msa_mask[..., mine_s, :], msa_mask[..., mine_n]  # [*, S'/p, N'], [*, S', N'/p]
        pm_rows, pm_cols = pair_mask[..., mine_n, :], pair_mask[..., mine_n]  # [*, N'/p, N'], [*, N', N'/p]

        def gathered(x, dim):
            return _gather(x, g, dim)

        def rows_to_cols(x):  # [*, A/p, B, C] -> [*, A, B/p, C]
            return all_to_all(x, g, scatter_dim=x.ndim - 2, gather_dim=x.ndim - 3)

        def cols_to_rows(x):  # [*, A, B/p, C] -> [*, A/p, B, C]
            return all_to_all(x, g, scatter_dim=x.ndim - 3, gather_dim=x.ndim - 2)

        def opm(m_c, z_r):  # z's rows i are m's residues i: this rank's columns of m
            a, b, mask_a = blk.outer_product_mean.project(m_c, mask_c)  # [*, S', N'/p, c]
            return z_r + blk.outer_product_mean.outer(a, gathered(b, b.ndim - 2), mask_a, msa_mask, chunk_size)

        m_s = split_sequence_region(m, g, m.ndim - 3)  # [*, S'/p, N', C_m]
        z_r = split_sequence_region(z, g, z.ndim - 3)  # [*, N'/p, N', C_z]
        if blk.opm_first:
            z_r = opm(rows_to_cols(m_s), z_r)
        bias = gathered(blk.msa_att_row.pair_bias_of(z_r), z_r.ndim - 3)  # [*, N', N', H]
        m_s = m_s + blk.msa_dropout_layer(blk.msa_att_row(m_s, None, mask_s, chunk_size, bias=bias))
        m_c = rows_to_cols(m_s)  # [*, S', N'/p, C_m]
        if not blk.no_column_attention:
            m_c = m_c + blk.msa_att_col(m_c, mask_c, chunk_size)
        m_c = m_c + blk.msa_transition(m_c, mask_c, chunk_size)
        if not blk.opm_first:
            z_r = opm(m_c, z_r)
        z_c = self._pair_stack(z_r, pm_rows, pm_cols, chunk_size, gathered, rows_to_cols, cols_to_rows)
        m = _gather_out(m_c, g, m_c.ndim - 2)[..., :n_seq, :n_res, :]
        z = _gather_out(z_c, g, z_c.ndim - 2)[..., :n_res, :n_res, :]
        return m, z

    def _pair_stack(self, z_r, pm_rows, pm_cols, chunk_size, gathered, rows_to_cols, cols_to_rows) -> Tensor:
        """The pair stack on z by rows ``[*, N'/p, N', C_z]``; returns z by columns ``[*, N', N'/p, C_z]``."""
        ps = self.block.pair_stack
        rows, cols = z_r.ndim - 3, z_r.ndim - 2
        mul = ps.tri_mul_out  # outgoing: p_ij = sum_k a_ik b_jk: this rank's rows i of a, every row j of b
        x = mul.layer_norm_in(z_r)
        a, b = mul.projections(x, pm_rows.unsqueeze(-1))
        z_r = z_r + ps.dropout_row(mul.finish(x, mul.combine(a, gathered(b, rows))))
        z_c = rows_to_cols(z_r)
        mul = ps.tri_mul_in  # incoming: p_ij = sum_k a_ki b_kj: every column i of a, this rank's columns j of b
        x = mul.layer_norm_in(z_c)
        a, b = mul.projections(x, pm_cols.unsqueeze(-1))
        z_c = z_c + ps.dropout_row(mul.finish(x, mul.combine(gathered(a, cols), b)))
        z_r = cols_to_rows(z_c)
        bias = gathered(ps.tri_att_start.triangle_bias(z_r), rows)
        z_r = z_r + ps.dropout_row(ps.tri_att_start(z_r, pm_rows, chunk_size, bias=bias))
        z_c = rows_to_cols(z_r)
        bias = gathered(ps.tri_att_end.triangle_bias(z_c), cols)
        z_c = z_c + ps.dropout_col(ps.tri_att_end(z_c, pm_cols, chunk_size, transpose_bias=ps.transpose_end_bias,
                                                  bias=bias))
        return z_c + ps.pair_transition(z_c, pm_cols, chunk_size)


class EvoformerContextParallel(nn.Module):
    """An :class:`~ds4sci.models.evoformer.EvoformerBlock` run across the ranks of ``group`` (module docstring), with
    the block's call signature: ``forward(m [*, N_seq, N_res, C_m], z [*, N_res, N_res, C_z], msa_mask=None
    [*, N_seq, N_res], pair_mask=None [*, N_res, N_res], chunk_size=None) -> (m, z)``, full tensors in and out on
    every rank (each rank passes the same inputs). Holds the given block (its parameters, not a copy): its state dict
    is the block's. A group of one runs the block itself."""

    def __init__(self, block: EvoformerBlock, group=None):
        super().__init__()
        if not isinstance(block, EvoformerBlock):
            raise TypeError(f"evoformer_context_parallel: expected a ds4sci EvoformerBlock, got {type(block).__name__}")
        self.block = block
        self.group = group if group is not None or not dist.is_initialized() else dist.group.WORLD
        self._sharded = (_AxialEvoformer(block, self.group),)  # a tuple: not a second path to the parameters

    def forward(self, m: Tensor, z: Tensor, msa_mask: Tensor | None = None, pair_mask: Tensor | None = None,
                chunk_size: int | None = None) -> tuple[Tensor, Tensor]:
        if group_size(self.group) == 1:
            return self.block(m, z, msa_mask, pair_mask, chunk_size)
        sharded = self._sharded[0]
        synced = {f"block.{name}": sync_grad(p, self.group) for name, p in self.block.named_parameters()}
        return torch.func.functional_call(sharded, synced, (m, z, msa_mask, pair_mask, chunk_size))


def evoformer_context_parallel(block: EvoformerBlock, group=None, mesh: tuple[int, int] | None = None) -> nn.Module:
    """``block`` run across ``group`` (default: every rank of the default process group) by axial context
    parallelism: :class:`EvoformerContextParallel` (module docstring: layouts, collectives, exactness); with
    ``mesh=(p, p)``, on a p x p mesh of the group's ranks by 2-D tiles:
    :class:`~ds4sci.parallel.evoformer_cp2d.EvoformerContextParallel2D` (same call signature and semantics)."""
    if mesh is None:
        return EvoformerContextParallel(block, group)
    from ds4sci.parallel.evoformer_cp2d import EvoformerContextParallel2D, check_mesh

    group = group if group is not None or not dist.is_initialized() else dist.group.WORLD
    p = check_mesh(mesh, group_size(group))
    return EvoformerContextParallel(block, group) if p == 1 else EvoformerContextParallel2D(block, group, p)
