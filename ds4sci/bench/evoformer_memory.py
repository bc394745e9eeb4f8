"""``ds4sci bench evoformer-memory``: memory of Evoformer attention forward+backward per backend.

At OpenFold-like MSA row attention shapes (Jumper et al. 2021, Alg. 7; N_res = 256 crops, 8 heads of 32 channels)
it measures, for the reference / torch (and triton on CUDA) backends:

- bytes saved for backward (:func:`ds4sci.bench.memory.saved_for_backward`, q, k, v included);
- peak memory of one forward+backward above what is held before it (:class:`ds4sci.bench.memory.PeakMemory`, one
  fresh subprocess per backend on the CPU, so one backend's allocations never hide another's);
- the max abs difference of the output and of every gradient from the reference run in float64 on the same inputs
  (:func:`fp64_reference`): the error of each path itself, the fp32 reference's included.

When OpenFold3 is importable, its own attention paths run the same inputs in its layout ``[B, N_seq, H, N_res, D]``
with queries pre-scaled, as its ``Attention.forward`` does: ``openfold3-default`` (the plain path),
``openfold3-chunked`` (``attention_chunked_trainable`` over ``--openfold-chunk`` MSA rows, each chunk recomputed in
backward) and ``openfold3-lma`` (its low-memory attention, Rabe & Staats 2021, ``--lma-chunk`` queries per block and
OpenFold3's default key block). Otherwise, or with ``--no-openfold``, the report says why they are missing.

The triangle multiplicative update's rows (:mod:`ds4sci.bench.trimul_rows`: bytes saved for backward and the
inference peak of one outgoing update, torch and chunked backends (and triton on CUDA), at ``--trimul-n`` and
``--trimul-c``, in the report's ``triangle_update``) follow the attention table.

Writes ``evoformer_memory.json``, ``.md`` and ``.png`` (saved and peak bytes per path) to ``--out``.
DeepSpeed4Science reports 13x lower peak memory for OpenFold training with its fused kernel; the JSON records the
ratios against that target.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ds4sci.bench.report import MIB
from ds4sci.bench.report import check_positive
from ds4sci.bench.report import markdown_table
from ds4sci.bench.report import missing_dependency
from ds4sci.bench.report import save_figure
from ds4sci.bench.report import subplots
from ds4sci.bench.report import write_files

if TYPE_CHECKING:  # imported where used: ``ds4sci bench evoformer-memory --help`` imports no torch
    import torch

logger = logging.getLogger(__name__)

TARGET_PEAK_RATIO = 13.0  # DeepSpeed4Science's headline for OpenFold training
_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # --dtype -> the torch dtype's name
_GRADS = ("q", "k", "v", "pair")
OPENFOLD_PATHS = ("openfold3-default", "openfold3-chunked", "openfold3-lma")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=1, help="B (default: %(default)s)")
    parser.add_argument("--n-seq", type=int, default=128, help="MSA depth N_seq = N (default: %(default)s)")
    parser.add_argument("--n-res", type=int, default=256, help="residues N_res = S (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=8, help="H (default: %(default)s)")
    parser.add_argument("--head-dim", type=int, default=32, help="D (default: %(default)s)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32", help="(default: %(default)s)")
    parser.add_argument("--device", help="(default: cuda when it is available, else cpu)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the random inputs and weights (default: %(default)s)")
    parser.add_argument("--trimul-n", type=int, default=64,
                        help="N of the triangle multiplicative update's rows (default: %(default)s)")
    parser.add_argument("--trimul-c", type=int, default=32,
                        help="c_z = c_hidden of the triangle multiplicative update's rows (default: %(default)s)")
    parser.add_argument("--openfold-chunk", type=int, default=4,
                        help="MSA rows per chunk of OpenFold3's chunked path (default: %(default)s)")
    parser.add_argument("--lma-chunk", type=int, default=64,
                        help="queries per block of OpenFold3's LMA path (default: %(default)s)")
    parser.add_argument("--no-openfold", action="store_true", help="leave out OpenFold3's paths")
    parser.add_argument("--quick", action="store_true",
                        help="smoke-test shapes (N_seq=16, N_res=128, H=4, D=16), runs in seconds")


def _shape(cfg: dict) -> tuple[int, int, int, int, int]:
    return cfg["batch"], cfg["n_seq"], cfg["n_res"], cfg["heads"], cfg["head_dim"]


def _inputs(cfg: dict) -> dict[str, torch.Tensor]:
    """q, k, v ``[B, N_seq, N_res, H, D]``, an OpenFold mask bias ``[B, N_seq, 1, 1, N_res]`` (no grad, last
    eighth of the residues padded with -1e9) and a learned pair bias ``[B, 1, H, N_res, N_res]``; plus dO."""
    import torch

    b, n, s, h, d = _shape(cfg)
    dtype, device = getattr(torch, _DTYPES[cfg["dtype"]]), torch.device(cfg["device"])
    g = torch.Generator().manual_seed(cfg["seed"])
    t = {name: torch.randn(b, n, s, h, d, generator=g).to(device, dtype) for name in ("q", "k", "v", "do")}
    keep = torch.ones(b, n, s)
    keep[..., s - s // 8:] = 0
    t["mask"] = (1e9 * (keep - 1))[:, :, None, None, :].to(device, dtype)
    t["pair"] = torch.randn(b, 1, h, s, s, generator=g).to(device, dtype)
    for name in _GRADS:
        t[name].requires_grad_(True)
    return t


def openfold3_missing() -> str | None:
    """Why OpenFold3's attention functions cannot be imported here, or None when they can."""
    return missing_dependency("openfold3.core.model.primitives.attention",
                              "OpenFold3 is not importable ({err}); pip install 'ds4sci[openfold]' adds its paths")


