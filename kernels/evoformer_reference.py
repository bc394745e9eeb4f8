"""Plain-PyTorch Evoformer attention: the oracle every other backend is tested against.

Computes, for canonical inputs (see ``ds4sci.kernels.evoformer``)::

    s[z, n, h, i, j] = (q[z, n, i, h] . k[z, n, j, h]) / sqrt(D) + mask[z, n, j] + pair[z, h, i, j]
    o[z, n, i, h]    = sum_j softmax_j(s)[z, n, h, i, j] * v[z, n, j, h]

which is the gated-free core of AlphaFold2's MSA row/column attention and triangle attention
(Jumper et al. 2021, supplement Algorithms 7, 8, 13, 14). Everything is computed in the dtype it is
given (fp64 in, fp64 arithmetic out), so tests can measure PyTorch's own same-dtype error against an
fp64 run. The full logits tensor ``[Z, N, H, S, S]`` is materialised: this path is for correctness, not
memory.

A query row whose keys are all masked with ``-inf`` is defined as zeros (never NaN); its softmax statistics are
stored as ``(+inf, +inf)`` so that ``exp(s - m) / l = 0`` in any backward that recomputes probabilities.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Optional

import torch
from torch import Tensor


@contextlib.contextmanager
def ieee_fp32_matmul(device: torch.device) -> Iterator[None]:
    """Force IEEE fp32 matmuls (no TF32) on CUDA for the duration of the block; a no-op elsewhere."""
    if device.type != "cuda":
        yield
        return
    previous = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.fp32_precision = previous


def logits(q: Tensor, k: Tensor, mask: Optional[Tensor], pair: Optional[Tensor]) -> Tensor:
    """Scaled, biased logits ``[Z, N, H, Sq, Sk]`` in q's dtype.

    q ``[Z, N, Sq, H, D]``, k ``[Z, N, Sk, H, D]``, mask ``[Z, N, Sk]`` or None,
    pair ``[Z, H, Sq, Sk]`` or None. Biases are cast to q's dtype; they are added in the order
    ``(qk * scale + mask) + pair``, the order every backend uses.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    # [Z, N, Sq, H, D] x [Z, N, Sk, H, D] -> [Z, N, H, Sq, Sk]
    s = torch.einsum("znihd,znjhd->znhij", q, k) * scale
    if mask is not None:
        s = s + mask.to(q.dtype)[:, :, None, None, :]  # [Z, N, 1, 1, Sk]
    if pair is not None:
        s = s + pair.to(q.dtype)[:, None]  # [Z, 1, H, Sq, Sk]
    return s


def forward(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], pair: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """Attention output and softmax statistics; differentiable with plain autograd.

    Args:
        q, k, v: ``[Z, N, S, H, D]``, same dtype and device.
        mask: ``[Z, N, S]`` key-wise additive bias, or None.
        pair: ``[Z, H, S, S]`` (query x key) additive bias, or None.

    Returns:
        o ``[Z, N, S, H, D]`` in q's dtype and stats ``[Z, N, H, S, 2]``: the row max m of the biased logits and
        the row sum ``l = sum_j exp(s_j - m)``, kept apart (the log-sum-exp ``m + log l`` in fp32 loses ``log l``
        when |m| is huge); float32 for fp16/bf16/fp32 inputs, float64 for fp64
        inputs; ``(+inf, +inf)`` on fully ``-inf``-masked rows.
    """
    with ieee_fp32_matmul(q.device):
        s = logits(q, k, mask, pair)  # [Z, N, H, S, S]
        # The row maximum is a constant shift of the row (softmax is invariant to it), so it is detached;
        # a fully -inf row has max -inf and is shifted by 0 instead, giving exp(-inf) = 0 everywhere.
        row_max = s.detach().amax(dim=-1, keepdim=True)  # [Z, N, H, S, 1]
        row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
        e = torch.exp(s - row_max)
        denom = e.sum(dim=-1, keepdim=True)  # [Z, N, H, S, 1]
        empty = denom == 0
        p = e / torch.where(empty, torch.ones_like(denom), denom)
        # [Z, N, H, Sq, Sk] x [Z, N, Sk, H, D] -> [Z, N, Sq, H, D]
        o = torch.einsum("znhij,znjhd->znihd", p, v)
        inf = torch.full_like(denom, math.inf)
        stats = torch.cat([torch.where(empty, inf, row_max), torch.where(empty, inf, denom)], dim=-1)
    stats_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return o, stats.detach().to(stats_dtype)  # [Z, N, H, S, 2]


def backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, stats: Tensor, mask: Optional[Tensor],
             pair: Optional[Tensor], need_mask_grad: bool,
             need_pair_grad: bool) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """The backend contract's ``backward`` (:mod:`ds4sci.kernels.evoformer`) by recomputing :func:`forward` under
    autograd; ``o`` and ``stats`` are accepted for the contract and not used."""
    del o, stats
    grad_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    with torch.enable_grad():
        q_, k_, v_ = (t.detach().requires_grad_(True) for t in (q, k, v))
        # Per-n / per-z leaf copies so the gradient is not reduced over broadcast (stride-0) dims.
        mask_ = None if mask is None else mask.detach().clone().requires_grad_(need_mask_grad)
        pair_ = None if pair is None else pair.detach().clone().requires_grad_(need_pair_grad)
        out, _ = forward(q_, k_, v_, mask_, pair_)
        inputs = [q_, k_, v_] + [t for t, need in ((mask_, need_mask_grad), (pair_, need_pair_grad)) if need]
        grads = list(torch.autograd.grad(out, inputs, do))
    dq, dk, dv = grads[:3]
    rest = grads[3:]
    dmask = rest.pop(0).to(grad_dtype) if need_mask_grad else None
    dpair = rest.pop(0).to(grad_dtype) if need_pair_grad else None
    return dq, dk, dv, dmask, dpair
