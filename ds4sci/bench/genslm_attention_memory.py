"""``ds4sci bench genslm-attention-memory``: memory of one GenSLM attention layer vs sequence length.

One :class:`ds4sci.models.genslm.model.Attention` layer (by default hidden 256 = 4 heads of 64, batch 1, fp32) runs
forward and the backward of ``mean(out^2)`` for every sequence length S of ``--seq-lens``, in three modes:
``causal`` (rotary positions; ``--position learned`` without), ``alibi`` (Press et al. 2022) and ``documents``
(packed documents of lengths drawn from ``[doc_len/2, 3*doc_len/2]``, positions restarting in each, the document ids
passed to the core as ``ds4sci.data`` packs windows). Each mode runs on two paths, GenSLM's ``attention_backend``:

- ``before`` = ``"sdpa"``: :func:`ds4sci.kernels.local_reference.sdpa_attention`, an explicit ``S x S`` softmax or
  mask where ALiBi or documents need one;
- ``after`` = ``"auto"``: :func:`ds4sci.kernels.local_attention.memory_efficient_attention` (chunked
  FlashAttention-2 on the CPU, O(S * chunk) memory; the Triton kernel or flash-attn on CUDA).

Every run is one fresh subprocess (:func:`ds4sci.bench.memory.run_in_subprocess` of
:func:`ds4sci.bench.genslm_attention_step.measure`) measuring, after a warm-up, the peak memory of forward+backward
(:class:`~ds4sci.bench.memory.PeakMemory`), the bytes saved for backward and the wall time. Runs predicted to need
more than ``--memory-limit-gib`` (quadratic extrapolation from the largest smaller S measured, or
:func:`analytic_peak_bytes` before any) are skipped; on the CPU each subprocess also caps its address space, so a run
let through fails with an allocation error and is reported as failed.

Writes ``genslm_attention_memory.json``, ``.md`` (tables per S, mode and path, and the growth exponent p of ``c + a
* S^p`` fitted to peak and saved bytes) and ``.png`` (log-log, with slope-1 and slope-2 references) to ``--out``.
``--quick`` runs S = 256 and 512.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

from ds4sci.bench.report import MIB
from ds4sci.bench.report import markdown_table
from ds4sci.bench.report import parse_int_list
from ds4sci.bench.report import plural
from ds4sci.bench.report import save_figure
from ds4sci.bench.report import subplots
from ds4sci.bench.report import write_report
from ds4sci.kernels.backends import LOCAL_CHUNK_SIZE

logger = logging.getLogger(__name__)

NAME = "genslm_attention_memory"
MODES = ("causal", "alibi", "documents")
#: path -> GenSLM ``attention_backend``
PATHS = {"before": "sdpa", "after": "auto"}
DEFAULT_SEQ_LENS = (4096, 8192, 16384, 32768, 65536)
QUICK_SEQ_LENS = (256, 512)  # --quick
#: what each run's subprocess calls (the module of one run imports torch; this one builds the parser without it)
MEASURE = "ds4sci.bench.genslm_attention_step:measure"
GIB = 2.0**30
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # --dtype -> the torch dtype's name
# Analytic bounds used before a mode and path has a measurement (see analytic_peak_bytes). The explicit ALiBi path
# peaks at about 5.3 fp32 [B, H, S, S] tensors (logits, |i - j| biases, biased logits, probabilities, their
# gradient; measured at 4K and 8K); 8 covers it. Linear terms: the after path peaks at about 13 [B, S, hidden]
# fp32 tensors (x, qkv, rotated q/k, out and their gradients; measured 4K-64K) plus a few [B, H, chunk, chunk]
# blocks of the chunked path; 32 covers them.
_QUADRATIC_FACTOR = 8
_LINEAR_FACTOR = 32


# ----------------------------------------------------------------------------------------------------------
# Options
# ----------------------------------------------------------------------------------------------------------


def _choice_list(choices: tuple[str, ...], what: str):
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(dict.fromkeys(item.strip() for item in text.split(",")))
        unknown = [item for item in items if item not in choices]
        if unknown or not items:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(map(repr, unknown or [text]))}; choose from {','.join(choices)}")
        return items

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The shape and run options (``--out`` is added by :mod:`ds4sci.bench`)."""
    parser.add_argument("--seq-lens", type=parse_int_list, default=DEFAULT_SEQ_LENS, metavar="S,S,...",
                        help="sequence lengths, comma-separated, K = 1024 (default: 4K,8K,16K,32K,64K)")
    parser.add_argument("--modes", type=_choice_list(MODES, "mode"), default=MODES, metavar="MODE,...",
                        help=f"any of {','.join(MODES)} (default: all)")
    parser.add_argument("--paths", type=_choice_list(tuple(PATHS), "path"), default=tuple(PATHS),
                        metavar="PATH,...", help="before (attention_backend 'sdpa'), after ('auto') (default: both)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default: %(default)s: D = 64)")
    parser.add_argument("--batch", type=int, default=1, help="(default: %(default)s)")
    parser.add_argument("--position", choices=("rotary", "learned"), default="rotary",
                        help="positions of the causal and documents modes; 'learned' means no rotary in the layer "
                             "(default: %(default)s)")
    parser.add_argument("--doc-len", type=int, default=3000,
                        help="mean document length of the documents mode (default: %(default)s)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="(default: %(default)s)")
    parser.add_argument("--device", help="(default: cuda when it is available, else cpu)")
    parser.add_argument("--threads", type=int,
                        help="torch threads per run on the CPU (default: torch's number of threads here)")
    parser.add_argument("--memory-limit-gib", type=float, default=None,
                        help="runs predicted to peak above this are not launched (default: 3/4 of the memory "
                             "available at the start: MemAvailable on the CPU, free device memory on CUDA)")
    parser.add_argument("--time-limit-s", type=float, default=None,
                        help="runs predicted (time at a smaller S times (S/S0)^2) to take longer than this many "
                             "seconds are not launched (default: no limit)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the random inputs and weights (default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help=f"a smoke test: --seq-lens {','.join(map(str, QUICK_SEQ_LENS))} (seconds per run)")


def default_memory_limit(device: str) -> int:
    """3/4 of the memory available now: ``MemAvailable`` of ``/proc/meminfo`` on the CPU, free memory on CUDA."""
    import torch

    if torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(0.75 * free)
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(0.75 * int(line.split()[1]) * 1024)  # reported in kB
    raise RuntimeError("MemAvailable not found in /proc/meminfo")


def _check_config(cfg: dict) -> str | None:
    """Why ``cfg`` cannot run (one line), or None."""
    import torch

    for name in ("hidden", "heads", "batch", "doc_len", "threads"):
        if cfg[name] < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {cfg[name]}"
    if cfg["hidden"] % cfg["heads"]:
        return f"--hidden {cfg['hidden']} is not divisible by --heads {cfg['heads']}"
    if cfg["memory_limit_bytes"] <= 0:
        return "--memory-limit-gib must be > 0"
    if cfg["time_limit_s"] is not None and cfg["time_limit_s"] <= 0:
        return "--time-limit-s must be > 0"
    try:
        torch.device(cfg["device"])
    except RuntimeError as err:
        return f"--device {cfg['device']!r}: {err}"
    if torch.device(cfg["device"]).type == "cuda" and not torch.cuda.is_available():
        return f"--device {cfg['device']!r}: no CUDA device is visible"
    return None


def command_line(cfg: dict, out: str) -> str:
    """The ``ds4sci bench genslm-attention-memory`` command that reproduces ``cfg``."""
    lengths = ",".join(map(str, cfg["seq_lens"]))
    return (f"ds4sci bench genslm-attention-memory --seq-lens {lengths} --modes {','.join(cfg['modes'])} "
            f"--paths {','.join(cfg['paths'])} --hidden {cfg['hidden']} --heads {cfg['heads']} --batch {cfg['batch']} "
            f"--position {cfg['position']} --doc-len {cfg['doc_len']} --dtype {cfg['dtype']} --device {cfg['device']} "
            f"--threads {cfg['threads']} --memory-limit-gib {cfg['memory_limit_bytes'] / GIB:.4g} "
            + (f"--time-limit-s {cfg['time_limit_s']:g} " if cfg["time_limit_s"] is not None else "")
            + f"--seed {cfg['seed']} --out {out}")


# ----------------------------------------------------------------------------------------------------------
# Prediction, growth exponents
# ----------------------------------------------------------------------------------------------------------


def analytic_peak_bytes(cfg: dict, path: str, seq_len: int) -> int:
    """A generous bound on the peak before anything of a mode and path is measured: the before path as if it held
    8 fp32 ``[B, H, S, S]`` tensors (its explicit ALiBi softmax peaks at about 5.3; the others at less), both paths
    32 ``[B, S, hidden]`` tensors and 8 ``[B, H, chunk, chunk]`` blocks."""
    import torch

    elem = torch.finfo(getattr(torch, DTYPES[cfg["dtype"]])).bits // 8
    logits_elem = max(elem, 4)  # the explicit softmax runs in promote_types(dtype, float32)
    B, H = cfg["batch"], cfg["heads"]
    linear = (_LINEAR_FACTOR * B * seq_len * cfg["hidden"] * elem
              + _QUADRATIC_FACTOR * B * H * LOCAL_CHUNK_SIZE**2 * logits_elem)
    if path == "before":
        return linear + _QUADRATIC_FACTOR * B * H * seq_len**2 * logits_elem
    return linear


def predict_peak_bytes(cfg: dict, mode: str, path: str, seq_len: int, measured: dict[int, int]) -> int:
    """Predicted peak of a run: the memory measured at the largest smaller S0 of the same mode and path
    (``measured``: S -> bytes; :func:`run_all` passes the larger of the peak and the saved bytes, since a peak
    RSS at a tiny S can read 0) times ``(S / S0)^2``: exact for an ``S x S`` path, an overestimate for a linear
    one. :func:`analytic_peak_bytes` when no smaller S was measured."""
    smaller = [s for s in measured if s < seq_len]
    if not smaller:
        return analytic_peak_bytes(cfg, path, seq_len)
    s0 = max(smaller)
    return int(max(measured[s0], 0) * (seq_len / s0) ** 2)


def growth_exponent(seq_lens: list[int], values: list[float]) -> float | None:
    """The exponent p of ``value ~= c + a * S^p`` (c, a >= 0) fitted to the points, least squares on relative
    errors over p in [0, 3] in steps of 0.01: 1 is linear growth, 2 quadratic. The constant c absorbs what does
    not grow with S (weights, allocator slack). With two points c = 0, so p is the log-log slope; with fewer, or a
    non-positive value, None."""
    points = sorted(zip(seq_lens, values))
    if len(points) < 2 or any(v <= 0 for _, v in points):
        return None
    if len(points) == 2:
        (s0, y0), (s1, y1) = points
        return math.log(y1 / y0) / math.log(s1 / s0)
    s_max = points[-1][0]
    best_err, best_p = math.inf, None
    for step in range(301):
        p = step / 100
        # residuals c * u_i + a * w_i - 1 (relative to y_i), basis scaled to 1 at the largest S
        u = [1 / y for _, y in points]
        w = [(s / s_max) ** p / y for s, y in points]
        uu, uw, ww = sum(x * x for x in u), sum(x * z for x, z in zip(u, w)), sum(z * z for z in w)
        det = uu * ww - uw * uw
        c = (ww * sum(u) - uw * sum(w)) / det if det > 1e-12 * uu * ww else -1.0
        a = (uu * sum(w) - uw * sum(u)) / det if c >= 0 else 0.0
        if c < 0:  # the best fit with c >= 0 has c = 0
            c, a = 0.0, sum(w) / ww
        if a <= 0:
            continue
        err = sum((c * x + a * z - 1) ** 2 for x, z in zip(u, w))
        if err < best_err - 1e-15:
            best_err, best_p = err, p
    return best_p


# ----------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------


def _series(report: dict, mode: str, path: str) -> list[dict]:
    return [r for r in report["runs"] if r["mode"] == mode and r["path"] == path]


def exponents(report: dict) -> dict[str, dict[str, dict[str, float | None]]]:
    """mode -> path -> {"peak": p, "saved": p} over the runs that ran (:func:`growth_exponent`)."""
    result: dict = {}
    for mode in report["config"]["modes"]:
        for path in report["config"]["paths"]:
            ran = [r for r in _series(report, mode, path) if r["status"] == "ok"]
            lengths = [r["seq_len"] for r in ran]
            result.setdefault(mode, {})[path] = {
                key: growth_exponent(lengths, [r[f"{key}_bytes"] for r in ran]) for key in ("peak", "saved")
            }
    return result


def before_after_ratios(report: dict) -> dict[str, dict | None]:
    """mode -> {"seq_len", "peak", "saved"}: before / after at the largest S where both ran (None if none)."""
    ok = {(r["mode"], r["path"], r["seq_len"]): r for r in report["runs"] if r["status"] == "ok"}
    result = {}
    for mode in report["config"]["modes"]:
        both = [s for s in report["config"]["seq_lens"] if (mode, "before", s) in ok and (mode, "after", s) in ok]
        if not both:
            result[mode] = None
            continue
        before, after = ok[mode, "before", max(both)], ok[mode, "after", max(both)]
        result[mode] = {"seq_len": max(both)} | {
            key: before[f"{key}_bytes"] / max(after[f"{key}_bytes"], 1) for key in ("peak", "saved")}
    return result


def _cell(run: dict | None, key: str) -> str:
    if run is None:
        return ""
    if run["status"] == "not run":
        return f"not run ({run['reason']})" if key == "peak" else "not run"
    if run["status"] == "failed":
        return f"failed: {run['error']}" if key == "peak" else "failed"
    if key == "seconds":
        return f"{run['seconds']:.2f}"
    return f"{run[key + '_bytes'] / MIB:.1f}"


def _fmt_exponent(p: float | None) -> str:
    return "-" if p is None else f"{p:.2f}"


def markdown(report: dict) -> str:
    """The Markdown summary of a report: peak, saved bytes and time per S, mode and path, and growth exponents."""
    from ds4sci.bench import memory

    cfg = report["config"]
    columns = [(mode, path) for mode in cfg["modes"] for path in cfg["paths"]]
    header = ["S", *[f"{mode} {path}" for mode, path in columns]]
    by_key = {(r["mode"], r["path"], r["seq_len"]): r for r in report["runs"]}
    kernels = sorted({r["kernel"] for r in report["runs"] if r.get("kernel") and r["path"] == "after"})

    def table(key: str) -> list[str]:
        rows = [[s, *[_cell(by_key.get((m, p, s)), key) for m, p in columns]] for s in cfg["seq_lens"]]
        return markdown_table(header, rows)

    exps = report["exponents"]
    exp_rows = [(mode, f"{path} ({PATHS[path]})", _fmt_exponent(exps[mode][path]["peak"]),
                 _fmt_exponent(exps[mode][path]["saved"]),
                 len([r for r in _series(report, mode, path) if r["status"] == "ok"]))
                for mode in cfg["modes"] for path in cfg["paths"]]
    position = f"{cfg['position']} positions" if cfg["position"] == "rotary" else "learned positions (no rotary)"
    threads = plural(cfg["threads"], "thread")
    lines = [
        "# GenSLM attention layer: peak memory of forward + backward vs sequence length",
        "",
        f"One GenSLM `Attention` layer (fused QKV, core, output projection): hidden {cfg['hidden']}, "
        f"{plural(cfg['heads'], 'head')} of {cfg['hidden'] // cfg['heads']}, batch {cfg['batch']}, {cfg['dtype']} on "
        f"{cfg['device']} "
        f"({threads}); forward and backward of mean(out^2). Modes: causal ({position}), alibi "
        f"(ALiBi), documents (packed documents of {cfg['doc_len'] // 2}-{3 * cfg['doc_len'] // 2} tokens, "
        f"{position}). Paths: before = `attention_backend='sdpa'` (sdpa_attention), after = "
        f"`attention_backend='auto'` (memory_efficient_attention: {', '.join(kernels) or '-'} here). Peak: "
        f"{report['peak_method']}, above what the layer and its inputs hold. "
        f"{memory.describe_allocator(report['allocator'])} Runs predicted to exceed "
        f"{format_bytes(cfg['memory_limit_bytes'])}"
        + (f" or {cfg['time_limit_s']:g} s" if cfg["time_limit_s"] is not None else "") + " are not run.",
        "",
        "## Peak memory of forward + backward (MiB)",
        "",
        *table("peak"),
        "",
        "## Saved for backward (MiB)",
        "",
        *table("saved"),
        "",
        "## Time of forward + backward (s)",
        "",
        *table("seconds"),
        "",
        "## Growth exponent p (fit of c + a * S^p over the runs that ran; 1 = linear, 2 = quadratic)",
        "",
        *markdown_table(("mode", "path", "p of peak", "p of saved for backward", "runs"), exp_rows),
        "",
        *([
            "## Before / after at the largest S both ran",
            "",
            *markdown_table(("mode", "S", "peak before / after", "saved before / after"), [
                (mode, r["seq_len"], f"{r['peak']:.1f}x", f"{r['saved']:.1f}x")
                for mode, r in report["ratios"].items() if r is not None]),
            "",
        ] if len(cfg["paths"]) == 2 else []),
        f"Command: `{report['command']}`",
        "",
    ]
    return "\n".join(lines)


def plot(report: dict, path) -> None:
    """Log-log peak and saved bytes vs S per mode and path, with slope-1 and slope-2 references, to ``path``."""
    cfg = report["config"]
    fig, axes = subplots(1, 2, figsize=(12, 5))
    colors = dict(zip(MODES, ("tab:blue", "tab:orange", "tab:green")))
    for ax, key, title in ((axes[0], "peak", "peak memory of forward + backward"),
                           (axes[1], "saved", "saved for backward")):
        lows = []
        for mode in cfg["modes"]:
            for p in cfg["paths"]:
                ran = [r for r in _series(report, mode, p) if r["status"] == "ok" and r[f"{key}_bytes"] > 0]
                if not ran:
                    continue
                xs, ys = [r["seq_len"] for r in ran], [r[f"{key}_bytes"] / MIB for r in ran]
                lows.append(ys[0])
                ax.plot(xs, ys, color=colors[mode], linestyle="--" if p == "before" else "-",
                        marker="o" if p == "before" else "s", label=f"{mode} {p} ({PATHS[p]})")
        if lows:
            s0, s1 = cfg["seq_lens"][0], cfg["seq_lens"][-1]
            y0 = min(lows)
            for slope, style in ((1, ":"), (2, "-.")):
                ax.plot([s0, s1], [y0, y0 * (s1 / s0) ** slope], color="gray", linestyle=style,
                        label=f"slope {slope}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length S")
        ax.set_ylabel("MiB")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"GenSLM attention layer, hidden {cfg['hidden']}, {plural(cfg['heads'], 'head')}, {cfg['dtype']} on "
                 f"{cfg['device']}")
    save_figure(fig, path)


# ----------------------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------------------


def format_bytes(n: float) -> str:
    """``"17.1 GiB"``; ``"0.25 GiB"`` below 1 GiB, ``"12 MiB"`` below 64 MiB."""
    if n < GIB / 16:
        return f"{n / MIB:.0f} MiB"
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / GIB:.2f} GiB"


