"""Streaming FASTA reading with an explicit policy for soft-masking, ambiguous bases and malformed files.

The parser is ds4sci's own line reader, not Biopython's ``SeqIO``: Biopython cannot say on which line a bad character
sits, reports a FASTQ or a headerless file as "comments at the beginning of the file", and silently deletes spaces
inside sequence lines. Biopython stays the oracle the tests compare against on valid files (``tests/data``).
Reading is streamed (one record in memory at a time); gzip is detected from the file's magic bytes, not its name.

Accepted: ``\\n`` and ``\\r\\n`` line endings, blank lines anywhere, trailing whitespace on a line, any line width.

Base policy (applied in this order):

1. lowercase (soft-masked) bases are uppercased;
2. ``U`` (RNA) is read as ``T``;
3. ``A C G T N`` are kept;
4. the other IUPAC ambiguity codes ``R Y S W K M B D H V`` follow ``iupac``: ``"n"`` replaces them with ``N``
   (the default: one ambiguous-base token), ``"keep"`` keeps the letter (tokenizers map it to ``[UNK]``),
   ``"error"`` raises;
5. anything else (digits, ``-``, ``*``, ``.``, a space inside a line, a non-ASCII byte ...) raises a ``ValueError``
   naming the file, the record id, the line and column, and the character.

Malformed files raise a ``ValueError`` that names the file and the line: an empty file, a file that is not FASTA
(FASTQ, GenBank, other compression, binary), sequence before the first ``>`` header, a header without an id, a
truncated or corrupt gzip stream. A header followed by no sequence (an empty record) is skipped with a logged
warning naming the file, record and line. Duplicate ids are not this module's business (see
:mod:`ds4sci.data.corpus`).
"""
from __future__ import annotations

import bisect
import gzip
import logging
import os
import zlib
from array import array
from collections.abc import Callable
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

IUPAC_POLICIES = ("n", "keep", "error")
_AMBIGUOUS = b"RYSWKMBDHV"
_KEEP = b"ACGTN"

# byte -> 0 (invalid), 1 (kept base), 2 (ambiguous IUPAC code), for uppercase input.
_CLASS = np.zeros(256, dtype=np.uint8)
_CLASS[np.frombuffer(_KEEP, dtype=np.uint8)] = 1
_CLASS[np.frombuffer(_AMBIGUOUS, dtype=np.uint8)] = 2
_VALID = _KEEP + _AMBIGUOUS + b"U"
_VALID_ANY_CASE = _VALID + _VALID.lower()
# One-pass translation tables (each byte is mapped once, so 'u' must go straight to 'T', 'r' straight to 'N').
_UPPER = bytes.maketrans(b"ACGTNUacgtnu" + _AMBIGUOUS + _AMBIGUOUS.lower(), b"ACGTNTACGTNT" + _AMBIGUOUS * 2)
_TO_N = bytes.maketrans(b"ACGTNUacgtnu" + _AMBIGUOUS + _AMBIGUOUS.lower(), b"ACGTNTACGTNT" + b"N" * 2 * len(_AMBIGUOUS))

_OTHER_COMPRESSION = {b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"PK\x03\x04": "zip", b"\x28\xb5\x2f\xfd": "zstd"}


@dataclass(frozen=True)
class FastaRecord:
    """One FASTA record after the policy above: ``sequence`` is uppercase ASCII; ``line`` is its header's line."""

    id: str
    description: str
    sequence: str
    line: int = 0

    def __len__(self) -> int:
        return len(self.sequence)


class _BadBase(ValueError):
    """Internal: the first offending byte of a sequence (0-based ``pos``) and how many there are."""

    def __init__(self, pos: int, char: int, count: int, ambiguous: bool):
        super().__init__(pos, char, count, ambiguous)
        self.pos, self.char, self.count, self.ambiguous = pos, char, count, ambiguous

    def what(self) -> str:
        char = repr(chr(self.char)) if self.char < 128 else f"byte 0x{self.char:02x}"
        if self.ambiguous:
            return f"ambiguous IUPAC code {char}"
        return f"invalid nucleotide character {char}"

    def count_text(self) -> str:
        kind = "ambiguous code(s) and iupac='error'" if self.ambiguous else "invalid character(s)"
        return f"{self.count} {kind} in the record"


