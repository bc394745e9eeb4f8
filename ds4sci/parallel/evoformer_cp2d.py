"""Evoformer and Pairformer blocks on a p x p mesh of ranks: 2-D context parallelism with single-process semantics.

Fold-CP's layout (NVIDIA's context parallelism for Boltz): the pair representation ``z [*, N_res, N_res, C_z]`` is
cut into p x p tiles and rank (r, c) of the mesh (group rank ``r * p + c``) holds ``z[I_r, J_c]``, ``N_res/p`` by
``N_res/p``; the MSA ``m [*, N_seq, N_res, C_m]`` is tiled to match, rank (r, c) holding sequences ``S_r`` of
residues ``R_c`` (the same residue blocks as z's: ``I = J = K = R``). No rank ever holds more than tiles: every
sub-module that needs a whole row or column of tiles gets them one at a time, Cannon's way (Cannon 1969):

- the *transpose swap*: rank (r, c) exchanges a tile with rank (c, r) (its own adjoint);
- the *skew*: on the mesh row, rank (r, c) takes the tile of (r, c + r); on the mesh column, that of (r + c, c)
  (backward: the inverse shift), so that both operands of a product start at the same block ``t0 = r + c``;
- the *ring*: the tiles move one rank on around the row or the column per step (block ``t0 - step``), the
  gradients of each tile travel with it and are home after p steps (:class:`~ds4sci.sequence.comm.RingShift`).

Per block (AF2 supplement Algorithm 6), rank (r, c) computes the outputs of its own tiles only, over blocks t:

==============================  =================================================================================
sub-module                      the operands rotating (around the mesh row / the mesh column)
==============================  =================================================================================
MSA row attention, pair bias    keys/values ``m[S_r, R_t]`` / the swapped bias tile ``b[R_c, R_t]``
MSA column attention            - / keys/values ``m[S_t, R_c]``
MSA and pair transitions        - (pointwise on the tile)
outer product mean              the swapped ``a[S_t, I_r]`` / ``b[S_t, J_c]``: ``sum_s a_si b_sj`` summed over t
triangle mult. outgoing         ``a[I_r, K_t]`` / the swapped ``b[J_c, K_t]`` (Cannon's matrix product)
triangle mult. incoming         the swapped ``a[K_t, I_r]`` / ``b[K_t, J_c]``
triangle attention, start       keys/values ``z[I_r, K_t]`` / bias ``b[J_c, K_t]`` (swapped; ``b[K_t, J_c]``
                                transposed)
triangle attention, end         bias ``b[K_t, I_r]`` (swapped; ``b[I_r, K_t]`` transposed) / keys/values
                                ``z[K_t, J_c]``
==============================  =================================================================================

The attentions are ring attention (Liu et al. 2023) on the Evoformer kernel (:class:`_RingAttention`): one kernel
call per ``N/p x N/p`` tile, the bias tile rotating beside the key/value tile, the partial results merged by the
kernel's row max and row sum kept apart (:func:`_merge_stats`: a log-sum-exp loses the row sum in fp32 on a row
whose keys are all masked with OpenFold's -1e9); backward runs the kernel's backward per tile against the merged
output and statistics, which gives each tile's exact share of the gradients. The padding keys are masked with
-inf, so a real row whose keys are all masked attends over its real keys, as the single process does.

Pairformer block (AF3 supplement Algorithm 17): the pair stack on the z tiles as above, then the single
representation ``s [*, N, C_s]`` replicated, as in the axial version (s is ``O(N)``: sharding it would save ``N
C_s`` per rank and cost a layout switch per block), but its attention with pair bias (AF3 Algorithm 24) computed from
the bias tiles (:class:`_TileAttention`): rank (r, c) projects its z tile to its bias tile ``b[I_r, J_c]`` ``[*, n,
n, H]``, which never moves, and attends the queries ``I_r`` to the keys ``J_c`` with it; the mesh row's p partial
results are merged by the ring attention's merge (:func:`_merge_stats`) and the query blocks gathered over the mesh
column. No rank makes an ``N x N`` tensor (tested, forward and backward). Every per-token step of the s-side
(layer norm, q, k, v, gate, output projection, transition) runs whole on every rank; the q, k, v gradients are
summed over the mesh in backward, so every rank holds them whole and the s-side parameters' gradients are not
all-reduced (``PAIRFORMER_REPLICATED``); the bias projection's are, as the pair stack's.

Entry, exit, parameters, padding and dropout as the axial version (:mod:`ds4sci.parallel.evoformer_cp`): full
tensors in and out on every rank (entry split, backward all-gather; exit gather, backward split), parameter
gradients all-reduced over the mesh, N_seq and N_res padded to multiples of p with masked rows; exact in eval mode.
Of the pair mask a rank holds only the strips it reads, rows ``I_r`` and columns ``J_c`` (``2 N'^2 / p``), cut out of
the caller's mask before they are converted and padded: no rank makes an ``N' x N'`` mask (the MSA mask, ``S' x N'``,
is padded whole). ``chunk_size`` bounds the transitions as in the block; the attentions and products are already tiled.

Tile layout, and stacks. ``S'``, ``N'``: N_seq and N_res padded to multiples of p, ``s = S'/p``, ``n = N'/p``,
``S_r`` the sequences ``r s .. (r+1) s - 1``, ``R_c`` (= ``I_c`` = ``J_c``) the residues ``c n .. (c+1) n - 1``. Rank
(r, c) holds ``m[..., S_r, R_c, :]`` ``[*, s, n, C_m]`` and ``z[..., R_r, R_c, :]`` ``[*, n, n, C_z]`` (the padded
sequences and residues at the ends of the last row and column of tiles), and a block maps this layout to itself.
A stack (a sequence of Evoformer blocks, an ``nn.ModuleList``) runs block after block; by default each block is
its own region (full tensors between blocks); ``sharded=True`` keeps the tiles from the stack's entry split to its
exit gather, and nothing moves between blocks.

Bytes sent per rank per block inside a sharded stack (:func:`block_comm_bytes`), training (forward and backward),
as :class:`~ds4sci.sequence.CommCounter` records them (``p2p``: every tile a rank sends; ``all_reduce``: the
parameter gradients, ``2 (P-1)/P |params|`` over the ``P = p^2`` ranks), in elements (times batch and bytes per
element). A tile ``t`` that moves (swap or skew) sends ``|t|`` forward and its gradient backward, ``2 |t|``, and
moves only where the permutation is not the identity: the swap off the diagonal (``X = [r != c]``), the row skew
on rows ``r != 0`` (``R``), the column skew on columns ``c != 0`` (``C``). A tile rotating on a ring of p ranks is
sent ``p - 1`` times forward, ``p - 1`` times again in backward and its gradient ``p`` times (home after the last
step): ``(3p - 2) |t|``. With ``H``, ``c`` each attention's heads and channels per head::

    outer product mean      a, b [s, n, c_opm]        (2X + 2R + 2C + 2(3p-2)) s n c_opm
    MSA row attention       bias [n, n, H_msa]        (2X + 2C + (3p-2)) n^2 H_msa
                            m (skew), k, v            2R s n C_m + 2(3p-2) s n H_msa c_msa
    MSA column attention    m (skew), k, v            2C s n C_m + 2(3p-2) s n H_msa c_msa   (if present)
    triangle mult. out, in  a, b [n, n, c_mul]        2 (2X + 2R + 2C + 2(3p-2)) n^2 c_mul
    triangle att. start     bias, z (skew), k, v      (2X + 2C + (3p-2)) n^2 H_pair + 2R n^2 C_z
                                                      + 2(3p-2) n^2 H_pair c_pair
    triangle att. end       bias, z (skew), k, v      (2X' + 2R + (3p-2)) n^2 H_pair + 2C n^2 C_z
                                                      + 2(3p-2) n^2 H_pair c_pair

(``X' = X`` with OpenFold3's ending-node bias, 0 with OpenFold's, which needs no swap). Every term is ``n^2`` or
``s n`` times ``O(p)``: with ``n = N'/p`` the bytes per rank fall as ``1/p = 1/sqrt(P)``, where the axial layout's
stay ``O(N^2)`` at any P. A Pairformer block sends the pair stack's rows and its single attention's (``H`` heads of
``c`` channels, no ``N^2`` term): forward, the all-gather of the partial results ``[n, H, c]`` and statistics
``[H, n, 2]`` (fp32, fp64 with fp64 activations: ``e'`` bytes) over the mesh row and of the merged queries' output
over the mesh column, ``(p - 1) n H (2 c e + 2 e')`` bytes (``all_gather``); backward, the all-reduce over the p^2
ranks of dq, dk, dv ``[3, N', H, c]``, ``2 (P-1)/P 3 N' H c`` (``all_reduce``, beside the parameters', the
replicated s-side parameters left out).
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ds4sci.kernels import EvoformerBackend
from ds4sci.kernels.evoformer import _attention_bwd, _attention_fwd, _choose_backend
from ds4sci.models.evoformer import EvoformerBlock, PairformerBlock
from ds4sci.models.evoformer.primitives import GatedAttention, mask_bias
from ds4sci.parallel.evoformer_cp import PAIRFORMER_REPLICATED, _gather_out, hold_blocks, synced_parameters
from ds4sci.distributed.comm import CommCounter, RingShift, group_rank, group_size, split_sequence_region
from ds4sci.distributed.comm import all_gather as all_gather_seq
from ds4sci.distributed.comm import all_reduce as _all_reduce
from ds4sci.sequence.sharding import pad_to_multiple

__all__ = ["block_comm_bytes", "EvoformerContextParallel2D", "check_mesh"]

# RingShift tags: tiles and their gradients on the mesh row and column (distinct while in flight at once)
_TILE_TAG, _GRAD_TAG = 0, 1


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


def _p2p(x: Tensor, dst: int, src: int, group, counter: CommCounter | None) -> Tensor:
    """Send ``x`` to global rank ``dst`` and receive a tensor of its shape from ``src`` (``x`` itself if both are
    this rank)."""
    if dst == src == dist.get_rank():
        return x
    x = x.contiguous()
    if counter is not None:
        counter.record("p2p", x.numel() * x.element_size(), x.numel() * x.element_size())
    out = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, dst, group), dist.P2POp(dist.irecv, out, src, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return out


class _Move(torch.autograd.Function):
    """A permutation of tiles in forward (``x`` to ``dst``, this rank's from ``src``) and its inverse in backward."""

    @staticmethod
    def forward(ctx, x, dst, src, group, counter):
        ctx.dst, ctx.src, ctx.group, ctx.counter = dst, src, group, counter
        return _p2p(x, dst, src, group, counter)

    @staticmethod
    def backward(ctx, grad):
        return _p2p(grad, ctx.src, ctx.dst, ctx.group, ctx.counter), None, None, None, None


def _swap(x: Tensor, mesh: _Mesh) -> Tensor:
    """Rank (r, c) gets the tile of rank (c, r)."""
    return _Move.apply(x, mesh.partner, mesh.partner, mesh.group, mesh.counter)


def _skewed(x: Tensor, mesh: _Mesh, ring) -> Tensor:
    """Rank (r, c) gets, on the row, the tile of (r, c + r); on the column, the tile of (r + c, c)."""
    by, me = mesh.skew(ring), group_rank(ring)
    dst, src = (dist.get_global_rank(ring, (me + step) % mesh.p) for step in (-by, by))
    return _Move.apply(x, dst, src, ring, mesh.counter)


class _Rotation:
    """One step of the rings: each tile (None entries stay None) goes to the next rank of its ring and the previous
    rank's comes in; posted at construction, the received tiles returned by :meth:`wait` (compute in between)."""

    def __init__(self, tiles: list, rings: list, tag: int, counter: CommCounter | None):
        self._tiles, self._rings = tiles, rings
        self._shifts = {id(ring): RingShift([t for t, g in zip(tiles, rings) if g is ring and t is not None], ring,
                                            counter, tag)
                        for ring in {id(g): g for g, t in zip(rings, tiles) if t is not None}.values()}

    def wait(self) -> list:
        received = {key: iter(shift.wait()) for key, shift in self._shifts.items()}
        return [None if t is None else next(received[id(g)]) for t, g in zip(self._tiles, self._rings)]


class _CannonSum(torch.autograd.Function):
    """``sum_t product(a_t, b_t)`` over the p blocks t, Cannon's schedule: ``a`` (this rank's skewed tile, block
    ``t0``) rotates around ``ring_a``, ``b`` around ``ring_b``, both one block back per step, the next tiles in flight
    while this step computes; backward rotates them again with their gradients (``product``'s, by autograd), which
    are home after p steps."""

    @staticmethod
    def forward(ctx, a, b, product, ring_a, ring_b, counter):
        ctx.product, ctx.rings, ctx.counter = product, [ring_a, ring_b], counter
        ctx.save_for_backward(a, b)
        size, tiles, total = group_size(ring_a), [a, b], None
        for step in range(size):
            pending = _Rotation(tiles, ctx.rings, _TILE_TAG, counter) if step < size - 1 else None
            total = product(*tiles) if total is None else total + product(*tiles)
            if pending is not None:
                tiles = pending.wait()
        return total

    @staticmethod
    def backward(ctx, grad):
        size, tiles = group_size(ctx.rings[0]), list(ctx.saved_tensors)
        grads = [torch.zeros_like(t) for t in tiles]  # the gradients travel with their tile
        for step in range(size):
            pending = _Rotation(tiles, ctx.rings, _TILE_TAG, ctx.counter) if step < size - 1 else None
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_() for t in tiles]
                step_grads = torch.autograd.grad(ctx.product(*leaves), leaves, grad)
            # on to the next rank, which holds these tiles next step; after the last step, home
            grads = _Rotation([g + d for g, d in zip(grads, step_grads)], ctx.rings, _GRAD_TAG, ctx.counter).wait()
            if pending is not None:
                tiles = pending.wait()
        return grads[0], grads[1], None, None, None, None


