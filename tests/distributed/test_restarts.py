"""Runs beyond one torchrun agent, through the command line: two ``torchrun --nnodes 2`` agents on this host (c10d
rendezvous, one process each) train the demo config with ring SP=2 as two ranks on one node do and both exit 0
without a traceback; a worker killed mid-run under ``--max-restarts 1`` and ``--resume auto`` finishes with the
uninterrupted run's losses and export; and a ``--nnodes 1:2`` job that loses its second node re-forms on one and
finishes at the same global batch (``train.global_batch_size``) with the same losses.

One uninterrupted run (:func:`reference`: the 2 ranks of ``torchrun --nproc-per-node 2``, forked with its variables) is
trained for every test: 4 steps, a checkpoint every 2, so a fault at the start of step 3 resumes from step 2. Faults
are planted by :data:`_PLANTED`, a wrapper of ``ds4sci`` that torchrun starts in its place, on the first attempt only
(``TORCHELASTIC_RESTART_COUNT=0``), as tests/distributed/test_faults.py plants its own."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ds4sci.spawn import open_store

from fork_checks import launch
from fork_checks import ranks_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
DEMO = str(ROOT / "examples" / "configs" / "demo_ecoli_sp2.yaml")
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}

#: ``python WRAPPER ds4sci-argv...``: ``ds4sci`` with $FAULT planted at the start of step 3 of the first attempt:
#: "kill-worker" SIGKILLs rank 1; "lose-node" SIGKILLs the worker's torchrun agent (its parent) and then the worker,
#: as a node that goes away does.
_PLANTED = """
import os, signal, sys
from ds4sci.cli import main
from ds4sci.train.trainer import Trainer

fault = os.environ.get("FAULT", "")
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and (fault == "lose-node" or fault and os.environ["RANK"] == "1"):
    train_step = Trainer.train_step

    def planted(self):
        if self.step == 2:  # step 2's checkpoint is written
            if fault == "lose-node":
                os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        return train_step(self)

    Trainer.train_step = planted
sys.exit(main(sys.argv[1:]))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sets(out: Path, cache: Path, *extra: str) -> list[str]:
    """The demo config's model and data, 4 steps of 2 windows of 256 (a checkpoint every 2), ring SP=2 unless
    ``extra`` says otherwise, ``--resume auto``."""
    sets = [f"train.out_dir={out}", f"data.cache_dir={cache}", "data.max_train_tokens=20000", "parallel.ulysses=1",
            "parallel.ring=2", "train.micro_batch_size=2", "train.steps=4", "train.save_every=2", "train.log_every=1",
            "train.eval_every=0", "train.eval_batches=1", "train.progress=false", *extra]
    return [arg for item in sets for arg in ("--set", item)] + ["--resume", "auto"]


def _agents(script: Path, out: Path, cache: Path, torchrun: list[list[str]], *extra: str,
            env: list[dict] | None = None) -> list[subprocess.CompletedProcess]:
    """One torchrun agent per ``torchrun`` argument list, started together, each running ``script`` (the planted
    wrapper) on the demo config; their processes once all have exited (output in ``stdout``, stderr merged)."""
    procs = []
    for i, args in enumerate(torchrun):
        cmd = [TORCHRUN, *args, "--monitor-interval", "1", str(script), "train", DEMO, *_sets(out, cache, *extra)]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env={**ENV, **(env[i] if env else {})}, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = [proc.communicate(timeout=500)[0] for proc in procs]
    return [subprocess.CompletedProcess(proc.args, proc.returncode, output, "") for proc, output in zip(procs, outputs)]


def _losses(out: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def _export(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "export" / "model.safetensors"))


def _quiet(done: subprocess.CompletedProcess) -> None:
    """Exit status 0 and no stack trace, Python's or C++'s, in an agent's and its worker's output."""
    assert done.returncode == 0, done.stdout[-4000:]
    for mark in ("Traceback", "Exception raised from", "frame #"):
        assert mark not in done.stdout, done.stdout[-4000:]


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> Path:
    script = tmp_path_factory.mktemp("planted") / "planted.py"
    script.write_text(_PLANTED)
    return script


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, Path]:
    """The uninterrupted run (ring SP=2, nothing planted) on the 2 ranks ``torchrun --nproc-per-node 2`` would start,
    with its variables (:func:`fork_checks.launch`: the reference's numbers, not a launcher, are what the tests
    use): its folder and the token cache every test shares."""
    tmp = tmp_path_factory.mktemp("restarts")
    store = open_store()
    argv = ["train", DEMO, *_sets(tmp / "reference", tmp / "cache")]
    ranks = launch(argv, [{**ENV, **env, "TORCHELASTIC_RESTART_COUNT": "0"} for env in ranks_env(2, store.port)],
                   cwd=ROOT, timeout=500)
    for done in ranks:
        _quiet(subprocess.CompletedProcess(argv, done.returncode, done.stdout + done.stderr, ""))
    losses = _losses(tmp / "reference")
    assert [s for s, _ in losses] == [1, 2, 3, 4] and abs(losses[-1][1] - losses[0][1]) > 1e-2  # it learned
    return tmp / "reference", tmp / "cache"


