"""A checkpoint folder found, its record read and its files verified, before anything is loaded from it.

A complete checkpoint ``stepN`` holds ``checkpoint.json`` (:data:`META`), written last by the save
(:mod:`ds4sci.train.checkpoint`): format 2 records each file's size and sha256 and the sha256 of the record itself.
Loading checks, in order: the folder is complete and its record unchanged (:func:`read_record`), no file is missing
or of another size and the model config matches this run (:func:`check_checkpoint`), then every file's content
(:func:`verify_checkpoint`, collective: each rank reads a share, split by bytes with :class:`Spread`). A corrupt
file is refused naming it and the earlier checkpoint to resume from. A format-1 record (no digests) is checked by
size only, with a warning. Files are read with ``torch.load(weights_only=True)`` (:func:`safe_load`): tensors and
plain containers, never pickled code.
"""
from __future__ import annotations

import hashlib
import json
import logging
import pickle
import re
from pathlib import Path

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

META = "checkpoint.json"
PORTABLE = "portable"  # the layout-free state: one safetensors file per rank that owns some of it
STEP_DIR = re.compile(r"step(\d+)")
FORMAT = 2  # checkpoint.json's format: 2 records each file's sha256 and its own; 1 (no "format" key) sizes only
DIGEST = "sha256"  # checkpoint.json's key of the files' digests (hashlib's name)
RECORD_DIGEST = "record sha256"  # checkpoint.json's key of its own digest (of the rest, canonical JSON)


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


