"""Checkpoints for exact resume, at the layout that saved them or any other: DeepSpeed's engine checkpoint, a
layout-free copy of the training state ("portable") and the learned position table's state, one file per
sequence shard (:meth:`ds4sci.train.position_table.PositionTable.shard_state`).

Layout of ``train.out_dir/checkpoints``::

    step4/         a complete checkpoint: DeepSpeed's files, portable/rank*.safetensors, position_table/sp*.pt,
                   and checkpoint.json, written last (:mod:`ds4sci.train.checkpoint_check` reads and verifies it)
    latest         the newest complete tag (DeepSpeed's pointer; its tools, e.g. zero_to_fp32.py, read it)
    .tmp-step6/    a save in progress, or one a killed process left behind (never loaded; removed by the next save)

A save is atomic: every rank writes into ``.tmp-stepN`` and takes the sha256 of each file it wrote (while writing
where it can); rank 0 gathers them, flushes the files, writes ``checkpoint.json``, renames the folder to ``stepN``
and replaces ``latest``. A process killed at any moment leaves every earlier checkpoint and ``latest`` as they were.

DeepSpeed's engine checkpoint loads only into the same TP and PP degrees, ZeRO stage and, under ZeRO, partition
count. So each save also writes the state by GenSLM parameter name, whole over ZeRO, TP and pipeline stages
(``portable/``: the fp32 master and AdamW's moments, split by bytes over the ranks that assemble them, so no rank
holds the whole), and the load uses it when the layout changed: every engine parameter, master and moment is set
from the whole tensor cut to this rank's piece. Exact: the resumed losses and parameters are an uninterrupted
single process's to fp32 rounding (``tests/distributed/test_resume_layouts.py``). DeepSpeed's loader is handed
:class:`SafeCheckpointEngine`, which loads with ``weights_only=True`` plus, by name, the DeepSpeed classes its ZeRO
files hold.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils import safe_get_full_fp32_param
from deepspeed.utils import safe_get_full_optimizer_state
from deepspeed.utils import safe_set_full_fp32_param
from deepspeed.utils import safe_set_full_optimizer_state
from deepspeed.utils.tensor_fragment import fragment_address
from safetensors import safe_open
from safetensors.torch import save_file

from ds4sci.io.export import follow_umask
from ds4sci.train.checkpoint_check import DIGEST
from ds4sci.train.checkpoint_check import FORMAT
from ds4sci.train.checkpoint_check import META
from ds4sci.train.checkpoint_check import PORTABLE
from ds4sci.train.checkpoint_check import RECORD_DIGEST
from ds4sci.train.checkpoint_check import Spread
from ds4sci.train.checkpoint_check import check_checkpoint
from ds4sci.train.checkpoint_check import describe_layout
from ds4sci.train.checkpoint_check import digest_file
from ds4sci.train.checkpoint_check import engine_differences
from ds4sci.train.checkpoint_check import find_checkpoint
from ds4sci.train.checkpoint_check import record_digest
from ds4sci.train.checkpoint_check import safe_load
from ds4sci.train.checkpoint_check import verify_checkpoint
from ds4sci.train.consolidate import gather_tensor_parallel
from ds4sci.train.consolidate import shard_tensor_parallel
from ds4sci.train.engine import bounded_collectives
from ds4sci.train.engine import write_error
from ds4sci.train.pipeline import genslm_name

logger = logging.getLogger(__name__)

__all__ = ["save_checkpoint", "load_checkpoint", "SafeCheckpointEngine"]

TABLE = "position_table"  # the learned table: one file per sequence shard, sp{R}.pt (its rows, moments, positions)
_ADAM = ("exp_avg", "exp_avg_sq")  # torch AdamW's moments, beside the fp32 master ("param")
_DEEPSPEED_SAFE_GLOBALS = [LossScaler, ZeroStageEnum, fragment_address]


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


def fingerprint(trainer) -> dict:
    """What a checkpoint records of the run that saved it (compared by :func:`check_checkpoint`; its global batch,
    ``batch`` with the layout's ``dp``, by :func:`ds4sci.train.run_dir.check_resumed_config`)."""
    d, t = trainer.dims, trainer.cfg.train
    return json.loads(json.dumps({"model": trainer.model_config.to_dict(), "zero.stage": trainer.cfg.zero.stage,
                                  "zero partitions": dist.get_world_size(trainer.groups.sdp),
                                  "layout": {"tp": d.tp, "pp": d.pp, "dp": d.dp, "ulysses": d.ulysses,
                                             "ring": d.ring},
                                  "batch": {"micro_batch_size": t.micro_batch_size,
                                            "grad_accum": t.grad_accum}}))  # as stored


def _engine_params(trainer, replicas: bool = True) -> list[tuple[str, torch.nn.Parameter]]:
    """``(GenSLM name, parameter)`` of this rank's engine's trainable parameters (its pipeline stage's under PP).
    ``replicas=False`` leaves out the last stage's copy of a tied embedding (DeepSpeed's ``ds_pipe_replicated``),
    whose values are the first stage's: each tensor is written once, and read into both copies."""
    # frozen parameters (LoRA's base weights) are the run's start, rebuilt from model.init_from: never saved
    named = [(name, p) for name, p in trainer.engine.module.named_parameters() if p.requires_grad]
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
    (:class:`Spread`, in the engine's parameter order, the same on every rank of the stage), so each rank holds and
    writes at most ``1 / ranks per stage`` of its stage's state plus one parameter's (``rank{R}.safetensors``;
    stages are not balanced against each other: a tensor stays on the stage that assembled it). The sha256 is
    read back right after the write (safetensors writes the file itself; its bytes are still in the page cache)."""
    engine, groups, dims = trainer.engine, trainer.groups, trainer.dims
    step = _adam_step(engine.basic_optimizer)
    keys = ("param", *_ADAM) if step else ("param",)  # no moments before the first update
    spread = Spread(dims.tp * dist.get_world_size(groups.sdp))
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
            follow_umask(file)
            digests[str(file.relative_to(folder))] = digest_file(file)

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
                meta = {"step": trainer.step, **fingerprint(trainer), PORTABLE: portable}
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
                          else digest_file(tmp / name) for name in names}})
    _write_atomic(tmp / META, json.dumps({**meta, RECORD_DIGEST: record_digest(meta)}, indent=1))
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


def load_checkpoint(trainer, path: str | Path) -> Path:
    """Resume from a checkpoint (a ``stepN`` folder, or the newest complete one of a run or ``checkpoints``
    folder; see :func:`find_checkpoint`), at the layout that saved it or any other (module docstring). Returns the
    folder loaded."""
    path = find_checkpoint(path)
    expected = fingerprint(trainer)
    meta = check_checkpoint(path, expected)
    verify_checkpoint(path, meta)
    engine = trainer.engine
    differ = engine_differences(meta, expected)
    if differ:
        logger.info("%s was saved at %s, this run is %s (%s): loading its portable state", path, describe_layout(meta),
                    describe_layout(expected), "; ".join(differ))
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
