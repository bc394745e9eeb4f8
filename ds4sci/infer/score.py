"""The log-likelihood of every record of a FASTA file (``ds4sci score``).

The per-sequence score genome language models are used for in variant-effect prediction and ranking (the
sequence likelihood of Meier et al. 2021 and Evo 2's ``score_sequences``): a record's total next-token
log-likelihood ``sum_t log p(x_t | x_<t)`` in nats, and its mean in bits per base. A record is read through the
windows ``ds4sci evaluate`` uses (:mod:`ds4sci.infer.evaluate`: windows of ``seq_len`` tokens every ``stride`` tokens,
each token scored once), so a file's token-weighted mean of ``-log_likelihood / tokens`` is ``evaluate``'s loss.

``reverse_complement`` (nucleotide models) scores both strands and averages their log-likelihoods, as Evo 2 does for
strand-symmetric scores. A codon model refuses it: the reverse complement of a coding sequence is not a coding
sequence in frame (its codons are other codons read backwards), so its likelihood under a model trained on genes in
frame says nothing about the gene.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from collections.abc import Iterator

import numpy as np

from ds4sci.infer.evaluate import window_length
from ds4sci.infer.parallel import ShardedForward
from ds4sci.infer.records import item_windows
from ds4sci.infer.records import my_items
from ds4sci.infer.records import read_items
from ds4sci.infer.records import token_budget
from ds4sci.progress import record_progress


def score_stream(model, tokenizer, records: Iterable, seq_len: int | None = None, reverse_complement: bool = False,
                 *, stride: int | None = None, batch_size: int = 8, max_tokens: int | None = None, pack: bool = False,
                 skip: Iterable[int] = (), progress=None, runner: ShardedForward | None = None
                 ) -> Iterator[tuple[int, dict]]:
    """``(index, row)`` for the records this data rank reads (:func:`~ds4sci.infer.records.my_items`: dealt by token
    count), in the order they complete; ``index`` is the record's place in ``records``, ``row`` as
    :func:`score_records`. Records whose index is in ``skip`` are not yielded (they are dealt and batched as without
    ``skip``, so the others' numbers do not change; :func:`~ds4sci.infer.records.read_items`). ``max_tokens``:
    tokens per forward (default ``batch_size`` full windows); ``pack``: short records several to a row; ``progress``:
    ``progress(records, tokens)`` after each forward (:func:`~ds4sci.infer.records.read_items`).

    Raises:
        ValueError: ``reverse_complement`` with a codon model, a bad window, stride or budget (naming it).
    """
    if reverse_complement and not hasattr(tokenizer, "reverse_complement"):
        raise ValueError(f"reverse complement needs a nucleotide model; this one reads {tokenizer.kind} tokens, and "
                         f"the reverse complement of a coding sequence is not in frame")
    seq_len = window_length(model.config, seq_len)
    budget = token_budget(max_tokens, batch_size, seq_len)
    runner = runner or ShardedForward(model)
    strands = 2 if reverse_complement else 1
    heads, strand_ids = [], []
    for r, rec in enumerate(records):
        heads.append((r, rec.id, len(rec.sequence)))
        ids = tokenizer.encode(rec.sequence)
        strand_ids += [ids, tokenizer.reverse_complement(ids)] if reverse_complement else [ids]
    windows, owner = item_windows(strand_ids, seq_len, stride)
    items = my_items(runner, np.array([len(strand_ids[strands * r]) for r in range(len(heads))]), strands)
    skip = {strands * r + k for r in skip for k in range(strands)}
    done: dict[int, list] = {}

    def counted(n_items: int, tokens: int) -> None:
        if progress is not None:
            progress(n_items / strands, tokens)

    for item, (nats, scored) in read_items(runner, windows, owner, items, "loss", max_tokens=budget,
                                           row_len=seq_len, pad_id=tokenizer.pad_id, layer=None,
                                           pack=pack, skip=skip, progress=counted):
        r = item // strands
        done.setdefault(r, [None] * strands)[item % strands] = (nats, scored)
        if all(part is not None for part in done[r]):
            parts = done.pop(r)
            loss = sum(p[0] for p in parts) / strands  # nats, the mean of both strands
            tokens = parts[0][1]
            _, name, length = heads[r]
            yield r, {"id": name, "length": length, "tokens": tokens, "log_likelihood": 0.0 - loss,
                      "bits_per_base": loss / tokens / math.log(2) / tokenizer.bases_per_token if tokens
                      else math.nan}


def score_records(model, tokenizer, records: Iterable, seq_len: int | None = None, reverse_complement: bool = False,
                  *, stride: int | None = None, batch_size: int = 8, max_tokens: int | None = None, pack: bool = False,
                  progress: bool = False, runner: ShardedForward | None = None) -> list[dict]:
    """One row per record: ``id``, ``length`` (bases), ``tokens`` (targets scored, as ``evaluate`` counts them: the
    record's tokens minus one per window that does not overlap the one before it), ``log_likelihood`` (total, nats;
    the mean of both strands with ``reverse_complement``) and ``bits_per_base`` (``-log_likelihood / tokens / ln 2 /
    bases per token``; NaN when nothing is scored).

    ``records``: objects with ``id`` and ``sequence`` (:func:`ds4sci.data.read_fasta`); ``seq_len``: window length
    (default: the model's context); ``stride``: tokens between window starts (default ``seq_len``:
    :func:`~ds4sci.infer.evaluate.record_windows`); windows of every record are batched together by length,
    ``max_tokens`` per forward (default ``batch_size`` full windows), short records packed several to a row
    (``pack``; :mod:`ds4sci.infer.records`).
    ``progress``: a progress display over the records (:func:`ds4sci.progress.record_progress`).
    ``runner``: the :class:`~ds4sci.infer.parallel.ShardedForward` of ``model`` (default: one process); across ranks
    every rank returns the rows (rank 0 shows progress).
    """
    records = list(records)
    runner = runner or ShardedForward(model)
    rows = [{"id": rec.id, "length": len(rec.sequence)} for rec in records]
    values = np.zeros((3, len(rows)))  # log-likelihood, tokens, bits per base
    with record_progress(progress and runner.is_writer, "score", len(rows)) as shown:
        for r, row in score_stream(model, tokenizer, records, seq_len, reverse_complement, stride=stride,
                                   batch_size=batch_size, max_tokens=max_tokens, pack=pack, progress=shown,
                                   runner=runner):
            values[:, r] = row["log_likelihood"], row["tokens"], row["bits_per_base"]
    if not rows:
        raise ValueError("no tokens to score")
    values = runner.reduce_data(values)
    for row, (ll, tokens, bpb) in zip(rows, values.T):
        row.update(tokens=int(tokens), log_likelihood=float(ll), bits_per_base=float(bpb) if tokens else math.nan)
    return rows
