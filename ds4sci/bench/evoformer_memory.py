"""``ds4sci bench evoformer-memory``: memory of Evoformer attention forward+backward per backend.

At OpenFold-like MSA row attention shapes (Jumper et al. 2021, Alg. 7; OpenFold's initial training uses
N_res = 256 crops, 8 heads of 32 channels) it measures, for the reference / torch (and triton on CUDA)
backends:

- bytes saved for backward: unique storages packed by autograd, counted with
  ``torch.autograd.graph.saved_tensors_hooks`` during the forward (q, k, v included);
- peak memory of one forward+backward above the memory held before it (inputs and the output gradient
  already allocated): on CUDA ``torch.cuda.max_memory_allocated``, on the CPU the peak RSS (``VmHWM - VmRSS``)
  of a fresh subprocess per backend, so one backend's allocations never hide another's (both measured by
  :mod:`ds4sci.bench.memory`);
- the max abs difference of the output and of every gradient (q, k, v, pair bias) against the reference.

Writes ``evoformer_memory.json`` and ``evoformer_memory.md`` to ``--out``. DeepSpeed4Science reports 13x lower
peak memory for OpenFold training with its fused kernel; the JSON records the ratios against that target.
"""
from __future__ import annotations

import argparse
import logging

import torch

from ds4sci.bench import memory
from ds4sci.bench.report import MIB, markdown_table, write_report
from ds4sci.kernels import evoformer_attention

logger = logging.getLogger(__name__)

