"""``ds4sci bench kernels-aot``: compile the shipped Triton kernels (Evoformer, local attention, the triangle
multiplicative update) for sm_80 and sm_90, without a GPU.

Every variant of ``--set`` (:mod:`ds4sci.bench.aot.variants`: the Evoformer tile table at a representative launch,
OpenFold's and OpenFold3's launches, the local-attention tile table) is compiled for each target with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))``, from the arguments its call passes through the
public path (recorded, not run: :mod:`ds4sci.bench.aot.calls`) as Triton's JIT would specialise them
(:mod:`ds4sci.bench.aot.specialise`), in worker processes started without ``TRITON_INTERPRET``
(:mod:`ds4sci.bench.aot.pool`). Each compilation (:mod:`ds4sci.bench.aot.compile`) records Triton's dynamic shared
memory request, the registers, stack frame and spills of Triton's own ``ptxas -v`` run (:mod:`ds4sci.bench.aot.ptxas`)
and whether every ``ex2.approx`` in the PTX takes a scaled difference ``(s - m) * log2 e`` rather than a fused
multiply-add of a separately scaled maximum (:mod:`ds4sci.bench.aot.ptx`). That rule is the softmax's: the triangle
multiplicative update's kernels (``--set trimul``, :mod:`ds4sci.bench.aot.trimul`) subtract no maximum, their only
exponents are sigmoids of a logit, so their records carry no exponent findings (:func:`_without_softmax`).

``--cache-dir DIR`` keeps each compilation's figures under what determines its code and reads them back in later runs
(:mod:`ds4sci.bench.aot.compile`): the test suite's gates share one folder, so a kernel two of them compile is
compiled once.

``--quick`` compiles :func:`~ds4sci.bench.aot.variants.quick_variants` instead (one tile-table entry per kernel
family, every flag on: 16 compilations, a smoke test of the command).

Writes ``kernels_aot.json``, ``kernels_aot.md`` and ``kernels_aot.png`` (registers against shared memory of every
compilation, beside each target's limits) to ``--out``; returns non-zero when a variant fails to compile, exceeds the
target's shared memory, spills or computes an exponent from a fused multiply-add.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import time

from ds4sci.bench.aot.calls import CALLERS
from ds4sci.bench.aot.compile import TARGETS
from ds4sci.bench.aot.pool import compile_all
from ds4sci.bench.aot.ptxas import ptxas_versions
from ds4sci.bench.aot.variants import DTYPES
from ds4sci.bench.aot.variants import LOCAL_DTYPES
from ds4sci.bench.aot.variants import LOCAL_REPRESENTATIVE
from ds4sci.bench.aot.variants import QUICK
from ds4sci.bench.aot.variants import REPRESENTATIVE
from ds4sci.bench.aot.variants import SETS
from ds4sci.bench.aot.variants import quick_variants
from ds4sci.bench.aot.variants import variants_for
from ds4sci.bench.report import plural
from ds4sci.bench.report import save_figure
from ds4sci.bench.report import subplots
from ds4sci.bench.report import write_files

logger = logging.getLogger(__name__)


def _markdown(report: dict) -> str:
    rep = report["representative"]
    local = report.get("local_representative", LOCAL_REPRESENTATIVE)
    names = [name for name, _ in TARGETS.values()]
    lines = [
        "# Triton kernels compiled ahead of time (Evoformer, local attention, triangle multiplicative update)",
        "",
        f"Triton {report['triton_version']}; registers and spills from the `ptxas -v` log of Triton's own compile "
        f"({'; '.join(f'{k}: {v}' for k, v in report['ptxas'].items())}); "
        f"`representative`: Evoformer launch Z={rep['Z']}, N={rep['N']}, S={rep['S']}, H={rep['H']}, D=BLOCK_D, "
        "contiguous, biases in q's dtype; `local representative`: causal local attention B={B}, S={S}, H={H}, "
        "Hkv={Hkv}, D=BLOCK_D, contiguous; other cases: OpenFold's and OpenFold3's calls, each distinct "
        "specialisation once. ".format(**local) +
        "Shared memory is Triton's dynamic request (limits: "
        f"{', '.join(f'{n} {lim} B' for n, lim in TARGETS.values())}). "
        "`unsafe ex2`: exponents (of all `ex2` in the PTX) computed from a fused multiply-add of a scaled maximum "
        "(whose rounding error would become the exponent)."
        + (f" `--quick`: a smoke test of one tile-table entry per kernel family ({_quick_entries()}), every flag on; "
           "not the gate." if report.get("quick") else ""),
        "",
        "| case | kernel | dtype | BLOCK_D | flags | specialisation | BLOCK_MxN | warps | stages | maxnreg | "
        + " | ".join(f"{name} regs | {name} spill B | {name} smem B | {name} unsafe ex2" for name in names)
        + " | ok |",
        "| --- " * (11 + 4 * len(names)) + "|",
    ]
    by_variant: dict[tuple, dict[str, dict]] = {}
    for r in report["results"]:
        key = (r["case"], r["kernel"], r["dtype"], r["block_d"], r["flags"])
        by_variant.setdefault(key, {})[r["target"]] = r
    for (case, kernel, dtype, block_d, flags), per_target in by_variant.items():
        first = next(iter(per_target.values()))
        cells = []
        for name in names:
            r = per_target.get(name)
            if r is None:
                cells += ["", "", "", ""]
            elif r["error"]:
                cells += ["error", "", "", ""]
            else:
                cells += [str(r["registers"]), str(r["spill_stores"] + r["spill_loads"]), str(r["shared_bytes"]),
                          f"{len(r['unsafe_ex2'])}/{r['ex2']}"]
        ok = all(r["ok"] for r in per_target.values())
        lines.append(
            f"| {case} | {kernel} | {dtype} | {block_d} | {flags} | {first.get('specialisation', '')} | "
            f"{first.get('BLOCK_M', '-')}x{first.get('BLOCK_N', '-')} | "
            f"{first.get('num_warps', '')} | {first.get('num_stages', '')} | {first.get('maxnreg') or '-'} | "
            + " | ".join(cells) + f" | {'yes' if ok else 'NO'} |"
        )
    results = report["results"]
    errors = [r for r in results if r["error"]]
    unsafe = [r for r in results if r["error"] is None and r["unsafe_ex2"]]
    unsafe_text = f"NO ({plural(len(unsafe), 'compilation')})" if unsafe else "yes"
    cached = sum(bool(r.get("cached")) for r in results)
    lines += ["", f"{plural(len(results), 'compilation')} ({report['wall_s']} s"
              + (f"; {cached} read from `--cache-dir`" if cached else "") + f"), {plural(len(errors), 'error')}; "
              f"within limits and spill-free: {'yes' if all(r['resources_ok'] for r in results) else 'NO'}; exponents "
              f"from scaled differences only: {unsafe_text}."]
    for r in errors:
        lines.append(f"- {_where(r)}: {r['error'][:500]}")
    for r in unsafe[:5]:
        lines.append(f"- {_where(r)}: {len(r['unsafe_ex2'])} of {r['ex2']} ex2, e.g. {r['unsafe_ex2'][0]}")
    return "\n".join(lines) + "\n"


def _quick_entries() -> str:
    return ", ".join(f"{name} {dtype} BLOCK_D={block_d}" for name, (dtype, block_d) in QUICK.items())


#: kernel family of a compilation -> (label, colour) in the plot
_FAMILIES = {"evoformer": ("Evoformer tile table", "tab:blue"),
             "callers": ("OpenFold/OpenFold3 launches", "tab:orange"),
             "local": ("local attention", "tab:green"),
             "trimul": ("triangle multiplicative update", "tab:purple")}


def _family(r: dict) -> str:
    """``"local"`` (a local-attention variant: it has document flags), ``"trimul"`` (a triangle multiplicative update
    variant: it has an edge direction), ``"callers"`` (an Evoformer variant launched as a caller launches it) or
    ``"evoformer"`` (the representative launch of the Evoformer tile table)."""
    if "has_docs" in r:
        return "local"
    if "outgoing" in r:
        return "trimul"
    return "callers" if r["call"] is not None else "evoformer"


def plot(report: dict, path) -> None:
    """One panel per target: registers per thread (x) against Triton's dynamic shared memory request (y, KiB) of every
    compilation, coloured by kernel family, with the target's shared-memory limit and the 255-register ceiling;
    compilations that spill or take an exponent from a fused multiply-add are circled in red, errors are counted in the
    title."""
    targets = sorted({r["target"] for r in report["results"]})
    fig, axes = subplots(1, max(1, len(targets)), figsize=(6 * max(1, len(targets)), 4.5), squeeze=False)
    for ax, target in zip(axes[0], targets):
        results = [r for r in report["results"] if r["target"] == target]
        compiled = [r for r in results if r["error"] is None]
        for family, (label, colour) in _FAMILIES.items():
            points = [r for r in compiled if _family(r) == family]
            if points:
                ax.scatter([r["registers"] for r in points], [r["shared_bytes"] / 1024 for r in points], s=14,
                           color=colour, alpha=0.6, label=f"{label} ({len(points)})")
        bad = [r for r in compiled if not r["ok"]]
        if bad:
            ax.scatter([r["registers"] for r in bad], [r["shared_bytes"] / 1024 for r in bad], s=60,
                       facecolors="none", edgecolors="red", label=f"spills or unsafe ex2 ({len(bad)})")
        limit = results[0]["smem_limit"] / 1024
        ax.axhline(limit, color="red", linestyle="--", linewidth=1, label=f"shared memory limit ({limit:g} KiB)")
        ax.axvline(255, color="gray", linestyle=":", linewidth=1, label="255 registers")
        ax.set_xlabel("registers per thread")
        ax.set_ylabel("dynamic shared memory (KiB)")
        errors = len(results) - len(compiled)
        ax.set_title(f"{target}: {plural(len(results), 'compilation')}, {plural(errors, 'error')}", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="center left")
    fig.suptitle(f"Triton kernels compiled ahead of time (Triton {report['triton_version']}, set "
                 f"{'--quick' if report.get('quick') else report['set']})", fontsize=10)
    save_figure(fig, path)


def _where(r: dict) -> str:
    return f"{r['case']}: {r['kernel']} {r['dtype']} BLOCK_D={r['block_d']} {r['flags']} {r['target']}"


def _without_softmax(r: dict) -> dict:
    """A triangle multiplicative update record with the softmax exponent rule lifted: its ``ex2`` are sigmoids,
    ``exp2(-x * log2 e)`` of a logit, with no maximum whose rounding could become an exponent."""
    if _family(r) == "trimul" and r["error"] is None:
        r = r | {"unsafe_ex2": [], "exponents_ok": True, "ok": r["resources_ok"]}
    return r


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", dest="variant_set", choices=SETS, default="all",
                        help="shipped: every Evoformer tile-table variant at a representative launch; callers: the "
                             "specialisations OpenFold/OpenFold3 launch; local: the local-attention kernels for every "
                             "tile-table entry, flags all off and all on; local-full: every flag combination; trimul: "
                             "the triangle multiplicative update's kernels for every bf16/fp32/fp64 tile-table "
                             "entry and N=4096; all: shipped, callers, local and trimul (default: %(default)s)")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=None,
                        help="shipped and local sets: dtypes (default: all for shipped and local-full, "
                             f"{' '.join(LOCAL_DTYPES)} for local)")
    parser.add_argument("--block-d", nargs="+", type=int, default=None,
                        help="shipped and local sets: BLOCK_D buckets (default: all)")
    parser.add_argument("--targets", nargs="+", type=int, choices=sorted(TARGETS), default=sorted(TARGETS),
                        help="compute capabilities (default: %(default)s)")
    parser.add_argument("--worst-case-only", action="store_true",
                        help="shipped set: per kernel and table entry only the variant with every flag on (quick, "
                             "not complete)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="compile processes (default: %(default)s)")
    parser.add_argument("--cache-dir", default=None,
                        help="a folder (created if missing) keeping the figures of each compilation under its kernel "
                             "source, Triton version, specialisation, target and ds4sci's checks: one found there is "
                             "read instead of compiled, so runs sharing the folder compile each distinct kernel once "
                             "(default: none, compile everything)")
    parser.add_argument("--quick", action="store_true",
                        help=f"a smoke test instead of --set, --dtypes, --block-d and --worst-case-only: "
                             f"{_quick_entries()}, every kernel with every flag on (16 compilations for both "
                             "targets: about 40 s of CPU time, 1.5 minutes on 2 busy cores)")


def run(args: argparse.Namespace) -> int:
    import triton

    if args.cache_dir is not None:
        os.makedirs(args.cache_dir, exist_ok=True)
    if args.quick:
        variants = quick_variants()
    else:
        variants = variants_for(args.variant_set, tuple(args.dtypes) if args.dtypes else None,
                                tuple(args.block_d) if args.block_d else None, args.worst_case_only)
    compiles_callers = not args.quick and args.variant_set in ("callers", "all")
    start = time.perf_counter()
    results = [_without_softmax(r) for r in compile_all(variants, tuple(args.targets), args.jobs, args.cache_dir)]
    report = {
        "triton_version": triton.__version__,
        "ptxas": ptxas_versions(TARGETS),
        "targets": {name: {"capability": cc, "smem_limit": lim} for cc, (name, lim) in TARGETS.items()},
        "representative": REPRESENTATIVE,
        "local_representative": LOCAL_REPRESENTATIVE,
        "quick": bool(args.quick),
        "set": None if args.quick else args.variant_set,
        "callers": [dataclasses.asdict(call) for call in CALLERS] if compiles_callers else [],
        "worst_case_only": bool(args.worst_case_only),
        "cache_dir": args.cache_dir,
        "wall_s": round(time.perf_counter() - start, 1),
        "all_ok": all(r["ok"] for r in results),
        "results": results,
    }
    write_files(args.out, "kernels_aot", report, _markdown(report), plot)
    bad = [r for r in results if not r["ok"]]
    for r in bad:
        if r["error"]:
            why = r["error"]
        elif not r["resources_ok"]:
            why = f"smem {r['shared_bytes']} B, spills {r['spill_stores']}/{r['spill_loads']} B"
        else:
            why = f"{len(r['unsafe_ex2'])} of {r['ex2']} exponents from a fused multiply-add, e.g. {r['unsafe_ex2'][0]}"
        logger.error("kernels-aot: %s: %s", _where(r), why)
    logger.info("kernels-aot: %s in %.0f s, %d not ok", plural(len(results), "compilation"), report["wall_s"],
                len(bad))
    return 0 if not bad else 1
