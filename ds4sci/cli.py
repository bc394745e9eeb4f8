"""The ``ds4sci`` console script.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``.
Command modules keep heavy imports (deepspeed, torch.distributed) inside ``run`` so ``ds4sci --help``
stays fast. Only subcommands that do something real are listed in ``COMMANDS``.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("ds4sci.info", "show versions, devices and which attention backends are usable here"),
    "train": ("ds4sci.train.cli_train", "train a GenSLM on FASTA data (DeepSpeed, ZeRO, sequence parallelism)"),
    "evaluate": ("ds4sci.train.evaluate", "loss, perplexity and bits per base of an exported model on FASTA"),
    "generate": ("ds4sci.train.generate", "sample sequences from an exported model and write FASTA"),
    "embed": ("ds4sci.train.embed", "per-record mean embeddings of FASTA sequences (.npz)"),
    "bench": ("ds4sci.bench", "run a benchmark and write its results (JSON + Markdown) to --out"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ds4sci",
        description="Evoformer attention kernels and long-context genome language models.",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default: %(default)s)")
    # The `deepspeed` launcher passes --local_rank=N before the command (it also sets LOCAL_RANK, which is what
    # the trainer reads); accepted here so `deepspeed --module ds4sci.cli train ...` works.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
