"""``ds4sci bench kernels-aot``: compile every shipped Triton Evoformer kernel for sm_80 and sm_90, without a GPU.

For every configuration the tile table of :mod:`ds4sci.kernels.triton_evoformer` can return (each dtype x
``BLOCK_D`` bucket) and every kernel variant the launchers can request (forward and the four backward kernels, each
with its ``HAS_MASK`` / ``HAS_PAIR`` / ``MASK_GRAD`` flags), it runs

    triton.compile(ASTSource(fn=kernel, signature=..., constexprs=..., attrs=...), target=GPUTarget("cuda", cc, 32))

and records the dynamic shared memory Triton requests (``compiled.metadata.shared``) and the registers per thread,
stack frame and spill bytes that ``ptxas -v`` reports for the very compile that produced the cubin: Triton always
runs ptxas with ``-v`` and prints its log under ``TRITON_DUMP_PTXAS_LOG=1``, which the workers set (with
``TRITON_ALWAYS_COMPILE=1``, so a cache hit never skips ptxas). So the figures come from the ptxas and flags Triton
itself uses for each target (the wheel's ``ptxas`` for sm_80, its ``ptxas-blackwell`` for sm_90a, with Triton's
``--regAllocOptLevel=2``), i.e. what a launch on that GPU would load.

The signature, constexprs and divisibility attributes come from the kernel launchers themselves
(``fwd_launch`` / ``bwd_launches``) applied to small CPU tensors of a representative shape, passed through Triton's
own argument specialisation (``native_specialize_impl``, what ``JITFunction.run`` calls), so the gate compiles what a
launch on contiguous inputs of that shape would compile: S = 256 (a multiple of 16, like the residue crops), D equal
to ``BLOCK_D``, 16-byte aligned pointers, unit head-dim strides.

Compilation runs in worker processes started with ``TRITON_INTERPRET`` removed from their environment (under the
interpreter ``@triton.jit`` returns interpreted functions, which cannot be compiled), so this also works from a
process, such as the test suite, that runs the kernels under the interpreter.

Writes ``kernels_aot.json`` and ``kernels_aot.md`` to ``--out``; returns non-zero when a variant fails to compile,
exceeds the target's shared memory or spills.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import io
import json
import logging
import multiprocessing
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

#: compute capability -> (ptxas --gpu-name, max dynamic shared memory per block in bytes)
TARGETS: dict[int, tuple[str, int]] = {
    80: ("sm_80", 163 * 1024),  # A100: 163 KB opt-in dynamic shared memory per block
    90: ("sm_90a", 227 * 1024),  # H100: 227 KB
}
DTYPES = ("fp16", "bf16", "fp32")
KERNELS = ("fwd", "bwd_preprocess", "bwd_dkdv", "bwd_dq", "bwd_dpair")
#: representative launch shape (Z, N, S, H); D is each BLOCK_D bucket
REPRESENTATIVE = {"Z": 1, "N": 2, "S": 256, "H": 8}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One compiled specialisation: a kernel, a table entry (dtype, BLOCK_D) and its bias flags."""

    kernel: str
    dtype: str
    block_d: int
    has_mask: bool
    has_pair: bool
    mask_grad: bool = False

    @property
    def flags(self) -> str:
        names = [n for n, on in (("mask", self.has_mask), ("pair", self.has_pair), ("mask_grad", self.mask_grad)) if on]
        return "+".join(names) or "-"


def shipped_variants(
    dtypes=DTYPES, block_ds: Optional[tuple[int, ...]] = None, worst_case_only: bool = False
) -> list[Variant]:
    """Every (kernel, dtype, BLOCK_D, flags) the launchers can request; ``worst_case_only`` keeps, per kernel and
    table entry, only the variant with every flag on: the most code and shared memory, a quick check but not a
    substitute for the full set (ptxas allocates registers per variant; a flag-off variant can spill alone)."""
    from ds4sci.kernels.triton_evoformer import BLOCK_D_BUCKETS

    out = []
    for dtype in dtypes:
        for block_d in block_ds or BLOCK_D_BUCKETS:
            both = [(m, p) for m in (False, True) for p in (False, True)]
            per_kernel = {
                "fwd": [(m, p, False) for m, p in both],
                "bwd_preprocess": [(False, False, False)],
                "bwd_dkdv": [(m, p, g) for m, p in both for g in ((False, True) if m else (False,))],
                "bwd_dq": [(m, p, False) for m, p in both],
                "bwd_dpair": [(m, True, False) for m in (False, True)],
            }
            for kernel in KERNELS:
                flags = per_kernel[kernel]
                if worst_case_only:
                    flags = flags[-1:]
                out += [Variant(kernel, dtype, block_d, m, p, g) for m, p, g in flags]
    return out


