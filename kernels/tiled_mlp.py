"""Tiled MLP: a token-wise function (a transformer block's MLP) computed over tiles of the sequence and recomputed
tile by tile in backward (:mod:`~ds4sci.kernels.token_tiles`), so none of its intermediate activations is saved for
backward, and none of more than one tile's tokens is ever alive (TiledMLP of Arctic Long Sequence Training, ALST:
Bekman et al. 2025, arXiv:2506.13996; written here from that description). The memory-efficient PyTorch path of an
MLP, as :mod:`~ds4sci.kernels.local_chunked` is of attention: the untiled call is the reference.
"""
from __future__ import annotations

from typing import Callable
from typing import Sequence

from torch import Tensor

from .token_tiles import token_tiles

__all__ = ["tiled_mlp"]


def tiled_mlp(fn: Callable[[Tensor], Tensor], x: Tensor, params: Sequence[Tensor], tile: int) -> Tensor:
    """``fn(x)`` for ``x [B, T, hidden]``, computed over tiles of ``tile`` tokens along T and recomputed in backward
    (:func:`~ds4sci.kernels.token_tiles.token_tiles`); ``params``: every tensor ``fn`` computes with that may need a
    gradient (its module's parameters), at full shape. ``fn`` must act on each token alone and be deterministic
    (no dropout)."""
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise ValueError(f"tiled_mlp: tile must be an integer >= 1 (tokens), got {tile!r}")
    if x.ndim < 2:
        raise ValueError(f"tiled_mlp: x must be [B, T, ...], got shape {tuple(x.shape)}")
    return token_tiles(fn, x, (), params, tile)
