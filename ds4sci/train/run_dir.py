"""Run folders that never mix: what ``ds4sci train`` may do with ``train.out_dir``.

* A new run needs an empty or missing ``out_dir``. A folder that already holds a run (``config.yaml``, written by
  every run) is refused with one line naming it and the two ways on: ``--resume`` continues it, ``--overwrite``
  replaces it. ``token_cache/`` (the default ``data.cache_dir``) is a cache keyed by its data and tokenizer, not part
  of a run: a folder holding only it counts as empty, and ``--overwrite`` keeps it. Nor is the lock file
  (:mod:`ds4sci.train.run_lock`): every command that writes ``out_dir`` holds its lock first (:func:`open_run_dir`),
  so a folder in use by a live run is refused whatever the command; nor a node check's marker
  (:mod:`ds4sci.distributed.storage`) that a killed process left behind.
* Every node must see the same ``out_dir``: a node that does not is refused by name before anything there is read
  or deleted (:func:`open_run_dir`).
* ``--overwrite`` deletes everything else in ``out_dir``, only when ``out_dir`` holds a run: a non-empty folder
  without ``config.yaml`` is no ds4sci run, and is never deleted (nor written into).
* ``--resume`` continues the run in ``out_dir`` from its newest complete checkpoint; ``--resume CHECKPOINT`` from that
  checkpoint folder, which must be the newest of ``out_dir``'s run when ``out_dir`` holds one (an earlier one would
  leave later checkpoints of a dropped future beside the new ones; branch off into a new ``out_dir`` instead), or may
  come from another run when ``out_dir`` is empty. The config must be the one the checkpoint's run was trained with,
  except the keys of :data:`MAY_CHANGE` (each other difference is named), at the same global batch
  (``train.micro_batch_size x dp x train.grad_accum``: at another process count or layout, set the micro-batch or
  the accumulation to keep it). The trainer then drops the metrics the stopped run logged after its checkpoint, so
  ``metrics.jsonl`` and ``loss.png`` continue the curve.
* ``--resume auto``: one command line for every start of a job, so a restart (``torchrun --max-restarts``, a
  scheduler's requeue) continues: it resumes as ``--resume`` when ``out_dir``'s run has a complete checkpoint, starts
  a new run when ``out_dir`` is empty or missing, and starts again (deleting what the stopped run wrote) when the run
  stopped before its first checkpoint. A run of another config is refused, as ``--resume`` refuses it.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import torch.distributed as dist

from ds4sci.distributed.launch import Launch
from ds4sci.distributed.storage import MARKER_PREFIX
from ds4sci.distributed.storage import check_same_folder
from ds4sci.train.config import Config
from ds4sci.train.config import load_config
from ds4sci.train.resume_keys import MAY_CHANGE
from ds4sci.train.run_lock import LOCK_FILE
from ds4sci.train.run_lock import RunLock
from ds4sci.train.run_lock import lock_run_dir

logger = logging.getLogger(__name__)

RUN_MARK = "config.yaml"
CACHE = "token_cache"


def _may_change(key: str) -> bool:
    return any(key == k or (k.endswith(".*") and key.startswith(k[:-1])) for k in MAY_CHANGE)


def _flat(cfg: Config) -> dict:
    return {f"{section}.{key}": value for section, part in dataclasses.asdict(cfg).items()
            for key, value in part.items()}


def _names(entries: list[str]) -> str:
    return ", ".join(entries[:4]) + (f" and {len(entries) - 4} more" if len(entries) > 4 else "")


def _batch_change(saved: Config, record: dict, cfg: Config, world_size: int) -> str | None:
    """How ``cfg`` at ``world_size`` processes changes the global batch (``train.micro_batch_size x dp x
    train.grad_accum`` sequences per step) that a checkpoint's run trained with (its ``record``: ``batch`` and the
    layout's ``dp``; a record from before ``batch`` was kept, the saved config's), and what to set to keep it. None:
    it is kept, or the record holds no layout to tell."""
    if "layout" not in record:
        return None
    kept = record.get("batch", {"micro_batch_size": saved.train.micro_batch_size, "grad_accum": saved.train.grad_accum})
    micro, dp, accum = kept["micro_batch_size"], record["layout"]["dp"], kept["grad_accum"]
    before = micro * dp * accum
    t, new_dp = cfg.train, cfg.parallel.dims(world_size).dp
    now = t.micro_batch_size * new_dp * t.grad_accum
    if now == before:
        return None
    ways = [f"train.{key}={before // (new_dp * other)}" for key, other in
            (("grad_accum", t.micro_batch_size), ("micro_batch_size", t.grad_accum)) if before % (new_dp * other) == 0]
    if not ways:
        ways = [f"train.micro_batch_size x train.grad_accum = {before // new_dp}" if before % new_dp == 0 else
                f"parallel degrees that leave a dp dividing {before}"]
    return (f"resuming at dp={new_dp} with train.micro_batch_size={t.micro_batch_size} x train.grad_accum="
            f"{t.grad_accum} is {now} sequences per step, the run used {before} ({micro} x dp {dp} x {accum}): set "
            f"{' or '.join(ways)} (a resumed run keeps the global batch, micro_batch_size x dp x grad_accum, so each "
            f"step reads the samples it would have)")


def check_resumed_config(saved_file: Path, checkpoint: Path, cfg: Config, world_size: int) -> None:
    """``cfg`` at ``world_size`` processes against the config a checkpoint's run was trained with (``saved_file``):
    only :data:`MAY_CHANGE` keys may differ, and the global batch (``train.micro_batch_size x dp x
    train.grad_accum``, the saving run's as ``checkpoint`` records it) must stay, so the data order does.

    Raises:
        ValueError: naming every other key that differs, old and new value, and a changed global batch, old and new
            and what to set.
    """
    from ds4sci.train.checkpoint_check import read_record

    problems = [config_change(saved_file, cfg)]
    problems.append(_batch_change(load_config(saved_file), read_record(checkpoint), cfg, world_size))
    if any(problems):
        raise ValueError(f"--resume: {'. '.join(filter(None, problems))}")


def config_change(saved_file: Path, cfg: Config) -> str | None:
    """How ``cfg`` differs from the config a run was trained with (``saved_file``) in keys a resume may not change
    (every key but :data:`MAY_CHANGE`), each named with its old and new value; None when it does not."""
    old, new = _flat(load_config(saved_file)), _flat(cfg)
    differ = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in old.keys() | new.keys()
              if old.get(k) != new.get(k) and not _may_change(k)]
    if not differ:
        return None
    return (f"the config differs from the one the run was trained with ({saved_file}): {'; '.join(sorted(differ))}; "
            f"only {', '.join(MAY_CHANGE)} may change on resume")


def prepare_run_dir(cfg: Config, resume: str | None = None, overwrite: bool = False,
                    world_size: int = 1) -> Path | None:
    """Check (and with ``overwrite`` empty) ``train.out_dir`` by the rules of this module, before anything is written
    there. ``resume``: None (a new run), ``""`` (continue ``out_dir``'s run), ``"auto"`` (continue it if it has a
    checkpoint, else start) or a checkpoint folder.

    Returns:
        the checkpoint folder to resume from, or None for a new run.

    Raises:
        ValueError / FileNotFoundError: the folder cannot be used so (one line naming it and the way on).
    """
    from ds4sci.train.checkpoint_check import find_checkpoint

    if overwrite and resume is not None:
        raise ValueError("--overwrite and --resume exclude each other: replace the run, or continue it")
    out = Path(cfg.train.out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"train.out_dir {out} is a file, not a folder")
    entries = sorted(p.name for p in out.iterdir() if p.name not in (CACHE, LOCK_FILE)
                     and not p.name.startswith(MARKER_PREFIX)) if out.is_dir() else []
    holds_run = (out / RUN_MARK).is_file()
    if entries and not holds_run:
        raise ValueError(f"train.out_dir {out} is not empty and holds no ds4sci run (no {RUN_MARK}; it holds "
                         f"{_names(entries)}): choose another train.out_dir (ds4sci deletes only its own runs)")
    if overwrite:
        _delete_run(out, entries, "--overwrite")
        return None
    if resume == "auto":
        if not holds_run:
            return None  # nothing there yet: the first start of the job
        try:
            find_checkpoint(out)
        except FileNotFoundError:  # stopped before its first save: start it again, if it is this config's run
            change = config_change(out / RUN_MARK, cfg)
            if change:
                raise ValueError(f"--resume auto: train.out_dir {out} holds another run: {change}") from None
            _delete_run(out, entries, "--resume auto: no complete checkpoint, starting again")
            return None
        resume = ""
    if resume is None:
        if entries:
            raise ValueError(f"train.out_dir {out} already holds a run ({_names(entries)}): continue it with "
                             f"--resume, or replace it with --overwrite (or choose another train.out_dir)")
        return None
    if resume == "":
        if not holds_run:
            raise ValueError(f"--resume: train.out_dir {out} holds no run to continue (start one without --resume)")
        try:
            checkpoint = find_checkpoint(out)
        except FileNotFoundError:
            raise ValueError(f"--resume: the run in train.out_dir {out} has no complete checkpoint (it stopped "
                             f"before its first save): start it again with --overwrite") from None
    else:
        if Path(resume).is_file():
            raise ValueError(f"--resume {resume} is a file: give a checkpoint folder (.../checkpoints/stepN), or "
                             f"nothing to continue train.out_dir (put the config first: ds4sci train CONFIG --resume)")
        checkpoint = find_checkpoint(resume)
        if holds_run and checkpoint.resolve() != (newest := find_checkpoint(out)).resolve():
            raise ValueError(f"--resume {checkpoint}: train.out_dir {out} is a run whose newest checkpoint is "
                             f"{newest}; continuing it from another one would mix two histories. To branch off "
                             f"{checkpoint}, write into a new folder: --set train.out_dir=NEW --resume {checkpoint}")
    saved = checkpoint.parent.parent / RUN_MARK  # the config of the run the checkpoint belongs to
    if saved.is_file():
        check_resumed_config(saved, checkpoint, cfg, world_size)
    return checkpoint


def _delete_run(out: Path, entries: list[str], why: str) -> None:
    """Delete ``entries`` of ``out`` (a run's files: all but the token cache and the lock), saying ``why``."""
    for name in entries:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    if entries:
        logger.warning("%s: deleted the run in %s (%s)", why, out, _names(entries))


def open_run_dir(cfg: Config, resume: str | None, overwrite: bool, device,
                 launch: Launch) -> tuple[Path | None, RunLock | None]:
    """:func:`prepare_run_dir` on rank 0 under the run folder's lock (:mod:`ds4sci.train.run_lock`), its result or
    error on every rank (collective: every rank calls it). Rank 0 locks the folder before it reads or deletes
    anything there, and keeps the lock for the run; then every node checks that it sees the folder rank 0 locked
    (:func:`~ds4sci.distributed.storage.check_same_folder`: a node-local ``train.out_dir`` would give each node its
    own half of every checkpoint), before anything there is read or deleted. A refusal (the folder in use by
    another live run, seen by some node as another folder, or refused by :func:`prepare_run_dir`) releases the
    lock, and reaches every rank as the same one line.

    Returns:
        the checkpoint to resume from (or None), and on rank 0 the lock to release when the run ends (None on the
        other ranks).
    """
    out = Path(cfg.train.out_dir)
    box: list = [None, None]  # [checkpoint, error message]
    lock = None
    if dist.get_rank() == 0:
        mode = " --overwrite" if overwrite else "" if resume is None else f" --resume {resume}".rstrip()
        try:
            lock = lock_run_dir(out, f"ds4sci train{mode}")
        except (OSError, ValueError) as err:
            box[1] = str(err)
    try:
        dist.broadcast_object_list(box, src=0, device=device)
        if box[1] is None:
            check_same_folder(out, "train.out_dir", launch)
            if dist.get_rank() == 0:
                try:
                    box[0] = prepare_run_dir(cfg, resume, overwrite, dist.get_world_size())
                except (OSError, ValueError) as err:
                    box[1] = str(err)
            dist.broadcast_object_list(box, src=0, device=device)
        if box[1] is not None:
            raise ValueError(box[1])
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return box[0], lock


def keep_metrics_until(path: Path, step: int) -> None:
    """Drop the records of ``metrics.jsonl`` after ``step``: what a stopped run logged after the checkpoint the
    resumed run continues from (a new run has no such file). A torn final line (the run died, or the disk filled,
    while writing it) is dropped with a warning naming the file and line.

    Raises:
        ValueError: a line before the last is not a metrics record (naming the file and line).
    """
    if not path.exists():
        return
    lines = path.read_text(errors="replace").splitlines()
    last = max((n for n, line in enumerate(lines, 1) if line.strip()), default=0)
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            record_step = record["step"]
        except (json.JSONDecodeError, TypeError, KeyError) as err:
            if number == last:
                logger.warning("%s: line %d, the last, is torn (%s: %s): dropped", path, number, type(err).__name__,
                               err)
                continue
            raise ValueError(f"{path}: line {number} is not a metrics record ({type(err).__name__}: {err}); only "
                             f"the last line may be torn (repair or remove the line to resume)") from None
        if record_step <= step:
            rows.append(line)
    path.write_text("".join(f"{line}\n" for line in rows))
