"""Evoformer and Pairformer blocks, and stacks of them, across ranks: axial (1-D) context parallelism with
single-process semantics (FastFold's Dynamic Axial Parallelism, Cheng et al. 2022, on ds4sci's collectives).

The MSA ``m [*, N_seq, N_res, C_m]`` and the pair ``z [*, N_res, N_res, C_z]`` are split along one axis over P
ranks, switched by all-to-alls between the sub-modules of a block (AF2 supplement Algorithm 6) that need the other
axis whole: MSA row attention on m by sequences (gathering the pair bias ``[N_res, N_res, H]`` from z's rows);
column attention, transition and outer product mean on m by residues (gathering the outer product's ``b``); triangle
multiplication outgoing / incoming on z by rows / columns (gathering ``b`` / ``a``; the steps of
:mod:`ds4sci.kernels.trimul`: operands and output recomputed in backward, the product by ``channel_product``);
triangle attention starting / ending on z by rows / columns (gathering the triangle bias); pair transition on z by
columns. An internal gather's backward reduce-scatters, so a gathered tensor's gradient sums every rank's
contribution (FastFold's split-only backward drops the other ranks' terms).

Pairformer blocks (AF3 supplement Algorithm 17): the same pair stack, then the single representation ``s`` replicated
on every rank (its attention's bias gathered from z's columns; its cost ``O(N^2 H c)`` is small beside the pair
stack's ``O(N^3 c)``); the replicated s-side's gradients are every rank's whole and not all-reduced.

Stacks run block after block, each block its own region (full tensors between blocks) or, ``sharded=True``, m and z
split from the stack's entry to its exit, switched back (m: residues -> sequences, z: columns -> rows) between blocks.
N_seq and N_res of any length are padded to multiples of P with masked rows (attention masks the padding keys with
-inf) and cut off at the exit; exact single-process equality in eval mode (dropout draws per rank).

Bytes sent per rank per block inside a sharded stack, training (:func:`block_comm_bytes`; ``f = (P-1)/P``, ``N``,
``S`` padded, ``B`` batch, ``e`` bytes per element), plus the parameter gradients' all-reduce ``2 f |params| e``::

    evoformer  = 2 f B e [N^2 (H_msa + 2 c_mul + 2 H_pair) + S N c_opm + (4 N^2 C_z + (2 + opm_first) S N C_m) / P]
    pairformer = 2 f B e [N^2 (2 c_mul + 2 H_pair) + 4 N^2 C_z / P] + f B e N^2 H_s
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch import nn

from ds4sci.distributed.comm import CommCounter
from ds4sci.distributed.comm import SequenceRegion
from ds4sci.distributed.comm import all_gather
from ds4sci.distributed.comm import all_to_all
from ds4sci.distributed.comm import group_rank
from ds4sci.distributed.comm import group_size
from ds4sci.distributed.comm import reduce_scatter
from ds4sci.distributed.comm import split_sequence_region
from ds4sci.kernels import TriMulParams
from ds4sci.kernels.trimul import channel_product
from ds4sci.kernels.trimul import triangle_finish
from ds4sci.kernels.trimul import triangle_operand
from ds4sci.models.evoformer import EvoformerBlock
from ds4sci.models.evoformer import PairformerBlock
from ds4sci.parallel.evoformer.common import Blocks
from ds4sci.parallel.evoformer.common import HeldBlocks
from ds4sci.parallel.evoformer.common import ceil_div
from ds4sci.parallel.evoformer.common import default_group
from ds4sci.parallel.evoformer.common import gather_leading
from ds4sci.parallel.evoformer.common import gather_out
from ds4sci.parallel.evoformer.common import padding_keys
from ds4sci.parallel.evoformer.common import param_grad_bytes
from ds4sci.parallel.evoformer.common import synced_parameters
from ds4sci.sequence.sharding import pad_to_multiple

__all__ = ["block_comm_bytes", "EvoformerContextParallel"]


class _Axes:
    """One call's group, padded masks and layout switches. ``msa_mask [*, S', N']`` (Evoformer) and
    ``pair_mask [*, N', N']`` are padded to multiples of P with zeros; ``mine_s``, ``mine_n``: this rank's
    sequences and residues; ``key_*``: the attentions' masks, padding keys at -inf
    (:func:`~ds4sci.parallel.evoformer.common.padding_keys`)."""

    def __init__(self, group, counter: CommCounter | None, chunk_size: int | None, pair_mask: Tensor,
                 msa_mask: Tensor | None):
        self.group, self.counter, self.chunk_size = group, counter, chunk_size
        self.p, r = group_size(group), group_rank(group)
        n_res = pair_mask.shape[-1]
        self.pair_mask = pad_to_multiple(pad_to_multiple(pair_mask, -2, self.p), -1, self.p)  # [*, N', N']
        res = self.pair_mask.shape[-1] // self.p
        self.mine_n = slice(r * res, (r + 1) * res)
        self.pm_rows, self.pm_cols = self.pair_mask[..., self.mine_n, :], self.pair_mask[..., self.mine_n]
        # the triangle attentions' keys: along the rows (starting node), along the columns (ending node)
        self.key_rows, self.key_cols = padding_keys(self.pm_rows, -1, n_res), padding_keys(self.pm_cols, -2, n_res)
        if msa_mask is not None:
            n_seq = msa_mask.shape[-2]
            self.msa_mask = pad_to_multiple(pad_to_multiple(msa_mask, -2, self.p), -1, self.p)  # [*, S', N']
            seqs = self.msa_mask.shape[-2] // self.p
            self.mask_s = self.msa_mask[..., r * seqs:(r + 1) * seqs, :]  # [*, S'/p, N']
            self.mask_c = self.msa_mask[..., self.mine_n]  # [*, S', N'/p]
            # MSA row attention's keys are residues, column attention's sequences
            self.key_s, self.key_c = padding_keys(self.mask_s, -1, n_res), padding_keys(self.mask_c, -2, n_seq)

    def split(self, x: Tensor, dim: int) -> Tensor:
        """Entry: the full (padded) tensor -> this rank's piece along ``dim`` (backward: all-gather)."""
        return split_sequence_region(x, self.group, x.ndim + dim, self.counter)

    def gather(self, x: Tensor, dim: int) -> Tensor:
        """An internal gather along ``dim``; backward reduce-scatters (every rank's use contributes)."""
        return SequenceRegion.apply(x, self.group, x.ndim + dim, self.counter, all_gather, reduce_scatter)

    def gather_out(self, x: Tensor, dim: int) -> Tensor:
        """A gather whose every rank's use is the same (the exit; the replicated s-side): backward keeps this rank's
        piece."""
        return gather_out(x, self.group, x.ndim + dim, self.counter)

    def rows_to_cols(self, x: Tensor) -> Tensor:  # [*, A/p, B, C] -> [*, A, B/p, C]
        return all_to_all(x, self.group, scatter_dim=x.ndim - 2, gather_dim=x.ndim - 3, counter=self.counter)

    def cols_to_rows(self, x: Tensor) -> Tensor:  # [*, A, B/p, C] -> [*, A/p, B, C]
        return all_to_all(x, self.group, scatter_dim=x.ndim - 3, gather_dim=x.ndim - 2, counter=self.counter)