def _launch(variant: Variant):
    """(jit kernel, positional args, constexpr and launch kwargs) from the real launchers on CPU tensors."""
    import torch

    from ds4sci.kernels import triton_evoformer as te

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[variant.dtype]
    z, n, s, h = (REPRESENTATIVE[k] for k in ("Z", "N", "S", "H"))
    d = variant.block_d
    q, k, v, o, do = (torch.empty(z, n, s, h, d, dtype=dtype) for _ in range(5))  # [Z, N, S, H, D]
    mask = torch.empty(z, n, s, dtype=dtype) if variant.has_mask else None  # [Z, N, S]
    pair = torch.empty(z, h, s, s, dtype=dtype) if variant.has_pair else None  # [Z, H, S, S]
    lse, delta = (torch.empty(z, n, h, s) for _ in range(2))  # [Z, N, H, S] fp32
    if variant.kernel == "fwd":
        _, args, meta = te.fwd_launch(q, k, v, mask, pair, o, lse)
        return te._fwd_kernel, args, meta
    dmask_part = torch.empty(z, n, h, s) if variant.mask_grad else None
    dpair = torch.empty(z, h, s, s) if variant.kernel == "bwd_dpair" else None
    launches = te.bwd_launches(do, q, k, v, o, lse, mask, pair, delta, *(torch.empty_like(q) for _ in range(3)),
                               dmask_part, dpair)
    name = "_" + variant.kernel + "_kernel"
    (kernel, _, args, meta), = [launch for launch in launches if launch[0].__name__ == name]
    return kernel, args, meta


def _ast_source(kernel, args, meta, backend):
    """ASTSource with the signature/constexprs/attrs Triton's JIT would derive from these arguments."""
    import triton
    from triton.runtime.jit import native_specialize_impl

    names = kernel.arg_names
    options = {key: value for key, value in meta.items() if key not in names}  # num_warps, num_stages
    constexprs = {key: value for key, value in meta.items() if key in names}
    runtime_names = [name for name in names if name not in constexprs]
    if len(runtime_names) != len(args):
        raise ValueError(f"{kernel.__name__}: {len(args)} arguments for parameters {runtime_names}")
    signature, attrs = {}, {}
    for name, arg in zip(runtime_names, args):
        # (type, specialisation): e.g. ("*fp16", "D") for a 16-byte aligned pointer, ("constexpr", 1), ("i32", "")
        ty, desc = native_specialize_impl(backend, arg, False, True, True)
        signature[name] = ty
        if ty == "constexpr":
            constexprs[name] = arg
        elif desc:
            attrs[(names.index(name),)] = backend.parse_attr(desc)
    for name in constexprs:
        signature[name] = "constexpr"
    return triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs), options