@contextlib.contextmanager
def _quiet_openfold() -> Iterator[None]:
    """OpenFold3's ``_attention`` enters ``torch.amp.autocast("cuda")``, which warns on a machine without CUDA (also
    when a checkpointed chunk is recomputed in backward)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="CUDA is not available", category=UserWarning)
        warnings.filterwarnings("ignore", message=".*use_reentrant", category=UserWarning)
        yield


def _attend(t: dict[str, torch.Tensor], path: str, cfg: dict) -> torch.Tensor:
    """O ``[B, N_seq, N_res, H, D]`` of ``path``: a ds4sci backend or one of :data:`OPENFOLD_PATHS`."""
    from ds4sci.kernels import evoformer_attention

    biases = [t["mask"], t["pair"]]
    if path not in OPENFOLD_PATHS:
        return evoformer_attention(t["q"], t["k"], t["v"], biases, backend=path)
    from openfold3.core.model.primitives import attention as of3

    # OpenFold3's layout [B, N_seq, H, N_res, D], queries scaled by 1/sqrt(D) as in Attention._prep_qkv
    q, k, v = (x.transpose(-2, -3) for x in (t["q"] * t["q"].shape[-1] ** -0.5, t["k"], t["v"]))
    if path == "openfold3-chunked":  # chunks along N_seq (dim -4); returns [B, N_seq, N_res, H, D]
        return of3.attention_chunked_trainable(q, k, v, biases, chunk_size=cfg["openfold_chunk"], chunk_dim=-4,
                                               checkpoint=True)
    if path == "openfold3-lma":  # as Attention.forward: biases expanded to [..., N_res, N_res]
        full = [b.expand(*b.shape[:-2], q.shape[-2], k.shape[-2]) for b in biases]
        o = of3._lma(q, k, v, full, cfg["lma_chunk"], of3.DEFAULT_LMA_KV_CHUNK_SIZE)  # [B, N_seq, H, N_res, D]
        return o.transpose(-2, -3)
    return of3._attention(q, k, v, biases).transpose(-2, -3)  # [B, N_seq, H, N_res, D] -> [B, N_seq, N_res, H, D]


def _fwd_bwd(t: dict[str, torch.Tensor], path: str, cfg: dict) -> torch.Tensor:
    o = _attend(t, path, cfg)
    o.backward(t["do"])
    return o


def _results(o: torch.Tensor, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The output ``o`` ``[B, N_seq, N_res, H, D]`` (detached) and the gradients ``dq, dk, dv`` (o's shape) and
    ``dpair`` ``[B, 1, H, N_res, N_res]`` left in ``t`` by the backward."""
    return {"o": o.detach()} | {f"d{name}": t[name].grad for name in _GRADS}


def saved_bytes_and_results(cfg: dict, backend: str) -> tuple[int, dict[str, torch.Tensor]]:
    """Bytes of the unique storages autograd saves in the forward of ``backend`` (a ds4sci backend or one of
    :data:`OPENFOLD_PATHS`) at ``cfg``'s shape, and the output ``o`` and gradients ``dq, dk, dv, dpair``."""
    from ds4sci.bench import memory

    t = _inputs(cfg)
    with _quiet_openfold():
        with memory.saved_for_backward() as saved:
            o = _attend(t, backend, cfg)
        o.backward(t["do"])
    return saved.bytes, _results(o, t)


