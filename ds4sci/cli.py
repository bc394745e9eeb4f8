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


class CommandError(Exception):
    """A user's mistake a command finds after parsing (e.g. ``--seq-len`` beyond the model's context):
    :func:`main` prints the message as one line and exits with status 2, like an argparse error."""


def _number(kind, text: str, ok, requirement: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {requirement}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {requirement}, got {text}")
    return value


def positive_int(text: str) -> int:
    """argparse ``type=``: an integer >= 1."""
    return _number(int, text, lambda v: v >= 1, "a positive integer")


def nonnegative_int(text: str) -> int:
    """argparse ``type=``: an integer >= 0."""
    return _number(int, text, lambda v: v >= 0, "an integer >= 0")


def nonnegative_float(text: str) -> float:
    """argparse ``type=``: a finite number >= 0."""
    return _number(float, text, lambda v: 0 <= v < float("inf"), "a finite number >= 0")


def probability(text: str) -> float:
    """argparse ``type=``: a number in (0, 1]."""
    return _number(float, text, lambda v: 0 < v <= 1, "a number in (0, 1]")

def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """The positional ``export`` argument of the commands that load a trained model (:func:`ds4sci.load_model`)."""
    parser.add_argument("export", metavar="MODEL",
                        help="a ds4sci export (OUT_DIR/export of ds4sci train), a Hugging Face GPT-NeoX directory or "
                        "a GenSLM / PyTorch checkpoint file (.pt, .ckpt, .bin, .safetensors) that keeps its config")

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("ds4sci.info", "show versions, devices and which attention backends are usable here"),
    "train": ("ds4sci.train.cli_train", "train a GenSLM on FASTA data (DeepSpeed, ZeRO, sequence parallelism)"),
    "evaluate": ("ds4sci.train.evaluate", "loss, perplexity and bits per base of an exported model on FASTA"),
    "generate": ("ds4sci.train.generate", "sample sequences from an exported model and write FASTA"),
    "embed": ("ds4sci.train.embed", "per-record mean embeddings of FASTA sequences (.npz)"),
    "score": ("ds4sci.train.score", "per-record log-likelihood and bits per base of FASTA sequences (TSV)"),
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
