"""The run folder's lock (:mod:`ds4sci.train.run_lock`): one run at a time per ``train.out_dir``, whatever the
command, through the CLI; a killed run's lock is taken over; a torchrun job whose launcher is killed stops and frees
the folder."""
import errno
import fcntl
import json
import logging
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ds4sci.train import run_lock
from ds4sci.train.run_lock import LOCK_FILE
from ds4sci.train.run_lock import lock_run_dir

from fork_checks import run_in_fork  # tests/ is on sys.path (its conftest.py)
from fork_checks import start_in_fork

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CDS = ROOT / "examples" / "data" / "NZ_CP040672.1_cds_100.fna"
FORK_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
ENV = {**os.environ, **FORK_ENV}
# long enough to be still training while the test acts (it is killed): ~30 steps a second here
LONG = [f"data.fasta={CDS}", "data.dataset=records", "data.seq_len=32", "data.val_fraction=0.2", "train.steps=100000",
        "train.micro_batch_size=2", "train.log_every=10", "train.eval_every=0", "train.save_every=0",
        "train.progress=false"]


def _cmd(out: Path, *args: str, sets=LONG, launcher=(sys.executable, "-m", "ds4sci.cli")) -> list[str]:
    return [*launcher, "train", *[a for s in [*sets, f"train.out_dir={out}"] for a in ("--set", s)], *args]


def _start(out: Path, stderr: Path) -> multiprocessing.Process:
    """``ds4sci train`` (:data:`LONG`) into ``out``, started in a process forked from the spawn server (torch
    imported), its stderr written to the file ``stderr``."""
    return start_in_fork(_cmd(out, launcher=()), ROOT, env=FORK_ENV, stderr=stderr)


def _wait_for(what, condition, timeout=240.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout:.0f} s for {what}"
        time.sleep(0.2)


def _training(out: Path) -> bool:
    """The run in ``out`` has logged a step (so it holds its lock and has written its config)."""
    metrics = out / "metrics.jsonl"
    return metrics.is_file() and metrics.stat().st_size > 0


def _in_fork(out: Path, *args: str, sets=LONG) -> subprocess.CompletedProcess:
    """``ds4sci train`` as :func:`_cmd` writes it, run to its end in a process forked from the spawn server (torch
    imported)."""
    return run_in_fork(_cmd(out, *args, sets=sets, launcher=()), ROOT, env=FORK_ENV, timeout=300)


def _refusal(proc: subprocess.CompletedProcess) -> str:
    """``proc``'s one error line; it must have exited 2 without a traceback."""
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


def _in_use_by(out: Path, pid: int) -> str:
    return (f"ds4sci train: error: train.out_dir {out} is in use by pid {pid} on host {socket.gethostname()} "
            f"(ds4sci train, started ")


@pytest.mark.slow
def test_a_live_run_folder_is_refused_to_every_command_and_a_killed_runs_lock_is_taken_over(tmp_path):
    """Two runs started at once into one folder: one trains, the other is refused naming it; ``--resume`` and
    ``--overwrite`` while it trains are refused too (nothing of its folder deleted); once it is killed (its lock
    left behind), ``--overwrite`` takes the lock over, naming the killed run, and replaces the run. A run stopped by
    an error leaves no lock behind."""
    out = tmp_path / "run"
    errs = [tmp_path / "first.err", tmp_path / "second.err"]
    procs = [first, second] = [_start(out, err) for err in errs]
    try:
        _wait_for("one of two simultaneous runs to be refused", lambda: first.exitcode is not None or
                  second.exitcode is not None, timeout=150)
        loser, winner = (first, second) if first.exitcode is not None else (second, first)
        line = _refusal(subprocess.CompletedProcess([], loser.exitcode, "", errs[procs.index(loser)].read_text()))
        assert line.startswith(_in_use_by(out, winner.pid)), line
        assert line.endswith(f"): wait for it to finish, or choose another train.out_dir (its lock: "
                             f"{out / LOCK_FILE})")
        _wait_for("the run to train", lambda: _training(out))
        config = (out / "config.yaml").read_bytes()
        for flag in ("--overwrite", "--resume"):
            assert _refusal(_in_fork(out, flag)).startswith(_in_use_by(out, winner.pid))
        assert winner.is_alive() and (out / "config.yaml").read_bytes() == config and _training(out)
    finally:
        for proc in procs:
            proc.kill()
            proc.join()
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == winner.pid  # left behind: stale

    replaced = _in_fork(out, "--overwrite", sets=[*LONG, "train.steps=2"])
    assert replaced.returncode == 0, replaced.stderr[-3000:]
    assert (f"train.out_dir {out}: took over the lock left by pid {winner.pid} on host {socket.gethostname()} "
            f"(ds4sci train, started ") in replaced.stderr
    assert "which is no longer running" in replaced.stderr and "deleted the run in" in replaced.stderr
    assert [json.loads(r)["step"] for r in (out / "metrics.jsonl").read_text().splitlines()] == [2, 2]
    assert not (out / LOCK_FILE).exists()  # released at the end of the run

    # a run stopped by an error after taking the lock releases it as it exits: no stale lock for the next run
    # (a new interpreter: the release at exit is atexit's, which a forked process does not run)
    stopped = subprocess.run(_cmd(out, "--resume", sets=[*LONG, "train.steps=2"]), cwd=ROOT, env=ENV,
                             capture_output=True, text=True, timeout=300)
    assert stopped.returncode == 2 and "nothing left to train" in stopped.stderr, stopped.stderr[-3000:]
    assert not (out / LOCK_FILE).exists()