def digest_file(path: Path) -> str:
    """The sha256 of the file ``path`` (read once, in chunks)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, DIGEST).hexdigest()


class Spread:
    """A split by bytes over ``n`` owners: :meth:`take` gives each item, in the order they come, to the owner with
    the fewest bytes so far (the lowest on a tie). Deterministic: ranks that take the same sizes in the same order
    agree. No owner ends with more than ``total / n + largest item`` (the owner of any item held at most the mean
    before taking it)."""

    def __init__(self, n: int):
        self.loads = [0] * n

    def take(self, size: int) -> int:
        owner = min(range(len(self.loads)), key=self.loads.__getitem__)
        self.loads[owner] += size
        return owner


def describe_layout(record: dict) -> str:
    """``tp 2 x pp 1 x dp 1 x ulysses 1 x ring 1, ZeRO-1`` (the layout of a checkpoint record)."""
    layout = " x ".join(f"{k} {v}" for k, v in record["layout"].items()) if "layout" in record else "layout unrecorded"
    return f"{layout}, ZeRO-{record['zero.stage']}"


def engine_differences(meta: dict, expected: dict) -> list[str]:
    """What keeps DeepSpeed from loading the engine checkpoint of ``meta`` into the run of ``expected``: another
    ZeRO stage, TP or PP degree (other per-rank files), or, under ZeRO, another partition count (sequence x data
    ranks). Empty: the engine checkpoint loads as it is."""
    saved, now = meta.get("layout"), expected.get("layout")
    differ = [f"parallel.{k}: checkpoint {saved[k]}, this run {now[k]}" for k in ("tp", "pp")
              if saved and now and saved[k] != now[k]]
    differ += [f"zero.stage: checkpoint {meta['zero.stage']}, this run {expected['zero.stage']}"] * (
        meta["zero.stage"] != expected["zero.stage"])
    if meta["zero.stage"] == expected["zero.stage"] > 0 and meta["zero partitions"] != expected["zero partitions"]:
        differ.append(f"zero partitions: checkpoint {meta['zero partitions']}, this run {expected['zero partitions']}")
    return differ


def record_digest(meta: dict) -> str:
    """The sha256 of a checkpoint record (without its own digest), as canonical JSON: the same after a round trip
    through the file."""
    return hashlib.new(DIGEST, json.dumps(meta, sort_keys=True).encode()).hexdigest()


def _corrupt(file: Path, checkpoint: Path, why: str) -> str:
    """The refusal of a corrupt ``file`` of ``checkpoint``, with the way on: the newest earlier checkpoint."""
    def step(folder: Path) -> int | None:
        return int(m.group(1)) if (m := STEP_DIR.fullmatch(folder.name)) else None

    this = step(checkpoint)
    earlier = [(s, p) for p in checkpoint.parent.iterdir()
               if (s := step(p)) is not None and (this is None or s < this) and (p / META).is_file()]
    way = (f"rename {checkpoint} (e.g. to {checkpoint.name}.corrupt), then --resume continues from {max(earlier)[1]}"
           if earlier else f"{checkpoint.parent} holds no earlier one: start the run again (--overwrite)")
    return f"{file}: {why}; the checkpoint is corrupt. Resume from an earlier one: {way}"


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint folder ``path`` names: a ``stepN`` folder itself, or the newest complete one of a
    ``checkpoints`` folder or of a run folder (``train.out_dir``).

    Raises:
        FileNotFoundError: nothing there, or no complete checkpoint.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if (path / META).is_file() or STEP_DIR.fullmatch(path.name) or path.name.startswith(".tmp-"):
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    steps = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.fullmatch(p.name)) and (p / META).is_file()]
    if not steps:
        raise FileNotFoundError(f"{path}: no complete checkpoint (a folder stepN with {META}) in {root}")
    return max(steps)[1]


def read_record(path: Path) -> dict:
    """The record (``checkpoint.json``) of the complete checkpoint folder ``path``, checked against its own sha256
    (format 2).

    Raises:
        ValueError: the save did not finish, or the record is corrupt (naming it and an earlier checkpoint).
    """
    meta_file = path / META
    if not meta_file.is_file():
        raise ValueError(f"{path} is incomplete (no {META}: its save was interrupted); resume from the run folder "
                         f"to take the newest complete checkpoint")
    try:
        meta = json.loads(meta_file.read_text(errors="replace"))
    except json.JSONDecodeError as err:
        raise ValueError(_corrupt(meta_file, path, f"not a ds4sci checkpoint record ({err})")) from None
    if "format" in meta or RECORD_DIGEST in meta:  # format 2 on (format 1 had neither)
        if meta.pop(RECORD_DIGEST, None) != record_digest(meta):
            raise ValueError(_corrupt(meta_file, path, f"content differs from what the save wrote ({DIGEST} "
                                                       f"mismatch)"))
    return meta


def check_checkpoint(path: Path, expected: dict) -> dict:
    """The record of the complete checkpoint folder ``path`` (:func:`read_record`), checked against ``expected``
    (the loading run's :func:`ds4sci.train.checkpoint.fingerprint`), and its files against the sizes the save wrote
    (their contents: :func:`verify_checkpoint`).

    Raises:
        ValueError: the save did not finish, the record is corrupt, a file is missing or truncated, or a field
            differs (each named).
    """
    meta = read_record(path)
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
    if differ:
        raise ValueError(f"{path} was saved by another configuration: {'; '.join(differ)}")
    layout = engine_differences(meta, expected)
    if layout and PORTABLE not in meta:
        raise ValueError(f"{path} was saved at {describe_layout(meta)}, this run is {describe_layout(expected)}: "
                         f"{'; '.join(layout)}; it holds no portable state (saved by an older ds4sci), so it resumes "
                         f"only at its own layout")
    return meta


def verify_checkpoint(path: Path, meta: dict) -> None:
    """Check every file of the checkpoint ``path`` against the sha256 its save recorded (``meta``: its
    :func:`check_checkpoint`), before any is used. Collective: each rank reads a share, split by bytes
    (:class:`Spread`), so the checkpoint is read once more in all, ~1/world per rank; every rank raises the same
    error. A format-1 checkpoint (saved before ds4sci recorded digests) is checked by size only, with a warning.

    Raises:
        ValueError: a file's content differs from what the save wrote (naming the file and the way on).
    """
    if DIGEST not in meta:
        if dist.get_rank() == 0:
            logger.warning("%s records no file digests (saved by an older ds4sci): its files are checked by size "
                           "only", path / META)
        return
    spread, rank, problem = Spread(dist.get_world_size()), dist.get_rank(), None
    for name in sorted(meta["files"], key=lambda n: (-meta["files"][n], n)):  # largest first: an even split
        if spread.take(meta["files"][name]) == rank and problem is None and (
                digest_file(path / name) != meta[DIGEST][name]):
            problem = _corrupt(path / name, path, f"content differs from what the save wrote ({DIGEST} mismatch)")
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    problem = next((p for p in problems if p is not None), None)
    if problem is not None:
        raise ValueError(problem)