class _RingAttention(torch.autograd.Function):
    """``softmax_j(q_i . k_j / sqrt(D) + mask_j + pair_ij) v_j`` of this rank's queries over the key blocks of a ring
    of p ranks (a mesh row or column): ring attention's schedule (Liu et al. 2023) on the Evoformer kernel.

    q ``[*, N, s, H, D]``; k, v ``[*, N, s, H, D]`` (this rank's skewed tile, key block ``t0``), rotating around
    ``kv_ring``; mask bias ``[*, N|1, 1, 1, p*s]`` (every key's, in key order, constant) or None; pair bias tile
    ``[*, 1, H, s, s]`` of the same key block (rotating around ``bias_ring``) or None; returns ``[*, N, s, H, D]``.
    Each step is one call of the Evoformer kernel (``evoformer_attention``'s custom op) on key block
    ``t0 - step``, the next tiles in flight meanwhile; the partial results are merged by the kernel's statistics,
    row max and row sum kept apart (:func:`_merge_stats`). Backward rotates the tiles again and runs the kernel's
    backward per tile against the merged output and statistics (flash attention's gradient of a tile needs only
    ``P = exp(logits - max) / sum`` and ``D = rowsum(dO * O)``); the tiles' gradients travel with them and are home
    after p steps.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, pair, backend, kv_ring, bias_ring, t0, counter):
        *_, n, s, h, d = q.shape
        size, rings = group_size(kv_ring), [kv_ring, kv_ring, bias_ring]
        out = stats = None
        tiles = [k, v, pair]
        for step in range(size):
            pending = _Rotation(tiles, rings, _TILE_TAG, counter) if step < size - 1 else None
            keys = _block((t0 - step) % size, s)
            o_t, stats_t = _attention_fwd(q, tiles[0], tiles[1], None if mask is None else mask[..., keys],
                                          tiles[2], backend)
            o_t = o_t.reshape(-1, n, s, h, d)  # [Z, N, s, H, D], beside the statistics [Z, N, H, s, 2]
            out, stats = (o_t, stats_t) if out is None else _merge_stats(out, stats, o_t, stats_t)
            if pending is not None:
                tiles = pending.wait()
        out = out.reshape(q.shape)
        ctx.save_for_backward(q, k, v, mask, pair, out, stats)
        ctx.backend, ctx.rings, ctx.t0, ctx.counter = backend, rings, t0, counter
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, mask, pair, out, stats = ctx.saved_tensors  # the merged statistics: every key's row max and sum
        *_, s, _, _ = q.shape
        size = group_size(ctx.rings[0])
        need_pair = pair is not None and ctx.needs_input_grad[4]
        grad = grad.contiguous()
        dq = torch.zeros_like(q)
        tiles = [k, v, pair]
        grads = [torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(pair) if need_pair else None]
        for step in range(size):
            pending = _Rotation(tiles, ctx.rings, _TILE_TAG, ctx.counter) if step < size - 1 else None
            keys = _block((ctx.t0 - step) % size, s)
            dq_t, dk_t, dv_t, *dpair_t = _attention_bwd(grad, q, tiles[0], tiles[1], out, stats,
                                                        None if mask is None else mask[..., keys], tiles[2], False,
                                                        need_pair, ctx.backend)
            dq += dq_t
            # on to the next rank, which holds these tiles next step; after the last step, home
            grads = _Rotation([grads[0] + dk_t, grads[1] + dv_t, grads[2] + dpair_t[0] if need_pair else None],
                              ctx.rings, _GRAD_TAG, ctx.counter).wait()
            if pending is not None:
                tiles = pending.wait()
        return dq, grads[0], grads[1], None, grads[2], None, None, None, None, None


class _TileAttention(torch.autograd.Function):
    """AF3 Algorithm 24's ``softmax_j(q_i . k_j / sqrt(D) + b_ij + mask_j) v_j`` over the whole single representation,
    from the pair bias tiles: no rank holds more of ``b`` than its own tile and no ``N x N`` tensor is made.

    q, k, v ``[*, 1, N', H, D]`` whole on every rank (the same on each); mask bias ``[*, 1, 1, 1, N']`` (the padding
    keys at -inf); pair ``[*, 1, H, n, n]``: this rank's tile ``b[I_r, J_c]``; returns ``[*, 1, N', H, D]``, the same
    on every rank. Rank (r, c) runs the Evoformer kernel once, queries ``I_r`` against keys ``J_c`` with its tile;
    the mesh row's p partial results (the row's key blocks) are all-gathered and merged in column order
    (:func:`_merge_stats`, the ring attention's merge: every rank of the row the same bits), and the column's
    query blocks all-gathered. Backward: the kernel's backward of the tile against the merged output and statistics
    (each tile's exact share, as in :class:`_RingAttention`), the pair gradient this rank's tile's (it goes back into
    this rank's z tile), and ``dq`` (rows ``I_r``), ``dk``, ``dv`` (rows ``J_c``) summed over the mesh in one
    all-reduce, so that every rank holds the whole gradients of q, k and v, as the replicated s-side expects.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, pair, backend, mesh):
        n = pair.shape[-1]
        rows, cols = _block(mesh.r, n), _block(mesh.c, n)
        q_r, k_c, v_c, mask_c = (q[..., rows, :, :], k[..., cols, :, :], v[..., cols, :, :], mask[..., cols])
        o_t, stats_t = _attention_fwd(q_r, k_c, v_c, mask_c, pair, backend)
        parts = [all_gather_seq(t.reshape(1, -1, *t.shape[-4:]), mesh.row, 0, mesh.counter) for t in (o_t, stats_t)]
        out, stats = parts[0][0], parts[1][0]  # [Z, 1, n, H, D], [Z, 1, H, n, 2]
        for o_c, stats_c in zip(parts[0][1:], parts[1][1:]):  # the row's key blocks J_1 .. J_{p-1}, in order
            out, stats = _merge_stats(out, stats, o_c, stats_c)
        out = out.reshape(q_r.shape)
        ctx.save_for_backward(q_r, k_c, v_c, mask_c, pair, out, stats)
        ctx.backend, ctx.mesh, ctx.full = backend, mesh, q.shape
        return all_gather_seq(out, mesh.col, -3, mesh.counter)

    @staticmethod
    def backward(ctx, grad):
        q_r, k_c, v_c, mask_c, pair, out, stats = ctx.saved_tensors
        mesh, n = ctx.mesh, pair.shape[-1]
        rows, cols = _block(mesh.r, n), _block(mesh.c, n)
        need_pair = ctx.needs_input_grad[4]
        dq, dk, dv, *dpair = _attention_bwd(grad[..., rows, :, :].contiguous(), q_r, k_c, v_c, out, stats, mask_c,
                                            pair, False, need_pair, ctx.backend)
        whole = grad.new_zeros((3, *ctx.full))  # dq of rows I_r, dk and dv of rows J_c, summed over the mesh
        whole[0][..., rows, :, :], whole[1][..., cols, :, :], whole[2][..., cols, :, :] = dq, dk, dv
        whole = _all_reduce(whole, mesh.group, mesh.counter)
        return whole[0], whole[1], whole[2], None, dpair[0] if need_pair else None, None, None


def _merge_stats(out: Tensor, stats: Tensor, o_t: Tensor, stats_t: Tensor) -> tuple[Tensor, Tensor]:
    """Two partial softmax results over disjoint key sets as one: ``out``, ``o_t`` ``[Z, N, s, H, D]`` with the
    kernel's statistics ``[Z, N, H, s, 2]`` (row max ``m``, row sum ``l = sum exp(logit - m)``; ``(+inf, +inf)`` on a
    row with no key). ``M = max(m, m_t)``, ``L = l e^(m - M) + l_t e^(m_t - M)``, ``out = (out l e^(m - M) + o_t l_t
    e^(m_t - M)) / L``: the one-pass kernel's ``(M, L)`` and output up to the order of the additions. Kept apart, not
    as a log-sum-exp ``m + log l``: with OpenFold's finite mask ``-1e9``, a row whose keys are all masked has ``m``
    near ``-1e9``, where fp32's spacing (64) swallows ``log l``, and the tiles would be weighted as if each held one
    key."""
    def parts(st):  # [Z, N, H, s] row max and row sum; a row with no key: (-inf, 0), which weighs nothing
        empty = torch.isposinf(st[..., 0])
        return torch.where(empty, -math.inf, st[..., 0]), torch.where(empty, 0.0, st[..., 1])

    (m, l), (m_t, l_t) = parts(stats), parts(stats_t)
    top = torch.maximum(m, m_t)
    shift = torch.where(torch.isfinite(top), top, 0.0)
    w, w_t = l * torch.exp(m - shift), l_t * torch.exp(m_t - shift)  # [Z, N, H, s]
    total = w + w_t
    seen = total > 0
    safe = torch.where(seen, total, 1.0)
    out = (out * (w / safe).transpose(-1, -2).unsqueeze(-1) + o_t * (w_t / safe).transpose(-1, -2).unsqueeze(-1))
    return out, torch.stack([torch.where(seen, top, math.inf), torch.where(seen, total, math.inf)], dim=-1)


def _block(t: int, size: int) -> slice:
    return slice(t * size, (t + 1) * size)


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


def _attend(mha: GatedAttention, x: Tensor, mesh: _Mesh, kv_ring, key_mask: Tensor, real_keys: int,
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
    chosen = _choose_backend(backend, q)
    chosen = EvoformerBackend.TORCH if chosen is EvoformerBackend.REFERENCE else chosen  # the oracle has no op
    mask = mask_bias(key_mask, inf, x.dtype)  # [*, N, 1, 1, p*s]
    mask[..., real_keys:] = -math.inf
    o = _RingAttention.apply(q, k, v, mask, pair, chosen.value, kv_ring, bias_ring, mesh.t0, mesh.counter)
    return mha.linear_o(o.flatten(-2) * torch.sigmoid(mha.linear_g(x)))


class _MeshStack(nn.Module):
    """The sharded computation of :class:`EvoformerBlock` s run one after the other on a mesh, m and z this rank's
    tiles from the entry to the exit (module docstring); ``blocks`` are the caller's."""

    def __init__(self, blocks: nn.ModuleList, mesh: _Mesh):
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
        res_r, res_c = _block(r, n), _block(c, n)
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
            seq_r = _block(r, msa_mask.shape[-2] // p)
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
        z = _gather_out(_gather_out(z, mesh.row, z.ndim - 2, counter), mesh.col, z.ndim - 3, counter)
        if evoformer:
            x = _gather_out(_gather_out(x, mesh.row, x.ndim - 2, counter), mesh.col, x.ndim - 3, counter)
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
        24) from the bias tiles (:class:`_TileAttention`) and its transition, every per-token step replicated."""
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
        chosen = _choose_backend(apb.backend, q)
        chosen = EvoformerBackend.TORCH if chosen is EvoformerBackend.REFERENCE else chosen  # the oracle has no op
        o = _TileAttention.apply(q, k, v, mask, pair, chosen.value, mesh)
        o = o.squeeze(-4)[..., :n_res, :, :].flatten(-2)  # [*, N, H * D]
        s = s + apb.mha.linear_o(o * torch.sigmoid(apb.mha.linear_g(x)))
        return s + blk.single_transition(s, single_mask, chunk_size), z

    def _cannon(self, a: Tensor, b: Tensor, product: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        """``sum_t product(a_t, b_t)``: ``a`` this rank's tile of the mesh row's blocks, ``b`` of the column's."""
        mesh = self.mesh
        return _CannonSum.apply(_skewed(a, mesh, mesh.row), _skewed(b, mesh, mesh.col), product, mesh.row, mesh.col,
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

    def _pair_stack(self, blk: EvoformerBlock, z: Tensor, chunk_size: int | None) -> Tensor:
        """The pair stack on this rank's z tile ``[*, n, n, C_z]``."""
        ps, pm, mesh = blk.pair_stack, self._masks[3], self.mesh
        mul = ps.tri_mul_out  # p_ij = sum_k a_ik b_jk: the row's a[I_r, K_t], the column's swapped b[J_c, K_t]
        x = mul.layer_norm_in(z)
        a, b = mul.projections(x, pm.unsqueeze(-1))
        z = z + ps.dropout_row(mul.finish(x, self._cannon(a, _swap(b, mesh), mul.combine)))
        mul = ps.tri_mul_in  # p_ij = sum_k a_ki b_kj: the row's swapped a[K_t, I_r], the column's b[K_t, J_c]
        x = mul.layer_norm_in(z)
        a, b = mul.projections(x, pm.unsqueeze(-1))
        z = z + ps.dropout_row(mul.finish(x, self._cannon(_swap(a, mesh), b, mul.combine)))
        z = z + ps.dropout_row(self._triangle_attention(ps.tri_att_start, z, False))
        z = z + ps.dropout_col(self._triangle_attention(ps.tri_att_end, z, ps.transpose_end_bias))
        return z + ps.pair_transition(z, pm, chunk_size)


class EvoformerContextParallel2D(nn.Module):
    """An :class:`~ds4sci.models.evoformer.EvoformerBlock` or :class:`~ds4sci.models.evoformer.PairformerBlock`, or a
    stack of blocks of one kind, run on a ``p x p`` mesh of ``group``'s ranks (module docstring), with the block's
    call signature: ``forward(m [*, N_seq, N_res, C_m], z [*, N_res, N_res, C_z], msa_mask=None [*, N_seq, N_res],
    pair_mask=None [*, N_res, N_res], chunk_size=None) -> (m, z)`` (Pairformer: ``forward(s [*, N, C_s], z,
    single_mask=None [*, N], pair_mask=None, chunk_size=None) -> (s, z)``), full tensors in and out on every rank
    (each rank passes the same inputs). Holds the given block or blocks (their parameters, not copies): ``block``
    (one block) or ``blocks`` (a stack; the caller's ``nn.ModuleList`` itself), so its state dict is theirs under
    that prefix. ``sharded``: a stack keeps m and z as this rank's tiles between its blocks (a Pairformer's s
    whole). ``counter`` records this rank's collectives. Every rank of ``group`` constructs it (it creates the
    mesh's row and column groups)."""

    def __init__(self, block_or_stack, group, p: int, *, sharded: bool = False, counter: CommCounter | None = None):
        super().__init__()
        single, blocks = hold_blocks(self, block_or_stack)
        self.group, self.sharded, self.counter = group, sharded, counter
        mesh = _Mesh(group, p, counter)
        regions = [blocks] if sharded or single else [[b] for b in blocks]
        # a tuple: not a second path to the parameters
        self._regions = tuple(_MeshStack(nn.ModuleList(r), mesh) for r in regions)

    def forward(self, x: Tensor, z: Tensor, x_mask: Tensor | None = None, pair_mask: Tensor | None = None,
                chunk_size: int | None = None) -> tuple[Tensor, Tensor]:
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
    """The closed form (module docstring) of the bytes that mesh rank ``rank`` (group rank ``r * p + c``) of a
    ``p x p`` mesh sends for one Evoformer or Pairformer ``block`` inside a sharded stack, training (forward and
    backward), per collective kind as :class:`~ds4sci.sequence.CommCounter` records them: ``p2p`` (tile moves and
    ring steps), ``all_gather`` (a Pairformer's single-attention partial results and outputs) and ``all_reduce``
    (the parameter gradients over the p^2 ranks, and a Pairformer's single-attention q, k, v gradients); ``n_seq``
    for an Evoformer block; ``itemsize`` of the activations."""
    r, c = divmod(rank, p)
    s, n = -(-n_seq // p), -(-n_res // p)  # tile sides, padded
    x, rr, cc, ring = int(r != c), int(r != 0), int(c != 0), 3 * p - 2
    ps = block.pair_stack
    start, end, c_z = ps.tri_att_start.mha, ps.tri_att_end.mha, ps.tri_mul_out.c_z
    tiles = 2 * (x + rr + cc + ring) * 2 * n * n * ps.tri_mul_out.c_hidden
    tiles += (2 * x + 2 * cc + ring) * n * n * start.no_heads + 2 * rr * n * n * c_z
    tiles += (2 * x * (not ps.transpose_end_bias) + 2 * rr + ring) * n * n * end.no_heads + 2 * cc * n * n * c_z
    tiles += 2 * ring * n * n * (start.no_heads * start.c_hidden + end.no_heads * end.c_hidden)
    ranks, unit = p * p, batch * itemsize
    gathered, reduced, params = 0, 0, list(block.parameters())
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
        params = [q for name, q in block.named_parameters() if not name.startswith(PAIRFORMER_REPLICATED)]
    return {"p2p": tiles * unit, "all_gather": gathered,
            "all_reduce": reduced + sum(2 * q.numel() * q.element_size() * (ranks - 1) // ranks for q in params)}