def _children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    """Whether a thread of process ``pid`` still runs: a killed process's main thread can be a zombie while its other
    threads still exit, and its files (its lock) are closed with the last one."""
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] not in "ZX":
                return True
        except OSError:  # that thread is gone
            continue
    return False


@pytest.mark.distributed
@pytest.mark.slow
def test_workers_stop_when_their_torchrun_launcher_is_killed_and_free_the_folder(tmp_path):
    """``kill -9`` of torchrun while its two workers train: both exit within seconds (the kernel signals them,
    PR_SET_PDEATHSIG), and the folder's lock is then free."""
    out = tmp_path / "run"
    launcher = [str(BIN / "torchrun"), "--nproc-per-node", "2", "--master-port", "29547", "-m", "ds4sci.cli"]
    log = open(tmp_path / "torchrun.log", "w")  # not a pipe: workers that outlive torchrun would hold it open
    torchrun, workers = subprocess.Popen(_cmd(out, launcher=launcher), cwd=ROOT, env=ENV, stdout=log, stderr=log), []
    try:
        _wait_for("the workers to train", lambda: _training(out))
        workers = _children(torchrun.pid)
        assert len(workers) == 2, workers
        assert json.loads((out / LOCK_FILE).read_text())["pid"] in workers
        torchrun.kill()
        torchrun.wait()
        _wait_for("the workers to exit", lambda: not any(map(_alive, workers)), timeout=10)
    finally:
        log.close()
        for pid in {*_children(torchrun.pid), *workers}:  # whatever a failure left running
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    fd = os.open(out / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: no live holder
    except BlockingIOError:
        inode = os.fstat(fd).st_ino
        holders = [line for line in Path("/proc/locks").read_text().splitlines() if f":{inode} " in line]
        pytest.fail(f"the lock is still held: {holders}, workers {workers}")
    finally:
        os.close(fd)


def test_the_lock_is_shared_within_a_process_and_a_refused_launch_leaves_nothing(tmp_path):
    """A second lock of a folder this process holds shares it; the last release removes the lock file, and the
    folder when the lock created it and nothing was written there."""
    out = tmp_path / "new" / "run"
    lock = lock_run_dir(out, "ds4sci train")
    record = json.loads((out / LOCK_FILE).read_text())
    assert (record["pid"], record["host"], record["command"]) == (os.getpid(), socket.gethostname(), "ds4sci train")
    assert lock_run_dir(out, "ds4sci train --resume") is lock
    lock.release()
    assert (out / LOCK_FILE).is_file()  # still held by the first holder
    lock.release()
    assert not out.exists() and (tmp_path / "new").is_dir()


def _no_flock(fd, operation):
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))


#: ``python -c HOLDER FOLDER``: takes the lock of FOLDER where flock is refused (ENOLCK), says so, and sleeps.
HOLDER = """
import errno, fcntl, os, sys, time
def no_flock(fd, operation):
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
fcntl.flock = no_flock
from ds4sci.train.run_lock import lock_run_dir
lock_run_dir(sys.argv[1], "ds4sci train --set x=1")
print("locked", flush=True)
time.sleep(600)
"""


def _exact_record(path: Path, command: str, pid: int | None = None) -> dict:
    """The lock file at ``path`` holds exactly this process's (or ``pid``'s) record, byte for byte; returns it."""
    content = path.read_bytes()
    started = re.search(rb'"started": "([^"]+)"', content)[1].decode()
    record = {"host": socket.gethostname(), "pid": pid or os.getpid(), "command": command, "started": started}
    assert content == json.dumps(record).encode() + b"\n", content
    return record


