"""Tiles around the rings of a p x p mesh (:mod:`ds4sci.parallel.evoformer.mesh2d`): Cannon's sum of products
(Cannon 1969), ring attention on the Evoformer kernel (Liu et al. 2023) and the single representation's attention
from pair-bias tiles, the partial softmax results merged by the kernel's statistics
(:func:`ds4sci.kernels.evoformer.evoformer_attention_fwd`: FlashAttention-2's row max and row sum, kept apart) with
the one merge, :func:`ds4sci.sequence.merge_softmax`.

The rings are driven by the sequence ring's driver (:func:`ds4sci.sequence.ring.ring_forward`,
:func:`~ds4sci.sequence.ring.ring_backward`): each Function here gives only its step (a product of tiles, one call
of the Evoformer kernel on a key block and its bias tile); the gradients of a rotating tile travel with it and are
home after p steps. ``mesh`` arguments are
:class:`~ds4sci.parallel.evoformer.mesh2d.Mesh` objects (``p``, ``r``, ``c``, ``row``, ``col``, ``group``,
``counter``).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ds4sci.distributed.comm import all_gather
from ds4sci.distributed.comm import all_reduce
from ds4sci.distributed.comm import group_size
from ds4sci.kernels.evoformer import evoformer_attention_bwd
from ds4sci.kernels.evoformer import evoformer_attention_fwd
from ds4sci.parallel.evoformer.common import block_slice
from ds4sci.sequence.ring import merge_softmax
from ds4sci.sequence.ring import ring_backward
from ds4sci.sequence.ring import ring_forward

__all__ = ["CannonSum", "EvoformerRingAttention", "TileAttention", "merge_stats"]


class CannonSum(torch.autograd.Function):
    """``sum_t product(a_t, b_t)`` over the p blocks t, Cannon's schedule: ``a`` (this rank's skewed tile, block
    ``t0``) rotates around ``ring_a``, ``b`` around ``ring_b``, both one block back per step, the next tiles in flight
    while this step computes; backward rotates them again with their gradients (``product``'s, by autograd), which
    are home after p steps."""

    @staticmethod
    def forward(ctx, a, b, product, ring_a, ring_b, counter):
        ctx.product, ctx.rings, ctx.counter = product, [ring_a, ring_b], counter
        ctx.save_for_backward(a, b)
        return ring_forward([a, b], ctx.rings, counter,
                            lambda _, tiles, total: product(*tiles) if total is None else total + product(*tiles))

    @staticmethod
    def backward(ctx, grad):
        tiles = list(ctx.saved_tensors)

        def step(_, tiles, grads):  # the gradients travel with their tile
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_() for t in tiles]
                step_grads = torch.autograd.grad(ctx.product(*leaves), leaves, grad)
            return [g + d for g, d in zip(grads, step_grads)]

        grads = ring_backward(tiles, [torch.zeros_like(t) for t in tiles], ctx.rings, ctx.counter, step)
        return grads[0], grads[1], None, None, None, None


class EvoformerRingAttention(torch.autograd.Function):
    """``softmax_j(q_i . k_j / sqrt(D) + mask_j + pair_ij) v_j`` of this rank's queries over the key blocks of a ring
    of p ranks (a mesh row or column): ring attention's schedule (Liu et al. 2023) on the Evoformer kernel.

    q ``[*, N, s, H, D]``; k, v ``[*, N, s, H, D]`` (this rank's skewed tile, key block ``t0``), rotating around
    ``kv_ring``; mask bias ``[*, N|1, 1, 1, p*s]`` (every key's, in key order, constant) or None; pair bias tile
    ``[*, 1, H, s, s]`` of the same key block (rotating around ``bias_ring``) or None; returns ``[*, N, s, H, D]``.
    Each step is one call of the Evoformer kernel (``evoformer_attention``'s custom op) on key block
    ``t0 - step``, the next tiles in flight meanwhile; the partial results are merged by the kernel's statistics,
    row max and row sum kept apart (:func:`merge_stats`). Backward rotates the tiles again and runs the kernel's
    backward per tile against the merged output and statistics (flash attention's gradient of a tile needs only
    ``P = exp(logits - max) / sum`` and ``D = rowsum(dO * O)``); the tiles' gradients travel with them and are home
    after p steps.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, pair, backend, kv_ring, bias_ring, t0, counter):
        *_, n, s, h, d = q.shape
        rings = [kv_ring, kv_ring, bias_ring]
        size = group_size(kv_ring)

        def step(i, tiles, merged):
            keys = block_slice((t0 - i) % size, s)
            o_t, stats_t = evoformer_attention_fwd(q, tiles[0], tiles[1], None if mask is None else mask[..., keys],
                                                   tiles[2], backend=backend)
            o_t = o_t.reshape(-1, n, s, h, d)  # [Z, N, s, H, D], beside the statistics [Z, N, H, s, 2]
            return (o_t, stats_t) if merged is None else merge_stats(*merged, o_t, stats_t)

        out, stats = ring_forward([k, v, pair], rings, counter, step)
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

        def step(i, tiles, grads):
            keys = block_slice((ctx.t0 - i) % size, s)
            dq_t, dk_t, dv_t, _, dpair_t = evoformer_attention_bwd(grad, q, tiles[0], tiles[1], out, stats,
                                                                   None if mask is None else mask[..., keys], tiles[2],
                                                                   need_pair_grad=need_pair, backend=ctx.backend)
            dq.add_(dq_t)
            return [grads[0] + dk_t, grads[1] + dv_t, grads[2] + dpair_t if need_pair else None]

        grads = [torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(pair) if need_pair else None]
        grads = ring_backward([k, v, pair], grads, ctx.rings, ctx.counter, step)
        return dq, grads[0], grads[1], None, grads[2], None, None, None, None, None


class TileAttention(torch.autograd.Function):
    """AF3 Algorithm 24's ``softmax_j(q_i . k_j / sqrt(D) + b_ij + mask_j) v_j`` over the whole single representation,
    from the pair bias tiles: no rank holds more of ``b`` than its own tile and no ``N x N`` tensor is made.

    q, k, v ``[*, 1, N', H, D]`` whole on every rank (the same on each); mask bias ``[*, 1, 1, 1, N']`` (the padding
    keys at -inf); pair ``[*, 1, H, n, n]``: this rank's tile ``b[I_r, J_c]``; returns ``[*, 1, N', H, D]``, the same
    on every rank. Rank (r, c) runs the Evoformer kernel once, queries ``I_r`` against keys ``J_c`` with its tile;
    the mesh row's p partial results (the row's key blocks) are all-gathered and merged in column order
    (:func:`merge_stats`, the ring attention's merge: every rank of the row the same bits), and the column's
    query blocks all-gathered. Backward: the kernel's backward of the tile against the merged output and statistics
    (each tile's exact share, as in :class:`EvoformerRingAttention`), the pair gradient this rank's tile's (it goes
    back into this rank's z tile), and ``dq`` (rows ``I_r``), ``dk``, ``dv`` (rows ``J_c``) summed over the mesh in one
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
            out, stats = merge_stats(out, stats, o_c, stats_c)
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


def merge_stats(out: Tensor, stats: Tensor, o_t: Tensor, stats_t: Tensor) -> tuple[Tensor, Tensor]:
    """Two partial softmax results over disjoint key sets as one, in the Evoformer kernel's form: ``out``, ``o_t``
    ``[Z, N, s, H, D]`` with the kernel's statistics ``[Z, N, H, s, 2]`` (row max, row sum; ``(+inf, +inf)`` on a
    row with no key). :func:`~ds4sci.sequence.merge_softmax` on the row max and row sum kept apart (not as a
    log-sum-exp: with OpenFold's finite mask ``-1e9`` fp32 would swallow ``log(sum)``), the empty rows given to it
    as ``(-inf, 0)`` and returned as ``(+inf, +inf)``."""
    def parts(st):  # [Z, N, H, s] row max and row sum; a row with no key: (-inf, 0), which weighs nothing
        empty = torch.isposinf(st[..., 0])
        return torch.where(empty, -math.inf, st[..., 0]), torch.where(empty, 0.0, st[..., 1])

    out, top, total = merge_softmax(out, *parts(stats), o_t, *parts(stats_t))
    seen = total > 0
    return out, torch.stack([torch.where(seen, top, math.inf), torch.where(seen, total, math.inf)], dim=-1)
