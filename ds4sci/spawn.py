"""Run a function on a local gloo process group of N spawned processes: ``run_workers(fn, world_size, *args)``.

What the multi-process tests and the communication benchmarks use instead of ``torchrun``: each worker process
initializes ``torch.distributed`` (gloo, on a TCP store that the calling process opened on a port the system
picked, so no other process can take the port between choosing and listening), calls ``fn(rank, world_size, *args)`` and
destroys the group. ``fn`` must be importable (a module-level function) and its arguments and return value
picklable. The first worker exception is re-raised in the calling process with every failing worker's traceback;
a run that exceeds ``timeout`` seconds is killed and reported.

Workers are started by multiprocessing's fork server, which has imported :data:`PRELOAD` once: each worker is a fork
of it (a fraction of a second) instead of a fresh interpreter that imports torch (seconds of CPU per process, the
main cost of a small multi-process test). Each worker still gets its own process, its own process group and the
caller's environment as it is at the call (plus ``env``), as a spawned one would.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from typing import Any
from typing import Callable

__all__ = ["run_workers", "open_store"]

#: Seconds the workers that reported get to exit on their own before they are stopped.
EXIT_GRACE_S = 30.0

#: Modules the fork server imports before it forks any worker: what every worker imports first. Nothing that reads
#: the environment at import (DeepSpeed picks its accelerator then, from ``DS_ACCELERATOR``): the server's environment
#: is the caller's at the first call, while each worker must see the caller's at its own call. ``torch._dynamo``: a
#: model built on the meta device (the trainer's first step) initializes its weights through torch's reference
#: implementations, which import it (about 3.5 s of CPU per process, more than torch itself); it imports Triton,
#: whose settings (``TRITON_INTERPRET``) are read from the environment when used, not at import.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo")


def open_store(timeout: float = 180.0):
    """A ``torch.distributed.TCPStore`` server on 127.0.0.1, listening on a port the system picked (``.port``).

    The caller keeps it open while its workers run; they connect as clients (``is_master=False``), directly or
    through ``env://`` with ``TORCHELASTIC_USE_AGENT_STORE=True`` and ``MASTER_PORT=store.port``, as torchrun's
    workers do.
    """
    import datetime

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout))


def _worker(fn, rank, world_size, port, args, env, threads, results) -> None:
    try:
        os.environ.clear()  # the caller's environment at the call, not the fork server's
        os.environ.update(env)
        import torch
        import torch.distributed as dist

        from ds4sci.progress import quiet_dependencies

        quiet_dependencies()  # a worker shows what a ds4sci command would: not DeepSpeed's or torch's own notices
        torch.set_num_threads(threads)
        store = dist.TCPStore("127.0.0.1", port, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - every failure must reach the test process
        results.put((rank, False, traceback.format_exc()))


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    env: dict[str, str] | None = None,
    threads: int = 1,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes on one gloo process group.

    Args:
        fn: module-level function (the worker processes import it by name).
        world_size: number of processes.
        timeout: seconds for the whole run; on expiry the workers are killed and ``TimeoutError`` raised.
        env: environment variables set in each worker before ``fn`` runs (e.g. ``{"DS_ACCELERATOR": "cpu"}``).
        threads: ``torch.set_num_threads`` in each worker (1 keeps several workers from oversubscribing cores).
    Returns:
        ``fn``'s return values, indexed by rank.
    Raises:
        RuntimeError: a worker raised (message: each failing rank's traceback) or died without reporting.
        TimeoutError: the run exceeded ``timeout``.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # read when the server starts (the first call), ignored after
    results = ctx.Queue()
    store = open_store(timeout)
    worker_env = {**os.environ, **(env or {})}
    procs = [
        ctx.Process(target=_worker, args=(fn, rank, world_size, store.port, args, worker_env, threads, results),
                    daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"run_workers({fn.__name__}, world_size={world_size}) exceeded {timeout:.0f} s; ranks done: "
                    f"{sorted(values)}, failed: {sorted(failures)}"
                )
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and r not in values and r not in failures]
                for r in dead:
                    failures[r] = f"worker exited with code {procs[r].exitcode} without reporting"
                if failures:
                    break
                continue
            if ok:
                values[rank] = payload
            else:
                failures[rank] = payload
                # the other ranks may be blocked in a collective with the failed one: give them a moment to
                # fail too (their tracebacks help), then stop waiting
                grace = time.monotonic() + 3.0
                while len(values) + len(failures) < world_size and time.monotonic() < grace:
                    try:
                        rank, ok, payload = results.get(timeout=0.2)
                    except queue.Empty:
                        continue
                    (values if ok else failures)[rank] = payload
                break
    finally:
        # A worker that reported is exiting on its own: let it finish (terminated mid-exit, it would skip its
        # clean-up, and the resource tracker would then warn at shutdown of the semaphores it made as "leaked",
        # e.g. tqdm's lock); stop the others.
        exit_by = time.monotonic() + EXIT_GRACE_S
        for rank, proc in enumerate(procs):
            if rank in values:
                proc.join(timeout=max(0.0, exit_by - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
    if failures:
        report = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        raise RuntimeError(f"run_workers({fn.__name__}, world_size={world_size}): worker(s) failed\n{report}")
    return [values[r] for r in range(world_size)]
