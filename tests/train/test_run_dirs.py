"""Run folders that never mix, and what training says while it runs, through the CLI.

The trainings run ``ds4sci.cli.main`` in a process forked from the spawn server (:mod:`fork_checks`): the command's
files, output and exit status are the subject, not the interpreter's start-up."""
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from ds4sci.train.config import load_config
from ds4sci.train.run_dir import MAY_CHANGE
from ds4sci.train.run_dir import prepare_run_dir

from cli_checks import log_messages  # tests/ is on sys.path (its conftest.py)
from fork_checks import run_in_fork

ROOT = Path(__file__).resolve().parents[2]
CDS = ROOT / "examples" / "data" / "NZ_CP040672.1_cds_100.fna"
ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}  # added to this process's
TINY = {"data": {"fasta": str(CDS), "dataset": "records", "seq_len": 32, "val_fraction": 0.2},
        "train": {"steps": 4, "micro_batch_size": 2, "log_every": 1, "eval_every": 2, "eval_batches": 1,
                  "save_every": 2, "progress": False}}


def _train(config: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    """``ds4sci train CONFIG`` into ``out`` in a process of its own (forked, torch imported), under umask 0022."""
    argv = ["train", str(config), "--set", f"train.out_dir={out}", *args]
    return run_in_fork(argv, ROOT, env=ENV, umask=0o022, timeout=300)


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


@pytest.mark.slow  # a training through the command line
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
    # every file of the run follows the umask (0022: 0644), checkpoints too (safetensors writes 0600 by itself)
    modes = {p.relative_to(out).as_posix(): oct(p.stat().st_mode & 0o777) for p in out.rglob("*") if p.is_file()}
    assert any(name.startswith("checkpoints/step4/portable/") for name in modes), sorted(modes)
    wrong = {name: mode for name, mode in modes.items() if mode != oct(0o644)}
    assert not wrong, wrong

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


def _fake_run(out: Path, cfg, steps=(2, 4), dp=1) -> None:
    """A run folder as the trainer leaves it, with complete checkpoints ``stepN`` (their record only: step, data
    ranks, batch) of a run of ``dp`` data ranks."""
    batch = {"micro_batch_size": cfg.train.micro_batch_size, "grad_accum": cfg.train.grad_accum}
    for step in steps:
        (out / "checkpoints" / f"step{step}").mkdir(parents=True)
        record = {"step": step, "layout": {"tp": 1, "pp": 1, "dp": dp, "ulysses": 1, "ring": 1}, "batch": batch}
        (out / "checkpoints" / f"step{step}" / "checkpoint.json").write_text(json.dumps(record))
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
    with pytest.raises(ValueError, match=r"optim.lr: 0.001 -> 0.5; only .* may change on resume\. resuming at dp=1 "
                                         r"with train.micro_batch_size=8 x train.grad_accum=1 is 8 sequences per step, "
                                         r"the run used 4 \(4 x dp 1 x 1\): set train.micro_batch_size=4 \("):
        prepare_run_dir(changed, resume="")
    # branching: another run's checkpoint into an empty folder; the config is checked against that run's
    other = load_config(None, [f"train.out_dir={tmp_path / 'branch'}", f"data.fasta={CDS}", "train.steps=9"])
    assert prepare_run_dir(other, resume=str(out / "checkpoints" / "step2")) == out / "checkpoints" / "step2"
    (out / "export").mkdir()
    assert prepare_run_dir(cfg, overwrite=True) is None
    assert sorted(p.name for p in out.iterdir()) == ["token_cache"]


def test_resume_auto_continues_a_run_with_a_checkpoint_and_starts_one_without(tmp_path):
    """One command line for every start of a job: a missing or empty folder (a token cache and a lock are no run)
    starts a run; a run stopped before its first checkpoint starts again, its files deleted but the cache; a run with
    a checkpoint continues from its newest; another config's run is refused with or without a checkpoint, untouched."""
    from ds4sci.train.run_lock import LOCK_FILE

    out = tmp_path / "run"
    cfg = load_config(None, [f"train.out_dir={out}", f"data.fasta={CDS}"])
    other = load_config(None, [f"train.out_dir={out}", f"data.fasta={CDS}", "optim.lr=0.5"])
    assert prepare_run_dir(cfg, resume="auto") is None
    (out / "token_cache").mkdir(parents=True)
    (out / LOCK_FILE).write_text("")
    assert prepare_run_dir(cfg, resume="auto") is None
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=f"{out} is not empty and holds no ds4sci run.*notes.txt"):
        prepare_run_dir(cfg, resume="auto")
    (out / "notes.txt").unlink()
    _fake_run(out, cfg, steps=())
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    before = _files(out)
    with pytest.raises(ValueError, match=rf"^--resume auto: train.out_dir {out} holds another run: the config "
                                         r"differs .*optim.lr: 0.001 -> 0.5; only .* may change on resume$"):
        prepare_run_dir(other, resume="auto")
    assert _files(out) == before
    assert prepare_run_dir(cfg, resume="auto") is None  # stopped before its first save: started again
    assert sorted(p.name for p in out.iterdir()) == sorted([LOCK_FILE, "token_cache"])
    _fake_run(out, cfg)
    assert prepare_run_dir(cfg, resume="auto") == out / "checkpoints" / "step4"
    before = _files(out)
    with pytest.raises(ValueError, match=r"^--resume: the config differs .*optim.lr: 0.001 -> 0.5"):
        prepare_run_dir(other, resume="auto")
    assert _files(out) == before