def test_without_flock_a_lock_file_stops_a_second_job_and_a_dead_holders_lock_is_taken_over(tmp_path, monkeypatch,
                                                                                              caplog):
    """Where flock is refused (ENOLCK: NFS without a lock manager), the lock file is the lock: a live holder (another
    process) refuses a second run naming it; killed, its lock (fresh, but naming a process of this host that is gone)
    is taken over with the warning that names it, and the file then holds exactly the new holder's record."""
    monkeypatch.setattr(run_lock.fcntl, "flock", _no_flock)
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        _exact_record(out / LOCK_FILE, "ds4sci train --set x=1", pid=holder.pid)
        with pytest.raises(ValueError) as refused:
            lock_run_dir(out, "ds4sci train")
        assert str(refused.value).startswith(f"train.out_dir {out} is in use by pid {holder.pid} on host "
                                             f"{socket.gethostname()} (ds4sci train --set x=1, started "), refused.value
    finally:
        holder.kill()
        holder.wait()
    with caplog.at_level(logging.INFO, logger="ds4sci.train.run_lock"):
        lock = lock_run_dir(out, "ds4sci train --overwrite")
    try:
        assert (f"train.out_dir {out}: took over the lock left by pid {holder.pid} on host {socket.gethostname()} "
                f"(ds4sci train --set x=1, started ") in caplog.text
        assert f"is on {run_lock.filesystem(out)}, which cannot lock files (flock: No locks available)" in caplog.text
        _exact_record(out / LOCK_FILE, "ds4sci train --overwrite")
        assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]  # the stale file moved aside is gone
    finally:
        lock.release()
    assert not (out / LOCK_FILE).exists()  # released


def test_without_flock_another_hosts_lock_is_stale_once_its_heartbeat_stops(tmp_path, monkeypatch):
    """A lock file of another host is live while its time is refreshed (within STALE_S), stale after; a holder
    refreshes its own file every HEARTBEAT_S, and its release leaves a file that took its lock over alone."""
    monkeypatch.setattr(run_lock.fcntl, "flock", _no_flock)
    out = tmp_path / "run"
    out.mkdir()
    other = {"host": "node07", "pid": 1, "command": "ds4sci train", "started": "2026-01-01T00:00:00+00:00"}
    (out / LOCK_FILE).write_text(json.dumps(other) + "\n")
    with pytest.raises(ValueError, match="is in use by pid 1 on host node07 "):
        lock_run_dir(out, "ds4sci train")
    old = time.time() - run_lock.STALE_S - 1
    os.utime(out / LOCK_FILE, (old, old))
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    lock = lock_run_dir(out, "ds4sci train")
    try:
        beat = (out / LOCK_FILE).stat().st_mtime
        _wait_for("a heartbeat", lambda: (out / LOCK_FILE).stat().st_mtime > beat, timeout=10)
        (out / LOCK_FILE).rename(out / "taken")  # as a contender that judged this holder stale would replace it
        (out / LOCK_FILE).write_text(json.dumps(other) + "\n")
    finally:
        lock.release()
    assert json.loads((out / LOCK_FILE).read_text()) == other


def test_a_takeover_from_a_longer_stale_record_leaves_exactly_the_new_holders_record(tmp_path, caplog):
    """The lock file after a takeover holds the new holder's record and nothing else, byte for byte: a stale record
    longer than the new one (a long command line) must not leave its tail behind, which would make the file no
    longer read as its holder (a refusal could not name it)."""
    out = tmp_path / "run"
    out.mkdir()
    stale = {"host": "gone-node", "pid": 1, "command": "ds4sci train " + "--set train.steps=1 " * 40,
             "started": "2020-01-01T00:00:00+00:00"}
    (out / LOCK_FILE).write_text(json.dumps(stale) + "\n")
    with caplog.at_level(logging.WARNING, logger="ds4sci.train.run_lock"):
        lock = lock_run_dir(out, "ds4sci train --resume auto")
    try:
        assert "took over the lock left by pid 1 on host gone-node" in caplog.text
        content = (out / LOCK_FILE).read_bytes()
        started = re.search(rb'"started": "([^"]+)"', content)[1].decode()
        record = {"host": socket.gethostname(), "pid": os.getpid(), "command": "ds4sci train --resume auto",
                  "started": started}
        assert content == json.dumps(record).encode() + b"\n"
        fd = os.open(out / LOCK_FILE, os.O_RDONLY)
        try:
            assert run_lock._read_record(fd) == record  # what a refused second run names
        finally:
            os.close(fd)
    finally:
        lock.release()
