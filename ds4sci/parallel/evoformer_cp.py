"""Evoformer and Pairformer blocks, and stacks of them, across ranks: axial (1-D) context parallelism with
single-process semantics.

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

Pairformer block (AF3 supplement Algorithm 17): the same pair stack (z: rows -> columns -> rows -> columns), then
the attention over the single representation ``s [*, N, C_s]`` with the pair bias and the single transition. The
s-side is replicated: every rank holds all of s and runs the attention and the transition on it whole, with the
bias ``[*, N_res, N_res, H]`` all-gathered from z's columns. Sharding its queries instead would need the kernel to
attend ``N/P`` queries to ``N`` keys (it takes ``q``, ``k``, ``v`` of one shape), and its cost, ``O(N^2 H c)``, is
small beside the pair stack's ``O(N^3 c)``. Replicated work must not have its gradients summed: every rank computes
the whole of the s-side parameters' gradients (the same on every rank, the single process's), so those parameters
(``attn_pair_bias.layer_norm_a``, ``attn_pair_bias.mha``, ``single_transition``) are not all-reduced, and the bias
gather's backward keeps this rank's columns of the bias gradient (each rank holds all of it) instead of summing.

Stacks: a sequence of blocks of one kind (an ``nn.ModuleList``) runs block after block. By default every block is
its own region (full tensors between blocks: each block splits m and z at entry and gathers them at exit);
``sharded=True`` keeps m and z split between blocks: one split at the stack's entry, one gather at its exit, and
between blocks the all-to-alls m: residues -> sequences and z: columns -> rows (``1/P`` of a gather's bytes).

Entry and exit: the block (or stack) takes and returns full tensors on every rank. The entry split's backward
all-gathers, the exit gather's backward takes this rank's piece, and the parameters are used through an identity
whose backward all-reduces their gradient over the group (as DDP would), so when every rank computes the same loss
on the full outputs, every rank's input gradients and parameter ``.grad`` equal the single process's. The exit
receives each gather into the tensor it returns (:func:`gather_leading`), so m and z come back as permuted views,
not contiguous, and a rank holds each whole once at the end of forward, not its received pieces beside their
concatenation.

N_seq and N_res of any length: both are padded at their end to a multiple of P with masked (zero-mask) rows,
which no real position attends to or sums over (attention masks them with -inf, not the blocks' finite ``inf``, so
that a real row whose real keys are all masked attends over them alone, as in the single process; the outer
product mean and the triangle multiplications multiply them by their zero mask), and cut off again at the exit. Dropout draws its masks per rank
in training; exact single-process equality holds in eval mode (or at rate 0).

Bytes sent per rank per block inside a sharded stack (:func:`block_comm_bytes`; ``f = (P-1)/P``, ``N`` and
``S`` padded to multiples of P, ``B`` batch, ``e`` bytes per element; counted as
:class:`~ds4sci.sequence.CommCounter` does): an all-gather of a ``1/P`` piece of ``X`` sends ``f |X|``, its
backward reduce-scatter of ``X`` the same; an all-to-all of a piece ``X/P`` sends ``f |X| / P``, its backward the
same. Forward, the Evoformer gathers the MSA pair bias ``N^2 H_msa``, the outer product's ``b`` ``S N c_opm``, the
triangle multiplications' ``b``, ``a`` ``2 N^2 c_mul`` and the triangle biases ``2 N^2 H_pair`` and switches m once
and z three times, plus once each between blocks::

    evoformer  = 2 f B e [N^2 (H_msa + 2 c_mul + 2 H_pair) + S N c_opm + (4 N^2 C_z + (2 + opm_first) S N C_m) / P]
    pairformer = 2 f B e [N^2 (2 c_mul + 2 H_pair) + 4 N^2 C_z / P] + f B e N^2 H_s

(the Pairformer's bias gather ``N^2 H_s`` has no backward collective), plus the all-reduce of the parameter
gradients ``2 f |params| e`` (a Pairformer's replicated s-side parameters excluded). The gathered tensors are of
size ``N^2`` against z's ``N^2 C_z / P``: the bytes per rank fall with P only in the switches, so the bytes per rank
per block grow as ``N^2`` at any P; what P divides is the memory of z and m and the ``O(N^3)`` work.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ds4sci.models.evoformer import EvoformerBlock, PairformerBlock
from ds4sci.distributed.comm import CommCounter, all_to_all, group_rank, group_size, split_sequence_region, sync_grad
from ds4sci.distributed.comm import SequenceRegion as _SequenceRegion
from ds4sci.distributed.comm import all_gather as _all_gather
from ds4sci.distributed.comm import reduce_scatter as _reduce_scatter
from ds4sci.distributed.comm import split as _split
from ds4sci.sequence.sharding import pad_to_multiple

__all__ = ["block_comm_bytes", "evoformer_context_parallel", "EvoformerContextParallel"]

#: Parameters of a Pairformer block whose work is replicated on every rank: their gradients are not all-reduced.
PAIRFORMER_REPLICATED = ("attn_pair_bias.layer_norm_a.", "attn_pair_bias.mha.", "single_transition.")


def _gather_out(x: Tensor, group, dim: int, counter: CommCounter | None = None) -> Tensor:
    """A gather along ``dim`` whose every rank's use is the same (the exit; a replicated computation): backward keeps
    this rank's piece (the loss is every rank's)."""
    return _SequenceRegion.apply(x, group, dim, counter, _all_gather, _split)


def gather_leading(x: Tensor, group, dim: int, counter: CommCounter | None = None) -> Tensor:
    """:func:`_gather_out` received straight into the tensor it returns: ``dim`` is moved first (one copy of this
    rank's piece), gathered there into one buffer (``tensor_parallel._all_gather``: no list of received pieces beside
    their concatenation) and moved back, so the result is a permuted view of that buffer, not contiguous (z by
    columns ``[*, N, N/P, C_z]`` comes back with its two residue strides swapped). The same values and the same bytes
    sent; every rank holds one whole copy of the result instead of two at once."""
    return _gather_out(x.movedim(dim, 0), group, 0, counter).movedim(0, dim)


def _padding_keys(mask: Tensor, dim: int, real: int) -> Tensor:
    """``mask`` with its entries past the first ``real`` along ``dim`` (the padding keys) at -inf: the attention's
    mask bias ``inf * (mask - 1)`` is then -inf there, not the block's finite ``-inf``, so a real row whose real
    keys are all masked attends over them alone, as in the single process (which has no padding keys)."""
    index = torch.arange(mask.shape[dim], device=mask.device).view(-1, *[1] * (-dim - 1))
    return torch.where(index >= real, -math.inf, mask)


class _Axes:
    """One call's group, padded masks and layout switches. ``msa_mask [*, S', N']`` (Evoformer) and
    ``pair_mask [*, N', N']`` are padded to multiples of P with zeros; ``mine_s``, ``mine_n``: this rank's
    sequences and residues; ``key_*``: the attentions' masks, padding keys at -inf (:func:`_padding_keys`)."""

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
        self.key_rows, self.key_cols = _padding_keys(self.pm_rows, -1, n_res), _padding_keys(self.pm_cols, -2, n_res)
        if msa_mask is not None:
            n_seq = msa_mask.shape[-2]
            self.msa_mask = pad_to_multiple(pad_to_multiple(msa_mask, -2, self.p), -1, self.p)  # [*, S', N']
            seqs = self.msa_mask.shape[-2] // self.p
            self.mask_s = self.msa_mask[..., r * seqs:(r + 1) * seqs, :]  # [*, S'/p, N']
            self.mask_c = self.msa_mask[..., self.mine_n]  # [*, S', N'/p]
            # MSA row attention's keys are residues, column attention's sequences
            self.key_s, self.key_c = _padding_keys(self.mask_s, -1, n_res), _padding_keys(self.mask_c, -2, n_seq)

    def split(self, x: Tensor, dim: int) -> Tensor:
        """Entry: the full (padded) tensor -> this rank's piece along ``dim`` (backward: all-gather)."""
        return split_sequence_region(x, self.group, x.ndim + dim, self.counter)

    def gather(self, x: Tensor, dim: int) -> Tensor:
        """An internal gather along ``dim``; backward reduce-scatters (every rank's use contributes)."""
        return _SequenceRegion.apply(x, self.group, x.ndim + dim, self.counter, _all_gather, _reduce_scatter)

    def gather_out(self, x: Tensor, dim: int) -> Tensor:
        """A gather whose every rank's use is the same (the exit; the replicated s-side): backward keeps this rank's
        piece."""
        return _gather_out(x, self.group, x.ndim + dim, self.counter)

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


