"""``ds4sci evaluate MODEL --fasta FILE``: loss, perplexity and bits per base over real tokens
(:mod:`ds4sci.infer.evaluate`)."""
from __future__ import annotations

import argparse
import json

from ds4sci.cli_args import (add_device_argument, add_model_argument, add_parallel_arguments, add_window_arguments,
                             check_parallel, check_windows, positive_int)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    add_device_argument(parser)
    parser.add_argument("--fasta", required=True, help="FASTA file to score")
    add_window_arguments(parser)
    add_parallel_arguments(parser)
    parser.add_argument("--batch-size", type=positive_int, default=8, help="windows per forward (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    from ds4sci.infer.evaluate import evaluate, windows
    from ds4sci.infer.parallel import ShardedForward, inference_device, launch_world_size
    from ds4sci.io.weights import load_model

    model, config, tokenizer = load_model(args.export, inference_device(args.device))
    check_windows(args, config)
    check_parallel(args, config, launch_world_size())
    runner = ShardedForward.from_world(model, args.ulysses, args.ring)
    dataset = windows(config, tokenizer, args.fasta, args.seq_len, args.stride)
    result = evaluate(model, tokenizer, dataset, args.batch_size, runner)
    if not runner.is_writer:
        return 0
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>14}: {value:.4f}" if isinstance(value, float) else f"{key:>14}: {value}")
    return 0
