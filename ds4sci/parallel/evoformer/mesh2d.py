"""Evoformer and Pairformer blocks on a p x p mesh of ranks: 2-D context parallelism with single-process semantics.

Fold-CP's layout (NVIDIA's context parallelism for Boltz): rank (r, c) of the mesh (group rank ``r * p + c``) holds
the pair tile ``z[I_r, J_c]`` ``[*, n, n, C_z]`` and the MSA tile ``m[S_r, R_c]`` ``[*, s, n, C_m]`` (``n = N'/p``,
``s = S'/p``, N_res and N_seq padded to multiples of p; ``I = J = K = R`` the same residue blocks). No rank holds
more than tiles: a sub-module that needs a whole row or column of tiles gets them one at a time, Cannon's way
(Cannon 1969; :mod:`ds4sci.parallel.evoformer.ring`): the *transpose swap* with rank (c, r), the *skew* (on the
mesh row, the tile of (r, c + r); on the column, of (r + c, c)) so that both operands start at block ``r + c``, and
the *ring* that moves the tiles one rank on per step.

Per block (AF2 supplement Algorithm 6): the outer product mean and the triangle multiplications are Cannon sums of
products of tiles (the triangle multiplications by the steps of :mod:`ds4sci.kernels.trimul`: each step one
``channel_product``, operands and output recomputed in backward); the MSA row and column attentions and the triangle
attentions are ring attention (Liu et al. 2023) on the Evoformer kernel, the bias tile rotating beside the key/value
tile and the partial results merged by the kernel's row max and row sum; the transitions are pointwise on the tile.
The padding keys are masked with -inf.

Pairformer blocks (AF3 supplement Algorithm 17): the pair stack on the tiles, then ``s [*, N, C_s]`` replicated as in
the axial version, its attention with pair bias (AF3 Algorithm 24) computed from the bias tiles, which never move
(:class:`~ds4sci.parallel.evoformer.ring.TileAttention`); no rank makes an ``N x N`` tensor.

Entry, exit, parameters, padding and dropout as the axial version (:mod:`ds4sci.parallel.evoformer.axial`); of the
pair mask a rank holds only the strips it reads (rows ``I_r``, columns ``J_c``). A stack runs block by block (full
tensors between blocks) or, ``sharded=True``, keeps the tiles from its entry to its exit. The bytes per rank fall as
``1/p = 1/sqrt(P)`` (:func:`block_comm_bytes`), where the axial layout's stay ``O(N^2)`` at any P.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch import nn

from ds4sci.distributed.comm import CommCounter
from ds4sci.distributed.comm import group_rank
from ds4sci.distributed.comm import move
from ds4sci.distributed.comm import split_sequence_region
from ds4sci.kernels import TriMulParams
from ds4sci.kernels.trimul import channel_product
from ds4sci.kernels.trimul import triangle_finish
from ds4sci.kernels.trimul import triangle_operand
from ds4sci.models.evoformer import EvoformerBlock
from ds4sci.models.evoformer import PairformerBlock
from ds4sci.models.evoformer.primitives import GatedAttention
from ds4sci.models.evoformer.primitives import mask_bias
from ds4sci.parallel.evoformer.common import Blocks
from ds4sci.parallel.evoformer.common import HeldBlocks
from ds4sci.parallel.evoformer.common import block_slice
from ds4sci.parallel.evoformer.common import ceil_div
from ds4sci.parallel.evoformer.common import gather_out
from ds4sci.parallel.evoformer.common import param_grad_bytes
from ds4sci.parallel.evoformer.common import synced_parameters
from ds4sci.parallel.evoformer.ring import CannonSum
from ds4sci.parallel.evoformer.ring import EvoformerRingAttention
from ds4sci.parallel.evoformer.ring import TileAttention
from ds4sci.sequence.sharding import pad_to_multiple

__all__ = ["block_comm_bytes", "check_mesh", "EvoformerContextParallel2D", "Mesh"]


def check_mesh(mesh, ranks: int) -> int:
    """The side p of ``mesh`` (a pair ``(p, p)`` of equal positive ints whose product is the group's ``ranks``)."""
    if (not isinstance(mesh, (tuple, list)) or len(mesh) != 2 or mesh[0] != mesh[1]
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in mesh)):
        raise ValueError(f"evoformer_context_parallel: mesh must be a square (p, p) of positive ints, got {mesh!r}")
    if mesh[0] * mesh[1] != ranks:
        raise ValueError(f"evoformer_context_parallel: mesh={tuple(mesh)} needs {mesh[0] * mesh[1]} ranks, the group "
                         f"has {ranks}")
    return mesh[0]


