"""``ds4sci score-variants MODEL --reference REF.fa --vcf VARIANTS.vcf --out scores.tsv``: the log-likelihood ratio
of every variant (:mod:`ds4sci.infer.variants`), one TSV row each, in input order."""
from __future__ import annotations

import argparse
import csv
import logging
import sys

from ds4sci.cli_args import CommandError
from ds4sci.cli_args import add_device_argument
from ds4sci.cli_args import add_model_argument
from ds4sci.cli_args import add_out_argument
from ds4sci.cli_args import out_folder
from ds4sci.cli_args import positive_int
from ds4sci.commands.inference import add_reading_arguments
from ds4sci.commands.inference import add_token_budget_argument
from ds4sci.commands.inference import load_reader

logger = logging.getLogger(__name__)

COLUMNS = ("chrom", "pos", "id", "ref", "alt", "llr", "ref_log_likelihood", "alt_log_likelihood", "window_start",
           "window_end")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    add_device_argument(parser)
    parser.add_argument("--reference", required=True, help="reference FASTA (plain or .gz); VCF CHROM names its "
                        "record ids")
    parser.add_argument("--vcf", required=True, metavar="VARIANTS",
                        help="variants: a VCF (.vcf or bgzipped .vcf.gz; one variant per ALT) or a TSV with a header "
                        "naming chrom, pos (1-based), ref, alt and optionally id")
    add_out_argument(parser, "score-variants", "variant_scores.tsv", "output TSV with a header line: " +
                     ", ".join(COLUMNS) + " (window_start/window_end: the REF window, 0-based half-open; '-': stdout)")
    parser.add_argument("--window", type=positive_int, default=None,
                        help="bases of the REF window centred on each variant (shifted inside the record near its "
                        "ends; the whole record when shorter) (default: the length the model was trained on, as its "
                        "export records it; the model's context for one that records none)")
    parser.add_argument("--equal-length", action=argparse.BooleanOptionalAction, default=True,
                        help="ALT windows of as many bases as the REF window, cut from the ALT haplotype centred on "
                        "ALT (default: on, as Evo 2's maintainers recommend: with windows of different lengths an "
                        "indel's LLR mostly measures the bases one window has and the other lacks); "
                        "--no-equal-length: the REF window with REF replaced by ALT. SNVs score the same either way")
    add_reading_arguments(parser, windows=False)
    add_token_budget_argument(parser)


def write_rows(rows: list[dict], out: str) -> None:
    """``rows`` of :func:`~ds4sci.infer.variants.score_variants` as a TSV at ``out`` (``'-'``: stdout)."""
    handle = sys.stdout if out == "-" else open(out, "w", newline="", encoding="utf-8")
    try:
        writer = csv.writer(handle, delimiter="\t", lineterminator="\n")
        writer.writerow(COLUMNS)
        for r in rows:
            writer.writerow([r["chrom"], r["pos"], r["id"], r["ref"], r["alt"], f"{r['llr']:.6f}",
                             f"{r['ref_log_likelihood']:.6f}", f"{r['alt_log_likelihood']:.6f}", r["window_start"],
                             r["window_end"]])
    finally:
        if handle is not sys.stdout:
            handle.close()


def run(args: argparse.Namespace) -> int:
    from ds4sci.data import read_fasta
    from ds4sci.infer.length import default_length
    from ds4sci.infer.variants import check_nucleotide
    from ds4sci.infer.variants import read_variants
    from ds4sci.infer.variants import score_variants

    def check(config, tokenizer) -> None:
        check_nucleotide(tokenizer)  # before the reference is read

    out_folder(args.out)
    model, _, tokenizer, runner = load_reader(args, windows=False, check=check)
    reference = {}
    for rec in read_fasta(args.reference):
        if rec.id in reference:
            raise CommandError(f"{args.reference}: record id {rec.id!r} appears twice (line {rec.line})")
        reference[rec.id] = rec.sequence
    variants = read_variants(args.vcf, reference)
    trained = default_length(args.export, model.config) if args.window is None else None
    try:
        rows = score_variants(model, tokenizer, reference, variants, args.window, trained=trained,
                              equal_length=args.equal_length, batch_size=args.batch_size,
                              max_tokens=args.max_tokens_per_batch, progress=not args.no_progress, runner=runner)
    except ValueError as err:  # a variant its window cannot hold: name the file beside the line
        raise CommandError(f"{args.vcf}: {err}") from None
    if not runner.is_writer:
        return 0
    write_rows(rows, args.out)
    if args.out != "-":
        logger.info("wrote the scores of %d variant(s) to %s", len(rows), args.out)
    return 0
