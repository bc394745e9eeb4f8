"""Length-aware batching of many records' windows, and records dealt over data ranks by their token counts.

A file of mixed lengths read ``batch_size`` windows at a time in file order pads every batch to its longest window,
and short records (genes, reads, amplicons) fill one row each. Here:

- :func:`deal`: records to data ranks, longest first onto the rank with the fewest tokens so far (greedy LPT), so
  ranks finish together.
- :func:`plan_batches`: a rank's windows into rows and rows into batches. Records are taken longest first. With
  ``together``, a record's windows stay together (a record is complete soon after its first window is read, so
  little is held: what per-token states need); without, the short last window of a longer record waits for the
  others of its length, so that the full windows fill whole batches and the short ones share batches sorted by
  length (next to full ones it would be padded to the window length). With ``pack``, records of one window are
  packed several to a row (the longest left with the shortest that still fit, up to ``row_len`` tokens): each is
  its own document of the row, so attention never crosses records (``doc_ids``). A long record's last window is
  not packed: a row of one window keeps attention's causal kernel, where a packed row needs a document mask. Rows
  are grouped into batches of at most ``max_tokens`` tokens, padding counted (rows x the longest row); a row longer
  than the budget is a batch alone.
- :func:`collate_rows`: a planned batch as tensors, every window a slot with its own document id and positions
  from 0, as one window alone reads them.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np
import torch

from ds4sci.kernels.local_reference import PAD_DOC_ID
from ds4sci.models.genslm import IGNORE_INDEX

__all__ = ["deal", "plan_batches", "collate_rows"]


def deal(sizes: Sequence[int], parts: int) -> np.ndarray:
    """The part (data rank) of each item ``[N]`` int64: items by ``sizes`` (tokens) longest first, each to the part
    with the smallest total so far (ties: the lowest part; equal sizes keep input order).

    Raises:
        ValueError: ``parts`` < 1.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    sizes = np.asarray(sizes, dtype=np.int64)
    out = np.zeros(len(sizes), dtype=np.int64)
    if parts == 1:
        return out
    loads = [(0, p) for p in range(parts)]
    for i in np.argsort(-sizes, kind="stable"):
        load, p = heapq.heappop(loads)
        out[i] = p
        heapq.heappush(loads, (load + int(sizes[i]), p))
    return out


def plan_batches(lengths: Sequence[int], owner: Sequence[int], max_tokens: int, row_len: int,
                 pack: bool = True, together: bool = True) -> list[list[list[int]]]:
    """Batches of rows of window indices: ``batches[b][row]`` lists the windows laid one after the other in that row.

    ``lengths [W]``: tokens of each window; ``owner [W]``: its record, a record's windows consecutive and in order;
    ``max_tokens``: tokens per batch, padding included (rows x longest row); ``row_len``: the longest row a packed
    row may reach (the window length); ``pack``: records of one window packed several to a row; ``together``: a
    record's windows read together, else the short last windows of longer records are batched by length after the
    full windows. Every window is in exactly one row, a record's windows in order.

    Raises:
        ValueError: ``max_tokens`` or ``row_len`` < 1, or ``lengths`` and ``owner`` of different sizes.
    """
    if max_tokens < 1 or row_len < 1:
        raise ValueError(f"max_tokens ({max_tokens}) and row_len ({row_len}) must be >= 1")
    lengths, owner = np.asarray(lengths, dtype=np.int64), np.asarray(owner, dtype=np.int64)
    if lengths.shape != owner.shape:
        raise ValueError(f"lengths {lengths.shape} and owner {owner.shape} must have one entry per window")
    if not len(lengths):
        return []
    starts = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])  # first window of each record
    ends = np.r_[starts[1:], len(owner)]
    totals = np.add.reduceat(lengths, starts)
    order = np.argsort(-totals, kind="stable")
    rows, singles, shorts = [], [], []
    for r in order:
        last, alone = ends[r] - 1, ends[r] - starts[r] == 1
        if lengths[last] < row_len and ((pack and alone) or not together):
            rows += [[w] for w in range(starts[r], last)]
            (singles if pack and alone else shorts).append(int(last))
        else:
            rows += [[w] for w in range(starts[r], ends[r])]
    lo, hi = 0, len(singles) - 1  # singles longest first: each row the longest left, then the shortest that fit
    packed = [[w] for w in shorts]  # a long record's last window: sorted by length, not packed (a causal row)
    while lo <= hi:
        row, used = [singles[lo]], int(lengths[singles[lo]])
        lo += 1
        while lo <= hi and used + lengths[singles[hi]] <= row_len:
            row.append(singles[hi])
            used += int(lengths[singles[hi]])
            hi -= 1
        packed.append(row)
    packed.sort(key=lambda row: -int(lengths[row].sum()))
    batches, batch, longest = [], [], 0
    for row in rows + packed:
        size = int(lengths[row].sum())
        if batch and (len(batch) + 1) * max(longest, size) > max_tokens:
            batches.append(batch)
            batch, longest = [], 0
        batch.append(row)
        longest = max(longest, size)
    if batch:
        batches.append(batch)
    return batches


def collate_rows(windows, rows: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """A planned batch as tensors ``[B, T]`` (``T`` the longest row): ``input_ids``, ``position_ids`` (from 0 in
    every window; padding keeps counting), ``labels`` (the window's token from its first owned one on, so a target
    is scored only where it is owned; ``IGNORE_INDEX`` before, at padding and at every window's first token, which
    no token of the row may predict), ``owned`` (bool: the tokens the window owns, embedded), ``slots`` (the window's
    place in the batch, ``0..n-1`` in row order, -1 at padding) and ``doc_ids`` (``slots``, ``PAD_DOC_ID`` at
    padding). ``windows``: :class:`~ds4sci.infer.evaluate.Window` s indexed by the ids in ``rows``."""
    width = max(sum(len(windows[w].ids) for w in row) for row in rows)
    shape = (len(rows), width)
    out = {"input_ids": np.full(shape, pad_id), "labels": np.full(shape, IGNORE_INDEX), "position_ids": np.zeros(shape),
           "owned": np.zeros(shape, dtype=bool), "slots": np.full(shape, -1)}
    slot = 0
    for b, row in enumerate(rows):
        start = 0
        for w in row:
            ids, owned = windows[w].ids, windows[w].owned
            end = start + len(ids)
            out["input_ids"][b, start:end] = ids
            out["labels"][b, start + max(owned, 1) : end] = ids[max(owned, 1) :]
            out["owned"][b, start + owned : end] = True
            out["position_ids"][b, start:end] = np.arange(len(ids))
            out["slots"][b, start:end] = slot
            slot, start = slot + 1, end
        out["position_ids"][b, start:] = np.arange(width - start) + (out["position_ids"][b, start - 1] + 1)
    batch = {k: torch.from_numpy(v.astype(bool if k == "owned" else np.int64)) for k, v in out.items()}
    batch["doc_ids"] = torch.where(batch["slots"] < 0, PAD_DOC_ID, batch["slots"])
    return batch