def test_two_nnodes_2_agents_train_as_one_torchrun_and_exit_quietly(reference, planted, tmp_path):
    """Two agents, one process each, one c10d rendezvous: one world of two (the start-up block says 2 node(s) x 1 per
    node), the same ring layout as the reference, so its losses and export bitwise. Both agents exit 0 and print no
    Python traceback; the workers' own output (``--redirects 3``: in files under ``--log-dir``) holds no stack trace
    at all. An agent's C++ TCPStore warning at its rendezvous shutdown is torch's, after every worker has ended (a race
    between the agents' closing reads of the c10d store and the exit of the agent that hosts it): not asserted."""
    ref, cache = reference
    rdzv = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{_free_port()}", "--rdzv-id", "two-agents", "--redirects", "3"]
    agents = _agents(planted, tmp_path / "run", cache,
                     [[*rdzv, "--log-dir", str(tmp_path / f"agent{i}")] for i in range(2)])
    workers = [path.read_text() for i in range(2) for path in sorted((tmp_path / f"agent{i}").rglob("*.log"))]
    assert len(workers) == 4  # stdout and stderr of each agent's one worker
    for done in agents:
        assert done.returncode == 0 and "Traceback" not in done.stdout, done.stdout[-4000:]
    for output in workers:
        assert not any(mark in output for mark in ("Traceback", "Exception raised from", "frame #")), output[-4000:]
    assert sum("2 process(es) on cpu: 2 node(s) x 1 per node (torchrun)" in output for output in workers) == 1
    assert _losses(tmp_path / "run") == _losses(ref)
    export, want = _export(tmp_path / "run"), _export(ref)
    assert export.keys() == want.keys() and all(torch.equal(export[k], want[k]) for k in want)


def test_a_worker_killed_mid_run_is_restarted_and_finishes_with_the_uninterrupted_losses(reference, planted,
                                                                                         tmp_path):
    """Rank 1 SIGKILLed at the start of step 3 under ``--max-restarts 1``: torchrun stops rank 0 and starts both
    again with the same command line; ``--resume auto`` continues from step 2's checkpoint (the run lock's dead
    holder is taken over). metrics.jsonl holds each step once, and losses and export are the reference's bitwise:
    the same layout resumed from a complete state (parameters, optimizer moments, data position) computes the same
    operations in the same order. The restarted workers join through the agent's store under their attempt's
    prefix (``ds4sci.train.engine``): torchrun's static rendezvous keeps one store across restarts, and gloo read the
    killed attempt's addresses from it ("Connection refused") before."""
    ref, cache = reference
    [done] = _agents(planted, tmp_path / "run", cache,
                     [["--nproc-per-node", "2", "--max-restarts", "1", "--master-port", str(_free_port())]],
                     env=[{"FAULT": "kill-worker"}])
    assert done.returncode == 0, done.stdout[-4000:]
    assert "ds4sci train: error: step 3: another rank left a collective" in done.stdout, done.stdout[-4000:]
    assert f"resumed from {tmp_path / 'run' / 'checkpoints' / 'step2'} (step 2)" in done.stdout, done.stdout[-4000:]
    assert _losses(tmp_path / "run") == _losses(ref)
    export, want = _export(tmp_path / "run"), _export(ref)
    assert export.keys() == want.keys() and all(torch.equal(export[k], want[k]) for k in want)


def test_a_job_that_loses_one_of_two_nodes_finishes_on_one_with_the_same_losses(reference, planted, tmp_path):
    """``--nnodes 1:2``, data parallel over the 2 nodes (micro-batch 1, ``train.global_batch_size=2``: the
    reference's 2 sequences per step). The second node's agent and worker are SIGKILLed at the start of step 3; the
    first node's worker stops (its all-reduce lost a rank), its agent re-forms the rendezvous alone once
    ``last_call_timeout`` has passed and starts it again at dp 1 x 2 accumulated micro-steps, and ``--resume auto``
    continues from step 2. The first agent hosts the rendezvous store (``is_host``): a job cannot outlive the node
    that holds its c10d store. Losses and export are the reference's to fp32 rounding (another layout: data
    parallel and accumulation in place of the ring, so sums are ordered otherwise)."""
    ref, cache = reference
    rdzv = ["--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", "lose-a-node"]
    kept, lost = _agents(planted, tmp_path / "run", cache,
                         [[*rdzv, "--rdzv-conf", "is_host=true,last_call_timeout=15"],
                          [*rdzv, "--rdzv-conf", "is_host=false,last_call_timeout=15"]],
                         "parallel.ring=1", "train.micro_batch_size=1", "train.global_batch_size=2",
                         env=[{}, {"FAULT": "lose-node"}])
    assert lost.returncode == -9 and kept.returncode == 0, kept.stdout[-4000:]
    assert "ds4sci train: error: step 3: another rank left a collective" in kept.stdout, kept.stdout[-4000:]
    assert "1 process(es) on cpu: 1 node(s) x 1 per node (torchrun)" in kept.stdout, kept.stdout[-4000:]
    assert "1 x 1 data ranks x 2 accumulation = 2 sequences (512 tokens) per step; steps 3..4" in kept.stdout
    assert f"resumed from {tmp_path / 'run' / 'checkpoints' / 'step2'} (step 2)" in kept.stdout, kept.stdout[-4000:]
    got, want = _losses(tmp_path / "run"), _losses(ref)
    assert [s for s, _ in got] == [1, 2, 3, 4]
    torch.testing.assert_close(torch.tensor([v for _, v in got]), torch.tensor([v for _, v in want]), rtol=1e-5,
                               atol=1e-6)
    export, ref_export = _export(tmp_path / "run"), _export(ref)
    assert export.keys() == ref_export.keys()
    for key, value in ref_export.items():
        torch.testing.assert_close(export[key], value, rtol=1e-4, atol=1e-6, msg=key)
