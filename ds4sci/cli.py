"""The ``ds4sci`` console script (``python -m ds4sci.cli``): the parser and :func:`main`.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``
(:mod:`ds4sci.commands` for training and the model commands; the argument helpers they share are in
:mod:`ds4sci.cli_args`). Command modules keep heavy imports (deepspeed, torch.distributed) inside ``run`` so
``ds4sci --help`` stays fast. Only subcommands that do something real are listed in ``COMMANDS``.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib
import logging
import os
import signal
import sys
import time
from pathlib import Path

from ds4sci.cli_args import CommandError
from ds4sci.distributed.launch import launch_rank
from ds4sci.progress import quiet_dependencies

logger = logging.getLogger(__name__)

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("ds4sci.commands.info", "show versions, devices and which attention backends are usable here"),
    "train": ("ds4sci.commands.train", "train a GenSLM on FASTA data (DeepSpeed, ZeRO, sequence parallelism)"),
    "evaluate": ("ds4sci.commands.evaluate", "loss, perplexity and bits per base of an exported model on FASTA"),
    "generate": ("ds4sci.commands.generate", "sample sequences from an exported model and write FASTA"),
    "embed": ("ds4sci.commands.embed", "per-record mean embeddings of FASTA sequences (.npz)"),
    "score": ("ds4sci.commands.score", "per-record log-likelihood and bits per base of FASTA sequences (TSV)"),
    "score-variants": ("ds4sci.commands.score_variants", "log-likelihood ratio ALT vs REF of each variant of a VCF "
                       "(or TSV) in a window of the reference (TSV)"),
    "predict": ("ds4sci.commands.predict", "a fine-tuned task model's predictions for FASTA or table records, one "
                "TSV row per record (or per token)"),
    "probe": ("ds4sci.commands.probe", "a linear probe (logistic or ridge, cross-validated) on a model's frozen "
              "embeddings of labelled sequences: test metrics to metrics.json"),
    "merge": ("ds4sci.commands.merge", "fold a fine-tuned task model's LoRA adapters into its weights: a plain "
              "ds4sci export with its head"),
    "export-hf": ("ds4sci.commands.export_hf", "write a model as a Hugging Face transformers directory "
                  "(GPTNeoXForCausalLM or LlamaForCausalLM, and its tokenizer)"),
    "bench": ("ds4sci.bench", "run a benchmark and write its results (JSON + Markdown) to --out"),
    "plan": ("ds4sci.commands.plan", "predict per-GPU memory and communication of parallel layouts; list those "
             "that fit"),
    "plan-evoformer": ("ds4sci.commands.plan_evoformer", "predict per-GPU memory of an Evoformer / Pairformer trunk "
                       "on 1 GPU, 1-D axial or a 2-D mesh; --max-crop: the longest crop that fits"),
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


#: Seconds a rank other than 0 waits, after a user's error, before it reports the error itself
#: (see :func:`report_error`).
ERROR_WAIT_S = 20.0


#: How a launcher's process shows in its command line (``/proc/PID/cmdline``): torchrun (its script, or ``python -m
#: torch.distributed.run``) and the per-node launcher of ``deepspeed`` (``python -m deepspeed.launcher.launch``).
LAUNCHERS = ("torchrun", "torch.distributed.run", "deepspeed.launcher.launch")


def stop_with_launcher() -> None:
    """A worker started by a launcher (torchrun, DeepSpeed's) stops when the launcher dies: the kernel sends it SIGTERM
    (``prctl(PR_SET_PDEATHSIG)``, Linux). Without it, a launcher killed with ``kill -9`` (or by the OOM killer) leaves
    its workers training on, into the run folder, holding its lock.

    Only when this process's parent is a launcher (``LOCAL_RANK`` set, and the parent's command line names one of
    :data:`LAUNCHERS`): a process that merely inherited a launcher's environment keeps running when its parent exits.
    The signal follows the parent thread that started the worker (torchrun and DeepSpeed's launcher start workers
    from their main thread, which lives as long as they do). A launcher that dies before the call leaves the worker
    to a new parent, so the parent is checked again after the call, and the worker stops at once if it changed.
    DeepSpeed's ``deepspeed`` command starts the launcher as its own child: ``kill -9`` of that command leaves the
    launcher, and with it its workers, running (``kill`` without ``-9`` is forwarded, and stops them)."""
    if "LOCAL_RANK" not in os.environ or not sys.platform.startswith("linux"):
        return
    launcher = os.getppid()
    try:
        args = Path(f"/proc/{launcher}/cmdline").read_bytes().split(b"\0")[:4]
    except OSError:
        return
    if not any(Path(arg.decode(errors="replace")).name in LAUNCHERS for arg in args):
        return
    pr_set_pdeathsig = 1  # <linux/prctl.h>
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0) != 0:
        logger.warning("prctl(PR_SET_PDEATHSIG) failed (%s): this worker keeps running if its launcher (pid %d) "
                       "dies", os.strerror(ctypes.get_errno()), launcher)
        return
    if os.getppid() != launcher:  # the launcher died before the call: no signal will come
        os.kill(os.getpid(), signal.SIGTERM)


def report_error(command: str, err: BaseException | str) -> None:
    """Print a user's error as ONE line, once per launch: ``ds4sci COMMAND: error: MESSAGE`` on stderr.

    Under a launcher every rank usually meets the same error (a config, a run folder or data that rank 0 checked
    for all), so rank 0 prints it and the other ranks wait :data:`ERROR_WAIT_S` seconds without a word: rank 0
    exits first, and the launcher stops them (were they to exit first, it could stop rank 0 before it printed).
    A rank still running after the wait met an error of its own (rank 0 is blocked in a collective with it): it
    prints the error naming itself, ``ds4sci COMMAND (rank N): error: ...``. A line is written in one call, so
    two ranks' lines never run together."""
    rank = launch_rank()
    who = f"ds4sci {command}"
    if rank != 0:
        time.sleep(ERROR_WAIT_S)
        who += f" (rank {rank})"
    sys.stderr.write(f"{who}: error: {err}\n")
    sys.stderr.flush()