class Mesh:
    """The p x p mesh of ``group``'s ranks (group rank ``r * p + c`` at row r, column c): this rank's row group
    (ranks (r, *), ordered by column) and column group (ranks (*, c), ordered by row); ``counter`` records this
    rank's collectives (or None)."""

    def __init__(self, group, p: int, counter: CommCounter | None):
        ranks = dist.get_process_group_ranks(group)
        self.p, self.group, self.counter = p, group, counter
        self.r, self.c = divmod(group_rank(group), p)
        # every rank of a row (column) creates that group only: no call on the ranks outside it
        self.row = dist.new_group(ranks[self.r * p:(self.r + 1) * p], use_local_synchronization=True)
        self.col = dist.new_group(ranks[self.c::p], use_local_synchronization=True)
        self.partner = ranks[self.c * p + self.r]  # global rank of (c, r)
        self.t0 = (self.r + self.c) % p  # the block of the tiles a skewed product starts with

    def skew(self, ring) -> int:
        """How far the skew moves tiles on ``ring``: on the row, by this rank's row; on the column, by its column."""
        return self.r if ring is self.row else self.c


def _swap(x: Tensor, mesh: Mesh) -> Tensor:
    """Rank (r, c) gets the tile of rank (c, r)."""
    return move(x, mesh.partner, mesh.partner, mesh.group, mesh.counter)


def _skewed(x: Tensor, mesh: Mesh, ring) -> Tensor:
    """Rank (r, c) gets, on the row, the tile of (r, c + r); on the column, the tile of (r + c, c)."""
    by, me = mesh.skew(ring), group_rank(ring)
    dst, src = (dist.get_global_rank(ring, (me + step) % mesh.p) for step in (-by, by))
    return move(x, dst, src, ring, mesh.counter)


def _mask_strip(mask: Tensor, shape: torch.Size, dtype: torch.dtype, rows: slice, cols: slice) -> Tensor:
    """``mask[..., rows, cols]`` in ``dtype`` of the caller's ``mask`` (broadcastable to ``shape`` ``[*, N, N]``)
    padded to ``[*, N', N']`` (its rows and columns past N masked, 0, as :func:`pad_to_multiple` pads them), without
    making the padded mask or the whole ``[*, N, N]``: only the strip's real part is cut, converted and expanded, then
    padded to ``[*, len(rows), len(cols)]``."""
    n_res = shape[-1]
    if mask.ndim < 2:  # [N or 1, N or 1]
        mask = mask.reshape((1,) * (2 - mask.ndim) + mask.shape)
    real_rows, real_cols = slice(rows.start, min(rows.stop, n_res)), slice(cols.start, min(cols.stop, n_res))
    cut = mask[..., real_rows if mask.shape[-2] > 1 else slice(None), real_cols if mask.shape[-1] > 1 else slice(None)]
    cut = cut.to(dtype).expand(*shape[:-2], max(real_rows.stop - rows.start, 0), max(real_cols.stop - cols.start, 0))
    return torch.nn.functional.pad(cut, (0, cols.stop - cols.start - cut.shape[-1],
                                         0, rows.stop - rows.start - cut.shape[-2]))


