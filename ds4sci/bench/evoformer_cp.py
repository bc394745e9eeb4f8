"""``ds4sci bench evoformer-cp``: bytes sent and memory per rank of Evoformer and Pairformer blocks under context
parallelism, axial (1-D) or on a p x p mesh (2-D), as N_res and the group size P grow, beside the closed forms.

For each P of ``--degrees``, P gloo processes (:func:`ds4sci.spawn.run_workers`; P = 1 is the single process) run,
per block kind and N_res, one training step (forward + backward of the sum of both outputs, fp32, dropout 0)
of a sharded stack of one and of two blocks (:func:`ds4sci.evoformer_context_parallel` with ``sharded=True``). A
:class:`~ds4sci.distributed.comm.CommCounter` records every collective; the bytes per block are the two-block stack's
minus the one-block stack's, so the stack's entry and exit cancel and what a block costs inside a long stack
remains (1-D: one switch between blocks is in; 2-D: nothing moves between blocks). They are set beside the
layout's closed form, per rank: :func:`ds4sci.parallel.evoformer.axial.block_comm_bytes` (every rank the same) and
:func:`ds4sci.parallel.evoformer.mesh2d.block_comm_bytes` (the ranks on the mesh's diagonal, first row and first
column move fewer tiles).

Memory per rank of one step of the one-block stack, counted by :class:`ds4sci.bench.memory.LiveTensors`: the bytes
saved for backward, the activations held from forward to backward and the peak of live tensors; parameters and
inputs are left out. The loss is the sum of the outputs, whose gradient is a broadcast view, so no loss head adds a
term that no P divides. Beside them the planner's figure (:func:`planned_peak`).

The pair terms: with N_res multiples of P each figure is a quadratic ``alpha N^2 + beta N + gamma`` at a fixed N_seq;
``alpha P`` (least squares over ``--n-res``, three or more) is constant where the pair terms fall as 1/P, and the
saved bytes' ``alpha`` is set beside the closed form of the ``N^2`` bytes per rank that do not fall as 1/P (1-D: the
gathered tensors; 2-D: the triangle attentions' key-mask rows), see :func:`pair_terms`.

Layouts: :data:`LAYOUTS` maps ``--layout`` to how a stack is made parallel and to its closed forms (``1d`` axial,
``2d`` the p x p mesh, ``--degrees`` squares). Writes ``evoformer_cp.json``, ``.md`` and ``.png`` to ``--out``.
"""
from __future__ import annotations

import argparse
import logging
import math
from pathlib import Path

from ds4sci.bench.report import MIB
from ds4sci.bench.report import check_positive
from ds4sci.bench.report import command_line
from ds4sci.bench.report import markdown_table
from ds4sci.bench.report import parse_int_list
from ds4sci.bench.report import save_figure
from ds4sci.bench.report import subplots
from ds4sci.bench.report import write_files

logger = logging.getLogger(__name__)

KINDS = ("evoformer", "pairformer")
COUNTED = ("all_gather", "reduce_scatter", "all_to_all", "p2p", "all_reduce")
KIB = 2.0**10
LAYOUT_NAMES = {"1d": "axial (1d)", "2d": "2-D mesh (2d)"}
MODULES = {"1d": "evoformer.axial", "2d": "evoformer.mesh2d"}
TRANSITION_N = 2  # the transitions' hidden factor (AlphaFold's 4, halved with the bench's small channels)
#: the memory figures per rank of a one-block stack's training step (:func:`_measure_memory`)
MEMORY = ("saved_bytes", "peak_bytes")


def _axial(blocks, counter):
    from ds4sci.parallel.evoformer import evoformer_context_parallel

    return evoformer_context_parallel(blocks, sharded=True, counter=counter)


def _axial_bytes(block, p: int, n_res: int, n_seq: int, rank: int) -> dict[str, int]:
    from ds4sci.parallel.evoformer.axial import block_comm_bytes

    return block_comm_bytes(block, p, n_res, n_seq)


def _axial_floor(block, p: int, itemsize: int = 4) -> float:
    """1-D: the gathered ``N^2`` tensors saved whole (module docstring), bytes per ``N_res^2``."""
    ps = block.pair_stack
    heads = (block.msa_att_row.no_heads if hasattr(block, "msa_att_row")
             else block.attn_pair_bias.linear_z.out_features)
    return float(itemsize * (heads + 2 * ps.tri_mul_out.c_hidden + 2 * ps.tri_att_start.no_heads)) if p > 1 else 0.0


