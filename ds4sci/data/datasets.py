"""Datasets for causal genome LMs: windows over long genomes, one record per sample, packed records.

Every sample is a dict of int64 tensors of length ``T`` (the window):

- ``input_ids [T]``: token ids, ``pad_id`` after the end of the data;
- ``labels [T]``: the ids the model should reproduce, aligned with ``input_ids`` (GPT convention: the one-token
  shift is done in the loss, ``logits[t]`` predicts ``labels[t + 1]``); ``IGNORE_INDEX`` (-100) at padding and at the
  first token of every packed document after the first, so no prediction crosses a document boundary;
- ``position_ids [T]``: positions inside the document (restart at 0 for each packed document);
- ``doc_ids [T]``: document index inside the window, ``PAD_DOC_ID`` (-1) at padding (``IGNORE_INDEX`` from
  ``ds4sci.models.genslm``, ``PAD_DOC_ID`` from ``ds4sci.kernels.local_reference``).

Datasets index :class:`Spans` (documents as ranges of one flat, usually memory-mapped, token array); a list of
arrays is accepted too. Train/validation splits are deterministic (:func:`split_spans`): by held-out region (the last
``val_fraction`` of every record, so no window spans both splits), by a hash of each record's id, or (``split:
files``) whole source files by a hash of each file's basename; ``split: auto`` (:func:`choose_split`) splits by
region unless there are enough records for a record split (a single genome or two are split by region).
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from ds4sci.data.tokenizers import NucleotideTokenizer
from ds4sci.data.tokenizers import Tokenizer
from ds4sci.kernels.local_reference import PAD_DOC_ID
from ds4sci.models.genslm import IGNORE_INDEX

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


@dataclass(frozen=True)
class Spans:
    """Documents as ranges of one flat token array: document ``r`` is ``tokens[bounds[r, 0]:bounds[r, 1]]``.

    What every dataset indexes. ``tokens`` is usually a read-only ``np.memmap`` of a token cache
    (:mod:`ds4sci.data.corpus`), so a rank's memory is O(documents) for ``bounds``, never O(tokens), and no Python
    object exists per document. Splits and ``max_train_tokens`` only select or trim rows of ``bounds``.
    """

    tokens: np.ndarray  # [N] integer token ids (uint8 in a cache)
    bounds: np.ndarray  # [R, 2] int64 (start, end), end exclusive

    def __post_init__(self):
        b = np.asarray(self.bounds, dtype=np.int64).reshape(-1, 2)
        object.__setattr__(self, "bounds", b)

    @staticmethod
    def from_arrays(arrays: Sequence[np.ndarray]) -> "Spans":
        """One document per array (the arrays are concatenated: for small in-memory data and tests)."""
        arrays = [np.asarray(a).reshape(-1) for a in arrays]
        ends = np.cumsum([len(a) for a in arrays], dtype=np.int64)
        tokens = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
        return Spans(tokens, np.stack([ends - [len(a) for a in arrays], ends], axis=1) if arrays else np.zeros((0, 2)))

    @property
    def lengths(self) -> np.ndarray:
        """``[R]`` int64 tokens per document."""
        return self.bounds[:, 1] - self.bounds[:, 0]

    def __len__(self) -> int:
        return len(self.bounds)

    def __getitem__(self, r: int) -> np.ndarray:
        start, end = self.bounds[r]
        return self.tokens[start:end]

    def select(self, rows) -> "Spans":
        return Spans(self.tokens, self.bounds[rows])

    def head(self, n_tokens: int) -> "Spans":
        """The first ``n_tokens`` tokens in document order (the document holding the limit is cut there)."""
        before = np.cumsum(self.lengths) - self.lengths  # tokens before each document
        keep = before < n_tokens
        bounds = self.bounds[keep].copy()
        bounds[:, 1] = np.minimum(bounds[:, 1], bounds[:, 0] + (n_tokens - before[keep]))
        return Spans(self.tokens, bounds)


def as_spans(source: "Spans | Sequence[np.ndarray]") -> Spans:
    return source if isinstance(source, Spans) else Spans.from_arrays(source)


class WindowDataset(Dataset):
    """Fixed-length windows with a stride over long documents (genomes).

    Windows never cross a document boundary; a document's last window is padded. ``reverse_complement`` is the
    probability of flipping a window to its reverse complement (nucleotide tokens only), drawn from
    ``(seed, epoch, index)`` so runs are reproducible; call :meth:`set_epoch` to draw anew. Window ``i`` is found
    from per-document window counts (``searchsorted``), so the index is O(documents), not O(windows).
    """

    def __init__(self, source: Spans | Sequence[np.ndarray], tokenizer: Tokenizer, seq_len: int,
                 stride: int | None = None, *, reverse_complement: float = 0.0, seed: int = 0):
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}")
        stride = seq_len if stride is None else stride
        if not 1 <= stride <= seq_len:
            raise ValueError(f"stride must be in [1, seq_len={seq_len}], got {stride}")
        spans = as_spans(source)
        self.spans = spans.select(spans.lengths >= 2)
        self.tokenizer, self.seq_len, self.stride = tokenizer, seq_len, stride
        self.augment = _Augment(tokenizer, reverse_complement, seed)
        n = self.spans.lengths
        last = np.maximum(n - seq_len, 0)  # the last start a full window (or the whole short document) can have
        base = last // stride + 1  # starts 0, stride, ... <= last
        counts = base + ((base - 1) * stride + seq_len < n)  # + the tail window the stride would skip, at n - T
        self._last, self._ends = last, np.cumsum(counts)  # [R] each
        if not len(self):
            raise ValueError("no window: every sequence is shorter than 2 tokens")

    def set_epoch(self, epoch: int) -> None:
        self.augment.epoch = epoch

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def window(self, i: int) -> tuple[int, int]:
        """``(document, start token inside it)`` of window ``i``."""
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} out of range [0, {len(self)})")
        r = int(np.searchsorted(self._ends, i, side="right"))
        k = i - (int(self._ends[r - 1]) if r else 0)
        return r, min(k * self.stride, int(self._last[r]))

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        r, s = self.window(i)
        ids = self.augment(self.spans[r][s : s + self.seq_len], i)
        return _sample([ids], self.seq_len, self.tokenizer.pad_id)


class RecordDataset(Dataset):
    """One record per sample (e.g. genes in codon mode), truncated to ``seq_len`` and padded."""

    def __init__(self, source: Spans | Sequence[np.ndarray], tokenizer: Tokenizer, seq_len: int):
        spans = as_spans(source)
        self.spans = spans.select(spans.lengths > 0)
        if not len(self.spans):
            raise ValueError("RecordDataset got no non-empty record")
        truncated = int((self.spans.lengths > seq_len).sum())
        if truncated:
            logger.info("%d of %d records truncated to %d tokens", truncated, len(self.spans), seq_len)
        self.tokenizer, self.seq_len = tokenizer, seq_len

    def __len__(self) -> int:
        return len(self.spans)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return _sample([self.spans[i][: self.seq_len]], self.seq_len, self.tokenizer.pad_id)


class PackedDataset(Dataset):
    """Several records packed into each window (next fit in file order), with per-document ids and positions.

    Records longer than ``seq_len`` are cut into ``seq_len`` pieces, each its own document. The index is two
    int64 arrays (piece starts and lengths, first piece of each window): O(pieces) memory, no Python list.
    """

    def __init__(self, source: Spans | Sequence[np.ndarray], tokenizer: Tokenizer, seq_len: int):
        spans = as_spans(source)
        spans = spans.select(spans.lengths > 0)
        n = spans.lengths
        per_doc = -(-n // seq_len)  # pieces per document
        first = np.repeat(np.cumsum(per_doc) - per_doc, per_doc)  # [P] index of the document's first piece
        k = np.arange(int(per_doc.sum()), dtype=np.int64) - first  # piece number inside its document
        doc = np.repeat(np.arange(len(n)), per_doc)
        self._start = spans.bounds[doc, 0] + k * seq_len  # [P] offsets into spans.tokens
        self._len = np.minimum(seq_len, n[doc] - k * seq_len)  # [P]
        heads, fill = array("q"), seq_len
        for c in range(0, len(self._len), 1 << 20):  # next fit, in chunks so no list of P Python ints is built
            for j, length in enumerate(self._len[c : c + (1 << 20)].tolist(), c):
                if fill + length > seq_len:
                    heads.append(j)
                    fill = 0
                fill += length
        if not heads:
            raise ValueError("PackedDataset got no non-empty record")
        self._heads = np.append(np.frombuffer(heads, dtype=np.int64), len(self._len))  # [W + 1]
        self.tokens, self.tokenizer, self.seq_len = spans.tokens, tokenizer, seq_len

    def __len__(self) -> int:
        return len(self._heads) - 1

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} out of range [0, {len(self)})")
        pieces = range(int(self._heads[i]), int(self._heads[i + 1]))
        docs = [self.tokens[self._start[j] : self._start[j] + self._len[j]] for j in pieces]
        return _sample(docs, self.seq_len, self.tokenizer.pad_id)


def _region_cut(length, val_fraction: float):
    """Where the held-out end of a document of ``length`` tokens starts (at least one token held out)."""
    return length - np.maximum(1, np.round(np.asarray(length) * val_fraction).astype(np.int64))


def _check_fraction(val_fraction: float) -> None:
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")


def split_region(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Hold out the last ``val_fraction`` of one long token array: ``(train, val)``, disjoint."""
    _check_fraction(val_fraction)
    cut = int(_region_cut(len(tokens), val_fraction))
    return tokens[:cut], tokens[cut:]


