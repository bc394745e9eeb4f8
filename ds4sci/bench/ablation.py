"""``ds4sci bench ablation``: what each long-sequence memory switch leaves per token per layer, measured beside the
planner's figure (the per-technique ablation of Arctic Long Sequence Training, ALST: Bekman et al. 2025,
arXiv:2506.13996, Table 1, measured here on one process).

Rows, each adding one switch to the one above (``activation_checkpointing`` in the training config): ``baseline``
(nothing), ``+ tiled loss`` (``tiled_loss: true``; first after the baseline, as in ALST's runs, where every row after
the baseline computes the loss over tiles), ``+ checkpointing`` (``mode: full``), ``+ tiled MLP`` (``tiled_mlp:
true``), ``+ host offload`` (``cpu: true``). For each row, sequence length ``S`` and layer count ``L`` one fresh gloo process
(:func:`ds4sci.spawn.run_workers`, DeepSpeed's CPU accelerator) builds a GenSLM, applies the switches as the trainer
does (:func:`~ds4sci.train.activation_checkpointing.apply_activation_checkpointing`), runs a warm-up step at a tiny
length and then one forward + cross-entropy + backward at ``S`` tokens, measuring:

- ``saved``: the bytes autograd saves for backward in the forward, each storage once (``saved_tensors_hooks``; the
  checkpoint's own inputs, which DeepSpeed's reentrant checkpoint keeps out of the hooks' sight, counted where the
  checkpoint is called), and ``host``: what :class:`~ds4sci.train.activation_offload.HostOffload` holds in host
  memory at the end of the forward (``offloaded_bytes``); ``device = saved - host``;
- ``peak``: the peak RSS of the step above its start (:class:`ds4sci.bench.memory.PeakMemory`; glibc's allocator,
  whose settings the report records).

Per row the report gives, in hidden vectors (``h e`` bytes) per token: per layer on the device, the slope of
``device`` over ``S L`` (from the two layer counts); the working set, the slope over ``S`` of ``peak - device`` at the
larger ``L`` (what backward adds above the saved tensors: the recomputed layer and its gradients); and the longest
sequence within ``--budget-mib`` from the fit ``peak = a + b S`` at the larger ``L``. Beside each the planner's figure
(:mod:`ds4sci.plan`, fp32, one GPU: ``activations + workspace + attention + grads``, the step's peak above the
parameters and the optimizer state, as ``PeakMemory`` starts after them).
"""
from __future__ import annotations

import argparse
import time

from ds4sci.bench.report import MIB, markdown_table, parse_int_list, plural, pyplot, save_figure, write_report

ROWS = {  # name -> activation_checkpointing keys; each row adds one switch to the row above (ALST's ablation)
    "baseline": {"mode": "none"},
    "+ tiled loss": {"mode": "none", "tiled_loss": True},
    "+ checkpointing": {"mode": "full", "tiled_loss": True},
    "+ tiled MLP": {"mode": "full", "tiled_loss": True, "tiled_mlp": True},
    "+ host offload": {"mode": "full", "tiled_loss": True, "tiled_mlp": True, "cpu": True},
}
VOCAB = 6
_WARMUP_TOKENS = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seq-lens", type=parse_int_list, default=(1024, 2048, 4096, 8192), metavar="S,S,...",
                        help="sequence lengths, K = 1024 (default: 1K,2K,4K,8K)")
    parser.add_argument("--layers", type=parse_int_list, default=(4, 8), metavar="L,L",
                        help="two layer counts; the per-layer figures are the difference (default: 4,8)")
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


def _worker(rank: int, world: int, switches: dict, shape: dict, layers: int, seq_len: int) -> dict:
    """One step's saved, host and peak bytes (module docstring)."""
    import torch
    import torch.nn.functional as F

    from ds4sci.bench.memory import PeakMemory
    from ds4sci.models.genslm import GenSLM
    from ds4sci.train.activation_checkpointing import apply_activation_checkpointing
    from ds4sci.train.config import ActivationCheckpointingConfig
    from ds4sci.train.engine import init_distributed

    init_distributed()
    torch.manual_seed(0)
    model = GenSLM(_config(shape, layers, seq_len)).train()
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

        def counted(block, *args):
            for a in args:
                if isinstance(a, torch.Tensor):
                    pack(a)
            return inner(block, *args)

        model.checkpoint_fn = counted

    def step(n: int, hooks: bool) -> None:
        g = torch.Generator().manual_seed(n)
        ids = torch.randint(0, VOCAB, (1, n + 1), generator=g)
        with torch.autograd.graph.saved_tensors_hooks(pack if hooks else (lambda t: t), lambda t: t):
            if switches.get("tiled_loss"):  # the head computes the summed loss tile by tile
                loss = model(ids[:, :-1], torch.arange(n)[None], targets=ids[:, 1:]) / n
            else:
                logits = model(ids[:, :-1], torch.arange(n)[None])  # [1, n, V]
                loss = F.cross_entropy(logits.float().flatten(0, 1), ids[0, 1:])
        out["host"] = offload.offloaded_bytes if offload is not None else 0
        loss.backward()
        model.zero_grad(set_to_none=True)

    out: dict = {}
    step(_WARMUP_TOKENS, hooks=False)
    storages.clear()
    with PeakMemory("cpu") as peak:
        step(seq_len, hooks=True)
    saved = sum(storages.values())
    return {"saved": saved, "host": out["host"], "device": saved - out["host"], "peak": peak.bytes}