def _evoformer(blk: EvoformerBlock, m_s: Tensor, z_r: Tensor, ax: _Axes) -> tuple[Tensor, Tensor]:
    """One Evoformer block on m by sequences ``[*, S'/p, N', C_m]`` and z by rows ``[*, N'/p, N', C_z]``; returns m
    by residues ``[*, S', N'/p, C_m]`` and z by columns ``[*, N', N'/p, C_z]`` (module docstring)."""
    chunk_size = ax.chunk_size

    def opm(m_c, z_r):  # z's rows i are m's residues i: this rank's columns of m
        a, b, mask_a = blk.outer_product_mean.project(m_c, ax.mask_c)  # [*, S', N'/p, c]
        return z_r + blk.outer_product_mean.outer(a, ax.gather(b, -2), mask_a, ax.msa_mask, chunk_size)

    if blk.opm_first:
        z_r = opm(ax.rows_to_cols(m_s), z_r)
    bias = ax.gather(blk.msa_att_row.pair_bias_of(z_r), -3)  # [*, N', N', H]
    m_s = m_s + blk.msa_dropout_layer(blk.msa_att_row(m_s, None, ax.key_s, chunk_size, bias=bias))
    m_c = ax.rows_to_cols(m_s)  # [*, S', N'/p, C_m]
    if not blk.no_column_attention:
        m_c = m_c + blk.msa_att_col(m_c, ax.key_c, chunk_size)
    m_c = m_c + blk.msa_transition(m_c, ax.mask_c, chunk_size)
    if not blk.opm_first:
        z_r = opm(m_c, z_r)
    return m_c, _pair_stack(blk.pair_stack, z_r, ax)