def _skip_reason(cfg: dict, predicted_bytes: int, predicted_seconds: float | None) -> str | None:
    """Why a run is not launched (``"predicted X GiB > limit Y GiB"``, or the same for time), or None."""
    if predicted_bytes > cfg["memory_limit_bytes"]:
        return f"predicted {format_bytes(predicted_bytes)} > limit {format_bytes(cfg['memory_limit_bytes'])}"
    limit_s = cfg["time_limit_s"]
    if limit_s is not None and predicted_seconds is not None and predicted_seconds > limit_s:
        return f"predicted {predicted_seconds:.0f} s > time limit {limit_s:g} s"
    return None


def run_all(cfg: dict, progress: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Every (mode, path, S) of ``cfg``, smallest S first: measured in its own subprocess, or not run when predicted
    over the memory limit (:func:`predict_peak_bytes`) or the time limit (the time at the largest smaller S times
    ``(S / S0)^2``), or when a smaller S of the same mode and path failed. ``progress`` gets the records so far
    after each run."""
    plan = [(mode, path, s) for s in cfg["seq_lens"] for mode in cfg["modes"] for path in cfg["paths"]]
    measured: dict[tuple[str, str], dict[int, int]] = {}
    times: dict[tuple[str, str], dict[int, float]] = {}
    failed: set[tuple[str, str]] = set()
    runs = []
    for i, (mode, path, s) in enumerate(plan, 1):
        where = f"[{i}/{len(plan)}] {mode} {path} ({PATHS[path]}) S={s}"
        record = {"mode": mode, "path": path, "backend": PATHS[path], "seq_len": s}
        series, series_times = measured.setdefault((mode, path), {}), times.setdefault((mode, path), {})
        record["predicted_bytes"] = predict_peak_bytes(cfg, mode, path, s, series)
        smaller = [s0 for s0 in series_times if s0 < s]
        predicted_s = series_times[max(smaller)] * (s / max(smaller)) ** 2 if smaller else None
        reason = "a smaller S failed" if (mode, path) in failed else _skip_reason(cfg, record["predicted_bytes"],
                                                                                  predicted_s)
        if reason:
            record |= {"status": "not run", "reason": reason}
            logger.info("genslm-attention-memory %s: not run (%s)", where, reason)
        else:
            _launch(cfg, mode, path, s, where, record, series, series_times, failed)
        runs.append(record)
        if progress is not None:
            progress(runs)
    return runs


def _launch(cfg: dict, mode: str, path: str, s: int, where: str, record: dict, series: dict[int, int],
            series_times: dict[int, float], failed: set[tuple[str, str]]) -> None:
    """One run in its subprocess: its results into ``record`` and the series' measurements, or a failure."""
    from ds4sci.bench import memory

    logger.info("genslm-attention-memory %s: running (predicted peak <= %.2f GiB)", where,
                record["predicted_bytes"] / GIB)
    try:
        result = memory.run_in_subprocess(MEASURE, cfg, mode, path, s, env={"PYTHONWARNINGS": "ignore"})
    except RuntimeError as err:
        last = [line for line in str(err).strip().splitlines() if line.strip()][-1]
        record |= {"status": "failed", "error": last[:200]}
        failed.add((mode, path))
        logger.warning("genslm-attention-memory %s: failed: %s", where, last[:200])
        return
    record |= {"status": "ok"} | result
    series[s] = max(result["peak_bytes"], result["saved_bytes"])
    series_times[s] = result["seconds"]
    logger.info("genslm-attention-memory %s: peak %.1f MiB, saved %.1f MiB, %.1f s", where,
                result["peak_bytes"] / MIB, result["saved_bytes"] / MIB, result["seconds"])


def run(args: argparse.Namespace) -> int:
    """``ds4sci bench genslm-attention-memory``: exit status 2 with one error line for an impossible
    configuration, 1 when a run failed, else 0."""
    import torch

    from ds4sci.bench import memory

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    threads = torch.get_num_threads() if args.threads is None else args.threads
    cfg = {
        "seq_lens": list(QUICK_SEQ_LENS if args.quick else args.seq_lens), "modes": list(args.modes),
        "paths": list(args.paths),
        "hidden": args.hidden, "heads": args.heads, "batch": args.batch, "position": args.position,
        "doc_len": args.doc_len, "dtype": args.dtype, "device": device, "threads": threads,
        "time_limit_s": args.time_limit_s, "seed": args.seed,
    }
    problem = None
    try:
        cfg["memory_limit_bytes"] = (int(args.memory_limit_gib * GIB) if args.memory_limit_gib is not None
                                     else default_memory_limit(device))
    except (RuntimeError, ValueError) as err:
        problem = f"cannot determine the memory limit ({err}); pass --memory-limit-gib"
    problem = problem or _check_config(cfg)
    if problem:
        logger.error("genslm-attention-memory: %s", problem)
        return 2
    start = time.perf_counter()
    report = {
        "config": cfg,
        "command": command_line(cfg, args.out),
        "peak_method": memory.peak_method(cfg["device"]),
        "allocator": memory.allocator_settings(),
        "torch_version": torch.__version__,
        "cpu_count": os.cpu_count(),
        "runs": [],
    }

    def write(runs: list[dict]) -> Path:  # after every run, so an interrupted benchmark leaves its results
        report["runs"] = runs
        report["wall_s"] = round(time.perf_counter() - start, 1)
        report["exponents"] = exponents(report)
        report["ratios"] = before_after_ratios(report)
        return write_report(args.out, NAME, report, markdown(report))

    path = write(run_all(cfg, progress=write))
    plot(report, path.with_suffix(".png"))
    logger.info("genslm-attention-memory: wrote %s, %s and %s", path, path.with_suffix(".md"), path.with_suffix(".png"))
    return 1 if any(r["status"] == "failed" for r in report["runs"]) else 0
