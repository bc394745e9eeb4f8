"""What a run shows besides ds4sci's own log lines. Progress bars only on a terminal: ``progress_bar(enabled, ...)``,
the one rule every ds4sci bar follows; and the dependencies kept quiet (:func:`quiet_dependencies`).

A bar is drawn when it is ``enabled`` (``train.progress``, no ``--no-progress``) and stderr is a terminal. Output
redirected to a file or a pipe gets no bar frames: training logs one line every ``train.log_every`` steps instead
(:meth:`ds4sci.train.trainer.Trainer.train` reads ``bar.disable``)."""
from __future__ import annotations

import logging
import warnings


def progress_bar(enabled: bool, **kwargs):
    """A ``tqdm`` bar (``kwargs``: ``total``, ``desc``, ``unit``, ...) that is drawn only when ``enabled`` and stderr
    is a terminal (tqdm's ``disable=None``); ``bar.disable`` is true when it is not drawn."""
    from tqdm.auto import tqdm

    return tqdm(disable=None if enabled else True, **kwargs)


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


def quiet_dependencies() -> None:
    """Keep what DeepSpeed and torch print on their own out of a run's output (``--log-level DEBUG`` keeps it):
    DeepSpeed's logger below ERROR (e.g. "Setting accelerator to CPU ...", logged as DeepSpeed is imported: a
    filter, since DeepSpeed sets the level of its logger when it creates it), torch's FutureWarnings that DeepSpeed's
    ZeRO calls the deprecated ``all_gather_into_tensor`` and ``reduce_scatter_tensor``, and torch's warning that
    ``optimizer.step`` was wrapped after the scheduler was made (DeepSpeed's engine wraps it). DeepSpeed's prints
    ("... built successfully", the pipeline's seeds, topology and stage layers) are logged at DEBUG by
    :func:`ds4sci.train.engine.init_distributed` and :func:`ds4sci.train.pipeline.build_pipeline_engine`. Every
    :func:`ds4sci.spawn.run_workers` worker calls it too (a worker starts without the command's filters)."""
    logging.getLogger("DeepSpeed").addFilter(_errors_only)  # once: a logger keeps one of each filter
    collectives = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
    warnings.filterwarnings("ignore", category=FutureWarning, message=collectives)
    warnings.filterwarnings("ignore", category=UserWarning,
                            message=r"Seems like `optimizer\.step\(\)` has been overridden after learning rate")
