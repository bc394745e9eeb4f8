"""What a run shows besides ds4sci's own log lines. Progress bars only on a terminal: ``progress_bar(enabled, ...)``,
the one rule every ds4sci bar follows; and the dependencies kept quiet (:func:`quiet_dependencies`).

A bar is drawn when it is ``enabled`` (``train.progress``, no ``--no-progress``) and stderr is a terminal. Output
redirected to a file or a pipe gets no bar frames: training logs one line every ``train.log_every`` steps instead
(:meth:`ds4sci.train.trainer.Trainer.train` reads ``bar.disable``), and :func:`record_progress` (``score``,
``embed``) one line of records, tokens and ETA every ``LOG_INTERVAL_S`` seconds."""
from __future__ import annotations

import contextlib
import logging
import time
import warnings

logger = logging.getLogger(__name__)

#: Seconds between two progress log lines when stderr is not a terminal.
LOG_INTERVAL_S = 30.0


def progress_bar(enabled: bool, **kwargs):
    """A ``tqdm`` bar (``kwargs``: ``total``, ``desc``, ``unit``, ...) that is drawn only when ``enabled`` and stderr
    is a terminal (tqdm's ``disable=None``); ``bar.disable`` is true when it is not drawn."""
    from tqdm.auto import tqdm

    return tqdm(disable=None if enabled else True, **kwargs)


def _eta(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


@contextlib.contextmanager
def record_progress(enabled: bool, desc: str, total: int, interval_s: float = LOG_INTERVAL_S):
    """A callable ``show(records, tokens)`` that counts records and tokens read over ``total`` records: on a terminal
    a bar (records, tokens in its postfix, tqdm's ETA); redirected, one log line every ``interval_s`` seconds and one
    at the end (``desc: 120/5000 records, 61440 tokens, 40.0 records/s, ETA 0:02:02``); nothing when not
    ``enabled``."""
    counts = {"records": 0.0, "tokens": 0}
    start = last = time.monotonic()

    def line() -> str:
        rate = counts["records"] / max(time.monotonic() - start, 1e-9)
        left = (total - counts["records"]) / rate if rate else float("inf")
        return (f"{desc}: {counts['records']:.0f}/{total} records, {counts['tokens']} tokens, {rate:.1f} records/s, "
                f"ETA {_eta(left) if left != float('inf') else '?'}")

    with progress_bar(enabled, total=total, desc=desc, unit="record") as bar:
        logged = enabled and bar.disable

        def show(records: float, tokens: int) -> None:
            nonlocal last
            counts["records"] += records
            counts["tokens"] += tokens
            if not bar.disable:
                bar.update(records)
                bar.set_postfix(tokens=counts["tokens"], refresh=False)
            elif logged and time.monotonic() - last >= interval_s:
                last = time.monotonic()
                logger.info("%s", line())

        yield show
        if logged and counts["records"]:
            logger.info("%s", line())


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
