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

import numpy as np

from ds4sci.infer.evaluate import RecordWindows
from ds4sci.infer.evaluate import record_windows
from ds4sci.infer.evaluate import window_length
from ds4sci.infer.evaluate import window_losses
from ds4sci.infer.parallel import ShardedForward
from ds4sci.progress import progress_bar


def score_records(model, tokenizer, records: Iterable, seq_len: int | None = None, reverse_complement: bool = False,
                  *, stride: int | None = None, batch_size: int = 8, progress: bool = False,
                  runner: ShardedForward | None = None) -> list[dict]:
    """One row per record: ``id``, ``length`` (bases), ``tokens`` (targets scored, as ``evaluate`` counts them: the
    record's tokens minus one per window that does not overlap the one before it), ``log_likelihood`` (total, nats;
    the mean of both strands with ``reverse_complement``) and ``bits_per_base`` (``-log_likelihood / tokens / ln 2 /
    bases per token``; NaN when nothing is scored).

    ``records``: objects with ``id`` and ``sequence`` (:func:`ds4sci.data.read_fasta`); ``seq_len``: window length
    (default: the model's context); ``stride``: tokens between window starts (default ``seq_len``:
    :func:`~ds4sci.infer.evaluate.record_windows`); windows of every record are batched together, ``batch_size`` per
    forward.
    ``progress``: a progress bar over the windows, on a terminal only (:func:`ds4sci.progress.progress_bar`).
    ``runner``: the :class:`~ds4sci.infer.parallel.ShardedForward` of ``model`` (default: one process); across ranks
    every rank returns the rows (rank 0 draws the bar).
    """
    if reverse_complement and not hasattr(tokenizer, "reverse_complement"):
        raise ValueError(f"reverse complement needs a nucleotide model; this one reads {tokenizer.kind} tokens, and "
                         f"the reverse complement of a coding sequence is not in frame")
    seq_len = window_length(model.config, seq_len)
    strands = 2 if reverse_complement else 1
    rows, chunks, owner = [], [], []  # owner[w]: strands * record + strand of window w
    for rec in records:
        ids = tokenizer.encode(rec.sequence)
        for strand, strand_ids in enumerate([ids, tokenizer.reverse_complement(ids)] if reverse_complement else [ids]):
            pieces = record_windows(strand_ids, seq_len, stride)
            chunks += pieces
            owner += [strands * len(rows) + strand] * len(pieces)
        rows.append({"id": rec.id, "length": len(rec.sequence)})
    if not chunks:
        raise ValueError("no tokens to score")
    runner = runner or ShardedForward(model)
    with progress_bar(progress and runner.is_writer, total=len(runner.share(len(chunks))), desc="score",
                      unit="window") as bar:
        sums, counts = window_losses(model, RecordWindows(chunks, tokenizer), batch_size, bar, runner)
    n = strands * len(rows)
    loss = np.bincount(owner, weights=sums, minlength=n).reshape(-1, strands)  # [R, strands] nats
    scored = np.bincount(owner, weights=counts, minlength=n).reshape(-1, strands)[:, 0]  # [R] (both strands alike)
    for row, record_loss, tokens in zip(rows, loss.mean(1), scored):
        row.update(tokens=int(tokens), log_likelihood=0.0 - float(record_loss),
                   bits_per_base=float(record_loss) / tokens / math.log(2) / tokenizer.bases_per_token if tokens
                   else math.nan)
    return rows
