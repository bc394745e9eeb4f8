"""Checkpoint faults: atomic checkpoints (a process killed while saving leaves the previous one loadable, and the
resumed run continues the uninterrupted loss curve), checkpoint errors naming the file or field, flipped bytes in
a checkpoint refused naming the file (sha256), the portable state spread by bytes, and safe loading."""
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from ds4sci.spawn import run_workers

from fork_checks import launch
from test_train_equivalence import ENV
from test_train_equivalence import _overrides

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------- checkpoint records
def _fake_checkpoint(folder: Path, step: int, model: dict, stage: int = 0, complete: bool = True) -> Path:
    path = folder / f"step{step}"
    path.mkdir(parents=True)
    (path / "mp_rank_00_model_states.pt").write_bytes(b"x" * 10)
    if complete:
        meta = {"step": step, "model": model, "zero.stage": stage, "zero partitions": 2,
                "files": {"mp_rank_00_model_states.pt": 10}}
        (path / "checkpoint.json").write_text(json.dumps(meta))
    return path


def test_checkpoint_records_name_what_is_wrong(tmp_path):
    from ds4sci.train.checkpoint_check import check_checkpoint
    from ds4sci.train.checkpoint_check import find_checkpoint

    model = {"num_layers": 2, "hidden_size": 32}
    this_run = {"model": model, "zero.stage": 1, "zero partitions": 2}
    root = tmp_path / "run" / "checkpoints"
    _fake_checkpoint(root, 2, model, stage=1)
    newest = _fake_checkpoint(root, 10, model, stage=1)  # 10 > 4: steps compare as numbers, not strings
    (root / ".tmp-step12").mkdir()  # a save killed midway
    _fake_checkpoint(root, 11, model, stage=1, complete=False)
    assert find_checkpoint(tmp_path / "run") == newest == find_checkpoint(root)
    assert check_checkpoint(newest, this_run)["step"] == 10

    with pytest.raises(ValueError, match=r"step11 is incomplete \(no checkpoint.json"):
        check_checkpoint(find_checkpoint(root / "step11"), this_run)
    with pytest.raises(ValueError, match=r"\.tmp-step12 is incomplete"):
        check_checkpoint(find_checkpoint(root / ".tmp-step12"), this_run)
    with pytest.raises(ValueError, match=r"model\.num_layers: checkpoint 2, this run 4$"):
        check_checkpoint(newest, {**this_run, "model": {**model, "num_layers": 4}})
    with pytest.raises(ValueError, match=r"zero\.stage: checkpoint 1, this run 2"):
        check_checkpoint(newest, {**this_run, "zero.stage": 2})
    with pytest.raises(ValueError, match=r"zero partitions: checkpoint 2, this run 4"):
        check_checkpoint(newest, {**this_run, "zero partitions": 4})
    file = newest / "mp_rank_00_model_states.pt"
    file.write_bytes(b"x" * 4)
    with pytest.raises(ValueError, match=r"step10/mp_rank_00_model_states.pt is truncated or changed: 4 bytes, the "
                                         r"save wrote 10"):
        check_checkpoint(newest, this_run)
    file.unlink()
    with pytest.raises(ValueError, match=r"step10/mp_rank_00_model_states.pt is missing"):
        check_checkpoint(newest, this_run)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        find_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        find_checkpoint(tmp_path / "nowhere")


def test_safe_load_refuses_pickled_code_and_names_a_truncated_file(tmp_path):
    from ds4sci.train.checkpoint_check import safe_load

    good = tmp_path / "table.pt"
    torch.save({"weight": torch.ones(3), "scheduler": {"last_epoch": 2}}, good)
    assert safe_load(good)["scheduler"]["last_epoch"] == 2
    evil = tmp_path / "evil.pt"
    torch.save({"callback": Path("x")}, evil)  # any class outside the allowlist
    with pytest.raises(ValueError, match=r"evil.pt: torch.load\(weights_only=True\) refuses it \(it holds pathlib"):
        safe_load(evil)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[:40])
    with pytest.raises(ValueError, match=r"cut.pt: cannot be read, truncated or corrupt"):
        safe_load(cut)


