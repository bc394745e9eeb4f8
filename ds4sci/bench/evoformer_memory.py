"""``ds4sci bench evoformer-memory``: memory of Evoformer attention forward+backward per backend.

At OpenFold-like MSA row attention shapes (Jumper et al. 2021, Alg. 7; OpenFold's initial training uses
N_res = 256 crops, 8 heads of 32 channels) it measures, for the reference / torch (and triton on CUDA)
backends:

- bytes saved for backward: unique storages packed by autograd, counted with
  ``torch.autograd.graph.saved_tensors_hooks`` during the forward (q, k, v included);
- peak memory of one forward+backward above the memory held before it (inputs and the output gradient
  already allocated): on CUDA ``torch.cuda.max_memory_allocated``, on the CPU the peak RSS
  (``ru_maxrss``) of a fresh subprocess per backend, so one backend's allocations never hide another's;
- the max abs difference of the output and of every gradient (q, k, v, pair bias) against the reference.

Writes ``evoformer_memory.json`` and ``evoformer_memory.md`` to ``--out``. DeepSpeed4Science reports 13x lower
peak memory for OpenFold training with its fused kernel; the JSON records the ratios against that target.
"""
from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path

import torch

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
    storages: dict[int, int] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        storage = x.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        o = evoformer_attention(t["q"], t["k"], t["v"], [t["mask"], t["pair"]], backend=backend)
    o.backward(t["do"])
    results = {"o": o.detach()} | {f"d{name}": t[name].grad for name in _GRADS}
    return sum(storages.values()), results


def _peak_cuda(cfg: dict, backend: str) -> int:
    t = _inputs(cfg)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _fwd_bwd(t, backend)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def _proc_status_bytes(field: str) -> int:
    """A memory field (VmRSS, VmHWM) of /proc/self/status, in bytes (Linux)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"{field} not found in /proc/self/status")


def _worker(cfg: dict, backend: str) -> None:
    """Subprocess body: peak RSS above the RSS before one forward+backward (bytes), printed as JSON.

    Reads VmHWM from /proc/self/status after resetting it through /proc/self/clear_refs; ``ru_maxrss`` is not
    usable here because it survives fork+exec and so carries the parent's peak.
    """
    torch.set_num_threads(cfg["threads"])
    # Warm up at a tiny shape so lazily loaded kernels and libraries are not counted.
    _fwd_bwd(_inputs(cfg | {"batch": 1, "n_seq": 1, "n_res": 4, "heads": 1, "head_dim": 4}), backend)
    t = _inputs(cfg)
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # reset the peak-RSS high-water mark (VmHWM) to the current RSS
    before = _proc_status_bytes("VmRSS")
    _fwd_bwd(t, backend)
    print(json.dumps({"peak_bytes": _proc_status_bytes("VmHWM") - before}))


def _peak_cpu(cfg: dict, backend: str) -> int:
    code = f"import json; from ds4sci.bench.evoformer_memory import _worker; _worker(json.loads({json.dumps(json.dumps(cfg))}), {backend!r})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"evoformer-memory worker for backend {backend!r} failed:\n{proc.stderr}")
    return int(json.loads(proc.stdout.strip().splitlines()[-1])["peak_bytes"])


def _markdown(report: dict) -> str:
    cfg = report["config"]
    lines = [
        "# Evoformer attention memory (MSA row attention, forward + backward)",
        "",
        f"B={cfg['batch']}, N_seq={cfg['n_seq']}, N_res={cfg['n_res']}, H={cfg['heads']}, D={cfg['head_dim']}, "
        f"{cfg['dtype']} on {cfg['device']}; peak measured by {report['peak_method']}.",
        "",
        "| backend | saved for backward (MiB) | peak fwd+bwd (MiB) | peak vs reference | max abs diff vs reference |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, r in report["backends"].items():
        diff = max(r["max_abs_diff"].values())
        lines.append(
            f"| {name} | {r['saved_bytes'] / 2**20:.1f} | {r['peak_bytes'] / 2**20:.1f} | "
            f"{r['peak_ratio_vs_reference']:.1f}x lower | {diff:.2e} |"
        )
    lines += [
        "",
        f"Target: >= {report['target_peak_ratio']:.0f}x lower peak than the reference (DeepSpeed4Science, OpenFold "
        f"training). O and the gradients alone take {report['output_and_grad_bytes'] / 2**20:.1f} MiB, so no backend "
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
        "peak_method": "torch.cuda.max_memory_allocated" if on_cuda else "peak RSS delta, fresh subprocess",
        "target_peak_ratio": TARGET_PEAK_RATIO,
        "backends": {},
    }
    ref_results = None
    for backend in backends:
        saved, results = _saved_bytes_and_results(cfg, backend)
        if ref_results is None:
            ref_results = results
        diffs = {k: (results[k].double() - ref_results[k].double()).abs().max().item() for k in results}
        peak = _peak_cuda(cfg, backend) if on_cuda else _peak_cpu(cfg, backend)
        report["backends"][backend] = {"saved_bytes": saved, "peak_bytes": peak, "max_abs_diff": diffs}
        logger.info("evoformer-memory %s: saved %.1f MiB, peak %.1f MiB", backend, saved / 2**20, peak / 2**20)
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
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "evoformer_memory.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "evoformer_memory.md").write_text(_markdown(report))
    logger.info("evoformer-memory: wrote %s", out / "evoformer_memory.json")
    return 0
