"""Variant-effect scores of a nucleotide GenSLM: the log-likelihood ratio of each variant (``ds4sci score-variants``).

The zero-shot score genome language models give a variant (Meier et al. 2021's masked-marginal idea in its
autoregressive form; Benegas et al. 2023, GPN; Evo 2's variant-effect scoring): the total log-likelihood of a window
of the genome carrying the alternative allele minus that of the window carrying the reference allele,

    llr = log p(ALT window) - log p(REF window)    (nats; negative: the model finds the variant less likely),

each window's log-likelihood the mean of both strands, exactly as ``ds4sci score --reverse-complement`` computes it
(:func:`ds4sci.infer.score.score_records`, which every window here goes through, :data:`BLOCK` variants per call).

Windows (:func:`variant_windows`) depend on the variant and the model alone, never on the other lines of the file.
The REF window holds ``W`` bases of the record around the variant's REF span, centred on it (``start = pos0 +
len(REF) // 2 - W // 2``) and shifted, not cut, where it would run past either end of the record, so every window
has ``W`` bases; a record shorter than ``W`` is its own window. ``W`` defaults to the length the model was trained on
(recorded in its export: :mod:`ds4sci.infer.length`), since a window longer than any the model has seen scores worse.
The ALT window (:func:`alt_window`):

- ``equal_length`` (the default, ``--equal-length``): ``W`` bases of the ALT haplotype centred on ALT, the way the
  REF window is centred on REF, so an insertion's ALT window holds fewer flanking bases and a deletion's more. Both
  windows hold the same number of bases, so the LLR of an indel compares sequences of one length (Evo 2's maintainers
  keep the windows equal, ArcInstitute/evo2 #206); with windows of different lengths, the log-likelihood of the bases
  one window has and the other lacks (about -1.4 nats per base at 2 bits per base) swamps the effect of the variant.
- otherwise (``--no-equal-length``): the REF window with REF replaced by ALT (``W - len(REF) + len(ALT)`` bases); by
  default ``W`` is narrowed for an insertion that would not fit the context otherwise (:func:`default_window`).

SNVs and MNVs (``len(REF) == len(ALT)``) get the same windows both ways. Variants whose REF windows coincide
(several ALTs at one site, neighbours near a record end, where the shifted windows are the same) share one REF
window, scored once. Every window must fit the model's context (one window of ``score_records``).

Variants come from a VCF (read with pysam; ``.vcf`` or a bgzipped ``.vcf.gz``; a record with several ALTs is one
variant per ALT) or from a TSV with a header naming the columns ``chrom pos ref alt`` and optionally ``id`` (1-based
``pos``, as in a VCF; comma-separated ALTs as in a VCF). Every line is checked before anything is scored, and one
``ValueError`` names each bad line with its line number in the file: an unknown chromosome, a position past the record,
a REF that does not match the reference, an allele that is no sequence of A/C/G/T (symbolic ``<DEL>``, breakends
``N[chr:1[``, ``*``, ``.``, ``N`` or other codes), ALT equal to REF, an allele longer than :data:`MAX_ALLELE` bases. No
line is skipped.

Codon models are refused: a window around a variant has no reading frame of its own (the frame of the gene it falls
in is not in a VCF), and an indel whose length is not a multiple of 3 shifts the frame of everything after it, so
the two windows would be read in different frames.
"""
from __future__ import annotations

import csv
import gzip
import logging
import os
import time
from dataclasses import dataclass
from typing import NamedTuple

from ds4sci.data import FastaRecord
from ds4sci.infer.score import score_records
from ds4sci.progress import progress_bar

logger = logging.getLogger(__name__)

#: The longest REF or ALT allele scored, in bases: 50 bp, the usual boundary between indels and structural variants.
MAX_ALLELE = 50
#: Chromosomes named in an "unknown chromosome" message.
SHOWN_CHROMS = 5
#: Bad lines named in one error message (the count of the others follows).
SHOWN_ERRORS = 20
#: Variants per :func:`~ds4sci.infer.score.score_records` call: bounds memory on a file of millions of variants.
BLOCK = 4096
_BASES = frozenset("ACGT")