def _attend(mha: GatedAttention, x: Tensor, mesh: Mesh, kv_ring, key_mask: Tensor, real_keys: int,
            pair: Tensor | None, inf: float, backend) -> Tensor:
    """``mha`` on this rank's queries ``x [*, N, s, C]`` (layer-normed) against the keys of every rank of
    ``kv_ring`` (their tiles of x): ``key_mask [*, N, p*s]`` in key order, of which the first ``real_keys`` are
    real and the rest padding; ``pair`` this rank's skewed bias tile ``[*, s, s, H]`` (queries by keys of block
    ``t0``, rotating on the other ring) or None. Returns ``[*, N, s, C]``. The padding keys are masked with -inf,
    not the block's finite ``inf``: a real row whose real keys are all masked then attends over them as in the
    single process, which has no padding keys."""
    heads = (mha.no_heads, mha.c_hidden)
    kv = _skewed(x, mesh, kv_ring)  # block t0's keys
    q, k, v = (lin(t).unflatten(-1, heads) for lin, t in ((mha.linear_q, x), (mha.linear_k, kv), (mha.linear_v, kv)))
    bias_ring = mesh.col if kv_ring is mesh.row else mesh.row
    pair = None if pair is None else pair.movedim(-1, -3).unsqueeze(-4)  # [*, 1, H, s, s]
    mask = mask_bias(key_mask, inf, x.dtype)  # [*, N, 1, 1, p*s]
    mask[..., real_keys:] = -math.inf
    o = EvoformerRingAttention.apply(q, k, v, mask, pair, backend, kv_ring, bias_ring, mesh.t0, mesh.counter)
    return mha.linear_o(o.flatten(-2) * torch.sigmoid(mha.linear_g(x)))


