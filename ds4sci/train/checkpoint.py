"""Checkpoints for exact resume: DeepSpeed's engine checkpoint plus the learned position table's full state
(:meth:`ds4sci.train.position_table.PositionTable.state_dict`), so a run resumes at another sequence-parallel degree.

Layout of ``train.out_dir/checkpoints``::

    step4/                 a complete checkpoint: DeepSpeed's files (mp_rank_*_model_states.pt, under ZeRO
                           zero_pp_rank_*_optim_states.pt), position_table.pt, and checkpoint.json, written last
    latest                 the newest complete tag (DeepSpeed's pointer; its tools, e.g. zero_to_fp32.py, read it)
    .tmp-step6/            a save in progress, or one a killed process left behind (never loaded; removed by the
                           next save)

A save is atomic: every rank writes into ``.tmp-stepN`` (DeepSpeed with ``save_latest=False``); after a barrier
rank 0 flushes the files to disk, writes ``checkpoint.json`` (step, model config, ZeRO stage, ranks, each file's
size), renames the folder to ``stepN`` and replaces ``latest`` (write a temporary file, then ``os.replace``).
A process killed at any moment leaves every earlier checkpoint and ``latest`` as they were. Checkpoints live on a
file system every rank sees (DeepSpeed's requirement as well).

Loading checks before DeepSpeed reads anything: the folder is complete (``checkpoint.json``), no file is missing
or shorter than the save wrote, and the model config, ZeRO stage and partition count match this run (each
difference named: ``model.num_layers: checkpoint 4, this run 2``). Every file is read with
``torch.load(weights_only=True)`` (tensors and plain containers; no pickled code runs): DeepSpeed 0.19.8's own
loader passes ``weights_only=False``, so the engine is handed :class:`SafeCheckpointEngine` for the load, which
allows, by name, the three DeepSpeed classes its ZeRO optimizer files hold (loss scaler, ZeRO stage enum,
fragment address) and nothing else.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

logger = logging.getLogger(__name__)

__all__ = ["save_checkpoint", "load_checkpoint", "find_checkpoint", "check_checkpoint", "SafeCheckpointEngine"]

META = "checkpoint.json"
TABLE = "position_table.pt"
_STEP_DIR = re.compile(r"step(\d+)")
_DEEPSPEED_SAFE_GLOBALS = [LossScaler, ZeroStageEnum, fragment_address]


def safe_load(path: str | Path, map_location="cpu"):
    """``torch.load(path, weights_only=True)`` with one-line errors naming the file.

    Raises:
        ValueError: the file needs a class the safe loader refuses, or cannot be read (truncated, corrupt).
    """
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        refused = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(err))
        raise ValueError(f"{path}: torch.load(weights_only=True) refuses it (it holds "
                         f"{refused.group(1) if refused else 'a non-tensor object'}); only tensors and plain "
                         f"containers are loaded from a checkpoint") from None
    except (RuntimeError, EOFError) as err:
        raise ValueError(f"{path}: cannot be read, truncated or corrupt ({str(err).splitlines()[0]})") from None


class SafeCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine, loading with ``weights_only=True`` (plus the DeepSpeed classes of
    ``_DEEPSPEED_SAFE_GLOBALS``) instead of its ``weights_only=False``."""

    def load(self, path: str, map_location=None):
        with torch.serialization.safe_globals(_DEEPSPEED_SAFE_GLOBALS):
            return safe_load(path, map_location)


def _fingerprint(trainer) -> dict:
    """What a checkpoint must share with the run that loads it (compared by :func:`check_checkpoint`)."""
    return json.loads(json.dumps({"model": trainer.model_config.to_dict(), "zero.stage": trainer.cfg.zero.stage,
                                  "zero partitions": dist.get_world_size(trainer.groups.sdp)}))  # as stored


def save_checkpoint(trainer) -> Path:
    """Save under ``out_dir/checkpoints/step{N}``, atomically (collective: every rank calls it)."""
    root = trainer.out / "checkpoints"
    tag = f"step{trainer.step}"
    tmp = root / f".tmp-{tag}"
    if trainer.rank == 0 and tmp.exists():
        shutil.rmtree(tmp)  # left by a save that was killed
    dist.barrier()
    trainer.engine.save_checkpoint(str(root), tag=tmp.name, client_state={"step": trainer.step}, save_latest=False)
    if trainer.pos_table is not None:
        full = trainer.pos_table.state_dict()
        if trainer.rank == 0:
            torch.save(full, tmp / TABLE)
    dist.barrier()
    if trainer.rank == 0:
        _commit(root, tmp, tag, {"step": trainer.step, **_fingerprint(trainer)})
        logger.info("saved checkpoint %s", root / tag)
    dist.barrier()
    return root / tag


