"""Checkpoints for exact resume, at the layout that saved them or any other: DeepSpeed's engine checkpoint, a
layout-free copy of the training state ("portable") and the learned position table's state, one file per
sequence shard (:meth:`ds4sci.train.position_table.PositionTable.shard_state`).

Layout of ``train.out_dir/checkpoints``::

    step4/                 a complete checkpoint: DeepSpeed's files (mp_rank_*_model_states.pt, under ZeRO
                           zero_pp_rank_*_optim_states.pt, under PP layer_*-model_states.pt), portable/rank*.safetensors,
                           position_table/sp*.pt, and checkpoint.json, written last
    latest                 the newest complete tag (DeepSpeed's pointer; its tools, e.g. zero_to_fp32.py, read it)
    .tmp-step6/            a save in progress, or one a killed process left behind (never loaded; removed by the
                           next save)

A save is atomic: every rank writes into ``.tmp-stepN`` (DeepSpeed with ``save_latest=False``) and takes the
sha256 of each file it wrote; rank 0 gathers them, flushes the files to disk, writes ``checkpoint.json`` (format 2:
step, model config, ZeRO stage, partitions, layout, micro-batch and accumulation, the portable record, each file's
size and sha256, and the sha256 of the record itself), renames the folder to ``stepN`` and replaces ``latest``
(write a temporary file, then ``os.replace``). A process killed at any moment leaves every earlier checkpoint and
``latest`` as they were. Checkpoints live on a file system every rank sees (DeepSpeed's requirement as well).

Digests: the files ``torch.save`` writes (DeepSpeed's, through :class:`SafeCheckpointEngine`, and the position
table's) are hashed while written, nothing read back; the portable files (safetensors writes them itself) are read
back once by their writer right after the write, from the page cache; rank 0 reads only what no rank reported
(DeepSpeed's copy of NVMe-offloaded optimizer state, ``offloaded_tensors/``). Cost at save: sha256 over every byte
once, spread over the writing ranks (~1-2 GB/s per core), beside the portable files' second read.

Resuming at another layout (``parallel.*`` and ``zero.stage`` may change on resume). What DeepSpeed 0.19.8's engine
checkpoint can do, checked here: its files are per TP rank (``mp_rank_XX``), per pipeline layer, and under ZeRO 1-3
per partition of the sequence x data group (``zero_pp_rank_N``, flat fp32 partitions and AdamW moments); it loads
into the same TP and PP degrees, ZeRO stage and, under ZeRO, partition count (at stage 0 the sequence and data
degrees may change; under ZeRO ``dp x sp`` may be regrouped, e.g. SP1 x DP2 -> SP2 x DP1,
``tests/distributed/test_resume_combinations.py``). DeepSpeed's answer to the rest is the universal checkpoint
(``deepspeed/checkpoint/ds_to_universal.py``, then ``checkpoint.load_universal``): an offline conversion that
expects Megatron-style files and per-parameter TP patterns (``UNIVERSAL_CHECKPOINT_INFO``: which parameters are
split, on which dim, vocabulary padding), and knows nothing of our pipeline names or the position table kept out of
the engine. Instead each save also writes the state layout-free, by GenSLM parameter name:

- ``portable/rank{R}.safetensors``: ``param/NAME`` (the fp32 master), ``exp_avg/NAME``, ``exp_avg_sq/NAME`` (AdamW's
  moments; none before the first update), each whole: assembled over ZeRO (``deepspeed.utils.safe_get_full_fp32_param``
  / ``safe_get_full_optimizer_state``; at ZeRO-0 fp32 the parameter and the client AdamW's state), over TP
  (:func:`~ds4sci.train.consolidate.gather_tensor_parallel`, vocabulary padding cut off) and named across
  pipeline stages (:func:`~ds4sci.train.pipeline.genslm_name`). Every rank of a stage assembles each tensor and one
  of them keeps it, split by bytes (each parameter's tensors to the rank with the fewest bytes so far), so a rank
  holds and writes ~1/world of the state (at most its stage's share plus one parameter's), never the whole.
- ``checkpoint.json["portable"]``: AdamW's step count, the schedule's state, the engine's step counters.

Loading uses DeepSpeed's engine checkpoint when it can (the fast path: the same TP and PP degrees, ZeRO stage and,
under ZeRO, partition count) and the portable state otherwise: AdamW's state is created (torch AdamW creates it
lazily; ZeRO-1/2 link it to their per-parameter views after the first step), then every engine parameter's model
copy, fp32 master and moments are set from the whole tensors cut to this rank's TP piece
(:func:`~ds4sci.train.consolidate.shard_tensor_parallel`; ``safe_set_full_fp32_param`` /
``safe_set_full_optimizer_state`` keep this rank's ZeRO partition), then the schedule and the counters. Exact: the
resumed run's losses and parameters are those of an uninterrupted single process to fp32 rounding
(``tests/distributed/test_resume_layouts.py``). The cost: every save writes the fp32 master and both moments once
more (12 bytes per parameter beside the engine checkpoint's ~16 under ZeRO); the portable files are read only
when the layout changes. A checkpoint without portable state (written before it existed) resumes only at its own
layout, and loading it elsewhere is refused naming both layouts.

Loading checks before DeepSpeed reads anything: the folder is complete (``checkpoint.json``, itself unchanged: its
own sha256), no file is missing or of another size than the save wrote, every file's content is what the save
wrote (its sha256; each rank reads a share, split by bytes, and every rank refuses naming the first file that
differs: ``...: content differs from what the save wrote (sha256 mismatch); the checkpoint is corrupt. Resume from
an earlier one: ...``), and the model config matches this run (each difference named: ``model.num_layers:
checkpoint 4, this run 2``). A checkpoint saved before digests were recorded (no ``format`` in its record) is still
loaded, checked by size only, with a warning. Every file is read with ``torch.load(weights_only=True)`` or
safetensors (tensors and plain containers; no pickled code runs): DeepSpeed 0.19.8's own loader passes
``weights_only=False``, so the engine is handed :class:`SafeCheckpointEngine` for the load, which allows, by name,
the three DeepSpeed classes its ZeRO optimizer files hold (loss scaler, ZeRO stage enum, fragment address) and
nothing else.
"""
from __future__ import annotations