def measure(row: str, shape: dict, layers: int, seq_len: int) -> dict:
    from ds4sci.spawn import run_workers

    start = time.perf_counter()
    result = run_workers(_worker, 1, ROWS[row], shape, layers, seq_len, timeout=3600,
                         env={"DS_ACCELERATOR": "cpu"})[0]
    return {"row": row, "layers": layers, "seq_len": seq_len, **result,
            "seconds": round(time.perf_counter() - start, 1)}


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x``: ``(a, b)``."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def planner(row: str, shape: dict, layers: int, seq_len: int) -> dict:
    """The planner's figures for ``row`` at one length: bytes per token per layer on the device, the working set per
    token (what backward adds above the saved tensors), host bytes, and the step's peak (module docstring)."""
    from ds4sci import plan

    switches = ROWS[row]
    w = plan.Workload(_config(shape, layers, seq_len), seq_len, dtype="fp32")
    strategy = plan.Strategy(checkpointing=switches["mode"], mlp_tile=shape["mlp_tile"] if switches.get(
        "tiled_mlp") else 0, offload_activations=switches.get("cpu", False),
        loss_tile=shape["loss_tile"] if switches.get("tiled_loss") else 0)
    per_layer = plan.layer_activation_bytes(w, strategy, strategy.checkpointing) - plan.offloaded_layer_bytes(w, strategy)
    terms = plan.memory(w, strategy)
    peak = terms["activations"] + terms["workspace"] + terms["attention"] + terms["grads"]
    # saved outside the layers (ids, final norm, logits or the tiled loss's targets): the activations without
    # checkpointing less its layers'
    plain = plan.Strategy(loss_tile=strategy.loss_tile)
    outside = plan.memory(w, plain)["activations"] / seq_len - layers * plan.layer_activation_bytes(w, plain, "none")
    working = (terms["activations"] + terms["workspace"]) / seq_len - layers * per_layer - outside
    return {"per_layer": per_layer, "working_per_token": working, "host": terms["host_activations"], "peak": peak}


def summarize(report: dict) -> list[dict]:
    """Per row: measured and predicted per-layer device bytes and working set per token, in hidden vectors, and the
    longest sequence within the budget."""
    c = report["config"]
    shape = {k: c[k] for k in ("hidden", "heads", "mlp_tile", "loss_tile")}
    vector = c["hidden"] * 4  # one fp32 hidden vector
    small, large = min(c["layers"]), max(c["layers"])
    budget = c["budget_mib"] * MIB
    rows = []
    for row in ROWS:
        runs = {(r["layers"], r["seq_len"]): r for r in report["runs"] if r["row"] == row}
        lengths = sorted(s for (L, s) in runs if L == large and (small, s) in runs)
        if len(lengths) < 2:
            continue
        per_layer = [(runs[large, s]["device"] - runs[small, s]["device"]) / ((large - small) * s) for s in lengths]
        _, working = _fit(lengths, [runs[large, s]["peak"] - runs[large, s]["device"] for s in lengths])
        a, b = _fit(lengths, [runs[large, s]["peak"] for s in lengths])
        longest = int((budget - a) / b) if budget > a else 0
        predicted = [planner(row, shape, large, s) for s in lengths]
        lo, hi = 0, 1 << 30  # the planner's longest S within the budget: its peak grows with S
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if planner(row, shape, large, mid)["peak"] <= budget else (lo, mid)
        rows.append({"row": row, "per_layer_vectors": max(per_layer) / vector,
                     "planner_per_layer_vectors": predicted[-1]["per_layer"] / vector,
                     "working_vectors": working / vector,
                     "planner_working_vectors": predicted[-1]["working_per_token"] / vector,
                     "host_bytes": runs[large, lengths[-1]]["host"], "planner_host_bytes": predicted[-1]["host"],
                     "longest_within_budget": longest, "planner_longest_within_budget": lo})
    return rows


