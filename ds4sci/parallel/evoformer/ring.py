"""Tiles around the rings of a p x p mesh (:mod:`ds4sci.parallel.evoformer.mesh2d`): point-to-point moves, ring
rotations, Cannon's sum of products (Cannon 1969), ring attention on the Evoformer kernel (Liu et al. 2023) and the
single representation's attention from pair-bias tiles, the partial softmax results merged by the kernel's
statistics (:func:`ds4sci.kernels.evoformer.evoformer_attention_fwd`: FlashAttention-2's row max and row sum, kept
apart).

Each autograd.Function here moves the gradients back the way its tiles came: the gradients of a rotating tile
travel with it and are home after p steps. ``mesh`` arguments are
:class:`~ds4sci.parallel.evoformer.mesh2d.Mesh` objects (``p``, ``r``, ``c``, ``row``, ``col``, ``group``,
``counter``).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from ds4sci.distributed.comm import CommCounter, RingShift, all_gather, all_reduce, group_size
from ds4sci.kernels.evoformer import evoformer_attention_bwd, evoformer_attention_fwd
from ds4sci.parallel.evoformer.common import block_slice

__all__ = ["CannonSum", "Move", "RingAttention", "TileAttention"]

# RingShift tags: tiles and their gradients on the mesh row and column (distinct while in flight at once)
_TILE_TAG, _GRAD_TAG = 0, 1


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


class Move(torch.autograd.Function):
    """A permutation of tiles in forward (``x`` to ``dst``, this rank's from ``src``) and its inverse in backward."""

    @staticmethod
    def forward(ctx, x, dst, src, group, counter):
        ctx.dst, ctx.src, ctx.group, ctx.counter = dst, src, group, counter
        return _p2p(x, dst, src, group, counter)

    @staticmethod
    def backward(ctx, grad):
        return _p2p(grad, ctx.src, ctx.dst, ctx.group, ctx.counter), None, None, None, None


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


class CannonSum(torch.autograd.Function):
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


class RingAttention(torch.autograd.Function):
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
            keys = block_slice((t0 - step) % size, s)
            o_t, stats_t = evoformer_attention_fwd(q, tiles[0], tiles[1], None if mask is None else mask[..., keys],
                                                   tiles[2], backend=backend)
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
            keys = block_slice((ctx.t0 - step) % size, s)
            dq_t, dk_t, dv_t, _, dpair_t = evoformer_attention_bwd(grad, q, tiles[0], tiles[1], out, stats,
                                                                   None if mask is None else mask[..., keys], tiles[2],
                                                                   need_pair_grad=need_pair, backend=ctx.backend)
            dq += dq_t
            # on to the next rank, which holds these tiles next step; after the last step, home
            grads = _Rotation([grads[0] + dk_t, grads[1] + dv_t, grads[2] + dpair_t if need_pair else None],
                              ctx.rings, _GRAD_TAG, ctx.counter).wait()
            if pending is not None:
                tiles = pending.wait()
        return dq, grads[0], grads[1], None, grads[2], None, None, None, None, None


class TileAttention(torch.autograd.Function):
    """AF3 Algorithm 24's ``softmax_j(q_i . k_j / sqrt(D) + b_ij + mask_j) v_j`` over the whole single representation,
    from the pair bias tiles: no rank holds more of ``b`` than its own tile and no ``N x N`` tensor is made.

    q, k, v ``[*, 1, N', H, D]`` whole on every rank (the same on each); mask bias ``[*, 1, 1, 1, N']`` (the padding
    keys at -inf); pair ``[*, 1, H, n, n]``: this rank's tile ``b[I_r, J_c]``; returns ``[*, 1, N', H, D]``, the same
    on every rank. Rank (r, c) runs the Evoformer kernel once, queries ``I_r`` against keys ``J_c`` with its tile;
    the mesh row's p partial results (the row's key blocks) are all-gathered and merged in column order
    (:func:`_merge_stats`, the ring attention's merge: every rank of the row the same bits), and the column's
    query blocks all-gathered. Backward: the kernel's backward of the tile against the merged output and statistics
    (each tile's exact share, as in :class:`RingAttention`), the pair gradient this rank's tile's (it goes back into
    this rank's z tile), and ``dq`` (rows ``I_r``), ``dk``, ``dv`` (rows ``J_c``) summed over the mesh in one
    all-reduce, so that every rank holds the whole gradients of q, k and v, as the replicated s-side expects.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, pair, backend, mesh):
        n = pair.shape[-1]
        rows, cols = block_slice(mesh.r, n), block_slice(mesh.c, n)
        q_r, k_c, v_c, mask_c = (q[..., rows, :, :], k[..., cols, :, :], v[..., cols, :, :], mask[..., cols])
        o_t, stats_t = evoformer_attention_fwd(q_r, k_c, v_c, mask_c, pair, backend=backend)
        parts = [all_gather(t.reshape(1, -1, *t.shape[-4:]), mesh.row, 0, mesh.counter) for t in (o_t, stats_t)]
        out, stats = parts[0][0], parts[1][0]  # [Z, 1, n, H, D], [Z, 1, H, n, 2]
        for o_c, stats_c in zip(parts[0][1:], parts[1][1:]):  # the row's key blocks J_1 .. J_{p-1}, in order
            out, stats = _merge_stats(out, stats, o_c, stats_c)
        out = out.reshape(q_r.shape)
        ctx.save_for_backward(q_r, k_c, v_c, mask_c, pair, out, stats)
        ctx.backend, ctx.mesh, ctx.full = backend, mesh, q.shape
        return all_gather(out, mesh.col, -3, mesh.counter)

    @staticmethod
    def backward(ctx, grad):
        q_r, k_c, v_c, mask_c, pair, out, stats = ctx.saved_tensors
        mesh, n = ctx.mesh, pair.shape[-1]
        rows, cols = block_slice(mesh.r, n), block_slice(mesh.c, n)
        need_pair = ctx.needs_input_grad[4]
        dq, dk, dv, _, dpair = evoformer_attention_bwd(grad[..., rows, :, :].contiguous(), q_r, k_c, v_c, out, stats,
                                                       mask_c, pair, need_pair_grad=need_pair, backend=ctx.backend)
        whole = grad.new_zeros((3, *ctx.full))  # dq of rows I_r, dk and dv of rows J_c, summed over the mesh
        whole[0][..., rows, :, :], whole[1][..., cols, :, :], whole[2][..., cols, :, :] = dq, dk, dv
        whole = all_reduce(whole, mesh.group, mesh.counter)
        return whole[0], whole[1], whole[2], None, dpair, None, None


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