def fp64_reference(cfg: dict) -> dict[str, torch.Tensor]:
    """``o, dq, dk, dv, dpair`` of the reference backend in float64 on ``cfg``'s inputs (those of every path, in
    ``cfg``'s dtype, then converted exactly to float64): what each path's max abs difference is measured from."""
    t = {name: x.detach().double().requires_grad_(x.requires_grad) for name, x in _inputs(cfg).items()}
    o = _attend(t, "reference", cfg)
    o.backward(t["do"])
    return _results(o, t)


def peak_ratio_cell(name: str, ratio: float) -> str:
    """The "peak vs reference" cell of path ``name`` whose peak is ``ratio`` times below the reference's: ``"-"``
    for the reference itself and where the reference's peak is 0 (too small to measure: ratio 0), ``"9.7x lower"``,
    ``"1.3x higher"`` (ratio < 1), ``"same"`` (within 5%)."""
    if name == "reference" or ratio <= 0:
        return "-"
    if abs(ratio - 1) < 0.05:
        return "same"
    return f"{ratio:.1f}x lower" if ratio > 1 else f"{1 / ratio:.1f}x higher"


def peak_bytes(cfg: dict, backend: str) -> int:
    """Peak memory of one forward+backward of ``backend`` above the memory held before it (bytes), in this
    process: after a warm-up at a tiny shape, so lazily loaded kernels and libraries are not counted. On the CPU
    :func:`run` calls it in a fresh subprocess per backend."""
    import torch

    from ds4sci.bench import memory

    torch.set_num_threads(cfg["threads"])
    with _quiet_openfold():
        _fwd_bwd(_inputs(cfg | {"batch": 1, "n_seq": 1, "n_res": 4, "heads": 1, "head_dim": 4}), backend, cfg)
        t = _inputs(cfg)
        with memory.PeakMemory(cfg["device"]) as peak:
            _fwd_bwd(t, backend, cfg)
    return peak.bytes


def _peak(cfg: dict, backend: str) -> int:
    import torch

    from ds4sci.bench import memory

    if torch.device(cfg["device"]).type == "cuda":
        return peak_bytes(cfg, backend)
    return int(memory.run_in_subprocess(f"{__name__}:peak_bytes", cfg, backend))


def _markdown(report: dict) -> str:
    from ds4sci.bench import memory
    from ds4sci.bench import trimul_rows

    cfg = report["config"]
    rows = [
        (name, f"{r['saved_bytes'] / MIB:.1f}", f"{r['peak_bytes'] / MIB:.1f}",
         peak_ratio_cell(name, r["peak_ratio_vs_reference"]), f"{max(r['max_abs_diff'].values()):.1e}")
        for name, r in (report["backends"] | report["openfold3"]).items()
    ]
    lines = [
        "# Evoformer attention memory (MSA row attention, forward + backward)",
        "",
        f"B={cfg['batch']}, N_seq={cfg['n_seq']}, N_res={cfg['n_res']}, H={cfg['heads']}, D={cfg['head_dim']}, "
        f"{cfg['dtype']} on {cfg['device']}; peak measured by {report['peak_method']}. "
        f"{memory.describe_allocator(report['allocator'])}",
        "",
        *markdown_table(("path", "saved for backward (MiB)", "peak fwd+bwd (MiB)", "peak vs reference",
                         "max abs diff vs fp64 reference"), rows),
        "",
        f"Max abs diff: {report['max_abs_diff_from']}; the largest over o, dq, dk, dv and dpair.",
        "",
        f"Target: >= {report['target_peak_ratio']:.0f}x lower peak than the reference (DeepSpeed4Science, OpenFold "
        f"training). O and the gradients alone take {report['output_and_grad_bytes'] / MIB:.1f} MiB, so no backend "
        f"can be more than {report['best_possible_peak_ratio']:.1f}x lower at this shape; the ratio grows with "
        "N_res / D.",
        "",
        f"OpenFold3's paths: {report['openfold3_paths']}",
        "",
        *trimul_rows.memory_markdown(report["triangle_update"], cfg["trimul_n"], cfg["trimul_c"], cfg["dtype"]),
    ]
    return "\n".join(lines) + "\n"


