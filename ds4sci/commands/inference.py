"""What the commands that read sequences through a trained model share (``evaluate``, ``score``, ``embed``,
``score-variants``): their common arguments, and the model loaded, checked against them and made ready to read
windows on this launch (one process, or sequence-parallel ranks under ``torchrun``, DeepSpeed's launcher, ``srun`` or
``mpiexec``: :func:`~ds4sci.distributed.launch.resolve_launch`). Library imports stay inside :func:`load_reader` so
``ds4sci COMMAND --help`` imports no torch."""
from __future__ import annotations

import argparse
import logging
from typing import Callable

from ds4sci.cli_args import add_parallel_arguments
from ds4sci.cli_args import add_window_arguments
from ds4sci.cli_args import check_parallel
from ds4sci.cli_args import check_windows
from ds4sci.cli_args import positive_int

logger = logging.getLogger(__name__)


def add_reading_arguments(parser: argparse.ArgumentParser, *, windows: bool = True, progress: bool = True) -> None:
    """The options after a command's own: ``--seq-len``/``--stride`` (``windows``), ``--ulysses``/``--ring``,
    ``--batch-size`` and ``--no-progress`` (``progress``)."""
    if windows:
        add_window_arguments(parser)
    add_parallel_arguments(parser)
    parser.add_argument("--batch-size", type=positive_int, default=8, help="windows per forward (default: %(default)s)")
    if progress:
        parser.add_argument("--no-progress", action="store_true", help="no progress bar (none either when stderr is "
                            "not a terminal)")


def add_token_budget_argument(parser: argparse.ArgumentParser) -> None:
    """``--max-tokens-per-batch`` (``score``, ``embed``, ``score-variants``)."""
    parser.add_argument("--max-tokens-per-batch", type=positive_int, default=None, metavar="N",
                        help="tokens per forward, padding included, windows sorted by length (default: --batch-size "
                        "full windows)")


def add_record_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the commands that read many records (``score``, ``embed``): ``--max-tokens-per-batch``,
    ``--pack``, ``--resume`` and ``--flush-every``."""
    add_token_budget_argument(parser)
    parser.add_argument("--pack", action="store_true",
                        help="pack short records several to a row, each attending to itself alone: faster on many "
                        "short records; numbers equal unpacked ones up to float32 rounding (about 1e-7 relative)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the records already written in OUT.parts/ by a job of the same input and options "
                        "(an interrupted run) and read only the others")
    parser.add_argument("--flush-every", type=positive_int, default=256, metavar="N",
                        help="records per chunk written to OUT.parts/ (what an interrupted job keeps; default: "
                        "%(default)s)")


def write_records(args: argparse.Namespace, runner, options: dict, stream: Callable, kind: str, desc: str,
                  total: int, header: str | None = None) -> int | None:
    """Run a record job into ``args.out`` through its shards (:mod:`ds4sci.infer.shards`): every rank calls it.
    ``stream(skip, progress)`` yields ``(index, row)`` for this data rank's records not in ``skip`` (rows as
    :class:`~ds4sci.infer.shards.ShardWriter` takes them, ``kind`` ``"tsv"`` or ``"parquet"``); ``options``: what
    the job's manifest holds besides the FASTA file's digest and the process layout (data ranks, Ulysses and ring
    degrees). Returns the records in the merged file on rank 0 (None elsewhere, and
    0 when a resumed job was already complete).

    Raises:
        CommandError: ``--resume`` of a job of another input, options or number of processes (naming them).
    """
    from ds4sci.cli_args import CommandError
    from ds4sci.infer.shards import ShardWriter
    from ds4sci.infer.shards import done_indices
    from ds4sci.infer.shards import input_digest
    from ds4sci.infer.shards import merge
    from ds4sci.infer.shards import parts_folder
    from ds4sci.infer.shards import start_job
    from ds4sci.progress import record_progress

    try:
        job = {"input": input_digest(args.fasta), "data_ranks": runner.dims.dp, "ulysses": runner.dims.ulysses,
               "ring": runner.dims.ring} | options
        state = start_job(args.out, job, args.resume, runner.is_writer)
    except ValueError as e:
        raise CommandError(str(e)) from None
    runner.barrier()
    if state == "merged":
        logger.info("%s is complete (%s): nothing to do", args.out, parts_folder(args.out))
        return 0
    done = done_indices(args.out)
    if done and runner.is_writer:
        logger.info("resuming: %d of %d record(s) already written", len(done), total)
    writer = ShardWriter(args.out, runner.data_rank, kind, args.flush_every) if runner.writes_shards else None
    left = -(-(total - len(done)) // runner.dims.dp)  # about this rank's share (dealt by tokens, not by count)
    with record_progress(not args.no_progress and runner.is_writer, desc, left) as shown:
        for index, row in stream(done, shown):
            if writer is not None:
                writer.add(index, row)
    if writer is not None:
        writer.close()
    runner.barrier()
    return merge(args.out, header) if runner.is_writer else None


def load_reader(args: argparse.Namespace, *, windows: bool = True, check: Callable | None = None) -> tuple:
    """``(model, config, tokenizer, runner)``: the launch resolved (logged when it has several processes: by every
    rank, shown by rank 0 alone, :func:`ds4sci.cli.main`), then the model of ``args.export`` on ``--device``,
    checked against ``--seq-len``/``--stride`` (``windows``), the command's own ``check(config, tokenizer)`` and the
    launch's ``--ulysses``/``--ring``, all before any process group starts; then its
    :class:`~ds4sci.infer.parallel.ShardedForward` (collective under a launcher: every rank calls it).

    Raises:
        LaunchError: (a ``ValueError``) the launcher's environment cannot form the group (naming the variable), before
            the export is read.
        CommandError: (:mod:`ds4sci.cli_args`) a window or a parallel degree the model or launch cannot take.
    """
    from ds4sci.distributed.launch import resolve_launch
    from ds4sci.infer.parallel import ShardedForward
    from ds4sci.infer.parallel import inference_device
    from ds4sci.io.weights import load_model

    launch = resolve_launch()
    if launch.world_size > 1:
        logger.info("%s", launch.describe())
    model, config, tokenizer = load_model(args.export, inference_device(args.device))
    if windows:
        check_windows(args, config)
    if check is not None:
        check(config, tokenizer)
    check_parallel(args, config, launch.world_size)
    return model, config, tokenizer, ShardedForward.from_world(model, args.ulysses, args.ring)