def _pair_stack(ps, z_r: Tensor, ax: _Axes) -> Tensor:
    """The pair stack on z by rows ``[*, N'/p, N', C_z]``; returns z by columns ``[*, N', N'/p, C_z]``."""
    chunk_size, pm_rows, pm_cols = ax.chunk_size, ax.pm_rows, ax.pm_cols
    mul = ps.tri_mul_out  # outgoing: p_ij = sum_k a_ik b_jk: this rank's rows i of a, every row j of b
    x = mul.layer_norm_in(z_r)
    a, b = mul.projections(x, pm_rows.unsqueeze(-1))
    z_r = z_r + ps.dropout_row(mul.finish(x, mul.combine(a, ax.gather(b, -3))))
    z_c = ax.rows_to_cols(z_r)
    mul = ps.tri_mul_in  # incoming: p_ij = sum_k a_ki b_kj: every column i of a, this rank's columns j of b
    x = mul.layer_norm_in(z_c)
    a, b = mul.projections(x, pm_cols.unsqueeze(-1))
    z_c = z_c + ps.dropout_row(mul.finish(x, mul.combine(ax.gather(a, -2), b)))
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
        for i, blk in enumerate(self.blocks):
            if i:  # z by columns -> by rows; m by residues -> by sequences
                z_r = ax.cols_to_rows(z_c)
                x = ax.cols_to_rows(x) if evoformer else x
            x, z_c = _evoformer(blk, x, z_r, ax) if evoformer else _pairformer(blk, x, z_r, x_mask, ax)
        if evoformer:
            x = gather_leading(x, self.group, x.ndim - 2, self.counter)[..., :n_seq, :n_res, :]
        return x, gather_leading(z_c, self.group, z_c.ndim - 2, self.counter)[..., :n_res, :n_res, :]


