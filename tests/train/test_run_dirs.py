"""Run folders that never mix, and what training says while it runs, through the CLI."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ds4sci.train.config import load_config
from ds4sci.train.run_dir import prepare_run_dir

ROOT = Path(__file__).resolve().parents[2]
CDS = ROOT / "examples" / "data" / "NZ_CP040672.1_cds_100.fna"
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
TINY = {"data": {"fasta": str(CDS), "dataset": "records", "seq_len": 32, "val_fraction": 0.2},
        "train": {"steps": 4, "micro_batch_size": 2, "log_every": 1, "eval_every": 2, "eval_batches": 1,
                  "save_every": 2, "progress": False}}


def _train(config: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ds4sci.cli", "train", str(config), "--set", f"train.out_dir={out}", *args]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


def _metrics(out: Path) -> tuple[list[int], list[int]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "loss" in r], [r["step"] for r in rows if "val_loss" in r]


def _checkpoints(out: Path) -> tuple[set[str], str]:
    root = out / "checkpoints"
    return {p.name for p in root.iterdir() if p.is_dir()}, (root / "latest").read_text().strip()


def _error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return lines[0]


def test_a_second_run_never_mixes_with_the_first(tmp_path):
    config, out = tmp_path / "tiny.yaml", tmp_path / "run"
    config.write_text(json.dumps(TINY))  # JSON is YAML
    first = _train(config, out)
    assert first.returncode == 0, first.stderr[-3000:]
    # the start-up block and one line per validation, as they happen (train.progress=false: one line per step too)
    log = first.stderr
    for needle in (f"run folder  {out}", "101,376 parameters", "rotary position embedding", "records of 32: train",
                   "validation 13,440 tokens", "dp 1 x tp 1 x ulysses 1 x ring 1 x pp 1", "fp32, ZeRO stage 0",
                   "step 1/4: loss", "step 2/4: validation loss", "step 4/4: validation loss"):
        assert needle in log, needle
    assert log.index("step 2/4: validation loss") < log.index("saved checkpoint") < log.index("step 3/4: loss")
    assert _metrics(out) == ([1, 2, 3, 4], [2, 4]) and _checkpoints(out) == ({"step2", "step4"}, "step4")

    # README's second command into the same folder: refused, nothing of the first run touched
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    line = _error_line(_train(config, out, "--set", "train.steps=2"))
    assert str(out) in line and "--resume" in line and "--overwrite" in line
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before

    # --resume continues from step 4; what a stopped run logged after its checkpoint is dropped
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 5, "loss": 99.0, "tokens": 1, "lr": 0.0}) + "\n")
    resumed = _train(config, out, "--resume", "--set", "train.steps=6")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / 'step4'} at step 4" in resumed.stderr
    assert "99.0" not in (out / "metrics.jsonl").read_text()
    assert _metrics(out) == ([1, 2, 3, 4, 5, 6], [2, 4, 6])
    assert _checkpoints(out) == ({"step2", "step4", "step6"}, "step6")

    # --overwrite replaces the run (the token cache stays: not rebuilt)
    replaced = _train(config, out, "--overwrite", "--set", "train.steps=2")
    assert replaced.returncode == 0, replaced.stderr[-3000:]
    assert "building from" not in replaced.stderr and "deleted the run in" in replaced.stderr
    assert _metrics(out) == ([1, 2], [2]) and _checkpoints(out) == ({"step2"}, "step2")
    assert load_config(out / "config.yaml").train.steps == 2


def _fake_run(out: Path, cfg, steps=(2, 4)) -> None:
    """A run folder as the trainer leaves it, with complete checkpoints ``stepN`` (their marker file only)."""
    for step in steps:
        (out / "checkpoints" / f"step{step}").mkdir(parents=True)
        (out / "checkpoints" / f"step{step}" / "checkpoint.json").write_text(json.dumps({"step": step}))
    (out / "config.yaml").write_text(cfg.to_yaml())


def test_run_folder_rules(tmp_path):
    out = tmp_path / "run"
    cfg = load_config(None, [f"train.out_dir={out}", f"data.fasta={CDS}"])
    assert prepare_run_dir(cfg) is None  # missing: a new run
    (out / "token_cache").mkdir(parents=True)
    assert prepare_run_dir(cfg) is None  # a token cache alone is no run
    (out / "notes.txt").write_text("mine")
    for kwargs in ({}, {"overwrite": True}, {"resume": ""}):  # not a ds4sci run: never deleted, never written
        with pytest.raises(ValueError, match=f"{out} is not empty and holds no ds4sci run.*notes.txt"):
            prepare_run_dir(cfg, **kwargs)
    assert (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    _fake_run(out, cfg, steps=())
    with pytest.raises(ValueError, match="no complete checkpoint .*--overwrite"):
        prepare_run_dir(cfg, resume="")
    _fake_run(out, cfg)
    assert prepare_run_dir(cfg, resume="") == out / "checkpoints" / "step4"
    with pytest.raises(ValueError, match="newest checkpoint is .*step4.*--set train.out_dir=NEW --resume"):
        prepare_run_dir(cfg, resume=str(out / "checkpoints" / "step2"))
    with pytest.raises(ValueError, match="is a file.*ds4sci train CONFIG --resume"):
        prepare_run_dir(cfg, resume=str(out / "config.yaml"))
    changed = load_config(None, [f"train.out_dir={out}", f"data.fasta={CDS}", "optim.lr=0.5", "train.steps=500",
                                 "train.micro_batch_size=8", "parallel.ulysses=1", "zero.stage=1"])
    with pytest.raises(ValueError, match=r"optim.lr: 0.001 -> 0.5; samples per global micro-batch .*: 4 -> 8\. Only"):
        prepare_run_dir(changed, resume="")
    # branching: another run's checkpoint into an empty folder; the config is checked against that run's
    other = load_config(None, [f"train.out_dir={tmp_path / 'branch'}", f"data.fasta={CDS}", "train.steps=9"])
    assert prepare_run_dir(other, resume=str(out / "checkpoints" / "step2")) == out / "checkpoints" / "step2"
    (out / "export").mkdir()
    assert prepare_run_dir(cfg, overwrite=True) is None
    assert sorted(p.name for p in out.iterdir()) == ["token_cache"]
