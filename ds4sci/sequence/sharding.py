"""Sequence sharding: tokens, labels and positions are cut the same way, by a sequence :class:`Layout`.

:class:`Layout` (contiguous / zigzag) and its chunk arithmetic live with the parallel degrees in
:mod:`ds4sci.distributed.dims` (they are torch-free there, for the planner); this module applies a layout to tensors.
Under Unified SP the shard index is ``sp_rank = ring_rank * ulysses + ulysses_rank`` of ``world = ulysses * ring``
(:class:`~ds4sci.distributed.dims.ParallelDims`). After the Ulysses all-to-all a ring rank holds a contiguous block
(contiguous) or ring chunks ``r`` and ``2R-1-r`` (zigzag): :func:`regroup` puts the gathered rows in that order and
:meth:`Layout.pieces` says which global positions each run of rows holds.

Lengths that the layout does not divide raise ``ValueError``; :func:`pad_to_multiple` pads instead (mask the
padding out with document id :data:`ds4sci.kernels.local_reference.PAD_DOC_ID`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ds4sci.distributed.comm import CommCounter
from ds4sci.distributed.comm import all_gather
from ds4sci.distributed.comm import group_size
from ds4sci.distributed.dims import Layout

__all__ = [
    "Layout",
    "regroup",
    "shard_sequence",
    "unshard_sequence",
    "gather_sequence",
    "shard_positions",
    "pad_to_multiple",
]


def regroup(x: torch.Tensor, layout: Layout, ulysses: int, inverse: bool = False) -> torch.Tensor:
    """Order the rows the Ulysses all-to-all gathered (``[B, U*s, ...]``, dim 1) as the ring rank's chunks.

    Zigzag: SP rank ``p`` holds chunks ``p`` and ``2P-1-p``, so the all-to-all concatenates the U shards of
    ring rank r as ``[c_a, c_z, c_(a+1), c_(z-1), ...]`` (``a = r*U``, ``z = 2P-1-a``). Regroup them as
    ``[c_a .. c_(a+U-1), c_(z-U+1) .. c_z]`` = ring chunks ``r`` and ``2R-1-r`` in sequence order (or back, with
    ``inverse``). Contiguous shards are already in order.
    """
    if layout is Layout.CONTIGUOUS or ulysses == 1:
        return x
    B, L = x.shape[:2]
    rest = x.shape[2:]
    c = L // (2 * ulysses)
    if inverse:
        early, late = x.reshape(B, 2, ulysses, c, *rest).unbind(1)  # 2 x [B, U, c, ...]
        x = torch.stack([early, late.flip(1)], dim=2)  # [B, U, 2, c, ...]
    else:
        x = x.reshape(B, ulysses, 2, c, *rest)  # [B, U, 2, c, ...]: the early then the late chunk of each shard
        x = torch.stack([x[:, :, 0], x[:, :, 1].flip(1)], dim=1)  # [B, 2, U, c, ...], late chunks ascending
    return x.reshape(B, L, *rest)  # [B, U*s, ...]


def _split(x: torch.Tensor, dim: int, world: int, layout: Layout) -> tuple[torch.Tensor, ...]:
    multiple = layout.multiple(world)
    if x.size(dim) % multiple != 0:
        raise ValueError(
            f"sequence length {x.size(dim)} (dim {dim} of shape {tuple(x.shape)}) is not divisible by {multiple} "
            f"({layout.value} layout over {world} shards); pad it with pad_to_multiple(x, dim, {multiple}) and mask "
            f"the padding"
        )
    return x.chunk(multiple, dim=dim)


def shard_sequence(x: torch.Tensor, dim: int, rank: int, world: int,
                   layout: str | Layout = Layout.CONTIGUOUS) -> torch.Tensor:
    """The shard of ``x`` that sequence rank ``rank`` of ``world`` holds along ``dim``.

    Example: q ``[B, S, H, D]`` with ``dim=1`` -> ``[B, S/W, H, D]``; positions ``[S]`` with ``dim=0`` -> ``[S/W]``.

    Raises:
        ValueError: unknown layout, rank outside ``[0, world)``, or ``x.size(dim)`` not divisible by
            ``world`` (contiguous) / ``2*world`` (zigzag).
    """
    layout = Layout.parse(layout)
    held = layout.chunks(rank, world)
    chunks = _split(x, dim, world, layout)
    return torch.cat([chunks[c] for c in held], dim=dim) if len(held) > 1 else chunks[held[0]]


def unshard_sequence(shards: list[torch.Tensor], dim: int, layout: str | Layout = Layout.CONTIGUOUS) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: the full sequence from all ``W`` shards given in rank order."""
    layout, world = Layout.parse(layout), len(shards)
    pieces: dict[int, torch.Tensor] = {}
    for rank, shard in enumerate(shards):
        held = layout.chunks(rank, world)
        pieces.update(zip(held, shard.chunk(len(held), dim=dim)))
    return torch.cat([pieces[c] for c in range(layout.multiple(world))], dim=dim)


def gather_sequence(
    x: torch.Tensor,
    dim: int,
    group: dist.ProcessGroup | None,
    layout: str | Layout = Layout.CONTIGUOUS,
    counter: CommCounter | None = None,
) -> torch.Tensor:
    """All-gather the local shards of ``group`` (sequence ranks in group-rank order) into the full sequence.

    Not differentiable (for evaluation, logging and tests).
    """
    if group_size(group) == 1:
        return x
    stacked = all_gather(x.unsqueeze(0), group, dim=0, counter=counter)  # [W, *x.shape]
    return unshard_sequence(list(stacked.unbind(0)), dim=dim, layout=layout)


def shard_positions(
    seq_len: int, rank: int, world: int, layout: str | Layout = Layout.CONTIGUOUS,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Global positions (int64 ``[S/W]``) that sequence rank ``rank`` holds: feed them to position embeddings
    (learned, rotary, ALiBi) so they follow the tokens."""
    return shard_sequence(torch.arange(seq_len, device=device), 0, rank, world, layout)


def pad_to_multiple(x: torch.Tensor, dim: int, multiple: int, value: float | int = 0) -> torch.Tensor:
    """Pad ``x`` at the end of ``dim`` with ``value`` up to the next multiple of ``multiple``.

    Padding changes attention unless it is masked: give padding tokens document id ``PAD_DOC_ID``
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
