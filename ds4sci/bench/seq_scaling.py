"""``ds4sci bench seq-scaling``: peak memory per rank of one GenSLM training step as the sequence grows.

For each scheme (Ulysses, ring, hybrid Ulysses x ring), degree ``P`` and sequence length ``S``, ``P`` gloo processes
(:func:`ds4sci.spawn.run_workers`) each run one forward + backward of a GenSLM made sequence-parallel by
:func:`~ds4sci.parallel.parallelize.parallelize` on their ``S/P`` tokens, after a warm-up step at a tiny length; each
measures the step's peak with :class:`ds4sci.bench.memory.PeakMemory` (CPU: peak RSS above the RSS at the start of the
step, so parameters and the warm-up's libraries are not counted). The figure is the maximum over ranks.

The Ulysses paper's claim (Jacobs et al. 2023) is a sequence ``P`` times longer at the same per-rank memory: the
activation memory of a rank should depend on ``S/P`` only. The report fits ``peak = a + b * S/P`` per scheme and
``P`` (``b``: bytes per local token; equal ``b`` across ``P`` means nothing on a rank grows with the full ``S``)
and lists the longest measured ``S`` within ``--budget-mib`` per rank, beside ``P`` times the ``P = 1`` figure.
"""
from __future__ import annotations

import argparse
import logging
import time

from ds4sci.bench.report import MIB
from ds4sci.bench.report import add_int_options
from ds4sci.bench.report import check_heads
from ds4sci.bench.report import markdown_table
from ds4sci.bench.report import parse_int_list
from ds4sci.bench.report import plot_peaks
from ds4sci.bench.report import plural
from ds4sci.bench.report import shape_options
from ds4sci.bench.report import write_files

logger = logging.getLogger(__name__)

SCHEMES = ("ulysses", "ring", "hybrid")
_WARMUP_TOKENS = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The shape and run options (``--out`` is added by :mod:`ds4sci.bench`)."""
    parser.add_argument("--seq-lens", type=parse_int_list, default=(2048, 4096, 8192, 16384), metavar="S,S,...",
                        help="sequence lengths, K = 1024 (default: 2K,4K,8K,16K)")
    parser.add_argument("--degrees", type=parse_int_list, default=(1, 2, 4), metavar="P,P,...",
                        help="sequence-parallel degrees; 1 is the single-process baseline (default: 1,2,4)")
    add_int_options(parser, shape_options(hidden=256, layers=2, heads=8))
    parser.add_argument("--budget-mib", type=float, default=256.0,
                        help="per-rank memory budget for the longest-sequence column (default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="S = 256, 512 at P = 1, 2, hidden 32, 1 layer (a smoke test)")


def _dims_kwargs(scheme: str, P: int) -> dict | None:
    if P == 1:
        return {}
    if scheme == "ulysses":
        return {"ulysses": P}
    if scheme == "ring":
        return {"ring": P, "layout": "zigzag"}
    return {"ulysses": P // 2, "ring": 2, "layout": "zigzag"} if P >= 4 and P % 2 == 0 else None


def _worker(rank: int, world: int, dims_kwargs: dict, seq_len: int, shape: dict) -> int:
    """This rank's peak bytes above its start during one forward + backward at ``seq_len`` tokens."""
    import torch

    from ds4sci.bench.memory import PeakMemory
    from ds4sci.distributed import ParallelDims
    from ds4sci.distributed.groups import build_groups
    from ds4sci.models.genslm import GenSLM
    from ds4sci.models.genslm import GenSLMConfig
    from ds4sci.parallel.parallelize import parallelize
    from ds4sci.sequence import shard_sequence

    dims = ParallelDims(dp=1, **dims_kwargs)
    groups = build_groups(dims)
    torch.manual_seed(0)
    config = GenSLMConfig(vocab_size=6, hidden_size=shape["hidden"], num_layers=shape["layers"],
                          num_heads=shape["heads"], max_position_embeddings=seq_len, position_embedding="rotary")
    model = GenSLM(config)
    parallelize(model, groups)

    def step(n: int) -> None:
        ids = torch.randint(0, 6, (1, n), generator=torch.Generator().manual_seed(n))
        pos = torch.arange(n)[None]
        ids, pos = (shard_sequence(t, 1, groups.sp_rank, dims.sp, dims.layout) for t in (ids, pos))
        model(ids, pos).float().square().mean().backward()
        model.zero_grad(set_to_none=True)

    step(_WARMUP_TOKENS * max(1, dims.sequence_multiple))
    with PeakMemory("cpu") as peak:
        step(seq_len)
    return peak.bytes


def measure(scheme: str, P: int, seq_len: int, shape: dict) -> dict:
    from ds4sci.spawn import run_workers

    start = time.perf_counter()
    peaks = run_workers(_worker, P, _dims_kwargs(scheme, P), seq_len, shape, timeout=1800)
    return {"scheme": scheme, "P": P, "seq_len": seq_len, "peak_bytes_max": max(peaks), "peak_bytes": peaks,
            "seconds": round(time.perf_counter() - start, 1)}


def fit_per_token(runs: list[dict]) -> tuple[float, float] | None:
    """Least-squares ``peak = a + b * S/P`` over ``runs`` (one scheme and P); ``(a, b)``, None below 2 points."""
    if len(runs) < 2:
        return None
    xs = [r["seq_len"] / r["P"] for r in runs]
    ys = [r["peak_bytes_max"] for r in runs]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
    return my - b * mx, b


