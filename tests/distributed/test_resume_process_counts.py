"""Resume on another process count, through the CLI as a user meets it (``ds4sci train`` in one process, or in as many
as torchrun would start, with its variables: :func:`fork_checks.launch`; the resume, not the launcher, is the subject
here): a run shrunk from 2 processes to 1, grown from 1 to 2, and grown to 4 then shrunk to 2 continues with the
losses of one uninterrupted process, as long as the global batch (micro-batch x dp x accumulation) stays; a launch
that changes it is refused in one line saying what to set.

The training set is 10 windows, 2 global batches of 4 per epoch (2 dropped): steps 3-6 cross two epochs, where a
data order that depended on the split (micro-batch x dp per micro-step rather than the global batch) would read
other samples. The final validation (step 6, one global batch) is compared too.
"""
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from ds4sci.spawn import open_store

from fork_checks import launch
from fork_checks import ranks_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CDS = ROOT / "examples" / "data" / "NZ_CP040672.1_cds_100.fna"
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def _train(tmp: Path, name: str, procs: int, *sets: str, resume: Path | None = None) -> subprocess.CompletedProcess:
    """``ds4sci train`` into ``tmp/name`` on ``procs`` processes (stopped, as torchrun stops them, when one fails:
    the status is the first failing rank's; the output is every rank's); 6 steps of 4 windows of 32 nucleotides, a
    checkpoint every 2, validation at the end."""
    run = [f"train.out_dir={tmp / name}", f"data.cache_dir={tmp / 'token_cache'}", f"data.fasta={CDS}",
           "data.dataset=windows", "data.seq_len=32", "data.max_train_tokens=320", "data.val_fraction=0.2",
           "train.steps=6", "train.save_every=2", "train.log_every=1", "train.eval_every=0", "train.eval_batches=1",
           "train.progress=false", "optim.warmup_steps=1", "optim.lr=0.05", "optim.grad_clip=0", "optim.eps=1.0",
           *sets]
    argv = ["train", *(arg for item in run for arg in ("--set", item))]
    argv += ["--resume", str(resume)] if resume is not None else []
    store = open_store()
    ranks = launch(argv, [{**ENV, **env} for env in ranks_env(procs, store.port)] if procs > 1 else [ENV], cwd=ROOT,
                   timeout=500, until="launcher")
    code = next((rank.returncode for rank in ranks if rank.returncode), 0)
    return subprocess.CompletedProcess(argv, code, "".join(r.stdout for r in ranks), "".join(r.stderr for r in ranks))


def _run(tmp: Path, name: str, procs: int, *sets: str, resume: Path | None = None) -> dict[int, tuple[float, ...]]:
    """:func:`_train`, which must succeed: its metrics by step, (training loss,) and at step 6 (.., validation loss)."""
    proc = _train(tmp, name, procs, *sets, resume=resume)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp / name / "metrics.jsonl").read_text().splitlines()]
    metrics: dict[int, tuple[float, ...]] = {}
    for row in rows:
        metrics[row["step"]] = metrics.get(row["step"], ()) + (row["loss"] if "loss" in row else row["val_loss"],)
    return metrics


def _same(got: dict, want: dict, steps: range, label: str) -> None:
    assert sorted(got) == list(steps) and all(len(got[s]) == len(want[s]) for s in steps), label
    torch.testing.assert_close(torch.tensor([v for s in steps for v in got[s]]),
                               torch.tensor([v for s in steps for v in want[s]]), rtol=1e-5, atol=1e-6, msg=label)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict]:
    """One process, micro-batch 4, uninterrupted: its folder (checkpoints at steps 2 and 4) and metrics."""
    tmp = tmp_path_factory.mktemp("resume_counts")
    metrics = _run(tmp, "one", 1, "train.micro_batch_size=4")
    assert abs(metrics[6][0] - metrics[1][0]) > 1e-2 and len(metrics[6]) == 2  # it learned; validated at the end
    return tmp, metrics


@pytest.fixture(scope="module")
def one_to_two(reference) -> dict:
    """1 process -> 2 at Ulysses 2 (the same micro-batch 4 x dp 1), refused as "8 -> 4" before: its metrics (its
    checkpoint at step 4, saved by 2 processes, is what :func:`test_two_processes_shrunk_to_one` resumes)."""
    tmp, _ = reference
    return _run(tmp, "one_to_two", 2, "parallel.ulysses=2", "train.micro_batch_size=4",
                resume=tmp / "one" / "checkpoints" / "step2")


def test_one_process_grown_to_two(reference, one_to_two):
    _same(one_to_two, reference[1], range(3, 7), "1 -> 2")


def test_two_processes_shrunk_to_one(reference, one_to_two):
    """2 processes (Ulysses 2, micro-batch 4; their step-4 checkpoint) -> 1 (micro-batch 2 x accumulation 2): the
    issue's "world size 1 is not a multiple of tp=1 x ulysses=2" came from checking the saved layout at the new
    world size."""
    tmp, want = reference
    got = _run(tmp, "two_to_one", 1, "train.micro_batch_size=2", "train.grad_accum=2",
               resume=tmp / "one_to_two" / "checkpoints" / "step4")
    _same(got, want, range(5, 7), "2 -> 1")


def test_four_processes_shrunk_to_two(reference):
    """1 process -> 4 (Ulysses 2 x dp 2, micro-batch 2, ZeRO-1) -> 2 (dp 2, micro-batch 1 x accumulation 2): each
    at the reference's losses (ZeRO-1 over another partition count: the portable state is re-split)."""
    tmp, want = reference
    four = _run(tmp, "one_to_four", 4, "parallel.ulysses=2", "train.micro_batch_size=2", "zero.stage=1",
                resume=tmp / "one" / "checkpoints" / "step2")
    _same(four, want, range(3, 7), "1 -> 4")
    two = _run(tmp, "four_to_two", 2, "train.micro_batch_size=1", "train.grad_accum=2", "zero.stage=1",
               resume=tmp / "one_to_four" / "checkpoints" / "step4")
    _same(two, want, range(5, 7), "4 -> 2")


def test_a_changed_global_batch_is_named(reference):
    """1 process -> 2 at dp 2 with the same micro-batch doubles the samples per step: refused in one line, naming
    both global batches and what to set (it trained silently at 8 per step before), before the folder is made."""
    tmp, _ = reference
    proc = _train(tmp, "doubled", 2, "train.micro_batch_size=4", resume=tmp / "one" / "checkpoints" / "step2")
    output = proc.stdout + proc.stderr
    refusals = [line for line in output.splitlines() if "error:" in line]
    assert proc.returncode != 0 and len(refusals) == 1, output[-4000:]
    assert refusals[0].endswith(
        "--resume: resuming at dp=2 with train.micro_batch_size=4 x train.grad_accum=1 is 8 sequences per step, the "
        "run used 4 (4 x dp 1 x 1): set train.micro_batch_size=2 (a resumed run keeps the global batch, "
        "micro_batch_size x dp x grad_accum, so each step reads the samples it would have)"), refusals[0]
    assert not (tmp / "doubled").exists()
