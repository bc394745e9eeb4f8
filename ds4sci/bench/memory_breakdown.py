"""``ds4sci bench memory-breakdown``: the per-rank bytes of the two long-sequence memory items the
DeepSpeed4Science paper (Song et al. 2023, "DeepSpeed4Science Initiative", GenSLM section) singles out: the learned
position table's state and the attention mask.

Measured here, at small sizes on this machine, from the tensors ds4sci really allocates (``nbytes`` of every tensor,
exact), then compared with the closed forms the planner uses (:func:`ds4sci.planning.costs.position_table_bytes`,
:func:`ds4sci.planning.costs.mask_bytes`), which the report evaluates at the paper's sequence lengths:

- position table (learned, fp32): parameter, gradient and AdamW's two moments of ``S`` rows unpartitioned, ``S/P``
  with ds4sci's sequence-partitioned table (:func:`ds4sci.sequence.shard_positions`).
- attention mask of a packed-document batch, per policy: ``fp32 additive [S, S]`` (what a dense additive mask
  costs: the paper's 10 GB above 50K tokens), ``bool [S, S]`` built on the device
  (:func:`ds4sci.kernels.local_reference.attention_mask` below its threshold), ``bool [S, S]`` built on the CPU then
  moved (above the threshold), and ``none``: ds4sci's memory-efficient attention evaluates causality and document ids
  inside the kernel, holding only the ``[S]`` int64 document ids.

The position-table and bool-mask rows measure ds4sci's own modules (``LearnedPositionEmbedding`` with AdamW,
``attention_mask``); the fp32-additive and in-kernel rows are the sizes of the tensors those policies hold,
built here for comparison.
"""
from __future__ import annotations

import argparse

from ds4sci.bench.report import markdown_table
from ds4sci.bench.report import parse_int_list
from ds4sci.bench.report import save_figure
from ds4sci.bench.report import subplots
from ds4sci.bench.report import write_files
from ds4sci.planning.costs import MASK_POLICIES
from ds4sci.planning.costs import mask_bytes
from ds4sci.planning.costs import position_table_bytes

