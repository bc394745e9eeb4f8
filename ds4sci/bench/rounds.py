"""Timed rounds shared by the benchmarks that compare two ways of doing one piece of work in one process
(``throughput``, ``generate``, ``score-variants``, ``inference-scale``): each round runs every way once, the order
reversed every round so that drift (other processes, thermal, the allocator) falls on all; rates are work / seconds on
two clocks, ``wall`` (``time.perf_counter``) and ``cpu`` (``time.process_time``: this process's CPU seconds, so time
other processes take from a shared machine does not count; with one thread, the compute time). :func:`write_rounds`
writes such a benchmark's report."""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ds4sci.bench.report import command_line
from ds4sci.bench.report import write_files

logger = logging.getLogger(__name__)

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def round_options(rounds: int, each: str) -> dict[str, tuple[int, str]]:
    """The ``add_int_options`` entries (:mod:`ds4sci.bench.report`) of a benchmark timed in rounds: ``rounds`` (its
    default, each round doing ``each``) and ``threads`` (default 1)."""
    return {"rounds": (rounds, f"timed rounds ({each})"),
            "threads": (1, "torch threads (1 keeps other processes on a shared machine from skewing the ratio)")}


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch threads, then restore the caller's number."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def alternate(runs: dict[str, Callable[[], Any]], work: dict[str, float], rounds: int, unit: str,
              check: Callable[[dict[str, Any]], None] | None = None) -> list[dict]:
    """Time ``runs`` (name -> function) ``rounds`` times, in their order on even rounds and reversed on odd ones.
    Each round is ``{clock: {name: work[name] / seconds, ..., "ratio": rate of the first run / rate of the
    second}}``; ``check`` (if given) sees each round's results, name -> what the function returned, and raises when
    they disagree. One log line per round names the rates in ``unit`` per second."""
    names = list(runs)
    timed = []
    for r in range(rounds):
        rates: dict[str, dict[str, float]] = {clock: {} for clock in CLOCKS}
        results = {}
        for name in (names if r % 2 == 0 else names[::-1]):
            start = {clock: now() for clock, now in CLOCKS.items()}
            results[name] = runs[name]()
            for clock, now in CLOCKS.items():
                rates[clock][name] = work[name] / (now() - start[clock])
        if check is not None:
            check(results)
        timed.append({clock: v | {"ratio": v[names[0]] / v[names[1]]} for clock, v in rates.items()})
        logger.info("round %d: %s %s/s; ratio %.3f (CPU time: %.3f)", r,
                    ", ".join(f"{name} {rates['wall'][name]:.1f}" for name in names), unit,
                    timed[-1]["wall"]["ratio"], timed[-1]["cpu"]["ratio"])
    return timed


def round_rows(report: dict, names: tuple[str, ...], unit: str, cells: Callable[[dict], list[str]]) -> list[list]:
    """The rows of a benchmark's table of rounds: ``[i, *cells(round)]`` for each of ``report["rounds"]`` (as
    :func:`alternate` times them), then ``["median", *cells(median)]``, ``median`` the round of the medians in
    ``report["summary"]`` (clock -> ``{"NAME_UNIT_per_s_median": ..., "ratio_median": ...}``)."""
    median = {clock: {name: s[f"{name}_{unit}_per_s_median"] for name in names} | {"ratio": s["ratio_median"]}
              for clock, s in report["summary"].items()}
    return [[i, *cells(r)] for i, r in enumerate(report["rounds"])] + [["median", *cells(median)]]


def write_rounds(benchmark: str, cfg: dict, out: str, context: dict, measured: dict,
                 summarize: Callable[[list[dict]], dict], markdown: Callable[[dict], str], plot) -> Path:
    """Write the report of ``ds4sci bench BENCHMARK`` (:func:`~ds4sci.bench.report.write_files`, named ``benchmark``
    with ``_`` for ``-``): ``{"command": ..., "config": cfg} | context | measured`` (``measured["rounds"]`` as
    :func:`alternate` times them) and ``"summary"``, clock -> ``summarize`` of the rounds on that clock; the JSON path.
    """
    report = {"command": command_line(benchmark, cfg, out), "config": cfg} | context | measured
    report["summary"] = {clock: summarize([r[clock] for r in report["rounds"]]) for clock in CLOCKS}
    return write_files(out, benchmark.replace("-", "_"), report, markdown(report), plot)


def cuda_median_ms(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA device (CUDA events around each call, after ``warmup``
    untimed calls and a synchronize)."""
    import statistics

    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
