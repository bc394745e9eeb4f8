"""The contract of :func:`ds4sci.bench.memory.run_in_subprocess` (``python -m ds4sci.bench.memory TARGET ARGS_JSON
RESULT_JSON``: the target called in a process of its own, its JSON result returned, ``RuntimeError`` with the end of
the child's stderr when it fails) kept, in a process forked from the tests' fork server (tests/fork_checks.py) instead
of a fresh interpreter that imports torch again. For tests whose subject is what a benchmark's measurements add up
to; the fresh interpreter itself is tested where it is the subject (tests/bench/test_bench_memory.py, and in
tests/bench/test_bench_genslm_attention.py the address-space cap and a measurement that returns what it returns
here). tests/ is on sys.path through its conftest.py."""
from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path
from typing import Any

from fork_checks import run_in_fork
from fork_checks import run_script

#: ``python -m ds4sci.bench.memory ARGV...`` as a script: the module run as ``__main__`` reads ``sys.argv[1:]``
HARNESS = "import runpy\nrunpy.run_module('ds4sci.bench.memory', run_name='__main__')\n"


def run_in_forked_process(target: str, *args: Any, env: dict[str, str] | None = None) -> Any:
    """``run_in_subprocess(target, *args, env=env)`` in a forked process: monkeypatch it over
    ``ds4sci.bench.memory.run_in_subprocess``.

    Raises:
        RuntimeError: the target failed (message: the end of its stderr).
    """
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        done = run_in_fork([target, json.dumps(list(args)), str(result)], tmp,
                           main=functools.partial(run_script, HARNESS), env=env)
        if done.returncode != 0:
            raise RuntimeError(f"{target}{tuple(args)!r} failed in its forked process:\n{done.stderr[-4000:]}")
        return json.loads(result.read_text())
