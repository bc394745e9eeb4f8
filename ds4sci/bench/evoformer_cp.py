"""``ds4sci bench evoformer-cp``: bytes sent and memory per rank of Evoformer and Pairformer blocks under axial
context parallelism as N_res and the group size P grow, beside the closed forms.

For each P of ``--degrees``, P gloo processes (:func:`ds4sci.spawn.run_workers`; P = 1 is the single process) run,
per block kind and N_res, one training step (forward + backward of the mean square of both outputs, fp32, dropout 0)
of a sharded stack of one and of two blocks (:func:`ds4sci.evoformer_context_parallel` with ``sharded=True``). A
:class:`~ds4sci.sequence.CommCounter` records every collective; the bytes per block are the two-block stack's
minus the one-block stack's, so the stack's entry and exit cancel and one switch between blocks is in (what a block
costs inside a long stack). They are set beside :func:`ds4sci.parallel.evoformer_cp.block_comm_bytes`, whose
derivation is :mod:`ds4sci.parallel.evoformer_cp`'s docstring. Memory per rank, of the one-block stack: the bytes
autograd saves for backward (unique storages, :func:`ds4sci.bench.memory.saved_for_backward`): the activations a
training step holds from its forward to its backward. (A peak RSS is not reported: in a gloo worker that has run
the step before, the allocator reuses freed memory and the RSS barely moves at these sizes.)

Layouts: :data:`LAYOUTS` maps ``--layout`` to how a stack is made parallel and to its closed form; ``1d`` is the
axial layout. A 2-D layout adds its entry there (a wrapper taking ``(blocks, counter)`` and a closed form taking
``(block, P, n_res, n_seq)``); the measurement, report and figure are shared.

Writes ``evoformer_cp.json``, ``evoformer_cp.md`` and ``evoformer_cp.png`` to ``--out``.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from ds4sci.bench.report import MIB, check_positive, command_line, markdown_table, parse_int_list, pyplot, \
    save_figure, write_report

logger = logging.getLogger(__name__)

KINDS = ("evoformer", "pairformer")
COUNTED = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")
KIB = 2.0**10


def _axial(blocks, counter):
    from ds4sci.parallel.evoformer_cp import evoformer_context_parallel

    return evoformer_context_parallel(blocks, sharded=True, counter=counter)


def _axial_bytes(block, p: int, n_res: int, n_seq: int) -> dict[str, int]:
    from ds4sci.parallel.evoformer_cp import block_comm_bytes

    return block_comm_bytes(block, p, n_res, n_seq)


#: ``--layout`` -> (make a stack parallel: ``(blocks, counter) -> module``, closed form of the bytes per block per
#: collective kind: ``(block, P, n_res, n_seq) -> dict``)
LAYOUTS = {"1d": (_axial, _axial_bytes)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The shape and run options (``--out`` is added by :mod:`ds4sci.bench`)."""
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="1d", help="(default: %(default)s)")
    parser.add_argument("--kinds", default=",".join(KINDS), help="blocks measured (default: %(default)s)")
    parser.add_argument("--degrees", type=parse_int_list, default=(1, 2, 4), metavar="P,P,...",
                        help="group sizes, 1 = the single process (default: 1,2,4)")
    parser.add_argument("--n-res", type=parse_int_list, default=(16, 32, 64), metavar="N,N,...",
                        help="residues (tokens) N_res (default: 16,32,64)")
    parser.add_argument("--n-seq", type=int, default=16, help="MSA depth N_seq of the Evoformer (default: %(default)s)")
    parser.add_argument("--c-m", type=int, default=32, help="C_m, also the Pairformer's C_s (default: %(default)s)")
    parser.add_argument("--c-z", type=int, default=16, help="C_z (default: %(default)s)")
    parser.add_argument("--c-hidden", type=int, default=8,
                        help="channels per head and of the outer product and triangle multiplications "
                             "(default: %(default)s)")
    parser.add_argument("--heads", type=int, default=4, help="heads of every attention (default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="P = 1, 2 at N_res 6, 9, N_seq 5 and channels of 4 to 8 (a smoke test)")


def _blocks(kind: str, cfg: dict, n_blocks: int):
    """``n_blocks`` blocks of ``kind`` (seeded, the same on every rank), fp32, dropout 0."""
    import torch
    from torch import nn

    from ds4sci.models.evoformer import EvoformerBlock, PairformerBlock

    torch.manual_seed(0)
    c, h = cfg["c_hidden"], cfg["heads"]

    def make():
        if kind == "evoformer":
            return EvoformerBlock(cfg["c_m"], cfg["c_z"], c, c, c, c, h, h, 2, 0.0, 0.0, backend="torch")
        return PairformerBlock(cfg["c_m"], cfg["c_z"], c, h, c, c, h, transition_n=2, pair_dropout=0.0,
                               backend="torch")
    return nn.ModuleList(make() for _ in range(n_blocks))


def _inputs(kind: str, n_res: int, cfg: dict):
    import torch

    g = torch.Generator().manual_seed(1)
    x_shape = (1, cfg["n_seq"], n_res, cfg["c_m"]) if kind == "evoformer" else (1, n_res, cfg["c_m"])
    return torch.randn(*x_shape, generator=g), torch.randn(1, n_res, n_res, cfg["c_z"], generator=g)


def _step(module, x, z):
    out_x, out_z = module(x, z)
    (out_x.square().mean() + out_z.square().mean()).backward()


def _worker(rank: int, world: int, cfg: dict) -> list[dict]:
    """Per kind and N_res: this rank's bytes sent per collective kind by a one- and a two-block stack, and the bytes
    the one-block stack saves for backward."""
    from ds4sci.bench import memory
    from ds4sci.sequence import CommCounter

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
            x, z = _inputs(kind, n_res, cfg)
            with memory.saved_for_backward() as saved:
                out_x, out_z = module(x, z)
            (out_x.square().mean() + out_z.square().mean()).backward()
            rows.append({"kind": kind, "n_res": n_res, "saved_bytes": saved.bytes,
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
        predicted = closed_form(block, p, first["n_res"], cfg["n_seq"]) if p > 1 else dict.fromkeys(COUNTED, 0)
        rows.append({"kind": first["kind"], "P": p, "n_res": first["n_res"],
                     "n_seq": cfg["n_seq"] if first["kind"] == "evoformer" else None,
                     "sent_per_block": max(sum(c["sent"].values()) for c in cases),
                     "sent_per_block_min": min(sum(c["sent"].values()) for c in cases),
                     "sent_by_kind": first["sent"], "predicted": sum(predicted.values()),
                     "predicted_by_kind": predicted,
                     "saved_bytes": max(c["saved_bytes"] for c in cases)})
    return rows


def markdown(report: dict) -> str:
    c = report["config"]
    rows = []
    for r in report["runs"]:
        single = next((s for s in report["runs"] if (s["kind"], s["n_res"], s["P"]) == (r["kind"], r["n_res"], 1)),
                      None)
        rows.append((r["kind"], r["P"], r["n_res"], "-" if r["n_seq"] is None else r["n_seq"],
                     f"{r['sent_per_block'] / KIB:.1f}", f"{r['predicted'] / KIB:.1f}",
                     f"{r['saved_bytes'] / MIB:.2f}",
                     f"{single['saved_bytes'] / max(r['saved_bytes'], 1):.2f}x" if single else "-"))
    lines = [
        f"# evoformer-cp: axial context parallelism ({c['layout']}), per rank, one training step, fp32",
        "",
        f"C_m = C_s = {c['c_m']}, C_z = {c['c_z']}, {c['heads']} heads, {c['c_hidden']} hidden channels; sent: "
        "bytes per block inside a sharded stack (a two-block stack's minus a one-block stack's), all collectives "
        "of forward and backward including the parameter-gradient all-reduce; closed form: "
        "ds4sci.parallel.evoformer_cp.block_comm_bytes. Saved: what autograd keeps for backward in a one-block "
        "stack (vs P = 1: how much less).",
        "",
        *markdown_table(("block", "P", "N_res", "N_seq", "sent/block (KiB)", "closed form (KiB)",
                         "saved/rank (MiB)", "saved vs P=1"), rows),
        "",
        f"Command: `{report['command']}`",
    ]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """Bytes sent per block (measured: markers; closed form: lines) and saved bytes per rank vs N_res, per P."""
    plt = pyplot()
    kinds = report["config"]["kinds"]
    fig, axes = plt.subplots(2, len(kinds), figsize=(5.5 * len(kinds), 8), squeeze=False)
    for col, kind in enumerate(kinds):
        for p in report["config"]["degrees"]:
            runs = [r for r in report["runs"] if r["kind"] == kind and r["P"] == p]
            n = [r["n_res"] for r in runs]
            if p > 1:
                line, = axes[0][col].plot(n, [r["predicted"] / MIB for r in runs], label=f"P={p} closed form")
                axes[0][col].plot(n, [r["sent_per_block"] / MIB for r in runs], "o", color=line.get_color(),
                                  label=f"P={p} measured")
            axes[1][col].plot(n, [r["saved_bytes"] / MIB for r in runs], "o-", label=f"P={p}")
        axes[0][col].set_title(f"{kind}: bytes sent per rank per block", fontsize=9)
        axes[1][col].set_title(f"{kind}: saved for backward per rank", fontsize=9)
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xlabel("N_res")
            ax.set_ylabel("MiB")
            ax.legend(fontsize=7)
    save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    cfg = {"layout": args.layout, "kinds": [k.strip() for k in args.kinds.split(",")], "degrees": list(args.degrees),
           "n_res": list(args.n_res), "n_seq": args.n_seq, "c_m": args.c_m, "c_z": args.c_z,
           "c_hidden": args.c_hidden, "heads": args.heads}
    if args.quick:
        cfg.update(degrees=[1, 2], n_res=[6, 9], n_seq=5, c_m=8, c_z=6, c_hidden=4, heads=2)
    bad = [k for k in cfg["kinds"] if k not in KINDS]
    if bad or not cfg["kinds"]:
        raise ValueError(f"--kinds={args.kinds}: expected some of {', '.join(KINDS)}")
    check_positive(cfg, ("n_seq", "c_m", "c_z", "c_hidden", "heads"))
    report = {"config": cfg, "runs": [],
              "command": command_line("evoformer-cp", {k: ",".join(map(str, v)) if isinstance(v, list) else v
                                                       for k, v in cfg.items()}, args.out)}
    for p in cfg["degrees"]:
        report["runs"] += measure(cfg, p)
        logger.info("evoformer-cp: P=%d done", p)
    path = write_report(args.out, "evoformer_cp", report, markdown(report))
    plot(report, path.with_suffix(".png"))
    logger.info("evoformer-cp: wrote %s, %s and %s", path, path.with_suffix(".md"), path.with_suffix(".png"))
    return 0
