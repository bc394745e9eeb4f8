"""`ds4sci train` end to end under every launcher, Ulysses SP=2 on gloo, on the shipped codon config
(``examples/configs/codon_cds_sp2.yaml``, 3 steps). The job templates of ``examples/cluster/`` (SLURM with ``srun
torchrun`` and with ``srun`` alone, PBS with ``mpiexec``, DeepSpeed's launcher with a hostfile) run as written, with
bash, the scheduler faked by its environment (one node: this machine). torchrun's run (:func:`torchrun_run`: the
``srun torchrun`` template's, launched once for the module) logs the losses and exports the weights of the same
configuration trained in one plain process, and writes every output of a run (metrics, validation, loss plot, config,
TensorBoard, checkpoints, export) that `ds4sci evaluate` / `generate` / `embed` read; the other templates train as
torchrun does: its losses and weights, bitwise. A second run into a folder that holds a run is refused once.
(``mpiexec -n 2 ... evaluate --ulysses 2`` writes one process's numbers: tests/distributed/test_inference_parallel.py.)
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ds4sci.spawn import open_store
from ds4sci.spawn import run_workers

from fork_checks import launch
from fork_checks import ranks_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CDS = ROOT / "examples" / "data" / "NZ_CP040672.1_cds_100.fna"
CONFIG = ROOT / "examples" / "configs" / "codon_cds_sp2.yaml"
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
#: ``srun`` faked for one node (no SLURM here): a directory holding only ``srun``, put first on the templates' PATH.
FAKE_SLURM = Path(__file__).resolve().parent / "fake_slurm"
#: The job's host list, compressed: its first host (the rendezvous and master) is this machine, the only one that
#: resolves here; the job runs on that node alone.
SLURM_JOB = {"SLURM_JOB_NODELIST": "localhost,node[02-03]", "SLURM_NNODES": "1"}
#: Each template: the scheduler's environment (each its own rendezvous port, 29532-29537 in this module: srun's ports
#: are 20000 + job id % 10000) and the launcher the start-up block names.
TEMPLATES = {
    "slurm_torchrun.sh": ({**SLURM_JOB, "SLURM_NTASKS": "1", "SLURM_JOB_ID": "9537", "GPUS_PER_NODE": "2"},
                          "torchrun"),
    "slurm_srun.sh": ({**SLURM_JOB, "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_ID": "9535"},
                      "slurm"),
    "pbs_mpiexec.sh": ({"PBS_JOBID": "9534.pbs", "PBS_O_WORKDIR": str(ROOT), "NRANKS_PER_NODE": "2",
                        "MASTER_PORT": "29534"}, "mpi"),
    "deepspeed_hostfile.sh": ({"MASTER_PORT": "29532"}, "torchrun"),
}


def _sets(out) -> list[str]:
    """The shipped config as it is, for 3 steps into ``out``, a loss line per step and validation at the end."""
    run = [f"train.out_dir={out}", "train.steps=3", "train.log_every=1", "train.eval_every=0"]
    return [arg for item in run for arg in ("--set", item)]  # one KEY=VALUE per --set


def _run_template(script: str, out: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """``bash examples/cluster/SCRIPT`` with CONFIG and DS4SCI_ARGS pointing it at :func:`_sets`' run into ``out``,
    the scheduler's variables of :data:`TEMPLATES`, this environment's launchers first on PATH (the fake ``srun``
    before them), and the files a job would be given: ``$PBS_NODEFILE`` naming localhost twice (two ranks, one
    node), DeepSpeed's ``hostfile`` naming localhost with 2 slots (launched locally: no ssh)."""
    (nodefile := tmp_path / "nodefile").write_text("localhost\nlocalhost\n")
    (hostfile := tmp_path / "hostfile").write_text("# one node, two processes\nlocalhost slots=2\n")
    env = {**ENV, **TEMPLATES[script][0], "PATH": f"{FAKE_SLURM}:{BIN}:{ENV['PATH']}", "CONFIG": str(CONFIG),
           "DS4SCI_ARGS": " ".join(_sets(out)), "PBS_NODEFILE": str(nodefile), "HOSTFILE": str(hostfile)}
    done = subprocess.run(["bash", str(ROOT / "examples" / "cluster" / script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """``slurm_torchrun.sh``'s job: ``srun torchrun --nproc-per-node 2 -m ds4sci.cli train CONFIG``, two processes,
    Ulysses 2, ZeRO-2 over both, 3 steps, validation at the end (the codon config's validation set is smaller than one
    global micro-batch): its folder and its process (output as text), launched once for the tests of this module,
    the reference of the other templates."""
    tmp = tmp_path_factory.mktemp("torchrun")
    return tmp / "run", _run_template("slurm_torchrun.sh", tmp / "run", tmp)


def _cli_main(rank, world, argv):
    """``ds4sci ARGV`` in this worker (a world of one): its exit status."""
    from ds4sci.cli import main

    return main(argv)


def _losses_and_weights(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r], load_file(str(out / "export" / "model.safetensors"))


def _check_outputs(out: Path, tmp_path: Path, capsys) -> None:
    """Every output of the run in ``out`` is written, and the tools read its export."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all({"loss", "tokens", "lr"} <= set(r) for r in steps)
    # ... it ran as 2 processes: ZeRO partitioned the optimizer state in two
    assert len(list((out / "checkpoints" / "step3").glob("*optim_states.pt"))) == 2
    val = [r for r in rows if "val_bits_per_base" in r]
    assert val and {"val_loss", "val_bits_per_base"} <= set(val[-1])
    assert (out / "loss.png").stat().st_size > 0 and (out / "config.yaml").is_file()
    assert any((out / "tensorboard").rglob("events.out.tfevents.*"))
    assert (out / "checkpoints" / "step3").is_dir()
    export = out / "export"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in export.iterdir()}

    # The tools run in this process (``cli.main``, what the console script calls): each launched interpreter would
    # cost a torch import, seconds of the suite per tool and launcher; their command lines are the tests' in infer/.
    from ds4sci.cli import main

    capsys.readouterr()
    assert main(["evaluate", str(export), "--fasta", str(CDS), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["tokens"] > 0 and np.isfinite(result["bits_per_base"])
    fasta = tmp_path / "gen.fasta"
    assert main(["generate", str(export), "--prompt", "ATGAAA", "--num-tokens", "5", "--out", str(fasta)]) == 0
    text = fasta.read_text().splitlines()
    assert text[0].startswith(">") and text[1].startswith("ATGAAA")
    emb = tmp_path / "emb.npz"
    assert main(["embed", str(export), "--fasta", str(CDS), "--out", str(emb)]) == 0
    arrays = np.load(emb)
    assert len(arrays["ids"]) == 100 and arrays["embeddings"].shape[0] == 100


def test_torchrun_trains_as_one_process_and_writes_every_output(torchrun_run, tmp_path, capsys):
    """torchrun's run is the single-process run (the same configuration with SP=1: the same global batches, run by
    ``cli.main`` in a worker forked from :func:`ds4sci.spawn.run_workers`' server, torch imported once there): same
    losses, same exported weights; and it writes every output, which the tools read."""
    out = torchrun_run[0]
    # fp32; the layouts round apart, and Adam (eps 1e-8) amplifies that for the few weights of near-zero gradient
    # (1.2e-5 seen on one of 65,536), where a wrong run moves every weight by about the learning rate per step (1e-4
    # and more here). So each tensor's root-mean-square difference must stay 100x below that, and no single weight
    # may be off by a whole step.
    single = tmp_path / "single"
    argv = ["train", str(CONFIG), *_sets(single), "--set", "parallel.ulysses=1"]
    assert run_workers(_cli_main, 1, argv, env=ENV, timeout=400) == [0]
    (losses, weights), (ref_losses, ref_weights) = _losses_and_weights(out), _losses_and_weights(single)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert abs(ref_losses[-1] - ref_losses[0]) > 1e-4  # it learned
    assert set(weights) == set(ref_weights)
    for key, value in ref_weights.items():
        diff = (weights[key].double() - value.double()).abs()
        rms, worst = diff.pow(2).mean().sqrt().item(), diff.max().item()
        assert rms <= 1e-6 and worst <= 1e-4, f"{key}: rms difference {rms:.2e}, largest {worst:.2e}"
    _check_outputs(out, tmp_path, capsys)


@pytest.mark.parametrize("script", sorted(TEMPLATES))
def test_job_template_trains_as_torchrun(script, torchrun_run, tmp_path, capsys):
    """Each job template of examples/cluster, run as written with its scheduler faked, forms one world of two (not
    two worlds of one): torchrun's layout, so its losses and weights, bitwise; the start-up block names the launcher,
    its node and processes per node. DeepSpeed's launcher's run also writes every output the tools read. (The
    ``srun torchrun`` template's run is :func:`torchrun_run`, which the others are compared with: it is checked
    against one process in the test above.)"""
    if script == "pbs_mpiexec.sh" and not (BIN / "mpiexec").exists():
        pytest.skip("no mpiexec beside this interpreter (pip install mpich mpi4py: the dev extra)")
    out, done = torchrun_run if script == "slurm_torchrun.sh" else (tmp_path / "run", None)
    done = done or _run_template(script, out, tmp_path)
    launcher = TEMPLATES[script][1]
    assert f"2 process(es) on cpu: 1 node(s) x 2 per node ({launcher})" in done.stdout + done.stderr
    (losses, weights), (ref_losses, ref_weights) = _losses_and_weights(out), _losses_and_weights(torchrun_run[0])
    assert len(losses) == 3 and losses == ref_losses
    assert weights.keys() == ref_weights.keys()
    for key, value in ref_weights.items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=0, msg=key)
    assert len(list((out / "checkpoints" / "step3").glob("*optim_states.pt"))) == 2
    if script == "deepspeed_hostfile.sh":
        _check_outputs(out, tmp_path, capsys)


def test_torchrun_prints_ds4sci_lines_only_and_a_refusal_once(torchrun_run, tmp_path):
    """Two processes under srun torchrun, ZeRO-2 (whose all-gathers make torch warn), output redirected: the run
    prints ds4sci's lines only, from rank 0 (no DeepSpeed start-up print or warning, no FutureWarning, no bar frames:
    a loss line per train.log_every steps). A second run into the same folder (a copy of the shared run's), by two
    ranks with torchrun's variables (:func:`fork_checks.launch`: the refusal, not the launcher, is the subject here;
    stopped as torchrun stops its workers when one fails), is refused in ONE line (rank 0's; rank 1 says nothing) and
    exits non-zero."""
    from cli_checks import log_messages  # tests/ is on sys.path (its conftest.py)

    shared, first = torchrun_run
    messages = log_messages(first.stdout + first.stderr)
    assert [m.split(":")[0] for m in messages if m.startswith("step ")] == ["step 1/3", "step 2/3", "step 3/3",
                                                                            "step 3/3"]
    assert sum(m.startswith("ds4sci train") for m in messages) == 1  # the start-up block, once
    out = tmp_path / "run"
    shutil.copytree(shared, out)
    sets = [f"train.out_dir={out}", f"data.fasta={CDS}", "data.dataset=records", "data.seq_len=64",
            "data.val_fraction=0.1", "parallel.ulysses=2", "zero.stage=1", "train.steps=2", "train.log_every=1",
            "train.eval_batches=1", "train.micro_batch_size=2"]
    store = open_store()
    ranks = launch(["train", *[arg for item in sets for arg in ("--set", item)]],
                   [{"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **env} for env in ranks_env(2, store.port)],
                   cwd=ROOT, until="launcher", timeout=400)
    refusals = [[line for line in (done.stdout + done.stderr).splitlines() if "error:" in line] for done in ranks]
    output = "\n".join(f"--- rank {r} ---\n{done.stdout}{done.stderr}" for r, done in enumerate(ranks))
    assert ranks[0].returncode != 0 and [len(lines) for lines in refusals] == [1, 0], output[-3000:]
    assert refusals[0][0].startswith(f"ds4sci train: error: train.out_dir {out} already holds a run (checkpoints, ")
    assert refusals[0][0].endswith("continue it with --resume, or replace it with --overwrite (or choose another "
                                   "train.out_dir)")