def _commit(root: Path, tmp: Path, tag: str, meta: dict) -> None:
    """Rank 0: make the written ``tmp`` folder the checkpoint ``tag`` (see the module docstring)."""
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    for path in files:  # on disk before the marker that declares them complete
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    meta["files"] = {str(p.relative_to(tmp)): p.stat().st_size for p in files}
    _write_atomic(tmp / META, json.dumps(meta, indent=1))
    final = root / tag
    if final.exists():  # the same step saved again (a resumed run that ends where it started)
        old = root / f".old-{tag}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _write_atomic(root / "latest", tag)
    for stale in root.glob(".tmp-*"):  # saves killed earlier
        shutil.rmtree(stale, ignore_errors=True)


def _write_atomic(path: Path, text: str) -> None:
    part = path.with_name(path.name + ".part")
    with open(part, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself
    finally:
        os.close(fd)


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint folder ``path`` names: a ``stepN`` folder itself, or the newest complete one of a
    ``checkpoints`` folder or of a run folder (``train.out_dir``).

    Raises:
        FileNotFoundError: nothing there, or no complete checkpoint.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if (path / META).is_file() or _STEP_DIR.fullmatch(path.name) or path.name.startswith(".tmp-"):
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    steps = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.fullmatch(p.name)) and (p / META).is_file()]
    if not steps:
        raise FileNotFoundError(f"{path}: no complete checkpoint (a folder stepN with {META}) in {root}")
    return max(steps)[1]


def check_checkpoint(path: Path, expected: dict) -> dict:
    """The metadata of the complete checkpoint folder ``path``, checked against ``expected`` (the loading run's
    :func:`_fingerprint`) and its files against the sizes the save wrote.

    Raises:
        ValueError: the save did not finish, a file is missing or truncated, or a field differs (each named).
    """
    meta_file = path / META
    if not meta_file.is_file():
        raise ValueError(f"{path} is incomplete (no {META}: its save was interrupted); resume from the run folder "
                         f"to take the newest complete checkpoint")
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{meta_file}: not a ds4sci checkpoint record ({err})") from None
    for name, size in meta["files"].items():
        file = path / name
        if not file.is_file():
            raise ValueError(f"{file} is missing (the save wrote {size} bytes)")
        if file.stat().st_size != size:
            raise ValueError(f"{file} is truncated or changed: {file.stat().st_size} bytes, the save wrote {size}")
    differ = [f"model.{k}: checkpoint {v!r}, this run {expected['model'].get(k)!r}"
              for k, v in meta["model"].items() if expected["model"].get(k) != v]
    differ += [f"model.{k}: checkpoint (none), this run {v!r}" for k, v in expected["model"].items()
               if k not in meta["model"]]
    stage = meta["zero.stage"]
    keys = ["zero.stage"] + (["zero partitions"] if stage > 0 and expected["zero.stage"] == stage else [])
    differ += [f"{k}: checkpoint {meta[k]}, this run {expected[k]}" for k in keys if meta[k] != expected[k]]
    if differ:
        raise ValueError(f"{path} was saved by another configuration: {'; '.join(differ)}")
    return meta


def load_checkpoint(trainer, path: str | Path) -> Path:
    """Resume from a checkpoint (a ``stepN`` folder, or the newest complete one of a run or ``checkpoints``
    folder; see :func:`find_checkpoint`). Under ZeRO the number of partitions (sequence x data ranks) must match;
    at stage 0 the sequence-parallel and data-parallel degrees may differ. Returns the folder loaded."""
    path = find_checkpoint(path)
    meta = check_checkpoint(path, _fingerprint(trainer))
    engine = trainer.engine
    engine.checkpoint_engine = SafeCheckpointEngine(engine._config)
    _, client = engine.load_checkpoint(str(path.parent), tag=path.name)
    if client is None:
        raise ValueError(f"{path}: DeepSpeed could not load this checkpoint")
    trainer.step = int(client["step"])
    if trainer.step != meta["step"]:
        raise ValueError(f"{path}: the engine state is of step {trainer.step}, {META} says {meta['step']}")
    if trainer.pos_table is not None:
        table_file = path / TABLE
        if not table_file.is_file():
            raise FileNotFoundError(f"{table_file} is missing: this checkpoint has no learned position table")
        trainer.pos_table.load_state_dict(safe_load(table_file), str(table_file))
    logger.info("resumed from %s (step %d)", path, trainer.step)
    return path
