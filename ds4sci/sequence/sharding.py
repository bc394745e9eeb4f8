"""Sequence sharding for sequence parallelism: tokens, labels and positions are sharded the same way.

Layouts over ``world`` shards of a sequence of length ``S``:

- ``"contiguous"``: shard ``r`` holds ``[r*S/W, (r+1)*S/W)``.
- ``"zigzag"`` (load-balanced, for causal attention; Brandon et al. 2023 "Striped Attention" and the USP paper's
  load-balanced ring): the sequence is cut into ``2W`` chunks and shard ``r`` holds chunks ``r`` and
  ``2W-1-r``, so every shard holds one early and one late chunk and does the same causal work.

Under Unified SP use ``rank = sp_rank`` and ``world = ulysses * ring`` (see :mod:`ds4sci.sequence.groups`):
after the Ulysses all-to-all a ring rank then holds a contiguous block (contiguous layout) or ring chunks
``r`` and ``2R-1-r`` (zigzag layout), which is what :class:`~ds4sci.sequence.DistributedAttention` expects.

Lengths that the layout does not divide raise ``ValueError``; :func:`pad_to_multiple` pads instead (mask the
padding out, e.g. with document id :data:`PAD_DOC_ID`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ds4sci.sequence.comm import CommCounter, all_gather_seq, group_size

__all__ = [
    "LAYOUTS",
    "PAD_DOC_ID",
    "shard_sequence",
    "unshard_sequence",
    "gather_sequence",
    "shard_positions",
    "pad_to_multiple",
    "layout_multiple",
]

LAYOUTS = ("contiguous", "zigzag")

PAD_DOC_ID = -1
"""Document id for padding positions: real document ids are >= 0, so no real query sees a padding key."""


def _check(layout: str, rank: int, world: int) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank={rank} is outside [0, world={world})")


def layout_multiple(world: int, layout: str) -> int:
    """The sequence length must be a multiple of this: ``world`` (contiguous) or ``2*world`` (zigzag)."""
    return world if layout == "contiguous" else 2 * world


def _chunks(length: int, dim: int, shape: tuple, world: int, layout: str) -> int:
    multiple = layout_multiple(world, layout)
    if length % multiple != 0:
        raise ValueError(
            f"sequence length {length} (dim {dim} of shape {shape}) is not divisible by {multiple} "
            f"({layout} layout over {world} shards); pad it with pad_to_multiple(x, dim, {multiple}) and mask "
            f"the padding"
        )
    return multiple


def shard_sequence(x: torch.Tensor, dim: int, rank: int, world: int, layout: str = "contiguous") -> torch.Tensor:
    """The shard of ``x`` that sequence rank ``rank`` of ``world`` holds along ``dim``.

    Example: q ``[B, S, H, D]`` with ``dim=1`` -> ``[B, S/W, H, D]``; positions ``[S]`` with ``dim=0`` -> ``[S/W]``.

    Raises:
        ValueError: unknown layout, rank outside ``[0, world)``, or ``x.size(dim)`` not divisible by
            ``world`` (contiguous) / ``2*world`` (zigzag).
    """
    _check(layout, rank, world)
    n_chunks = _chunks(x.size(dim), dim, tuple(x.shape), world, layout)
    chunks = x.chunk(n_chunks, dim=dim)
    if layout == "contiguous":
        return chunks[rank]
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=dim)


def unshard_sequence(shards: list[torch.Tensor], dim: int, layout: str = "contiguous") -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: the full sequence from all ``W`` shards given in rank order."""
    world = len(shards)
    _check(layout, 0, world)
    if layout == "contiguous":
        return torch.cat(shards, dim=dim)
    # each shard = [chunk r, chunk 2W-1-r] -> chunks 0..W-1 are the first halves, W..2W-1 the reversed second halves
    halves = [shard.chunk(2, dim=dim) for shard in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)


def gather_sequence(
    x: torch.Tensor,
    dim: int,
    group: dist.ProcessGroup | None,
    layout: str = "contiguous",
    counter: CommCounter | None = None,
) -> torch.Tensor:
    """All-gather the local shards of ``group`` (sequence ranks in group-rank order) into the full sequence.

    Not differentiable (for evaluation, logging and tests).
    """
    world = group_size(group)
    if world == 1:
        return x
    stacked = all_gather_seq(x.unsqueeze(0), group, dim=0, counter=counter)  # [W, *x.shape]
    return unshard_sequence(list(stacked.unbind(0)), dim=dim, layout=layout)


def shard_positions(
    seq_len: int, rank: int, world: int, layout: str = "contiguous", device: torch.device | str | None = None
) -> torch.Tensor:
    """Global positions (int64 ``[S/W]``) that sequence rank ``rank`` holds: feed them to position embeddings
    (learned, rotary, ALiBi) so they follow the tokens."""
    return shard_sequence(torch.arange(seq_len, device=device), 0, rank, world, layout)


def pad_to_multiple(x: torch.Tensor, dim: int, multiple: int, value: float | int = 0) -> torch.Tensor:
    """Pad ``x`` at the end of ``dim`` with ``value`` up to the next multiple of ``multiple``.

    Padding changes attention unless it is masked: give padding tokens document id :data:`PAD_DOC_ID`
    (``pad_to_multiple(doc_ids, 1, m, PAD_DOC_ID)``) and drop padded rows from the loss.
    """
    if multiple < 1:
        raise ValueError(f"multiple={multiple} must be >= 1")
    pad = -x.size(dim) % multiple
    if pad == 0:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_full(shape, value)], dim=dim)