@pytest.mark.slow  # a training through the command line
def test_the_same_command_line_with_resume_auto_starts_then_continues(tmp_path):
    """``ds4sci train CONFIG --resume auto``, as a restarted job runs it: the first start trains from step 1, the
    next continues from the newest checkpoint; another config into that folder is refused in one line."""
    config, out = tmp_path / "tiny.yaml", tmp_path / "run"
    config.write_text(json.dumps(TINY))
    first = _train(config, out, "--resume", "auto", "--set", "train.steps=2")
    assert first.returncode == 0 and "resumed from" not in first.stderr, first.stderr[-3000:]
    again = _train(config, out, "--resume", "auto")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / 'step2'} at step 2" in again.stderr
    assert _metrics(out) == ([1, 2, 3, 4], [2, 4]) and _checkpoints(out) == ({"step2", "step4"}, "step4")
    line = _error_line(_train(config, out, "--resume", "auto", "--set", "optim.lr=0.5", "--set", "train.steps=6"))
    assert line.endswith("optim.lr: 0.001 -> 0.5; only " + ", ".join(MAY_CHANGE) + " may change on resume"), line


def test_a_resume_at_any_process_count_keeps_the_global_batch(tmp_path):
    """The global batch (micro-batch x dp x accumulation) of the checkpoint's run, at this launch's world size: any
    split of it resumes, another size is named with what to set (the saved config's layout never meets the new
    world size)."""
    out = tmp_path / "run"
    base = [f"train.out_dir={out}", f"data.fasta={CDS}", "train.micro_batch_size=2"]
    _fake_run(out, load_config(None, [*base, "parallel.ulysses=2"]), dp=2)  # 4 processes: ulysses 2 x dp 2

    def resume(world: int, *sets: str):
        return prepare_run_dir(load_config(None, [*base, *sets]), resume="", world_size=world)

    for world, sets in ((1, ["train.grad_accum=2"]), (1, ["train.micro_batch_size=4"]), (2, []),
                        (2, ["parallel.ulysses=2", "train.micro_batch_size=4"]), (4, ["train.micro_batch_size=1"])):
        assert resume(world, *sets) == out / "checkpoints" / "step4", (world, sets)
    for world, sets, message in (
            (1, [], "resuming at dp=1 with train.micro_batch_size=2 x train.grad_accum=1 is 2 sequences per step, the "
                    "run used 4 (2 x dp 2 x 1): set train.grad_accum=2 or train.micro_batch_size=4 ("),
            (2, ["parallel.ulysses=2"], "resuming at dp=1 with train.micro_batch_size=2 x train.grad_accum=1 is 2"),
            (4, [], "dp=4 with train.micro_batch_size=2 x train.grad_accum=1 is 8 sequences per step, the run used 4 "
                    "(2 x dp 2 x 1): set train.micro_batch_size=1 ("),
            (1, ["train.micro_batch_size=3", "train.grad_accum=3"],
             "set train.micro_batch_size x train.grad_accum = 4"),
            (3, [], "is 6 sequences per step, the run used 4 (2 x dp 2 x 1): set parallel degrees that leave a dp "
                    "dividing 4")):
        with pytest.raises(ValueError) as err:
            resume(world, *sets)
        assert str(err.value).startswith("--resume: resuming at") and message in str(err.value), (world, sets)


