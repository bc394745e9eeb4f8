"""Run faults: collective timeouts (a rank that dies or hangs, a rank lost outside the step, a full disk), checks
of rank 0 that stop every rank, non-finite losses (stop / skip), and the deterministic switch. Checkpoint faults are
in test_checkpoint_faults.py."""
import contextlib
import copy
import functools
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ds4sci.spawn import open_store
from ds4sci.spawn import run_workers

from fork_checks import launch
from fork_checks import ranks_env
from fork_checks import run_script
from test_train_equivalence import ENV
from test_train_equivalence import GENOME
from test_train_equivalence import _overrides

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------- non-finite loss, determinism
def _snapshot(trainer):
    """Module parameters (gathered under ZeRO-3), and for each optimizer (the engine's client AdamW and the position
    table's) every tensor it steps on with its state, copied. The optimizer's ``state`` is keyed by the tensors it
    updates: the fp32 master weights (ZeRO-1/2: this rank's flat partition; ZeRO-3: the partitioned fp32 groups;
    bf16: the fp32 copies), read directly since ZeRO-3 empties the param_groups between steps."""
    optimizers = [trainer.engine.basic_optimizer, trainer.pos_table.optimizer]
    return ({k: v.clone() for k, v in trainer.full_state_dict().items()},
            [[(p.detach().clone(), {n: copy.deepcopy(v) for n, v in s.items()}) for p, s in o.state.items()]
             for o in optimizers])


def _assert_same(a, b, label):
    (params_a, opt_a), (params_b, opt_b) = a, b
    assert params_a.keys() == params_b.keys() and params_a, label
    for key in params_a:
        assert torch.equal(params_a[key], params_b[key]), f"{label}: {key}"
    assert len(opt_a) == len(opt_b) == 2
    for o, (state_a, state_b) in enumerate(zip(opt_a, opt_b)):
        assert state_a and len(state_a) == len(state_b), label
        for i, ((master_a, moments_a), (master_b, moments_b)) in enumerate(zip(state_a, state_b)):
            assert torch.equal(master_a, master_b), f"{label}: optimizer {o} master tensor {i}"
            assert moments_a.keys() == moments_b.keys() and {"exp_avg", "exp_avg_sq"} <= moments_a.keys(), label
            for name in moments_a:
                assert torch.equal(moments_a[name], moments_b[name]), f"{label}: optimizer {o} state {i}.{name}"


def _adam_steps(snapshot):
    return {int(moments["step"]) for state in snapshot[1] for _, moments in state}


