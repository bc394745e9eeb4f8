"""``ds4sci bench ablation``: what each long-sequence memory switch leaves per token per layer on each rank, measured
beside the planner's figure (the per-technique ablation of Arctic Long Sequence Training, ALST: Bekman et al. 2025,
arXiv:2506.13996, Table 1, measured here on one process and per rank under Ulysses and tensor parallelism).

Rows, each adding one switch to the one above (``activation_checkpointing`` in the training config): ``baseline``
(nothing), ``+ tiled loss`` (``tiled_loss: true``; first after the baseline, as in ALST's runs, where every row after
the baseline computes the loss over tiles), ``+ checkpointing`` (``mode: full``), ``+ tiled MLP`` (``tiled_mlp:
true``), ``+ host offload`` (``cpu: true``). Each row runs under each layout of ``--layouts``: ``1`` (one process),
``ulysses2`` (Ulysses sequence parallelism over 2 ranks), ``tp2`` (tensor parallelism over 2 ranks, Megatron-LM's
sequence-parallel regions), ``tp2xulysses2``... Under TP the column-parallel layers save this rank's sequence region
of their inputs and all-gather it again in backward (the TP re-gather, :mod:`ds4sci.parallel.tensor_parallel`): the
rows without checkpointing (``baseline``, ``+ tiled loss``) under ``tp2`` show what it leaves saved.

For each layout, row, sequence length ``S`` and layer count ``L`` a fresh gloo process group
(:func:`ds4sci.spawn.run_workers`, DeepSpeed's CPU accelerator, one process per rank) builds a GenSLM and applies the
layout and the switches with the trainer's own functions (:func:`~ds4sci.parallel.groups.build_groups`,
:func:`~ds4sci.parallel.parallelize.parallelize`,
:func:`~ds4sci.train.activation_checkpointing.apply_activation_checkpointing`, the batch cut by
:func:`~ds4sci.sequence.shard_sequence` and the loss :func:`~ds4sci.parallel.tensor_parallel.token_loss_for`'s, as
:class:`~ds4sci.train.trainer.Trainer` does), runs a warm-up step at a tiny length and then one forward + cross-entropy
+ backward at ``S`` tokens, measuring on every rank:

- ``saved``: the bytes autograd saves for backward in the forward, each storage once (``saved_tensors_hooks``; the
  checkpoint's own inputs, which DeepSpeed's reentrant checkpoint keeps out of the hooks' sight, counted where the
  checkpoint is called), and ``host``: what :class:`~ds4sci.train.activation_offload.HostOffload` holds in host
  memory at the end of the forward (``offloaded_bytes``); ``device = saved - host``;
- ``peak``: the peak RSS of the step above its start (:class:`ds4sci.bench.memory.PeakMemory`; glibc's allocator,
  whose settings the report records).

A run records the largest of each over the ranks (the most loaded rank, as the planner reports). Per layout and row
the report gives, in hidden vectors (``h e`` bytes) per token of the FULL sequence (a rank's bytes over ``S``, so
1/P of the one-process figure where a layout divides everything by its P ranks): per layer on the device, the slope
of ``device`` over ``S L`` (from the two layer counts); the working set, the slope over ``S`` of ``peak - device`` at
the larger ``L`` (what backward adds above the saved tensors: the recomputed layer and its gradients); and the
longest sequence within the per-rank ``--budget-mib`` from the fit ``peak = a + b S`` at the larger ``L``. Beside
each the planner's figure for the same layout (:mod:`ds4sci.plan`, fp32, a ``Strategy`` with the layout's degrees:
``activations + workspace + attention + grads`` and the larger of the Ulysses all-to-all staging and the ring's
buffers, the step's peak above the parameters and the optimizer state, as ``PeakMemory`` starts after them).
"""
from __future__ import annotations

import argparse
import time

from ds4sci.bench.layout_memory import parse_layout
from ds4sci.bench.report import MIB, markdown_table, parse_int_list, plural, pyplot, save_figure, write_report
from ds4sci.parallel import ParallelDims

