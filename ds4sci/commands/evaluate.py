"""``ds4sci evaluate MODEL --fasta FILE``: loss, perplexity and bits per base over real tokens
(:mod:`ds4sci.infer.evaluate`)."""
from __future__ import annotations

import argparse
import json

from ds4sci.cli_args import add_device_argument
from ds4sci.cli_args import add_model_argument
from ds4sci.commands.inference import add_reading_arguments
from ds4sci.commands.inference import load_reader


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    add_device_argument(parser)
    parser.add_argument("--fasta", required=True, help="FASTA file to score")
    add_reading_arguments(parser, progress=False)
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    from ds4sci.infer.evaluate import evaluate
    from ds4sci.infer.evaluate import windows
    from ds4sci.infer.length import default_length

    model, config, tokenizer, runner = load_reader(args)
    dataset = windows(config, tokenizer, args.fasta, args.seq_len or default_length(args.export, config), args.stride)
    result = evaluate(model, tokenizer, dataset, args.batch_size, runner)
    if not runner.is_writer:
        return 0
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>14}: {value:.4f}" if isinstance(value, float) else f"{key:>14}: {value}")
    return 0