# ----------------------------------------------------------------------------------------- flipped bytes
def _flip(file: Path, count: int = 64) -> bytes:
    """Invert ``count`` bytes in the middle of ``file`` (its size unchanged); returns its original content."""
    data = file.read_bytes()
    start = max(0, len(data) // 2 - count // 2)
    file.write_bytes(data[:start] + bytes(b ^ 0xFF for b in data[start:start + count]) + data[start + count:])
    return data


def _corrupt_each_file(rank, world, out):
    """DP2 ZeRO-3 with the learned position table: one step and a save; then each file of the checkpoint in turn has
    64 bytes flipped (by rank 0) and both ranks load it. Returns the files, each rank's error per file, the portable
    files' tensor names and bytes, and the step the intact checkpoint loads at."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from ds4sci.train.checkpoint import load_checkpoint
    from ds4sci.train.checkpoint import save_checkpoint
    from ds4sci.train.config import load_config
    from ds4sci.train.trainer import Trainer

    trainer = Trainer(load_config(None, _overrides(out, 3, micro=1, steps=2)))
    trainer.train_step()
    path = save_checkpoint(trainer)
    names = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    errors = {}
    for name in names:
        if rank == 0:
            original = _flip(path / name)
        dist.barrier()
        try:
            load_checkpoint(trainer, path)
            errors[name] = None
        except ValueError as err:
            errors[name] = str(err)
        dist.barrier()
        if rank == 0:
            (path / name).write_bytes(original)
        dist.barrier()
    trainer.step = 0
    load_checkpoint(trainer, path)
    portable = {p.name: {k: v.nbytes for k, v in load_file(p).items()} for p in (path / "portable").iterdir()}
    engine_names = {n for n, _ in trainer.engine.module.named_parameters()}
    return str(path), names, errors, portable, engine_names, trainer.step


@pytest.mark.distributed
def test_a_flipped_byte_anywhere_is_refused_by_every_rank_naming_the_file_and_the_portable_state_is_spread(tmp_path):
    results = run_workers(_corrupt_each_file, 2, str(tmp_path / "run"), env=ENV, timeout=300)
    path, names, errors, portable, engine_names, step = results[0]
    path = Path(path)
    assert {"checkpoint.json", "portable/rank00000.safetensors", "portable/rank00001.safetensors",
            "position_table/sp00000.pt", *(f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in range(2)
                                           for kind in ("model", "optim"))} == set(names)
    for name in names:
        assert errors[name] == results[1][2][name], name  # both ranks: the same line
        assert errors[name] is not None and errors[name].startswith(f"{path / name}: "), (name, errors[name])
        assert errors[name].endswith(f"; the checkpoint is corrupt. Resume from an earlier one: {path.parent} holds "
                                     f"no earlier one: start the run again (--overwrite)"), errors[name]
        if name != "checkpoint.json":  # (its flip may also break the JSON)
            assert f"{path / name}: content differs from what the save wrote (sha256 mismatch)" in errors[name]
    assert step == 1  # intact again: loads

    # each parameter's master and moments whole in one file; each file <= half the state + one parameter's
    per_param = {}
    for tensors in portable.values():
        for key, nbytes in tensors.items():
            per_param.setdefault(key.split("/", 1)[1], []).append(nbytes)
    assert set(per_param) == engine_names and all(len(v) == 3 for v in per_param.values())
    total, largest = sum(map(sum, per_param.values())), max(map(sum, per_param.values()))
    for file, tensors in portable.items():
        assert sum(tensors.values()) <= total / 2 + largest, (file, sum(tensors.values()), total, largest)


def _cli_train(out: Path, zero: int, steps: int, *args: str) -> subprocess.CompletedProcess:
    """``ds4sci train`` in one process (:func:`fork_checks.launch`: forked, not a fresh interpreter) on the genome,
    rotary positions, a save every step."""
    sets = _overrides(out, zero, pe="rotary", steps=steps,
                      extra=["train.save_every=1", f"data.cache_dir={out.parent / 'token_cache'}"])
    [done] = launch(["train", *[a for s in sets for a in ("--set", s)], *args], [{**ENV, "OMP_NUM_THREADS": "1"}],
                    cwd=ROOT, timeout=300)
    return done


@pytest.mark.distributed
@pytest.mark.slow
def test_a_flipped_byte_is_refused_at_resume_naming_the_file_through_the_cli(tmp_path):
    """64 flipped bytes (the size unchanged) in the engine's model states (the fast path) or the portable state
    (read when the layout changes: here ZeRO-1 -> 0): ``--resume`` exits 2 with one line naming the file and the
    earlier checkpoint (every file's refusal by every rank: the test above). Following it (renaming the corrupt one)
    resumes, a torn final metrics line dropped."""
    out = tmp_path / "run"
    first = _cli_train(out, 1, 2)
    assert first.returncode == 0, first.stderr[-3000:]
    step1, step2 = out / "checkpoints" / "step1", out / "checkpoints" / "step2"
    for name, zero in (("mp_rank_00_model_states.pt", 1), ("portable/rank00000.safetensors", 0)):
        original = _flip(step2 / name)
        resumed = _cli_train(out, zero, 3, "--resume")
        errors = [line for line in resumed.stderr.splitlines() if "error:" in line]
        assert resumed.returncode == 2 and "Traceback" not in resumed.stderr, (name, resumed.stderr[-3000:])
        assert errors == [f"ds4sci train: error: {step2 / name}: content differs from what the save wrote (sha256 "
                          f"mismatch); the checkpoint is corrupt. Resume from an earlier one: rename {step2} (e.g. to "
                          f"step2.corrupt), then --resume continues from {step1}"], (name, errors)
        (step2 / name).write_bytes(original)

    _flip(step2 / "mp_rank_00_model_states.pt")
    step2.rename(out / "checkpoints" / "step2.corrupt")
    metrics = out / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join(lines) + '\n{"step": 3, "loss": 2.')  # the stopped run died writing step 3
    resumed = _cli_train(out, 1, 3, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {step1} at step 1" in resumed.stderr
    assert f"{metrics}: line {len(lines) + 1}, the last, is torn" in resumed.stderr
    assert [r["step"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r] == [1, 2, 3]


# ------------------------------------------------------------------------------------------ kill during a save
def _killed_while_saving(rank, world, out):
    """Train 4 steps saving every 2; the save of step 4 dies (SIGKILL) halfway through its first file."""
    from ds4sci.train.checkpoint import SafeCheckpointEngine
    from ds4sci.train.config import load_config
    from ds4sci.train.trainer import Trainer

    trainer = Trainer(load_config(None, _overrides(out, 1, steps=4, extra=["train.save_every=2"])))
    save = SafeCheckpointEngine.save  # the engine every save writes DeepSpeed's files with

    def dying_save(self, state_dict, path):
        if ".tmp-step4" not in path:
            return save(self, state_dict, path)
        save(self, state_dict, path)
        data = Path(path).read_bytes()
        Path(path).write_bytes(data[: len(data) // 2])  # the kill lands while this file is being written
        os.kill(os.getpid(), signal.SIGKILL)

    SafeCheckpointEngine.save = dying_save  # this spawned process only
    trainer.train()


def _resume_after_kill(rank, world, out, straight_out):
    from ds4sci.train.checkpoint import load_checkpoint
    from ds4sci.train.config import load_config
    from ds4sci.train.trainer import Trainer

    def trainer(folder, *extra, resume=None):
        cfg = load_config(None, _overrides(folder, 1, steps=4, extra=["train.save_every=2", *extra]))
        return Trainer(cfg, resume=resume)

    flags = []
    real_load = torch.load

    def spy(*args, **kwargs):
        flags.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    torch.load = spy
    try:
        resumed = trainer(out, resume="")  # the run folder: its newest complete checkpoint
    finally:
        torch.load = real_load
    loaded = resumed.resumed_from
    with pytest.raises(ValueError, match=r"\.tmp-step4 is incomplete"):
        load_checkpoint(resumed, Path(out) / "checkpoints" / ".tmp-step4")
    resumed_losses = [resumed.train_step().loss for _ in range(2)]
    resumed_state = {k: v.numpy() for k, v in resumed.full_state_dict().items()}

    straight = trainer(straight_out)
    straight_losses = [straight.train_step().loss for _ in range(4)]
    straight_state = {k: v.numpy() for k, v in straight.full_state_dict().items()}

    other = trainer(Path(out).parent / "other", "model.overrides.num_layers=3")
    with pytest.raises(ValueError, match=r"another configuration: model\.num_layers: checkpoint 2, this run 3"):
        load_checkpoint(other, out)
    return loaded.name, flags, resumed_losses, resumed_state, straight_losses, straight_state


@pytest.mark.distributed
def test_a_kill_during_a_save_leaves_the_previous_checkpoint_and_the_resume_continues_the_curve(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match=r"exited with code -9"):
        run_workers(_killed_while_saving, 1, str(out), env=ENV, timeout=300)
    root = out / "checkpoints"
    assert (root / "step2" / "checkpoint.json").is_file() and not (root / "step4").exists()
    assert (root / ".tmp-step4").is_dir() and not (root / ".tmp-step4" / "checkpoint.json").exists()
    assert (root / "latest").read_text() == "step2"

    loaded, flags, losses, state, straight_losses, straight_state = run_workers(
        _resume_after_kill, 1, str(out), str(tmp_path / "straight"), env=ENV, timeout=300)[0]
    assert loaded == "step2"
    assert flags and all(flag is True for flag in flags), flags  # DeepSpeed's files and the table: safe loads only
    assert losses == straight_losses[2:]  # bitwise: fp32 on the CPU, same layout
    assert straight_losses[3] != straight_losses[1]
    for key, value in straight_state.items():
        torch.testing.assert_close(torch.from_numpy(state[key]), torch.from_numpy(value), rtol=0, atol=0,
                                   msg=lambda m, k=key: f"{k}: {m}")
