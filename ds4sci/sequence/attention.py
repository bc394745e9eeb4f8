"""Sequence-parallel attention: Ulysses, ring, and Unified (Ulysses x Ring) sequence parallelism.

- DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv:2309.14509): an all-to-all switches q, k, v from
  sequence-sharded ``[B, S/P, H, D]`` to head-sharded ``[B, S, H/P, D]``, local attention runs over the full
  sequence on ``H/P`` heads, an inverse all-to-all brings the output back. Per rank and layer it moves 4 tensors
  of ``B*S*H*D/P`` elements, ``(P-1)/P`` of each leaving the rank.
- Ring attention (Liu et al. 2023, arXiv:2310.01889): key/value blocks travel around a ring of ``R`` ranks while
  each rank keeps its queries; block results are merged with their log-sum-exp (online softmax, Milakov &
  Gimelshein 2018). Backward recomputes each block and sends the key/value gradients around the ring with the
  blocks, so only q, k, v, out and lse are saved.
- Unified SP (Fang & Zhao 2024, USP, arXiv:2405.07719): Ulysses inside the Ulysses group, ring across the ring
  group on the head-sharded tensors, inverse all-to-all. The ring degree carries what the head count cannot.

Sharding contract: rank ``(ring_rank, ulysses_rank)`` holds sequence shard
``sp_rank = ring_rank * U + ulysses_rank`` of ``U * R`` (``shard_sequence(x, 1, dims.sp_rank(rank), dims.sp,
dims.layout)``), contiguous or zigzag (:class:`~ds4sci.sequence.Layout`). After the all-to-all a ring rank then holds a
contiguous block (contiguous) or ring chunks ``r`` and ``2R-1-r`` (zigzag); each piece is passed to the local attention with
its own global offsets, so causal, window and document masks stay exact.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ds4sci.distributed.comm import CommCounter, RingShift, all_gather, all_to_all, group_rank, group_size
from ds4sci.distributed.dims import Layout, Piece
from ds4sci.sequence.sharding import regroup

logger = logging.getLogger(__name__)

__all__ = ["DistributedAttention", "merge_attention", "merge_softmax"]

_KV_TAG, _GRAD_TAG = 0, 1


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


@dataclass
class _RingPlan:
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


class _RingAttention(torch.autograd.Function):
    """Ring attention over ``plan.group`` on local blocks q ``[B, Sq, h, D]``, k and v ``[B, Sk, hkv, D]``."""

    @staticmethod
    def forward(ctx, q, k, v, plan: _RingPlan):
        ct = torch.promote_types(q.dtype, torch.float32)
        B, Sq, h, _ = q.shape
        out = torch.zeros(B, Sq, h, v.shape[-1], dtype=ct, device=q.device)  # [B, Sq, h, D]
        lse = torch.full((B, h, Sq), -math.inf, dtype=ct, device=q.device)  # [B, h, Sq]
        kv = [k, v]
        for step in range(plan.ring):
            src = (plan.rank - step) % plan.ring
            # post the next rotation first: it overlaps with this step's compute
            shift = RingShift(kv, plan.group, plan.counter, tag=_KV_TAG) if step < plan.ring - 1 else None
            for qp, kp in plan.blocks(Sq, k.shape[1], src):
                rows = slice(qp.start, qp.start + qp.length)
                keys = slice(kp.start, kp.start + kp.length)
                o_blk, l_blk = plan.attend(q[:, rows], kv[0][:, keys], kv[1][:, keys], qp, kp, src)
                out[:, rows], lse[:, :, rows] = merge_attention(out[:, rows], lse[:, :, rows], o_blk, l_blk.to(ct))
            if shift is not None:
                kv = shift.wait()
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        plan: _RingPlan = ctx.plan
        ct = out.dtype
        Sq, Sk = q.shape[1], k.shape[1]
        grad_out = grad_out.to(ct)
        dq = torch.zeros_like(q, dtype=ct)
        dkv = [torch.zeros_like(k, dtype=ct), torch.zeros_like(v, dtype=ct)]  # travel with their key block
        kv = [k, v]
        lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # [B, h, Sq]
        for step in range(plan.ring):
            src = (plan.rank - step) % plan.ring
            shift = RingShift(kv, plan.group, plan.counter, tag=_KV_TAG) if step < plan.ring - 1 else None
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
            # the key/value gradients follow their block; after R shifts they are back with their owner
            dkv = RingShift(dkv, plan.group, plan.counter, tag=_GRAD_TAG).wait()
            if shift is not None:
                kv = shift.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


class DistributedAttention(torch.nn.Module):
    """Sequence-parallel attention around any local attention (Ulysses, ring, or Unified Ulysses x Ring).

    Args:
        local_attention: a callable implementing the local attention protocol
            (:mod:`ds4sci.kernels.local_attention`), e.g. ``functools.partial(memory_efficient_attention,
            causal=True)`` or a model's attention core (GenSLM's binds ``memory_efficient_attention``). Ring
            attention needs one whose lse carries autograd history (``chunked_attention``, the Triton kernel,
            ``sdpa_attention``; flash-attn's does not, so ``"auto"`` does not route ring training to it).
        ulysses_group: the Ulysses (all-to-all) group; ``None`` or a group of one for ring attention alone.
        ring_group: the ring group; ``None`` or a group of one for Ulysses alone. With both, the groups must meet
            only in this rank (as :func:`~ds4sci.distributed.groups.build_groups` makes them); passing the whole
            sequence-parallel group as ``ulysses_group`` together with a ring group is rejected.
        layout: the :class:`~ds4sci.sequence.Layout` (or its name) the inputs were sharded with.
        counter: optional :class:`~ds4sci.distributed.comm.CommCounter` recording this layer's communication.
        check_shapes: all-gather the local shapes first (a few bytes, recorded as ``"all_gather"``) and raise a
            ``ValueError`` if the ranks disagree (unevenly sharded sequences), instead of a hang or a silently
            wrong result.

    Sharding: rank ``(ring_rank, ulysses_rank)`` must hold sequence shard ``ring_rank * U + ulysses_rank`` of
    ``U * R`` (:meth:`ParallelDims.sp_rank <ds4sci.distributed.ParallelDims.sp_rank>`).

    Heads: Ulysses needs ``H % U == 0`` (else ``ValueError`` naming heads, KV heads and degrees; a ring degree
    can carry the parallelism instead). GQA/MQA key/value heads are split over the Ulysses group when ``U``
    divides ``Hkv``; otherwise each is replicated ``U / gcd(Hkv, U)`` times first (the smallest count the
    all-to-all can split; gradients of the copies are summed by autograd).
    """

    def __init__(
        self,
        local_attention: Callable,
        ulysses_group: dist.ProcessGroup | None,
        ring_group: dist.ProcessGroup | None = None,
        *,
        layout: str | Layout = Layout.CONTIGUOUS,
        counter: CommCounter | None = None,
        check_shapes: bool = True,
    ) -> None:
        super().__init__()
        self.layout = Layout.parse(layout)
        if group_size(ulysses_group) > 1 and group_size(ring_group) > 1:
            ulysses_ranks = dist.get_process_group_ranks(ulysses_group)
            ring_ranks = dist.get_process_group_ranks(ring_group)
            shared = set(ulysses_ranks) & set(ring_ranks)
            if shared != {dist.get_rank()}:
                raise ValueError(
                    f"ulysses_group (ranks {ulysses_ranks}) and ring_group (ranks {ring_ranks}) share ranks "
                    f"{sorted(shared)}; pass SequenceParallelGroups.ulysses as ulysses_group, not the whole "
                    "sequence-parallel group"
                )
        self.local_attention = local_attention
        self.ulysses_group = ulysses_group
        self.ring_group = ring_group
        self.counter = counter
        self.check_shapes = check_shapes

    @property
    def ulysses_size(self) -> int:
        return group_size(self.ulysses_group)

    @property
    def ring_size(self) -> int:
        return group_size(self.ring_group)

    def _validate(self, q, k, v, q_doc, k_doc) -> None:
        U, R = self.ulysses_size, self.ring_size
        if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
            raise ValueError(
                f"expected local shards q [B, S/P, H, D], k and v [B, S/P, Hkv, D]; got q {tuple(q.shape)}, "
                f"k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
        H, Hkv = q.shape[2], k.shape[2]
        if H % Hkv != 0:
            raise ValueError(f"heads={H} is not a multiple of kv heads={Hkv}")
        if H % U != 0:
            raise ValueError(
                f"heads={H} (kv heads={Hkv}) cannot be split over the Ulysses degree {U} (ring degree {R}); use a "
                f"Ulysses degree that divides {H} and let the ring degree carry the rest"
            )
        if self.layout is Layout.ZIGZAG and (q.shape[1] % 2 or k.shape[1] % 2):
            raise ValueError(
                f"zigzag shards hold two equal chunks; local lengths q {q.shape[1]}, k {k.shape[1]} are odd"
            )
        if (q_doc is None) != (k_doc is None):
            raise ValueError("pass both q_doc and k_doc, or neither")
        if q_doc is not None and (tuple(q_doc.shape) != tuple(q.shape[:2]) or tuple(k_doc.shape) != tuple(k.shape[:2])):
            raise ValueError(
                f"q_doc {tuple(q_doc.shape)} / k_doc {tuple(k_doc.shape)} must be the local [B, S/P] shards "
                f"{tuple(q.shape[:2])} / {tuple(k.shape[:2])}"
            )
        if self.check_shapes:
            mine = torch.tensor([*q.shape, *k.shape], dtype=torch.int64, device=q.device)  # [8]
            for group in (self.ulysses_group, self.ring_group):
                shapes = all_gather(mine[None], group, dim=0, counter=self.counter)  # [P, 8]
                if not bool((shapes == mine).all()):
                    raise ValueError(
                        "ranks hold different local shapes (q then k, per rank): "
                        f"{shapes.tolist()}; shard the sequence evenly (shard_sequence, pad_to_multiple)"
                    )

    def _to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """Ulysses all-to-all and zigzag reorder: ``[B, s, H, D] -> [B, U*s, H/U, D]`` with the ring rank's
        pieces in sequence order."""
        x = all_to_all(x, self.ulysses_group, scatter_dim=2, gather_dim=1, counter=self.counter)  # [B, U*s, H/U, D]
        return regroup(x, self.layout, self.ulysses_size)

    def _from_heads(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`_to_heads`: ``[B, U*s, H/U, D] -> [B, s, H, D]``."""
        x = regroup(x, self.layout, self.ulysses_size, inverse=True)
        return all_to_all(x, self.ulysses_group, scatter_dim=1, gather_dim=2, counter=self.counter)  # [B, s, H, D]

    def _block_docs(self, doc: torch.Tensor) -> torch.Tensor:
        """Document ids of the post all-to-all block: ``[B, s] -> [B, U*s]`` (gathered, zigzag-reordered)."""
        doc = all_gather(doc, self.ulysses_group, dim=1, counter=self.counter)  # [B, U*s]
        return regroup(doc, self.layout, self.ulysses_size)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        q_doc: torch.Tensor | None = None,
        k_doc: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention on local shards.

        Args:
            q: ``[B, S/P, H, D]``, k and v: ``[B, S/P, Hkv, D]``, this rank's sequence shard
                (``P = U * R``, shard ``ring_rank * U + ulysses_rank``, layout :attr:`layout`).
            q_doc, k_doc: optional ``[B, S/P]`` document ids of the same shards.
        Returns:
            ``[B, S/P, H, D]``: this rank's shard of the attention output.
        """
        self._validate(q, k, v, q_doc, k_doc)
        U, R = self.ulysses_size, self.ring_size
        H, Hkv = q.shape[2], k.shape[2]
        if Hkv % U != 0:
            # GQA/MQA with fewer KV heads than the split needs: replicate each KV head so the all-to-all can
            # split them and every rank still holds the KV heads its query heads use (h -> h // (H/Hkv)).
            copies = U // math.gcd(Hkv, U)
            logger.debug("replicating %d KV heads x%d for Ulysses degree %d", Hkv, copies, U)
            k = k.repeat_interleave(copies, dim=2)  # [B, s, Hkv*copies, D]
            v = v.repeat_interleave(copies, dim=2)
        q, k, v = self._to_heads(q), self._to_heads(k), self._to_heads(v)  # [B, s, H, D] -> [B, U*s, H/U, D]
        head_offset = group_rank(self.ulysses_group) * (H // U)
        q_blk_doc = k_blk_doc = None
        if q_doc is not None:
            q_blk_doc = self._block_docs(q_doc)  # [B, U*s]
            k_blk_doc = q_blk_doc if k_doc is q_doc else self._block_docs(k_doc)
        if R == 1:  # every rank holds the whole sequence, in order, on H/U heads
            out = self.local_attention(
                q, k, v, q_offset=0, k_offset=0, head_offset=head_offset, q_doc=q_blk_doc, k_doc=k_blk_doc
            )
        else:
            k_docs = None
            if k_blk_doc is not None:
                k_docs = all_gather(k_blk_doc[None], self.ring_group, dim=0, counter=self.counter)  # [R, B, U*s]
            plan = _RingPlan(self.local_attention, self.ring_group, self.counter, self.layout, head_offset,
                             q_blk_doc, k_docs)
            out = _RingAttention.apply(q, k, v, plan)  # [B, U*s, H/U, D]
        return self._from_heads(out)  # [B, U*s, H/U, D] -> [B, s, H, D]
