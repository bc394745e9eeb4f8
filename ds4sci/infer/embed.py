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

from ds4sci.infer.batching import deal
from ds4sci.infer.evaluate import window_length
from ds4sci.infer.parallel import ShardedForward
from ds4sci.infer.records import item_windows
from ds4sci.infer.records import my_items
from ds4sci.infer.records import read_items
from ds4sci.infer.records import token_budget
from ds4sci.progress import record_progress


def _record_tokens(tokenizer, records: Iterable) -> tuple[list[str], list[np.ndarray]]:
    """Ids of ``records`` and their token ids.

    Raises:
        ValueError: an empty record or an id seen twice (naming it), or no record at all.
    """
    ids, seen, tokens = [], set(), []
    for rec in records:
        if rec.id in seen:
            raise ValueError(f"record id {rec.id!r} appears twice: embeddings are keyed by id")
        seen.add(rec.id)
        ids.append(rec.id)
        tokens.append(tokenizer.encode(rec.sequence))
        if len(tokens[-1]) == 0:
            raise ValueError(f"record {rec.id!r}: cannot embed an empty sequence")
    if not ids:
        raise ValueError("no record to embed")
    return ids, tokens


def embed_stream(model, tokenizer, records: Iterable, seq_len: int | None = None, *, stride: int | None = None,
                 batch_size: int = 8, max_tokens: int | None = None, pack: bool = False, layer: int | None = None,
                 per_token: bool = False, skip: Iterable[int] = (), progress=None,
                 runner: ShardedForward | None = None) -> Iterator[tuple[int, str, np.ndarray]]:
    """``(index, id, embedding)`` for the records this data rank reads (dealt by token count,
    :func:`~ds4sci.infer.records.my_items`), in the order they complete: the mean state ``[hidden]`` float32, or
    with ``per_token`` every token's ``[tokens, hidden]``. Records whose index is in ``skip`` are not yielded (as
    :func:`ds4sci.infer.score.score_stream`).
    ``max_tokens``, ``pack``, ``progress``: as :func:`ds4sci.infer.score.score_stream`; others as
    :func:`embed_records`.

    Raises:
        ValueError: a record with no token or an id seen twice (naming it), no record at all, a bad budget.
    """
    seq_len = window_length(model.config, seq_len)
    budget = token_budget(max_tokens, batch_size, seq_len)
    runner = runner or ShardedForward(model)
    ids, tokens = _record_tokens(tokenizer, records)
    windows, owner = item_windows(tokens, seq_len, stride)
    items = my_items(runner, np.array([len(t) for t in tokens], dtype=np.int64))
    for r, value in read_items(runner, windows, owner, items, "states" if per_token else "sum", max_tokens=budget,
                               row_len=seq_len, pad_id=tokenizer.pad_id, pack=pack, layer=layer, skip=skip,
                               progress=progress):
        yield r, ids[r], value if per_token else (value[0] / value[1]).astype(np.float32)


def embed_records(model, tokenizer, records: Iterable, seq_len: int | None = None, *, stride: int | None = None,
                  batch_size: int = 8, max_tokens: int | None = None, pack: bool = False, progress: bool = False,
                  layer: int | None = None, runner: ShardedForward | None = None) -> tuple[list[str], np.ndarray]:
    """The ids of ``records`` (objects with ``id`` and ``sequence``: :func:`ds4sci.data.read_fasta`) and their
    embeddings ``[R, hidden]`` float32: each the mean state of ``layer`` over the record's tokens.

    ``seq_len``: window length (default: the model's context); ``stride``: tokens between window starts (default
    ``seq_len``); windows batched by length, ``max_tokens`` per forward (default ``batch_size`` full windows),
    short records packed several to a row (``pack``: :mod:`ds4sci.infer.records`); ``progress``: a display over
    the records (:func:`ds4sci.progress.record_progress`); ``runner``: one process by default (across ranks,
    records are dealt over the data ranks by token count, and every rank returns the embeddings).

    Raises:
        ValueError: a record with no token or an id seen twice (naming it), no record at all, or ``batch_size`` < 1.
    """
    records = list(records)
    runner = runner or ShardedForward(model)
    ids, vectors = [rec.id for rec in records], None
    with record_progress(progress and runner.is_writer, "embed", len(records)) as shown:
        for r, _, vector in embed_stream(model, tokenizer, records, seq_len, stride=stride, batch_size=batch_size,
                                         max_tokens=max_tokens, pack=pack, layer=layer, progress=shown,
                                         runner=runner):
            if vectors is None:
                vectors = np.zeros((len(records), len(vector)))
            vectors[r] = vector
    vectors = runner.reduce_data(vectors if vectors is not None else np.zeros((len(ids), model.config.hidden_size)))
    return ids, vectors.astype(np.float32)


def token_embeddings(model, tokenizer, records: Iterable, seq_len: int | None = None, *, stride: int | None = None,
                     batch_size: int = 8, max_tokens: int | None = None, progress: bool = False,
                     layer: int | None = None, runner: ShardedForward | None = None
                     ) -> Iterator[tuple[str, np.ndarray]]:
    """``(id, states [tokens, hidden] float32)`` of each record in order: the state of ``layer`` at every token of
    the record, each from the window that owns it (arguments as :func:`embed_records`).

    Across ranks, records are dealt over the data ranks by token count, each read in turn by its data rank (its
    windows sequence-parallel) and sent to rank 0: only rank 0 gets pairs, the others get none, and every rank must
    run the iterator to its end.
    """
    seq_len = window_length(model.config, seq_len)
    budget = token_budget(max_tokens, batch_size, seq_len)
    runner = runner or ShardedForward(model)
    ids, tokens = _record_tokens(tokenizer, records)
    part = deal([len(t) for t in tokens], runner.dims.dp)
    with record_progress(progress and runner.is_writer, "embed", len(ids)) as shown:
        for r, name in enumerate(ids):
            states = None
            if part[r] == runner.data_rank:
                windows, owner = item_windows([tokens[r]], seq_len, stride)
                (_, states), = read_items(runner, windows, owner, [0], "states", max_tokens=budget, row_len=seq_len,
                                          pad_id=tokenizer.pad_id, layer=layer)
            states = runner.to_writer(states, int(part[r]), (len(tokens[r]), model.config.hidden_size))
            shown(1, len(tokens[r]))
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