class EvoformerContextParallel(nn.Module):
    """An :class:`~ds4sci.models.evoformer.EvoformerBlock` or :class:`~ds4sci.models.evoformer.PairformerBlock`, or a
    stack of blocks of one kind, run across the ranks of ``group`` (module docstring), with the block's call
    signature: ``forward(m [*, N_seq, N_res, C_m], z [*, N_res, N_res, C_z], msa_mask=None [*, N_seq, N_res],
    pair_mask=None [*, N_res, N_res], chunk_size=None) -> (m, z)`` (Evoformer) or ``forward(s [*, N, C_s], z,
    single_mask=None [*, N], pair_mask=None, chunk_size=None) -> (s, z)`` (Pairformer), full tensors in and out on
    every rank (each rank passes the same inputs). Holds the given block or blocks (their parameters, not copies):
    ``block`` (one block) or ``blocks`` (a stack; the caller's ``nn.ModuleList`` itself), so its state dict is theirs
    under that prefix. ``sharded``: a stack keeps m and z split between its blocks. ``counter`` records this rank's
    collectives. A group of one runs the blocks themselves."""

    def __init__(self, block_or_stack: EvoformerBlock | PairformerBlock | Sequence[EvoformerBlock | PairformerBlock],
                 group=None, *, sharded: bool = False, counter: CommCounter | None = None):
        super().__init__()
        single, blocks = hold_blocks(self, block_or_stack)
        self.group = group if group is not None or not dist.is_initialized() else dist.group.WORLD
        self.sharded, self.counter = sharded, counter
        regions = [blocks] if sharded or single else [[b] for b in blocks]
        # a tuple: not a second path to the parameters
        self._regions = tuple(_AxialStack(nn.ModuleList(r), self.group, counter) for r in regions)

    def forward(self, x: Tensor, z: Tensor, x_mask: Tensor | None = None, pair_mask: Tensor | None = None,
                chunk_size: int | None = None) -> tuple[Tensor, Tensor]:
        if group_size(self.group) == 1:
            for region in self._regions:
                for blk in region.blocks:
                    x, z = blk(x, z, x_mask, pair_mask, chunk_size)
            return x, z
        for region in self._regions:
            x, z = torch.func.functional_call(region, synced_parameters(region, self.group, self.counter),
                                              (x, z, x_mask, pair_mask, chunk_size))
        return x, z



