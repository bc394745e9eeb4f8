"""A command's ``main(argv)`` run as a test would run its command line, in a process forked from
:mod:`ds4sci.spawn`'s fork server instead of a fresh interpreter (tests/ is on sys.path through its conftest.py).

A fresh ``python -m ds4sci.cli ...`` spends most of its CPU importing torch; the fork server has imported it once, so
a test whose subject is what the command does (its output, its files, its exit status, a process killed or racing
another) gets the same check for a fraction of the cost. Each command runs in a process of its own: its own pid,
working directory, umask, the caller's environment (plus what the test adds) and one torch thread, its file
descriptors 1 and 2 written to files. :func:`start_in_fork` starts a lone process, as ``subprocess.Popen`` would
(the command forms its own process group if it needs one, as a lone ``ds4sci`` does); :func:`run_in_fork` runs one
to its end, as ``subprocess.run(..., capture_output=True)`` would; :func:`ranks_in_fork` runs ``world`` processes
in one gloo process group, what a ``torchrun`` of that many processes gives a command.
"""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

from ds4sci.cli import main as cli_main
from ds4sci.spawn import PRELOAD
from ds4sci.spawn import run_workers

Main = Callable[[list[str]], int]


def _enter(cwd: str, umask: int | None, stdout: str, stderr: str) -> None:
    """This forked process: in ``cwd``, under ``umask``, its fds 1 and 2 written to the files ``stdout``, ``stderr``."""
    os.chdir(cwd)
    if umask is not None:
        os.umask(umask)
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, path in ((1, stdout), (2, stderr)):
        with open(path, "w") as file:
            os.dup2(file.fileno(), fd)


def _exit_status(main: Main, argv: list[str]) -> int:
    try:
        return int(main(argv) or 0)
    except SystemExit as stop:  # argparse's own checks
        return stop.code if isinstance(stop.code, int) else 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _alone(main: Main, argv: list[str], cwd: str, environ: dict[str, str], umask: int | None, stdout: str,
           stderr: str) -> None:
    import torch

    os.environ.clear()  # the caller's environment at the start, not the fork server's
    os.environ.update(environ)
    torch.set_num_threads(1)
    _enter(cwd, umask, stdout, stderr)
    sys.exit(_exit_status(main, argv))


def start_in_fork(argv: list[str], cwd: Path | str, *, main: Main = cli_main, env: dict[str, str] | None = None,
                  umask: int | None = None, stdout: Path | str = os.devnull,
                  stderr: Path | str = os.devnull) -> multiprocessing.Process:
    """Start ``main(argv)`` (``ds4sci.cli.main`` unless given: a module-level function) in a lone forked process, from
    ``cwd``, with ``env`` added to this process's environment, its output written to the files ``stdout`` and
    ``stderr``. Returns it running: its ``pid``, ``exitcode`` (``main``'s status once it ended, ``-9`` when killed),
    ``is_alive()``, ``join()`` and ``kill()``."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # as run_workers: read when the server starts, ignored after
    proc = ctx.Process(target=_alone, args=(main, list(argv), str(cwd), {**os.environ, **(env or {})}, umask,
                                            str(stdout), str(stderr)))
    proc.start()
    return proc


def run_in_fork(argv: list[str], cwd: Path | str, *, main: Main = cli_main, env: dict[str, str] | None = None,
                umask: int | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """:func:`start_in_fork`, waited for: its exit status, stdout and stderr.

    Raises:
        TimeoutError: it ran past ``timeout`` seconds (it is killed).
    """
    with tempfile.TemporaryDirectory() as logs:
        out, err = Path(logs) / "out", Path(logs) / "err"
        proc = start_in_fork(argv, cwd, main=main, env=env, umask=umask, stdout=out, stderr=err)
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise TimeoutError(f"{argv} ran past {timeout:.0f} s:\n{err.read_text()[-3000:]}")
        return subprocess.CompletedProcess(list(argv), proc.exitcode, out.read_text(), err.read_text())


def _rank(rank: int, world: int, main: Main, argv: list[str], cwd: str, logs: str) -> int:
    # what torchrun --nproc-per-node WORLD tells each rank (its default port: the group exists already)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      GROUP_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    _enter(cwd, None, f"{logs}/{rank}.out", f"{logs}/{rank}.err")
    return _exit_status(main, argv)


def ranks_in_fork(argv: list[str], cwd: Path | str, world: int, *, main: Main = cli_main,
                  env: dict[str, str] | None = None, timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """``main(argv)`` in ``world`` forked processes of one gloo process group (:func:`ds4sci.spawn.run_workers`) with
    torchrun's variables for one node of ``world`` processes, from ``cwd``, with ``env`` added to this process's
    environment: each rank's exit status, stdout and stderr.

    Raises:
        RuntimeError: a rank raised (with its traceback) or died; TimeoutError: they ran past ``timeout`` seconds.
    """
    with tempfile.TemporaryDirectory() as logs:
        codes = run_workers(_rank, world, main, list(argv), str(cwd), logs, env=env, timeout=timeout)
        return [subprocess.CompletedProcess(list(argv), code, Path(f"{logs}/{rank}.out").read_text(),
                                            Path(f"{logs}/{rank}.err").read_text())
                for rank, code in enumerate(codes)]
