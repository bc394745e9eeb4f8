"""One Evoformer block on a p x p mesh of ranks: 2-D context parallelism with single-process semantics.

Fold-CP's layout (NVIDIA's context parallelism for Boltz): the pair representation ``z [*, N_res, N_res, C_z]`` is
cut into p x p tiles and rank (r, c) of the mesh (group rank ``r * p + c``) holds ``z[I_r, J_c]``, ``N_res/p`` by
``N_res/p``; the MSA ``m [*, N_seq, N_res, C_m]`` is tiled to match, rank (r, c) holding sequences ``S_r`` of
residues ``R_c`` (the same residue blocks as z's). Three collectives move pieces (every one differentiable, its
adjoint in backward):

- a *row gather* over the mesh row (ranks (r, *)) and a *column gather* over the mesh column (ranks (*, c)):
  all-gather, backward reduce-scatter (the gathered copy is used by every rank of the row or column);
- the *transpose swap*: rank (r, c) exchanges its tensor with rank (c, r) (its own adjoint).

No rank holds an ``N_res x N_res`` tensor: the largest pieces are ``N_res/p x N_res`` slabs (this first version
gathers along one mesh axis where Fold-CP rotates tiles around a ring). Per block (AF2 supplement Algorithm 6),
rank (r, c) computes the outputs of its own tile only (blocks ``I = J = R``):

==============================  ============================================================================
sub-module                      what rank (r, c) gathers (N/p x N slabs; S = all sequences)
==============================  ============================================================================
MSA row attention, pair bias    keys/values ``m[S_r, :]`` (row gather); bias rows ``b[R_c, :]`` (row gather,
                                swap)
MSA column attention            keys/values ``m[:, R_c]`` (column gather)
MSA transition, pair transition -
outer product mean              ``a[:, I_r]`` (swap, row gather), ``b[:, J_c]`` (column gather)
triangle mult. outgoing         ``a[I_r, :]`` (row gather), ``b[J_c, :]`` (row gather, swap)
triangle mult. incoming         ``a[:, I_r]`` (column gather, swap), ``b[:, J_c]`` (column gather)
triangle attention, start       keys/values ``z[I_r, :]`` (row gather); bias ``b[J_c, :]`` (row gather, swap)
                                or, transposed, ``b[:, J_c]`` (column gather)
triangle attention, end         keys/values ``z[:, J_c]`` (column gather); bias ``b[:, I_r]`` (column gather,
                                swap) or, transposed, ``b[I_r, :]`` (row gather)
==============================  ============================================================================

The attentions run on the kernels' ``N/p x N/p`` tiles: :class:`_KeyTiledAttention` calls the Evoformer kernel once
per key tile (queries, key tile and bias tile all ``N/p`` long) and merges the partial results by their
log-sum-exp (ring attention's online softmax, :func:`ds4sci.sequence.attention._merge`); its backward calls the
kernel's backward per key tile with the merged output and log-sum-exp, which gives each tile's exact share of the
gradients (as ring attention's backward does).

Entry, exit, parameters, padding and dropout as the axial version (:mod:`ds4sci.parallel.evoformer_cp`): full
tensors in and out on every rank (entry split, backward all-gather; exit gather, backward split), parameter
gradients all-reduced over the mesh, N_seq and N_res padded to multiples of p with masked rows; exact in eval mode.
``chunk_size`` bounds the transitions and the outer product mean as in the block; the attentions are already tiled.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ds4sci.kernels import EvoformerBackend
from ds4sci.kernels.evoformer import _attention_bwd, _attention_fwd, _choose_backend
from ds4sci.models.evoformer import EvoformerBlock
from ds4sci.models.evoformer.primitives import GatedAttention, mask_bias
from ds4sci.parallel.evoformer_cp import _gather, _gather_out
from ds4sci.parallel.tensor_parallel import split_sequence_region, sync_grad
from ds4sci.sequence.attention import _GRAD_TAG, _KV_TAG, _merge
from ds4sci.sequence.comm import RingShift, group_rank, group_size
from ds4sci.sequence.sharding import pad_to_multiple

__all__ = ["EvoformerContextParallel2D", "check_mesh"]


def check_mesh(mesh, ranks: int) -> int:
    """The side p of ``mesh`` (a pair ``(p, p)`` of equal positive ints whose product is the group's ``ranks``)."""
    if (not isinstance(mesh, (tuple, list)) or len(mesh) != 2 or mesh[0] != mesh[1]
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in mesh)):
        raise ValueError(f"evoformer_context_parallel: mesh must be a square (p, p) of positive ints, got {mesh!r}")
    if mesh[0] * mesh[1] != ranks:
        raise ValueError(f"evoformer_context_parallel: mesh={tuple(mesh)} needs {mesh[0] * mesh[1]} ranks, the group "
                         f"has {ranks}")
    return mesh[0]


