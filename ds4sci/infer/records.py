"""Many records read through a model: windows batched by length, records dealt over data ranks by token count,
results yielded record by record as each is complete (``ds4sci score`` and ``ds4sci embed``).

An *item* is what one result belongs to (a record, or one strand of it for ``score --reverse-complement``); its
windows (:func:`~ds4sci.infer.evaluate.record_windows`) are consecutive in the window list. :func:`item_windows`
cuts them; :func:`my_items` deals items over the data ranks of a :class:`~ds4sci.infer.parallel.ShardedForward`
(:func:`~ds4sci.infer.batching.deal`: longest first onto the least loaded rank, the items of one record together);
:func:`read_items` reads this rank's items in the batches :func:`~ds4sci.infer.batching.plan_batches` plans
(``max_tokens`` per forward, the short windows batched by length after the full ones, or packed several to a row
with document masks; no packing across sequence ranks; per-token states keep an item's windows together, so little
is held) and yields each item's result as soon as its last window is read; on the CPU several batches are read at
once (:meth:`~ds4sci.infer.parallel.ShardedForward.map_batches`), their results taken in plan order. Numbers equal
one window at a time up to float32 summation order: every window keeps its own positions, and attention never
leaves its document.
"""
from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Iterator

import numpy as np

from ds4sci.infer.batching import collate_rows
from ds4sci.infer.batching import deal
from ds4sci.infer.batching import plan_batches
from ds4sci.infer.evaluate import Window
from ds4sci.infer.evaluate import record_windows
from ds4sci.infer.parallel import ShardedForward

__all__ = ["item_windows", "my_items", "read_items", "token_budget"]


def token_budget(max_tokens: int | None, batch_size: int, seq_len: int) -> int:
    """Tokens per forward: ``max_tokens`` (``--max-tokens-per-batch``), or ``batch_size`` full windows.

    Raises:
        ValueError: ``max_tokens`` or ``batch_size`` < 1.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens_per_batch must be >= 1, got {max_tokens}")
    return max_tokens if max_tokens is not None else batch_size * seq_len


def item_windows(token_ids: Iterable[np.ndarray], seq_len: int, stride: int | None) -> tuple[list[Window], np.ndarray]:
    """The windows of every item (token ids ``[L]`` each) and ``owner [W]``, the item of each window."""
    windows, owner = [], []
    for i, ids in enumerate(token_ids):
        pieces = record_windows(ids, seq_len, stride)
        windows += pieces
        owner += [i] * len(pieces)
    return windows, np.array(owner, dtype=np.int64)


def my_items(runner: ShardedForward, sizes: np.ndarray, per_record: int = 1) -> np.ndarray:
    """The items this data rank reads, sorted: records (``sizes [R]`` tokens each) dealt over the data ranks by
    :func:`~ds4sci.infer.batching.deal`, record ``r`` being items ``per_record * r + k`` for ``k < per_record``."""
    part = deal(sizes, runner.dims.dp)
    records = np.flatnonzero(part == runner.data_rank)
    return (records[:, None] * per_record + np.arange(per_record)).ravel()


def read_items(runner: ShardedForward, windows: list[Window], owner: np.ndarray, items: Iterable[int], what: str, *,
               max_tokens: int, row_len: int, pad_id: int, pack: bool = False, layer: int | None = None,
               skip: Iterable[int] = (), progress=None) -> Iterator[tuple[int, object]]:
    """``(item, result)`` for each of ``items``, in the order they complete (every rank of a sequence group must
    read the same items). ``what``: ``"loss"``, result ``(nats, scored targets)`` (float, int); ``"sum"``,
    ``(summed states [hidden] float64, owned tokens)``; ``"states"``, ``[tokens, hidden]`` float32. An item with no
    window gives ``(0.0, 0)``, ``(None, 0)`` or None at once. ``progress`` (or None): called as
    ``progress(items, tokens)`` after each batch with the items completed and tokens read. Items in ``skip`` (done
    by an earlier run) are planned with the others but not yielded, and a batch of theirs alone is not read: the
    others are batched as in a run without ``skip``, so their numbers are the same to the last bit.

    Raises:
        ValueError: an unknown ``what`` (from :meth:`~ds4sci.infer.parallel.ShardedForward.read_slots`).
    """
    items, skip = np.asarray(sorted(items), dtype=np.int64), set(skip)
    chosen = np.flatnonzero(np.isin(owner, items))  # [w] this rank's windows, in order
    left = dict(zip(*np.unique(owner[chosen], return_counts=True)))
    for item in items:
        if int(item) not in left and int(item) not in skip:
            yield int(item), {"loss": (0.0, 0), "sum": (None, 0), "states": None}[what]
    lengths = np.array([len(windows[w].ids) for w in chosen], dtype=np.int64)
    # per-token states are held until their item is complete: only they keep an item's windows together
    plan = plan_batches(lengths, owner[chosen], max_tokens, row_len, pack and runner.dims.sp == 1,
                        together=what == "states")
    parts: dict[int, list] = {}
    owned = np.bincount(owner[chosen], weights=[len(windows[w].ids) - windows[w].owned for w in chosen],
                        minlength=int(owner.max(initial=-1)) + 1).astype(np.int64)  # [items] tokens embedded
    batches = ([[int(chosen[i]) for i in row] for row in planned] for planned in plan)
    wanted = (rows for rows in batches if not all(int(owner[w]) in skip for row in rows for w in row))
    for rows, out in runner.map_batches(lambda rows: runner.read_slots(collate_rows(windows, rows, pad_id), what,
                                                                       layer, row_len), wanted, len(plan)):
        done = []
        for slot, w in enumerate(w for row in rows for w in row):
            item = int(owner[w])
            value = (out[0][slot], out[1][slot]) if what == "loss" else out[slot]
            parts.setdefault(item, []).append((w, value))
            left[item] -= 1
            if left[item] == 0 and item not in skip:
                done.append(item)
        for item in done:
            pieces = [value for _, value in sorted(parts.pop(item), key=lambda p: p[0])]
            if what == "loss":
                yield item, (float(sum(p[0] for p in pieces)), int(sum(p[1] for p in pieces)))
            elif what == "sum":
                yield item, (np.sum(pieces, axis=0), int(owned[item]))
            else:
                yield item, np.concatenate(pieces)
        if progress is not None:
            progress(len(done), int(sum(len(windows[w].ids) for row in rows for w in row)))