def markdown(report: dict) -> str:
    c = report["config"]
    lines = [f"# ablation: what each memory switch leaves per token per layer (fp32, CPU, one process, hidden "
             f"{c['hidden']}, {plural(c['heads'], 'head')}, {plural(len(c['layers']), 'layer count')} "
             f"{c['layers']}, MLP tile {c['mlp_tile']}, loss tile {c['loss_tile']}, chunked attention, rotary, "
             "causal)", "",
             f"Command: `{report['command']}`", "", report["allocator"], "",
             "Per row, each adding one switch to the row above; hidden vectors (`h e` bytes) per token; measured "
             "(saved-tensor hooks, HostOffload.offloaded_bytes, peak RSS) beside the planner's (`ds4sci plan`):", ""]
    rows = [[s["row"], f"{s['per_layer_vectors']:.2f}", f"{s['planner_per_layer_vectors']:.2f}",
             f"{s['working_vectors']:.2f}", f"{s['planner_working_vectors']:.2f}",
             f"{s['host_bytes'] / MIB:.1f}", f"{s['planner_host_bytes'] / MIB:.1f}",
             s["longest_within_budget"], s["planner_longest_within_budget"]] for s in report["summary"]]
    lines += markdown_table(["switches", "per layer on device", "planner", "working set", "planner",
                             f"host MiB (L={max(c['layers'])}, S={max(c['seq_lens'])})", "planner",
                             f"longest S in {c['budget_mib']:g} MiB (fit)", "planner"], rows)
    lines += ["", "Per layer on device: the slope of saved-minus-offloaded bytes over S x L. Working set: the slope "
              "over S of peak RSS minus the device-side saved bytes at the larger L. Longest S: the fit "
              "`peak = a + b S` at the larger L extrapolated to the budget; the planner's: its activations + "
              "workspace + attention + gradients within the budget. On a CPU the \"host\" copies of host offload "
              "are in the same process's RSS, so its peak does not fall here as it does on a GPU.", "",
              "Peak MiB (RSS above the step's start):", ""]
    keys = sorted({(r["row"], r["layers"]) for r in report["runs"]}, key=lambda k: (list(ROWS).index(k[0]), k[1]))
    table = []
    for row, L in keys:
        by_s = {r["seq_len"]: r for r in report["runs"] if r["row"] == row and r["layers"] == L}
        table.append([row, L] + [f"{by_s[s]['peak'] / MIB:.1f}" if s in by_s else "" for s in c["seq_lens"]])
    lines += markdown_table(["switches", "L"] + [f"S={s}" for s in c["seq_lens"]], table)
    return "\n".join(lines) + "\n"


def plot(report: dict, path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    L = max(report["config"]["layers"])
    for row in ROWS:
        runs = sorted((r for r in report["runs"] if r["row"] == row and r["layers"] == L), key=lambda r: r["seq_len"])
        if runs:
            ax.plot([r["seq_len"] for r in runs], [r["peak"] / MIB for r in runs], marker="o", label=row)
    ax.axhline(report["config"]["budget_mib"], color="gray", linestyle="--", label="budget")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length S (tokens)")
    ax.set_ylabel(f"peak MiB, one process, {L} layers (forward + backward)")
    ax.legend()
    save_figure(fig, path)


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
    command = "ds4sci bench ablation " + ("--quick" if args.quick else (
        f"--seq-lens {','.join(map(str, seq_lens))} --layers {','.join(map(str, layers))} --hidden {shape['hidden']} "
        f"--heads {shape['heads']} --mlp-tile {shape['mlp_tile']} --loss-tile {shape['loss_tile']}")) + (
        f" --budget-mib {args.budget_mib:g}")
    report = {"command": command, "allocator": describe_allocator(allocator_settings()),
              "config": {"seq_lens": list(seq_lens), "layers": list(layers), **shape, "budget_mib": args.budget_mib},
              "runs": []}
    from tqdm import tqdm

    jobs = [(row, L, s) for row in ROWS for L in layers for s in seq_lens]
    for row, L, s in tqdm(jobs, desc="ablation", unit="run"):
        report["runs"].append(measure(row, shape, L, s))
    report["summary"] = summarize(report)
    path = write_report(args.out, "ablation", report, markdown(report))
    plot(report, path.with_suffix(".png"))
    print(f"ablation: wrote {path}, {path.with_suffix('.md')} and {path.with_suffix('.png')}")
    return 0
