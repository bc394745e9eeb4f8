"""``ds4sci score MODEL --fasta FILE --out scores.tsv``: the log-likelihood of every record
(:mod:`ds4sci.infer.score`), one TSV row each."""
from __future__ import annotations

import argparse
import logging
import sys

from ds4sci.cli_args import CommandError
from ds4sci.cli_args import add_device_argument
from ds4sci.cli_args import add_model_argument
from ds4sci.cli_args import add_out_argument
from ds4sci.cli_args import out_folder
from ds4sci.commands.inference import add_reading_arguments
from ds4sci.commands.inference import add_record_arguments
from ds4sci.commands.inference import load_reader
from ds4sci.commands.inference import write_records

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
    add_record_arguments(parser)


def tsv_row(row: dict) -> str:
    """A score row as its TSV line (no newline), the columns of :data:`COLUMNS`."""
    return "\t".join([row["id"], str(row["length"]), str(row["tokens"]), f"{row['log_likelihood']:.6f}",
                      f"{row['bits_per_base']:.6f}"])


def run(args: argparse.Namespace) -> int:
    import os

    from ds4sci.data import read_fasta
    from ds4sci.infer.length import default_length
    from ds4sci.infer.score import score_records
    from ds4sci.infer.score import score_stream

    if args.resume and args.out == "-":
        raise CommandError("--resume needs an --out file (its OUT.parts/ folder holds what was written)")
    out_folder(args.out)
    model, _, tokenizer, runner = load_reader(args)
    seq_len = args.seq_len or default_length(args.export, model.config)
    options = dict(stride=args.stride, max_tokens=args.max_tokens_per_batch, pack=args.pack,
                   batch_size=args.batch_size)
    if args.out == "-":
        rows = score_records(model, tokenizer, read_fasta(args.fasta), seq_len, args.reverse_complement,
                             progress=not args.no_progress, runner=runner, **options)
        if runner.is_writer:
            sys.stdout.write("\t".join(COLUMNS) + "\n" + "".join(tsv_row(r) + "\n" for r in rows))
        return 0
    records = list(read_fasta(args.fasta))

    def stream(skip, progress):
        for index, row in score_stream(model, tokenizer, records, seq_len, args.reverse_complement, skip=skip,
                                       progress=progress, runner=runner, **options):
            yield index, tsv_row(row)

    job = {"command": "score", "export": os.path.abspath(args.export), "seq_len": seq_len,
              "stride": args.stride, "reverse_complement": args.reverse_complement,
              "batch_size": args.batch_size, "max_tokens": args.max_tokens_per_batch, "pack": args.pack}
    count = write_records(args, runner, job, stream, "tsv", "score", len(records), "\t".join(COLUMNS))
    if count:
        logger.info("wrote the scores of %d record(s) to %s", count, args.out)
    return 0
