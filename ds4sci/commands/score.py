"""``ds4sci score MODEL --fasta FILE --out scores.tsv``: the log-likelihood of every record
(:mod:`ds4sci.infer.score`), one TSV row each."""
from __future__ import annotations

import argparse
import csv
import logging
import sys

from ds4sci.cli_args import add_device_argument
from ds4sci.cli_args import add_model_argument
from ds4sci.cli_args import add_out_argument
from ds4sci.cli_args import out_folder
from ds4sci.commands.inference import add_reading_arguments
from ds4sci.commands.inference import load_reader

logger = logging.getLogger(__name__)

COLUMNS = ("id", "length", "tokens", "log_likelihood", "bits_per_base")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    add_device_argument(parser)
    parser.add_argument("--fasta", required=True, help="FASTA file whose records are scored")
    add_out_argument(parser, "score", "scores.tsv", "output TSV with a header line: " + ", ".join(COLUMNS) +
                     " ('-': stdout)")
    parser.add_argument("--reverse-complement", action="store_true",
                        help="nucleotide models: average the log-likelihoods of both strands")
    add_reading_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from ds4sci.data import read_fasta
    from ds4sci.infer.length import default_length
    from ds4sci.infer.score import score_records

    out_folder(args.out)
    model, _, tokenizer, runner = load_reader(args)
    rows = score_records(model, tokenizer, read_fasta(args.fasta),
                         args.seq_len or default_length(args.export, model.config), args.reverse_complement,
                         stride=args.stride, batch_size=args.batch_size, progress=not args.no_progress, runner=runner)
    if not runner.is_writer:
        return 0
    out = sys.stdout if args.out == "-" else open(args.out, "w", newline="", encoding="utf-8")
    try:
        writer = csv.writer(out, delimiter="\t", lineterminator="\n")
        writer.writerow(COLUMNS)
        for r in rows:
            writer.writerow([r["id"], r["length"], r["tokens"], f"{r['log_likelihood']:.6f}",
                             f"{r['bits_per_base']:.6f}"])
    finally:
        if out is not sys.stdout:
            out.close()
    if args.out != "-":
        logger.info("wrote the scores of %d record(s) to %s", len(rows), args.out)
    return 0