def _pairformer(blk: PairformerBlock, s: Tensor, z_r: Tensor, single_mask: Tensor | None,
                ax: _Axes) -> tuple[Tensor, Tensor]:
    """One Pairformer block on s whole ``[*, N, C_s]`` and z by rows ``[*, N'/p, N', C_z]``; returns s whole and z by
    columns ``[*, N', N'/p, C_z]`` (module docstring: the s-side is replicated)."""
    n = s.shape[-2]
    z_c = _pair_stack(blk.pair_stack, z_r, ax)
    apb = blk.attn_pair_bias
    bias = ax.gather_out(apb.pair_bias_of(z_c), -2)[..., :n, :n, :]  # [*, N, N, H], every rank the same
    s = s + apb(s, None, single_mask, bias=bias)
    return s + blk.single_transition(s, single_mask, ax.chunk_size), z_c


def _triangle_update(mul, z: Tensor, mask: Tensor, ax: _Axes) -> Tensor:
    """A triangle multiplicative update of z by rows ``[*, N'/p, N', C_z]`` (outgoing: ``p_ij = sum_k a_ik b_jk``,
    this rank's rows i of a, every row j of b, gathered) or by columns ``[*, N', N'/p, C_z]`` (incoming: ``p_ij =
    sum_k a_ki b_kj``, every column i of a, gathered, this rank's columns j of b), by the steps of
    :mod:`ds4sci.kernels.trimul` on channel-major operands ``[*, c, ., .]``; ``mask`` z's ``[*, ., .]``. This rank's
    operand first, the gathered one second; each dies once the product is made."""
    w, eps, outgoing = TriMulParams.from_module(mul), mul.layer_norm_in.eps, mul.outgoing
    mine = triangle_operand(z, mask, w, "a" if outgoing else "b", eps)
    other = ax.gather(triangle_operand(z, mask, w, "b" if outgoing else "a", eps), -2 if outgoing else -1)
    p = channel_product(mine, other, True) if outgoing else channel_product(other, mine, False)
    del mine, other
    return triangle_finish(z, p, w, eps)


def _pair_stack(ps, z_r: Tensor, ax: _Axes) -> Tensor:
    """The pair stack on z by rows ``[*, N'/p, N', C_z]``; returns z by columns ``[*, N', N'/p, C_z]``."""
    chunk_size, pm_rows, pm_cols = ax.chunk_size, ax.pm_rows, ax.pm_cols
    z_r = z_r + ps.dropout_row(_triangle_update(ps.tri_mul_out, z_r, pm_rows, ax))
    z_c = ax.rows_to_cols(z_r)
    z_c = z_c + ps.dropout_row(_triangle_update(ps.tri_mul_in, z_c, pm_cols, ax))
    z_r = ax.cols_to_rows(z_c)
    bias = ax.gather(ps.tri_att_start.triangle_bias(z_r), -3)
    z_r = z_r + ps.dropout_row(ps.tri_att_start(z_r, ax.key_rows, chunk_size, bias=bias))
    z_c = ax.rows_to_cols(z_r)
    bias = ax.gather(ps.tri_att_end.triangle_bias(z_c), -2)
    z_c = z_c + ps.dropout_col(ps.tri_att_end(z_c, ax.key_cols, chunk_size, transpose_bias=ps.transpose_end_bias,
                                              bias=bias))
    return z_c + ps.pair_transition(z_c, pm_cols, chunk_size)


class _AxialStack(nn.Module):
    """The sharded computation of blocks run one after the other with m and z split between them (module
    docstring); ``blocks`` are the caller's."""

    def __init__(self, blocks: nn.ModuleList, group, counter: CommCounter | None):
        super().__init__()
        self.blocks, self.group, self.counter = blocks, group, counter

    def forward(self, x: Tensor, z: Tensor, x_mask: Tensor | None, pair_mask: Tensor | None,
                chunk_size: int | None) -> tuple[Tensor, Tensor]:
        """``x``: m ``[*, N_seq, N_res, C_m]`` (Evoformer) or s ``[*, N, C_s]`` (Pairformer); ``x_mask`` its mask."""
        evoformer = isinstance(self.blocks[0], EvoformerBlock)
        n_seq, n_res = x.shape[-3], z.shape[-2]
        pair_mask = z.new_ones(z.shape[:-1]) if pair_mask is None else pair_mask.to(z.dtype).expand(z.shape[:-1])
        msa_mask = None
        if evoformer:
            msa_mask = x.new_ones(x.shape[:-1]) if x_mask is None else x_mask.to(x.dtype).expand(x.shape[:-1])
        ax = _Axes(self.group, self.counter, chunk_size, pair_mask, msa_mask)
        # [*, N, N, C_z] -> [*, N', N', C_z] -> z by rows [*, N'/p, N', C_z]; the pad rows are masked out
        z_r = ax.split(pad_to_multiple(pad_to_multiple(z, -3, ax.p), -2, ax.p), -3)
        if evoformer:  # [*, S, N, C_m] -> [*, S', N', C_m] -> m by sequences [*, S'/p, N', C_m]
            x = ax.split(pad_to_multiple(pad_to_multiple(x, -3, ax.p), -2, ax.p), -3)

        def run(blk, x, z_r):
            return _evoformer(blk, x, z_r, ax) if evoformer else _pairformer(blk, x, z_r, x_mask, ax)

        x, z_c = run(self.blocks[0], x, z_r)
        for blk in self.blocks[1:]:  # z by columns -> by rows; m by residues -> by sequences
            z_r = ax.cols_to_rows(z_c)
            x = ax.cols_to_rows(x) if evoformer else x
            x, z_c = run(blk, x, z_r)
        if evoformer:
            x = gather_leading(x, self.group, x.ndim - 2, self.counter)[..., :n_seq, :n_res, :]
        return x, gather_leading(z_c, self.group, z_c.ndim - 2, self.counter)[..., :n_res, :n_res, :]


