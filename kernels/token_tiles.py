"""Token tiles recomputed in backward: a function that acts on each token alone, computed over tiles of the sequence
without autograd and recomputed tile by tile in backward, so none of its intermediate activations is saved and none of
more than one tile's tokens is ever alive (the mechanism of Arctic Long Sequence Training's TiledMLP and tiled loss,
ALST: Bekman et al. 2025, arXiv:2506.13996; written here from that description). Serves
:func:`~ds4sci.kernels.tiled_mlp.tiled_mlp` and :func:`~ds4sci.kernels.tiled_loss.tiled_loss`.

Cost: one more forward of the function per backward (its recomputation), and ``T / tile`` smaller matrix products in
place of one.
"""
from __future__ import annotations

from typing import Callable
from typing import Sequence

import torch
from torch import Tensor

__all__ = ["token_tiles"]


class _TokenTiles(torch.autograd.Function):
    """``forward(ctx, fn, tile, n_aligned, x [B, T, ...], *aligned [B, T, ...], *params)``
    ``-> fn(x, *aligned) [B, T, ...]``.

    Forward runs ``fn`` on each tile of ``tile`` tokens (of ``x`` and of the ``n_aligned`` tensors ``aligned`` that
    go with it token by token, e.g. the targets; never differentiated) without autograd and saves only ``x`` and
    ``aligned``. Backward recomputes one tile at a time with autograd on and takes its gradients with
    ``torch.autograd.grad``, which returns them without accumulating into ``.grad`` (no gradient-accumulation hook
    fires per tile); the parameters' gradients are summed over the tiles (in fp32 for a 16-bit parameter, so the sum
    rounds once, as the untiled GEMM's fp32 accumulator does) and returned once as the gradients of ``params``,
    explicit inputs of this function: autograd accumulates each exactly once per backward, so a ZeRO gradient hook
    reduces it once, not once per tile.

    ``params`` are the tensors ``fn`` computes with, at their full shape when this function is applied (under ZeRO-3:
    gathered for the whole call, as for a ZeRO-3 leaf module).
    """

    @staticmethod
    def forward(ctx, fn, tile: int, n_aligned: int, x: Tensor, *rest: Tensor) -> Tensor:
        aligned, params = rest[:n_aligned], rest[n_aligned:]
        ctx.fn, ctx.tile, ctx.n_aligned, ctx.params = fn, tile, n_aligned, params
        ctx.save_for_backward(x, *aligned)
        out = None
        for start in range(0, x.shape[1], tile):
            y = fn(x[:, start:start + tile], *(a[:, start:start + tile] for a in aligned))  # [B, tile, ...]
            if out is None:
                out = y.new_empty(x.shape[0], x.shape[1], *y.shape[2:])  # [B, T, ...]
            out[:, start:start + tile] = y
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, *aligned = ctx.saved_tensors  # [B, T, ...] each
        need_x = int(ctx.needs_input_grad[3])  # 1: x's gradient is the first one autograd.grad returns
        param_needs = ctx.needs_input_grad[4 + ctx.n_aligned:]
        wrt = [p for p, need in zip(ctx.params, param_needs) if need]
        grad_x = torch.empty_like(x) if need_x else None
        sums: list[Tensor | None] = [None] * len(wrt)
        for start in range(0, x.shape[1], ctx.tile):
            piece = x[:, start:start + ctx.tile].detach().requires_grad_(bool(need_x))  # [B, tile, ...]
            with torch.enable_grad():
                y = ctx.fn(piece, *(a[:, start:start + ctx.tile] for a in aligned))
            grads = torch.autograd.grad(y, [piece][:need_x] + wrt, grad_out[:, start:start + ctx.tile])
            if need_x:
                grad_x[:, start:start + ctx.tile] = grads[0]
            for i, g in enumerate(grads[need_x:]):
                if sums[i] is None:
                    sums[i] = g.to(torch.promote_types(g.dtype, torch.float32))  # fp32 sum; no copy when fp32
                else:
                    sums[i] += g
        summed = iter(sums)
        grad_params = [next(summed).to(p.dtype) if need else None for p, need in zip(ctx.params, param_needs)]
        return None, None, None, grad_x, *([None] * ctx.n_aligned), *grad_params


def token_tiles(fn: Callable[..., Tensor], x: Tensor, aligned: Sequence[Tensor], params: Sequence[Tensor],
                tile: int) -> Tensor:
    """``fn(x, *aligned)`` for ``x [B, T, ...]`` and ``aligned`` tensors ``[B, T, ...]`` (not differentiated),
    computed over tiles of ``tile`` tokens along T and recomputed in backward (:class:`_TokenTiles`); ``params``: every
    tensor ``fn`` computes with that may need a gradient, at full shape. ``fn`` must act on each token alone and be
    deterministic (no dropout); its output is ``[B, tile, ...]`` per tile. Callers check ``tile``."""
    return _TokenTiles.apply(fn, tile, len(aligned), x, *aligned, *params)
