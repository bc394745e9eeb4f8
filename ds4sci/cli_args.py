"""Argument helpers the command modules share: argparse ``type=`` checks, the model argument, and
:class:`CommandError` for a mistake found after parsing. No heavy imports, so ``ds4sci --help`` stays fast."""
from __future__ import annotations

import argparse
import importlib
from pathlib import Path


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
                        help="window length in tokens, at most the model's context (default: the length the model "
                        "was trained on, as its export records it; the context for a model that records none)")
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


class LazyParser(argparse.ArgumentParser):
    """The parser of a subcommand whose options come from a module (``add_arguments(parser)``, ``run(args)``) that
    is imported only when this subcommand is parsed or its help shown: ``parser_class=`` of ``add_subparsers``, with
    ``add_parser(name, module=MODULE_NAME, ...)``. Listing the subcommands (``ds4sci bench --help``) then imports
    none of their modules (nor torch); ``run`` is set as the ``run_key`` default."""

    def __init__(self, *args, module: str | None = None, run_key: str = "_run", **kwargs):
        super().__init__(*args, **kwargs)
        self.module, self.run_key = module, run_key

    def load(self) -> None:
        """Import the module and add its options (once; a reference generator calls it to see every option)."""
        if self.module is None:
            return
        module, self.module = importlib.import_module(self.module), None
        module.add_arguments(self)
        self.set_defaults(**{self.run_key: module.run})

    def parse_known_args(self, args=None, namespace=None):
        self.load()
        return super().parse_known_args(args, namespace)


def add_out_argument(parser: argparse.ArgumentParser, command: str, name: str, what: str) -> None:
    """``--out`` of a command that writes one file, by default ``runs/COMMAND/NAME``: ``runs/`` is git-ignored, so a
    workflow run in a clone leaves no untracked file in it. :func:`out_folder` makes the file's folder."""
    parser.add_argument("--out", default=f"runs/{command}/{name}", help=f"{what} (default: %(default)s; its folder "
                        "is made)")


def out_folder(out: str) -> None:
    """Make the folder of output file ``out`` (``'-'``, stdout: nothing), before the work that fills it."""
    if out != "-":
        Path(out).parent.mkdir(parents=True, exist_ok=True)
