"""The "torch" backend: memory-efficient Evoformer attention in plain PyTorch, chunked over queries.

Forward processes one head and one chunk of C queries at a time, so that only one ``[Z, N, C, S]``
logits block lives at a time, computes the softmax in fp32 (fp64 for fp64 inputs) and saves only O and the softmax
statistics ``stats [Z, N, H, S, 2]``: the row max m and the row sum l, kept apart (the log-sum-exp ``m + log l``
loses ``log l`` to rounding when |m| is huge, as on a row fully masked with OpenFold's -1e9, where every logit rounds
to the mask value and the softmax is uniform: recomputed from the sum it would be 1 instead of 1/S). The max is
subtracted before exponentiating, ``exp(s - m)``, which is exact for ``s == m`` at any magnitude (a mask of
``finfo(float32).min`` included). Backward recomputes each block's probabilities as ``P = exp(S - m) / l`` and
forms
``dS = P * (dP - rowsum(dO * O))`` (the FlashAttention-2 backward, Dao 2023, Algorithm 2, applied per
query chunk as in Rabe & Staats 2021, "Self-attention does not need O(n^2) memory"). The pair-bias
gradient is ``dS`` summed over N with an ordinary (deterministic) reduction, one query chunk at a time, so
two backward passes give bitwise-equal results.

The chunk size C is the largest that keeps one fp32 logits block within :data:`LOGITS_CHUNK_BYTES`
(at least one query). Gradients are accumulated in place (``baddbmm_``) into strided per-head views of
tensors already in the ``[Z, N, S, H, D]`` output layout, so beyond O, dQ, dK, dV the backward holds about two
logits blocks (plus fp32 per-head copies and fp32 accumulators for fp16/bf16 inputs).

Works on any device; canonical shapes and the backend contract are described in ``ds4sci.kernels.evoformer``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .evoformer_reference import ieee_fp32_matmul

#: Upper bound on the bytes of one fp32 logits block ``[Z, N, C, S]`` (one head); backward holds about two.
LOGITS_CHUNK_BYTES = 4 * 2**20


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_size(z: int, n: int, s: int, dtype: torch.dtype) -> int:
    """Queries per chunk so that a ``[Z, N, C, S]`` block of ``dtype`` fits in LOGITS_CHUNK_BYTES."""
    bytes_per_query = z * n * s * torch.finfo(dtype).bits // 8
    return max(1, min(s, LOGITS_CHUNK_BYTES // bytes_per_query))


def _head(t: Tensor, hh: int, dtype: torch.dtype) -> Tensor:
    """Head ``hh`` of a ``[Z, N, S, H, D]`` tensor as ``[Z*N, S, D]`` in ``dtype`` (a strided view when possible)."""
    z, n, s, _, d = t.shape
    return t[:, :, :, hh].to(dtype).reshape(z * n, s, d)


def _block_logits(
    q_c: Tensor, k_t: Tensor, mask: Optional[Tensor], pair_c: Optional[Tensor], z: int, scale: float
) -> Tensor:
    """Logits of one head and query chunk: q_c ``[Z*N, C, D]``, k_t ``[Z*N, D, S]`` -> ``[Z, N, C, S]``."""
    s = torch.bmm(q_c, k_t)  # [Z*N, C, S]
    s = s.view(z, -1, *s.shape[1:]).mul_(scale)  # [Z*N, C, S] -> [Z, N, C, S]
    if mask is not None:
        s.add_(mask[:, :, None, :])  # [Z, N, 1, S]
    if pair_c is not None:
        s.add_(pair_c[:, None])  # [Z, 1, C, S]
    return s


def forward(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], pair: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """Backend contract ``forward``: o ``[Z, N, S, H, D]`` in q's dtype, stats ``[Z, N, H, S, 2]`` (row max, row sum;
    fp32, fp64 for fp64; ``(+inf, +inf)`` on fully ``-inf`` rows)."""
    z, n, s_len, h, d = q.shape
    cdt = _compute_dtype(q.dtype)
    scale = 1.0 / math.sqrt(d)
    mask_c = None if mask is None else mask.to(cdt)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [Z, N, S, H, D]
    stats = torch.empty((z, n, h, s_len, 2), dtype=cdt, device=q.device)  # [Z, N, H, S, (max, sum)]
    chunk = _chunk_size(z, n, s_len, cdt)
    with ieee_fp32_matmul(q.device):
        for hh in range(h):
            q_h, v_h = _head(q, hh, cdt), _head(v, hh, cdt)  # [Z*N, S, D]
            k_t = _head(k, hh, cdt).transpose(1, 2)  # [Z*N, D, S]
            pair_h = None if pair is None else pair[:, hh].to(cdt)  # [Z, S, S]
            for i0 in range(0, s_len, chunk):
                i1 = min(i0 + chunk, s_len)
                blk = _block_logits(
                    q_h[:, i0:i1], k_t, mask_c, None if pair_h is None else pair_h[:, i0:i1], z, scale
                )  # [Z, N, C, S]
                row_max = blk.amax(dim=-1, keepdim=True)  # [Z, N, C, 1]
                # Fully -inf rows: shift by 0 so exp gives exact zeros, never NaN.
                row_max.masked_fill_(torch.isinf(row_max), 0.0)
                blk.sub_(row_max).exp_()
                denom = blk.sum(dim=-1, keepdim=True)  # [Z, N, C, 1]
                empty = denom == 0
                blk.div_(denom.masked_fill(empty, 1.0))
                # [Z*N, C, S] @ [Z*N, S, D] -> [Z*N, C, D] -> [Z, N, C, D]
                o[:, :, i0:i1, hh] = torch.bmm(blk.view(z * n, i1 - i0, s_len), v_h).view(z, n, i1 - i0, d)
                stats[:, :, hh, i0:i1, 0] = row_max.masked_fill_(empty, math.inf).squeeze(-1)
                stats[:, :, hh, i0:i1, 1] = denom.masked_fill_(empty, math.inf).squeeze(-1)
    return o, stats


def backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, stats: Tensor, mask: Optional[Tensor],
             pair: Optional[Tensor], need_mask_grad: bool,
             need_pair_grad: bool) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """The backend contract's ``backward`` (:mod:`ds4sci.kernels.evoformer`): recompute P per head and query chunk
    from :func:`forward`'s stats."""
    z, n, s_len, h, d = q.shape
    cdt = _compute_dtype(q.dtype)
    scale = 1.0 / math.sqrt(d)
    mask_c = None if mask is None else mask.to(cdt)
    # Gradients in the output layout [Z, N, S, H, D]; in the compute dtype (cast at the end for fp16/bf16).
    dq, dk, dv = (torch.zeros(q.shape, dtype=cdt, device=q.device) for _ in range(3))
    dmask = torch.zeros((z, n, s_len), dtype=cdt, device=q.device) if need_mask_grad else None
    dpair = torch.empty((z, h, s_len, s_len), dtype=cdt, device=q.device) if need_pair_grad else None
    chunk = _chunk_size(z, n, s_len, cdt)
    with ieee_fp32_matmul(q.device):
        for hh in range(h):
            q_h, k_h, v_h, do_h = (_head(t, hh, cdt) for t in (q, k, v, do))  # [Z*N, S, D]
            delta = (do_h * _head(o, hh, cdt)).sum(dim=-1).view(z, n, s_len, 1)  # rowsum(dO * O): [Z, N, S, 1]
            dq_h, dk_h, dv_h = (t[:, :, :, hh].view(z * n, s_len, d) for t in (dq, dk, dv))  # strided views
            pair_h = None if pair is None else pair[:, hh].to(cdt)  # [Z, S, S]
            for i0 in range(0, s_len, chunk):
                i1 = min(i0 + chunk, s_len)
                c = i1 - i0
                p = _block_logits(
                    q_h[:, i0:i1], k_h.transpose(1, 2), mask_c, None if pair_h is None else pair_h[:, i0:i1], z, scale
                )  # [Z, N, C, S]
                # P = exp(S - m) / l: the max first (exact for S == m); (+inf, +inf) on fully -inf rows: zeros.
                p.sub_(stats[:, :, hh, i0:i1, 0, None]).exp_().div_(stats[:, :, hh, i0:i1, 1, None])
                p3 = p.view(z * n, c, s_len)
                # dV += P^T @ dO: [Z*N, S, C] @ [Z*N, C, D] -> [Z*N, S, D]
                dv_h.baddbmm_(p3.transpose(1, 2), do_h[:, i0:i1])
                # dP = dO @ V^T: [Z*N, C, D] @ [Z*N, D, S] -> [Z*N, C, S] -> [Z, N, C, S]
                ds = torch.bmm(do_h[:, i0:i1], v_h.transpose(1, 2)).view(z, n, c, s_len)
                ds.sub_(delta[:, :, i0:i1]).mul_(p)  # dS = P * (dP - delta): gradient of the logits
                del p, p3
                if need_mask_grad:
                    dmask.add_(ds.sum(dim=2))  # [Z, N, C, S] -> [Z, N, S]
                if need_pair_grad:
                    dpair[:, hh, i0:i1] = ds.sum(dim=1)  # [Z, N, C, S] -> [Z, C, S]
                ds3 = ds.view(z * n, c, s_len)
                # dQ = dS @ K * scale: [Z*N, C, S] @ [Z*N, S, D] -> [Z*N, C, D]
                dq_h[:, i0:i1].baddbmm_(ds3, k_h, alpha=scale)
                # dK += dS^T @ Q * scale: [Z*N, S, C] @ [Z*N, C, D] -> [Z*N, S, D]
                dk_h.baddbmm_(ds3.transpose(1, 2), q_h[:, i0:i1], alpha=scale)
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype), dmask, dpair
