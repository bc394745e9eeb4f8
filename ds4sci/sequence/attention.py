"""Sequence-parallel attention: Ulysses, ring, and Unified (Ulysses x Ring) sequence parallelism.

- DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv:2309.14509): an all-to-all switches q, k, v from
  sequence-sharded ``[B, S/P, H, D]`` to head-sharded ``[B, S, H/P, D]``, local attention runs over the full
  sequence on ``H/P`` heads, an inverse all-to-all brings the output back. Per rank and layer it moves 4 tensors
  of ``B*S*H*D/P`` elements, ``(P-1)/P`` of each leaving the rank.
- Ring attention (Liu et al. 2023, arXiv:2310.01889; :mod:`ds4sci.sequence.ring`): key/value blocks travel around
  a ring of ``R`` ranks while each rank keeps its queries; block results are merged with their log-sum-exp.
- Unified SP (Fang & Zhao 2024, USP, arXiv:2405.07719): Ulysses inside the Ulysses group, ring across the ring
  group on the head-sharded tensors, inverse all-to-all. The ring degree carries what the head count cannot.

Sharding contract: rank ``(ring_rank, ulysses_rank)`` holds sequence shard
``sp_rank = ring_rank * U + ulysses_rank`` of ``U * R`` (``shard_sequence(x, 1, dims.sp_rank(rank), dims.sp,
dims.layout)``), contiguous or zigzag (:class:`~ds4sci.sequence.Layout`). After the all-to-all a ring rank then
holds a contiguous block (contiguous) or ring chunks ``r`` and ``2R-1-r`` (zigzag); each piece is passed to the local
attention with its own global offsets, so causal, window and document masks stay exact.
"""
from __future__ import annotations

import logging
import math
from typing import Callable

import torch
import torch.distributed as dist

from ds4sci.distributed.comm import CommCounter
from ds4sci.distributed.comm import all_gather
from ds4sci.distributed.comm import all_to_all
from ds4sci.distributed.comm import group_rank
from ds4sci.distributed.comm import group_size
from ds4sci.distributed.dims import Layout
from ds4sci.sequence.ring import RingAttention
from ds4sci.sequence.ring import RingPlan
from ds4sci.sequence.sharding import regroup

logger = logging.getLogger(__name__)

__all__ = ["DistributedAttention"]


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
            q_doc: optional ``[B, S/P]`` document ids of the query shard.
            k_doc: optional ``[B, S/P]`` document ids of the key shard.
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
            plan = RingPlan(self.local_attention, self.ring_group, self.counter, self.layout, head_offset,
                            q_blk_doc, k_docs)
            out = RingAttention.apply(q, k, v, plan)  # [B, U*s, H/U, D]
        return self._from_heads(out)  # [B, U*s, H/U, D] -> [B, s, H, D]