@dataclass(frozen=True)
class Variant:
    """One ALT allele of one input line: ``line`` (1-based line in the file), ``chrom``, ``pos`` (1-based, of REF's
    first base), ``id`` (``'.'`` when none), ``ref`` and ``alt`` (uppercase)."""

    line: int
    chrom: str
    pos: int
    id: str
    ref: str
    alt: str


# ----------------------------------------------------------------------------------------------------- reading
def _open_text(path: str):
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rt", encoding="utf-8") if gz else open(path, encoding="utf-8")


def _is_vcf(path: str) -> bool:
    with _open_text(path) as f:
        return f.readline().startswith("##fileformat=VCF")


def _vcf_lines(path: str) -> tuple[list[int], list[tuple[int, str]]]:
    """The line numbers of the data lines of a VCF, and ``(line, message)`` for each data line htslib cannot read
    (fewer than 8 columns, a POS that is not a positive integer, a blank line)."""
    lines, errors = [], []
    with _open_text(path) as f:
        for number, text in enumerate(f, 1):
            if text.startswith("#"):
                continue
            fields = text.rstrip("\r\n").split("\t")
            if not text.strip():
                errors.append((number, "blank line in the body of a VCF"))
            elif len(fields) < 8:
                errors.append((number, f"{len(fields)} tab-separated column(s); a VCF record has at least 8"))
            elif not fields[1].isdigit() or int(fields[1]) < 1:
                errors.append((number, f"POS {fields[1]!r} is not a positive integer"))
            lines.append(number)
    return lines, errors


def _read_vcf(path: str) -> tuple[list[Variant], list[tuple[int, str]]]:
    import pysam

    with open(path, "rb") as f:
        head = f.read(14)
    if head[:2] == b"\x1f\x8b" and not (head[3] & 4 and head[12:14] == b"BC"):  # BGZF: gzip with a 'BC' extra field
        raise ValueError(f"{path}: gzip-compressed but not BGZF, which htslib reads: recompress it with bgzip "
                         f"(gunzip -c {path} | bgzip > OUT.vcf.gz) or decompress it")
    lines, errors = _vcf_lines(path)
    if errors:  # htslib would stop at the first: report them all instead
        return [], errors
    verbosity = pysam.set_verbosity(0)  # htslib's own warnings (a contig missing from the header) stay quiet
    records = []
    try:
        try:
            vcf = pysam.VariantFile(path)
        except (OSError, ValueError) as err:
            raise ValueError(f"{path}: htslib cannot read the VCF header ({err})") from None
        with vcf:
            for rec in vcf:
                records.append(rec)
    except OSError as err:  # a record htslib cannot parse, past the checks of _vcf_lines
        where = f"line {lines[len(records)]}" if len(records) < len(lines) else "after the last record"
        raise ValueError(f"{path}: {where}: htslib cannot read this record ({err})") from None
    finally:
        pysam.set_verbosity(verbosity)
    if len(records) != len(lines):
        raise ValueError(f"{path}: htslib read {len(records)} record(s) from {len(lines)} data line(s)")
    variants = [Variant(line, rec.chrom, rec.pos, rec.id or ".", rec.ref.upper(), alt.upper())
                for line, rec in zip(lines, records) for alt in rec.alts or (".",)]
    return variants, []


def _read_tsv(path: str) -> tuple[list[Variant], list[tuple[int, str]]]:
    variants, errors, columns = [], [], None
    with _open_text(path) as f:
        for number, fields in enumerate(csv.reader(f, delimiter="\t"), 1):
            if not any(field.strip() for field in fields):
                continue
            if columns is None:
                columns = [name.strip().lstrip("#").lower() for name in fields]
                missing = [name for name in ("chrom", "pos", "ref", "alt") if name not in columns]
                if missing:
                    raise ValueError(f"{path}: line {number}: the header names no {', '.join(missing)} column "
                                     f"(expected a tab-separated header with chrom, pos, ref, alt and optionally id; "
                                     f"got {fields})")
                continue
            if fields[0].startswith("#"):
                continue
            if len(fields) != len(columns):
                errors.append((number, f"{len(fields)} column(s), the header has {len(columns)}"))
                continue
            row = dict(zip(columns, (field.strip() for field in fields)))
            if not row["pos"].isdigit() or int(row["pos"]) < 1:
                errors.append((number, f"pos {row['pos']!r} is not a positive integer"))
                continue
            for alt in row["alt"].split(","):
                variants.append(Variant(number, row["chrom"], int(row["pos"]), row.get("id") or ".",
                                        row["ref"].upper(), alt.upper()))
    if columns is None:
        raise ValueError(f"{path}: empty: no header line 'chrom pos ref alt'")
    return variants, errors


