"""A command's ``main(argv)`` run as a test would run its command line, in processes forked from
:mod:`ds4sci.spawn`'s fork server instead of fresh interpreters (tests/ is on sys.path through its conftest.py).

A fresh ``python -m ds4sci.cli ...`` spends most of its CPU importing torch; the fork server has imported it once, so
a test whose subject is what the command does (its output, its files, its exit status, a process killed or racing
another, a rank that fails) gets the same check for a fraction of the cost. A launcher is not saved: where
torchrun, srun or mpiexec is the subject, the tests launch it.

Each process is a process of its own: its own pid, working directory, umask and environment (the caller's, plus what
the test adds), ``OMP_NUM_THREADS`` torch threads (1 when unset), its file descriptors 1 and 2 written to files, its
exit status the command's, and it runs the ``atexit`` functions an interpreter's exit would. :func:`start_in_fork`
starts a lone one (as ``subprocess.Popen`` would), :func:`run_in_fork` runs one to its end (as ``subprocess.run(...,
capture_output=True)`` would) and :func:`launch` runs one per rank, each forming the process group from torchrun's
variables (:func:`ranks_env`) at a store the caller opened with :func:`ds4sci.spawn.open_store`, as torchrun's
workers do at their agent's. :func:`run_script` runs a script (a fault planted around ``ds4sci``) as ``main``.
"""
from __future__ import annotations

import atexit
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from ds4sci import spawn
from ds4sci.cli import main as cli_main

Main = Callable[[list[str]], int]


def ranks_env(world: int, port: int, nodes: int = 1) -> list[dict[str, str]]:
    """torchrun's variables for each rank of ``world`` processes on ``nodes`` nodes (as many per node), meeting at
    the store on 127.0.0.1:``port``."""
    per_node = world // nodes
    return [{"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % per_node),
             "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(rank // per_node), "GROUP_WORLD_SIZE": str(nodes),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
            for rank in range(world)]


def run_script(script: str, argv: list[str]) -> int:
    """``python -c SCRIPT ARGV...`` as a ``main``: ``sys.argv`` is ``["-c", *argv]`` (bind ``script`` with
    ``functools.partial``, which pickles)."""
    sys.argv = ["-c", *argv]
    exec(compile(script, "<script>", "exec"), {"__name__": "__main__"})
    return 0


def _child(main: Main, argv: list[str], cwd: str, environ: dict[str, str], umask: int | None,
           file_size_limit: int | None, stdout: str, stderr: str) -> None:
    """The forked process: environment, directory, umask and limits set, output to files, then ``main(argv)``."""
    import torch

    os.environ.clear()  # the caller's environment at the start, not the fork server's
    os.environ.update(environ)
    os.chdir(cwd)
    if umask is not None:
        os.umask(umask)
    if file_size_limit is not None:  # a write past it fails with EFBIG instead of killing the process
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))
    torch.set_num_threads(int(environ.get("OMP_NUM_THREADS", "1")))  # the server's torch read its own environment
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, path in ((1, stdout), (2, stderr)):
        with open(path, "w") as file:
            os.dup2(file.fileno(), fd)
    code = 1
    try:
        code = int(main(argv) or 0)
    except SystemExit as stop:  # argparse's own checks, a script's sys.exit
        code = 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1
    finally:
        atexit._run_exitfuncs()  # an interpreter's exit runs them; a forked process's does not
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


def start_in_fork(argv: list[str], cwd: Path | str, *, main: Main = cli_main, env: dict[str, str] | None = None,
                  umask: int | None = None, file_size_limit: int | None = None, stdout: Path | str = os.devnull,
                  stderr: Path | str = os.devnull) -> multiprocessing.Process:
    """Start ``main(argv)`` (``ds4sci.cli.main`` unless given: a module-level function) in a lone forked process, from
    ``cwd``, with ``env`` added to this process's environment, its output written to the files ``stdout`` and
    ``stderr``. Returns it running: its ``pid``, ``exitcode`` (``main``'s status once it ended, ``-9`` when killed),
    ``is_alive()``, ``join()`` and ``kill()``."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(spawn.PRELOAD))  # as run_workers: read when the server starts, ignored after
    proc = ctx.Process(target=_child, args=(main, list(argv), str(cwd), {**os.environ, **(env or {})}, umask,
                                            file_size_limit, str(stdout), str(stderr)))
    proc.start()
    return proc


def run_in_fork(argv: list[str], cwd: Path | str, *, main: Main = cli_main, env: dict[str, str] | None = None,
                umask: int | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """:func:`start_in_fork`, waited for: its exit status, stdout and stderr.

    Raises:
        TimeoutError: it ran past ``timeout`` seconds (it is killed).
    """
    [done] = launch(argv, [env or {}], main=main, cwd=cwd, umask=umask, timeout=timeout)
    return done


def launch(argv: list[str], envs: list[dict[str, str]], *, main: Main = cli_main, cwd: Path | str | list | None = None,
           umask: int | None = None, timeout: float = 400, until: str = "all",
           file_size_limit: int | None = None) -> list[subprocess.CompletedProcess]:
    """``main(argv)`` as one forked process per environment in ``envs`` (each added to this process's environment),
    each in ``cwd`` (one for all or one per rank; default: this directory). ``until``: "all" waits for every rank;
    "launcher" stops the others (SIGTERM) when one fails, as torchrun does; "rank 0" waits for rank 0 and kills the
    others. Returns each rank's process (text output), its exit status negative if a signal ended it.

    Raises:
        TimeoutError: a rank awaited ran past ``timeout`` seconds (every rank is killed).
    """
    cwds = cwd if isinstance(cwd, list) else [cwd or Path.cwd()] * len(envs)
    logs = Path(tempfile.mkdtemp(prefix="fork_checks_"))
    for rank in range(len(envs)):  # read back even where a rank is killed before it writes
        (logs / f"{rank}.out").touch()
        (logs / f"{rank}.err").touch()
    procs = [start_in_fork(argv, cwds[rank], main=main, env=env, umask=umask, file_size_limit=file_size_limit,
                           stdout=logs / f"{rank}.out", stderr=logs / f"{rank}.err") for rank, env in enumerate(envs)]
    awaited = procs[:1] if until == "rank 0" else procs
    deadline = time.monotonic() + timeout
    try:
        while any(p.exitcode is None for p in awaited):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{' '.join(map(str, argv))}: {len(envs)} process(es) ran past {timeout:.0f} s:\n"
                                   + (logs / "0.err").read_text()[-3000:])
            if until == "launcher" and any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    if p.exitcode is None:
                        p.terminate()
                for p in procs:
                    p.join(timeout=30)
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join()
    done = [subprocess.CompletedProcess(list(argv), p.exitcode, (logs / f"{r}.out").read_text(),
                                        (logs / f"{r}.err").read_text()) for r, p in enumerate(procs)]
    shutil.rmtree(logs)
    return done