TARGET_PEAK_RATIO = 13.0  # DeepSpeed4Science's headline for OpenFold training
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_GRADS = ("q", "k", "v", "pair")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=1, help="B (default: %(default)s)")
    parser.add_argument("--n-seq", type=int, default=128, help="MSA depth N_seq = N (default: %(default)s)")
    parser.add_argument("--n-res", type=int, default=256, help="residues N_res = S (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=8, help="H (default: %(default)s)")
    parser.add_argument("--head-dim", type=int, default=32, help="D (default: %(default)s)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32", help="(default: %(default)s)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="smoke-test shapes (N_seq=16, N_res=128, H=4, D=16), runs in seconds")


def _shape(cfg: dict) -> tuple[int, int, int, int, int]:
    return cfg["batch"], cfg["n_seq"], cfg["n_res"], cfg["heads"], cfg["head_dim"]


def _inputs(cfg: dict) -> dict[str, torch.Tensor]:
    """q, k, v ``[B, N_seq, N_res, H, D]``, an OpenFold mask bias ``[B, N_seq, 1, 1, N_res]`` (no grad, last
    eighth of the residues padded with -1e9) and a learned pair bias ``[B, 1, H, N_res, N_res]``; plus dO."""
    b, n, s, h, d = _shape(cfg)
    dtype, device = _DTYPES[cfg["dtype"]], torch.device(cfg["device"])
    g = torch.Generator().manual_seed(cfg["seed"])
    t = {name: torch.randn(b, n, s, h, d, generator=g).to(device, dtype) for name in ("q", "k", "v", "do")}
    keep = torch.ones(b, n, s)
    keep[..., s - s // 8:] = 0
    t["mask"] = (1e9 * (keep - 1))[:, :, None, None, :].to(device, dtype)
    t["pair"] = torch.randn(b, 1, h, s, s, generator=g).to(device, dtype)
    for name in _GRADS:
        t[name].requires_grad_(True)
    return t


def _fwd_bwd(t: dict[str, torch.Tensor], backend: str) -> torch.Tensor:
    o = evoformer_attention(t["q"], t["k"], t["v"], [t["mask"], t["pair"]], backend=backend)
    o.backward(t["do"])
    return o


def _saved_bytes_and_results(cfg: dict, backend: str) -> tuple[int, dict[str, torch.Tensor]]:
    """Bytes of the unique storages autograd saves in the forward, and the output and gradients."""
    t = _inputs(cfg)
    with memory.saved_for_backward() as saved:
        o = evoformer_attention(t["q"], t["k"], t["v"], [t["mask"], t["pair"]], backend=backend)
    o.backward(t["do"])
    results = {"o": o.detach()} | {f"d{name}": t[name].grad for name in _GRADS}
    return saved.bytes, results


def peak_bytes(cfg: dict, backend: str) -> int:
    """Peak memory of one forward+backward of ``backend`` above the memory held before it (bytes), in this
    process: after a warm-up at a tiny shape, so lazily loaded kernels and libraries are not counted. On the CPU
    :func:`run` calls it in a fresh subprocess per backend."""
    torch.set_num_threads(cfg["threads"])
    _fwd_bwd(_inputs(cfg | {"batch": 1, "n_seq": 1, "n_res": 4, "heads": 1, "head_dim": 4}), backend)
    t = _inputs(cfg)
    with memory.PeakMemory(cfg["device"]) as peak:
        _fwd_bwd(t, backend)
    return peak.bytes


def _peak(cfg: dict, backend: str) -> int:
    if torch.device(cfg["device"]).type == "cuda":
        return peak_bytes(cfg, backend)
    return int(memory.run_in_subprocess(f"{__name__}:peak_bytes", cfg, backend))


def _markdown(report: dict) -> str:
    cfg = report["config"]
    rows = [
        (name, f"{r['saved_bytes'] / MIB:.1f}", f"{r['peak_bytes'] / MIB:.1f}",
         f"{r['peak_ratio_vs_reference']:.1f}x lower", f"{max(r['max_abs_diff'].values()):.2e}")
        for name, r in report["backends"].items()
    ]
    lines = [
        "# Evoformer attention memory (MSA row attention, forward + backward)",
        "",
        f"B={cfg['batch']}, N_seq={cfg['n_seq']}, N_res={cfg['n_res']}, H={cfg['heads']}, D={cfg['head_dim']}, "
        f"{cfg['dtype']} on {cfg['device']}; peak measured by {report['peak_method']}. "
        f"{memory.describe_allocator(report['allocator'])}",
        "",
        *markdown_table(("backend", "saved for backward (MiB)", "peak fwd+bwd (MiB)", "peak vs reference",
                         "max abs diff vs reference"), rows),
        "",
        f"Target: >= {report['target_peak_ratio']:.0f}x lower peak than the reference (DeepSpeed4Science, OpenFold "
        f"training). O and the gradients alone take {report['output_and_grad_bytes'] / MIB:.1f} MiB, so no backend "
        f"can be more than {report['best_possible_peak_ratio']:.1f}x lower at this shape; the ratio grows with "
        "N_res / D.",
    ]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    cfg = {
        "batch": args.batch, "n_seq": args.n_seq, "n_res": args.n_res, "heads": args.heads,
        "head_dim": args.head_dim, "dtype": args.dtype, "device": args.device, "seed": args.seed,
        "threads": torch.get_num_threads(),
    }
    if args.quick:
        cfg.update(n_seq=16, n_res=128, heads=4, head_dim=16)
    on_cuda = torch.device(cfg["device"]).type == "cuda"
    backends = ["reference", "torch"] + (["triton"] if on_cuda else [])
    report: dict = {
        "config": cfg,
        "peak_method": memory.peak_method(cfg["device"]),
        "allocator": memory.allocator_settings(),
        "target_peak_ratio": TARGET_PEAK_RATIO,
        "backends": {},
    }
    ref_results = None
    for backend in backends:
        saved, results = _saved_bytes_and_results(cfg, backend)
        if ref_results is None:
            ref_results = results
        diffs = {k: (results[k].double() - ref_results[k].double()).abs().max().item() for k in results}
        peak = _peak(cfg, backend)
        report["backends"][backend] = {"saved_bytes": saved, "peak_bytes": peak, "max_abs_diff": diffs}
        logger.info("evoformer-memory %s: saved %.1f MiB, peak %.1f MiB", backend, saved / MIB, peak / MIB)
    ref = report["backends"]["reference"]
    # What any backend must hold at the end of forward+backward: O, dQ, dK, dV and the pair-bias gradient.
    b, n, s, h, d = _shape(cfg)
    elem = torch.finfo(_DTYPES[cfg["dtype"]]).bits // 8
    report["output_and_grad_bytes"] = (4 * b * n * s * h * d + b * h * s * s) * elem
    report["best_possible_peak_ratio"] = ref["peak_bytes"] / report["output_and_grad_bytes"]
    for r in report["backends"].values():
        r["peak_ratio_vs_reference"] = ref["peak_bytes"] / max(r["peak_bytes"], 1)
        r["saved_ratio_vs_reference"] = ref["saved_bytes"] / max(r["saved_bytes"], 1)
        r["meets_target"] = r["peak_ratio_vs_reference"] >= TARGET_PEAK_RATIO
    path = write_report(args.out, "evoformer_memory", report, _markdown(report))
    logger.info("evoformer-memory: wrote %s", path)
    return 0