def _allele_problem(kind: str, allele: str) -> str | None:
    """Why ``allele`` (REF or ALT) is not a sequence this module scores, or None."""
    if allele in ("", "."):
        return f"no {kind} allele ({allele!r})"
    if allele == "*":
        return f"{kind} '*' (an allele removed by an overlapping deletion) has no sequence"
    if allele.startswith("<"):
        return f"symbolic {kind} allele {allele!r} has no sequence"
    if "[" in allele or "]" in allele:
        return f"breakend {kind} allele {allele!r} has no sequence"
    other = sorted(set(allele) - _BASES)
    if other:
        return f"{kind} {allele!r} holds {', '.join(map(repr, other))}: only A, C, G, T are scored"
    if len(allele) > MAX_ALLELE:
        return f"{kind} of {len(allele)} bases: at most {MAX_ALLELE} are scored (a longer one is a structural variant)"
    return None


def _variant_problem(v: Variant, reference: dict[str, str]) -> str | None:
    """Why ``v`` cannot be scored against ``reference``, or None."""
    problem = _allele_problem("REF", v.ref) or _allele_problem("ALT", v.alt)
    if problem:
        return problem
    if v.alt == v.ref:
        return f"ALT {v.alt!r} equals REF: not a variant"
    if v.chrom not in reference:
        known = list(reference)
        shown = ", ".join(known[:SHOWN_CHROMS]) + (f" and {len(known) - SHOWN_CHROMS} more"
                                                   if len(known) > SHOWN_CHROMS else "")
        return f"unknown chromosome {v.chrom!r} (the reference has {shown})"
    length = len(reference[v.chrom])
    if v.pos - 1 + len(v.ref) > length:
        return f"POS {v.pos} with REF of {len(v.ref)} base(s) runs past the end of {v.chrom} ({length} bases)"
    found = reference[v.chrom][v.pos - 1 : v.pos - 1 + len(v.ref)]
    if found != v.ref:
        return f"REF {v.ref!r} does not match the reference {found!r} at {v.chrom}:{v.pos}"
    return None


def read_variants(path: str | os.PathLike, reference: dict[str, str]) -> list[Variant]:
    """The variants of ``path`` (a VCF, plain or gzip, read with pysam; or a TSV with a header ``chrom pos ref alt``
    [``id``]), one per ALT, in file order, each checked against ``reference`` (record id -> sequence).

    Raises:
        ValueError: one message naming the bad lines, ``PATH: ... line N: why``, joined by ``'; '`` (see the module
            docstring for what is bad; the first :data:`SHOWN_ERRORS`, then how many more); or the file holds no
            variant.
    """
    path = os.fspath(path)
    variants, errors = (_read_vcf if _is_vcf(path) else _read_tsv)(path)
    errors += [(v.line, problem) for v in variants if (problem := _variant_problem(v, reference))]
    if errors:
        errors.sort(key=lambda e: e[0])
        more = f"; and {len(errors) - SHOWN_ERRORS} more" if len(errors) > SHOWN_ERRORS else ""
        raise ValueError(f"{path}: {len(errors)} bad variant(s), nothing scored: "
                         + "; ".join(f"line {line}: {why}" for line, why in errors[:SHOWN_ERRORS]) + more)
    if not variants:
        raise ValueError(f"{path}: no variant")
    return variants


