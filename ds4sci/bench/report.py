"""Helpers shared by the benchmarks: list and integer options, optional dependencies, and their report files,
``NAME.json`` (the figures) and ``NAME.md`` (a readable table), written by :mod:`ds4sci.report` (re-exported here with
the rest, as is its :func:`~ds4sci.report.plural`), beside ``NAME.png`` (:func:`write_files`)."""
from __future__ import annotations

import argparse
import datetime
import importlib
import os
import platform
from collections.abc import Iterable
from pathlib import Path

from ds4sci.report import markdown_table
from ds4sci.report import plural
from ds4sci.report import write_report

__all__ = ["MIB", "machine", "load_average", "describe_machine", "describe_load", "parse_int_list", "option",
           "shape_options", "describe_shape", "add_int_options", "int_config", "check_positive", "check_heads",
           "command_line", "missing_dependency", "versions", "subplots", "plot_peaks", "save_figure", "markdown_table",
           "plural", "write_report", "write_files"]

MIB = 2.0**20


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS reports one, else every core)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def machine() -> dict:
    """What a timing ran on, and when: ``{"cpu": model name, "cores": logical CPUs, "usable_cores": CPUs this process
    may run on, "date": UTC time, ISO 8601, to the second}`` (``"cpu"`` from ``/proc/cpuinfo``, else
    :func:`platform.processor`)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "usable_cores": usable_cores(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def load_average() -> list[float]:
    """The system load average over the last 1, 5 and 15 minutes (:func:`os.getloadavg`), two decimals: how many
    processes competed for the cores a timing ran on."""
    return [round(x, 2) for x in os.getloadavg()]


def describe_machine(info: dict) -> str:
    """One line of a :func:`machine` record: ``"AMD EPYC, 2 cores (2 usable), 2026-11-26T00:12:00+00:00"``."""
    return f"{info['cpu']}, {plural(info['cores'], 'core')} ({info['usable_cores']} usable), {info['date']}"


def describe_load(start: list[float], end: list[float]) -> str:
    """``"0.75 -> 2.10"``: the 1-minute load average at the start and at the end of a timing (:func:`load_average`)."""
    return f"{start[0]:.2f} -> {end[0]:.2f}"


def parse_int_list(text: str) -> tuple[int, ...]:
    """``"4K,8192,16k"`` -> ``(4096, 8192, 16384)``: distinct positive integers, sorted; ``K`` means 1024 (the
    ``type=`` of the benchmarks' list options)."""
    values = []
    for item in text.split(","):
        item = item.strip()
        scale = 1024 if item[-1:] in ("k", "K") else 1
        digits = item[:-1] if scale != 1 else item
        if not digits.isdigit() or int(digits) * scale < 1:
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected positive integers separated by commas, e.g. 4K,8K or 4096,8192")
        values.append(int(digits) * scale)
    return tuple(sorted(set(values)))


def option(name: str) -> str:
    """The command-line spelling of a configuration key: ``"n_res"`` -> ``"--n-res"``."""
    return "--" + name.replace("_", "-")


def shape_options(hidden: int, layers: int, heads: int) -> dict[str, tuple[int, str]]:
    """The ``add_int_options`` entries of a GenSLM shape: ``hidden``, ``layers`` and ``heads`` with their defaults."""
    return {"hidden": (hidden, "hidden size"), "layers": (layers, "transformer layers"),
            "heads": (heads, "attention heads")}


def describe_shape(cfg: dict) -> str:
    """``"hidden 64, 2 layers, 4 heads"``: the GenSLM shape :func:`shape_options` declares, as ``cfg`` holds it."""
    return f"hidden {cfg['hidden']}, {plural(cfg['layers'], 'layer')}, {plural(cfg['heads'], 'head')}"


def add_int_options(parser: argparse.ArgumentParser, options: dict[str, tuple[int, str]],
                    quick: dict[str, int] | None = None) -> None:
    """One ``type=int`` option per ``name -> (default, help)`` of ``options``, spelled by :func:`option`; with
    ``quick``, also ``--quick``, a smoke test that sets the options of ``quick`` to its values (:func:`int_config`)."""
    for name, (default, help_text) in options.items():
        parser.add_argument(option(name), type=int, default=default, help=f"{help_text} (default: %(default)s)")
    if quick is not None:
        parser.add_argument("--quick", action="store_true",
                            help="a smoke test: " + ", ".join(f"{option(k)} {v}" for k, v in quick.items()))


def int_config(args: argparse.Namespace, options: Iterable[str], quick: dict[str, int]) -> dict:
    """The values of ``options`` parsed into ``args`` (:func:`add_int_options`), ``quick`` over them under
    ``--quick``."""
    return {name: getattr(args, name) for name in options} | (quick if args.quick else {})


def check_positive(cfg: dict, names: Iterable[str]) -> None:
    """``ValueError`` naming the first option of ``names`` whose value in ``cfg`` is below 1."""
    for name in names:
        if cfg[name] < 1:
            raise ValueError(f"{option(name)}={cfg[name]}: must be >= 1")


def check_heads(hidden: int, heads: int) -> None:
    """``ValueError`` when ``--heads`` does not divide ``--hidden`` (a GenSLM's head size is their quotient)."""
    if hidden % heads:
        raise ValueError(f"--hidden={hidden} is not divisible by --heads={heads}")


def command_line(benchmark: str, cfg: dict, out: str) -> str:
    """The ``ds4sci bench BENCHMARK`` command that reproduces ``cfg``, every key spelled out as an option."""
    options = " ".join(f"{option(name)} {value}" for name, value in cfg.items())
    return f"ds4sci bench {benchmark} {options} --out {out}"


def missing_dependency(module: str, why: str, name: str | None = None) -> str | None:
    """None when ``module`` imports here (and has ``name``, if given, as ``from module import name`` requires);
    otherwise ``why`` with ``{err}`` replaced by the ``ImportError``: the message a benchmark logs or reports."""
    try:
        imported = importlib.import_module(module)
        if name is not None and not hasattr(imported, name):
            raise ImportError(f"cannot import name {name!r} from {module!r}")
    except ImportError as err:
        return why.format(err=err)
    return None


def versions(*modules: str) -> dict[str, str]:
    """``{module: its __version__}`` for each of ``modules`` (imported here): the libraries a report's figures came
    from."""
    return {name: importlib.import_module(name).__version__ for name in modules}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def subplots(*args, **kwargs):
    """``matplotlib.pyplot.subplots(*args, **kwargs)`` on the Agg backend: the benchmarks write PNG files and never
    open a window (``ImportError`` when matplotlib is missing)."""
    return _pyplot().subplots(*args, **kwargs)


def plot_peaks(path: str | Path, curves: dict[str, tuple[list[int], list[float]]], budget_mib: float,
               ylabel: str) -> None:
    """Peak memory against sequence length, log-log, one line per curve (label -> (lengths, MiB)), the per-rank budget
    dashed, written to ``path``."""
    fig, ax = subplots(figsize=(7, 5))
    for label, (seq_lens, mib) in curves.items():
        ax.plot(seq_lens, mib, marker="o", label=label)
    ax.axhline(budget_mib, color="gray", linestyle="--", label="budget")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length S (tokens)")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize="small")
    save_figure(fig, path)


def save_figure(fig, path: str | Path) -> None:
    """Lay ``fig`` out, write it to ``path`` (PNG, 100 dpi) and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)


def write_files(out: str | Path, name: str, report: dict, markdown: str, plot) -> Path:
    """Write ``out/NAME.json`` and ``out/NAME.md`` (:func:`write_report`) and ``out/NAME.png`` (``plot(report,
    path)``), print ``markdown`` and then the three paths; the JSON path."""
    path = write_report(out, name, report, markdown)
    plot(report, path.with_suffix(".png"))
    print(markdown, end="" if markdown.endswith("\n") else "\n")
    print(f"{name}: wrote {path}, {path.with_suffix('.md')} and {path.with_suffix('.png')}")
    return path
