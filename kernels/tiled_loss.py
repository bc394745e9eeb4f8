"""Tiled loss: a language model's output projection and cross entropy computed over tiles of the sequence and
recomputed tile by tile in backward (:mod:`~ds4sci.kernels.token_tiles`), so the logits ``[B, T, V]`` and their fp32
log-softmax are never alive for more than one tile's tokens and never saved for backward: only the final hidden
states and the targets are (the tiled loss of Arctic Long Sequence Training, ALST: Bekman et al. 2025,
arXiv:2506.13996; written here from that description). The untiled ``loss_fn(logits_fn(x), targets)`` is the
reference.

Cost: one more forward of the output projection and the loss per backward (its recomputation), and ``T / tile``
smaller matrix products in place of one.
"""
from __future__ import annotations

from typing import Callable
from typing import Sequence

from torch import Tensor

from .token_tiles import token_tiles

__all__ = ["tiled_loss"]


def tiled_loss(logits_fn: Callable[[Tensor], Tensor], loss_fn: Callable[[Tensor, Tensor], Tensor], x: Tensor,
               targets: Tensor, params: Sequence[Tensor], tile: int) -> Tensor:
    """``loss_fn(logits_fn(x), targets).sum()`` for final hidden states ``x [B, T, hidden]`` and aligned targets
    ``targets [B, T]``, computed over tiles of ``tile`` tokens along T and recomputed in backward: per tile the logits
    ``logits_fn(x_tile) [B, tile, V]`` (in the compute dtype; under vocabulary parallelism this rank's ``V/tp``
    columns) and the per-token losses ``loss_fn(logits, targets_tile) [B, tile]`` (fp32; 0 where a target is
    ignored; a vocabulary-parallel ``loss_fn`` all-reduces each tile's max and sums over its group, in forward and
    again in the recomputation). Returns the fp32 sum (a scalar). ``params``: every tensor ``logits_fn`` computes with
    that may need a gradient (the head weight), at full shape; each one's gradient is summed over the tiles in fp32
    and accumulated once per backward. Saved for backward: ``x`` and ``targets`` alone."""
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise ValueError(f"tiled_loss: tile must be an integer >= 1 (tokens), got {tile!r}")
    if x.ndim != 3 or targets.shape != x.shape[:2]:
        raise ValueError(f"tiled_loss: x must be [B, T, hidden] and targets [B, T], got shapes {tuple(x.shape)} and "
                         f"{tuple(targets.shape)}")

    def per_token(x_tile: Tensor, targets_tile: Tensor) -> Tensor:
        return loss_fn(logits_fn(x_tile), targets_tile)  # [B, tile], fp32

    return token_tiles(per_token, x, (targets,), params, tile).sum()
