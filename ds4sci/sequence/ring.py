"""Ring attention (Liu et al. 2023, arXiv:2310.01889) and its merge, one driver for every ring of this project.

The driver: tiles (key/value blocks, bias tiles, Cannon's operands) travel one rank on around their rings per step,
the next step's tiles in flight while this step computes (:class:`Rotation`, :func:`ring_forward`); in backward
the tiles travel again and their gradients travel with them, home after a full turn (:func:`ring_backward`). Each
user supplies only what one step does with the tiles it holds: the sequence ring (:class:`RingAttention`, a local
attention per pair of sequence pieces), the 2-D Evoformer's ring and Cannon sums
(:mod:`ds4sci.parallel.evoformer.ring`, the Evoformer kernel with bias tiles, products of tiles).

The merge: partial softmax results over disjoint key sets as one (online softmax, Milakov & Gimelshein 2018), kept
as row max and row sum (:func:`merge_softmax`) or as log-sum-exp (:func:`merge_attention`).

The steps stay with their users because their backwards differ: the sequence ring's recomputes each block of any
local attention through autograd on its pieces of q, k, v and weighs it by its share of the merged softmax,
``exp(lse_blk - lse)`` (only q, k, v, out and lse are saved); the Evoformer's calls the kernel's own backward against
the merged statistics, and its bias tile rotates on a second ring.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ds4sci.distributed.comm import CommCounter
from ds4sci.distributed.comm import RingShift
from ds4sci.distributed.comm import group_size
from ds4sci.distributed.dims import Layout
from ds4sci.distributed.dims import Piece

__all__ = ["RingAttention", "RingPlan", "Rotation", "merge_attention", "merge_softmax", "ring_backward",
           "ring_forward"]

# RingShift tags: tiles and their gradients (distinct while in flight at once)
TILE_TAG, GRAD_TAG = 0, 1


def merge_softmax(out: torch.Tensor, row_max: torch.Tensor, row_sum: torch.Tensor | float, block_out: torch.Tensor,
                  block_max: torch.Tensor, block_sum: torch.Tensor | float):
    """Two partial softmax results over disjoint key sets as one (the online softmax, Milakov & Gimelshein 2018; ring
    attention's merge, Liu et al. 2023), each given by its row max and its row sum of ``exp(logit - max)``.

    ``out``, ``block_out`` ``[*, S, H, D]`` (any leading dims); ``row_max``, ``row_sum``, ``block_max``,
    ``block_sum`` ``[*, H, S]`` (a row with no key: max ``-inf``, sum 0; a sum may be the number 1, when its max is a
    log-sum-exp). Returns ``(out, row_max, row_sum)`` of both key sets, ``out`` in ``out``'s dtype; a row no key
    reached: out 0, max ``-inf``, sum 0. Kept apart, max and sum survive a finite mask bias (OpenFold's ``-1e9``) where
    fp32's spacing (64) would swallow ``log(sum)`` in a log-sum-exp.
    """
    top = torch.maximum(row_max, block_max)
    shift = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w, w_blk = row_sum * torch.exp(row_max - shift), block_sum * torch.exp(block_max - shift)  # [*, H, S]
    total = w + w_blk
    seen = total > 0
    safe = torch.where(seen, total, torch.ones_like(total))
    w_ = (w / safe).transpose(-1, -2).unsqueeze(-1)  # [*, S, H, 1]
    w_blk_ = (w_blk / safe).transpose(-1, -2).unsqueeze(-1)
    merged = w_ * out + w_blk_ * block_out.to(out.dtype)
    return merged, torch.where(seen, shift, torch.full_like(shift, -math.inf)), total


def merge_attention(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                    block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_softmax` of two results given by their log-sum-exp: ``out``, ``block_out`` ``[*, S, H, D]``,
    ``lse``, ``block_lse`` ``[*, H, S]`` -> ``(out, lse)`` of both key sets. Rows with ``lse = -inf`` on both sides
    (no key) stay ``out = 0, lse = -inf``."""
    merged, row_max, row_sum = merge_softmax(out, lse, 1.0, block_out, block_lse, 1.0)
    return merged, torch.where(row_sum > 0, row_max + torch.log(row_sum), torch.full_like(row_max, -math.inf))


class Rotation:
    """One step of the rings: each tile (None entries stay None) goes to the next rank of its ring (``rings[i]``,
    a process group, for ``tiles[i]``) and the previous rank's comes in; posted at construction (one
    :class:`~ds4sci.distributed.comm.RingShift` per ring), the received tiles returned by :meth:`wait`."""

    def __init__(self, tiles: list, rings: list, tag: int, counter: CommCounter | None):
        self._tiles, self._rings = tiles, rings
        self._shifts = {id(ring): RingShift([t for t, g in zip(tiles, rings) if g is ring and t is not None], ring,
                                            counter, tag)
                        for ring in {id(g): g for g, t in zip(rings, tiles) if t is not None}.values()}

    def wait(self) -> list:
        received = {key: iter(shift.wait()) for key, shift in self._shifts.items()}
        return [None if t is None else next(received[id(g)]) for t, g in zip(self._tiles, self._rings)]


def ring_forward(tiles: list, rings: list, counter: CommCounter | None, step: Callable):
    """``state = step(i, tiles_i, state)`` (None at first) for the p steps ``i`` of the rings (p: the size of
    ``rings[0]``), where ``tiles_i`` are the tiles this rank holds at step i (its own at 0, then those ``i`` ranks
    back); the next step's tiles are in flight while ``step`` computes. Returns the last state."""
    size, state = group_size(rings[0]), None
    for i in range(size):
        pending = Rotation(tiles, rings, TILE_TAG, counter) if i < size - 1 else None  # overlaps this step
        state = step(i, tiles, state)
        if pending is not None:
            tiles = pending.wait()
    return state


def ring_backward(tiles: list, grads: list, rings: list, counter: CommCounter | None, step: Callable) -> list:
    """The tiles' gradients: ``grads`` (one per tile, None for none; zeros at first) travel with their tile, each
    step adding ``step(i, tiles_i, grads)`` (the gradients plus this step's share of them, in the order the caller
    adds them); after the p steps they are home. Returns them."""
    size = group_size(rings[0])
    for i in range(size):
        pending = Rotation(tiles, rings, TILE_TAG, counter) if i < size - 1 else None
        # on to the next rank, which holds these tiles next step; after the last step, home
        grads = Rotation(step(i, tiles, grads), rings, GRAD_TAG, counter).wait()
        if pending is not None:
            tiles = pending.wait()
    return grads


@dataclass
class RingPlan:
    """What the sequence ring's :class:`RingAttention` needs besides q, k, v: the local attention
    (:mod:`ds4sci.kernels.local_attention`), the ring group, the byte counter, the sequence layout, the first head
    of this rank, and the document ids of the local queries and of every ring rank's keys (or None)."""

    local_attention: Callable
    group: dist.ProcessGroup
    counter: CommCounter | None
    layout: Layout
    head_offset: int
    q_doc: torch.Tensor | None  # [B, Sq_blk] ids of the local queries
    k_docs: torch.Tensor | None  # [R, B, Sk_blk] ids of every ring rank's keys

    @property
    def ring(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def blocks(self, q_len: int, k_len: int, src: int):
        """(query piece, key piece) pairs between this rank's queries and ring rank ``src``'s keys."""
        for qp in self.layout.pieces(self.rank, self.ring, q_len):
            for kp in self.layout.pieces(src, self.ring, k_len):
                yield qp, kp

    def attend(self, q, k, v, qp: Piece, kp: Piece, src: int):
        """Local attention of query piece ``q`` (``qp``'s rows of this rank's queries) to key piece ``k``, ``v``
        (``kp``'s rows of ring rank ``src``'s keys): (out, lse)."""
        q_doc = k_doc = None
        if self.q_doc is not None:
            q_doc = self.q_doc[:, qp.start : qp.start + qp.length]
            k_doc = self.k_docs[src][:, kp.start : kp.start + kp.length]
        return self.local_attention(q, k, v, q_offset=qp.offset, k_offset=kp.offset, head_offset=self.head_offset,
                                    q_doc=q_doc, k_doc=k_doc, return_lse=True)


class RingAttention(torch.autograd.Function):
    """``RingAttention.apply(q, k, v, plan)``: ring attention over ``plan.group`` on local blocks q ``[B, Sq, h, D]``,
    k and v ``[B, Sk, hkv, D]`` -> ``[B, Sq, h, D]``; per step, the local attention of each pair of pieces
    (:meth:`RingPlan.blocks`) merged by :func:`merge_attention`."""

    @staticmethod
    def forward(ctx, q, k, v, plan: RingPlan):
        ct = torch.promote_types(q.dtype, torch.float32)
        B, Sq, h, _ = q.shape
        out = torch.zeros(B, Sq, h, v.shape[-1], dtype=ct, device=q.device)  # [B, Sq, h, D]
        lse = torch.full((B, h, Sq), -math.inf, dtype=ct, device=q.device)  # [B, h, Sq]

        def step(i, kv, _):
            src = (plan.rank - i) % plan.ring
            for qp, kp in plan.blocks(Sq, k.shape[1], src):
                rows = slice(qp.start, qp.start + qp.length)
                keys = slice(kp.start, kp.start + kp.length)
                o_blk, l_blk = plan.attend(q[:, rows], kv[0][:, keys], kv[1][:, keys], qp, kp, src)
                out[:, rows], lse[:, :, rows] = merge_attention(out[:, rows], lse[:, :, rows], o_blk, l_blk.to(ct))

        ring_forward([k, v], [plan.group, plan.group], plan.counter, step)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        plan: RingPlan = ctx.plan
        ct = out.dtype
        Sq, Sk = q.shape[1], k.shape[1]
        grad_out = grad_out.to(ct)
        dq = torch.zeros_like(q, dtype=ct)
        lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # [B, h, Sq]

        def step(i, kv, dkv):
            src = (plan.rank - i) % plan.ring
            for qp, kp in plan.blocks(Sq, Sk, src):
                rows = slice(qp.start, qp.start + qp.length)
                keys = slice(kp.start, kp.start + kp.length)
                with torch.enable_grad():  # on the pieces, so their gradients are piece-sized (issue #28)
                    qb = q[:, rows].detach().requires_grad_()
                    kb = kv[0][:, keys].detach().requires_grad_()
                    vb = kv[1][:, keys].detach().requires_grad_()
                    o_blk, l_blk = plan.attend(qb, kb, vb, qp, kp, src)
                if not o_blk.requires_grad:  # a block the mask empties: no contribution
                    continue
                if not l_blk.requires_grad:
                    raise RuntimeError(
                        "ring attention backpropagates through the block log-sum-exp, but local_attention "
                        f"{plan.local_attention!r} returned an lse without autograd history"
                    )
                # The block's share of the merged softmax: w = exp(lse_blk - lse) [B, h, rows].
                w = torch.exp(l_blk.detach().to(ct) - lse_safe[:, :, rows])
                w_ = w.transpose(1, 2).unsqueeze(-1)  # [B, rows, h, 1]
                g_out = grad_out[:, rows]  # [B, rows, h, D]
                # d loss / d o_blk = w dO;  d loss / d lse_blk = w * <dO, o_blk - out>  (per row and head)
                g_o = (w_ * g_out).to(o_blk.dtype)
                g_l = w * (g_out * (o_blk.detach().to(ct) - out[:, rows])).sum(-1).transpose(1, 2)
                grads = torch.autograd.grad(
                    (o_blk, l_blk), (qb, kb, vb), (g_o, g_l.to(l_blk.dtype)), allow_unused=True
                )
                for acc, g, sl in ((dq, grads[0], rows), (dkv[0], grads[1], keys), (dkv[1], grads[2], keys)):
                    if g is not None:
                        acc[:, sl] += g.to(ct)
            return dkv

        dkv = [torch.zeros_like(k, dtype=ct), torch.zeros_like(v, dtype=ct)]  # travel with their key block
        dkv = ring_backward([k, v], dkv, [plan.group, plan.group], plan.counter, step)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None
