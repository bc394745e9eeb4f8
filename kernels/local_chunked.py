"""Local attention, the chunked path: FlashAttention-2's online softmax over (query chunk x key chunk) blocks in
PyTorch, with a recomputing backward (also through the lse); every option of the protocol, O(S * chunk) memory, any
device.

:func:`chunked_attention` is a local attention in the sense of :mod:`ds4sci.kernels.local_attention` with
:func:`~ds4sci.kernels.local_reference.sdpa_attention`'s semantics (the oracle its tests compare against) and no
``Sq x Sk`` tensor: ``memory_efficient_attention`` runs it wherever flash-attn and the Triton kernel do not.
Layout: block planning (which blocks some query sees, which mask terms cut through them) -> one block's logits ->
the ``autograd.Function`` (forward and recomputing backward) -> the public function.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .backends import LOCAL_CHUNK_SIZE
from .local_reference import attention_mask
from .local_reference import check_qkv
from .local_reference import empty_result

__all__ = ["chunked_attention"]


@dataclass(frozen=True)
class _Block:
    """One (query chunk x key chunk) block that some query of which may see: local row/column ranges and the
    mask terms that actually cut through it (a term that keeps every pair of the block is dropped)."""

    r0: int
    r1: int
    c0: int
    c1: int
    causal: bool
    window: bool
    docs: bool


@dataclass(frozen=True)
class _ChunkSpec:
    q_offset: int
    k_offset: int
    head_offset: int
    causal: bool
    window: int | None
    scale: float
    blocks: tuple[tuple[_Block, ...], ...]  # per query chunk, its blocks in key order


def _chunk_ranges(doc: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
    """Per batch row and chunk of ``doc [B, S]``: (min id, max id), each ``[B, n_chunks]``."""
    B, S = doc.shape
    pad = -S % chunk
    lo = F.pad(doc, (0, pad), value=torch.iinfo(doc.dtype).max).view(B, -1, chunk).amin(-1)  # [B, n]
    hi = F.pad(doc, (0, pad), value=torch.iinfo(doc.dtype).min).view(B, -1, chunk).amax(-1)  # [B, n]
    return lo, hi


def _plan_blocks(Sq: int, Sk: int, chunk: int, q_offset: int, k_offset: int, causal: bool, window: int | None,
                 q_doc: Tensor | None, k_doc: Tensor | None) -> tuple[tuple[_Block, ...], ...]:
    """The blocks of a ``Sq x Sk`` attention that are not entirely invisible, and the mask terms each needs.

    Skipped: causal blocks whose first key is after their last query; window blocks whose nearest pair is
    ``window`` or more apart; document blocks whose query and key id ranges ``[min, max]`` do not meet (any ids;
    tight for the non-decreasing ids of packed sequences, where only the chunks holding padding widen).
    """
    docs_apart = docs_same = None
    if q_doc is not None:
        qlo, qhi = _chunk_ranges(q_doc, chunk)  # [B, nq]
        klo, khi = _chunk_ranges(k_doc, chunk)  # [B, nk]
        apart = (qhi[:, :, None] < klo[:, None, :]) | (khi[:, None, :] < qlo[:, :, None])  # [B, nq, nk]
        same = (qlo == qhi)[:, :, None] & (klo == khi)[:, None, :] & (qlo[:, :, None] == klo[:, None, :])
        docs_apart, docs_same = apart.all(0).tolist(), same.all(0).tolist()  # one host transfer each
    plan = []
    for a, r0 in enumerate(range(0, Sq, chunk)):
        r1 = min(Sq, r0 + chunk)
        i0, i1 = q_offset + r0, q_offset + r1 - 1  # first and last global query of the chunk
        row = []
        for b, c0 in enumerate(range(0, Sk, chunk)):
            c1 = min(Sk, c0 + chunk)
            j0, j1 = k_offset + c0, k_offset + c1 - 1  # first and last global key
            if causal and j0 > i1:
                break  # this key chunk and every later one lie after every query
            if window is not None and max(i0 - j1, j0 - i1) >= window:
                continue  # the nearest pair is out of the band
            if docs_apart is not None and docs_apart[a][b]:
                continue
            row.append(_Block(
                r0, r1, c0, c1,
                causal=causal and j1 > i0,
                window=window is not None and max(i1 - j0, j1 - i0) >= window,
                docs=docs_same is not None and not docs_same[a][b],
            ))
        plan.append(tuple(row))
    return tuple(plan)


def _block_logits(qb: Tensor, k: Tensor, blk: _Block, spec: _ChunkSpec, q_doc, k_doc, mask, slopes, ct, H):
    """Scaled, biased and masked logits of one block, and its key block.

    qb ``[B, Hkv, G*cq, D]`` (rows ordered group-major) -> s ``[B, Hkv, G, cq, ck]`` in ``ct``, kb ``[B, Hkv, ck, D]``.
    """
    B, Hkv = qb.shape[0], qb.shape[1]
    G, cq, ck = H // Hkv, blk.r1 - blk.r0, blk.c1 - blk.c0
    kb = k[:, blk.c0 : blk.c1].to(ct).transpose(1, 2)  # [B, ck, Hkv, D] -> [B, Hkv, ck, D]
    s = (qb @ kb.transpose(-1, -2)).mul_(spec.scale).view(B, Hkv, G, cq, ck)  # [B, Hkv, G, cq, ck]
    i0, j0 = spec.q_offset + blk.r0, spec.k_offset + blk.c0  # global index of the block's first query, key
    if slopes is not None:
        qi = torch.arange(i0, i0 + cq, device=qb.device)[:, None]  # [cq, 1] global query index
        kj = torch.arange(j0, j0 + ck, device=qb.device)[None, :]  # [1, ck] global key index
        s.sub_(slopes[:, :, None, None] * (qi - kj).abs().to(ct))  # slopes [Hkv, G] -> bias [Hkv, G, cq, ck]
    visible = None
    if blk.causal or blk.window or blk.docs or mask is not None:
        visible = attention_mask(
            cq, ck, q_offset=i0, k_offset=j0, head_offset=spec.head_offset, num_heads=H,
            q_doc=q_doc[:, blk.r0 : blk.r1] if blk.docs else None,
            k_doc=k_doc[:, blk.c0 : blk.c1] if blk.docs else None,
            causal=blk.causal, window=spec.window if blk.window else None, mask=mask, device=qb.device,
            threshold=None, chunk_rows=cq,
        )  # [B|1, H|1, cq, ck], chunk-sized: built where it is used
    if visible is not None:
        if visible.shape[1] == 1:
            visible = visible.unsqueeze(2)  # [B|1, 1, 1, cq, ck]
        else:
            visible = visible.view(visible.shape[0], Hkv, G, cq, ck)  # head h = kv_head * G + g
        s.masked_fill_(~visible, -math.inf)
    return s, kb


def _group_rows(x: Tensor, Hkv: int, ct) -> Tensor:
    """``[B, c, H, D]`` -> ``[B, Hkv, G*c, D]`` in ``ct``: query head ``h = kv_head * G + g``, rows group-major."""
    B, c, H, D = x.shape
    x = x.to(ct).view(B, c, Hkv, H // Hkv, D)  # [B, c, Hkv, G, D]
    return x.permute(0, 2, 3, 1, 4).reshape(B, Hkv, -1, D)  # [B, Hkv, G*c, D]


def _ungroup_rows(x: Tensor, c: int) -> Tensor:
    """Inverse of :func:`_group_rows` (without the cast): ``[B, Hkv, G*c, D]`` -> ``[B, c, H, D]``."""
    B, Hkv, _, D = x.shape
    return x.view(B, Hkv, -1, c, D).permute(0, 3, 1, 2, 4).reshape(B, c, -1, D)


class _ChunkedAttention(torch.autograd.Function):
    """Online-softmax attention over (query chunk x key chunk) blocks with a recomputing backward.

    Forward (FlashAttention-2, Dao 2023, Algorithm 1; online softmax of Milakov & Gimelshein 2018): per query
    chunk a running max ``m``, sum ``l`` and unnormalised output; per key block ``p = exp(s - m_safe)`` with
    the max subtracted from the finished logits (``m_safe = 0`` while a row has seen no key, so never
    ``-inf - -inf``). Backward (FlashAttention-2, Algorithm 2): recompute ``P = exp(s - lse)`` block by block;
    ``dS = P * (dP - delta + dlse)`` with ``delta = rowsum(dO * O)`` and ``dlse`` the gradient of the returned lse.
    Saved: q, k, v, out (in the compute dtype, so ``delta`` carries no extra rounding), lse, document ids, mask.
    """

    @staticmethod
    def forward(ctx, q, k, v, q_doc, k_doc, mask, slopes, spec: _ChunkSpec):
        ct = torch.promote_types(q.dtype, torch.float32)
        B, Sq, H, D = q.shape
        Hkv = k.shape[2]
        G = H // Hkv
        out = torch.zeros(B, Sq, H, v.shape[-1], dtype=ct, device=q.device)  # [B, Sq, H, D]
        lse = torch.full((B, H, Sq), -math.inf, dtype=ct, device=q.device)  # [B, H, Sq]
        for blocks in spec.blocks:
            if not blocks:
                continue  # the chunk's queries see no key: out 0, lse -inf
            r0, r1 = blocks[0].r0, blocks[0].r1
            cq = r1 - r0
            qb = _group_rows(q[:, r0:r1], Hkv, ct)  # [B, Hkv, G*cq, D]
            m = torch.full((B, Hkv, G, cq), -math.inf, dtype=ct, device=q.device)  # running row max
            m_safe = torch.zeros_like(m)  # m where finite, 0 for rows that have seen no key yet
            l = torch.zeros_like(m)  # running sum of exp(s - m_safe)
            acc = torch.zeros(B, Hkv, G * cq, v.shape[-1], dtype=ct, device=q.device)  # unnormalised output
            for blk in blocks:
                s, _ = _block_logits(qb, k, blk, spec, q_doc, k_doc, mask, slopes, ct, H)  # [B, Hkv, G, cq, ck]
                m_new = torch.maximum(m, s.amax(-1))  # [B, Hkv, G, cq]
                m_new_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
                p = torch.exp(s - m_new_safe[..., None])  # masked logits -> exp(-inf) = 0
                alpha = torch.exp(m - m_new_safe)  # rescales the old sums; 0 while a row has seen no key
                l = l * alpha + p.sum(-1)
                vb = v[:, blk.c0 : blk.c1].to(ct).transpose(1, 2)  # [B, Hkv, ck, D]
                acc = acc * alpha.reshape(B, Hkv, G * cq, 1) + p.view(B, Hkv, G * cq, -1) @ vb
                m, m_safe = m_new, m_new_safe
            seen = l > 0  # l >= 1 for a row that saw a key (its max contributes exp(0))
            l_safe = torch.where(seen, l, torch.ones_like(l))
            acc = acc / l_safe.reshape(B, Hkv, G * cq, 1)  # rows that saw nothing stay 0
            out[:, r0:r1] = _ungroup_rows(acc, cq)  # [B, cq, H, D]
            lse[:, :, r0:r1] = torch.where(seen, m_safe + torch.log(l_safe), m).reshape(B, H, cq)  # -inf unseen
        ctx.spec = spec
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse, q_doc, k_doc, mask, slopes)
        return out.to(q.dtype), lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, q_doc, k_doc, mask, slopes = ctx.saved_tensors
        spec: _ChunkSpec = ctx.spec
        ct = out.dtype
        B, Sq, H, D = q.shape
        Hkv = k.shape[2]
        G = H // Hkv
        if grad_out is None and grad_lse is None:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), *([None] * 5)
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out.to(ct)  # [B, Sq, H, D]
        # delta - dlse per row: dS = P * (dP - (delta - dlse))
        corr = (grad_out * out).sum(-1).transpose(1, 2)  # [B, H, Sq]
        if grad_lse is not None:
            corr = corr - torch.where(torch.isneginf(lse), torch.zeros_like(grad_lse), grad_lse.to(ct))
        # out is read only for delta: freed here when nothing else holds it (recompute_saved's hooks hand it over
        # once), before the gradients are allocated (issue #28's working set)
        del out
        lse_safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)  # unseen rows: P = exp(-inf) = 0
        dq = torch.zeros(B, Sq, H, D, dtype=ct, device=q.device)
        dk = torch.zeros(B, Hkv, k.shape[1], D, dtype=ct, device=q.device)  # [B, Hkv, Sk, D]
        dv = torch.zeros(B, Hkv, v.shape[1], v.shape[-1], dtype=ct, device=q.device)
        for blocks in spec.blocks:
            if not blocks:
                continue
            r0, r1 = blocks[0].r0, blocks[0].r1
            cq = r1 - r0
            qb = _group_rows(q[:, r0:r1], Hkv, ct)  # [B, Hkv, G*cq, D]
            dob = _group_rows(grad_out[:, r0:r1], Hkv, ct)  # [B, Hkv, G*cq, D]
            lse_b = lse_safe[:, :, r0:r1].reshape(B, Hkv, G, cq, 1)
            corr_b = corr[:, :, r0:r1].reshape(B, Hkv, G, cq, 1)
            dqb = torch.zeros_like(qb)
            for blk in blocks:
                s, kb = _block_logits(qb, k, blk, spec, q_doc, k_doc, mask, slopes, ct, H)  # [B, Hkv, G, cq, ck]
                p = torch.exp(s - lse_b)  # [B, Hkv, G, cq, ck]
                vb = v[:, blk.c0 : blk.c1].to(ct).transpose(1, 2)  # [B, Hkv, ck, D]
                p_rows = p.view(B, Hkv, G * cq, -1)  # [B, Hkv, G*cq, ck]
                dv[:, :, blk.c0 : blk.c1] += p_rows.transpose(-1, -2) @ dob  # sums the G query heads of a kv head
                dp = (dob @ vb.transpose(-1, -2)).view_as(p)  # [B, Hkv, G, cq, ck]
                ds = (p * (dp - corr_b)).view(B, Hkv, G * cq, -1).mul_(spec.scale)  # d loss / d (q k^T)
                dqb += ds @ kb
                dk[:, :, blk.c0 : blk.c1] += ds.transpose(-1, -2) @ qb
            dq[:, r0:r1] = _ungroup_rows(dqb, cq)
        return dq.to(q.dtype), dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype), *([None] * 5)



def chunked_attention(q: Tensor, k: Tensor, v: Tensor, *, q_offset: int = 0, k_offset: int = 0, head_offset: int = 0,
                      q_doc: Tensor | None = None, k_doc: Tensor | None = None, return_lse: bool = False,
                      causal: bool = False, window: int | None = None, mask: Tensor | None = None,
                      alibi_slopes: Tensor | None = None, scale: float | None = None,
                      chunk_size: int = LOCAL_CHUNK_SIZE):
    """Memory-efficient attention in PyTorch: ``sdpa_attention``'s semantics without any ``Sq x Sk`` tensor.

    q ``[B, Sq, H, D]``, k and v ``[B, Sk, Hkv, D]`` -> out ``[B, Sq, H, D]`` (and lse ``[B, H, Sq]`` in
    ``promote_types(dtype, float32)``, differentiable); :mod:`ds4sci.kernels.local_attention` gives the protocol,
    and the options ``causal``, ``window``, ``mask``, ``alibi_slopes``, ``scale`` mean what they mean for
    :func:`~ds4sci.kernels.local_reference.sdpa_attention`.

    The softmax is computed online over blocks of ``chunk_size`` queries x ``chunk_size`` keys (Rabe & Staats
    2021, "Self-attention does not need O(n^2) memory"; FlashAttention-2, Dao 2023, for the loop and the
    backward; online softmax, Milakov & Gimelshein 2018), all softmax arithmetic in
    ``promote_types(dtype, float32)``. Backward recomputes each block from the saved lse, so the memory beyond
    the inputs is O(S * chunk_size): the outputs, the lse, the q/k/v gradients and one block's temporaries
    ``[B, H, chunk_size, chunk_size]``. GQA runs on ``[B, Hkv, G*chunk, D]`` query blocks against each key
    block; K and V are never repeated.

    Blocks no query of which can see any key are skipped (causal: keys after every query; window: out of the
    band; documents: the chunk's id ranges do not meet), and mask terms that keep a whole block are not built.
    An explicit ``mask`` (bool ``[S, S]`` or ``[B|1, H_total|1, S, S]`` on global indices) is sliced per block.
    Rows that see no key return ``out = 0``, ``lse = -inf`` and zero gradients. When every block is skipped the
    result is zeros without autograd history, like ``sdpa_attention`` for a block no query sees (ring
    attention skips those). ALiBi slopes get no gradient.
    """
    check_qkv(q, k, v, q_doc, k_doc, window=window, alibi_slopes=alibi_slopes, head_offset=head_offset)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} must be a positive int")
    B, Sq, H, D = q.shape
    Hkv = k.shape[2]
    slopes = None
    if alibi_slopes is not None:
        ct = torch.promote_types(q.dtype, torch.float32)
        slopes = alibi_slopes[head_offset : head_offset + H].detach().to(q.device, ct).view(Hkv, H // Hkv)
    blocks = _plan_blocks(q.shape[1], k.shape[1], chunk_size, q_offset, k_offset, causal, window, q_doc, k_doc)
    if not any(blocks):
        return empty_result(q, v, return_lse)
    spec = _ChunkSpec(q_offset, k_offset, head_offset, causal, window,
                      1.0 / math.sqrt(D) if scale is None else scale, blocks)
    out, lse = _ChunkedAttention.apply(q, k, v, q_doc, k_doc, mask, slopes, spec)
    return (out, lse) if return_lse else out
