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


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """``--ulysses`` and ``--ring``: the sequence-parallel degrees a command reads each window with under ``torchrun``
    (:class:`ds4sci.infer.parallel.ShardedForward`); checked by :func:`check_parallel`."""
    parser.add_argument("--ulysses", type=positive_int, default=1,
                        help="Ulysses degree: ranks that split each window's heads by an all-to-all (default: 1)")
    parser.add_argument("--ring", type=positive_int, default=1,
                        help="ring-attention degree: ranks that pass key/value blocks around (default: 1); under "
                        "torchrun --nproc-per-node P, P / (ulysses x ring) data ranks share the windows")


def check_parallel(args: argparse.Namespace, model_config, world_size: int) -> None:
    """``--ulysses`` x ``--ring`` against the launch (``world_size`` processes) and the model: more than one
    sequence rank without a launcher, a world size they do not divide, or a Ulysses degree that does not divide the
    heads, each one :class:`CommandError` naming the numbers."""
    sp = args.ulysses * args.ring
    if world_size % sp:
        how = ("run it under torchrun --nproc-per-node with a multiple of that" if world_size == 1
               else f"launch a multiple of {sp} processes")
        raise CommandError(f"--ulysses {args.ulysses} x --ring {args.ring} = {sp} sequence ranks do not divide the "
                           f"{world_size} process(es) of this launch: {how}")
    heads = model_config.num_heads
    if heads % args.ulysses:
        raise CommandError(f"--ulysses {args.ulysses} must divide the model's {heads} attention heads (the ring "
                           f"degree carries the rest)")


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """``--device`` of the commands that run a model (:func:`ds4sci.infer.parallel.inference_device`)."""
    parser.add_argument("--device", default="auto",
                        help="where the model runs: auto (this process's GPU, cuda:LOCAL under torchrun, srun or "
                        "mpiexec with LOCAL its local rank, when CUDA is available, else the CPU), cpu, cuda or cuda:N "
                        "(default: %(default)s)")
