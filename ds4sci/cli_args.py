"""Argument helpers the command modules share: argparse ``type=`` checks, the model argument, and
:class:`CommandError` for a mistake found after parsing. No heavy imports, so ``ds4sci --help`` stays fast."""
from __future__ import annotations

import argparse


class CommandError(Exception):
    """A user's mistake a command finds after parsing (e.g. ``--seq-len`` beyond the model's context):
    :func:`ds4sci.cli.main` prints the message as one line and exits with status 2, like an argparse error."""


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
                        help="a ds4sci export (OUT_DIR/export of ds4sci train), a Hugging Face GPT-NeoX or Llama "
                        "directory or a GenSLM / PyTorch checkpoint file (.pt, .ckpt, .bin, .safetensors) that keeps "
                        "its config")


def add_window_arguments(parser: argparse.ArgumentParser) -> None:
    """``--seq-len`` and ``--stride``: the windows a command reads records through
    (:func:`ds4sci.infer.evaluate.record_windows`); checked against the model by :func:`check_windows`."""
    parser.add_argument("--seq-len", type=positive_int, default=None,
                        help="window length in tokens, at most the model's context (default: the model's context)")
    parser.add_argument("--stride", type=positive_int, default=None,
                        help="tokens between window starts, at most --seq-len (default: --seq-len, windows that do "
                        "not overlap); a smaller stride gives every token after the first window at least "
                        "seq_len - stride tokens of context, at seq_len / stride times the compute")


def check_windows(args: argparse.Namespace, model_config) -> None:
    """``--seq-len`` beyond the model's context, or ``--stride`` beyond the window: one :class:`CommandError`
    naming both numbers."""
    context = model_config.max_position_embeddings
    if args.seq_len is not None and args.seq_len > context:
        raise CommandError(f"--seq-len {args.seq_len} exceeds the model's context of {context} tokens")
    window = args.seq_len or context
    if args.stride is not None and args.stride > window:
        raise CommandError(f"--stride {args.stride} exceeds the window of {window} tokens "
                           f"({'--seq-len' if args.seq_len else 'the model context'}): windows would skip tokens")
