"""The "torch" backend: memory-efficient Evoformer attention in plain PyTorch, chunked over queries.

Forward processes queries in chunks so that only one ``[Z, N, H, C, S]`` logits block (C queries) lives
at a time, computes the softmax in fp32 (fp64 for fp64 inputs) and saves only O and the log-sum-exp.
Backward recomputes each block's probabilities from the LSE, ``P = exp(S - LSE)``, and forms
``dS = P * (dP - rowsum(dO * O))`` (the FlashAttention-2 backward, Dao 2023, Algorithm 2, applied per
query chunk as in Rabe & Staats 2021, "Self-attention does not need O(n^2) memory"). The pair-bias
gradient is ``dS`` summed over N with an ordinary (deterministic) reduction, one query chunk at a time, so
two backward passes give bitwise-equal results.

The chunk size C is the largest that keeps one fp32 logits block within :data:`LOGITS_CHUNK_BYTES`
(at least one query). Peak extra memory is about two such blocks in backward, plus fp32 copies of q/k/v/dO
for fp16/bf16 inputs.

Works on any device; canonical shapes and the backend contract are described in ``ds4sci.kernels.evoformer``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .reference import ieee_fp32_matmul

#: Upper bound on the bytes of one fp32 logits block ``[Z, N, H, C, S]``; backward holds about two.
LOGITS_CHUNK_BYTES = 16 * 2**20


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_size(z: int, n: int, h: int, s: int, dtype: torch.dtype) -> int:
    """Queries per chunk so that a ``[Z, N, H, C, S]`` block of ``dtype`` fits in LOGITS_CHUNK_BYTES."""
    bytes_per_query = z * n * h * s * torch.finfo(dtype).bits // 8
    return max(1, min(s, LOGITS_CHUNK_BYTES // bytes_per_query))


def _block_logits(
    q_c: Tensor, k: Tensor, mask: Optional[Tensor], pair_c: Optional[Tensor], scale: float
) -> Tensor:
    """Logits of one query chunk: q_c ``[Z, N, C, H, D]``, k ``[Z, N, S, H, D]`` -> ``[Z, N, H, C, S]``."""
    # [Z, N, H, C, D] @ [Z, N, H, D, S] -> [Z, N, H, C, S]
    s = torch.matmul(q_c.permute(0, 1, 3, 2, 4), k.permute(0, 1, 3, 4, 2))
    s.mul_(scale)
    if mask is not None:
        s.add_(mask[:, :, None, None, :])  # [Z, N, 1, 1, S]
    if pair_c is not None:
        s.add_(pair_c[:, None])  # [Z, 1, H, C, S]
    return s


def forward(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], pair: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """Backend contract ``forward``: o ``[Z, N, S, H, D]`` in q's dtype, lse ``[Z, N, H, S]`` (fp32; fp64 for fp64)."""
    z, n, s_len, h, d = q.shape
    cdt = _compute_dtype(q.dtype)
    scale = 1.0 / math.sqrt(d)
    k_c, v_c = k.to(cdt), v.to(cdt)
    mask_c = None if mask is None else mask.to(cdt)
    pair_c = None if pair is None else pair.to(cdt)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [Z, N, S, H, D]
    lse = torch.empty((z, n, h, s_len), dtype=cdt, device=q.device)  # [Z, N, H, S]
    # [Z, N, S, H, D] -> [Z, N, H, S, D] (view) for the P @ V product
    v_t = v_c.permute(0, 1, 3, 2, 4)
    chunk = _chunk_size(z, n, h, s_len, cdt)
    with ieee_fp32_matmul(q.device):
        for i0 in range(0, s_len, chunk):
            i1 = min(i0 + chunk, s_len)
            blk = _block_logits(
                q[:, :, i0:i1].to(cdt), k_c, mask_c, None if pair_c is None else pair_c[:, :, i0:i1], scale
            )  # [Z, N, H, C, S]
            row_max = blk.amax(dim=-1, keepdim=True)  # [Z, N, H, C, 1]
            # Fully -inf rows: shift by 0 so exp gives exact zeros, never NaN.
            row_max.masked_fill_(torch.isinf(row_max), 0.0)
            blk.sub_(row_max).exp_()
            denom = blk.sum(dim=-1, keepdim=True)  # [Z, N, H, C, 1]
            empty = denom == 0
            # [Z, N, H, C, S] @ [Z, N, H, S, D] -> [Z, N, H, C, D]
            o_blk = torch.matmul(blk, v_t).div_(denom.masked_fill(empty, 1.0))
            o[:, :, i0:i1] = o_blk.permute(0, 1, 3, 2, 4)  # -> [Z, N, C, H, D]
            lse[:, :, :, i0:i1] = (row_max + denom.log()).masked_fill_(empty, math.inf).squeeze(-1)
    return o, lse


def backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    mask: Optional[Tensor],
    pair: Optional[Tensor],
    need_mask_grad: bool,
    need_pair_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """Backend contract ``backward``: recompute P per query chunk from the LSE.

    Returns dq, dk, dv in q's dtype; dmask ``[Z, N, S]`` per n (not reduced) and dpair ``[Z, H, S, S]``
    summed over N, both fp32 (fp64 for fp64 inputs), or None when not requested.
    """
    z, n, s_len, h, d = q.shape
    cdt = _compute_dtype(q.dtype)
    scale = 1.0 / math.sqrt(d)
    k_c, v_c = k.to(cdt), v.to(cdt)
    mask_c = None if mask is None else mask.to(cdt)
    pair_c = None if pair is None else pair.to(cdt)
    # [Z, N, S, H, D] -> [Z, N, H, S, D] views of the key-side operands
    k_t, v_t = k_c.permute(0, 1, 3, 2, 4), v_c.permute(0, 1, 3, 2, 4)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros((z, n, h, s_len, d), dtype=cdt, device=q.device)  # [Z, N, H, S, D]
    dv = torch.zeros((z, n, h, s_len, d), dtype=cdt, device=q.device)  # [Z, N, H, S, D]
    # [Z, N, H, S, D] -> [Z*N*H, S, D] views for in-place batched accumulation
    dk3, dv3 = dk.view(-1, s_len, d), dv.view(-1, s_len, d)
    dmask = torch.zeros((z, n, s_len), dtype=cdt, device=q.device) if need_mask_grad else None
    dpair = torch.empty((z, h, s_len, s_len), dtype=cdt, device=q.device) if need_pair_grad else None
    chunk = _chunk_size(z, n, h, s_len, cdt)
    with ieee_fp32_matmul(q.device):
        for i0 in range(0, s_len, chunk):
            i1 = min(i0 + chunk, s_len)
            q_blk = q[:, :, i0:i1].to(cdt).permute(0, 1, 3, 2, 4)  # [Z, N, H, C, D]
            do_blk = do[:, :, i0:i1].to(cdt).permute(0, 1, 3, 2, 4)  # [Z, N, H, C, D]
            o_blk = o[:, :, i0:i1].to(cdt).permute(0, 1, 3, 2, 4)  # [Z, N, H, C, D]
            delta = (do_blk * o_blk).sum(dim=-1, keepdim=True)  # [Z, N, H, C, 1]
            p = _block_logits(
                q[:, :, i0:i1].to(cdt), k_c, mask_c, None if pair_c is None else pair_c[:, :, i0:i1], scale
            )  # [Z, N, H, C, S]
            # P = exp(S - LSE); LSE = +inf on fully -inf rows gives exact zeros.
            p.sub_(lse[:, :, :, i0:i1, None]).exp_()
            c = i1 - i0
            # dV += P^T @ dO, accumulated in place: [Z*N*H, S, C] @ [Z*N*H, C, D] -> [Z*N*H, S, D]
            dv3.baddbmm_(p.transpose(-1, -2).reshape(-1, s_len, c), do_blk.reshape(-1, c, d))
            # dP = dO @ V^T: [Z, N, H, C, D] @ [Z, N, H, D, S] -> [Z, N, H, C, S]
            ds = torch.matmul(do_blk, v_t.transpose(-1, -2))
            ds.sub_(delta).mul_(p)  # dS = P * (dP - delta), the gradient of the biased logits
            del p
            if need_mask_grad:
                dmask.add_(ds.sum(dim=(2, 3)))  # [Z, N, H, C, S] -> [Z, N, S]
            if need_pair_grad:
                dpair[:, :, i0:i1] = ds.sum(dim=1)  # [Z, N, H, C, S] -> [Z, H, C, S]
            # dQ = dS @ K * scale: [Z, N, H, C, S] @ [Z, N, H, S, D] -> [Z, N, H, C, D]
            dq[:, :, i0:i1] = torch.matmul(ds, k_t).mul_(scale).permute(0, 1, 3, 2, 4)  # -> [Z, N, C, H, D]
            # dK += dS^T @ Q * scale, in place: [Z*N*H, S, C] @ [Z*N*H, C, D] -> [Z*N*H, S, D]
            dk3.baddbmm_(ds.transpose(-1, -2).reshape(-1, s_len, c), q_blk.reshape(-1, c, d), alpha=scale)
    # [Z, N, H, S, D] -> [Z, N, S, H, D]
    dk_out = dk.permute(0, 1, 3, 2, 4).to(q.dtype).contiguous()
    dv_out = dv.permute(0, 1, 3, 2, 4).to(q.dtype).contiguous()
    return dq, dk_out, dv_out, dmask, dpair
