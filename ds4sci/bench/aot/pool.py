"""The worker processes that compile, started without ``TRITON_INTERPRET``.

Under the interpreter ``@triton.jit`` returns interpreted functions, which cannot be compiled; workers started with
the variable removed from their environment get JIT functions, so the gate also works from a process, such as the
test suite, that runs the kernels under the interpreter.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ds4sci.bench.aot.compile import compile_variant

if TYPE_CHECKING:
    from ds4sci.bench.aot.variants import LocalVariant
    from ds4sci.bench.aot.variants import Variant


def _worker_init() -> None:
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # Triton prints the log of its own `ptxas -v` run
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"  # a cache hit would skip ptxas and its log
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated to silence its warning


@contextlib.contextmanager
def _without_interpreter() -> Iterator[None]:
    """Spawned workers inherit os.environ: drop TRITON_INTERPRET while they start, so they get JIT functions."""
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


def compile_all(variants: list[Variant | LocalVariant], capabilities=(80, 90), jobs: int = 1,
                cache_dir: str | None = None) -> list[dict]:
    """Compile every (variant, target) in ``jobs`` spawned worker processes; records in input order. ``cache_dir``:
    figures of earlier compilations to reuse and add to (:func:`~ds4sci.bench.aot.compile.compile_variant`)."""
    tasks = [(v, cc, cache_dir) for v in variants for cc in capabilities]
    ctx = multiprocessing.get_context("spawn")
    with _without_interpreter(), concurrent.futures.ProcessPoolExecutor(
        max_workers=max(1, jobs), mp_context=ctx, initializer=_worker_init
    ) as pool:
        return list(pool.map(compile_variant, *zip(*tasks)))
