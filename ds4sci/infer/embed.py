"""Embeddings of sequences (``ds4sci embed``): one vector per record, or one per token.

A token's state is the output of a chosen layer (``layer``: block ``k`` of ``0..num_layers``, 0 the token and position
embeddings; ``None``, the default, the final norm's output, what the language-model head reads), taken once:
records longer than the window are read through the windows ``ds4sci evaluate`` uses
(:func:`ds4sci.infer.evaluate.record_windows`), each token's state from the window that owns it, so with
``stride < seq_len`` every token after the first window has at least ``seq_len - stride`` tokens of context. A short
window is padded at its end, which causal attention keeps from the real tokens before it.

- :func:`embed_records`: the mean over a record's tokens, ``[R, hidden]`` float32, the windows of every record
  batched together.
- :func:`token_embeddings`: every token's state, ``[tokens, hidden]`` float32 per record, yielded record by record;
  :func:`save_token_embeddings` writes them into an ``.npz`` one member per record (keyed by its id) as they come,
  so neither side holds more than one record's states. ``np.load`` of the file reads a member when it is indexed.

States are float32 whatever the model computes in: the difference between two embeddings of a sequence (a reference
and a variant) is about 1e-4 of their size, below half precision's resolution. Across ranks, ``runner``
(:class:`~ds4sci.infer.parallel.ShardedForward`) reads each window sequence-parallel, and the result equals one
process's.
"""
from __future__ import annotations

import zipfile
from collections.abc import Iterable
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ds4sci.infer.evaluate import RecordWindows
from ds4sci.infer.evaluate import Window
from ds4sci.infer.evaluate import record_windows
from ds4sci.infer.evaluate import window_length
from ds4sci.infer.parallel import ShardedForward
from ds4sci.progress import progress_bar


def _record_windows(model, tokenizer, records: Iterable, seq_len: int | None, stride: int | None
                    ) -> tuple[list[str], list[Window], np.ndarray]:
    """Ids of ``records``, the windows of all of them and ``owner [W]``, the record of each window.

    Raises:
        ValueError: an empty record or an id seen twice (naming it), or no record at all.
    """
    seq_len = window_length(model.config, seq_len)
    ids, seen, chunks, owner = [], set(), [], []
    for rec in records:
        if rec.id in seen:
            raise ValueError(f"record id {rec.id!r} appears twice: embeddings are keyed by id")
        seen.add(rec.id)
        tokens = tokenizer.encode(rec.sequence)
        if len(tokens) == 0:
            raise ValueError(f"record {rec.id!r}: cannot embed an empty sequence")
        pieces = record_windows(tokens, seq_len, stride)
        chunks += pieces
        owner += [len(ids)] * len(pieces)
        ids.append(rec.id)
    if not ids:
        raise ValueError("no record to embed")
    return ids, chunks, np.array(owner, dtype=np.int64)


def embed_records(model, tokenizer, records: Iterable, seq_len: int | None = None, *, stride: int | None = None,
                  batch_size: int = 8, progress: bool = False, layer: int | None = None,
                  runner: ShardedForward | None = None) -> tuple[list[str], np.ndarray]:
    """The ids of ``records`` (objects with ``id`` and ``sequence``: :func:`ds4sci.data.read_fasta`) and their
    embeddings ``[R, hidden]`` float32: each the mean state of ``layer`` over the record's tokens.

    ``seq_len``: window length (default: the model's context); ``stride``: tokens between window starts (default
    ``seq_len``); ``batch_size``: windows per forward; ``progress``: a bar over the windows, on a terminal only
    (:func:`ds4sci.progress.progress_bar`); ``runner``: one process by default (across ranks, window ``w`` is read
    by data rank ``w % dp``, and every rank returns the embeddings).

    Raises:
        ValueError: a record with no token or an id seen twice (naming it), no record at all, or ``batch_size`` < 1.
    """
    runner = runner or ShardedForward(model)
    ids, chunks, owner = _record_windows(model, tokenizer, records, seq_len, stride)
    windows = RecordWindows(chunks, tokenizer)
    sums = np.zeros((len(chunks), model.config.hidden_size))  # [W, hidden] float64
    mine = runner.share(len(chunks))
    with progress_bar(progress and runner.is_writer, total=len(mine), desc="embed", unit="window") as bar:
        for chosen, batch in runner.batches(windows, mine, batch_size):
            sums[chosen] = runner.owned_sums(batch, layer)
            bar.update(len(chosen))
    sums = runner.reduce_data(sums)
    totals = np.zeros((len(ids), sums.shape[1]))  # [R, hidden]
    np.add.at(totals, owner, sums)
    tokens = np.bincount(owner, weights=[len(c.ids) - c.owned for c in chunks], minlength=len(ids))  # [R]
    return ids, (totals / tokens[:, None]).astype(np.float32)


def token_embeddings(model, tokenizer, records: Iterable, seq_len: int | None = None, *, stride: int | None = None,
                     batch_size: int = 8, progress: bool = False, layer: int | None = None,
                     runner: ShardedForward | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """``(id, states [tokens, hidden] float32)`` of each record in order: the state of ``layer`` at every token of
    the record, each from the window that owns it (arguments as :func:`embed_records`).

    Across ranks, record ``r`` is read by data rank ``r % dp`` (its windows sequence-parallel) and its states are
    sent to rank 0: only rank 0 gets pairs, the others get none, and every rank must run the iterator to its end.
    """
    runner = runner or ShardedForward(model)
    ids, chunks, owner = _record_windows(model, tokenizer, records, seq_len, stride)
    windows = RecordWindows(chunks, tokenizer)
    bounds = np.searchsorted(owner, np.arange(len(ids) + 1))  # record r's windows: bounds[r] .. bounds[r + 1]
    tokens = np.bincount(owner, weights=[len(c.ids) - c.owned for c in chunks], minlength=len(ids)).astype(int)
    mine = set(runner.share(len(ids)))
    with progress_bar(progress and runner.is_writer, total=len(ids), desc="embed", unit="record") as bar:
        for r, name in enumerate(ids):
            states = None
            if r in mine:
                states = np.concatenate([s for _, batch in runner.batches(windows, range(bounds[r], bounds[r + 1]),
                                                                          batch_size)
                                         for s in runner.owned_states(batch, layer)])  # [tokens, hidden]
            states = runner.to_writer(states, r, (int(tokens[r]), model.config.hidden_size))
            bar.update(1)
            if states is not None:
                yield name, states


def save_token_embeddings(path: str | Path, items: Iterable[tuple[str, np.ndarray]]) -> int:
    """Write ``(id, states)`` pairs into the ``.npz`` at ``path``, one float32 member ``id`` per pair (the zip format
    numpy's ``savez`` writes, uncompressed; ``np.load(path)[id]`` reads one member), each in the file before the
    next pair is asked for: closing a member seeks back to complete its header, which flushes it. Returns the number
    of members.

    Raises:
        ValueError: an id seen twice (naming it).
    """
    count, seen = 0, set()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for key, states in items:
            if key in seen:
                raise ValueError(f"record id {key!r} appears twice: embeddings are keyed by id")
            seen.add(key)
            with archive.open(f"{key}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.ascontiguousarray(states, dtype=np.float32))
            count += 1
    return count
