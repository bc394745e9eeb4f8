"""Datasets for causal genome LMs: windows over long genomes, one record per sample, packed records.

Every sample is a dict of int64 tensors of length ``T`` (the window):

- ``input_ids [T]``: token ids, ``pad_id`` after the end of the data;
- ``labels [T]``: the ids the model should reproduce, aligned with ``input_ids`` (GPT convention: the one-token
  shift is done in the loss, ``logits[t]`` predicts ``labels[t + 1]``); ``IGNORE_INDEX`` (-100) at padding and at the
  first token of every packed document after the first, so no prediction crosses a document boundary;
- ``position_ids [T]``: positions inside the document (restart at 0 for each packed document);
- ``doc_ids [T]``: document index inside the window, ``PAD_DOC_ID`` (-1) at padding (both from ``ds4sci.models``).

Train/validation splits are deterministic: a single genome is split by held-out region (the last
``val_fraction`` of the sequence, so no window spans both splits), a multi-record file by record.
"""
from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from ds4sci.data.tokenizers import NucleotideTokenizer, Tokenizer
from ds4sci.models.genslm import IGNORE_INDEX
from ds4sci.models.local_attention import PAD_DOC_ID

logger = logging.getLogger(__name__)


def _sample(tokens: list[np.ndarray], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Lay documents ``tokens`` (total length <= seq_len) into one padded window."""
    input_ids = np.full(seq_len, pad_id, dtype=np.int64)
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
    position_ids = np.zeros(seq_len, dtype=np.int64)
    doc_ids = np.full(seq_len, PAD_DOC_ID, dtype=np.int64)
    start = 0
    for d, doc in enumerate(tokens):
        end = start + len(doc)
        input_ids[start:end] = doc
        labels[start:end] = doc
        if d > 0:
            labels[start] = IGNORE_INDEX  # would be predicted from the previous document
        position_ids[start:end] = np.arange(len(doc))
        doc_ids[start:end] = d
        start = end
    if start < seq_len:  # padding positions keep counting so position tables see in-range ids
        position_ids[start:] = np.arange(seq_len - start) + (position_ids[start - 1] + 1 if start else 0)
    return {
        "input_ids": torch.from_numpy(input_ids),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(position_ids),
        "doc_ids": torch.from_numpy(doc_ids),
    }


class _Augment:
    def __init__(self, tokenizer: Tokenizer, reverse_complement: float, seed: int):
        if not 0.0 <= reverse_complement <= 1.0:
            raise ValueError(f"reverse_complement probability must be in [0, 1], got {reverse_complement}")
        if reverse_complement and not isinstance(tokenizer, NucleotideTokenizer):
            raise ValueError(
                f"reverse-complement augmentation needs nucleotide tokens (it would break the reading frame of "
                f"{tokenizer.kind} tokens)"
            )
        self.tokenizer, self.p, self.seed, self.epoch = tokenizer, reverse_complement, seed, 0

    def __call__(self, ids: np.ndarray, index: int) -> np.ndarray:
        if not self.p:
            return ids
        rng = np.random.default_rng((self.seed, self.epoch, index))
        return self.tokenizer.reverse_complement(ids) if rng.random() < self.p else ids


class WindowDataset(Dataset):
    """Fixed-length windows with a stride over the token arrays of long sequences (genomes).

    Windows never cross a record boundary; a record's last window is padded. ``reverse_complement`` is the
    probability of flipping a window to its reverse complement (nucleotide tokens only), drawn from
    ``(seed, epoch, index)`` so runs are reproducible; call :meth:`set_epoch` to draw anew.
    """

    def __init__(self, token_arrays: Sequence[np.ndarray], tokenizer: Tokenizer, seq_len: int,
                 stride: int | None = None, *, reverse_complement: float = 0.0, seed: int = 0):
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}")
        stride = seq_len if stride is None else stride
        if not 1 <= stride <= seq_len:
            raise ValueError(f"stride must be in [1, seq_len={seq_len}], got {stride}")
        self.arrays, self.tokenizer, self.seq_len = list(token_arrays), tokenizer, seq_len
        self.augment = _Augment(tokenizer, reverse_complement, seed)
        self.index: list[tuple[int, int]] = []  # (array, start)
        for a, arr in enumerate(self.arrays):
            n = len(arr)
            if n < 2:
                continue
            starts = list(range(0, max(n - seq_len, 0) + 1, stride))
            if starts[-1] + seq_len < n:  # the tail the stride would skip
                starts.append(n - seq_len)
            self.index.extend((a, s) for s in starts)
        if not self.index:
            raise ValueError("no window: every sequence is shorter than 2 tokens")

    def set_epoch(self, epoch: int) -> None:
        self.augment.epoch = epoch

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        a, s = self.index[i]
        ids = self.augment(self.arrays[a][s : s + self.seq_len], i)
        return _sample([ids], self.seq_len, self.tokenizer.pad_id)


class RecordDataset(Dataset):
    """One record per sample (e.g. genes in codon mode), truncated to ``seq_len`` and padded."""

    def __init__(self, token_arrays: Sequence[np.ndarray], tokenizer: Tokenizer, seq_len: int):
        self.arrays = [a for a in token_arrays if len(a)]
        if not self.arrays:
            raise ValueError("RecordDataset got no non-empty record")
        truncated = sum(len(a) > seq_len for a in self.arrays)
        if truncated:
            logger.info("%d of %d records truncated to %d tokens", truncated, len(self.arrays), seq_len)
        self.tokenizer, self.seq_len = tokenizer, seq_len

    def __len__(self) -> int:
        return len(self.arrays)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return _sample([self.arrays[i][: self.seq_len]], self.seq_len, self.tokenizer.pad_id)


class PackedDataset(Dataset):
    """Several records packed into each window (first fit in file order), with per-document ids and positions.

    Records longer than ``seq_len`` are cut into ``seq_len`` pieces, each its own document.
    """

    def __init__(self, token_arrays: Sequence[np.ndarray], tokenizer: Tokenizer, seq_len: int):
        pieces = [a[s : s + seq_len] for a in token_arrays for s in range(0, len(a), seq_len)]
        self.windows: list[list[np.ndarray]] = []
        fill = seq_len
        for p in pieces:
            if fill + len(p) > seq_len:
                self.windows.append([])
                fill = 0
            self.windows[-1].append(p)
            fill += len(p)
        if not self.windows:
            raise ValueError("PackedDataset got no non-empty record")
        self.tokenizer, self.seq_len = tokenizer, seq_len

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return _sample(self.windows[i], self.seq_len, self.tokenizer.pad_id)


def split_region(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Hold out the last ``val_fraction`` of one long token array: ``(train, val)``, disjoint."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    cut = len(tokens) - max(1, int(round(len(tokens) * val_fraction)))
    return tokens[:cut], tokens[cut:]


def split_records(ids: Sequence[str], val_fraction: float) -> tuple[list[int], list[int]]:
    """Split records by a hash of their id (stable across runs and file orders): ``(train_idx, val_idx)``."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    train, val = [], []
    for i, rid in enumerate(ids):
        h = int.from_bytes(hashlib.sha256(rid.encode()).digest()[:8], "big") / 2**64
        (val if h < val_fraction else train).append(i)
    if not train or not val:
        raise ValueError(f"{len(ids)} record(s) cannot be split with val_fraction={val_fraction}: one side is empty")
    return train, val


def collate(samples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack samples into a batch: each value ``[B, T]``."""
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
