"""Variant-effect scores of a nucleotide GenSLM: the log-likelihood ratio of each variant (``ds4sci score-variants``).

The zero-shot score genome language models give a variant (Meier et al. 2021's masked-marginal idea in its
autoregressive form; Benegas et al. 2023, GPN; Evo 2's variant-effect scoring): the total log-likelihood of a window
of the genome carrying the alternative allele minus that of the same window carrying the reference allele,

    llr = log p(ALT window) - log p(REF window)    (nats; negative: the model finds the variant less likely),

each window's log-likelihood the mean of both strands, exactly as ``ds4sci score --reverse-complement`` computes it
(:func:`ds4sci.infer.score.score_records`, which every window here goes through, in one call).

Windows (:func:`reference_window`): the REF window holds ``W`` bases of the record around the variant's REF span,
centred on it (``start = pos0 + len(REF) // 2 - W // 2``) and shifted, not cut, where it would run past either end of
the record, so every window has ``W`` bases; a record shorter than ``W`` is its own window. The ALT window is the REF
window with REF replaced by ALT (``W - len(REF) + len(ALT)`` bases). Variants whose REF windows coincide (several ALTs
at one site, neighbours near a record end, where the shifted windows are the same) share one REF window, scored once.
Every window must fit the model's context (one window of ``score_records``): the default ``W`` is the context minus
the longest insertion's net length.

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
import os
from dataclasses import dataclass
from typing import NamedTuple

from ds4sci.data import FastaRecord
from ds4sci.infer.score import score_records

#: The longest REF or ALT allele scored, in bases: 50 bp, the usual boundary between indels and structural variants.
MAX_ALLELE = 50
#: Chromosomes named in an "unknown chromosome" message.
SHOWN_CHROMS = 5
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
        ValueError: one message naming every bad line, ``PATH line N: why``, joined by ``'; '`` (see the module
            docstring for what is bad); or the file holds no variant.
    """
    path = os.fspath(path)
    variants, errors = (_read_vcf if _is_vcf(path) else _read_tsv)(path)
    errors += [(v.line, problem) for v in variants if (problem := _variant_problem(v, reference))]
    if errors:
        errors.sort(key=lambda e: e[0])
        raise ValueError(f"{path}: {len(errors)} bad variant(s), nothing scored: "
                         + "; ".join(f"line {line}: {why}" for line, why in errors))
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


class VariantWindows(NamedTuple):
    """The windows of a list of variants: ``keys`` the distinct REF windows ``(chrom, start, end)``, ``ref_of[i]``
    the index in ``keys`` of variant ``i``'s REF window, ``alt[i]`` its ALT window's sequence."""

    keys: list[tuple[str, int, int]]
    ref_of: list[int]
    alt: list[str]


def default_window(context: int, variants: list[Variant]) -> int:
    """The widest ``W`` (bases) whose ALT windows all fit ``context`` tokens: the context minus the longest net
    insertion (``ValueError`` naming its line when that leaves no base)."""
    longest = max(variants, key=lambda v: len(v.alt) - len(v.ref))
    inserted = max(0, len(longest.alt) - len(longest.ref))
    if inserted >= context:
        raise ValueError(f"line {longest.line}: an insertion of {inserted} bases leaves no room for a window in the "
                         f"model's context of {context} tokens")
    return context - inserted


def variant_windows(reference: dict[str, str], variants: list[Variant], width: int, context: int) -> VariantWindows:
    """The REF and ALT windows (module docstring) of ``variants`` with REF windows of ``width`` bases.

    Raises:
        ValueError: ``width`` below the longest REF, or an ALT window longer than ``context`` tokens (naming the
            variant's line, ``width`` and the context).
    """
    if width < 1:
        raise ValueError(f"--window {width}: must be at least 1 base")
    if width > context:
        raise ValueError(f"--window {width} bases exceeds the model's context of {context} tokens")
    index: dict[tuple[str, int, int], int] = {}
    ref_of, alt = [], []
    for v in variants:
        if len(v.ref) > width:
            raise ValueError(f"line {v.line}: REF of {len(v.ref)} bases does not fit a --window of {width} bases")
        sequence = reference[v.chrom]
        start, end = reference_window(v.pos - 1, len(v.ref), len(sequence), width)
        alt_window = sequence[start : v.pos - 1] + v.alt + sequence[v.pos - 1 + len(v.ref) : end]
        if len(alt_window) > context:
            raise ValueError(f"line {v.line}: the ALT window of {len(alt_window)} bases (--window {width} with "
                             f"{len(v.alt) - len(v.ref)} inserted) exceeds the model's context of {context} tokens; "
                             f"use --window {width - (len(alt_window) - context)} or less")
        ref_of.append(index.setdefault((v.chrom, start, end), len(index)))
        alt.append(alt_window)
    return VariantWindows(list(index), ref_of, alt)


# ----------------------------------------------------------------------------------------------------- scoring
def check_nucleotide(tokenizer) -> None:
    """``ValueError`` for a codon model (module docstring: a variant's window has no reading frame)."""
    if tokenizer.kind != "nucleotide":
        raise ValueError(f"score-variants needs a nucleotide model; this one reads {tokenizer.kind} tokens, and a "
                         f"window around a variant has no reading frame (an indel would shift it)")


def score_variants(model, tokenizer, reference: dict[str, str], variants: list[Variant], width: int | None = None,
                   *, batch_size: int = 8, progress: bool = False, runner=None) -> list[dict]:
    """One row per variant, in order: ``chrom pos id ref alt``, ``llr`` (nats), ``ref_log_likelihood`` and
    ``alt_log_likelihood`` (nats, the mean of both strands), ``window_start`` / ``window_end`` (the REF window,
    0-based half-open on the record, BED's convention). The distinct REF windows and the ALT windows go through ONE
    :func:`~ds4sci.infer.score.score_records` call with ``seq_len`` = the model's context and
    ``reverse_complement=True``, each REF window once.

    ``width``: REF window in bases (default :func:`default_window`); ``runner``: a
    :class:`~ds4sci.infer.parallel.ShardedForward` to score across ranks (default: one process).
    """
    check_nucleotide(tokenizer)
    context = model.config.max_position_embeddings
    width = default_window(context, variants) if width is None else width
    windows = variant_windows(reference, variants, width, context)
    records = [FastaRecord(f"ref{k}", "", reference[chrom][start:end]) for k, (chrom, start, end) in
               enumerate(windows.keys)]
    records += [FastaRecord(f"alt{i}", "", sequence) for i, sequence in enumerate(windows.alt)]
    scores = [r["log_likelihood"] for r in score_records(model, tokenizer, records, context, True,
                                                         batch_size=batch_size, progress=progress, runner=runner)]
    ref_scores, alt_scores = scores[: len(windows.keys)], scores[len(windows.keys) :]
    rows = []
    for v, k, alt_ll in zip(variants, windows.ref_of, alt_scores):
        _, start, end = windows.keys[k]
        rows.append({"chrom": v.chrom, "pos": v.pos, "id": v.id, "ref": v.ref, "alt": v.alt,
                     "llr": alt_ll - ref_scores[k], "ref_log_likelihood": ref_scores[k],
                     "alt_log_likelihood": alt_ll, "window_start": start, "window_end": end})
    return rows
