"""``ds4sci`` command lines run as separate rank processes forked from :mod:`ds4sci.spawn`'s fork server, for the
tests where the command's own behaviour across ranks is the subject, not the launcher that starts it.

:func:`launch` starts one process per environment it is given (a fresh interpreter's way: the environment set,
the working directory changed, stdout and stderr to files) and runs ``ds4sci.cli.main(argv)`` there, or a wrapper
script that plants a fault and calls it (``sys.argv`` is ``["-c", *argv]``, as for ``python -c SCRIPT ARGV...``).
Each rank forms its process group itself from its environment (:func:`ranks_env`: torchrun's variables, every rank
a client of a store the caller opened with :func:`ds4sci.spawn.open_store`, as torchrun's workers are of its
agent's), exits with the command's status and can be killed as any process; only the interpreter start-up and the
import of torch are saved (several CPU-s per process). A launcher is not: where torchrun, srun or mpiexec is the
subject, the tests launch it.
"""
import atexit
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ds4sci.spawn import PRELOAD


def ranks_env(world: int, port: int, nodes: int = 1) -> list[dict[str, str]]:
    """torchrun's variables for each rank of ``world`` processes on ``nodes`` nodes (as many per node), meeting at
    the store on 127.0.0.1:``port``."""
    per_node = world // nodes
    return [{"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % per_node),
             "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(rank // per_node), "GROUP_WORLD_SIZE": str(nodes),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
            for rank in range(world)]


def _rank(argv, script, env, cwd, stdout, stderr, file_size_limit) -> None:
    """One rank: the environment and working directory set, output to files, then ``ds4sci ARGV`` (or ``script``);
    the process's exit status is the command's."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    if file_size_limit is not None:  # a write past it fails with EFBIG instead of killing the process
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))  # the fork server's torch read its own environment
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    code = 1
    try:
        if script is None:
            from ds4sci.cli import main

            code = main(argv)
        else:
            sys.argv = ["-c", *argv]
            try:
                exec(compile(script, "<script>", "exec"), {"__name__": "__main__"})
                code = 0
            except SystemExit as exit_:
                code = exit_.code
    finally:
        atexit._run_exitfuncs()  # an interpreter's exit runs them; a forked process's does not
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


def launch(argv: list[str], envs: list[dict[str, str]], *, script: str | None = None,
           cwd: Path | list[Path] | None = None, timeout: float = 400, until: str = "all",
           file_size_limit: int | None = None) -> list[subprocess.CompletedProcess]:
    """``ds4sci ARGV`` (or ``script``) as one process per environment in ``envs`` (each added to this process's
    environment), each in ``cwd`` (one for all or one per rank; default: this directory). ``until``: "all" waits for
    every rank; "launcher" stops the others (SIGTERM) when one fails, as torchrun does; "rank 0" waits for rank 0 and
    kills the others. Returns each rank's process (text output), its exit status negative if a signal ended it.

    Raises:
        TimeoutError: a rank awaited ran past ``timeout`` seconds (every rank is killed).
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    cwds = cwd if isinstance(cwd, list) else [cwd or Path.cwd()] * len(envs)
    logs = Path(tempfile.mkdtemp(prefix="rank_checks_"))
    for rank in range(len(envs)):  # read back even where a rank is killed before it writes
        (logs / f"{rank}.out").touch()
        (logs / f"{rank}.err").touch()
    procs = [ctx.Process(target=_rank, args=(argv, script, {**os.environ, **env}, str(cwds[rank]),
                                              logs / f"{rank}.out", logs / f"{rank}.err", file_size_limit))
             for rank, env in enumerate(envs)]
    for proc in procs:
        proc.start()
    awaited = procs[:1] if until == "rank 0" else procs
    deadline = time.monotonic() + timeout
    try:
        while any(p.exitcode is None for p in awaited):
            if time.monotonic() > deadline:
                raise TimeoutError(f"ds4sci {' '.join(argv)}: {len(envs)} rank(s) ran past {timeout:.0f} s")
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
    done = [subprocess.CompletedProcess(argv, p.exitcode, (logs / f"{r}.out").read_text(),
                                        (logs / f"{r}.err").read_text()) for r, p in enumerate(procs)]
    shutil.rmtree(logs)
    return done