GIB = 2.0**30
PAPER_SEQ_LENS = (50_000, 100_000, 200_000, 500_000)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seq-lens", type=parse_int_list, default=(512, 1024, 2048), metavar="S,S,...",
                        help="sequence lengths measured here (default: 512,1024,2048)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size measured here (default: %(default)s)")
    parser.add_argument("--degree", type=int, default=4, help="sequence-parallel degree P (default: %(default)s)")
    parser.add_argument("--paper-hidden", type=int, default=8192,
                        help="hidden size for the paper-scale rows (GenSLM 25B: 8192) (default: %(default)s)")
    parser.add_argument("--paper-degree", type=int, default=16,
                        help="sequence-parallel degree for the paper-scale rows (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="S = 256, 512 (a smoke test)")


def measure_table(seq_len: int, hidden: int, degree: int) -> int:
    """Bytes of rank 0's position table after one AdamW step: parameter, gradient, optimizer state tensors."""
    import torch

    from ds4sci.models.genslm import LearnedPositionEmbedding
    from ds4sci.sequence import shard_positions

    table = LearnedPositionEmbedding(seq_len, hidden)
    if degree > 1:
        table.shard_(shard_positions(seq_len, 0, degree, "contiguous"))
    positions = shard_positions(seq_len, 0, degree, "contiguous")[None]
    table(positions).square().sum().backward()
    optimizer = torch.optim.AdamW(table.parameters())
    optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    return sum(t.nbytes for t in (table.weight, table.weight.grad, *state))


def measure_mask(policy: str, seq_len: int) -> dict[str, int]:
    """Bytes of the mask tensors ds4sci (or a dense additive mask) allocates for one packed-document window."""
    import torch

    from ds4sci.kernels.local_reference import attention_mask

    doc = (torch.arange(seq_len) * 4 // seq_len)[None]  # four documents
    if policy == "none (in-kernel)":
        return {"device": doc.nbytes, "host": 0}
    mask = attention_mask(seq_len, seq_len, q_doc=doc, k_doc=doc, causal=True, device="cpu", threshold=None)
    if policy == "fp32-additive":
        additive = torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, float("-inf"))
        return {"device": additive.nbytes, "host": 0}
    if policy == "bool-device":
        return {"device": mask.nbytes, "host": 0}
    return {"device": mask.clone().nbytes, "host": mask.nbytes}  # built on the CPU, then a device copy


def markdown(report: dict) -> str:
    c = report["config"]
    lines = ["# memory-breakdown: learned position table and attention mask, bytes per rank", "",
             f"Command: `{report['command']}`", "",
             f"## Measured here (hidden {c['hidden']}, P = {c['degree']}), beside the closed form", ""]
    rows = [[r["seq_len"], r["P"], r["measured"], r["formula"]] for r in report["table"]]
    lines += ["Position table (parameter + gradient + AdamW state, fp32):", ""]
    lines += markdown_table(["S", "P (rows S/P)", "measured bytes", "16 x rows x hidden"], rows)
    lines += ["", "Attention mask of one packed-document window:", ""]
    rows = [[r["seq_len"], r["policy"], r["measured"]["device"], r["measured"]["host"], r["formula"]["device"],
             r["formula"]["host"]] for r in report["masks"]]
    lines += markdown_table(["S", "policy", "device bytes", "host bytes", "formula device", "formula host"], rows)
    lines += ["", f"## At the paper's lengths (formula; hidden {c['paper_hidden']}, P = {c['paper_degree']}), GiB "
              "per rank", ""]
    rows = []
    for S in PAPER_SEQ_LENS:
        P = c["paper_degree"]
        rows.append([S, f"{position_table_bytes(S, c['paper_hidden']) / GIB:.1f}",
                     f"{position_table_bytes(S // P, c['paper_hidden']) / GIB:.2f}"]
                    + [f"{mask_bytes(p, S)['device'] / GIB:.3g}" for p in MASK_POLICIES])
    lines += markdown_table(["S", "table, unpartitioned", f"table, partitioned (S/{c['paper_degree']} rows)"]
                            + [f"mask: {p}" for p in MASK_POLICIES], rows)
    lines += ["", "The paper reports about 10 GB of mask above 50K tokens and 10 GB of position-table state above "
              "100K at its hidden size; ds4sci partitions the table over the sequence ranks and never builds a "
              "mask for causal or packed-document attention on its default path."]
    return "\n".join(lines) + "\n"


def plot(report: dict, path) -> None:
    """GiB per rank vs S at the paper's scale (formula), log-log."""
    import torch

    c = report["config"]
    S = [int(s) for s in torch.logspace(4, 6, 9).tolist()]
    fig, ax = subplots(figsize=(7, 5))
    ax.plot(S, [position_table_bytes(s, c["paper_hidden"]) / GIB for s in S], label="position table, unpartitioned")
    ax.plot(S, [position_table_bytes(s // c["paper_degree"], c["paper_hidden"]) / GIB for s in S],
            label=f"position table, partitioned (P = {c['paper_degree']})")
    for policy in MASK_POLICIES:
        ax.plot(S, [mask_bytes(policy, s)["device"] / GIB for s in S], linestyle="--", label=f"mask: {policy}")
    ax.axvline(50_000, color="gray", linewidth=0.5)
    ax.axvline(100_000, color="gray", linewidth=0.5)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("sequence length S (tokens)")
    ax.set_ylabel(f"GiB per rank (hidden {c['paper_hidden']}, formula checked here at small S)")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    seq_lens = (256, 512) if args.quick else args.seq_lens
    for value, name in ((args.hidden, "--hidden"), (args.degree, "--degree"), (args.paper_hidden, "--paper-hidden"),
                        (args.paper_degree, "--paper-degree")):
        if value < 1:
            raise ValueError(f"{name}={value}: must be >= 1")
    bad = [s for s in seq_lens if s % args.degree]
    if bad:
        raise ValueError(f"--seq-lens {bad}: must be multiples of --degree={args.degree}")
    command = "ds4sci bench memory-breakdown " + ("--quick" if args.quick else (
        f"--seq-lens {','.join(map(str, seq_lens))} --hidden {args.hidden} --degree {args.degree}")) + (
        f" --paper-hidden {args.paper_hidden} --paper-degree {args.paper_degree}")
    report = {"command": command,
              "config": {"seq_lens": list(seq_lens), "hidden": args.hidden, "degree": args.degree,
                         "paper_hidden": args.paper_hidden, "paper_degree": args.paper_degree},
              "table": [], "masks": []}
    for S in seq_lens:
        for P in (1, args.degree):
            report["table"].append({"seq_len": S, "P": P, "measured": measure_table(S, args.hidden, P),
                                    "formula": position_table_bytes(S // P, args.hidden)})
        for policy in MASK_POLICIES:
            report["masks"].append({"seq_len": S, "policy": policy, "measured": measure_mask(policy, S),
                                    "formula": mask_bytes(policy, S)})
    write_files(args.out, "memory_breakdown", report, markdown(report), plot)
    return 0
