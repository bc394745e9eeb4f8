"""Tiled MLP: a token-wise function (a transformer block's MLP) computed over tiles of the sequence and recomputed
tile by tile in backward, so none of its intermediate activations is saved for backward, and none of more than one
tile's tokens is ever alive (TiledMLP of Arctic Long Sequence Training, ALST: Bekman et al. 2025, arXiv:2506.13996;
written here from that description). The memory-efficient PyTorch path of an MLP, as
:mod:`~ds4sci.kernels.local_chunked` is of attention: the untiled call is the reference.

Cost: one more forward of the function per backward (its recomputation), and ``T / tile`` smaller matrix products in
place of one.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

__all__ = ["tiled_mlp"]


class _TiledMLP(torch.autograd.Function):
    """``forward(ctx, fn, tile, x [B, T, hidden], *params) -> fn(x) [B, T, hidden]``.

    Forward runs ``fn`` on each tile of ``tile`` tokens without autograd and saves only ``x``. Backward recomputes one
    tile at a time with autograd on and takes its gradients with ``torch.autograd.grad``, which returns them without
    accumulating into ``.grad`` (no gradient-accumulation hook fires per tile); the parameters' gradients are summed
    over the tiles (in fp32 for a 16-bit parameter, so the sum rounds once, as the untiled GEMM's fp32 accumulator
    does) and returned once as the gradients of ``params``, explicit inputs of this function: autograd accumulates
    each exactly once per backward, so a ZeRO gradient hook reduces it once, not once per tile.

    ``params`` are the tensors ``fn`` computes with, at their full shape when this function is applied (under ZeRO-3:
    gathered for the whole call, as for a ZeRO-3 leaf module).
    """

    @staticmethod
    def forward(ctx, fn, tile: int, x: Tensor, *params: Tensor) -> Tensor:
        ctx.fn, ctx.tile, ctx.params = fn, tile, params
        ctx.save_for_backward(x)
        out = None
        for start in range(0, x.shape[1], tile):
            y = fn(x[:, start:start + tile])  # [B, tile, hidden]
            if out is None:
                out = y.new_empty(x.shape[0], x.shape[1], *y.shape[2:])  # [B, T, hidden]
            out[:, start:start + tile] = y
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (x,) = ctx.saved_tensors  # [B, T, hidden]
        need_x = int(ctx.needs_input_grad[2])  # 1: x's gradient is the first one autograd.grad returns
        wrt = [p for p, need in zip(ctx.params, ctx.needs_input_grad[3:]) if need]
        grad_x = torch.empty_like(x) if need_x else None
        sums: list[Tensor | None] = [None] * len(wrt)
        for start in range(0, x.shape[1], ctx.tile):
            piece = x[:, start:start + ctx.tile].detach().requires_grad_(bool(need_x))  # [B, tile, hidden]
            with torch.enable_grad():
                y = ctx.fn(piece)
            grads = torch.autograd.grad(y, [piece][:need_x] + wrt, grad_out[:, start:start + ctx.tile])
            if need_x:
                grad_x[:, start:start + ctx.tile] = grads[0]
            for i, g in enumerate(grads[need_x:]):
                if sums[i] is None:
                    sums[i] = g.to(torch.promote_types(g.dtype, torch.float32))  # fp32 sum; no copy when fp32
                else:
                    sums[i] += g
        summed = iter(sums)
        grad_params = [next(summed).to(p.dtype) if need else None
                       for p, need in zip(ctx.params, ctx.needs_input_grad[3:])]
        return None, None, grad_x, *grad_params


def tiled_mlp(fn: Callable[[Tensor], Tensor], x: Tensor, params: Sequence[Tensor], tile: int) -> Tensor:
    """``fn(x)`` for ``x [B, T, hidden]``, computed over tiles of ``tile`` tokens along T and recomputed in backward
    (:class:`_TiledMLP`); ``params``: every tensor ``fn`` computes with that may need a gradient (its module's
    parameters), at full shape. ``fn`` must act on each token alone and be deterministic (no dropout)."""
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise ValueError(f"tiled_mlp: tile must be an integer >= 1 (tokens), got {tile!r}")
    if x.ndim < 2:
        raise ValueError(f"tiled_mlp: x must be [B, T, ...], got shape {tuple(x.shape)}")
    return _TiledMLP.apply(fn, tile, x, *params)