def _nonfinite_and_deterministic(rank, world, out):
    """SP=2: a NaN injected into rank 1's loss at step 2 (every rank must agree to skip or stop), under ZeRO 0-3 in
    fp32 and ZeRO-1 in bf16 (DeepSpeed's BF16_Optimizer, fp32 master weights); then the same deterministic job
    twice."""
    from ds4sci.train.config import load_config
    from ds4sci.train.trainer import Trainer

    def trainer(name, zero, *extra):
        return Trainer(load_config(None, _overrides(Path(out) / name, zero, ulysses=2, steps=4,
                                                    extra=["optim.grad_clip=0.05", *extra])))

    def poison(t):
        forward = t._forward_sum

        def nan_on_rank_1(batch):
            loss, count = forward(batch)
            return (loss * float("nan") if rank == 1 and t.step in (1, 3) else loss), count

        t._forward_sum = nan_on_rank_1

    results = {}
    for zero, dtype in ((0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (1, "bf16")):
        case = f"zero {zero} {dtype}"
        t = trainer(f"skip{zero}{dtype}", zero, "train.nonfinite=skip", f"train.dtype={dtype}")
        poison(t)
        first = t.train_step().loss
        before = _snapshot(t)
        assert _adam_steps(before) == {1}, case
        lr_before = t.engine.get_lr()[0]
        second = t.train_step()
        _assert_same(before, _snapshot(t), f"{case}: the skipped step changed the state")
        assert t.engine.lr_scheduler.last_epoch == 2 and t.pos_table.scheduler.last_epoch == 2  # the schedule moved on
        assert t.engine.get_lr()[0] != lr_before
        third = t.train_step().loss
        after = _snapshot(t)
        assert _adam_steps(after) == {2}, case  # the good step after the skipped one updated, counted once
        assert not any(torch.equal(a, b) for (a, _), (b, _) in zip(before[1][0], after[1][0])), case
        results[case] = (first, second.step, second.loss, third)
        t.cfg.train.nonfinite = "stop"  # the default
        with pytest.raises(ValueError, match=r"^step 4: the loss is nan \(train.nonfinite=stop; no update was applied"):
            t.train_step()
        _assert_same(after, _snapshot(t), f"{case}: stop changed the state")

    runs = []
    for name in ("det_a", "det_b"):
        t = trainer(name, 1, "train.deterministic=true")
        assert torch.are_deterministic_algorithms_enabled()
        losses = [t.train_step().loss for _ in range(3)]
        runs.append((losses, {k: v.numpy() for k, v in t.full_state_dict().items()}))
    return results, runs


@pytest.mark.distributed
def test_nonfinite_loss_stops_or_skips_on_every_rank_and_deterministic_runs_repeat_bitwise(tmp_path):
    for results, runs in run_workers(_nonfinite_and_deterministic, 2, str(tmp_path), env=ENV, timeout=300):
        for zero, (first, step, second, third) in results.items():
            assert step == 2 and second != second, zero  # reported as NaN, every rank
            assert abs(first) < 1e9 and abs(third) < 1e9 and third != first, zero  # training went on
        (losses_a, state_a), (losses_b, state_b) = runs
        assert losses_a == losses_b and losses_a[0] != losses_a[2]
        for key in state_a:
            assert (state_a[key] == state_b[key]).all(), key


# --------------------------------------------------------------------------------------- collective timeouts
_FAULTY_RANK_1 = """
import os, sys, time
from ds4sci.cli import main
from ds4sci.train.trainer import Trainer

step = Trainer.train_step

def faulty(self):
    if self.rank == 1 and self.step == 1:
        print(f"FAULT {time.time()}", flush=True)
        if sys.argv[1] == "dies":
            os._exit(1)
        time.sleep(300)
    return step(self)

Trainer.train_step = faulty
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.distributed
@pytest.mark.slow
def test_a_rank_that_dies_or_hangs_stops_the_others_within_the_timeout(tmp_path):
    """`ds4sci train` on 2 gloo ranks (DP=2); rank 1 dies / hangs at step 2: rank 0 exits with one line naming
    train.timeout_s, at once / after the timeout (not the 30 min default that new_group would otherwise keep)."""
    from ds4sci.data import Tokenizer
    from ds4sci.data.corpus import open_corpus

    timeout_s = 8  # bounds every collective, start-up's included: the token cache is built here, before
    open_corpus(GENOME, Tokenizer.from_name("nucleotide"), cache_dir=str(tmp_path / "cache"), progress=False)
    for mode in ("dies", "hangs"):
        sets = _overrides(tmp_path / mode, 0, steps=3,
                          extra=[f"train.timeout_s={timeout_s}", f"data.cache_dir={tmp_path / 'cache'}"])
        argv = [mode, "train", *[a for s in sets for a in ("--set", s)]]
        store = open_store()  # torchrun's way: every rank a client of a store already listening
        rank0, rank1 = launch(argv, [{**ENV, "OMP_NUM_THREADS": "1", **env} for env in ranks_env(2, store.port)],
                              main=functools.partial(run_script, _FAULTY_RANK_1), cwd=ROOT, timeout=240,
                              until="rank 0")  # then rank 1 killed
        ended = time.time()
        fault = float(rank1.stdout.split("FAULT ")[1].split()[0])
        last = rank0.stderr.strip().splitlines()[-1]
        assert rank0.returncode == 2, rank0.stderr[-3000:]
        assert last.startswith("ds4sci train: error: step 2: ") and f"train.timeout_s={timeout_s} s" in last, last
        if mode == "dies":
            assert "another rank left a collective" in last and ended - fault < timeout_s, last
        else:
            assert "did not join a collective within" in last and timeout_s - 1 < ended - fault < timeout_s + 60, last


# ------------------------------------------------------------------- faults outside the step: one line each
#: ``python WRAPPER FAULT ds4sci-argv...`` (under torchrun, or forked by :func:`fork_checks.launch`): ``ds4sci`` with
#: one fault planted (after recording the time it strikes in the file $FAULT_FILE): rank 1 killed (SIGKILL) at
#: start-up (as it loads the data), in an evaluation or in the checkpoint save of step 4; or rank 0 fills the run's
#: (small) file system after step 1 (TensorBoard's buffered writes meet it first, some 30 steps on; with
#: "fill-metrics", metrics.jsonl's).
_PLANTED = """
import os, signal, sys, time
from pathlib import Path
import ds4sci.train.trainer as trainer_module
from ds4sci.cli import main
from ds4sci.train.checkpoint import SafeCheckpointEngine
from ds4sci.train.trainer import Trainer

fault, rank = sys.argv[1], int(os.environ["RANK"])

def strike():
    Path(os.environ["FAULT_FILE"]).write_text(str(time.time()))
    if fault.startswith("kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    with open(Path(sys.argv[-1].split("=", 1)[1]) / "filler", "wb", buffering=0) as f:  # last --set: train.out_dir
        try:
            while True:
                f.write(b"x" * 4096)
        except OSError:
            pass

def planted(original, when):
    def method(*args, **kwargs):
        if when(*args, **kwargs):
            strike()
        return original(*args, **kwargs)
    return method

if fault == "kill-at-start-up" and rank == 1:
    trainer_module.load_data = planted(trainer_module.load_data, lambda cfg, launch=None: True)
if fault == "kill-in-evaluation" and rank == 1:
    Trainer._micro_batch = planted(Trainer._micro_batch, lambda self, dataset, index, shuffle: not shuffle)
if fault == "kill-in-save" and rank == 1:
    SafeCheckpointEngine.save = planted(SafeCheckpointEngine.save, lambda self, state, path: ".tmp-step4" in path)
if fault.startswith("fill") and rank == 0:
    Trainer.train_step = planted(Trainer.train_step, lambda self: self.step == 1)
if fault == "fill-metrics":  # no TensorBoard scalars: metrics.jsonl meets the full disk first
    from torch.utils.tensorboard import SummaryWriter
    SummaryWriter.add_scalar = lambda *args, **kwargs: None
sys.exit(main(sys.argv[2:]))
"""


def _run_with_fault(tmp_path: Path, fault: str, out: Path, *extra: str, port: int | None = None,
                    file_size_limit: int | None = None) -> tuple[int, str, str, float, float | None]:
    """``ds4sci train`` on 2 ranks (DP=2, ZeRO-1) with ``fault`` planted (:data:`_PLANTED`; "none": none): under
    torchrun on ``port``, or (no port) as 2 ranks forked by :func:`fork_checks.launch`, rank 1 killed once rank 0
    has exited (as torchrun stops the others when a rank fails), files limited to ``file_size_limit`` bytes.
    Returns the exit status (torchrun's; rank 0's), the workers' output (torchrun's own report left out), the whole
    output, the wall time, and the time the fault struck (None if it did not)."""
    fault_file = tmp_path / f"{fault}.time"
    fault_file.unlink(missing_ok=True)
    sets = _overrides(out, 1, steps=4, extra=[f"data.cache_dir={tmp_path / 'cache'}", "train.timeout_s=120", *extra,
                                              f"train.out_dir={out}"])
    argv = [fault, "train", *[a for s in sets for a in ("--set", s)]]
    env = {**os.environ, **ENV, "OMP_NUM_THREADS": "1", "FAULT_FILE": str(fault_file)}
    began = time.time()
    if port is None:
        store = open_store()
        ranks = launch(argv, [{**env, **rank} for rank in ranks_env(2, store.port)],
                       main=functools.partial(run_script, _PLANTED), cwd=ROOT, timeout=400, until="rank 0",
                       file_size_limit=file_size_limit)
        code, workers = ranks[0].returncode, "".join(rank.stdout + rank.stderr for rank in ranks)
        output = workers
    else:
        (script := tmp_path / "planted.py").write_text(_PLANTED)
        cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "2", "--master-port", str(port),
               "--monitor-interval", "1", str(script), *argv]
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
        code, output = done.returncode, done.stdout + done.stderr
        workers = _TORCHRUN.split(done.stderr, maxsplit=1)[0] + done.stdout
    struck = float(fault_file.read_text()) if fault_file.exists() else None
    return code, workers, output, time.time() - began, struck


#: A line of torchrun's own report (glog style): it and all that follows is torchrun's, not ds4sci's.
_TORCHRUN = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ torch/distributed/", re.MULTILINE)


def _one_error_line(code: int, workers: str, output: str, status: int) -> str:
    """The run failed with exit status ``status`` and its workers printed ds4sci's log lines and ONE error line, no
    traceback or other line. Returns the error line."""
    from cli_checks import log_messages  # tests/ is on sys.path (its conftest.py)

    errors = [line for line in workers.splitlines() if "error:" in line]
    assert code == status and len(errors) == 1, output[-4000:]
    assert errors[0].startswith("ds4sci train: error: "), output[-4000:]
    log_messages("\n".join(line for line in workers.splitlines() if line != errors[0]))  # nothing else
    return errors[0].removeprefix("ds4sci train: error: ")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("fault, phase, port", [
    ("kill-at-start-up", "start-up ({out})", 29641),
    ("kill-in-evaluation", "evaluation at step 2 ({out})", None),
    ("kill-in-save", "checkpoint save at step 4 ({out}/checkpoints/step4)", None),
])
def test_a_rank_lost_outside_the_step_stops_the_run_with_one_line(tmp_path, fault, phase, port):
    """``ds4sci train`` on 2 ranks, rank 1 killed (SIGKILL) at start-up, in an evaluation or in a save: rank 0 stops
    at once with one line naming the phase, the run's folder (the checkpoint being written) and the cause; no
    traceback. At start-up under torchrun (its store and rendezvous; the line comes before torchrun's report, whose
    status is 1); in the phases after it, as forked ranks (rank 0's status: 2)."""
    from ds4sci.data import Tokenizer
    from ds4sci.data.corpus import open_corpus

    open_corpus(GENOME, Tokenizer.from_name("nucleotide"), cache_dir=str(tmp_path / "cache"), progress=False)
    out = tmp_path / "run"
    code, workers, output, _, struck = _run_with_fault(tmp_path, fault, out, "train.eval_every=2",
                                                       "train.save_every=2", port=port)
    line = _one_error_line(code, workers, output, 2 if port is None else 1)  # rank 0's; torchrun's: a worker failed
    assert line.startswith(f"{phase.format(out=out)}: another rank left a collective (it died?); every rank stops "
                           f"instead of waiting (a hang is bounded by train.timeout_s=120 s) ("), line
    assert struck is not None and time.time() - struck < 60  # at once (120 s: the timeout a hang would wait)


@contextlib.contextmanager
def _small_disk(folder: Path, size: str):
    """A file system of ``size`` at ``folder`` (tmpfs: mounting needs root); yields how a full disk is met there:
    "tmpfs", or "file size limit" where mounting is refused (RLIMIT_FSIZE, set for the launched ranks by
    :func:`fork_checks.launch`: a write past it fails with EFBIG, "File too large", in place of ENOSPC)."""
    folder.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                                 capture_output=True).returncode == 0
    except FileNotFoundError:  # no mount command
        mounted = False
    try:
        yield "tmpfs" if mounted else "file size limit"
    finally:
        if mounted:
            subprocess.run(["umount", str(folder)], check=True)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("fault", ["none", "fill-tensorboard", "fill-metrics"])
def test_a_full_disk_in_a_save_or_mid_run_stops_the_run_with_one_line(tmp_path, fault):
    """``ds4sci train`` on 2 ranks (forked: the error, not the launcher, is the subject here; the test above runs
    torchrun) on a 1 MB file system (tmpfs where the test may mount one, run as
    root; else a file size limit of 100 kB, which fills during the save only: the mid-run cases skip): the save of
    step 2 (2.8 MB) does not fit ("none": no fault planted), or rank 0 fills the file system after step 1 and
    TensorBoard's writes, or metrics.jsonl's, meet it. One line names the phase, the file and "No space left on
    device" (ENOSPC; EFBIG under the limit); no traceback (TensorBoard's writer thread prints none); the failed save
    is never loaded."""
    from ds4sci.data import Tokenizer
    from ds4sci.data.corpus import open_corpus

    open_corpus(GENOME, Tokenizer.from_name("nucleotide"), cache_dir=str(tmp_path / "cache"), progress=False)
    out = tmp_path / "disk" / "run"
    with _small_disk(tmp_path / "disk", "1m") as disk:
        extra = ["train.save_every=2"] if fault == "none" else ["train.steps=200", "train.save_every=0"]
        if disk != "tmpfs" and fault != "none":
            pytest.skip("filling a file system mid-run needs a small one: mounting a tmpfs needs root")
        limit = 100_000 if disk != "tmpfs" else None
        code, workers, output, wall, _ = _run_with_fault(tmp_path, fault, out, *extra, file_size_limit=limit)
        line = _one_error_line(code, workers, output, 2)  # rank 0's status: the command's error
    reason = "No space left on device [Errno 28]" if disk == "tmpfs" else "File too large [Errno 27]"
    if fault == "none":
        checkpoints = re.escape(str(out / "checkpoints"))
        assert re.fullmatch(rf"checkpoint save at step 2: cannot write {checkpoints}/\S+: {re.escape(reason)}; this "
                            rf"save is incomplete and never loaded; {checkpoints} holds no complete checkpoint",
                            line), line
    else:
        written = out / ("tensorboard" if fault == "fill-tensorboard" else "metrics.jsonl")
        assert re.fullmatch(rf"step \d+: cannot write {re.escape(str(written))}: {re.escape(reason)}", line), line
    assert wall < 120  # no rank waited for train.timeout_s


def _damaged_metrics_at_resume(rank, world, out):
    """Train 2 steps saving each; rank 0 damages line 1 of metrics.jsonl; resume (train.timeout_s=60): each rank's
    error from train() and the seconds it took (every error is caught: rank 0 stays alive, as in a harness that
    keeps its processes)."""
    import torch.distributed as dist

    from ds4sci.train.config import load_config
    from ds4sci.train.trainer import Trainer

    def cfg(steps):
        return load_config(None, _overrides(out, 1, steps=steps, extra=["train.save_every=1", "train.timeout_s=60"]))

    Trainer(cfg(2)).train()
    metrics = Path(out) / "metrics.jsonl"
    if rank == 0:
        metrics.write_text("{damaged\n" + metrics.read_text())
    dist.barrier()
    trainer = Trainer(cfg(3), resume="")
    began = time.time()
    try:
        trainer.train()
    except Exception as err:  # noqa: BLE001 - returned to the test
        return type(err).__name__, str(err), time.time() - began
    return None, None, time.time() - began


@pytest.mark.distributed
def test_a_check_of_rank_0_at_the_start_of_training_stops_every_rank_at_once_with_its_line(tmp_path):
    """metrics.jsonl's records after the checkpoint are dropped by rank 0 as training starts; a damaged line stops
    every rank at once with rank 0's line, naming the file and line (not the others after train.timeout_s, or with
    "another rank left")."""
    out = tmp_path / "run"
    results = run_workers(_damaged_metrics_at_resume, 2, str(out), env=ENV, timeout=300)
    expected = (f"{out / 'metrics.jsonl'}: line 1 is not a metrics record (JSONDecodeError: Expecting property "
                f"name enclosed in double quotes: line 1 column 2 (char 1)); only the last line may be torn (repair "
                f"or remove the line to resume)")
    for kind, message, seconds in results:
        assert (kind, message) == ("ValueError", expected)
        assert seconds < 10, seconds