def hold_blocks(module: nn.Module, block_or_stack) -> tuple[bool, list]:
    """Checks ``block_or_stack`` (one ds4sci Evoformer or Pairformer block, or a non-empty stack of one kind) and
    registers it on ``module`` as ``block`` or ``blocks`` (its parameters keep their names under that prefix);
    returns ``(single, blocks)``."""
    single = isinstance(block_or_stack, (EvoformerBlock, PairformerBlock))
    iterable = single or isinstance(block_or_stack, (list, tuple, nn.ModuleList, nn.Sequential))
    blocks = [block_or_stack] if single else list(block_or_stack) if iterable else []
    kinds = {type(b) for b in blocks}
    if not blocks or len(kinds) > 1 or not kinds <= {EvoformerBlock, PairformerBlock}:
        raise TypeError("evoformer_context_parallel: expected a ds4sci EvoformerBlock or PairformerBlock or a "
                        f"non-empty stack of one of them, got {type(block_or_stack).__name__} of "
                        f"{sorted(k.__name__ for k in kinds)}")
    if single:
        module.block = block_or_stack
    else:
        module.blocks = block_or_stack if isinstance(block_or_stack, nn.ModuleList) else nn.ModuleList(blocks)
    return single, blocks


def synced_parameters(region: nn.Module, group, counter: CommCounter | None) -> dict[str, Tensor]:
    """The parameters of ``region`` (a stack holding ``blocks``, 1-D or 2-D), each through an identity whose backward
    all-reduces its gradient over ``group``, except a Pairformer's replicated single-representation side
    (:data:`PAIRFORMER_REPLICATED`), whose gradients every rank computes whole."""
    synced = {}
    for name, p in region.named_parameters():
        block_name = name.split(".", 2)[2]  # <stack attribute>.<i>.<name in the block>
        replicated = isinstance(region.blocks[0], PairformerBlock) and block_name.startswith(PAIRFORMER_REPLICATED)
        synced[name] = p if replicated else sync_grad(p, group, counter)
    return synced


def block_comm_bytes(block: EvoformerBlock | PairformerBlock, p: int, n_res: int, n_seq: int = 0, batch: int = 1,
                     itemsize: int = 4) -> dict[str, int]:
    """The closed form (module docstring) of the bytes this rank sends for one ``block`` inside a sharded stack of
    the group size ``p``, training (forward and backward), per collective kind as
    :class:`~ds4sci.sequence.CommCounter` records them: ``all_gather``, ``reduce_scatter``, ``all_to_all`` and
    ``all_reduce`` (the parameter gradients); ``n_seq`` for an Evoformer block; ``itemsize`` of the activations."""
    n, s = -(-n_res // p) * p, -(-n_seq // p) * p  # padded
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
    params = [q for name, q in block.named_parameters()
              if not (isinstance(block, PairformerBlock) and name.startswith(PAIRFORMER_REPLICATED))]
    return {"all_gather": round(f * unit * (gathered + replicated)), "reduce_scatter": round(f * unit * gathered),
            "all_to_all": round(2 * f * unit * switched / p),
            "all_reduce": sum(2 * q.numel() * q.element_size() * (p - 1) // p for q in params)}


def evoformer_context_parallel(block_or_stack, group=None, mesh: tuple[int, int] | None = None, *,
                               sharded: bool = False, counter: CommCounter | None = None) -> nn.Module:
    """``block_or_stack`` (an Evoformer or Pairformer block, or a sequence of blocks of one kind) run across
    ``group`` (default: every rank of the default process group) by axial context parallelism:
    :class:`EvoformerContextParallel` (module docstring: layouts, collectives, exactness); with ``mesh=(p, p)``,
    on a p x p mesh of the group's ranks by 2-D tiles:
    :class:`~ds4sci.parallel.evoformer_cp2d.EvoformerContextParallel2D` (same call signature and semantics).
    ``sharded``: a stack keeps m and z split (1-D) or tiled (2-D) between its blocks; ``counter`` records this
    rank's collectives."""
    if mesh is None:
        return EvoformerContextParallel(block_or_stack, group, sharded=sharded, counter=counter)
    from ds4sci.parallel.evoformer_cp2d import EvoformerContextParallel2D, check_mesh

    group = group if group is not None or not dist.is_initialized() else dist.group.WORLD
    p = check_mesh(mesh, group_size(group))
    return (EvoformerContextParallel(block_or_stack, group, sharded=sharded, counter=counter) if p == 1
            else EvoformerContextParallel2D(block_or_stack, group, p, sharded=sharded, counter=counter))