def _files(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_what_can_be_checked_is_checked_before_any_work(tmp_path, capsys, monkeypatch):
    """A launch that cannot run (processes that do not fit the layout, a missing NVMe folder, no FASTA file) stops with
    its one line before the run folder is touched: a new one is not created (no token_cache/), and --overwrite
    deletes nothing of an old one."""
    from ds4sci.cli import main

    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    config, new, old = tmp_path / "tiny.yaml", tmp_path / "new", tmp_path / "old"
    config.write_text(json.dumps(TINY))
    old.mkdir()
    (old / "config.yaml").write_text(load_config(config).to_yaml())
    (old / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    before = _files(old)
    cases = [(["parallel.ulysses=2"], "world size 1 is not a multiple of tp=1 x ulysses=2"),
             (["zero.stage=3", "zero.offload_param=nvme", f"zero.nvme_path={tmp_path / 'nvme'}"],
              f"zero.nvme_path={str(tmp_path / 'nvme')!r} is not an existing folder"),
             ([f"data.fasta={tmp_path / 'none.fa'}"], "data.fasta: "f"{str(tmp_path / 'none.fa')!r}: no such file")]
    for sets, needle in cases:
        for out, extra in ((new, []), (old, ["--overwrite"])):
            argv = ["train", str(config), "--set", f"train.out_dir={out}", *extra]
            assert main(argv + [arg for item in sets for arg in ("--set", item)]) == 2
            err = capsys.readouterr().err
            assert needle in err and err.count("error:") == 1, err
            assert not new.exists() and _files(old) == before
    # the world size is the launcher's before the process group exists
    from ds4sci.train import launch

    monkeypatch.setattr(launch.dist, "is_initialized", lambda: False)  # an earlier test's group may still be up
    for key, value in {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29500"}.items():  # torchrun's
        monkeypatch.setenv(key, value)
    assert launch.current_launch().world_size == 4


@pytest.mark.slow  # a training through the command line
def test_train_without_a_config_runs_from_any_directory_and_its_redirected_output_reads_like_a_log(tmp_path):
    """No config: the bundled genome, from any working directory. Output redirected (no terminal), progress on (the
    default): no bar frames and nothing but ds4sci's lines: the start-up block, a loss line per train.log_every steps
    (step, loss, lr, tokens/s, time left), validation lines and the final result."""
    argv = ["train", "--set", "train.steps=4", "--set", "train.log_every=2", "--set", "train.eval_every=2",
            "--set", "train.eval_batches=1", "--set", "train.micro_batch_size=2"]
    proc = run_in_fork(argv, tmp_path, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "runs" / "train" / "export" / "model.safetensors").is_file()
    messages = log_messages(proc.stdout + proc.stderr)
    steps = [m for m in messages if m.startswith("step ")]
    assert [m.split(":")[0] for m in steps] == ["step 2/4", "step 2/4", "step 4/4", "step 4/4"], steps
    assert re.fullmatch(r"step 2/4: loss \d\.\d{4}, lr [\d.e-]+, [\d,]+ tokens/s, \d+s left", steps[0]), steps[0]
    assert "validation loss" in steps[1] and "validation loss" in steps[3]
    assert messages[-1].startswith("final validation: ") and "%|" not in proc.stderr


def test_the_default_data_missing_says_how_to_start(tmp_path, monkeypatch):
    """An installation without the repository's examples/: ``ds4sci train`` with no config says how to start."""
    from ds4sci.distributed.launch import resolve_launch
    from ds4sci.train.config import BUNDLED_GENOME
    from ds4sci.train.launch import check_launch

    monkeypatch.chdir(tmp_path)
    cfg = load_config()
    assert cfg.data.fasta == BUNDLED_GENOME and os.path.isfile(BUNDLED_GENOME)
    check_launch(cfg, resolve_launch({}))
    isfile = os.path.isfile
    monkeypatch.setattr(os.path, "isfile", lambda path: path != BUNDLED_GENOME and isfile(path))
    with pytest.raises(FileNotFoundError, match="pass a YAML config .*examples/configs/demo_ecoli_sp2.yaml.* or --set "
                                                 "data.fasta=FILE .*--print-config lists every key"):
        check_launch(cfg, resolve_launch({}))


@pytest.mark.parametrize("config, sets, split", [
    (None, [], "region: the last 5% of every record held out"),
    (None, [f"data.fasta={CDS}", "data.dataset=records"], "region: the last 5% of every record held out"),
    (ROOT / "examples" / "configs" / "codon_cds_sp2.yaml", [], "records: whole records by a hash of their id"),
])
def test_the_defaults_and_the_codon_example_split_the_bundled_data(tmp_path, config, sets, split):
    """The defaults split both bundled files; the codon example holds out the 5 genes its comment says."""
    from ds4sci.train.launch import load_data

    cfg = load_config(config, [f"train.out_dir={tmp_path}", *sets])
    _, train, val, chosen = load_data(cfg)
    assert chosen.startswith(split) and len(train) and len(val)
    if config is not None:
        from ds4sci.data import Tokenizer
        from ds4sci.data import open_corpus

        corpus = open_corpus(cfg.data.fasta, Tokenizer.from_name("codon"), cache_dir=tmp_path / "token_cache")
        assert "5 of these 100 genes" in config.read_text() and len(corpus.split(0.1, "auto")[1]) == 5


def test_loss_plot_marks_the_points_of_a_short_curve(tmp_path, monkeypatch):
    """A curve of few points is drawn with markers (one point alone draws no line); a long one as a line."""
    import matplotlib.pyplot as plt

    from ds4sci.train.plot import FEW_POINTS
    from ds4sci.train.plot import plot_metrics

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    for steps in (1, FEW_POINTS + 1):
        metrics = tmp_path / f"metrics{steps}.jsonl"
        metrics.write_text("".join(json.dumps({"step": s, "loss": 2.0 / s}) + "\n" for s in range(1, steps + 1)) +
                           json.dumps({"step": steps, "val_bits_per_base": 1.9}) + "\n")
        plot_metrics(metrics, tmp_path / f"loss{steps}.png")
        assert (tmp_path / f"loss{steps}.png").stat().st_size > 0
    (short, _), (long, _) = (figure.axes for figure in figures)
    assert short.lines[0].get_marker() == "o" and long.lines[0].get_marker() in ("None", None, "")


def test_a_global_batch_gives_the_accumulation_at_each_process_count():
    """``train.global_batch_size`` fixes micro_batch_size x dp x grad_accum: the accumulation follows dp (2 nodes,
    then the 1 left after losing one, as a torchrun restart sees them); a batch that dp x micro-batch does not divide
    is refused in one line naming the numbers; 0 leaves grad_accum as set."""
    from ds4sci.distributed import ParallelDims
    from ds4sci.train.launch import fit_global_batch

    cfg = load_config(None, ["train.micro_batch_size=2", "train.global_batch_size=8", "train.grad_accum=3"])
    assert [fit_global_batch(cfg, ParallelDims(dp=dp)).train.grad_accum for dp in (1, 2, 4)] == [4, 2, 1]
    assert cfg.train.grad_accum == 3  # the caller's config is not changed
    with pytest.raises(ValueError, match=r"^train.global_batch_size=8 is not a multiple of train.micro_batch_size=2 x "
                                         r"dp=8 \(the sequences of one micro-step on this launch\)"):
        fit_global_batch(cfg, ParallelDims(dp=8))
    unset = load_config(None, ["train.grad_accum=3"])
    assert fit_global_batch(unset, ParallelDims(dp=2)) is unset
    with pytest.raises(ValueError, match=r"train.global_batch_size.*-1.*must be >= 0"):
        load_config(None, ["train.global_batch_size=-1"])