_PTXAS_LOG_RE = {
    "registers": re.compile(r"Used (\d+) registers"),
    "stack_bytes": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


def _ptxas_usage(log: str) -> dict:
    """Registers, stack frame and spill bytes of the (single) entry function in a ``ptxas -v`` log."""
    usage = {}
    for key, pattern in _PTXAS_LOG_RE.items():
        found = pattern.findall(log)
        if len(found) != 1:
            raise RuntimeError(f"expected one {key} figure in the ptxas -v log, found {found}:\n{log}")
        usage[key] = int(found[0])
    return usage


def ptxas_versions() -> dict[str, str]:
    """The ptxas Triton runs for each target (its own rule: ``ptxas`` below sm_90, ``ptxas-blackwell`` from sm_90)."""
    import triton

    versions = {}
    for cc, (name, _) in TARGETS.items():
        tool = triton.knobs.nvidia.ptxas if cc < 90 else triton.knobs.nvidia.ptxas_blackwell
        proc = subprocess.run([tool.path, "--version"], capture_output=True, text=True, check=False)
        last = proc.stdout.strip().splitlines()[-1:] or ["unknown"]
        versions[name] = f"{Path(tool.path).name}: {last[0]}"
    return versions


def compile_variant(variant: Variant, capability: int) -> dict:
    """Compile one variant for one target; a record of its tiles and resource usage (or its error)."""
    import triton
    from triton.backends.compiler import GPUTarget

    gpu_name, smem_limit = TARGETS[capability]
    record = dataclasses.asdict(variant) | {"flags": variant.flags, "target": gpu_name, "smem_limit": smem_limit}
    start = time.perf_counter()
    try:
        kernel, args, meta = _launch(variant)
        record |= {key: meta[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_D", "num_warps", "num_stages", "maxnreg")
                   if key in meta}
        target = GPUTarget("cuda", capability, 32)
        src, options = _ast_source(kernel, args, meta, triton.compiler.make_backend(target))
        with contextlib.redirect_stdout(io.StringIO()) as log:  # Triton prints ptxas's -v log here
            compiled = triton.compile(src, target=target, options=options)
        record["shared_bytes"] = int(compiled.metadata.shared)
        record |= _ptxas_usage(log.getvalue())
        record["error"] = None
    except Exception as err:  # recorded and reported; the gate fails on any error
        record["error"] = f"{type(err).__name__}: {err}"
    record["compile_s"] = round(time.perf_counter() - start, 2)
    record["ok"] = (
        record["error"] is None and record["shared_bytes"] <= smem_limit
        and record["spill_stores"] == 0 and record["spill_loads"] == 0
    )
    return record


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


def compile_all(variants: list[Variant], capabilities=(80, 90), jobs: int = 1) -> list[dict]:
    """Compile every (variant, target) in ``jobs`` spawned worker processes; records in input order."""
    tasks = [(v, cc) for v in variants for cc in capabilities]
    ctx = multiprocessing.get_context("spawn")
    with _without_interpreter(), concurrent.futures.ProcessPoolExecutor(
        max_workers=max(1, jobs), mp_context=ctx, initializer=_worker_init
    ) as pool:
        return list(pool.map(compile_variant, *zip(*tasks)))


def _markdown(report: dict) -> str:
    rep = report["representative"]
    lines = [
        "# Triton Evoformer kernels compiled ahead of time",
        "",
        f"Triton {report['triton_version']}; registers and spills from the `ptxas -v` log of Triton's own compile "
        f"({'; '.join(f'{k}: {v}' for k, v in report['ptxas'].items())}); "
        f"representative launch Z={rep['Z']}, N={rep['N']}, S={rep['S']}, H={rep['H']}, D=BLOCK_D. Shared memory is "
        f"Triton's dynamic request (limits: {', '.join(f'{n} {lim} B' for n, lim in TARGETS.values())}).",
        "",
        "| kernel | dtype | BLOCK_D | flags | BLOCK_MxN | warps | stages | maxnreg | "
        + " | ".join(f"{name} regs | {name} spill B | {name} smem B" for name, _ in TARGETS.values())
        + " | ok |",
        "| --- " * (9 + 3 * len(TARGETS)) + "|",
    ]
    by_variant: dict[tuple, dict[str, dict]] = {}
    for r in report["results"]:
        key = (r["kernel"], r["dtype"], r["block_d"], r["flags"])
        by_variant.setdefault(key, {})[r["target"]] = r
    for (kernel, dtype, block_d, flags), per_target in by_variant.items():
        first = next(iter(per_target.values()))
        cells = []
        for name, _ in TARGETS.values():
            r = per_target.get(name)
            if r is None:
                cells += ["", "", ""]
            elif r["error"]:
                cells += ["error", "", ""]
            else:
                cells += [str(r["registers"]), str(r["spill_stores"] + r["spill_loads"]), str(r["shared_bytes"])]
        ok = all(r["ok"] for r in per_target.values())
        lines.append(
            f"| {kernel} | {dtype} | {block_d} | {flags} | {first.get('BLOCK_M', '-')}x{first.get('BLOCK_N', '-')} | "
            f"{first.get('num_warps', '')} | {first.get('num_stages', '')} | {first.get('maxnreg') or '-'} | "
            + " | ".join(cells) + f" | {'yes' if ok else 'NO'} |"
        )
    errors = [r for r in report["results"] if r["error"]]
    lines += ["", f"{len(report['results'])} compilations, {len(errors)} errors; all within limits and spill-free: "
              f"{'yes' if report['all_ok'] else 'NO'}."]
    for r in errors:
        where = f"{r['kernel']} {r['dtype']} BLOCK_D={r['block_d']} {r['flags']} {r['target']}"
        lines.append(f"- {where}: {r['error'][:500]}")
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES), help="(default: all)")
    parser.add_argument("--block-d", nargs="+", type=int, default=None, help="BLOCK_D buckets (default: all)")
    parser.add_argument("--targets", nargs="+", type=int, choices=sorted(TARGETS), default=sorted(TARGETS),
                        help="compute capabilities (default: %(default)s)")
    parser.add_argument("--worst-case-only", action="store_true",
                        help="per kernel and table entry only the variant with every flag on (quick, not complete)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="compile processes (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    import triton

    variants = shipped_variants(tuple(args.dtypes), tuple(args.block_d) if args.block_d else None, args.worst_case_only)
    start = time.perf_counter()
    results = compile_all(variants, tuple(args.targets), args.jobs)
    report = {
        "triton_version": triton.__version__,
        "ptxas": ptxas_versions(),
        "targets": {name: {"capability": cc, "smem_limit": lim} for cc, (name, lim) in TARGETS.items()},
        "representative": REPRESENTATIVE,
        "worst_case_only": bool(args.worst_case_only),
        "wall_s": round(time.perf_counter() - start, 1),
        "all_ok": all(r["ok"] for r in results),
        "results": results,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels_aot.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "kernels_aot.md").write_text(_markdown(report))
    bad = [r for r in results if not r["ok"]]
    for r in bad:
        why = r["error"] or f"smem {r['shared_bytes']} B, spills {r['spill_stores']}/{r['spill_loads']} B"
        logger.error("kernels-aot: %s %s BLOCK_D=%d %s on %s: %s", r["kernel"], r["dtype"], r["block_d"], r["flags"],
                     r["target"], why)
    logger.info("kernels-aot: %d compilations in %.0f s, %d not ok; wrote %s", len(results), report["wall_s"], len(bad),
                out / "kernels_aot.json")
    return 0 if not bad else 1