class EvoformerContextParallel(HeldBlocks):
    """An :class:`~ds4sci.models.evoformer.EvoformerBlock` or :class:`~ds4sci.models.evoformer.PairformerBlock`, or a
    stack of blocks of one kind, run across the ranks of ``group`` (module docstring), called as the block is
    (:class:`~ds4sci.parallel.evoformer.common.HeldBlocks`): Evoformer ``(m [*, N_seq, N_res, C_m], z [*, N_res,
    N_res, C_z], msa_mask [*, N_seq, N_res], pair_mask [*, N_res, N_res], chunk_size) -> (m, z)``, Pairformer ``(s
    [*, N, C_s], z, single_mask [*, N], pair_mask, chunk_size) -> (s, z)``, full tensors in and out on every rank
    (each rank passes the same inputs). ``sharded``: a stack keeps m and z split between its blocks. ``counter``
    records this rank's collectives. A group of one runs the blocks themselves."""

    def __init__(self, block_or_stack: Blocks, group=None, *, sharded: bool = False,
                 counter: CommCounter | None = None):
        super().__init__(block_or_stack, sharded)
        self.group, self.counter = default_group(group), counter
        # a tuple: not a second path to the parameters
        self._regions = tuple(_AxialStack(nn.ModuleList(r), self.group, counter) for r in self.block_groups)

    def forward(self, *args, **kwargs) -> tuple[Tensor, Tensor]:
        x, z, x_mask, pair_mask, chunk_size = self.bind(args, kwargs)
        if group_size(self.group) == 1:
            for region in self._regions:
                for blk in region.blocks:
                    x, z = blk(x, z, x_mask, pair_mask, chunk_size)
            return x, z
        for region in self._regions:
            x, z = torch.func.functional_call(region, synced_parameters(region, self.group, self.counter),
                                              (x, z, x_mask, pair_mask, chunk_size))
        return x, z


def block_comm_bytes(block: EvoformerBlock | PairformerBlock, p: int, n_res: int, n_seq: int = 0, batch: int = 1,
                     itemsize: int = 4) -> dict[str, int]:
    """The closed form (module docstring) of the bytes this rank sends for one ``block`` inside a sharded stack of
    the group size ``p``, training (forward and backward), per collective kind as
    :class:`~ds4sci.sequence.CommCounter` records them: ``all_gather``, ``reduce_scatter``, ``all_to_all`` and
    ``all_reduce`` (the parameter gradients); ``n_seq`` for an Evoformer block; ``itemsize`` of the activations."""
    n, s = ceil_div(n_res, p) * p, ceil_div(n_seq, p) * p  # padded
    f, ps = (p - 1) / p, block.pair_stack
    c_mul, h_pair = ps.tri_mul_out.c_hidden, ps.tri_att_start.no_heads
    if isinstance(block, EvoformerBlock):
        gathered = (n * n * (block.msa_att_row.no_heads + 2 * c_mul + 2 * h_pair)
                    + s * n * block.outer_product_mean.c_hidden)
        switched = 4 * n * n * block.c_z + (2 + block.opm_first) * s * n * block.c_m
        replicated = 0
    else:
        gathered = n * n * (2 * c_mul + 2 * h_pair)
        switched = 4 * n * n * ps.tri_mul_out.c_z
        replicated = n * n * block.attn_pair_bias.linear_z.out_features  # forward only
    unit = batch * itemsize
    return {"all_gather": round(f * unit * (gathered + replicated)), "reduce_scatter": round(f * unit * gathered),
            "all_to_all": round(2 * f * unit * switched / p),
            "all_reduce": param_grad_bytes(block, p)}
