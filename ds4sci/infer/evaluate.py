"""Loss, perplexity and bits per base of a model over the real tokens of a FASTA file (``ds4sci evaluate``).

Every record is cut into consecutive non-overlapping windows of ``seq_len`` tokens (the last one padded), so each
token is scored at most once; a window's first token has no context and is not scored; padding never counts, and
perplexity is ``exp`` of the full mean loss. ``ds4sci score`` (:mod:`ds4sci.infer.score`) scores each record through
the same windows (:func:`record_windows`, :func:`window_losses`), so a file's token-weighted mean of its records'
scores is this loss.
Bits per base = loss (nats/token) / ln 2 / bases per token (a uniform model over A/C/G/T scores 2.0).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ds4sci.data import RecordDataset, collate, read_fasta
from ds4sci.models.genslm import IGNORE_INDEX, shift_labels, token_loss


def window_length(model_config, seq_len: int | None = None) -> int:
    """The window length: ``seq_len``, or the model's context when None (beyond the context: ``ValueError``)."""
    limit = model_config.max_position_embeddings
    if seq_len is None:
        return limit
    if not 1 <= seq_len <= limit:
        raise ValueError(f"seq_len={seq_len} must be between 1 and the model's context of {limit} tokens")
    return seq_len


def record_windows(ids: np.ndarray, seq_len: int) -> list[np.ndarray]:
    """A record's token ids ``[L]`` as consecutive windows of at most ``seq_len`` tokens (none when ``L == 0``)."""
    return [ids[s : s + seq_len] for s in range(0, len(ids), seq_len)]


def window_dataset(chunks: list[np.ndarray], tokenizer) -> RecordDataset:
    """Windows ``[w_i]`` (from :func:`record_windows`) as one padded sample each, padded to the longest window, not
    to the model's context: records shorter than a long context cost their own length."""
    return RecordDataset(chunks, tokenizer, max(len(c) for c in chunks))


def windows(model_config, tokenizer, fasta: str, seq_len: int | None = None) -> RecordDataset:
    """Consecutive windows of every record of ``fasta`` (padded at the end of each record)."""
    seq_len = window_length(model_config, seq_len)
    chunks = [w for rec in read_fasta(fasta) for w in record_windows(tokenizer.encode(rec.sequence), seq_len)]
    if not chunks:
        raise ValueError(f"{fasta}: no tokens to evaluate")
    return window_dataset(chunks, tokenizer)


@torch.no_grad()
def window_losses(model, dataset, batch_size: int = 8, progress=None) -> tuple[np.ndarray, np.ndarray]:
    """Summed next-token loss (nats) ``[W]`` float64 and real target count ``[W]`` int64 of each window of
    ``dataset``, in order; ``progress`` (a tqdm bar or None) is advanced by the windows done."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    sums, counts = np.zeros(len(dataset)), np.zeros(len(dataset), dtype=np.int64)
    for start in range(0, len(dataset), batch_size):
        stop = min(len(dataset), start + batch_size)
        batch = collate([dataset[i] for i in range(start, stop)])
        logits = model(batch["input_ids"], batch["position_ids"])  # [B, T, V]
        targets = shift_labels(batch["labels"])  # [B, T]
        sums[start:stop] = [token_loss(logits[b : b + 1], targets[b : b + 1], "sum").item()
                            for b in range(stop - start)]
        counts[start:stop] = (targets != IGNORE_INDEX).sum(1).numpy()
        if progress is not None:
            progress.update(stop - start)
    return sums, counts


def evaluate(model, tokenizer, dataset, batch_size: int = 8) -> dict[str, float]:
    """Mean next-token loss over the real targets of ``dataset``; perplexity; bits per base."""
    sums, counts = window_losses(model, dataset, batch_size)
    count = int(counts.sum())
    if count == 0:
        raise ValueError("no real target token to evaluate")
    loss = float(sums.sum()) / count
    return {"loss": loss, "perplexity": math.exp(loss), "bits_per_base": loss / math.log(2) / tokenizer.bases_per_token,
            "tokens": count}