def _normalize(data: bytes, iupac: str) -> bytes:
    """Apply the base policy to raw sequence bytes; raises :class:`_BadBase` at the first offending byte."""
    if data.translate(None, _VALID_ANY_CASE):  # anything left is not a nucleotide code (C-speed check)
        cls = _CLASS[np.frombuffer(data.translate(_UPPER), dtype=np.uint8)]
        bad = np.flatnonzero(cls == 0)
        raise _BadBase(int(bad[0]), data[int(bad[0])], int(bad.size), False)
    if iupac == "n":
        return data.translate(_TO_N)
    upper = data.translate(_UPPER)
    if iupac == "error" and upper.translate(None, _AMBIGUOUS) != upper:
        amb = np.flatnonzero(_CLASS[np.frombuffer(upper, dtype=np.uint8)] == 2)
        raise _BadBase(int(amb[0]), upper[int(amb[0])], int(amb.size), True)
    return upper


def _check_policy(iupac: str) -> None:
    if iupac not in IUPAC_POLICIES:
        raise ValueError(f"iupac must be one of {IUPAC_POLICIES}, got {iupac!r}")


def normalize_sequence(raw: str, *, iupac: str = "n", where: str = "sequence") -> str:
    """Apply the module's base policy to one sequence; ``where`` names it in error messages."""
    _check_policy(iupac)
    try:
        data = raw.encode("ascii")
    except UnicodeEncodeError as err:
        raise ValueError(f"{where}: non-ASCII character {raw[err.start]!r} at position {err.start + 1}") from None
    try:
        return _normalize(data, iupac).decode("ascii")
    except _BadBase as bad:
        raise ValueError(f"{where}: {bad.what()} at position {bad.pos + 1} ({bad.count_text()})") from None


@dataclass
class RawRecord:
    """A parsed record before tokenization: ``sequence`` is normalized uppercase ASCII bytes."""

    path: str
    id: str
    description: str
    line: int  # 1-based line of the header
    sequence: bytes


