"""Labelled sequences for downstream tasks (``ds4sci probe``, fine-tuning): readers, label kinds and splits.

Inputs (a :class:`LabelSource`; several sources are read as one data set):

- FASTA whose headers carry the label as ``key=value`` words: ``>r1 label=1 split=test``;
- a table (TSV, or CSV when the header line holds no tab) with a header row naming the columns ``id``,
  ``sequence``, ``label`` and optionally ``split``;
- FASTA plus a label table keyed by id (``LabelSource(path=TABLE, fasta=FASTA)``, the table without ``sequence``);
- FASTA plus BED intervals (``LabelSource(path=FASTA, bed=BED)``, kind ``token``): the bases inside an interval are
  class ``1``, the others ``0``. BED coordinates are 0-based and half-open; the first column names the record.

Kinds (:data:`KINDS`) and how a label value is written:

- ``binary``: ``0`` or ``1`` (or the two names of ``classes``, negative first); target: an int.
- ``multiclass``: a class name; target: its index in :attr:`LabelledData.classes`.
- ``multilabel``: class names joined by commas (``a,c``), ``-`` for none; target: a 0/1 tuple over the classes.
- ``regression``: one number, or several joined by commas (one per target); target: a tuple of floats.
  :meth:`LabelledData.standardisation` gives each target's mean and standard deviation over the train split.
- ``token``: one character per base, the same length as the sequence (``0011100``), or BED intervals; target:
  an int array ``[L]`` of class indices.

Class names, when not given, are the sorted names seen in the train split: a name met only in another split is an
unknown class there. Splits (``train``, ``validation``, ``test``) are given by a ``split`` column or header key, or
per file (``LabelSource(split=...)``); when no record names one, each record's split follows a stated, stable rule
(:func:`hash_split`: the SHA-256 of its id), so adding records never moves the old ones.

Every bad line (missing label, unknown class or split, a value that is not a number, a length mismatch, a
duplicate id, a BED interval outside its record, a record with no label row) is collected, and
:func:`read_labelled` raises one :class:`LabelError` that lists them ALL, each as ``FILE:LINE: what``. A FASTA file
itself malformed (not FASTA, a character that is no base) stops at its first error, from :func:`read_fasta`; a bad
base in a table's ``sequence`` cell is one more collected line.
"""
from __future__ import annotations

import csv
import gzip
import hashlib
import math
import os
from collections.abc import Iterable
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field

import numpy as np

from ds4sci.data.fasta import normalize_sequence
from ds4sci.data.fasta import read_fasta

KINDS = ("binary", "multiclass", "multilabel", "regression", "token")
SPLITS = ("train", "validation", "test")
NO_LABEL = "-"  # a multi-label value with no class