# ----------------------------------------------------------------------------------------------------- windows
def reference_window(pos0: int, ref_len: int, record_len: int, width: int) -> tuple[int, int]:
    """``(start, end)``, 0-based half-open on the record: the ``width`` bases centred on the REF span
    ``[pos0, pos0 + ref_len)``, shifted to lie inside the record (the whole record when it is shorter than
    ``width``). The span lies inside the window whenever ``ref_len <= width``."""
    if record_len <= width:
        return 0, record_len
    start = min(max(pos0 + ref_len // 2 - width // 2, 0), record_len - width)
    return start, start + width


def alt_window(sequence: str, v: Variant, start: int, end: int, equal_length: bool) -> str:
    """The ALT window of ``v`` on its record ``sequence`` whose REF window is ``[start, end)``: with
    ``equal_length`` the ``end - start`` bases of the ALT haplotype (the record with REF replaced by ALT) centred on
    the ALT allele, as :func:`reference_window` centres the REF window on REF (the whole haplotype when it is shorter);
    otherwise the REF window with REF replaced by ALT (``end - start - len(REF) + len(ALT)`` bases)."""
    pos0, ref_len, alt_len = v.pos - 1, len(v.ref), len(v.alt)
    if not equal_length:
        return sequence[start:pos0] + v.alt + sequence[pos0 + ref_len : end]
    # haplotype coordinates: h[i] = sequence[i] before pos0, ALT on [pos0, pos0 + alt_len), then sequence[i - shift]
    shift = alt_len - ref_len
    h_start, h_end = reference_window(pos0, alt_len, len(sequence) + shift, end - start)
    return sequence[h_start:pos0] + v.alt + sequence[pos0 + ref_len : h_end - shift]


class VariantWindows(NamedTuple):
    """The windows of a list of variants: ``keys`` the distinct REF windows ``(chrom, start, end)``, ``ref_of[i]``
    the index in ``keys`` of variant ``i``'s REF window, ``alt[i]`` its ALT window's sequence."""

    keys: list[tuple[str, int, int]]
    ref_of: list[int]
    alt: list[str]


def default_window(context: int, variant: Variant, trained: int | None = None) -> int:
    """The REF window (bases) of ``variant`` when none is asked for, with REF replaced by ALT in the ALT window: the
    model's training length ``trained`` (None: its ``context``), narrowed where needed so that the ALT window fits
    the context (``context`` minus the variant's net insertion). It depends on the variant and the model alone.

    Raises:
        ValueError: the insertion leaves no base of context (naming the variant's line).
    """
    inserted = max(0, len(variant.alt) - len(variant.ref))
    if inserted >= context:
        raise ValueError(f"line {variant.line}: an insertion of {inserted} bases leaves no room for a window in the "
                         f"model's context of {context} tokens")
    return min(context if trained is None else trained, context - inserted)


def variant_windows(reference: dict[str, str], variants: list[Variant], width: int | None, context: int, *,
                    trained: int | None = None, equal_length: bool = True) -> VariantWindows:
    """The REF and ALT windows (module docstring) of ``variants``: REF windows of ``width`` bases, or (None) of the
    model's training length ``trained`` (None: the ``context``), narrowed per variant by :func:`default_window`
    without ``equal_length``. ALT windows: :func:`alt_window`.

    Raises:
        ValueError: ``width`` beyond the context, a REF (or, ``equal_length``, an ALT) longer than its window, or an
            ALT window of an explicit ``width`` longer than ``context`` tokens (each naming the variant's line).
    """
    if width is not None and width < 1:
        raise ValueError(f"--window {width}: must be at least 1 base")
    if width is not None and width > context:
        raise ValueError(f"--window {width} bases exceeds the model's context of {context} tokens")
    index: dict[tuple[str, int, int], int] = {}
    ref_of, alt = [], []
    for v in variants:
        if width is not None:
            w = width
        elif equal_length:
            w = min(context if trained is None else trained, context)
        else:
            w = default_window(context, v, trained)
        longest = max(len(v.ref), len(v.alt)) if equal_length else len(v.ref)
        if longest > w:
            kind = "REF" if len(v.ref) == longest else "ALT"
            raise ValueError(f"line {v.line}: {kind} of {longest} bases does not fit a window of {w} bases")
        sequence = reference[v.chrom]
        start, end = reference_window(v.pos - 1, len(v.ref), len(sequence), w)
        window = alt_window(sequence, v, start, end, equal_length)
        if len(window) > context:
            raise ValueError(f"line {v.line}: the ALT window of {len(window)} bases (--window {w} with "
                             f"{len(v.alt) - len(v.ref)} inserted) exceeds the model's context of {context} tokens; "
                             f"use --window {w - (len(window) - context)} or less, or --equal-length")
        ref_of.append(index.setdefault((v.chrom, start, end), len(index)))
        alt.append(window)
    return VariantWindows(list(index), ref_of, alt)


# ----------------------------------------------------------------------------------------------------- scoring
def check_nucleotide(tokenizer) -> None:
    """``ValueError`` for a codon model (module docstring: a variant's window has no reading frame)."""
    if tokenizer.kind != "nucleotide":
        raise ValueError(f"score-variants needs a nucleotide model; this one reads {tokenizer.kind} tokens, and a "
                         f"window around a variant has no reading frame (an indel would shift it)")


def score_variants(model, tokenizer, reference: dict[str, str], variants: list[Variant], width: int | None = None,
                   *, trained: int | None = None, equal_length: bool = True, batch_size: int = 8,
                   max_tokens: int | None = None, block: int = BLOCK, progress: bool = False,
                   runner=None) -> list[dict]:
    """One row per variant, in order: ``chrom pos id ref alt``, ``llr`` (nats), ``ref_log_likelihood`` and
    ``alt_log_likelihood`` (nats, the mean of both strands), ``window_start`` / ``window_end`` (the REF window,
    0-based half-open on the record, BED's convention).

    ``width``, ``trained``, ``equal_length``: the windows (:func:`variant_windows`). The variants are scored
    ``block`` at a time (memory bounded whatever the file's size), each block's windows in one
    :func:`~ds4sci.infer.score.score_records` call (``seq_len`` = the model's context, ``reverse_complement=True``,
    ``max_tokens`` per forward, padding counted, windows sorted by length: default ``batch_size`` full windows);
    each distinct REF window is scored once, in the first block that needs it.
    ``progress``: a bar over the variants (variants per second) on a terminal, one log line per block otherwise; a
    last line gives the rate. ``runner``: a :class:`~ds4sci.infer.parallel.ShardedForward` to score across ranks
    (default: one process).
    """
    check_nucleotide(tokenizer)
    context = model.config.max_position_embeddings
    windows = variant_windows(reference, variants, width, context, trained=trained, equal_length=equal_length)
    ref_scores: dict[int, float] = {}
    alt_scores: list[float] = []
    began = time.perf_counter()
    writer = runner is None or runner.is_writer
    with progress_bar(progress and writer, total=len(variants), desc="score-variants", unit="variant") as bar:
        for first in range(0, len(variants), block):
            todo = list(dict.fromkeys(k for k in windows.ref_of[first : first + block] if k not in ref_scores))
            sequences = [reference[chrom][start:end] for chrom, start, end in (windows.keys[k] for k in todo)]
            sequences += windows.alt[first : first + block]
            records = [FastaRecord(str(i), "", sequence) for i, sequence in enumerate(sequences)]
            scores = [r["log_likelihood"] for r in score_records(model, tokenizer, records, context, True,
                                                                 batch_size=batch_size, max_tokens=max_tokens,
                                                                 runner=runner)]
            ref_scores.update(zip(todo, scores[: len(todo)]))
            alt_scores += scores[len(todo) :]
            bar.update(len(scores) - len(todo))
            if progress and writer and bar.disable:
                logger.info("score-variants: %d/%d variants, %.1f variants/s", len(alt_scores), len(variants),
                            len(alt_scores) / (time.perf_counter() - began))
    if progress and writer:
        seconds = time.perf_counter() - began
        logger.info("scored %d variant(s) (%d distinct REF windows) in %.1f s: %.1f variants/s", len(variants),
                    len(windows.keys), seconds, len(variants) / seconds)
    rows = []
    for v, k, alt_ll in zip(variants, windows.ref_of, alt_scores):
        _, start, end = windows.keys[k]
        rows.append({"chrom": v.chrom, "pos": v.pos, "id": v.id, "ref": v.ref, "alt": v.alt,
                     "llr": alt_ll - ref_scores[k], "ref_log_likelihood": ref_scores[k],
                     "alt_log_likelihood": alt_ll, "window_start": start, "window_end": end})
    return rows