class _MeshStack(nn.Module):
    """The sharded computation of :class:`EvoformerBlock` s run one after the other on a mesh, m and z this rank's
    tiles from the entry to the exit (module docstring); ``blocks`` are the caller's."""

    def __init__(self, blocks: nn.ModuleList, mesh: Mesh):
        super().__init__()
        self.blocks, self.mesh = blocks, mesh

    def forward(self, x: Tensor, z: Tensor, x_mask: Tensor | None, pair_mask: Tensor | None,
                chunk_size: int | None) -> tuple[Tensor, Tensor]:
        """``x``: m ``[*, N_seq, N_res, C_m]`` (Evoformer) or s ``[*, N_res, C_s]`` (Pairformer, replicated);
        ``x_mask`` its mask."""
        mesh, counter = self.mesh, self.mesh.counter
        p, r, c = mesh.p, mesh.r, mesh.c
        evoformer = isinstance(self.blocks[0], EvoformerBlock)
        n_res = z.shape[-2]
        n_seq = x.shape[-3] if evoformer else 0
        n = -(-n_res // p)  # the tile side: N' = p n
        res_r, res_c = block_slice(r, n), block_slice(c, n)
        mask = z.new_ones((1, 1)) if pair_mask is None else pair_mask
        # the strips this rank's sub-modules read, cut from the caller's mask: rows I_r [*, n, N'], columns J_c
        # [*, N', n]; never the whole [*, N', N']
        pair_rows = _mask_strip(mask, z.shape[:-1], z.dtype, res_r, slice(0, p * n))
        pair_cols = _mask_strip(mask, z.shape[:-1], z.dtype, slice(0, p * n), res_c)
        z = pad_to_multiple(pad_to_multiple(z, -3, p), -2, p)  # [*, N', N', C_z], N' a multiple of p
        msa_mask = mask_t = seq_r = None
        if evoformer:
            msa_mask = x.new_ones(x.shape[:-1]) if x_mask is None else x_mask.to(x.dtype).expand(x.shape[:-1])
            x = pad_to_multiple(pad_to_multiple(x, -3, p), -2, p)  # [*, S', N', C_m], S' a multiple of p
            msa_mask = pad_to_multiple(pad_to_multiple(msa_mask, -2, p), -1, p)  # [*, S', N']
            seq_r = block_slice(r, msa_mask.shape[-2] // p)
            mask_t = msa_mask[..., seq_r, res_c]
        # this call's masks (the MSA mask whole, padded; the pair mask's strips; this rank's tiles) and blocks, read by
        # the sub-module methods below
        self._masks = msa_mask, (pair_rows, pair_cols), mask_t, pair_rows[..., res_c]
        self._blocks, self._real = (seq_r, res_r, res_c), (n_seq, n_res)
        # this rank's tiles: z[I_r, J_c] [*, N'/p, N'/p, C_z], m[S_r, R_c] [*, S'/p, N'/p, C_m]
        z = split_sequence_region(split_sequence_region(z, mesh.col, z.ndim - 3, counter), mesh.row, z.ndim - 2,
                                  counter)
        if evoformer:
            x = split_sequence_region(split_sequence_region(x, mesh.col, x.ndim - 3, counter), mesh.row, x.ndim - 2,
                                      counter)
        for blk in self.blocks:  # each block maps the tile layout to itself: nothing moves between blocks
            x, z = (self._evoformer(blk, x, z, chunk_size) if evoformer
                    else self._pairformer(blk, x, z, x_mask, chunk_size))
        z = gather_out(gather_out(z, mesh.row, z.ndim - 2, counter), mesh.col, z.ndim - 3, counter)
        if evoformer:
            x = gather_out(gather_out(x, mesh.row, x.ndim - 2, counter), mesh.col, x.ndim - 3, counter)
            x = x[..., :n_seq, :n_res, :]
        return x, z[..., :n_res, :n_res, :]

    def _evoformer(self, blk: EvoformerBlock, m: Tensor, z: Tensor, chunk_size: int | None) -> tuple[Tensor, Tensor]:
        """One block (AF2 Algorithm 6) on this rank's tiles m[S_r, R_c] ``[*, s, n, C_m]`` and z[I_r, J_c]
        ``[*, n, n, C_z]``; returns the same tiles of its outputs."""
        if blk.opm_first:
            z = z + self._outer_product_mean(blk, m)
        m = m + blk.msa_dropout_layer(self._msa_row_attention(blk, m, z))
        if not blk.no_column_attention:
            m = m + self._msa_column_attention(blk, m)
        m = m + blk.msa_transition(m, self._masks[2], chunk_size)
        if not blk.opm_first:
            z = z + self._outer_product_mean(blk, m)
        return m, self._pair_stack(blk, z, chunk_size)

    def _pairformer(self, blk: PairformerBlock, s: Tensor, z: Tensor, single_mask: Tensor | None,
                    chunk_size: int | None) -> tuple[Tensor, Tensor]:
        """One Pairformer block (AF3 Algorithm 17) on s whole ``[*, N, C_s]`` and this rank's z tile ``[*, n, n,
        C_z]``: the pair stack on the tile, then the single representation's attention with pair bias (AF3 Algorithm
        24) from the bias tiles (:class:`~ds4sci.parallel.evoformer.ring.TileAttention`) and its transition, every
        per-token step replicated."""
        z = self._pair_stack(blk, z, chunk_size)
        apb, mesh, n_res = blk.attn_pair_bias, self.mesh, s.shape[-2]
        heads = (apb.mha.no_heads, apb.mha.c_hidden)
        x = apb.layer_norm_a(s)  # [*, N, C_s]
        padded = pad_to_multiple(x, -2, mesh.p)  # [*, N', C_s]: the padding queries' rows are dropped below
        q, k, v = (lin(padded).unflatten(-1, heads).unsqueeze(-4)  # [*, 1, N', H, D]: one row of N' positions
                   for lin in (apb.mha.linear_q, apb.mha.linear_k, apb.mha.linear_v))
        mask = (s.new_zeros((*s.shape[:-2], 1, 1, 1, n_res)) if single_mask is None
                else mask_bias(single_mask.expand(s.shape[:-1]).unsqueeze(-2), apb.inf, s.dtype))  # [*, 1, 1, 1, N]
        mask = pad_to_multiple(mask, -1, mesh.p, -math.inf)  # [*, 1, 1, 1, N']: the padding keys at -inf
        pair = apb.pair_bias_of(z).movedim(-1, -3).unsqueeze(-4)  # [*, 1, H, n, n]: this rank's tile b[I_r, J_c]
        o = TileAttention.apply(q, k, v, mask, pair, apb.backend, mesh)
        o = o.squeeze(-4)[..., :n_res, :, :].flatten(-2)  # [*, N, H * D]
        s = s + apb.mha.linear_o(o * torch.sigmoid(apb.mha.linear_g(x)))
        return s + blk.single_transition(s, single_mask, chunk_size), z

    def _cannon(self, a: Tensor, b: Tensor, product: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        """``sum_t product(a_t, b_t)``: ``a`` this rank's tile of the mesh row's blocks, ``b`` of the column's."""
        mesh = self.mesh
        return CannonSum.apply(_skewed(a, mesh, mesh.row), _skewed(b, mesh, mesh.col), product, mesh.row, mesh.col,
                                mesh.counter)

    def _outer_product_mean(self, blk: EvoformerBlock, m: Tensor) -> Tensor:
        """z tile update ``[*, n, n, C_z]``: ``sum_s a_si b_sj`` over the sequence blocks t of ``a[S_t, I_r]`` (the
        swapped tiles of the mesh row) and ``b[S_t, J_c]`` (the mesh column's), then the output projection."""
        opm, (msa_mask, _, mask_t, _), (_, res_r, res_c) = blk.outer_product_mean, self._masks, self._blocks
        a, b, _ = opm.project(m, mask_t)  # [*, s, n, c]
        outer = self._cannon(_swap(a, self.mesh), b, lambda a_t, b_t: torch.einsum("...sic,...sje->...ijce", a_t, b_t))
        count = torch.einsum("...si,...sj->...ij", msa_mask[..., res_r], msa_mask[..., res_c]).unsqueeze(-1)
        return opm.linear_out(outer.flatten(-2)) / (count + opm.eps)

    def _msa_row_attention(self, blk: EvoformerBlock, m: Tensor, z: Tensor) -> Tensor:
        """Queries m[S_r, R_c] against the mesh row's keys m[S_r, R_t], bias b[R_c, R_t] (swapped tiles)."""
        att, (msa_mask, *_), (seq_r, *_) = blk.msa_att_row, self._masks, self._blocks
        bias = _skewed(_swap(att.pair_bias_of(z), self.mesh), self.mesh, self.mesh.col)  # [*, n, n, H]
        return _attend(att.mha, att.layer_norm_m(m), self.mesh, self.mesh.row, msa_mask[..., seq_r, :],
                       self._real[1], bias, att.inf, att.backend)

    def _msa_column_attention(self, blk: EvoformerBlock, m: Tensor) -> Tensor:
        """Queries m[S_r, R_c] (transposed) against the mesh column's keys m[S_t, R_c]."""
        att, (msa_mask, *_), (_, _, res_c) = blk.msa_att_col._msa_att, self._masks, self._blocks
        x = att.layer_norm_m(m).transpose(-2, -3)  # [*, n, s, C_m]
        out = _attend(att.mha, x, self.mesh, self.mesh.col, msa_mask[..., res_c].transpose(-1, -2), self._real[0],
                      None, att.inf, att.backend)
        return out.transpose(-2, -3)

    def _triangle_attention(self, att, z: Tensor, transpose_bias: bool) -> Tensor:
        """Starting node: queries z[I_r, J_c] against the mesh row's keys z[I_r, K_t], bias ``b_jk`` of j in J_c
        (the swapped tiles of the mesh column; ``b_kj``, transposed: the column's own tiles). Ending node (on z's
        transpose): the mesh column's keys z[K_t, J_c], bias ``b_ki`` of i in I_r (the swapped tiles of the mesh
        row; ``b_ik``, transposed: the row's own)."""
        mesh, (_, (pair_rows, pair_cols), *_) = self.mesh, self._masks
        b = att.triangle_bias(z)  # [*, n, n, H]
        x = att.layer_norm(z)
        if att.starting:  # bias [*, j, k, H]
            kv_ring, key_mask = mesh.row, pair_rows
            bias = (_skewed(b, mesh, mesh.col).transpose(-2, -3) if transpose_bias
                    else _skewed(_swap(b, mesh), mesh, mesh.col))
        else:  # on z^T: bias [*, i, k, H]
            kv_ring, key_mask, x = mesh.col, pair_cols.transpose(-1, -2), x.transpose(-2, -3)
            bias = (_skewed(b, mesh, mesh.row) if transpose_bias
                    else _skewed(_swap(b, mesh), mesh, mesh.row).transpose(-2, -3))
        out = _attend(att.mha, x, mesh, kv_ring, key_mask, self._real[1], bias, att.inf, att.backend)
        return out if att.starting else out.transpose(-2, -3)

    def _triangle_update(self, mul, z: Tensor, mask: Tensor) -> Tensor:
        """A triangle multiplicative update of this rank's z tile ``[*, n, n, C_z]`` (``mask`` its ``[*, n, n]``) by
        the steps of :mod:`ds4sci.kernels.trimul` on channel-major tiles ``[*, c, n, n]``, each Cannon step one
        ``channel_product``: outgoing ``p_ij = sum_k a_ik b_jk`` from the row's a[I_r, K_t] and the column's swapped
        b[J_c, K_t]; incoming ``p_ij = sum_k a_ki b_kj`` from the row's swapped a[K_t, I_r] and the column's
        b[K_t, J_c]."""
        w, eps, outgoing, mesh = TriMulParams.from_module(mul), mul.layer_norm_in.eps, mul.outgoing, self.mesh
        a, b = (triangle_operand(z, mask, w, which, eps) for which in "ab")
        a, b = (a, _swap(b, mesh)) if outgoing else (_swap(a, mesh), b)
        p = self._cannon(a, b, lambda a_t, b_t: channel_product(a_t, b_t, outgoing))
        del a, b
        return triangle_finish(z, p, w, eps)

    def _pair_stack(self, blk: EvoformerBlock, z: Tensor, chunk_size: int | None) -> Tensor:
        """The pair stack on this rank's z tile ``[*, n, n, C_z]``."""
        ps, pm = blk.pair_stack, self._masks[3]
        z = z + ps.dropout_row(self._triangle_update(ps.tri_mul_out, z, pm))
        z = z + ps.dropout_row(self._triangle_update(ps.tri_mul_in, z, pm))
        z = z + ps.dropout_row(self._triangle_attention(ps.tri_att_start, z, False))
        z = z + ps.dropout_col(self._triangle_attention(ps.tri_att_end, z, ps.transpose_end_bias))
        return z + ps.pair_transition(z, pm, chunk_size)


class EvoformerContextParallel2D(HeldBlocks):
    """An :class:`~ds4sci.models.evoformer.EvoformerBlock` or :class:`~ds4sci.models.evoformer.PairformerBlock`, or a
    stack of blocks of one kind, run on a ``p x p`` mesh of ``group``'s ranks (module docstring), called as the
    block is (:class:`~ds4sci.parallel.evoformer.common.HeldBlocks`: m or s, z, their masks, chunk_size), full
    tensors in and out on every rank (each rank passes the same inputs). ``sharded``: a stack keeps m and z as this
    rank's tiles between its blocks (a Pairformer's s whole). ``counter`` records this rank's collectives. Every rank
    of ``group`` constructs it (it creates the mesh's row and column groups)."""

    def __init__(self, block_or_stack: Blocks, group, p: int, *, sharded: bool = False,
                 counter: CommCounter | None = None):
        super().__init__(block_or_stack, sharded)
        self.group, self.counter = group, counter
        mesh = Mesh(group, p, counter)
        # a tuple: not a second path to the parameters
        self._regions = tuple(_MeshStack(nn.ModuleList(r), mesh) for r in self.block_groups)

    def forward(self, *args, **kwargs) -> tuple[Tensor, Tensor]:
        x, z, x_mask, pair_mask, chunk_size = self.bind(args, kwargs)
        unbatched = z.ndim == 3  # the kernel wants a batch dim
        if unbatched:
            x, z = x.unsqueeze(0), z.unsqueeze(0)
            x_mask = None if x_mask is None else x_mask.unsqueeze(0)
            pair_mask = None if pair_mask is None else pair_mask.unsqueeze(0)
        for region in self._regions:
            x, z = torch.func.functional_call(region, synced_parameters(region, self.group, self.counter),
                                              (x, z, x_mask, pair_mask, chunk_size))
        return (x.squeeze(0), z.squeeze(0)) if unbatched else (x, z)


def block_comm_bytes(block: EvoformerBlock | PairformerBlock, p: int, n_res: int, n_seq: int, rank: int,
                     batch: int = 1, itemsize: int = 4) -> dict[str, int]:
    """The bytes that mesh rank ``rank`` (group rank ``r * p + c``) of a ``p x p`` mesh sends for one Evoformer or
    Pairformer ``block`` inside a sharded stack, training (forward and backward), per collective kind as
    :class:`~ds4sci.sequence.CommCounter` records them: ``p2p`` (tile moves and ring steps), ``all_gather`` (a
    Pairformer's single-attention partial results and outputs) and ``all_reduce`` (the parameter gradients over the
    p^2 ranks, and a Pairformer's single-attention q, k, v gradients); ``n_seq`` for an Evoformer block; ``itemsize``
    of the activations.

    A tile ``t`` that moves (swap or skew) sends ``|t|`` forward and its gradient backward, ``2 |t|``, and moves
    only where the permutation is not the identity: the swap off the diagonal (``X = [r != c]``), the row skew on
    rows ``r != 0`` (``R``), the column skew on columns ``c != 0`` (``C``). A tile rotating on a ring of p ranks is
    sent ``(3p - 2) |t|`` (``p - 1`` times forward, ``p - 1`` in backward, its gradient ``p`` times). In elements
    (times batch and bytes per element), ``H``, ``c`` each attention's heads and channels per head::

        outer product mean      a, b [s, n, c_opm]        (2X + 2R + 2C + 2(3p-2)) s n c_opm
        MSA row attention       bias [n, n, H_msa]        (2X + 2C + (3p-2)) n^2 H_msa
                                m (skew), k, v            2R s n C_m + 2(3p-2) s n H_msa c_msa
        MSA column attention    m (skew), k, v            2C s n C_m + 2(3p-2) s n H_msa c_msa   (if present)
        triangle mult. out, in  a, b [n, n, c_mul]        2 (2X + 2R + 2C + 2(3p-2)) n^2 c_mul
        triangle att. start     bias, z (skew), k, v      (2X + 2C + (3p-2)) n^2 H_pair + 2R n^2 C_z
                                                          + 2(3p-2) n^2 H_pair c_pair
        triangle att. end       bias, z (skew), k, v      (2X' + 2R + (3p-2)) n^2 H_pair + 2C n^2 C_z
                                                          + 2(3p-2) n^2 H_pair c_pair

    (``X' = X`` with OpenFold3's ending-node bias, 0 with OpenFold's). A Pairformer block sends the pair stack's
    rows and, for its single attention, forward the all-gathers ``(p - 1) n H (2 c e + 2 e')`` bytes (partial
    results and statistics over the mesh row, ``e'`` the statistics' 4 or 8 bytes; the merged output over the
    column), backward the all-reduce of dq, dk, dv ``[3, N', H, c]`` over the p^2 ranks; the parameter gradients
    ``2 (P-1)/P |params|`` over ``P = p^2`` ranks, the replicated s-side left out.
    """
    r, c = divmod(rank, p)
    s, n = ceil_div(n_seq, p), ceil_div(n_res, p)  # tile sides, padded
    x, rr, cc, ring = int(r != c), int(r != 0), int(c != 0), 3 * p - 2
    ps = block.pair_stack
    start, end, c_z = ps.tri_att_start.mha, ps.tri_att_end.mha, ps.tri_mul_out.c_z
    tiles = 2 * (x + rr + cc + ring) * 2 * n * n * ps.tri_mul_out.c_hidden
    tiles += (2 * x + 2 * cc + ring) * n * n * start.no_heads + 2 * rr * n * n * c_z
    tiles += (2 * x * (not ps.transpose_end_bias) + 2 * rr + ring) * n * n * end.no_heads + 2 * cc * n * n * c_z
    tiles += 2 * ring * n * n * (start.no_heads * start.c_hidden + end.no_heads * end.c_hidden)
    ranks, unit = p * p, batch * itemsize
    gathered, reduced = 0, 0
    if isinstance(block, EvoformerBlock):
        row, col = block.msa_att_row.mha, block.msa_att_col._msa_att.mha
        tiles += 2 * (x + rr + cc + ring) * s * n * block.outer_product_mean.c_hidden
        tiles += (2 * x + 2 * cc + ring) * n * n * row.no_heads + 2 * rr * s * n * block.c_m
        tiles += 2 * ring * s * n * row.no_heads * row.c_hidden
        if not block.no_column_attention:
            tiles += 2 * cc * s * n * block.c_m + 2 * ring * s * n * col.no_heads * col.c_hidden
    else:
        single = block.attn_pair_bias.mha
        heads, stats_itemsize = single.no_heads, 8 if itemsize == 8 else 4  # the kernel's statistics: fp32 or fp64
        gathered = batch * (p - 1) * n * heads * (2 * single.c_hidden * itemsize + 2 * stats_itemsize)
        reduced = 2 * (3 * p * n * heads * single.c_hidden * unit) * (ranks - 1) // ranks
    return {"p2p": tiles * unit, "all_gather": gathered,
            "all_reduce": reduced + param_grad_bytes(block, ranks)}
