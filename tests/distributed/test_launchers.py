"""`ds4sci train` end to end under torchrun and DeepSpeed's launcher, Ulysses SP=2 on gloo: the run's logged losses and
exported weights are those of the same configuration trained in one plain process, every output of a run is written
(metrics, validation, loss plot, config, TensorBoard, checkpoints, export), and `ds4sci evaluate` / `generate` /
`embed` read the export. `mpiexec` and a faked `srun`, without torchrun, train as torchrun does (its losses and
weights). The torchrun run is trained once (:func:`torchrun_run`) for the tests that read it."""
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

from ds4sci.spawn import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CDS = ROOT / "examples" / "data" / "NZ_CP040672.1_cds_100.fna"
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def _train(launcher, out, single=False) -> subprocess.CompletedProcess | None:
    """torchrun, mpiexec and srun: nucleotide records of the CDS file (learned positions: the table split over the
    sequence ranks); deepspeed: the shipped codon example config as it is (packed genes, GenSLM-69 codons), whose
    validation set is smaller than one global micro-batch. Two processes, Ulysses SP=2, ZeRO over both; or
    (``single``) the same configuration in one process with SP=1: the same global batches, the reference, run by
    ``cli.main`` in a worker forked from :func:`ds4sci.spawn.run_workers`' server (torch imported once there, not per
    launch). ``srun`` is faked: two processes started with the ``SLURM_*`` variables srun gives them, no torchrun.
    Returns the launched run's process (its output as text); None for ``single``."""
    run = [f"train.out_dir={out}", "train.steps=3", "train.log_every=1", "train.eval_every=0"]
    cli = [sys.executable, "-m", "ds4sci.cli", "train"]
    if launcher == "deepspeed":
        cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", "29532", "--module", "ds4sci.cli", "train",
               str(ROOT / "examples" / "configs" / "codon_cds_sp2.yaml")]
    else:
        cmd = {"torchrun": [str(BIN / "torchrun"), "--nproc-per-node", "2", "--master-port", "29531", *cli[1:]],
               "mpiexec": [str(BIN / "mpiexec"), "-n", "2", *cli], "srun": cli}[launcher]
        run += [f"data.fasta={CDS}", "data.dataset=records", "data.seq_len=64", "data.val_fraction=0.1",
                "model.overrides.position_embedding=learned", "parallel.ulysses=2", "train.micro_batch_size=2",
                "zero.stage=1"]
    if single:
        run.append("parallel.ulysses=1")
    sets = [arg for item in run for arg in ("--set", item)]  # one KEY=VALUE per --set
    if single:
        assert run_workers(_cli_main, 1, cmd[cmd.index("train"):] + sets, env=ENV, timeout=400) == [0]
        return None
    if launcher == "srun":
        return _fake_srun(cmd + sets)
    # mpiexec: no MASTER_ADDR, so rank 0's host name is agreed over MPI (mpi4py); a port of its own
    env = {**ENV, "MASTER_PORT": "29534"} if launcher == "mpiexec" else ENV
    done = subprocess.run(cmd + sets, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _fake_srun(cmd) -> subprocess.CompletedProcess:
    """``srun -n 2 CMD`` on one node, as SLURM starts it: two processes whose environment is srun's (the host list
    is this machine's name), no torchrun. Returns rank 0's process, the output of both."""
    slurm = {"SLURM_NTASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_NODEID": "0", "SLURM_JOB_ID": "77",
             "SLURM_STEP_NODELIST": "localhost", "MASTER_PORT": "29535"}
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**ENV, **slurm, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)})
             for rank in range(2)]
    outputs = [proc.communicate(timeout=400)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    return subprocess.CompletedProcess(cmd, 0, "".join(outputs), "")


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The torchrun run of :func:`_train` (two processes, Ulysses 2, ZeRO-1, 3 steps, validation at the end): its
    folder and its process, trained once for the tests of this module that only read them."""
    out = tmp_path_factory.mktemp("torchrun") / "run"
    return out, _train("torchrun", out)


def _cli_main(rank, world, argv):
    """``ds4sci ARGV`` in this worker (a world of one): its exit status."""
    from ds4sci.cli import main

    return main(argv)


def _losses_and_weights(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r], load_file(str(out / "export" / "model.safetensors"))


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_train_writes_every_output_and_the_tools_read_the_export(launcher, tmp_path, capsys, request):
    if launcher == "torchrun":
        out = request.getfixturevalue("torchrun_run")[0]
    else:
        out = tmp_path / "run"
        _train(launcher, out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all({"loss", "tokens", "lr"} <= set(r) for r in steps)
    # The launched run is the single-process run: same losses, same exported weights. fp32; the layouts round apart,
    # and Adam (eps 1e-8) amplifies that for the few weights of near-zero gradient (1.2e-5 seen on one of 65,536),
    # where a wrong run moves every weight by about the learning rate per step (1e-4 and more here). So each tensor's
    # root-mean-square difference must stay 100x below that, and no single weight may be off by a whole step.
    _train(launcher, tmp_path / "single", single=True)
    (losses, weights), (ref_losses, ref_weights) = _losses_and_weights(out), _losses_and_weights(tmp_path / "single")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert abs(ref_losses[-1] - ref_losses[0]) > 1e-4  # it learned
    assert set(weights) == set(ref_weights)
    for key, value in ref_weights.items():
        diff = (weights[key].double() - value.double()).abs()
        rms, worst = diff.pow(2).mean().sqrt().item(), diff.max().item()
        assert rms <= 1e-6 and worst <= 1e-4, f"{key}: rms difference {rms:.2e}, largest {worst:.2e}"
    # ... and it ran as 2 processes: ZeRO partitioned the optimizer state in two
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


@pytest.mark.parametrize("launcher", ["mpiexec", "srun"])
def test_mpiexec_and_srun_without_torchrun_train_as_torchrun_does(launcher, torchrun_run, tmp_path):
    """``mpiexec -n 2`` (MPICH, a dev extra) and a faked ``srun`` (SLURM_* variables, no torchrun) form one world of
    two, not two worlds of one: the same layout as the torchrun run, so its losses and weights; the start-up block
    names the launcher, its node and processes per node."""
    if launcher == "mpiexec" and not (BIN / "mpiexec").exists():
        pytest.skip("no mpiexec beside this interpreter (pip install mpich mpi4py: the dev extra)")
    done = _train(launcher, tmp_path / "run")
    assert f"2 process(es) on cpu: 1 node(s) x 2 per node ({'slurm' if launcher == 'srun' else 'mpi'})" in (
        done.stdout + done.stderr)
    (losses, weights), (ref_losses, ref_weights) = _losses_and_weights(tmp_path / "run"), _losses_and_weights(
        torchrun_run[0])
    assert len(losses) == 3 and losses == ref_losses
    assert weights.keys() == ref_weights.keys()
    for key, value in ref_weights.items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=0, msg=key)
    assert len(list((tmp_path / "run" / "checkpoints" / "step3").glob("*optim_states.pt"))) == 2
    if launcher == "mpiexec":  # and evaluate's ranks, ulysses 2, write the single process's numbers, once
        export = tmp_path / "run" / "export"
        cmd = [str(BIN / "mpiexec"), "-n", "2", sys.executable, "-m", "ds4sci.cli", "evaluate", str(export), "--fasta",
               str(CDS), "--json", "--ulysses", "2"]
        done = subprocess.run(cmd, cwd=ROOT, env={**ENV, "MASTER_PORT": "29536"}, capture_output=True, text=True,
                              timeout=400)
        assert done.returncode == 0, done.stderr[-3000:]
        [line] = done.stdout.strip().splitlines()
        alone = subprocess.run(cmd[3:-2], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=400)
        assert alone.returncode == 0, alone.stderr[-3000:]
        parallel, single = json.loads(line), json.loads(alone.stdout)
        assert parallel["tokens"] == single["tokens"]
        assert parallel["loss"] == pytest.approx(single["loss"], rel=1e-7)


def test_torchrun_prints_ds4sci_lines_only_and_a_refusal_once(torchrun_run, tmp_path):
    """Two processes under torchrun, ZeRO-1 (whose all-gathers make torch warn), output redirected: the run prints
    ds4sci's lines only, from rank 0 (no DeepSpeed start-up print or warning, no FutureWarning, no bar frames: a loss
    line per train.log_every steps). A second run into the same folder (a copy of the shared run's) is refused in
    ONE line (rank 0's; rank 1 says nothing) and exits non-zero: torchrun's own report of the failed worker follows,
    its exit status is 1."""
    from cli_checks import log_messages  # tests/ is on sys.path (its conftest.py)

    shared, first = torchrun_run
    messages = log_messages(first.stdout + first.stderr)
    assert [m.split(":")[0] for m in messages if m.startswith("step ")] == ["step 1/3", "step 2/3", "step 3/3",
                                                                            "step 3/3"]
    assert sum(m.startswith("ds4sci train") for m in messages) == 1  # the start-up block, once
    out = tmp_path / "run"
    shutil.copytree(shared, out)
    cmd = [str(BIN / "torchrun"), "--nproc-per-node", "2", "--master-port", "29533", "-m", "ds4sci.cli", "train"]
    sets = [f"train.out_dir={out}", f"data.fasta={CDS}", "data.dataset=records", "data.seq_len=64",
            "data.val_fraction=0.1", "parallel.ulysses=2", "zero.stage=1", "train.steps=2", "train.log_every=1",
            "train.eval_batches=1", "train.micro_batch_size=2"]
    cmd += [arg for item in sets for arg in ("--set", item)]
    second = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=400)
    output = second.stdout + second.stderr
    refusals = [line for line in output.splitlines() if "error:" in line]
    assert second.returncode != 0 and len(refusals) == 1, output[-3000:]
    assert refusals[0].startswith(f"ds4sci train: error: train.out_dir {out} already holds a run (checkpoints, ")
    assert refusals[0].endswith("continue it with --resume, or replace it with --overwrite (or choose another "
                                "train.out_dir)")
