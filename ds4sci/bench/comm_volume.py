"""``ds4sci bench comm-volume``: bytes each rank sends per GenSLM layer under sequence and tensor parallelism,
beside the closed forms of :func:`ds4sci.planning.costs.layer_comm_bytes`, which the planner uses.

For each degree ``P``, ``P`` gloo processes (:func:`ds4sci.spawn.run_workers`) run, scheme after scheme, one
training step (forward + backward) of a GenSLM made sequence- or tensor-parallel by
:func:`~ds4sci.parallel.parallelize.parallelize`, with the sequence growing with ``P`` (``N = tokens_per_rank * P``).
A :class:`~ds4sci.distributed.comm.CommCounter` records the bytes every collective call sends; the figure per layer is
the difference between a 2-layer and a 1-layer model, so embedding, head and loss traffic cannot leak in.

Schemes (the closed forms and their derivations: :mod:`ds4sci.planning.costs`): ``ulysses`` (Jacobs et al. 2023,
all-to-all of q, k, v and the output), ``ring`` (Liu et al. 2023, key/value blocks around a ring, zigzag layout),
``hybrid`` (USP, Fang & Zhao 2024: Ulysses ``P/2`` x ring 2), ``megatron-sp`` (Megatron-LM sequence parallelism,
Korthikanti et al. 2022, measured on ds4sci's tensor-parallel layers, :mod:`ds4sci.parallel.tensor_parallel`, TP
degree ``P`` with sequence-parallel regions, dropout on: the attention and MLP partial sums are reduce-scattered
separately, as in Megatron-LM; the formula row stays beside it, labelled formula) and ``tp-sp`` (the same layers
without dropout, ds4sci's training default: one shared reduce-scatter). No activation checkpointing: the TP closed
forms count one forward, its backward and backward's all-gathers that rebuild the column-parallel matmuls' inputs
(the layers save only this rank's sequence region); full checkpointing would add the forward's collectives again
(:func:`ds4sci.planning.costs.tp_forward_comm_bytes`). The TP layers' small all-reduce of the LayerNorm gradients is
left out of both TP closed forms.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from ds4sci.bench.report import MIB
from ds4sci.bench.report import check_heads
from ds4sci.bench.report import markdown_table
from ds4sci.bench.report import parse_int_list
from ds4sci.bench.report import plural
from ds4sci.bench.report import save_figure
from ds4sci.bench.report import subplots
from ds4sci.bench.report import write_files
from ds4sci.planning.costs import COMM_SCHEMES
from ds4sci.planning.costs import layer_comm_bytes

logger = logging.getLogger(__name__)

TP_SCHEMES = ("megatron-sp", "tp-sp")
#: the report's closing paragraph: what the schemes are and what the closed forms leave out
NOTES = ("Ulysses stays flat as N and P grow together; ring and Megatron-LM SP grow with N. megatron-sp: ds4sci's "
         "tensor-parallel layers with sequence-parallel regions (TP degree P, dropout 0.1); tp-sp: the same without "
         "dropout (one shared reduce-scatter); both all-gather the column-parallel inputs again in backward (their "
         "weight gradients: only the sequence region is saved). On gloo a reduce-scatter runs as an all-to-all plus a "
         "local sum, the same bytes. The small all_gather of the SP schemes is DistributedAttention's check that every "
         "rank holds the same local shapes (8 integers per group per layer); the small all_reduce of the TP schemes "
         "sums the LayerNorm gradients over TP (4 h values per layer); the closed forms leave both out.")


def _degrees(text: str) -> tuple[int, ...]:
    values = parse_int_list(text)
    bad = [v for v in values if v < 2 or v & (v - 1)]
    if bad:
        raise argparse.ArgumentTypeError(f"degrees must be powers of two >= 2, got {bad}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The shape and run options (``--out`` is added by :mod:`ds4sci.bench`)."""
    parser.add_argument("--degrees", type=_degrees, default=(2, 4, 8), metavar="P,P,...",
                        help="sequence-parallel degrees, powers of two (default: 2,4,8)")
    parser.add_argument("--tokens-per-rank", type=int, default=256,
                        help="sequence length per rank: N = this x P (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size h (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=8,
                        help="attention heads; Ulysses needs P | heads (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="P = 2, 4 at 64 tokens per rank (a smoke test)")


def _dims_kwargs(scheme: str, P: int) -> dict | None:
    if scheme == "ulysses":
        return {"ulysses": P}
    if scheme == "ring":
        return {"ring": P, "layout": "zigzag"}
    if scheme in TP_SCHEMES:
        return {"tp": P}
    return {"ulysses": P // 2, "ring": 2, "layout": "zigzag"} if P >= 4 else None  # P = 2 is plain Ulysses


def _worker(rank: int, world: int, schemes: list[str], tokens: int, hidden: int, heads: int) -> list[dict[int, dict]]:
    """Per scheme: bytes this rank sent, per collective kind, in one forward + backward of a 1- and a 2-layer model
    (``megatron-sp`` with dropout 0.1, so that each branch is reduce-scattered on its own)."""
    return [_scheme_bytes(s, world, tokens, hidden, heads) for s in schemes]


def _scheme_bytes(scheme: str, P: int, tokens: int, hidden: int, heads: int) -> dict[int, dict]:
    import torch

    from ds4sci.distributed import ParallelDims
    from ds4sci.distributed.comm import CommCounter
    from ds4sci.distributed.groups import build_groups
    from ds4sci.models.genslm import GenSLM
    from ds4sci.models.genslm import GenSLMConfig
    from ds4sci.parallel.parallelize import parallelize
    from ds4sci.sequence import shard_sequence

    dims = ParallelDims(dp=1, **_dims_kwargs(scheme, P))
    groups = build_groups(dims)
    dropout = 0.1 if scheme == "megatron-sp" else 0.0
    sent = {}
    for layers in (1, 2):
        torch.manual_seed(0)
        config = GenSLMConfig(vocab_size=8, hidden_size=hidden, num_layers=layers, num_heads=heads,
                              max_position_embeddings=tokens, position_embedding="rotary", dropout=dropout)
        model = GenSLM(config)
        counter = CommCounter()
        parallelize(model, groups, counter=counter)
        ids = torch.randint(0, 8, (1, tokens), generator=torch.Generator().manual_seed(1))
        pos = torch.arange(tokens)[None]
        ids, pos = (shard_sequence(t, 1, groups.sp_rank, dims.sp, dims.layout) for t in (ids, pos))
        model(ids, pos).float().square().mean().backward()
        sent[layers] = dict(counter.bytes_sent)
    return sent


def measure(schemes: list[str], P: int, tokens_per_rank: int, hidden: int, heads: int) -> list[dict]:
    """``schemes`` at degree ``P`` in one group of ``P`` processes: per scheme, measured bytes per layer per rank
    (max and min over ranks, by collective kind on rank 0) and the closed form."""
    from ds4sci.spawn import run_workers

    N = tokens_per_rank * P
    per_rank = run_workers(_worker, P, schemes, N, hidden, heads, timeout=600)
    runs = []
    for i, scheme in enumerate(schemes):
        per_layer = [{k: d[2].get(k, 0) - d[1].get(k, 0) for k in set(d[1]) | set(d[2])} for d in
                     (r[i] for r in per_rank)]
        totals = [sum(kinds.values()) for kinds in per_layer]
        runs.append({"scheme": scheme, "P": P, "N": N, "hidden": hidden, "heads": heads,
                     "bytes_per_layer_max": max(totals), "bytes_per_layer_min": min(totals),
                     "by_kind": per_layer[0], "predicted": layer_comm_bytes(scheme, P, N, hidden, 4)})
    return runs


def markdown(report: dict) -> str:
    c = report["config"]
    lines = [f"# comm-volume: bytes sent per rank per layer (forward + backward), fp32, hidden {c['hidden']}, "
             f"{plural(c['heads'], 'head')}, N = {c['tokens_per_rank']} x P", "",
             f"Command: `{report['command']}`", ""]
    rows = []
    for r in report["runs"]:
        nh = r["N"] * r["hidden"] * 4
        rows.append([r["scheme"], r["P"], r["N"], f"{r['bytes_per_layer_max'] / MIB:.3f}",
                     f"{r['bytes_per_layer_max'] / nh:.3f}", f"{r['predicted'] / nh:.3f}",
                     ", ".join(f"{k} {v / MIB:.3f}" for k, v in sorted(r["by_kind"].items()))])
    for P in sorted({r["P"] for r in report["runs"]}):
        N = c["tokens_per_rank"] * P
        b = layer_comm_bytes("megatron-sp", P, N, c["hidden"], 4)
        rows.append(["megatron-sp (formula)", P, N, f"{b / MIB:.3f}", "", f"{b / (N * c['hidden'] * 4):.3f}",
                     "all-gather + reduce-scatter"])
    lines += markdown_table(["scheme", "P", "N", "MiB sent / rank / layer", "measured / (N h)",
                             "closed form / (N h)", "by collective (MiB)"], rows)
    return "\n".join([*lines, "", NOTES]) + "\n"


def plot(report: dict, path: Path) -> None:
    c = report["config"]
    fig, ax = subplots(figsize=(7, 5))
    for scheme in COMM_SCHEMES:
        runs = [r for r in report["runs"] if r["scheme"] == scheme]
        if runs:
            ax.plot([r["P"] for r in runs], [r["bytes_per_layer_max"] / MIB for r in runs], marker="o",
                    label=f"{scheme} (measured)")
    Ps = sorted({r["P"] for r in report["runs"]})
    ax.plot(Ps, [layer_comm_bytes("megatron-sp", P, c["tokens_per_rank"] * P, c["hidden"], 4) / MIB for P in Ps],
            linestyle="--", color="gray", label="megatron-sp (formula)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"sequence-parallel degree P (N = {c['tokens_per_rank']} x P tokens)")
    ax.set_ylabel("MiB sent per rank per layer (fwd + bwd)")
    ax.legend()
    save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    degrees, tokens = ((2, 4), 64) if args.quick else (args.degrees, args.tokens_per_rank)
    for value, name in ((tokens, "--tokens-per-rank"), (args.hidden, "--hidden"), (args.heads, "--heads")):
        if value < 1:
            raise ValueError(f"{name}={value}: must be >= 1")
    check_heads(args.hidden, args.heads)
    for P in degrees:
        if args.heads % P:
            raise ValueError(f"--heads={args.heads}: the Ulysses and TP degree P={P} must divide the heads")
        if tokens % 2:  # the zigzag layout cuts each rank's share in two
            raise ValueError(f"--tokens-per-rank={tokens}: must be even (zigzag ring layout)")
    command = "ds4sci bench comm-volume " + (
        "--quick" if args.quick else
        f"--degrees {','.join(map(str, degrees))} --tokens-per-rank {tokens} --hidden {args.hidden} "
        f"--heads {args.heads}")
    report = {"command": command, "config": {"degrees": list(degrees), "tokens_per_rank": tokens,
                                             "hidden": args.hidden, "heads": args.heads}, "runs": []}
    from tqdm import tqdm

    for P in tqdm(degrees, desc="comm-volume", unit="degree"):
        schemes = [s for s in COMM_SCHEMES if _dims_kwargs(s, P) is not None]
        report["runs"] += measure(schemes, P, tokens, args.hidden, args.heads)
    write_files(args.out, "comm_volume", report, markdown(report), plot)
    return 0