def summarize(report: dict) -> list[dict]:
    """Per scheme and P: the fit and the longest measured S within the budget."""
    budget = report["config"]["budget_mib"] * MIB
    rows = []
    for scheme in ("baseline", *SCHEMES):
        for P in report["config"]["degrees"]:
            runs = [r for r in report["runs"] if r["scheme"] == scheme and r["P"] == P]
            if not runs:
                continue
            fit = fit_per_token(runs)
            fitting = [r["seq_len"] for r in runs if r["peak_bytes_max"] <= budget]
            rows.append({"scheme": scheme, "P": P, "bytes_per_local_token": fit[1] if fit else None,
                         "intercept_bytes": fit[0] if fit else None,
                         "longest_within_budget": max(fitting) if fitting else None})
    return rows


def markdown(report: dict) -> str:
    c = report["config"]
    lines = [f"# seq-scaling: peak memory per rank of one GenSLM forward + backward (fp32, CPU, hidden {c['hidden']}, "
             f"{plural(c['heads'], 'head')}, {plural(c['layers'], 'layer')}, rotary, causal)", "",
             f"Command: `{report['command']}`", "",
             "Peak MiB per rank (max over ranks):", ""]
    keys = sorted({(r["scheme"], r["P"]) for r in report["runs"]}, key=lambda k: (k[1], k[0]))
    seq_lens = c["seq_lens"]
    rows = []
    for scheme, P in keys:
        by_s = {r["seq_len"]: r for r in report["runs"] if r["scheme"] == scheme and r["P"] == P}
        rows.append([scheme, P] + [f"{by_s[s]['peak_bytes_max'] / MIB:.1f}" if s in by_s else "" for s in seq_lens])
    lines += markdown_table(["scheme", "P"] + [f"S={s}" for s in seq_lens], rows)
    base = next((s for s in report["summary"] if s["scheme"] == "baseline"), None)
    lines += ["", f"Fit `peak = a + b * S/P` and the longest measured S within {c['budget_mib']:g} MiB per rank:", ""]
    rows = []
    for s in report["summary"]:
        ideal = base["longest_within_budget"] * s["P"] if base and base["longest_within_budget"] else None
        rows.append([s["scheme"], s["P"],
                     f"{s['bytes_per_local_token'] / 1024:.1f}" if s["bytes_per_local_token"] else "",
                     f"{s['intercept_bytes'] / MIB:.1f}" if s["intercept_bytes"] is not None else "",
                     s["longest_within_budget"] or "none measured", ideal or ""])
    lines += markdown_table(["scheme", "P", "b: KiB per local token", "a: MiB", "longest S measured within budget",
                             "P x baseline's"], rows)
    lines += ["", "Equal `b` across P: a rank's activation memory depends on S/P only (nothing grows with the full "
              "S). The longest-S column is limited by the S values run."]
    return "\n".join(lines) + "\n"


def plot(report: dict, path) -> None:
    """Peak MiB of the most loaded rank against S, one line per scheme and P."""
    curves = {}
    for scheme, P in sorted({(r["scheme"], r["P"]) for r in report["runs"]}, key=lambda k: (k[1], k[0])):
        runs = sorted((r for r in report["runs"] if r["scheme"] == scheme and r["P"] == P), key=lambda r: r["seq_len"])
        curves[f"{scheme} P={P}"] = ([r["seq_len"] for r in runs], [r["peak_bytes_max"] / MIB for r in runs])
    plot_peaks(path, curves, report["config"]["budget_mib"], "peak MiB per rank (forward + backward)")


def run(args: argparse.Namespace) -> int:
    if args.quick:
        seq_lens, degrees, shape = (256, 512), (1, 2), {"hidden": 32, "heads": 4, "layers": 1}
    else:
        seq_lens, degrees = args.seq_lens, args.degrees
        shape = {"hidden": args.hidden, "heads": args.heads, "layers": args.layers}
    for name, value in (("--hidden", shape["hidden"]), ("--heads", shape["heads"]), ("--layers", shape["layers"]),
                        ("--budget-mib", args.budget_mib)):
        if value <= 0:
            raise ValueError(f"{name}={value:g}: must be > 0")
    check_heads(shape["hidden"], shape["heads"])
    for P in degrees:
        for scheme in SCHEMES:
            kwargs = _dims_kwargs(scheme, P)
            if kwargs is None:
                continue
            multiple = 2 * P if kwargs.get("ring") else P
            if shape["heads"] % kwargs.get("ulysses", 1):
                raise ValueError(f"--heads={shape['heads']}: the {scheme} Ulysses degree {kwargs['ulysses']} at P={P} "
                                 f"must divide the heads")
            bad = [s for s in seq_lens if s % multiple]
            if bad:
                raise ValueError(f"--seq-lens {bad}: must be multiples of {multiple} for {scheme} at P={P}")
    command = "ds4sci bench seq-scaling " + ("--quick" if args.quick else (
        f"--seq-lens {','.join(map(str, seq_lens))} --degrees {','.join(map(str, degrees))} --hidden {shape['hidden']} "
        f"--heads {shape['heads']} --layers {shape['layers']}")) + f" --budget-mib {args.budget_mib:g}"
    report = {"command": command, "config": {"seq_lens": list(seq_lens), "degrees": list(degrees), **shape,
                                             "budget_mib": args.budget_mib}, "runs": []}
    jobs = [("baseline" if P == 1 else scheme, P, s) for P in degrees for scheme in (SCHEMES[:1] if P == 1 else SCHEMES)
            if _dims_kwargs(scheme, P) is not None for s in seq_lens]
    from tqdm import tqdm

    for scheme, P, s in tqdm(jobs, desc="seq-scaling", unit="run"):
        report["runs"].append(measure(scheme, P, s, shape))
    report["summary"] = summarize(report)
    write_files(args.out, "seq_scaling", report, markdown(report), plot)
    return 0