class _Mesh:
    """The p x p mesh of ``group``'s ranks (group rank ``r * p + c`` at row r, column c): this rank's row group
    (ranks (r, *), ordered by column) and column group (ranks (*, c), ordered by row), and its transpose partner."""

    def __init__(self, group, p: int):
        ranks = dist.get_process_group_ranks(group)
        self.p, self.group = p, group
        self.r, self.c = divmod(group_rank(group), p)
        me = ranks[self.r * p + self.c]
        # every rank of a row (column) creates that group only: no call on the ranks outside it
        self.row = dist.new_group(ranks[self.r * p:(self.r + 1) * p], use_local_synchronization=True)
        self.col = dist.new_group(ranks[self.c::p], use_local_synchronization=True)
        self.partner = ranks[self.c * p + self.r]  # global rank of (c, r)
        self.me = me


class _Swap(torch.autograd.Function):
    """Exchange ``x`` with the transpose partner (c, r); the diagonal keeps its own. Backward: the same exchange."""

    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        return _exchange(x, mesh)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.mesh), None


def _exchange(x: Tensor, mesh: _Mesh) -> Tensor:
    if mesh.partner == mesh.me:
        return x
    x = x.contiguous()
    out = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, mesh.partner, mesh.group), dist.P2POp(dist.irecv, out, mesh.partner, mesh.group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return out


class _RingAttention(torch.autograd.Function):
    """``softmax_j(q_i . k_j / sqrt(D) + mask_j + pair_ij) v_j`` of this rank's queries over the keys of a ring of T
    ranks (a mesh row or column), ring attention's schedule (Liu et al. 2023) on the Evoformer kernel.

    q, k, v ``[*, N, s, H, D]`` (this rank's tile: ring rank t holds keys ``t*s .. (t+1)*s``), mask bias
    ``[*, N|1, 1, 1, T*s]`` or None (constant), pair bias ``[*, 1, H, s, T*s]`` (every key's, in key order); returns
    ``[*, N, s, H, D]``. The k, v tiles rotate around the ring; each step is one call of the Evoformer kernel
    (``evoformer_attention``'s custom op on s x s tiles) and the partial results are merged by their log-sum-exp
    (:func:`ds4sci.sequence.attention._merge`). Backward rotates k, v again, runs the kernel's backward per tile
    against the merged output and log-sum-exp (a tile's exact share of the gradients: ``P = exp(logits - lse)``,
    ``D = rowsum(dO * O)``), and sends each tile's k, v gradients on around the ring back to their rank.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, pair, backend, ring):
        *_, s, h, d = q.shape
        size, me = group_size(ring), group_rank(ring)
        out = lse = None
        kv = [k, v]
        for step in range(size):
            keys = _keys((me - step) % size, s)
            shift = RingShift(kv, ring, tag=_KV_TAG) if step < size - 1 else None
            o_t, stats = _attention_fwd(q, *kv, None if mask is None else mask[..., keys], pair[..., keys], backend)
            row_max, row_sum = stats.unbind(-1)  # [Z, N, H, s]; (+inf, +inf) on rows with every key -inf
            lse_t = torch.where(torch.isinf(row_max), -math.inf, row_max + torch.log(row_sum)).flatten(0, 1)
            o_t = o_t.reshape(-1, s, h, d)  # [Z*N, s, H, D] and [Z*N, H, s]: ring attention's layout
            out, lse = (o_t, lse_t) if out is None else _merge(out, lse, o_t, lse_t)
            if shift is not None:
                kv = shift.wait()
        out = out.reshape(q.shape)
        ctx.save_for_backward(q, k, v, mask, pair, out, lse)
        ctx.backend, ctx.ring = backend, ring
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, mask, pair, out, lse = ctx.saved_tensors
        *batch, n, s, h, d = q.shape
        ring, size, me = ctx.ring, group_size(ctx.ring), group_rank(ctx.ring)
        lse = lse.reshape(math.prod(batch), n, h, s)
        # the merged statistics in the kernel's form: row max lse, row sum 1; (+inf, +inf) where no key counts
        stats = torch.stack([torch.where(torch.isinf(lse), math.inf, lse),
                             torch.where(torch.isinf(lse), math.inf, 1.0)], dim=-1)
        need_pair = ctx.needs_input_grad[4]
        grad = grad.contiguous()
        dq = torch.zeros_like(q)
        dpair = torch.empty_like(pair) if need_pair else None
        kv, dkv = [k, v], [torch.zeros_like(k), torch.zeros_like(v)]  # the gradients travel with their tile
        for step in range(size):
            keys = _keys((me - step) % size, s)
            shift = RingShift(kv, ring, tag=_KV_TAG) if step < size - 1 else None
            grads = _attention_bwd(grad, q, *kv, out, stats, None if mask is None else mask[..., keys],
                                   pair[..., keys], False, need_pair, ctx.backend)
            dq += grads[0]
            dkv = [dkv[0] + grads[1], dkv[1] + grads[2]]
            if need_pair:
                dpair[..., keys] = grads[3]
            dkv = RingShift(dkv, ring, tag=_GRAD_TAG).wait()  # after the last step: home
            if shift is not None:
                kv = shift.wait()
        return dq, dkv[0], dkv[1], None, dpair, None, None


def _keys(tile: int, s: int) -> slice:
    return slice(tile * s, (tile + 1) * s)


def _attend(mha: GatedAttention, x: Tensor, ring, key_mask: Tensor, pair: Tensor | None, inf: float,
            backend) -> Tensor:
    """``mha`` on this rank's queries ``x [*, N, s, C]`` (layer-normed) against the keys of every rank of ``ring``
    (their tiles of x, in ring order): ``key_mask [*, N, T*s]``, ``pair`` the bias ``[*, 1, H, s, T*s]`` of these
    queries (None: zeros). Returns ``[*, N, s, C]``."""
    heads = (mha.no_heads, mha.c_hidden)
    q, k, v = (lin(x).unflatten(-1, heads) for lin in (mha.linear_q, mha.linear_k, mha.linear_v))
    if pair is None:
        pair = q.new_zeros(q.shape[:-4] + (1, heads[0], q.shape[-3], key_mask.shape[-1]))
    chosen = _choose_backend(backend, q)
    chosen = EvoformerBackend.TORCH if chosen is EvoformerBackend.REFERENCE else chosen  # the oracle has no op
    o = _RingAttention.apply(q, k, v, mask_bias(key_mask, inf, x.dtype), pair, chosen.value, ring)
    return mha.linear_o(o.flatten(-2) * torch.sigmoid(mha.linear_g(x)))


class _MeshEvoformer(nn.Module):
    """The sharded computation of one :class:`EvoformerBlock` on a mesh (module docstring); ``block`` is the
    caller's."""

    def __init__(self, block: EvoformerBlock, mesh: _Mesh):
        super().__init__()
        self.block, self.mesh = block, mesh

    def forward(self, m: Tensor, z: Tensor, msa_mask: Tensor | None, pair_mask: Tensor | None,
                chunk_size: int | None) -> tuple[Tensor, Tensor]:
        mesh, blk = self.mesh, self.block
        p, r, c = mesh.p, mesh.r, mesh.c
        n_seq, n_res = m.shape[-3], m.shape[-2]
        msa_mask = m.new_ones(m.shape[:-1]) if msa_mask is None else msa_mask.to(m.dtype).expand(m.shape[:-1])
        pair_mask = z.new_ones(z.shape[:-1]) if pair_mask is None else pair_mask.to(z.dtype).expand(z.shape[:-1])
        m = pad_to_multiple(pad_to_multiple(m, -3, p), -2, p)  # [*, S', N', C_m], S' and N' multiples of p
        z = pad_to_multiple(pad_to_multiple(z, -3, p), -2, p)  # [*, N', N', C_z]
        msa_mask = pad_to_multiple(pad_to_multiple(msa_mask, -2, p), -1, p)  # [*, S', N']: the pad rows masked
        pair_mask = pad_to_multiple(pad_to_multiple(pair_mask, -2, p), -1, p)  # [*, N', N']
        s, n = msa_mask.shape[-2] // p, msa_mask.shape[-1] // p
        seq_r, res_r, res_c = slice(r * s, (r + 1) * s), slice(r * n, (r + 1) * n), slice(c * n, (c + 1) * n)
        self._masks = msa_mask, pair_mask, msa_mask[..., seq_r, res_c], pair_mask[..., res_r, res_c]
        self._blocks = seq_r, res_r, res_c
        # this rank's tiles: m[S_r, R_c] [*, S'/p, N'/p, C_m], z[I_r, J_c] [*, N'/p, N'/p, C_z]
        m = split_sequence_region(split_sequence_region(m, mesh.col, m.ndim - 3), mesh.row, m.ndim - 2)
        z = split_sequence_region(split_sequence_region(z, mesh.col, z.ndim - 3), mesh.row, z.ndim - 2)
        if blk.opm_first:
            z = z + self._outer_product_mean(m, chunk_size)
        m = m + blk.msa_dropout_layer(self._msa_row_attention(m, z))
        if not blk.no_column_attention:
            m = m + self._msa_column_attention(m)
        m = m + blk.msa_transition(m, self._masks[2], chunk_size)
        if not blk.opm_first:
            z = z + self._outer_product_mean(m, chunk_size)
        z = self._pair_stack(z, chunk_size)
        m = _gather_out(_gather_out(m, mesh.row, m.ndim - 2), mesh.col, m.ndim - 3)[..., :n_seq, :n_res, :]
        z = _gather_out(_gather_out(z, mesh.row, z.ndim - 2), mesh.col, z.ndim - 3)[..., :n_res, :n_res, :]
        return m, z

    # the three collectives, along dim ``dim`` of this rank's piece
    def _row(self, x: Tensor, dim: int) -> Tensor:
        return _gather(x, self.mesh.row, dim)

    def _col(self, x: Tensor, dim: int) -> Tensor:
        return _gather(x, self.mesh.col, dim)

    def _swap(self, x: Tensor) -> Tensor:
        return _Swap.apply(x, self.mesh)

    def _outer_product_mean(self, m: Tensor, chunk_size: int | None) -> Tensor:
        """z tile update ``[*, n, n, C_z]``: z's rows I_r come from m's residues R_r (rank (c, r)'s column block)."""
        opm, (msa_mask, _, mask_t, _), (_, res_r, res_c) = self.block.outer_product_mean, self._masks, self._blocks
        a, b, _ = opm.project(m, mask_t)  # [*, s, n, c]
        seqs = a.ndim - 3
        a = self._row(self._swap(a), seqs)  # a[:, I_r] [*, S', n, c]
        b = self._col(b, seqs)  # b[:, J_c] [*, S', n, c]
        return opm.outer(a, b, msa_mask[..., res_r], msa_mask[..., res_c], chunk_size)

    def _msa_row_attention(self, m: Tensor, z: Tensor) -> Tensor:
        """Queries m[S_r, R_c], keys m[S_r, :], pair bias rows b[R_c, :] ``[*, 1, H, n, N']``."""
        att, (msa_mask, *_), (seq_r, *_) = self.block.msa_att_row, self._masks, self._blocks
        bias = self._swap(self._row(att.pair_bias_of(z), z.ndim - 2))  # [*, n, N', H]
        x = att.layer_norm_m(m)
        return _attend(att.mha, x, self.mesh.row, msa_mask[..., seq_r, :],
                       bias.movedim(-1, -3).unsqueeze(-4), att.inf, att.backend)

    def _msa_column_attention(self, m: Tensor) -> Tensor:
        """Queries m[S_r, R_c] (transposed), keys m[:, R_c]."""
        att, (msa_mask, *_), (_, _, res_c) = self.block.msa_att_col._msa_att, self._masks, self._blocks
        x = att.layer_norm_m(m).transpose(-2, -3)  # [*, n, s, C_m]
        out = _attend(att.mha, x, self.mesh.col, msa_mask[..., res_c].transpose(-1, -2), None,
                      att.inf, att.backend)
        return out.transpose(-2, -3)

    def _triangle_attention(self, att, z: Tensor, transpose_bias: bool) -> Tensor:
        """Starting node: queries z[I_r, J_c] against keys z[I_r, :], bias ``b_jk`` (``b_kj`` transposed) of j in
        J_c; ending node (on z's transpose): keys z[:, J_c], bias ``b_ki`` (``b_ik``) of i in I_r."""
        (_, pair_mask, *_), (_, res_r, res_c) = self._masks, self._blocks
        rows, cols = z.ndim - 3, z.ndim - 2
        b = att.triangle_bias(z)  # [*, n, n, H]
        x = att.layer_norm(z)
        if att.starting:  # [H, j, k] from b[J_c, :] or b[:, J_c]
            bias = (self._col(b, rows).transpose(-2, -3) if transpose_bias else self._swap(self._row(b, cols)))
            key_mask, ring = pair_mask[..., res_r, :], self.mesh.row
        else:  # on z^T: [H, i, k] from b[:, I_r] or b[I_r, :]
            bias = (self._row(b, cols) if transpose_bias else self._swap(self._col(b, rows)).transpose(-2, -3))
            key_mask, ring = pair_mask[..., res_c].transpose(-1, -2), self.mesh.col
            x = x.transpose(-2, -3)
        out = _attend(att.mha, x, ring, key_mask, bias.movedim(-1, -3).unsqueeze(-4), att.inf, att.backend)
        return out if att.starting else out.transpose(-2, -3)

    def _pair_stack(self, z: Tensor, chunk_size: int | None) -> Tensor:
        """The pair stack on this rank's z tile ``[*, n, n, C_z]``."""
        ps, pm = self.block.pair_stack, self._masks[3]
        rows, cols = z.ndim - 3, z.ndim - 2
        mul = ps.tri_mul_out  # p_ij = sum_k a_ik b_jk: a[I_r, :], b[J_c, :]
        x = mul.layer_norm_in(z)
        a, b = mul.projections(x, pm.unsqueeze(-1))
        z = z + ps.dropout_row(mul.finish(x, mul.combine(self._row(a, cols), self._swap(self._row(b, cols)))))
        mul = ps.tri_mul_in  # p_ij = sum_k a_ki b_kj: a[:, I_r], b[:, J_c]
        x = mul.layer_norm_in(z)
        a, b = mul.projections(x, pm.unsqueeze(-1))
        z = z + ps.dropout_row(mul.finish(x, mul.combine(self._swap(self._col(a, rows)), self._col(b, rows))))
        z = z + ps.dropout_row(self._triangle_attention(ps.tri_att_start, z, False))
        z = z + ps.dropout_col(self._triangle_attention(ps.tri_att_end, z, ps.transpose_end_bias))
        return z + ps.pair_transition(z, pm, chunk_size)


class EvoformerContextParallel2D(nn.Module):
    """An :class:`~ds4sci.models.evoformer.EvoformerBlock` run on a ``p x p`` mesh of ``group``'s ranks (module
    docstring), with the block's call signature: ``forward(m [*, N_seq, N_res, C_m], z [*, N_res, N_res, C_z],
    msa_mask=None [*, N_seq, N_res], pair_mask=None [*, N_res, N_res], chunk_size=None) -> (m, z)``, full tensors
    in and out on every rank (each rank passes the same inputs). Holds the given block (its parameters, not a copy):
    its state dict is the block's. Every rank of ``group`` constructs it (it creates the mesh's row and column
    groups)."""

    def __init__(self, block: EvoformerBlock, group, p: int):
        super().__init__()
        if not isinstance(block, EvoformerBlock):
            raise TypeError(f"evoformer_context_parallel: expected a ds4sci EvoformerBlock, got {type(block).__name__}")
        self.block, self.group = block, group
        self._sharded = (_MeshEvoformer(block, _Mesh(group, p)),)  # a tuple: not a second path to the parameters

    def forward(self, m: Tensor, z: Tensor, msa_mask: Tensor | None = None, pair_mask: Tensor | None = None,
                chunk_size: int | None = None) -> tuple[Tensor, Tensor]:
        unbatched = m.ndim == 3  # the kernel wants a batch dim
        if unbatched:
            m, z = m.unsqueeze(0), z.unsqueeze(0)
            msa_mask = None if msa_mask is None else msa_mask.unsqueeze(0)
            pair_mask = None if pair_mask is None else pair_mask.unsqueeze(0)
        synced = {f"block.{name}": sync_grad(p, self.group) for name, p in self.block.named_parameters()}
        m, z = torch.func.functional_call(self._sharded[0], synced, (m, z, msa_mask, pair_mask, chunk_size))
        return (m.squeeze(0), z.squeeze(0)) if unbatched else (m, z)