def plot(report: dict, path) -> None:
    """Bars of the bytes saved for backward and of the peak of forward+backward per path (MiB)."""
    rows = report["backends"] | report["openfold3"]
    x = range(len(rows))
    fig, ax = subplots(figsize=(max(6, 1.4 * len(rows)), 4.5))
    ax.bar([i - 0.2 for i in x], [r["saved_bytes"] / MIB for r in rows.values()], 0.4, label="saved for backward")
    ax.bar([i + 0.2 for i in x], [r["peak_bytes"] / MIB for r in rows.values()], 0.4, label="peak fwd+bwd")
    ax.set_xticks(list(x), list(rows), rotation=15)
    ax.set_ylabel("MiB")
    c = report["config"]
    ax.set_title(f"Evoformer MSA row attention, N_seq={c['n_seq']}, N_res={c['n_res']}, H={c['heads']}, "
                 f"D={c['head_dim']}, {c['dtype']} on {c['device']}", fontsize=9)
    ax.legend()
    save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    import torch

    from ds4sci.bench import memory
    from ds4sci.bench import trimul_rows

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = {
        "batch": args.batch, "n_seq": args.n_seq, "n_res": args.n_res, "heads": args.heads,
        "head_dim": args.head_dim, "dtype": args.dtype, "device": device, "seed": args.seed,
        "threads": torch.get_num_threads(), "openfold_chunk": args.openfold_chunk, "lma_chunk": args.lma_chunk,
        "trimul_n": args.trimul_n, "trimul_c": args.trimul_c,
    }
    if args.quick:
        cfg.update(n_seq=16, n_res=128, heads=4, head_dim=16)
    on_cuda = torch.device(cfg["device"]).type == "cuda"
    check_positive(cfg, ("batch", "n_seq", "n_res", "heads", "head_dim", "openfold_chunk", "lma_chunk", "trimul_n",
                         "trimul_c"))
    backends = ["reference", "torch"] + (["triton"] if on_cuda else [])
    missing = "left out (--no-openfold)" if args.no_openfold else openfold3_missing()
    report: dict = {
        "config": cfg,
        "peak_method": memory.peak_method(cfg["device"]),
        "allocator": memory.allocator_settings(),
        "target_peak_ratio": TARGET_PEAK_RATIO,
        "backends": {},
        "openfold3": {},
        "openfold3_paths": missing or (
            "default = _attention; chunked = attention_chunked_trainable over N_seq, "
            f"{cfg['openfold_chunk']} rows per chunk, checkpoint=True; LMA = _lma, {cfg['lma_chunk']} queries x "
            "DEFAULT_LMA_KV_CHUNK_SIZE keys per block (openfold3.core.model.primitives.attention). LMA still saves "
            "every block's probabilities for backward: it saves memory in inference only."),
    }
    exact = fp64_reference(cfg)
    report["max_abs_diff_from"] = ("the reference backend in float64 on the same inputs (converted exactly from "
                                   f"{cfg['dtype']})")
    for backend in backends + ([] if missing else list(OPENFOLD_PATHS)):
        saved, results = saved_bytes_and_results(cfg, backend)
        diffs = {k: (results[k].double() - exact[k]).abs().max().item() for k in results}
        peak = _peak(cfg, backend)
        section = report["openfold3" if backend in OPENFOLD_PATHS else "backends"]
        section[backend] = {"saved_bytes": saved, "peak_bytes": peak, "max_abs_diff": diffs}
        logger.info("evoformer-memory %s: saved %.1f MiB, peak %.1f MiB", backend, saved / MIB, peak / MIB)
    ref = report["backends"]["reference"]
    # What any backend must hold at the end of forward+backward: O, dQ, dK, dV and the pair-bias gradient.
    b, n, s, h, d = _shape(cfg)
    elem = torch.finfo(getattr(torch, _DTYPES[cfg["dtype"]])).bits // 8
    report["output_and_grad_bytes"] = (4 * b * n * s * h * d + b * h * s * s) * elem
    report["best_possible_peak_ratio"] = ref["peak_bytes"] / report["output_and_grad_bytes"]
    for r in (report["backends"] | report["openfold3"]).values():
        r["peak_ratio_vs_reference"] = ref["peak_bytes"] / max(r["peak_bytes"], 1)
        r["saved_ratio_vs_reference"] = ref["saved_bytes"] / max(r["saved_bytes"], 1)
        r["meets_target"] = r["peak_ratio_vs_reference"] >= TARGET_PEAK_RATIO
    report["triangle_update"] = trimul_rows.memory_rows(cfg["trimul_n"], cfg["trimul_c"], cfg["dtype"], cfg["device"],
                                                        cfg["seed"])
    write_files(args.out, "evoformer_memory", report, _markdown(report), plot)
    return 0