ROWS = {  # name -> activation_checkpointing keys; each row adds one switch to the row above (ALST's ablation)
    "baseline": {"mode": "none"},
    "+ tiled loss": {"mode": "none", "tiled_loss": True},
    "+ checkpointing": {"mode": "full", "tiled_loss": True},
    "+ tiled MLP": {"mode": "full", "tiled_loss": True, "tiled_mlp": True},
    "+ host offload": {"mode": "full", "tiled_loss": True, "tiled_mlp": True, "cpu": True},
}
VOCAB = 6
_WARMUP_TOKENS = 64
ONE = "1"  # the one-process layout


def row_key(row: str) -> str:
    """The name ``--rows`` takes for a row: ``"+ tiled MLP"`` -> ``"tiled-mlp"``."""
    return row.removeprefix("+ ").replace(" ", "-").lower()


def dims(layout: str) -> ParallelDims:
    """The degrees of a ``--layouts`` entry: ``"1"`` (one process) or tensor and Ulysses degrees joined by ``x``
    (``"tp2"``, ``"ulysses2"``, ``"tp2xulysses2"``; :func:`ds4sci.bench.layout_memory.parse_layout`'s syntax).
    ``ValueError`` naming the entry otherwise."""
    if layout == ONE:
        return ParallelDims(dp=1)
    degrees = parse_layout(layout, None)
    other = [f"{axis}{degrees[axis]}" for axis in ("ring", "pp", "dp") if degrees[axis] > 1]
    if other:
        raise ValueError(f"--layouts entry {layout!r}: the ablation runs tp and ulysses degrees only, not "
                         f"{', '.join(other)}")
    return ParallelDims(dp=1, tp=degrees["tp"], ulysses=degrees["ulysses"])


