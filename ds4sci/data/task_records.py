"""Labelled records as model inputs for fine-tuning and prediction: :class:`TaskRecords` tokenizes each record
into a window of ``seq_len`` tokens, right-padded, with its real-token mask and its label.

A record longer than ``seq_len`` tokens is refused (a sequence label read from part of a record would be silently
wrong): raise ``data.seq_len`` or cut the records first. Per-base labels become per-token labels: with nucleotide
tokens one each; with codon tokens each codon takes the most common label of its three bases (ties: the
smallest class), and a trailing partial codon is dropped as the tokenizer drops it.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from ds4sci.data.tokenizers import Tokenizer

IGNORE_INDEX = -100  # a label the loss skips (padding; filler records): PyTorch's default, as the LM's


def token_labels(base_labels: np.ndarray, bases_per_token: int) -> np.ndarray:
    """Per-base class ids ``[L]`` -> per-token ``[L // bases_per_token]``: the most common class of each token's
    bases (ties: the smallest)."""
    base_labels = np.asarray(base_labels, dtype=np.int64)
    if bases_per_token == 1:
        return base_labels
    n = len(base_labels) // bases_per_token
    groups = base_labels[: n * bases_per_token].reshape(n, bases_per_token)  # [tokens, bases per token]
    counts = (groups[:, :, None] == np.arange(groups.max(initial=0) + 1)).sum(1)  # [tokens, classes]
    return counts.argmax(1)


class TaskRecords(torch.utils.data.Dataset):
    """``records``: ``(id, sequence, target)`` triples (a target as :class:`ds4sci.data.labels.LabelledRecord`
    holds it: an int, a tuple of 0/1 or floats, or a per-base int array). Item ``i``: ``input_ids [T]`` (int64,
    padded with the tokenizer's pad id), ``mask [T]`` (bool, real tokens), ``labels``: ``[]`` int64 (binary,
    multi-class), ``[L]`` float32 (multi-label, regression), ``[T]`` int64 (token; -100 at padding).

    Raises:
        ValueError: a record longer than ``seq_len`` tokens, or empty (naming it).
    """

    def __init__(self, records: Sequence[tuple[str, str, object]], tokenizer: Tokenizer, seq_len: int, kind: str):
        self.ids = [r[0] for r in records]
        self.kind, self.seq_len = kind, seq_len
        self.input_ids = torch.full((len(records), seq_len), tokenizer.pad_id, dtype=torch.long)
        self.mask = torch.zeros(len(records), seq_len, dtype=torch.bool)
        labels = []
        for i, (rid, sequence, target) in enumerate(records):
            ids = tokenizer.encode(sequence)
            if not 0 < len(ids) <= seq_len:
                raise ValueError(f"record {rid!r}: {len(ids)} tokens; a fine-tuning record needs 1 to data.seq_len="
                                 f"{seq_len} (raise data.seq_len or cut the records)")
            self.input_ids[i, : len(ids)] = torch.from_numpy(ids)
            self.mask[i, : len(ids)] = True
            if kind == "token":
                row = torch.full((seq_len,), IGNORE_INDEX, dtype=torch.long)
                row[: len(ids)] = torch.from_numpy(token_labels(target, tokenizer.bases_per_token)[: len(ids)])
                labels.append(row)
            elif kind in ("binary", "multiclass"):
                labels.append(torch.tensor(int(target)))
            else:
                labels.append(torch.tensor(np.atleast_1d(np.asarray(target, dtype=np.float32))))
        self.labels = torch.stack(labels) if labels else torch.zeros(0)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "mask": self.mask[i], "labels": self.labels[i]}


def unlabelled(item: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``item`` with its label removed (-100, or NaN for float labels): fills a last, partial evaluation batch."""
    labels = item["labels"]
    empty = torch.full_like(labels, math.nan) if labels.is_floating_point() else torch.full_like(labels, IGNORE_INDEX)
    return {**item, "labels": empty}