import contextlib
import hashlib
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
from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_fp32_param,
                             safe_set_full_optimizer_state)
from deepspeed.utils.tensor_fragment import fragment_address
from safetensors import safe_open
from safetensors.torch import save_file

from ds4sci.train.consolidate import gather_tensor_parallel, shard_tensor_parallel
from ds4sci.train.engine import bounded_collectives, write_error
from ds4sci.train.pipeline import genslm_name

logger = logging.getLogger(__name__)

__all__ = ["save_checkpoint", "load_checkpoint", "find_checkpoint", "read_record", "check_checkpoint",
           "verify_checkpoint", "SafeCheckpointEngine"]

META = "checkpoint.json"
TABLE = "position_table"  # the learned table: one file per sequence shard, sp{R}.pt (its rows, moments, positions)
PORTABLE = "portable"  # the layout-free state: one safetensors file per rank that owns some of it
_ADAM = ("exp_avg", "exp_avg_sq")  # torch AdamW's moments, beside the fp32 master ("param")
_STEP_DIR = re.compile(r"step(\d+)")
FORMAT = 2  # checkpoint.json's format: 2 records each file's sha256 and its own; 1 (no "format" key) sizes only
DIGEST = "sha256"  # checkpoint.json's key of the files' digests (hashlib's name)
RECORD_DIGEST = "record sha256"  # checkpoint.json's key of its own digest (of the rest, canonical JSON)
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


def _digest_file(path: Path) -> str:
    """The sha256 of the file ``path`` (read once, in chunks)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, DIGEST).hexdigest()


class _DigestingWriter:
    """A binary file being written, and the sha256 of every byte written to it (``torch.save`` writes through
    ``write``; nothing is read back)."""

    def __init__(self, file):
        self.file, self.hash = file, hashlib.new(DIGEST)

    def write(self, data) -> int:
        self.hash.update(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def _save_torch(obj, path: str | Path, **kwargs) -> str:
    """``torch.save(obj, path, **kwargs)``; returns the sha256 of the bytes written, computed while writing."""
    with open(path, "wb") as f:
        writer = _DigestingWriter(f)
        torch.save(obj, writer, **kwargs)
    return writer.hash.hexdigest()


def _attempt(failed: list[str], where: str, path, write) -> None:
    """``write()`` (which writes ``path``), unless a write of this save failed already: a failed write is recorded
    in ``failed`` (the one-line message of :func:`~ds4sci.train.engine.write_error`) instead of raised, so this rank
    goes on through the save's collectives and every rank learns of it where they meet (:func:`save_checkpoint`)."""
    if failed:
        return
    try:
        write()
    except Exception as err:
        error = write_error(where, path, err)
        if error is None:
            raise
        failed.append(str(error))


class SafeCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine, loading with ``weights_only=True`` (plus the DeepSpeed classes of
    ``_DEEPSPEED_SAFE_GLOBALS``) instead of its ``weights_only=False``, and saving with each file's sha256 computed
    while it is written: ``written`` maps the path DeepSpeed gave to it. A failed write or folder creation (a full
    disk) is recorded in ``failed`` (see :func:`_attempt`; ``where`` names the save), not raised into DeepSpeed,
    which would log it, or raise it between its collectives while the other ranks wait in them."""

    def __init__(self, config_params=None):
        super().__init__(config_params)
        self.written: dict[str, str] = {}
        self.failed: list[str] = []
        self.where = "checkpoint save"

    def makedirs(self, path, exist_ok=False):
        _attempt(self.failed, self.where, path, lambda: os.makedirs(path, exist_ok=exist_ok))

    def save(self, state_dict, path: str):
        def write():
            self.written[path] = _save_torch(state_dict, path,
                                             _use_new_zipfile_serialization=self.zipfile_serialization)

        _attempt(self.failed, self.where, path, write)

    def load(self, path: str, map_location=None):
        with torch.serialization.safe_globals(_DEEPSPEED_SAFE_GLOBALS):
            return safe_load(path, map_location)


class _Spread:
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


def _fingerprint(trainer) -> dict:
    """What a checkpoint records of the run that saved it (compared by :func:`check_checkpoint`; its global batch,
    ``batch`` with the layout's ``dp``, by :func:`ds4sci.train.run_dir.check_resumed_config`)."""
    d, t = trainer.dims, trainer.cfg.train
    return json.loads(json.dumps({"model": trainer.model_config.to_dict(), "zero.stage": trainer.cfg.zero.stage,
                                  "zero partitions": dist.get_world_size(trainer.groups.sdp),
                                  "layout": {"tp": d.tp, "pp": d.pp, "dp": d.dp, "ulysses": d.ulysses,
                                             "ring": d.ring},
                                  "batch": {"micro_batch_size": t.micro_batch_size,
                                            "grad_accum": t.grad_accum}}))  # as stored


def _describe(record: dict) -> str:
    """``tp 2 x pp 1 x dp 1 x ulysses 1 x ring 1, ZeRO-1`` (the layout of a :func:`_fingerprint`)."""
    layout = " x ".join(f"{k} {v}" for k, v in record["layout"].items()) if "layout" in record else "layout unrecorded"
    return f"{layout}, ZeRO-{record['zero.stage']}"


def _engine_differences(meta: dict, expected: dict) -> list[str]:
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


def _engine_params(trainer, replicas: bool = True) -> list[tuple[str, torch.nn.Parameter]]:
    """``(GenSLM name, parameter)`` of this rank's engine (its pipeline stage's parameters under PP). ``replicas=False``
    leaves out the last stage's copy of a tied embedding (DeepSpeed's ``ds_pipe_replicated``), whose values are the
    first stage's: each tensor is written once, and read into both copies."""
    named = trainer.engine.module.named_parameters()
    if trainer.dims.pp > 1:
        return [(genslm_name(name, trainer.model_config.num_layers), p) for name, p in named
                if replicas or not getattr(p, "ds_pipe_replicated", False)]
    return list(named)


def _adam_step(optimizer: torch.optim.Optimizer) -> int:
    """AdamW's step count (0 before the first update; the same for every parameter: they all step together)."""
    return int(next(iter(optimizer.state.values()), {}).get("step", 0))


def _full(trainer, name: str, p: torch.nn.Parameter, key: str) -> torch.Tensor:
    """The fp32 master (``key`` "param") or the AdamW state ``key`` of engine parameter ``p`` (GenSLM ``name``),
    whole over ZeRO (collective over the ZeRO group) and over TP (collective over the TP group); fp32, CPU."""
    value = safe_get_full_fp32_param(p) if key == "param" else safe_get_full_optimizer_state(p, key)
    if value is None:  # ZeRO-0 in fp32: the engine's parameter is the master, the client AdamW holds its moments
        value = p if key == "param" else trainer.engine.basic_optimizer.state[p][key]
    full = gather_tensor_parallel({name: value.detach().float()}, trainer.groups, trainer.tp_plan)[name]
    return full.cpu().contiguous()


def _save_portable(trainer, folder: Path, digests: dict[str, str], failed: list[str], where: str) -> dict:
    """Write the layout-free state into ``folder/portable`` (collective), add its file's sha256 to ``digests`` and
    return its record for ``checkpoint.json`` (a failed write: recorded in ``failed``, see :func:`_attempt`).

    Each parameter's tensors (``param/NAME``, ``exp_avg/NAME``, ``exp_avg_sq/NAME`` by GenSLM name, TP- and
    ZeRO-whole) are assembled on every rank of its pipeline stage and kept by one of them, split by bytes
    (:class:`_Spread`, in the engine's parameter order, the same on every rank of the stage), so each rank holds and
    writes at most ``1 / ranks per stage`` of its stage's state plus one parameter's (``rank{R}.safetensors``;
    stages are not balanced against each other: a tensor stays on the stage that assembled it). The sha256 is
    read back right after the write (safetensors writes the file itself; its bytes are still in the page cache)."""
    engine, groups, dims = trainer.engine, trainer.groups, trainer.dims
    step = _adam_step(engine.basic_optimizer)
    keys = ("param", *_ADAM) if step else ("param",)  # no moments before the first update
    spread = _Spread(dims.tp * dist.get_world_size(groups.sdp))
    me = groups.sdp_rank * dims.tp + groups.tp_rank
    mine = {}
    for name, p in _engine_params(trainer, replicas=False):
        tensors = {f"{key}/{name}": _full(trainer, name, p, key) for key in keys}
        if spread.take(sum(t.nbytes for t in tensors.values())) == me:
            mine.update(tensors)
    if mine:
        file = folder / PORTABLE / f"rank{trainer.rank:05d}.safetensors"

        def write():
            file.parent.mkdir(exist_ok=True)
            save_file(mine, file)
            digests[str(file.relative_to(folder))] = _digest_file(file)

        _attempt(failed, where, file, write)
    return {"adam_step": step, "scheduler": engine.lr_scheduler.state_dict(), "global_steps": engine.global_steps,
            "global_samples": engine.global_samples, "skipped_steps": engine.skipped_steps}


def save_checkpoint(trainer) -> Path:
    """Save under ``out_dir/checkpoints/step{N}``, atomically (collective: every rank calls it): the engine
    checkpoint, the portable state and the position table, each file's sha256 taken by the rank that wrote it.

    A failed write (a full disk, a folder gone) stops every rank with the same line: each rank records its first
    failed write and skips the rest of its writes while it goes on through the save's collectives; rank 0 gathers
    them with the digests, commits only when none failed, and shares the outcome (its own commit's failure
    included). A rank that dies or hangs meanwhile: :func:`~ds4sci.train.engine.bounded_collectives`.

    Raises:
        OSError: ``checkpoint save at step N: cannot write PATH: REASON; ...`` naming the checkpoint that stays
            the newest; ``ConnectionError`` / ``TimeoutError``: another rank died or hangs.
    """
    root = trainer.out / "checkpoints"
    tag = f"step{trainer.step}"
    tmp = root / f".tmp-{tag}"
    where = f"checkpoint save at step {trainer.step}"
    with bounded_collectives(f"{where} ({root / tag})", trainer.cfg.train.timeout_s):
        if trainer.rank == 0 and tmp.exists():
            shutil.rmtree(tmp)  # left by a save that was killed
        engine = trainer.engine
        if not isinstance(engine.checkpoint_engine, SafeCheckpointEngine):  # DeepSpeed's own takes no digests
            engine.checkpoint_engine = SafeCheckpointEngine(engine._config)
        writer = engine.checkpoint_engine
        writer.written.clear()
        writer.failed.clear()
        writer.where = where
        # DeepSpeed's rank 0 copies its zero_to_fp32.py into the checkpoints folder between its collectives
        copy_script = type(engine)._copy_recovery_script
        engine._copy_recovery_script = lambda folder: _attempt(writer.failed, where, folder,
                                                               lambda: copy_script(engine, folder))
        dist.barrier()
        engine.save_checkpoint(str(root), tag=tmp.name, client_state={"step": trainer.step}, save_latest=False)
        digests = {str(Path(path).relative_to(tmp)): d for path, d in writer.written.items()}
        portable = _save_portable(trainer, tmp, digests, writer.failed, where)
        groups = trainer.groups
        if trainer.pos_table is not None and groups.dp_rank == 0 and groups.tp_rank == 0 and groups.coords.pp == 0:
            name = f"{TABLE}/sp{groups.sp_rank:05d}.pt"  # one writer per sequence shard: its own rows only

            def write_table():
                (tmp / TABLE).mkdir(exist_ok=True)
                digests[name] = _save_torch(trainer.pos_table.shard_state(), tmp / name)

            _attempt(writer.failed, where, tmp / name, write_table)
        every = [None] * dist.get_world_size() if trainer.rank == 0 else None
        dist.gather_object((digests, writer.failed[:1]), every, dst=0)  # rank 0 waits for every rank's files
        outcome = [None]
        if trainer.rank == 0:
            outcome[0] = next((failed[0] for _, failed in every if failed), None)
            if outcome[0] is None:
                meta = {"step": trainer.step, **_fingerprint(trainer), PORTABLE: portable}
                try:
                    _commit(root, tmp, tag, meta, [written for written, _ in every])
                except OSError as err:
                    outcome[0] = str(write_error(where, tmp, err) or err)
        dist.broadcast_object_list(outcome, src=0, device=trainer.device)
    if outcome[0] is not None:
        raise OSError(f"{outcome[0]}; {_kept(root)}")
    if trainer.rank == 0:
        logger.info("saved checkpoint %s", root / tag)
    return root / tag


def _kept(root: Path) -> str:
    """After a failed save into ``root``: which checkpoint stays the newest, and the way on."""
    try:
        return (f"this save is incomplete and never loaded; the newest complete checkpoint is {find_checkpoint(root)} "
                f"(free space, then --resume continues from it)")
    except FileNotFoundError:
        return f"this save is incomplete and never loaded; {root} holds no complete checkpoint"


def _commit(root: Path, tmp: Path, tag: str, meta: dict, written: list[dict[str, str]]) -> None:
    """Rank 0: make the written ``tmp`` folder the checkpoint ``tag`` (see the module docstring). ``written``: per
    rank, the sha256 of each file it wrote (name relative to ``tmp``); rank 0 reads the files no rank reported
    (DeepSpeed's copy of NVMe-offloaded optimizer state) and any reported with two different digests (two writers
    of one file: which one landed is unknown)."""
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    for path in files:  # on disk before the marker that declares them complete
        with _naming(path), open(path, "rb") as f:
            os.fsync(f.fileno())
    reported: dict[str, set[str]] = {}
    for rank_written in written:
        for name, digest in rank_written.items():
            reported.setdefault(name, set()).add(digest)
    names = [str(p.relative_to(tmp)) for p in files]
    meta.update({"format": FORMAT, "files": {name: (tmp / name).stat().st_size for name in names},
                 DIGEST: {name: next(iter(reported[name])) if len(reported.get(name, ())) == 1
                          else _digest_file(tmp / name) for name in names}})
    _write_atomic(tmp / META, json.dumps({**meta, RECORD_DIGEST: _record_digest(meta)}, indent=1))
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


def _record_digest(meta: dict) -> str:
    """The sha256 of a checkpoint record (without its own digest), as canonical JSON: the same after a round trip
    through the file."""
    return hashlib.new(DIGEST, json.dumps(meta, sort_keys=True).encode()).hexdigest()


def _corrupt(file: Path, checkpoint: Path, why: str) -> str:
    """The refusal of a corrupt ``file`` of ``checkpoint``, with the way on: the newest earlier checkpoint."""
    def step(folder: Path) -> int | None:
        return int(m.group(1)) if (m := _STEP_DIR.fullmatch(folder.name)) else None

    this = step(checkpoint)
    earlier = [(s, p) for p in checkpoint.parent.iterdir()
               if (s := step(p)) is not None and (this is None or s < this) and (p / META).is_file()]
    way = (f"rename {checkpoint} (e.g. to {checkpoint.name}.corrupt), then --resume continues from {max(earlier)[1]}"
           if earlier else f"{checkpoint.parent} holds no earlier one: start the run again (--overwrite)")
    return f"{file}: {why}; the checkpoint is corrupt. Resume from an earlier one: {way}"


@contextlib.contextmanager
def _naming(path: Path):
    """Inside, an ``OSError`` that names no file (a write's or an fsync's) names ``path``."""
    try:
        yield
    except OSError as err:
        if err.filename is None:
            err.filename = str(path)
        raise


def _write_atomic(path: Path, text: str) -> None:
    part = path.with_name(path.name + ".part")
    with _naming(part), open(part, "w", encoding="utf-8") as f:
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
        if meta.pop(RECORD_DIGEST, None) != _record_digest(meta):
            raise ValueError(_corrupt(meta_file, path, f"content differs from what the save wrote ({DIGEST} "
                                                       f"mismatch)"))
    return meta


def check_checkpoint(path: Path, expected: dict) -> dict:
    """The record of the complete checkpoint folder ``path`` (:func:`read_record`), checked against ``expected``
    (the loading run's :func:`_fingerprint`), and its files against the sizes the save wrote (their contents:
    :func:`verify_checkpoint`).

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
    layout = _engine_differences(meta, expected)
    if layout and PORTABLE not in meta:
        raise ValueError(f"{path} was saved at {_describe(meta)}, this run is {_describe(expected)}: "
                         f"{'; '.join(layout)}; it holds no portable state (saved by an older ds4sci), so it resumes "
                         f"only at its own layout")
    return meta


def _prime_adam(engine, step: int) -> None:
    """Create the client AdamW's state (zero moments, ``step``) for every parameter it updates, as its steps would
    (torch AdamW creates state lazily) and link it to DeepSpeed's per-parameter views (ZeRO-1/2 and bf16 link them
    after the first step: ``_lazy_init_hp_params_optimizer_state``), so the set calls of :func:`_load_portable`
    have somewhere to write."""
    optimizer, wrapper = engine.basic_optimizer, engine.optimizer
    # ZeRO-3 puts each flat fp32 partition into its AdamW's param group only while stepping it
    params = getattr(wrapper, "fp32_partitioned_groups_flat", None) or [p for g in optimizer.param_groups
                                                                         for p in g["params"]]
    for p in params:
        optimizer.state[p] = {"step": torch.tensor(float(step)), "exp_avg": torch.zeros_like(p),
                              "exp_avg_sq": torch.zeros_like(p)}
    if hasattr(wrapper, "_lazy_init_hp_params_optimizer_state"):
        wrapper._hp_optimizer_states_linked = False
        wrapper._lazy_init_hp_params_optimizer_state()


def _load_portable(trainer, path: Path, record: dict) -> None:
    """Set this rank's engine parameters, their fp32 masters and AdamW states from ``path/portable`` (any layout:
    each tensor is read whole by GenSLM name and cut to this rank's TP piece; DeepSpeed's set calls keep this
    rank's ZeRO partition), then the schedule and the engine's step counters."""
    import deepspeed

    engine, groups, stage3 = trainer.engine, trainer.groups, trainer.cfg.zero.stage == 3
    files = {}
    for file in sorted((path / PORTABLE).glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            files.update((key, file) for key in f.keys())

    def read(key: str, name: str) -> torch.Tensor:
        if f"{key}/{name}" not in files:
            raise ValueError(f"{path / PORTABLE}: no {key}/{name} (this model's parameter {name})")
        with safe_open(files[f"{key}/{name}"], "pt") as f:
            full = f.get_tensor(f"{key}/{name}")
        return shard_tensor_parallel({name: full}, trainer.tp_plan, groups.tp_rank, trainer.dims.tp)[name]

    if record["adam_step"]:
        _prime_adam(engine, record["adam_step"])
    for name, p in _engine_params(trainer):
        value = read("param", name)
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0, enabled=stage3), torch.no_grad():
            p.copy_(value.to(p))  # the model's (low-precision) copy; under ZeRO-3 re-partitioned on leaving
        safe_set_full_fp32_param(p, value.to(p.device))
        for key in _ADAM if record["adam_step"] else ():
            moment = read(key, name).to(p.device)
            if hasattr(p, "_hp_mapping") or hasattr(p, "_z3_optimizer"):
                safe_set_full_optimizer_state(p, moment, key)
            else:  # ZeRO-0 in fp32: the client AdamW's own state
                engine.basic_optimizer.state[p][key].copy_(moment)
    engine.lr_scheduler.load_state_dict(record["scheduler"])
    for group, lr in zip(engine.lr_scheduler.optimizer.param_groups, engine.lr_scheduler.get_last_lr()):
        group["lr"] = lr  # a scheduler's state does not reach its optimizer before the next scheduler step
    engine.global_steps, engine.global_samples = record["global_steps"], record["global_samples"]
    engine.skipped_steps = record["skipped_steps"]


def verify_checkpoint(path: Path, meta: dict) -> None:
    """Check every file of the checkpoint ``path`` against the sha256 its save recorded (``meta``: its
    :func:`check_checkpoint`), before any is used. Collective: each rank reads a share, split by bytes
    (:class:`_Spread`), so the checkpoint is read once more in all, ~1/world per rank; every rank raises the same
    error. A format-1 checkpoint (saved before ds4sci recorded digests) is checked by size only, with a warning.

    Raises:
        ValueError: a file's content differs from what the save wrote (naming the file and the way on).
    """
    if DIGEST not in meta:
        if dist.get_rank() == 0:
            logger.warning("%s records no file digests (saved by an older ds4sci): its files are checked by size "
                           "only", path / META)
        return
    spread, rank, problem = _Spread(dist.get_world_size()), dist.get_rank(), None
    for name in sorted(meta["files"], key=lambda n: (-meta["files"][n], n)):  # largest first: an even split
        if spread.take(meta["files"][name]) == rank and problem is None and (
                _digest_file(path / name) != meta[DIGEST][name]):
            problem = _corrupt(path / name, path, f"content differs from what the save wrote ({DIGEST} mismatch)")
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    problem = next((p for p in problems if p is not None), None)
    if problem is not None:
        raise ValueError(problem)


def load_checkpoint(trainer, path: str | Path) -> Path:
    """Resume from a checkpoint (a ``stepN`` folder, or the newest complete one of a run or ``checkpoints``
    folder; see :func:`find_checkpoint`), at the layout that saved it or any other (module docstring). Returns the
    folder loaded."""
    path = find_checkpoint(path)
    expected = _fingerprint(trainer)
    meta = check_checkpoint(path, expected)
    verify_checkpoint(path, meta)
    engine = trainer.engine
    differ = _engine_differences(meta, expected)
    if differ:
        logger.info("%s was saved at %s, this run is %s (%s): loading its portable state", path, _describe(meta),
                    _describe(expected), "; ".join(differ))
        _load_portable(trainer, path, meta[PORTABLE])
        trainer.step = meta["step"]
    else:
        engine.checkpoint_engine = SafeCheckpointEngine(engine._config)
        _, client = engine.load_checkpoint(str(path.parent), tag=path.name)
        if client is None:
            raise ValueError(f"{path}: DeepSpeed could not load this checkpoint")
        trainer.step = int(client["step"])
        if trainer.step != meta["step"]:
            raise ValueError(f"{path}: the engine state is of step {trainer.step}, {META} says {meta['step']}")
    if trainer.pos_table is not None:
        files = sorted((path / TABLE).glob("sp*.pt"))
        if not files:
            raise FileNotFoundError(f"{path / TABLE} is missing: this checkpoint has no learned position table")
        trainer.pos_table.load_shards((safe_load(file), str(file)) for file in files)
    logger.info("resumed from %s (step %d)", path, trainer.step)
    return path
