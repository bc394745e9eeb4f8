"""``ds4sci predict MODEL (--fasta FILE | --table FILE) --out predictions.tsv``: a fine-tuned task model's
predictions (:mod:`ds4sci.infer.predict`), one TSV row per record, or per token for a token task."""
from __future__ import annotations

import argparse
import csv
import logging
import sys

from ds4sci.cli_args import add_device_argument
from ds4sci.cli_args import add_out_argument
from ds4sci.cli_args import out_folder
from ds4sci.cli_args import positive_int

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("export", metavar="MODEL", help="a fine-tuned task model: OUT_DIR/export of a ds4sci train "
                        "run with a task: section (task.json, head.safetensors, and the weights or LoRA adapter)")
    add_device_argument(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--fasta", help="FASTA file of the records")
    source.add_argument("--table", help="TSV (or CSV) with columns id and sequence")
    add_out_argument(parser, "predict", "predictions.tsv", "output TSV: id, length (or position for a token task), "
                     "then p_CLASS per class or the regression targets ('-': stdout)")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="records per forward (default: 8)")


def run(args: argparse.Namespace) -> int:
    from ds4sci.data import read_fasta
    from ds4sci.infer.parallel import inference_device
    from ds4sci.infer.predict import output_names
    from ds4sci.infer.predict import predict_records
    from ds4sci.infer.predict import read_table_records
    from ds4sci.io.task_model import load_task_model

    model, tokenizer = load_task_model(args.export, device=inference_device(args.device))
    records = ((r.id, r.sequence) for r in read_fasta(args.fasta)) if args.fasta else read_table_records(args.table)
    out_folder(args.out)
    out = sys.stdout if args.out == "-" else open(args.out, "w", newline="", encoding="utf-8")
    n = 0
    try:
        writer = csv.writer(out, delimiter="\t", lineterminator="\n")
        writer.writerow(["id", "position" if model.spec.per_token else "length", *output_names(model)])
        for row in predict_records(model, tokenizer, records, args.batch_size):
            where = row["position"] if model.spec.per_token else row["length"]
            writer.writerow([row["id"], where, *(f"{v:.6g}" for v in row["values"])])
            n += 1
    finally:
        if out is not sys.stdout:
            out.close()
    if args.out != "-":
        logger.info("wrote %d prediction row(s) to %s", n, args.out)
    return 0
