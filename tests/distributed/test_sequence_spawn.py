"""The shared spawn helper: results by rank, worker exceptions re-raised with their traceback, no hang."""
import os
import time

import pytest
import torch.distributed as dist

from ds4sci.spawn import run_workers


def _rank_info(rank, world, offset):
    return (rank, world, dist.get_world_size(), offset)


def _fail_on_rank_one(rank, world):
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 would wait here forever for rank 1


@pytest.mark.distributed
def test_run_workers_returns_by_rank_and_propagates_errors():
    assert run_workers(_rank_info, 2, 7) == [(0, 2, 2, 7), (1, 2, 2, 7)]
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        run_workers(_fail_on_rank_one, 2, timeout=60)
    message = str(info.value)
    assert "--- rank 1 ---" in message and "ValueError: boom on rank 1" in message and "_fail_on_rank_one" in message
    assert time.monotonic() - start < 30, "a failed worker must not leave the test waiting for the timeout"


_KEPT = []


def _keeps_a_lock(rank, world):
    """A worker that makes a semaphore and holds it to its exit, as tqdm's lock does."""
    import multiprocessing

    _KEPT.append(multiprocessing.get_context("spawn").Lock())
    return rank


@pytest.mark.distributed
def test_run_workers_lets_workers_exit_so_nothing_leaks():
    """Workers that reported exit on their own, cleaning up: no resource_tracker warning of leaked semaphores at
    shutdown (a worker stopped mid-exit leaves its semaphores to the tracker, which warns)."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys\nsys.path.insert(0, sys.argv[1])\nfrom test_sequence_spawn import _keeps_a_lock\n"
            "from ds4sci.spawn import run_workers\nprint(run_workers(_keeps_a_lock, 2))\n")
    proc = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "[0, 1]", proc.stderr[-2000:]
    assert "leaked" not in proc.stderr, proc.stderr[-2000:]


def _env_value(rank, world, name):
    return os.environ.get(name)


@pytest.mark.distributed
def test_workers_see_the_callers_environment_at_the_call(monkeypatch):
    """Workers are forked from a server started at the first call: each still sees the caller's environment as it is
    at its own call, with ``env`` on top."""
    assert run_workers(_rank_info, 1, 0) == [(0, 1, 1, 0)]  # the fork server is running from here on
    monkeypatch.setenv("DS4SCI_SPAWN_PROBE", "set after the server started")
    assert run_workers(_env_value, 2, "DS4SCI_SPAWN_PROBE") == ["set after the server started"] * 2
    assert run_workers(_env_value, 1, "DS4SCI_SPAWN_PROBE", env={"DS4SCI_SPAWN_PROBE": "from env"}) == ["from env"]
