"""Loss, perplexity and bits per base of a model over the real tokens of a FASTA file (``ds4sci evaluate``).

Every record is read through windows of ``seq_len`` tokens that start every ``stride`` tokens (:func:`record_windows`;
the scheme of Hugging Face's strided perplexity). Each token is scored once, in the first window that holds it; a
record's first token has no context and is not scored, nor is any window's first token, and padding never counts.

- ``stride = seq_len`` (the default): consecutive windows that do not overlap. A window's first token is then
  context only, and the tokens early in a window see few tokens before them.
- ``stride < seq_len``: windows overlap by ``seq_len - stride`` tokens. Every token after the first window is scored
  with at least ``seq_len - stride`` tokens of context and every token but the record's first is scored; the cost is
  ``seq_len / stride`` times the forward passes.

A record that fits in one window scores the same with any stride. ``ds4sci score`` and ``ds4sci embed``
(:mod:`ds4sci.infer.score`, :mod:`ds4sci.infer.embed`) read records through the same windows, so a file's
token-weighted mean of its records' scores is this loss. Perplexity is ``exp`` of the full mean loss; bits per
base = loss (nats/token) / ln 2 / bases per token (a uniform model over A/C/G/T scores 2.0).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from ds4sci.data import RecordDataset
from ds4sci.data import read_fasta
from ds4sci.infer.parallel import ShardedForward
from ds4sci.models.genslm import IGNORE_INDEX


def window_length(model_config, seq_len: int | None = None) -> int:
    """The window length: ``seq_len``, or the model's context when None (beyond the context: ``ValueError``)."""
    limit = model_config.max_position_embeddings
    if seq_len is None:
        return limit
    if not 1 <= seq_len <= limit:
        raise ValueError(f"seq_len={seq_len} must be between 1 and the model's context of {limit} tokens")
    return seq_len


def window_stride(seq_len: int, stride: int | None = None) -> int:
    """The stride between window starts: ``stride``, or ``seq_len`` (consecutive windows) when None.

    Raises:
        ValueError: ``stride`` outside ``1..seq_len`` (naming both).
    """
    if stride is None:
        return seq_len
    if not 1 <= stride <= seq_len:
        raise ValueError(f"stride={stride} must be between 1 and the window length seq_len={seq_len}")
    return stride


class Window(NamedTuple):
    """A window of a record: its token ids ``[T]`` and ``owned``, the index of its first token that no earlier
    window of the record holds (0 in the first window; in later ones the overlap, ``seq_len - stride``)."""

    ids: np.ndarray
    owned: int


def record_windows(ids: np.ndarray, seq_len: int, stride: int | None = None) -> list[Window]:
    """A record's token ids ``[L]`` as windows of at most ``seq_len`` tokens starting at ``0, stride, 2*stride, ...``
    up to the first that reaches the record's end (none when ``L == 0``); ``stride`` defaults to ``seq_len``.

    Window ``k`` holds ``ids[k*stride : k*stride + seq_len]`` and owns the tokens from the end of window ``k-1`` on,
    so every token is owned by exactly one window, with at least ``seq_len - stride`` tokens before it in that window
    (or all the tokens before it in the record). Hugging Face's strided perplexity uses the same windows."""
    stride = window_stride(seq_len, stride)
    out, end = [], 0
    for start in range(0, len(ids), stride):
        window = ids[start : start + seq_len]
        out.append(Window(window, end - start))
        end = start + len(window)
        if end == len(ids):
            break
    return out


class RecordWindows(RecordDataset):
    """Windows (:func:`record_windows`) as samples padded to the longest window (not to the model's context: records
    shorter than a long context cost their own length), each labelled from its first owned token on: earlier
    tokens are context, neither scored nor embedded."""

    def __init__(self, windows: list[Window], tokenizer):
        super().__init__([w.ids for w in windows], tokenizer, max(len(w.ids) for w in windows))
        self.owned = [w.owned for w in windows]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        sample = super().__getitem__(i)
        sample["labels"][: self.owned[i]] = IGNORE_INDEX
        return sample


def windows(model_config, tokenizer, fasta: str, seq_len: int | None = None,
            stride: int | None = None) -> RecordWindows:
    """The windows (:func:`record_windows`) of every record of ``fasta``."""
    seq_len = window_length(model_config, seq_len)
    chunks = [w for rec in read_fasta(fasta) for w in record_windows(tokenizer.encode(rec.sequence), seq_len, stride)]
    if not chunks:
        raise ValueError(f"{fasta}: no tokens to evaluate")
    return RecordWindows(chunks, tokenizer)


def window_losses(model, dataset, batch_size: int = 8, progress=None,
                  runner: ShardedForward | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Summed next-token loss (nats) ``[W]`` float64 and real target count ``[W]`` int64 of each window of
    ``dataset``, in order, on every rank; ``progress`` (a tqdm bar or None) is advanced by this rank's windows.

    ``runner``: the :class:`~ds4sci.infer.parallel.ShardedForward` of ``model`` (default: one process); across ranks,
    window ``w`` is read by data rank ``w % dp``, sequence-parallel within it, ``batch_size`` windows per forward
    (several batches at once on the CPU: :meth:`~ds4sci.infer.parallel.ShardedForward.map_batches`)."""
    runner = runner or ShardedForward(model)
    sums, counts = np.zeros(len(dataset)), np.zeros(len(dataset), dtype=np.int64)
    mine = runner.share(len(dataset))
    batches = runner.batches(dataset, mine, batch_size)
    for (chosen, _), both in runner.map_batches(lambda pair: runner.losses(pair[1]), batches,
                                                -(-len(mine) // batch_size)):
        sums[chosen], counts[chosen] = both
        if progress is not None:
            progress.update(len(chosen))
    return runner.reduce_data(sums), runner.reduce_data(counts)


def evaluate(model, tokenizer, dataset, batch_size: int = 8,
             runner: ShardedForward | None = None) -> dict[str, float]:
    """Mean next-token loss over the real targets of ``dataset``; perplexity; bits per base (``runner``: as
    :func:`window_losses`; every rank returns the result)."""
    sums, counts = window_losses(model, dataset, batch_size, runner=runner)
    count = int(counts.sum())
    if count == 0:
        raise ValueError("no real target token to evaluate")
    loss = float(sums.sum()) / count
    return {"loss": loss, "perplexity": math.exp(loss), "bits_per_base": loss / math.log(2) / tokenizer.bases_per_token,
            "tokens": count}