def _mesh(blocks, counter):
    import torch.distributed as dist

    from ds4sci.parallel.evoformer import evoformer_context_parallel

    side = math.isqrt(dist.get_world_size()) if dist.is_initialized() else 1
    return evoformer_context_parallel(blocks, mesh=(side, side), sharded=True, counter=counter)


def _mesh_bytes(block, p: int, n_res: int, n_seq: int, rank: int) -> dict[str, int]:
    from ds4sci.parallel.evoformer.mesh2d import block_comm_bytes

    return block_comm_bytes(block, math.isqrt(p), n_res, n_seq, rank)


def _mesh_floor(block, p: int, itemsize: int = 4) -> float:
    """2-D: the triangle attentions' key-mask rows (module docstring), bytes per ``N_res^2``, Evoformer and
    Pairformer alike."""
    return itemsize * 2 / math.isqrt(p) if p > 1 else 0.0


#: ``--layout`` -> (make a stack parallel: ``(blocks, counter) -> module``, closed form of a rank's bytes per block
#: per collective kind: ``(block, P, n_res, n_seq, rank) -> dict``, closed form of the floor of the saved bytes'
#: ``N^2`` coefficient: ``(block, P) -> float``)
LAYOUTS = {"1d": (_axial, _axial_bytes, _axial_floor), "2d": (_mesh, _mesh_bytes, _mesh_floor)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The shape and run options (``--out`` is added by :mod:`ds4sci.bench`)."""
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="1d", help="(default: %(default)s)")
    parser.add_argument("--kinds", help="blocks measured, some of evoformer,pairformer (default: both)")
    parser.add_argument("--degrees", type=parse_int_list, metavar="P,P,...",
                        help="group sizes, 1 = the single process (default: 1d 1,2,4; 2d 1,4)")
    parser.add_argument("--n-res", type=parse_int_list, default=(16, 32, 64), metavar="N,N,...",
                        help="residues (tokens) N_res; three or more for the memory's N^2 fit (default: 16,32,64)")
    parser.add_argument("--n-seq", type=int, default=16, help="MSA depth N_seq of the Evoformer (default: %(default)s)")
    parser.add_argument("--c-m", type=int, default=32, help="C_m, also the Pairformer's C_s (default: %(default)s)")
    parser.add_argument("--c-z", type=int, default=16, help="C_z (default: %(default)s)")
    parser.add_argument("--c-hidden", type=int, default=8,
                        help="channels per head and of the outer product and triangle multiplications "
                             "(default: %(default)s)")
    parser.add_argument("--heads", type=int, default=4, help="heads of every attention (default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="P = 1, 2 (2d: 1, 4) at N_res 6, 9, N_seq 5 and channels of 4 to 8 (a smoke test)")


def _blocks(kind: str, cfg: dict, n_blocks: int):
    """``n_blocks`` blocks of ``kind`` (seeded, the same on every rank), fp32, dropout 0."""
    import torch
    from torch import nn

    from ds4sci.kernels import TriMulBackend
    from ds4sci.models.evoformer import EvoformerBlock
    from ds4sci.models.evoformer import PairformerBlock
    from ds4sci.models.evoformer import TriangleMultiplicativeUpdate

    torch.manual_seed(0)
    c, h = cfg["c_hidden"], cfg["heads"]

    def make():
        if kind == "evoformer":
            block = EvoformerBlock(cfg["c_m"], cfg["c_z"], c, c, c, c, h, h, TRANSITION_N, 0.0, 0.0,
                                   backend="torch")
        else:
            block = PairformerBlock(cfg["c_m"], cfg["c_z"], c, h, c, c, h, transition_n=TRANSITION_N,
                                    pair_dropout=0.0, backend="torch")
        # the triangle updates' torch path: a mesh rank saves both operand tiles of its Cannon products, which the
        # chunked default does not, and the 2-D peak ratio (tests/bench) was calibrated against this baseline
        for module in block.modules():
            if isinstance(module, TriangleMultiplicativeUpdate):
                module.backend = TriMulBackend.TORCH
        return block
    return nn.ModuleList(make() for _ in range(n_blocks))


def _inputs(kind: str, n_res: int, cfg: dict):
    import torch

    g = torch.Generator().manual_seed(1)
    x_shape = (1, cfg["n_seq"], n_res, cfg["c_m"]) if kind == "evoformer" else (1, n_res, cfg["c_m"])
    return torch.randn(*x_shape, generator=g), torch.randn(1, n_res, n_res, cfg["c_z"], generator=g)


def _loss(out_x, out_z):
    """The sum of both outputs: its gradient is a broadcast view of one number, so the loss allocates nothing of the
    outputs' size in backward (a loss head's memory is not the block's)."""
    return out_x.sum() + out_z.sum()


def _step(module, x, z):
    _loss(*module(x, z)).backward()


def _measure_memory(module, x, z) -> dict[str, int]:
    """One training step of ``module`` under :class:`~ds4sci.bench.memory.LiveTensors`: ``saved_bytes``, what
    autograd saves for backward in forward (unique storages), and ``peak_bytes``, the peak of live tensors over
    forward and backward. Both count what the step allocates: every tensor its ops return, the parameter gradients
    included (set to None first, so that they are allocated in the step; the same at any N_res); the parameters and
    the inputs, and views of them (the 1-D entry's pieces), are held before the step and left out."""
    from ds4sci.bench import memory

    module.zero_grad(set_to_none=True)
    before = {t.untyped_storage().data_ptr() for t in (*module.parameters(), x, z)}
    with memory.LiveTensors(before) as live:
        with memory.saved_for_backward() as saved:
            loss = _loss(*module(x, z))
        loss.backward()
        del loss
    return {"saved_bytes": sum(n for key, n in saved.storages.items() if key not in before), "peak_bytes": live.peak}


def _worker(rank: int, world: int, cfg: dict) -> list[dict]:
    """Per kind and N_res: this rank's bytes sent per collective kind by a one- and a two-block stack, and the memory
    of a training step of the one-block stack (:func:`_measure_memory`)."""
    from ds4sci.distributed.comm import CommCounter

    wrap = LAYOUTS[cfg["layout"]][0]
    rows = []
    for kind in cfg["kinds"]:
        for n_res in cfg["n_res"]:
            sent = {}
            for n_blocks in (2, 1):  # the one-block stack last: its module is the memory measurement's
                counter = CommCounter()
                module = wrap(_blocks(kind, cfg, n_blocks), counter)
                _step(module, *_inputs(kind, n_res, cfg))
                sent[n_blocks] = dict(counter.bytes_sent)
            rows.append({"kind": kind, "n_res": n_res, **_measure_memory(module, *_inputs(kind, n_res, cfg)),
                         "sent": {k: sent[2].get(k, 0) - sent[1].get(k, 0) for k in COUNTED}})
            del module
    return rows


def measure(cfg: dict, p: int) -> list[dict]:
    """``cfg``'s kinds and N_res at group size ``p``: per case, bytes sent per block (max over ranks, and rank 0's
    per collective kind), the closed form, and the bytes saved for backward (max over ranks)."""
    from ds4sci.spawn import run_workers

    per_rank = run_workers(_worker, p, cfg, timeout=600)
    closed_form = LAYOUTS[cfg["layout"]][1]
    rows = []
    for i, first in enumerate(per_rank[0]):
        cases = [r[i] for r in per_rank]
        block = _blocks(first["kind"], cfg, 1)[0]
        predicted = [{k: v for k, v in closed_form(block, p, first["n_res"], cfg["n_seq"], rank).items() if v}
                     if p > 1 else {} for rank in range(p)]
        sent = [{k: v for k, v in c["sent"].items() if v} for c in cases]
        rows.append({"kind": first["kind"], "P": p, "n_res": first["n_res"],
                     "n_seq": cfg["n_seq"] if first["kind"] == "evoformer" else None,
                     "sent_per_block": max(sum(c.values()) for c in sent),
                     "sent_per_block_min": min(sum(c.values()) for c in sent),
                     "predicted": max(sum(c.values()) for c in predicted),
                     "predicted_min": min(sum(c.values()) for c in predicted),
                     "sent_by_rank": sent, "predicted_by_rank": predicted,
                     **{k: max(c[k] for c in cases) for k in MEMORY},
                     **{f"{k}_by_rank": [c[k] for c in cases] for k in MEMORY},
                     "planned_peak": planned_peak(cfg, first["kind"], p, first["n_res"])})
    return rows


def planned_peak(cfg: dict, kind: str, p: int, n_res: int) -> float:
    """The planner's bytes per rank of one block's training step at ``cfg``'s shape:
    :func:`ds4sci.planning.evoformer.memory`'s ``block_saved + gathers + working + exit`` (its training terms less the
    checkpoints, which a stack without checkpointing does not keep), plus the block's parameter gradients in fp32
    (counted by the measurement too)."""
    from ds4sci.planning import evoformer as pe

    evoformer = kind == "evoformer"
    c, h = cfg["c_hidden"], cfg["heads"]
    shape = pe.EvoformerShape(kind, 1, cfg["c_m"], cfg["c_z"], c, h, c if evoformer else 0, c, c, h, TRANSITION_N,
                              "relu" if evoformer else "swiglu")
    w = pe.Workload(shape, n_res, cfg["n_seq"] if evoformer else 0, "fp32", "training",
                    layout=cfg["layout"] if p > 1 else "1", gpus=p)
    mem = pe.memory(w)
    gradients = 4 * sum(q.numel() for q in _blocks(kind, cfg, 1)[0].parameters())
    return mem.block_saved + mem.gathers + mem.working + mem.exit + gradients


def _n2_coefficient(n_res: list[int], values: list[float]) -> float:
    """``alpha`` of the least-squares ``alpha N^2 + beta N + gamma`` through ``(n_res, values)``."""
    import numpy as np

    n = np.array(n_res, dtype=float)
    return float(np.linalg.lstsq(np.stack([n * n, n, np.ones_like(n)], 1), np.array(values, dtype=float),
                                 rcond=None)[0][0])


def pair_terms(report: dict) -> list[dict]:
    """Per kind and P: the ``N^2`` coefficients ``alpha`` (least squares of ``alpha N^2 + beta N + gamma`` over the
    run's N_res) of the saved bytes, of the peak and of the planner's figure, each with ``alpha P``, and the closed
    form of the saved bytes' floor (module docstring); empty with fewer than three N_res."""
    cfg, rows = report["config"], []
    if len(cfg["n_res"]) < 3:
        return rows
    floor = LAYOUTS[cfg["layout"]][2]
    for kind in cfg["kinds"]:
        block = _blocks(kind, cfg, 1)[0]
        for p in cfg["degrees"]:
            runs = [r for r in report["runs"] if r["kind"] == kind and r["P"] == p]
            n = [r["n_res"] for r in runs]
            alpha = {k: _n2_coefficient(n, [r[k] for r in runs]) for k in ("saved_bytes", "peak_bytes", "planned_peak")}
            rows.append({"kind": kind, "P": p, "floor": floor(block, p),
                         **{f"{k}_alpha": a for k, a in alpha.items()},
                         **{f"{k}_alpha_times_P": a * p for k, a in alpha.items()}})
    return rows


def markdown(report: dict) -> str:
    c = report["config"]
    rows = []
    for r in report["runs"]:
        single = next((s for s in report["runs"] if (s["kind"], s["n_res"], s["P"]) == (r["kind"], r["n_res"], 1)),
                      None)
        rows.append((r["kind"], r["P"], r["n_res"], "-" if r["n_seq"] is None else r["n_seq"],
                     f"{r['sent_per_block'] / KIB:.1f}", f"{r['predicted'] / KIB:.1f}",
                     f"{r['saved_bytes'] / MIB:.2f}", f"{r['peak_bytes'] / MIB:.2f}", f"{r['planned_peak'] / MIB:.2f}",
                     f"{single['peak_bytes'] / max(r['peak_bytes'], 1):.2f}x" if single else "-"))
    lines = [
        f"# evoformer-cp: {LAYOUT_NAMES[c['layout']]} context parallelism, per rank, one training step, fp32",
        "",
        f"C_m = C_s = {c['c_m']}, C_z = {c['c_z']}, {c['heads']} heads, {c['c_hidden']} hidden channels; sent: "
        "bytes per block inside a sharded stack (a two-block stack's minus a one-block stack's), all collectives "
        f"of forward and backward including the parameter-gradient all-reduce, the most any rank sends; closed "
        f"form: ds4sci.parallel.{MODULES[c['layout']]}.block_comm_bytes (measured == closed form on every rank "
        f"and collective kind: {all(r['sent_by_rank'] == r['predicted_by_rank'] for r in report['runs'])}). "
        "Memory of a one-block stack's training step (loss: the sum of the outputs), the most on any rank, counted "
        "by ds4sci.bench.memory.LiveTensors (the tensors ops return; parameter gradients in, parameters and inputs "
        "out): saved, what autograd keeps for backward; peak, of the live tensors over forward and backward (vs "
        "P = 1: how much less); planner: ds4sci.planning.evoformer's block_saved + gathers + working + exit, plus the "
        "parameter gradients.",
        "",
        *markdown_table(("block", "P", "N_res", "N_seq", "sent/block (KiB)", "closed form (KiB)",
                         "saved/rank (MiB)", "peak/rank (MiB)", "planner (MiB)", "peak vs P=1"), rows),
    ]
    fitted = report.get("pair_terms") or []
    if fitted:
        lines += ["", "Pair terms: the N_res^2 coefficient alpha (bytes per N_res^2 per rank, fitted over the N_res "
                  "above) of the saved bytes, of the peak and of the planner's figure, times P (constant where they "
                  "fall as 1/P), and the closed form of the part of the saved bytes that does not fall as 1/P "
                  "(ds4sci.bench.evoformer_cp).", "",
                  *markdown_table(("block", "P", "saved alpha x P", "saved floor, closed form", "peak alpha x P",
                                   "planner alpha x P"),
                                  [(f["kind"], f["P"], f"{f['saved_bytes_alpha_times_P']:.0f}", f"{f['floor']:.1f}",
                                    f"{f['peak_bytes_alpha_times_P']:.0f}", f"{f['planned_peak_alpha_times_P']:.0f}")
                                   for f in fitted])]
    lines += ["", f"Command: `{report['command']}`"]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """Bytes sent per block (measured: markers; closed form: lines) and, per rank vs N_res, the saved bytes (dashed),
    the peak (solid) and the planner's figure (dotted), per P."""
    kinds = report["config"]["kinds"]
    fig, axes = subplots(2, len(kinds), figsize=(5.5 * len(kinds), 8), squeeze=False)
    for col, kind in enumerate(kinds):
        for p in report["config"]["degrees"]:
            runs = [r for r in report["runs"] if r["kind"] == kind and r["P"] == p]
            n = [r["n_res"] for r in runs]
            if p > 1:
                line, = axes[0][col].plot(n, [r["predicted"] / MIB for r in runs], label=f"P={p} closed form")
                axes[0][col].plot(n, [r["sent_per_block"] / MIB for r in runs], "o", color=line.get_color(),
                                  label=f"P={p} measured")
            line, = axes[1][col].plot(n, [r["peak_bytes"] / MIB for r in runs], "o-", label=f"P={p} peak")
            axes[1][col].plot(n, [r["saved_bytes"] / MIB for r in runs], "s--", color=line.get_color(),
                              label=f"P={p} saved")
            axes[1][col].plot(n, [r["planned_peak"] / MIB for r in runs], ":", color=line.get_color(),
                              label=f"P={p} planner")
        axes[0][col].set_title(f"{kind}: bytes sent per rank per block", fontsize=9)
        axes[1][col].set_title(f"{kind}: training step memory per rank", fontsize=9)
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xlabel("N_res")
            ax.set_ylabel("MiB")
            ax.legend(fontsize=7)
    save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    squares = args.layout == "2d"
    cfg = {"layout": args.layout,
           "kinds": list(KINDS) if args.kinds is None else [k.strip() for k in args.kinds.split(",")],
           "degrees": list(args.degrees or ((1, 4) if squares else (1, 2, 4))),
           "n_res": list(args.n_res), "n_seq": args.n_seq, "c_m": args.c_m, "c_z": args.c_z,
           "c_hidden": args.c_hidden, "heads": args.heads}
    if args.quick:
        cfg.update(degrees=[1, 4] if squares else [1, 2], n_res=[6, 9], n_seq=5, c_m=8, c_z=6, c_hidden=4, heads=2)
    bad = [k for k in cfg["kinds"] if k not in KINDS]
    if bad or not cfg["kinds"]:
        raise ValueError(f"--kinds={args.kinds}: expected some of {', '.join(KINDS)}")
    not_square = [p for p in cfg["degrees"] if math.isqrt(p) ** 2 != p]
    if squares and not_square:
        raise ValueError(f"--degrees={','.join(map(str, cfg['degrees']))}: the 2d layout runs p x p meshes, "
                         f"{not_square[0]} is not a square")
    check_positive(cfg, ("n_seq", "c_m", "c_z", "c_hidden", "heads"))
    report = {"config": cfg, "runs": [],
              "command": command_line("evoformer-cp", {k: ",".join(map(str, v)) if isinstance(v, list) else v
                                                       for k, v in cfg.items()}, args.out)}
    for p in cfg["degrees"]:
        report["runs"] += measure(cfg, p)
        logger.info("evoformer-cp: P=%d done", p)
    report["pair_terms"] = pair_terms(report)
    write_files(args.out, "evoformer_cp", report, markdown(report), plot)
    return 0