def record_hash(record_id: str) -> int:
    """The 64-bit hash of a record id that decides its side of a record split (first 8 bytes of SHA-256)."""
    return int.from_bytes(hashlib.sha256(record_id.encode()).digest()[:8], "big")


def val_mask(id_hashes: np.ndarray, val_fraction: float) -> np.ndarray:
    """``[R]`` bool: the records whose id hash (:func:`record_hash`) falls in the validation fraction."""
    _check_fraction(val_fraction)
    return np.asarray(id_hashes, dtype=np.uint64).astype(np.float64) / 2.0**64 < val_fraction


def split_records(ids: Sequence[str], val_fraction: float) -> tuple[list[int], list[int]]:
    """Split records by a hash of their id (stable across runs and file orders): ``(train_idx, val_idx)``."""
    mask = val_mask(np.array([record_hash(r) for r in ids], dtype=np.uint64), val_fraction)
    train, val = np.flatnonzero(~mask).tolist(), np.flatnonzero(mask).tolist()
    if not train or not val:
        raise ValueError(f"{len(ids)} record(s) cannot be split with val_fraction={val_fraction}: one side is empty")
    return train, val


def file_hash(path: str | os.PathLike) -> int:
    """The 64-bit hash that decides a source file's side of a file split: :func:`record_hash` of its BASENAME.

    The basename, not the absolute path, so the split does not change when the corpus folder is moved, copied or
    mounted elsewhere (or the cache is built on another machine), and not the path relative to the common root of
    the sources either, since that root (and so every file's name) changes when a file outside it is added. Files
    sharing a basename in different folders (``s1/contigs.fa``, ``s2/contigs.fa``) therefore fall on the same side:
    still disjoint, only coarser; rename them to split them apart.
    """
    return record_hash(os.path.basename(os.fspath(path)))