def layout_name(layout: str) -> str:
    """``"tp2xulysses2"`` -> ``"TP 2 x Ulysses 2"``; ``"1"`` -> ``"one process"``."""
    d = dims(layout)
    parts = [f"{name} {n}" for name, n in (("TP", d.tp), ("Ulysses", d.ulysses)) if n > 1]
    return " x ".join(parts) or "one process"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seq-lens", type=parse_int_list, default=(1024, 2048, 4096, 8192), metavar="S,S,...",
                        help="sequence lengths, K = 1024 (default: 1K,2K,4K,8K)")
    parser.add_argument("--layers", type=parse_int_list, default=(4, 8), metavar="L,L",
                        help="two layer counts; the per-layer figures are the difference (default: 4,8)")
    parser.add_argument("--layouts", default=ONE, metavar="LAYOUT,...",
                        help="1 (one process) or tp and ulysses degrees joined by x, e.g. 1,ulysses2,tp2: every row "
                             "runs under each, one process per rank (default: 1)")
    parser.add_argument("--rows", default=",".join(row_key(r) for r in ROWS), metavar="ROW,...",
                        help="rows to run (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (default: %(default)s)")
    parser.add_argument("--mlp-tile", type=int, default=1024, help="tokens per tiled-MLP tile (default: %(default)s)")
    parser.add_argument("--loss-tile", type=int, default=1024,
                        help="tokens per tiled-loss tile (default: %(default)s)")
    parser.add_argument("--budget-mib", type=float, default=1024.0,
                        help="per-rank budget for the longest-sequence column (default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="S = 256, 512, L = 1, 2, hidden 32, 4 heads, tiles 64 (a smoke test)")


def _config(shape: dict, layers: int, seq_len: int):
    from ds4sci.models.genslm import GenSLMConfig

    return GenSLMConfig(vocab_size=VOCAB, hidden_size=shape["hidden"], num_layers=layers, num_heads=shape["heads"],
                        max_position_embeddings=seq_len, attention_backend="chunked")


def _worker(rank: int, world: int, switches: dict, shape: dict, layout: str, runs: list[tuple[int, int]]
            ) -> list[dict]:
    """Each run's ``(L, S)`` saved, host and peak bytes on this rank, in order (module docstring)."""
    import torch

    from ds4sci.bench.memory import PeakMemory
    from ds4sci.models.genslm import GenSLM
    from ds4sci.parallel.groups import build_groups
    from ds4sci.parallel.parallelize import parallelize
    from ds4sci.parallel.tensor_parallel import token_loss_for
    from ds4sci.sequence import shard_sequence
    from ds4sci.train.activation_checkpointing import apply_activation_checkpointing
    from ds4sci.train.config import ActivationCheckpointingConfig
    from ds4sci.train.engine import init_distributed

    init_distributed()
    groups = build_groups(dims(layout))
    d = groups.dims
    loss_fn = token_loss_for(groups)
    results = []
    for layers, seq_len in runs:
        torch.manual_seed(0)
        model = GenSLM(_config(shape, layers, seq_len)).train()
        parallelize(model, groups)
        offload = apply_activation_checkpointing(model, ActivationCheckpointingConfig(
            **switches, mlp_tile=shape["mlp_tile"], loss_tile=shape["loss_tile"]))
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages: dict[int, int] = {}  # storage object -> bytes; an offloaded storage keeps its object, not its memory

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                storages[storage._cdata] = storage.nbytes()
            return t

        if model.checkpoint_fn is not None:  # count the checkpoint's inputs, which its reentrant Function keeps itself
            inner = model.checkpoint_fn

            def counted(block, *args, inner=inner):
                for a in args:
                    if isinstance(a, torch.Tensor):
                        pack(a)
                return inner(block, *args)

            model.checkpoint_fn = counted

        def step(n: int, hooks: bool) -> None:
            g = torch.Generator().manual_seed(n)
            ids = torch.randint(0, VOCAB, (1, n + 1), generator=g)  # [1, n + 1]: inputs and shifted targets
            batch = {"input_ids": ids[:, :-1], "position_ids": torch.arange(n)[None], "targets": ids[:, 1:]}
            batch = {k: shard_sequence(v, 1, groups.sp_rank, d.sp, d.layout) for k, v in batch.items()}  # [1, n/sp]
            inputs = (batch["input_ids"], batch["position_ids"])
            with torch.autograd.graph.saved_tensors_hooks(pack if hooks else (lambda t: t), lambda t: t):
                if switches.get("tiled_loss"):  # the head computes the summed loss tile by tile
                    loss = model(*inputs, targets=batch["targets"])
                else:
                    loss = loss_fn(model(*inputs), batch["targets"], "sum")
            out["host"] = offload.offloaded_bytes if offload is not None else 0
            loss.backward()
            model.zero_grad(set_to_none=True)

        out: dict = {}
        step(_WARMUP_TOKENS, hooks=False)
        storages.clear()
        with PeakMemory("cpu") as peak:
            step(seq_len, hooks=True)
        saved = sum(storages.values())
        results.append({"saved": saved, "host": out["host"], "device": saved - out["host"], "peak": peak.bytes})
        del model, offload
    return results


def measure(row: str, shape: dict, runs: list[tuple[int, int]], layout: str = ONE) -> list[dict]:
    """One process group of ``layout``'s ranks measures ``row`` at each ``(L, S)`` of ``runs`` in turn: per run the
    largest ``saved``, ``host``, ``device`` and ``peak`` over the ranks and each rank's (``ranks``)."""
    from ds4sci.spawn import run_workers

    start = time.perf_counter()
    per_rank = run_workers(_worker, dims(layout).world_size, ROWS[row], shape, layout, list(runs), timeout=3600,
                           env={"DS_ACCELERATOR": "cpu"})
    seconds = round(time.perf_counter() - start, 1)
    out = []
    for i, (layers, seq_len) in enumerate(runs):
        ranks = [r[i] for r in per_rank]
        out.append({"layout": layout, "row": row, "layers": layers, "seq_len": seq_len,
                    **{k: max(r[k] for r in ranks) for k in ("saved", "host", "device", "peak")},
                    "ranks": ranks, "seconds": seconds})
    return out


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x``: ``(a, b)``."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def planner(row: str, shape: dict, layers: int, seq_len: int, layout: str = ONE) -> dict:
    """The planner's figures for ``row`` under ``layout`` at one length, per rank: bytes per token of the full
    sequence per layer on the device, the working set per token (what backward adds above the saved tensors), host
    bytes, and the step's peak (module docstring)."""
    from ds4sci import plan

    switches = ROWS[row]
    d = dims(layout)
    w = plan.Workload(_config(shape, layers, seq_len), seq_len, dtype="fp32")
    strategy = plan.Strategy(d, checkpointing=switches["mode"], mlp_tile=shape["mlp_tile"] if switches.get(
        "tiled_mlp") else 0, offload_activations=switches.get("cpu", False),
        loss_tile=shape["loss_tile"] if switches.get("tiled_loss") else 0)
    local = d.sp * d.tp  # the planner counts per local token: S / (sp tp) of them on a rank
    per_layer = (plan.layer_activation_bytes(w, strategy, strategy.checkpointing)
                 - plan.offloaded_layer_bytes(w, strategy)) / local
    terms = plan.memory(w, strategy)
    buffers = max(terms["a2a_staging"], terms["ring_buffers"])  # alive one after the other: the larger counts
    peak = terms["activations"] + terms["workspace"] + terms["attention"] + terms["grads"] + buffers
    # saved outside the layers (ids, final norm, logits or the tiled loss's targets): the activations without
    # checkpointing less its layers'
    plain = plan.Strategy(d, loss_tile=strategy.loss_tile)
    outside = (plan.memory(w, plain)["activations"] / seq_len
               - layers * plan.layer_activation_bytes(w, plain, "none") / local)
    working = (terms["activations"] + terms["workspace"] + buffers) / seq_len - layers * per_layer - outside
    return {"per_layer": per_layer, "working_per_token": working, "host": terms["host_activations"], "peak": peak}


def summarize(report: dict) -> list[dict]:
    """Per layout and row: measured and predicted per-layer device bytes and working set per token of the full
    sequence, in hidden vectors, and the longest sequence within the per-rank budget."""
    c = report["config"]
    shape = {k: c[k] for k in ("hidden", "heads", "mlp_tile", "loss_tile")}
    vector = c["hidden"] * 4  # one fp32 hidden vector
    small, large = min(c["layers"]), max(c["layers"])
    budget = c["budget_mib"] * MIB
    rows = []
    for layout in c["layouts"]:
        for row in ROWS:
            runs = {(r["layers"], r["seq_len"]): r for r in report["runs"] if r["row"] == row and r["layout"] == layout}
            lengths = sorted(s for (L, s) in runs if L == large and (small, s) in runs)
            if len(lengths) < 2:
                continue
            per_layer = [(runs[large, s]["device"] - runs[small, s]["device"]) / ((large - small) * s)
                         for s in lengths]
            _, working = _fit(lengths, [runs[large, s]["peak"] - runs[large, s]["device"] for s in lengths])
            a, b = _fit(lengths, [runs[large, s]["peak"] for s in lengths])
            longest = int((budget - a) / b) if budget > a else 0
            predicted = planner(row, shape, large, lengths[-1], layout)
            lo, hi = 0, 1 << 30  # the planner's longest S within the budget: its peak grows with S
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if planner(row, shape, large, mid, layout)["peak"] <= budget else (lo, mid)
            rows.append({"layout": layout, "row": row, "per_layer_vectors": max(per_layer) / vector,
                         "planner_per_layer_vectors": predicted["per_layer"] / vector,
                         "working_vectors": working / vector,
                         "planner_working_vectors": predicted["working_per_token"] / vector,
                         "host_bytes": runs[large, lengths[-1]]["host"], "planner_host_bytes": predicted["host"],
                         "longest_within_budget": longest, "planner_longest_within_budget": lo})
    return rows


def markdown(report: dict) -> str:
    c = report["config"]
    layouts = ", ".join(layout_name(layout) for layout in c["layouts"])
    lines = [f"# ablation: what each memory switch leaves per token per layer per rank (fp32, CPU, {layouts}; hidden "
             f"{c['hidden']}, {plural(c['heads'], 'head')}, {plural(len(c['layers']), 'layer count')} "
             f"{c['layers']}, MLP tile {c['mlp_tile']}, loss tile {c['loss_tile']}, chunked attention, rotary, "
             "causal)", "",
             f"Command: `{report['command']}`", "", report["allocator"], "",
             "Per layout and row, each row adding one switch to the row above; hidden vectors (`h e` bytes) per token "
             "of the full sequence on the most loaded rank; measured (saved-tensor hooks, HostOffload.offloaded_bytes, "
             "peak RSS) beside the planner's (`ds4sci plan`):", ""]
    rows = [[layout_name(s["layout"]), s["row"], f"{s['per_layer_vectors']:.2f}",
             f"{s['planner_per_layer_vectors']:.2f}", f"{s['working_vectors']:.2f}",
             f"{s['planner_working_vectors']:.2f}", f"{s['host_bytes'] / MIB:.1f}",
             f"{s['planner_host_bytes'] / MIB:.1f}", s["longest_within_budget"], s["planner_longest_within_budget"]]
            for s in report["summary"]]
    lines += markdown_table(["layout", "switches", "per layer on device", "planner", "working set", "planner",
                             f"host MiB (L={max(c['layers'])}, S={max(c['seq_lens'])})", "planner",
                             f"longest S in {c['budget_mib']:g} MiB (fit)", "planner"], rows)
    lines += ["", "Per layer on device: the slope of saved-minus-offloaded bytes over S x L. Working set: the slope "
              "over S of peak RSS minus the device-side saved bytes at the larger L. Longest S: the fit "
              "`peak = a + b S` at the larger L extrapolated to the budget; the planner's: its activations + "
              "workspace + attention + gradients + sequence-parallel buffers within the budget. Under TP the "
              "column-parallel layers save this rank's sequence region of their inputs and gather it again in "
              "backward (the rows without checkpointing show it). On a CPU the \"host\" copies of host offload are "
              "in the same process's RSS, so its peak does not fall here as it does on a GPU.", "",
              "Peak MiB (RSS above the step's start, the most loaded rank):", ""]
    keys = sorted({(r["layout"], r["row"], r["layers"]) for r in report["runs"]},
                  key=lambda k: (c["layouts"].index(k[0]), list(ROWS).index(k[1]), k[2]))
    table = []
    for layout, row, L in keys:
        by_s = {r["seq_len"]: r for r in report["runs"]
                if r["layout"] == layout and r["row"] == row and r["layers"] == L}
        table.append([layout_name(layout), row, L]
                     + [f"{by_s[s]['peak'] / MIB:.1f}" if s in by_s else "" for s in c["seq_lens"]])
    lines += markdown_table(["layout", "switches", "L"] + [f"S={s}" for s in c["seq_lens"]], table)
    return "\n".join(lines) + "\n"


def plot(report: dict, path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    L = max(report["config"]["layers"])
    for layout in report["config"]["layouts"]:
        for row in ROWS:
            runs = sorted((r for r in report["runs"] if r["layout"] == layout and r["row"] == row and r["layers"] == L),
                          key=lambda r: r["seq_len"])
            if runs:
                ax.plot([r["seq_len"] for r in runs], [r["peak"] / MIB for r in runs], marker="o",
                        label=f"{layout_name(layout)}: {row}")
    ax.axhline(report["config"]["budget_mib"], color="gray", linestyle="--", label="budget")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length S (tokens)")
    ax.set_ylabel(f"peak MiB per rank, {L} layers (forward + backward)")
    ax.legend(fontsize="small")
    save_figure(fig, path)


def _rows(text: str) -> list[str]:
    """``--rows``' names -> the rows, in table order. ``ValueError`` naming an unknown one."""
    keys = {row_key(r): r for r in ROWS}
    given = [t.strip() for t in text.split(",")]
    unknown = [t for t in given if t not in keys]
    if unknown:
        raise ValueError(f"--rows {','.join(unknown)}: not a row (rows: {', '.join(keys)})")
    return [r for r in ROWS if row_key(r) in given]


def run(args: argparse.Namespace) -> int:
    from ds4sci.bench.memory import allocator_settings, describe_allocator

    if args.quick:
        seq_lens, layers, shape = (256, 512), (1, 2), {"hidden": 32, "heads": 4, "mlp_tile": 64, "loss_tile": 64}
    else:
        seq_lens, layers = args.seq_lens, args.layers
        shape = {"hidden": args.hidden, "heads": args.heads, "mlp_tile": args.mlp_tile, "loss_tile": args.loss_tile}
    for name, value in (("--hidden", shape["hidden"]), ("--heads", shape["heads"]), ("--mlp-tile", shape["mlp_tile"]),
                        ("--loss-tile", shape["loss_tile"]), ("--budget-mib", args.budget_mib)):
        if value <= 0:
            raise ValueError(f"{name}={value:g}: must be > 0")
    if shape["hidden"] % shape["heads"]:
        raise ValueError(f"--hidden={shape['hidden']} is not divisible by --heads={shape['heads']}")
    if len(layers) != 2 or len(seq_lens) < 2:
        raise ValueError(f"--layers {','.join(map(str, layers))}: give two layer counts, and at least two --seq-lens")
    layouts = list(dict.fromkeys(t.strip() for t in args.layouts.split(",")))
    rows = _rows(args.rows)
    for layout in layouts:
        d = dims(layout)
        cfg = _config(shape, max(layers), max(seq_lens))
        d.check_model(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, num_layers=cfg.num_layers,
                      intermediate_size=cfg.intermediate_size)
        uneven = [s for s in (*seq_lens, _WARMUP_TOKENS) if s % d.sequence_multiple]
        if uneven:
            raise ValueError(f"--seq-lens {','.join(map(str, uneven))}: layout {layout} cuts the sequence into "
                             f"{d.sequence_multiple} equal pieces")
    command = "ds4sci bench ablation " + ("--quick" if args.quick else (
        f"--seq-lens {','.join(map(str, seq_lens))} --layers {','.join(map(str, layers))} --hidden {shape['hidden']} "
        f"--heads {shape['heads']} --mlp-tile {shape['mlp_tile']} --loss-tile {shape['loss_tile']}")) + (
        f" --budget-mib {args.budget_mib:g}") + (f" --layouts {','.join(layouts)}" if layouts != [ONE] else "") + (
        f" --rows {','.join(map(row_key, rows))}" if rows != list(ROWS) else "")
    report = {"command": command, "allocator": describe_allocator(allocator_settings()),
              "config": {"seq_lens": list(seq_lens), "layers": list(layers), "layouts": layouts, **shape,
                         "budget_mib": args.budget_mib},
              "runs": []}
    from tqdm import tqdm

    jobs = [(layout, row, L, s) for layout in layouts for row in rows for L in layers for s in seq_lens]
    for layout, row, L, s in tqdm(jobs, desc="ablation", unit="run"):
        report["runs"] += measure(row, shape, [(L, s)], layout)  # a fresh process group per run: its own peak
    report["summary"] = summarize(report)
    path = write_report(args.out, "ablation", report, markdown(report))
    plot(report, path.with_suffix(".png"))
    print(f"ablation: wrote {path}, {path.with_suffix('.md')} and {path.with_suffix('.png')}")
    return 0