class LabelError(ValueError):
    """Bad lines of labelled data, all of them: ``problems`` is a list of ``"FILE:LINE: what"`` lines. The message
    is a count followed by one problem per line (the CLI prints it as one error and exits with status 2)."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__(f"{len(self.problems)} bad line(s) in the labelled data:\n  " + "\n  ".join(self.problems))


@dataclass(frozen=True)
class LabelSource:
    """One labelled input. ``path``: a FASTA with labels in its headers, a table with a ``sequence`` column, or (with
    ``fasta``) a label table keyed by id, or (with ``bed``) the FASTA whose bases the BED intervals label.
    ``split``: the split of every record of this source (else the ``split`` column / key, else :func:`hash_split`).
    ``label``: the column or header key holding the label."""

    path: str | os.PathLike
    fasta: str | os.PathLike | None = None
    bed: str | os.PathLike | None = None
    split: str | None = None
    label: str = "label"


@dataclass(frozen=True)
class LabelledRecord:
    """One labelled record. ``target``: int (binary, multiclass), tuple of 0/1 ``[C]`` (multilabel), tuple of
    floats ``[T]`` (regression), int64 array ``[L]`` of per-base class indices (token). ``where``: ``FILE:LINE``."""

    id: str
    sequence: str
    target: object
    split: str
    where: str


@dataclass(frozen=True)
class LabelledData:
    """A labelled data set. ``classes``: class names (binary: the two, negative first; multiclass, multilabel,
    token: in index order), or the target names of a regression (``label`` or ``label0, label1, ...``).
    ``split_rule``: how splits were made, stated for reports (``given`` or the :func:`hash_split` rule)."""

    kind: str
    classes: tuple[str, ...]
    examples: tuple[LabelledRecord, ...]
    split_rule: str

    def split(self, name: str) -> list[LabelledRecord]:
        """The examples of split ``name`` (``train``, ``validation`` or ``test``), in input order."""
        if name not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {name!r}")
        return [e for e in self.examples if e.split == name]

    def targets(self, name: str) -> np.ndarray:
        """The targets of split ``name`` as one array: ``[R]`` int64 (binary, multiclass), ``[R, C]`` int64
        (multilabel), ``[R, T]`` float64 (regression), ``[bases]`` int64 (token: the records' bases in order)."""
        rows = [e.target for e in self.split(name)]
        if self.kind == "token":
            return np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
        if self.kind == "regression":
            return np.array(rows, dtype=np.float64).reshape(len(rows), len(self.classes))
        if self.kind == "multilabel":
            return np.array(rows, dtype=np.int64).reshape(len(rows), len(self.classes))
        return np.array(rows, dtype=np.int64)

    def standardisation(self) -> tuple[np.ndarray, np.ndarray]:
        """Regression only: ``(mean [T], std [T])`` of the targets over the train split (population std; a target
        constant over the split gets std 1, so standardising only centres it).

        Raises:
            ValueError: not a regression, or an empty train split.
        """
        if self.kind != "regression":
            raise ValueError(f"standardisation is for regression targets, not {self.kind!r}")
        y = self.targets("train")  # [R, T]
        if not len(y):
            raise ValueError("no train record to take the standardisation statistics from")
        std = y.std(axis=0)
        return y.mean(axis=0), np.where(std > 0, std, 1.0)


def hash_split(record_id: str, validation: float = 0.1, test: float = 0.1) -> str:
    """The split of a record by the stable rule: ``u`` = the first 8 bytes of SHA-256(id, UTF-8) as a fraction of
    2**64; ``test`` if ``u < test``, ``validation`` if ``u < test + validation``, else ``train``. It depends on the
    id alone, so adding records never moves the old ones."""
    u = int.from_bytes(hashlib.sha256(record_id.encode("utf-8")).digest()[:8], "big") / 2.0 ** 64
    return "test" if u < test else "validation" if u < test + validation else "train"


@dataclass
class _Raw:
    """A record as read, before its label is decoded against the classes."""

    id: str
    sequence: str
    value: object  # label text, or an int array [L] for BED
    split: str | None
    path: str
    line: int

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass
class _Reading:
    records: list[_Raw] = field(default_factory=list)
    problems: list[tuple[str, int, str]] = field(default_factory=list)  # (file, line, what)

    def bad(self, path, line: int, what: str) -> None:
        self.problems.append((os.fspath(path), line, what))


def _lines(path) -> Iterable[tuple[int, str]]:
    """(1-based line number, text without the line end) of a plain or gzip text file."""
    with open(path, "rb") as raw:
        gz = raw.read(2) == b"\x1f\x8b"
    with (gzip.open(path, "rt", encoding="utf-8") if gz else open(path, encoding="utf-8", newline="")) as handle:
        for number, line in enumerate(handle, 1):
            yield number, line.rstrip("\r\n")


def _is_fasta(path) -> bool:
    for _, line in _lines(path):
        if line.strip():
            return line.startswith(">")
    return False


def _table(path, reading: _Reading, needed: Sequence[str]) -> Iterable[tuple[int, dict[str, str]]]:
    """Rows of a TSV/CSV with a header row, as (line, column -> stripped text); a missing column is one problem."""
    lines = [(n, text) for n, text in _lines(path) if text.strip() and not text.startswith("#")]
    if not lines:
        reading.bad(path, 1, "empty table: no header row")
        return
    header_line, header = lines[0]
    delimiter = "\t" if "\t" in header else ","
    columns = [c.strip() for c in next(csv.reader([header], delimiter=delimiter))]
    missing = [c for c in needed if c not in columns]
    if missing:
        reading.bad(path, header_line, f"header names no column {', '.join(map(repr, missing))} "
                    f"(columns: {', '.join(columns)})")
        return
    for number, cells in zip((n for n, _ in lines[1:]), csv.reader([t for _, t in lines[1:]], delimiter=delimiter)):
        if len(cells) != len(columns):
            reading.bad(path, number, f"{len(cells)} field(s), the header has {len(columns)}")
            continue
        yield number, {c: v.strip() for c, v in zip(columns, cells)}


def _header_values(description: str) -> dict[str, str]:
    """``key=value`` words after the id of a FASTA header."""
    words = description.split()[1:]
    return dict(w.split("=", 1) for w in words if "=" in w)


def _sequence(reading: _Reading, path, line: int, raw: str) -> str | None:
    if not raw:
        reading.bad(path, line, "empty sequence")
        return None
    try:
        return normalize_sequence(raw, where="sequence")
    except ValueError as err:
        reading.bad(path, line, str(err))
        return None


def _read_fasta_headers(source: LabelSource, reading: _Reading) -> None:
    for rec in read_fasta(source.path):
        values = _header_values(rec.description)
        if source.label not in values or not values[source.label]:
            reading.bad(source.path, rec.line, f"record {rec.id!r}: missing label ({source.label}=...)")
            continue
        reading.records.append(_Raw(rec.id, rec.sequence, values[source.label], values.get("split"),
                                    os.fspath(source.path), rec.line))


def _read_table(source: LabelSource, reading: _Reading) -> None:
    for line, row in _table(source.path, reading, ("id", "sequence", source.label)):
        sequence = _sequence(reading, source.path, line, row["sequence"])
        if not row[source.label]:
            reading.bad(source.path, line, f"record {row['id']!r}: missing label")
        elif sequence is not None:
            reading.records.append(_Raw(row["id"], sequence, row[source.label], row.get("split") or None,
                                        os.fspath(source.path), line))


def _read_keyed(source: LabelSource, reading: _Reading) -> None:
    """FASTA plus a label table keyed by id: a row for an id the FASTA lacks and a record no row labels are bad."""
    records = {rec.id: rec for rec in read_fasta(source.fasta)}
    labelled = set()
    for line, row in _table(source.path, reading, ("id", source.label)):
        rec = records.get(row["id"])
        if rec is None:
            reading.bad(source.path, line, f"id {row['id']!r} is not a record of {os.fspath(source.fasta)}")
        elif not row[source.label]:
            reading.bad(source.path, line, f"record {row['id']!r}: missing label")
        else:
            labelled.add(rec.id)
            reading.records.append(_Raw(rec.id, rec.sequence, row[source.label], row.get("split") or None,
                                        os.fspath(source.path), line))
    for rec in records.values():
        if rec.id not in labelled:
            reading.bad(source.fasta, rec.line, f"record {rec.id!r}: missing label (no row in "
                        f"{os.fspath(source.path)})")


def _read_bed(source: LabelSource, reading: _Reading) -> None:
    """FASTA plus BED intervals: per-base targets, 1 inside an interval and 0 elsewhere."""
    records = list(read_fasta(source.path))
    masks = {rec.id: np.zeros(len(rec), dtype=np.int64) for rec in records}
    for line, text in _lines(source.bed):
        if not text.strip() or text.startswith(("#", "track", "browser")):
            continue
        cells = text.split("\t") if "\t" in text else text.split()
        if len(cells) < 3:
            reading.bad(source.bed, line, f"{len(cells)} field(s), a BED line needs chrom, start and end")
            continue
        try:
            start, end = int(cells[1]), int(cells[2])
        except ValueError:
            reading.bad(source.bed, line, f"start {cells[1]!r} or end {cells[2]!r} is not an integer")
            continue
        mask = masks.get(cells[0])
        if mask is None:
            reading.bad(source.bed, line, f"record {cells[0]!r} is not in {os.fspath(source.path)}")
        elif not 0 <= start < end <= len(mask):
            reading.bad(source.bed, line, f"interval {start}-{end} outside record {cells[0]!r} "
                        f"(0-based, half-open; the record has {len(mask)} bases)")
        else:
            mask[start:end] = 1
    for rec in records:
        reading.records.append(_Raw(rec.id, rec.sequence, masks[rec.id], None, os.fspath(source.path), rec.line))


def _read(source: LabelSource, kind: str, reading: _Reading) -> None:
    if source.bed is not None:
        if kind != "token":
            raise ValueError(f"BED intervals label bases: kind must be 'token', not {kind!r}")
        _read_bed(source, reading)
    elif source.fasta is not None:
        _read_keyed(source, reading)
    elif _is_fasta(source.path):
        _read_fasta_headers(source, reading)
    else:
        _read_table(source, reading)


def _assign_splits(reading: _Reading, first: int, source: LabelSource) -> None:
    """Check the split names of the records read from ``source`` (from ``first`` on); ``source.split`` wins."""
    for raw in reading.records[first:]:
        if source.split is not None:
            raw.split = source.split
        elif raw.split is not None and raw.split not in SPLITS:
            reading.bad(raw.path, raw.line,
                        f"record {raw.id!r}: unknown split {raw.split!r} (one of {', '.join(SPLITS)})")


def _class_names(kind: str, train: list[_Raw]) -> tuple[str, ...]:
    """Classes seen in the train split, sorted (binary's default is fixed: ``0``, ``1``)."""
    if kind == "binary":
        return ("0", "1")
    if kind == "token":
        return tuple(sorted({c for raw in train if isinstance(raw.value, str) for c in raw.value})) or ("0", "1")
    if kind == "multiclass":
        return tuple(sorted({raw.value for raw in train}))
    return tuple(sorted({name for raw in train for name in raw.value.split(",") if name != NO_LABEL}))


def _decode(kind: str, raw: _Raw, classes: tuple[str, ...], targets: int | None) -> tuple[object, str | None]:
    """(target, None) or (None, what is wrong) for one record's label value."""
    index = {name: i for i, name in enumerate(classes)}
    if kind in ("binary", "multiclass"):
        if raw.value not in index:
            return None, f"record {raw.id!r}: unknown class {raw.value!r} (classes: {', '.join(classes)})"
        return index[raw.value], None
    if kind == "multilabel":
        names = [] if raw.value == NO_LABEL else raw.value.split(",")
        unknown = [n for n in names if n not in index]
        if unknown:
            return None, f"record {raw.id!r}: unknown class {unknown[0]!r} (classes: {', '.join(classes)})"
        return tuple(int(name in names) for name in classes), None
    if kind == "regression":
        try:
            values = tuple(float(v) for v in raw.value.split(","))
        except ValueError:
            return None, f"record {raw.id!r}: label {raw.value!r} is not a number (or numbers joined by commas)"
        if not all(math.isfinite(v) for v in values):
            return None, f"record {raw.id!r}: label {raw.value!r} is not finite"
        if len(values) != targets:
            return None, f"record {raw.id!r}: {len(values)} target(s), the first record has {targets}"
        return values, None
    if not isinstance(raw.value, str):  # BED mask
        return raw.value, None
    if len(raw.value) != len(raw.sequence):
        return None, (f"record {raw.id!r}: length mismatch: {len(raw.value)} per-base label(s) for "
                      f"{len(raw.sequence)} base(s)")
    unknown = sorted(set(raw.value) - set(index))
    if unknown:
        return None, f"record {raw.id!r}: unknown class {unknown[0]!r} (classes: {', '.join(classes)})"
    return np.array([index[c] for c in raw.value], dtype=np.int64), None


def read_labelled(sources: LabelSource | str | os.PathLike | Sequence[LabelSource | str | os.PathLike], kind: str, *,
                  classes: Sequence[str] | None = None, validation: float = 0.1, test: float = 0.1) -> LabelledData:
    """Read labelled records from one or several sources (a path alone is ``LabelSource(path)``).

    Args:
        kind: one of :data:`KINDS`.
        classes: the class names in index order (binary: negative, positive); default: sorted from the train split
            (binary: ``0``, ``1``). A name not among them is an unknown class.
        validation: the fraction for :func:`hash_split`'s validation split, used only when no record names its split.
        test: the same for the test split.

    Returns:
        :class:`LabelledData`; regression targets are named ``label`` (one) or ``label0, label1, ...``.

    Raises:
        LabelError: every bad line found, each as ``FILE:LINE: what`` (see the module docstring).
        ValueError: a bad argument (kind, classes, fractions, BED with another kind) or an unreadable FASTA.
        OSError: a file that cannot be opened.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if not (0 <= validation and 0 <= test and validation + test < 1):
        raise ValueError(f"validation {validation} and test {test} must be >= 0 and leave a train split (sum < 1)")
    if classes is not None and (len(set(classes)) != len(classes) or (kind == "binary" and len(classes) != 2)):
        raise ValueError(f"classes {list(classes)}: names must be distinct (two of them for binary)")
    if isinstance(sources, (LabelSource, str, os.PathLike)):
        sources = [sources]
    reading = _Reading()
    for source in sources:
        source = source if isinstance(source, LabelSource) else LabelSource(source)
        first = len(reading.records)
        _read(source, kind, reading)
        _assign_splits(reading, first, source)
    records, seen = [], {}
    for raw in reading.records:
        if raw.id in seen:
            reading.bad(raw.path, raw.line, f"duplicate id {raw.id!r} (first at {seen[raw.id]})")
        else:
            seen[raw.id] = raw.where
            records.append(raw)
    given = [raw for raw in records if raw.split is not None]
    if given and len(given) < len(records):
        for raw in records:
            if raw.split is None:
                reading.bad(raw.path, raw.line, f"record {raw.id!r}: no split, while other records name theirs")
    split_rule = "given" if given else f"hash_split(validation={validation}, test={test})"
    for raw in records:
        raw.split = raw.split or hash_split(raw.id, validation, test)
    train = [raw for raw in records if raw.split == "train"]
    names = tuple(classes) if classes is not None else _class_names(kind, train)
    targets = None
    if kind == "regression":
        first_value = next((raw.value for raw in records), "")
        targets = len(first_value.split(","))
        names = ("label",) if targets == 1 else tuple(f"label{i}" for i in range(targets))
    examples = []
    for raw in records:
        target, what = _decode(kind, raw, names, targets)
        if what is not None:
            reading.bad(raw.path, raw.line, what)
        else:
            examples.append(LabelledRecord(raw.id, raw.sequence, target, raw.split, raw.where))
    if reading.problems:
        raise LabelError([f"{path}:{line}: {what}" for path, line, what in sorted(reading.problems)])
    if not examples:
        raise LabelError(["no labelled record in " + ", ".join(os.fspath(getattr(s, "path", s)) for s in sources)])
    return LabelledData(kind, names, tuple(examples), split_rule)