class _Reader:
    """Line-by-line parser of one file; keeps line numbers for messages."""

    def __init__(self, path: str, iupac: str, progress: Callable[[int], None] | None):
        self.path, self.iupac, self.progress = path, iupac, progress

    def _open(self):
        raw = open(self.path, "rb")
        magic = raw.read(6)
        raw.seek(0)
        for prefix, name in _OTHER_COMPRESSION.items():
            if magic.startswith(prefix):
                raw.close()
                raise ValueError(f"{self.path}: {name}-compressed; only plain or gzip (.gz) FASTA is read: "
                                 f"decompress it first")
        return raw, (gzip.GzipFile(fileobj=raw, mode="rb") if magic[:2] == b"\x1f\x8b" else raw)

    def _first_line_error(self, lineno: int, line: bytes) -> ValueError:
        text = line[:40].decode("utf-8", "replace")
        if line.translate(None, bytes(range(32, 127)) + b"\t"):  # control or non-ASCII bytes
            why = f"line {lineno}: binary data ({text!r}): not a text FASTA file"
        elif line.startswith(b"@"):
            why = f"looks like FASTQ (line {lineno} starts with '@'); convert it to FASTA (e.g. seqtk seq -A)"
        elif line.startswith((b"LOCUS", b"ID   ")):
            why = f"looks like GenBank/EMBL (line {lineno}: {text!r}); convert it to FASTA"
        elif line and not line.translate(None, _VALID_ANY_CASE):
            why = f"sequence data at line {lineno} before any '>' header"
        else:
            why = f"line {lineno} does not start with '>' ({text!r}): not a FASTA file"
        return ValueError(f"{self.path}: {why}")

    def records(self) -> Iterator[RawRecord]:
        raw, handle = self._open()
        lineno = 0
        try:
            with raw, handle:
                header: tuple[str, str, int] | None = None
                seq = bytearray()
                starts, lines = array("q"), array("q")  # per sequence line: offset in seq, line number
                seen_any = False
                for lineno, line in enumerate(handle, 1):
                    if b"\x00" in line:
                        raise ValueError(f"{self.path}: line {lineno}: binary data (NUL byte): not a text FASTA file")
                    line = line.rstrip()
                    if not line:
                        continue  # blank lines are accepted anywhere
                    if line.startswith(b">"):
                        if header is not None:
                            yield from self._finish(header, seq, starts, lines)
                            if self.progress is not None:
                                self.progress(raw.tell())
                        header = self._header(line, lineno)
                        seq, starts, lines = bytearray(), array("q"), array("q")
                        seen_any = True
                        continue
                    if header is None:
                        raise self._first_line_error(lineno, line)
                    starts.append(len(seq))
                    lines.append(lineno)
                    seq += line
                if header is not None:
                    yield from self._finish(header, seq, starts, lines)
                if not seen_any:
                    raise ValueError(f"{self.path}: empty file: no FASTA record")
                if self.progress is not None:
                    self.progress(raw.tell())
        except (EOFError, zlib.error, gzip.BadGzipFile) as err:
            raise ValueError(f"{self.path}: truncated or corrupt gzip data after line {lineno} ({err}); "
                             f"download or compress the file again") from None

    def _header(self, line: bytes, lineno: int) -> tuple[str, str, int]:
        try:
            description = line[1:].decode("utf-8").strip()
        except UnicodeDecodeError:
            raise ValueError(f"{self.path}: line {lineno}: header is not UTF-8 text: not a text FASTA file") from None
        if not description.split():
            raise ValueError(f"{self.path}: line {lineno}: header '>' without a record id")
        return description.split(None, 1)[0], description, lineno

    def _finish(self, header, seq: bytearray, starts: array, lines: array) -> Iterator[RawRecord]:
        rid, description, lineno = header
        if not seq:
            logger.warning("%s: record %r (line %d) has no sequence; skipped", self.path, rid, lineno)
            return
        try:
            data = _normalize(bytes(seq), self.iupac)
        except _BadBase as bad:
            k = bisect.bisect_right(starts, bad.pos) - 1  # the sequence line holding the byte
            raise ValueError(
                f"{self.path}: record {rid!r} (header line {lineno}): {bad.what()} at line {lines[k]}, column "
                f"{bad.pos - starts[k] + 1} (position {bad.pos + 1} in the record; {bad.count_text()})"
            ) from None
        yield RawRecord(self.path, rid, description, lineno, data)


def iter_raw_records(path: str | os.PathLike, *, iupac: str = "n",
                     progress: Callable[[int], None] | None = None) -> Iterator[RawRecord]:
    """Records of one FASTA file as :class:`RawRecord` (normalized bytes): the reader behind :func:`read_fasta`.

    ``progress``, if given, is called with the number of bytes of the file (compressed bytes for gzip) read so far.
    """
    _check_policy(iupac)
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path}: is a directory, not a FASTA file")
    yield from _Reader(path, iupac, progress).records()


def read_fasta(path: str | os.PathLike, *, iupac: str = "n") -> Iterator[FastaRecord]:
    """Yield the records of a FASTA file (plain or ``.gz``) one at a time.

    Args:
        path: FASTA file; gzip compression is detected from the content, not the name.
        iupac: what to do with ambiguous IUPAC codes other than ``N``: ``"n"`` (replace with ``N``),
            ``"keep"``, or ``"error"``. See the module docstring for the whole policy.

    Yields:
        :class:`FastaRecord` with an uppercase sequence. Empty records are skipped (logged).

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file is empty or not FASTA, or a record holds a character that is not a nucleotide code
            (the message names the file, record id, line, column and character).
    """
    for rec in iter_raw_records(path, iupac=iupac):
        yield FastaRecord(id=rec.id, description=rec.description, sequence=rec.sequence.decode("ascii"), line=rec.line)