SPLITS = ("auto", "region", "records", "files")

#: ``auto`` splits whole records only where validation can expect this many of them. Each record lands in validation
#: with probability ``val_fraction`` (its id hash), so of R records Binomial(R, val_fraction) do, and none does with
#: probability (1 - val_fraction)^R <= exp(-R val_fraction) = exp(-5) < 0.7% from R = 5 / val_fraction on. With fewer
#: records (two genomes at 0.02) a record split holds out nothing or whole genomes; the end of every record is a
#: held-out region of the asked size whatever the number of records.
AUTO_VAL_RECORDS = 5


def auto_min_records(val_fraction: float) -> int:
    """The fewest records ``auto`` splits whole: ``ceil(AUTO_VAL_RECORDS / val_fraction)`` (250 at 0.02)."""
    _check_fraction(val_fraction)
    return math.ceil(round(AUTO_VAL_RECORDS / val_fraction, 6))  # rounded first: 5 / 0.02 = 249.99999999999997


def _auto_split(id_hashes: np.ndarray, val_fraction: float) -> tuple[str, str]:
    """``auto``'s choice for these records and why: ``(policy, reason)``."""
    n, least = len(id_hashes), auto_min_records(val_fraction)
    if n < least:
        return "region", f"{n} record(s), fewer than {least} = {AUTO_VAL_RECORDS} / val_fraction for a record split"
    in_val = int(val_mask(id_hashes, val_fraction).sum())
    if in_val in (0, n):
        side = "validation" if in_val == 0 else "training"
        return "region", f"{n} records, but their id hashes leave {side} empty"
    return "records", f"{n} records, at least {least} = {AUTO_VAL_RECORDS} / val_fraction"


