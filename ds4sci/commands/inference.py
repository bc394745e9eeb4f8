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