def path_error(err: OSError, args: argparse.Namespace, argv: list[str]) -> str:
    """The line for an ``OSError`` on a file (``err.filename``): the option (``--vcf``) or positional argument
    (``CONFIG``) the user gave that path with, the path, and the reason in words, e.g.
    ``--fasta genes.fa: no such file or directory``; a path no argument names is shown alone. An error without a
    file name (``err.filename`` None) keeps its message."""
    if err.filename is None:
        return str(err)
    path = os.fspath(err.filename)
    reason = (err.strerror or str(err)).lower()
    for dest, value in vars(args).items():
        values = value if isinstance(value, list) else [value]
        if not any(isinstance(v, str) and os.path.abspath(v) == os.path.abspath(path) for v in values):
            continue
        option = "--" + dest.replace("_", "-")
        given = option if any(a == option or a.startswith(option + "=") for a in argv) else dest.upper()
        return f"{given} {path}: {reason}"
    return f"{path}: {reason}"


def main(argv: list[str] | None = None) -> int:
    """Run one command. A user's mistake (a bad option, a missing file: :func:`path_error`, an export or FASTA the
    command cannot use) is one ``ds4sci COMMAND: error: ...`` line on stderr (once per launch:
    :func:`report_error`) and exit status 2; ``--log-level DEBUG`` re-raises it with its traceback.

    Below DEBUG, a run prints ds4sci's own lines only (:func:`ds4sci.progress.quiet_dependencies`), and ranks other
    than 0 only their warnings and errors (rank 0 speaks for the run)."""
    stop_with_launcher()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser([command_in(argv)]).parse_args(argv)
    debug = args.log_level == "DEBUG"
    level = logging.getLevelName(args.log_level)
    if not debug and launch_rank() != 0:
        level = max(level, logging.WARNING)
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not debug:
        quiet_dependencies()
    try:
        return int(args._run(args) or 0)
    except (CommandError, ValueError, OSError) as err:
        if debug:
            raise
        report_error(args.command, path_error(err, args, argv) if isinstance(err, OSError) else err)
        return 2


if __name__ == "__main__":
    sys.exit(main())
