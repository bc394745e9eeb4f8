"""The ``ds4sci`` console script (``python -m ds4sci.cli``): the parser and :func:`main`.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``
(:mod:`ds4sci.commands` for training and the model commands; the argument helpers they share are in
:mod:`ds4sci.cli_args`). Command modules keep heavy imports (deepspeed, torch.distributed) inside ``run`` so
``ds4sci --help`` stays fast. Only subcommands that do something real are listed in ``COMMANDS``.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from ds4sci.cli_args import CommandError

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("ds4sci.info", "show versions, devices and which attention backends are usable here"),
    "train": ("ds4sci.commands.train", "train a GenSLM on FASTA data (DeepSpeed, ZeRO, sequence parallelism)"),
    "evaluate": ("ds4sci.commands.evaluate", "loss, perplexity and bits per base of an exported model on FASTA"),
    "generate": ("ds4sci.commands.generate", "sample sequences from an exported model and write FASTA"),
    "embed": ("ds4sci.commands.embed", "per-record mean embeddings of FASTA sequences (.npz)"),
    "score": ("ds4sci.commands.score", "per-record log-likelihood and bits per base of FASTA sequences (TSV)"),
    "bench": ("ds4sci.bench", "run a benchmark and write its results (JSON + Markdown) to --out"),
    "plan": ("ds4sci.plan", "predict per-GPU memory and communication of parallel layouts; list those that fit"),
}


def command_in(argv: list[str]) -> str | None:
    """The command named in ``argv`` (its first positional argument), or None."""
    takes_value = {"--log-level", "--local_rank", "--local-rank"}
    skip = False
    for token in argv:
        if skip:
            skip = False
        elif token in takes_value:
            skip = True
        elif not token.startswith("-"):
            return token if token in COMMANDS else None
    return None


def build_parser(commands: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``ds4sci`` parser. Only the command modules named in ``commands`` (all when None) are imported to add
    their options; the others are listed by name and help, so ``ds4sci --help`` imports no torch."""
    parser = argparse.ArgumentParser(
        prog="ds4sci",
        description="Evoformer attention kernels and long-context genome language models.",
    )
    parser.add_argument("--log-level", default="INFO", type=str.upper,
                        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
                        help="logging level (default: %(default)s; DEBUG also shows the traceback of an error)")
    # The `deepspeed` launcher passes --local_rank=N before the command (it also sets LOCAL_RANK, which is what
    # the trainer reads); accepted here so `deepspeed --module ds4sci.cli train ...` works.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if commands is None or name in commands:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command. A user's mistake (a bad option, a missing file, an export or FASTA the command cannot
    use) is one ``ds4sci COMMAND: error: ...`` line on stderr and exit status 2; ``--log-level DEBUG`` re-raises it
    with its traceback."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser([command_in(argv)]).parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return int(args._run(args) or 0)
    except (CommandError, ValueError, OSError) as err:
        if logging.getLogger().isEnabledFor(logging.DEBUG):
            raise
        print(f"ds4sci {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
