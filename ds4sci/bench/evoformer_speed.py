"""``ds4sci bench evoformer-speed``: forward and forward+backward time of Evoformer attention on a CUDA GPU.

Implementations, each where it imports and supports the dtype:

- ``ds4sci-triton``: ``ds4sci.kernels.evoformer_attention(..., backend="triton")`` (the compiled kernels);
- ``ds4sci-torch``: the same function with ``backend="torch"`` (chunked PyTorch, recomputing backward);
- ``openfold3-triton``: OpenFold3's own Triton kernel, ``openfold3.core.kernels.triton.evoformer.TritonEvoformer``
  (what OpenFold3 runs with ``use_triton_triangle_kernels=True``);
- ``deepspeed``: DeepSpeed4Science's CUTLASS kernel ``deepspeed.ops.deepspeed4science.DS4Sci_EvoformerAttention``
  (fp16/bf16 only; JIT-built on its first call, which the warm-up absorbs).

Every implementation gets the same call: q, k, v ``[1, N, S, H, D]`` contiguous in the tested dtype, OpenFold's mask
bias ``1e9 * (mask - 1)`` ``[1, N, 1, 1, S]`` (about 10% of the keys masked) and a pair bias ``[1, 1, H, S, S]``,
both in q's dtype; q, k, v and the pair bias require grad (a training step), the mask bias does not.

Shapes are OpenFold's: MSA row attention with pair bias (N = N_seq, S = N_res, H = 8, D = 32), triangle attention
(N = S = N_res, H = 4, D = 32), extra-MSA row attention (N >= 1024, H = 8, D = 8); ``--quick`` runs small ones.

The triangle multiplicative update's rows (:mod:`ds4sci.bench.trimul_rows`: ds4sci's torch and chunked paths, and
cuEquivariance's kernel when ``cuequivariance_torch`` imports) at N = ``--trimul-sizes``, c_z = c_hidden = 128 (32 and
N = 64, 96 with ``--quick``), in the report's ``triangle_update``, follow the attention rows.

Timing: CUDA events, ``--warmup`` calls, then the median of ``--repeats``; "fwd" is the forward alone, "fwd+bwd" the
forward and the backward of ``sum(o * do)``. Also recorded: the peak CUDA memory of one forward+backward above what
the inputs hold, and the largest difference from the ``ds4sci-torch`` output (a fast kernel that computes something
else shows here).

Needs a CUDA GPU and compiled kernels: without CUDA (or with ``TRITON_INTERPRET=1``) it prints one line saying so and
returns 1. Writes ``evoformer_speed.json``, ``evoformer_speed.md`` and ``evoformer_speed.png`` (forward+backward time
per shape and implementation, one panel per dtype) to ``--out``; returns 1 when a ds4sci implementation fails
(another package's failure, such as DeepSpeed's JIT build, is recorded in the report).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from typing import Callable
from typing import Optional

from ds4sci.bench.report import MIB
from ds4sci.bench.report import markdown_table
from ds4sci.bench.report import save_figure
from ds4sci.bench.report import subplots
from ds4sci.bench.report import write_files
from ds4sci.bench.rounds import cuda_median_ms

logger = logging.getLogger(__name__)

NO_CUDA = "evoformer-speed needs a CUDA GPU; none is visible here"
INTERPRETED = ("evoformer-speed times the compiled Triton kernels, but TRITON_INTERPRET=1 would interpret them: "
               "unset it or set TRITON_INTERPRET=0")


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    n: int
    s: int
    h: int
    d: int

    def label(self) -> str:
        return f"{self.name} N={self.n} S={self.s} H={self.h} D={self.d}"


SHAPES = (
    Shape("msa-row", 128, 256, 8, 32),
    Shape("msa-row", 256, 384, 8, 32),
    Shape("msa-row", 512, 768, 8, 32),
    Shape("triangle", 256, 256, 4, 32),
    Shape("triangle", 384, 384, 4, 32),
    Shape("extra-msa-row", 1024, 256, 8, 8),
    Shape("extra-msa-row", 1024, 384, 8, 8),
)
QUICK_SHAPES = (
    Shape("msa-row", 16, 64, 8, 32),
    Shape("triangle", 48, 48, 4, 32),
    Shape("extra-msa-row", 64, 64, 8, 8),
)
DTYPES = ("bf16", "fp32")
IMPLEMENTATIONS = ("ds4sci-triton", "ds4sci-torch", "openfold3-triton", "deepspeed")


def _implementation(name: str, dtype) -> tuple[Optional[Callable], str]:
    """(function(q, k, v, mask_bias, pair_bias) -> o, "") or (None, why it is unavailable)."""
    import torch

    if name in ("ds4sci-triton", "ds4sci-torch"):
        from ds4sci.kernels import evoformer_attention

        backend = name.split("-", 1)[1]
        return (lambda q, k, v, mask, pair: evoformer_attention(q, k, v, [mask, pair], backend=backend)), ""
    if name == "openfold3-triton":
        try:
            from openfold3.core.kernels.triton.evoformer import TritonEvoformer
        except ImportError as err:
            return None, f"openfold3 not importable ({err})"
        if TritonEvoformer is None:
            return None, "openfold3's Triton kernel is unavailable (TritonEvoformer is None)"
        return (lambda q, k, v, mask, pair: TritonEvoformer(q, k, v, mask, pair, True)), ""
    if name == "deepspeed":
        if dtype not in (torch.float16, torch.bfloat16):
            return None, "DeepSpeed's kernel supports fp16/bf16 only"
        try:
            from deepspeed.ops.deepspeed4science import DS4Sci_EvoformerAttention
        except Exception as err:  # ImportError, or DeepSpeed's own errors at import
            return None, f"deepspeed.ops.deepspeed4science not importable ({type(err).__name__}: {err})"
        return (lambda q, k, v, mask, pair: DS4Sci_EvoformerAttention(q, k, v, [mask, pair])), ""
    raise ValueError(f"unknown implementation {name!r}")


def _inputs(shape: Shape, dtype, seed: int = 0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    size = (1, shape.n, shape.s, shape.h, shape.d)
    q, k, v, do = (torch.randn(size, generator=g, device="cuda", dtype=dtype) for _ in range(4))
    keep = torch.rand((1, shape.n, 1, 1, shape.s), generator=g, device="cuda") > 0.1
    keep[..., 0] = True
    mask = (1e9 * (keep.to(dtype) - 1)).to(dtype)  # OpenFold's mask bias, [1, N, 1, 1, S]
    pair = torch.randn((1, 1, shape.h, shape.s, shape.s), generator=g, device="cuda", dtype=dtype)
    for t in (q, k, v, pair):
        t.requires_grad_(True)
    return q, k, v, mask, pair, do


def _dtype(name: str):
    import torch

    return getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[name])


def _reference_output(shape: Shape, dtype_name: str):
    """The ds4sci-torch output for the inputs every implementation gets (what the others are compared with)."""
    import torch

    fn, _ = _implementation("ds4sci-torch", _dtype(dtype_name))
    with torch.no_grad():
        return fn(*_inputs(shape, _dtype(dtype_name))[:5])


def measure(name: str, shape: Shape, dtype_name: str, warmup: int, repeats: int, reference=None) -> dict:
    """Times of one implementation at one shape and dtype (or why it did not run)."""
    import torch

    dtype = _dtype(dtype_name)
    record = {"impl": name, "shape": dataclasses.asdict(shape), "dtype": dtype_name}
    fn, why = _implementation(name, dtype)
    if fn is None:
        return record | {"skipped": why}
    q, k, v, mask, pair, do = _inputs(shape, dtype)
    leaves = (q, k, v, pair)

    def forward():
        fn(q, k, v, mask, pair)

    def forward_backward():
        o = fn(q, k, v, mask, pair)
        torch.autograd.backward(o, do)
        for t in leaves:
            t.grad = None

    try:
        start = time.perf_counter()
        o = fn(q, k, v, mask, pair).detach()
        torch.cuda.synchronize()
        record["first_call_s"] = round(time.perf_counter() - start, 3)  # includes Triton/CUTLASS compilation
        if reference is not None:
            record["max_abs_diff_vs_ds4sci_torch"] = (o.float() - reference.float()).abs().max().item()
        record["fwd_ms"] = cuda_median_ms(forward, warmup, repeats)
        record["fwd_bwd_ms"] = cuda_median_ms(forward_backward, warmup, repeats)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        forward_backward()
        torch.cuda.synchronize()
        record["peak_mib"] = round((torch.cuda.max_memory_allocated() - base) / MIB, 1)
    except Exception as err:  # reported per implementation; the others still run
        record["error"] = f"{type(err).__name__}: {str(err)[:500]}"
    finally:
        torch.cuda.empty_cache()
    return record


def _markdown(report: dict) -> str:
    rows = []
    for r in report["results"]:
        shape = Shape(**r["shape"]).label()
        base = next((x for x in report["results"] if x["impl"] == "ds4sci-triton" and x["shape"] == r["shape"]
                     and x["dtype"] == r["dtype"] and "fwd_bwd_ms" in x), None)
        if "fwd_ms" in r:
            ratio = f"{r['fwd_bwd_ms'] / base['fwd_bwd_ms']:.2f}" if base else "-"
            diff = r.get("max_abs_diff_vs_ds4sci_torch")
            rows.append([shape, r["dtype"], r["impl"], f"{r['fwd_ms']:.3f}", f"{r['fwd_bwd_ms']:.3f}", ratio,
                         r["peak_mib"], "-" if diff is None else f"{diff:.2g}"])
        else:
            rows.append([shape, r["dtype"], r["impl"], "-", "-", "-", "-", r.get("skipped") or r.get("error")])
    lines = [
        "# Evoformer attention speed",
        "",
        f"{report['device']}; torch {report['torch_version']}, triton {report['triton_version']}; median of "
        f"{report['repeats']} after {report['warmup']} warm-up calls (CUDA events). fwd+bwd ratio: time / "
        "ds4sci-triton's (lower is faster). Peak: CUDA memory of one forward+backward above the inputs. Diff: largest "
        "|o - o(ds4sci-torch)| in the tested dtype.",
        "",
    ]
    lines += markdown_table(["shape", "dtype", "implementation", "fwd ms", "fwd+bwd ms", "fwd+bwd / ds4sci-triton",
                             "peak MiB", "diff / note"], rows)
    return "\n".join(lines) + "\n"


def plot(report: dict, path) -> None:
    """One panel per dtype: forward+backward milliseconds (log scale) per shape, a bar per implementation that ran
    (implementations skipped or failed at a shape leave a gap)."""
    results = [r for r in report["results"] if "fwd_bwd_ms" in r]
    dtypes = list(dict.fromkeys(r["dtype"] for r in report["results"]))
    fig, axes = subplots(1, max(1, len(dtypes)), figsize=(7 * max(1, len(dtypes)), 4.5), squeeze=False)
    impls = [name for name in IMPLEMENTATIONS if any(r["impl"] == name for r in results)]
    width = 0.8 / max(1, len(impls))
    for ax, dtype in zip(axes[0], dtypes):
        shapes = list(dict.fromkeys(Shape(**r["shape"]).label() for r in report["results"] if r["dtype"] == dtype))
        for i, name in enumerate(impls):
            ms = {Shape(**r["shape"]).label(): r["fwd_bwd_ms"] for r in results
                  if r["dtype"] == dtype and r["impl"] == name}
            xs = [j + (i - (len(impls) - 1) / 2) * width for j, label in enumerate(shapes) if label in ms]
            ax.bar(xs, [ms[label] for label in shapes if label in ms], width, label=name)
        ax.set_xticks(range(len(shapes)), [label.replace(" N=", "\nN=").replace(" H=", "\nH=") for label in shapes],
                      fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("forward + backward (ms)")
        ax.set_title(dtype)
        ax.grid(True, axis="y", alpha=0.3)
        if impls:
            ax.legend(fontsize=8)
    fig.suptitle(f"Evoformer attention on {report['device']}, median of {report['repeats']}"
                 + (" (--quick: a smoke test, not a measurement)" if report["quick"] else ""), fontsize=10)
    save_figure(fig, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small shapes (a smoke test of the command)")
    parser.add_argument("--dtypes", nargs="+", choices=("bf16", "fp16", "fp32"), default=list(DTYPES),
                        help="(default: %(default)s)")
    parser.add_argument("--impls", nargs="+", choices=IMPLEMENTATIONS, default=list(IMPLEMENTATIONS),
                        help="implementations to time where available (default: all)")
    parser.add_argument("--warmup", type=int, default=3, help="(default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=10, help="(default: %(default)s)")
    parser.add_argument("--trimul-sizes", nargs="+", type=int, default=[256, 512, 1024],
                        help="N of the triangle multiplicative update's rows (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 1
    if os.environ.get("TRITON_INTERPRET") == "1":
        print(INTERPRETED, file=sys.stderr)
        return 1
    import triton

    shapes = QUICK_SHAPES if args.quick else SHAPES
    results = []
    for shape in shapes:
        for dtype_name in args.dtypes:
            reference = _reference_output(shape, dtype_name)
            for name in args.impls:
                record = measure(name, shape, dtype_name, args.warmup, args.repeats, reference)
                logger.info("evoformer-speed: %s %s %s: %s", shape.label(), dtype_name, name,
                            {k: v for k, v in record.items() if k not in ("shape", "impl", "dtype")})
                results.append(record)
            del reference
            torch.cuda.empty_cache()
    report = {
        "device": torch.cuda.get_device_name(),
        "torch_version": torch.__version__,
        "triton_version": triton.__version__,
        "quick": bool(args.quick),
        "warmup": args.warmup,
        "repeats": args.repeats,
        "results": results,
    }
    from ds4sci.bench import trimul_rows  # imports torch and the models, as run() does

    sizes, c = ([64, 96], 32) if args.quick else (args.trimul_sizes, 128)
    report["triangle_update"] = trimul_rows.speed_rows(sizes, c, args.dtypes, args.warmup, args.repeats)
    markdown = _markdown(report) + "\n" + "\n".join(trimul_rows.speed_markdown(report["triangle_update"])) + "\n"
    write_files(args.out, "evoformer_speed", report, markdown, plot)
    # ds4sci's own failures fail the command; another package's kernel failing (say DeepSpeed's JIT build) is reported
    failed = [r for r in results + report["triangle_update"] if "error" in r and r["impl"].startswith("ds4sci")]
    return 1 if failed else 0