def choose_split(id_hashes: np.ndarray, val_fraction: float, policy: str = "auto") -> str:
    """The split ``policy`` stands for over records with these id hashes (:func:`record_hash`): an explicit policy
    itself (refused later if a side is empty), ``auto`` ``"records"`` when there are at least
    :func:`auto_min_records` records (:data:`AUTO_VAL_RECORDS` expected in validation) and their hashes put at least
    one on each side, ``"region"`` (the end of every record held out) otherwise. Deterministic: a function of the ids,
    ``val_fraction`` and the policy."""
    if policy not in SPLITS:
        raise ValueError(f"split policy must be one of {SPLITS}, got {policy!r}")
    _check_fraction(val_fraction)
    return _auto_split(id_hashes, val_fraction)[0] if policy == "auto" else policy


def describe_split(id_hashes: np.ndarray, val_fraction: float, policy: str = "auto") -> str:
    """One line naming the split ``policy`` stands for (:func:`choose_split`) and why, for the start-up block: e.g.
    ``region: the last 2% of every record held out (data.split auto: 2 record(s), fewer than 250 = ...)``."""
    chosen = choose_split(id_hashes, val_fraction, policy)
    what = {"region": f"the last {100 * val_fraction:g}% of every record held out",
            "records": "whole records by a hash of their id",
            "files": "whole source files by a hash of their basename"}[chosen]
    why = f"auto: {_auto_split(id_hashes, val_fraction)[1]}" if policy == "auto" else policy
    return f"{chosen}: {what} (data.split {why})"


def split_spans(spans: Spans, id_hashes: np.ndarray, val_fraction: float, policy: str = "auto", *,
                record_file: np.ndarray | None = None,
                files: Sequence[str | os.PathLike] | None = None) -> tuple[Spans, Spans]:
    """Train/validation split of a corpus: ``(train, val)``, deterministic, disjoint.

    - ``"region"``: the last ``val_fraction`` of EVERY document is held out (as :func:`split_region`), so no
      window spans both sides;
    - ``"records"``: whole documents, by the hash of their id (as :func:`split_records`): a document's side
      depends on its id only, so adding files never moves an existing document, and documents sharing an id (the
      same record in two files) land on the same side;
    - ``"files"``: whole source files, by :func:`file_hash` (the hash of the file's basename, so the split is
      independent of where the corpus folder lies): every record of a file is on its file's side, and adding files
      never moves an existing file. Needs ``record_file`` (``[R]``, each document's index into ``files``) and
      ``files`` (the source paths);
    - ``"auto"``: :func:`choose_split`: ``"records"`` when there are enough documents for both sides to be
      non-empty with high probability and they are, ``"region"`` otherwise (a single genome, two genomes).
    """
    policy = choose_split(id_hashes, val_fraction, policy)
    if policy == "region":
        cut = spans.bounds[:, 0] + _region_cut(spans.lengths, val_fraction)
        train = Spans(spans.tokens, np.stack([spans.bounds[:, 0], cut], axis=1))
        val = Spans(spans.tokens, np.stack([cut, spans.bounds[:, 1]], axis=1))
        train, val = train.select(train.lengths > 0), val.select(val.lengths > 0)
    elif policy == "files":
        if record_file is None or files is None:
            raise ValueError("split 'files' needs each record's source file (record_file) and the source paths (files)")
        record_file = np.asarray(record_file, dtype=np.int64)
        mask = val_mask(np.array([file_hash(f) for f in files], dtype=np.uint64), val_fraction)[record_file]
        train, val = spans.select(~mask), spans.select(mask)
        if not len(train) or not len(val):
            used = np.unique(record_file)
            names = len({os.path.basename(os.fspath(files[f])) for f in used.tolist()})
            shared = f" ({names} distinct basename(s): files sharing one share a side)" if names < len(used) else ""
            raise ValueError(f"{len(used)} file(s){shared} cannot be split by files with val_fraction={val_fraction}: "
                             f"one side is empty (use more files, a larger val_fraction, or split: records)")
    else:
        mask = val_mask(id_hashes, val_fraction)
        train, val = spans.select(~mask), spans.select(mask)
    if not len(train) or not len(val):
        raise ValueError(f"{len(spans)} record(s) cannot be split by {policy} with val_fraction={val_fraction}: "
                         f"one side is empty (use more records, a larger val_fraction, or split: region)")
    return train, val


def collate(samples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack samples into a batch: each value ``[B, T]``."""
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
