"""``ds4sci bench ablation``: what each long-sequence memory switch leaves per token per layer on each rank, measured
beside the planner's figure (the per-technique ablation of Arctic Long Sequence Training, ALST: Bekman et al. 2025,
arXiv:2506.13996, Table 1, here on one process and per rank under Ulysses, ring, tensor and pipeline parallelism and
ZeRO-3).

Rows, each adding one switch to the one above (``activation_checkpointing`` in the training config): ``baseline``,
``+ tiled loss`` (first after the baseline, as in ALST's runs), ``+ checkpointing`` (``mode: full``), ``+ tiled MLP``,
``+ host offload``. Each row runs under each layout of ``--layouts`` (:func:`parse_layout`: ``1``, ``ulysses2``,
``ring2``, ``tp2``, ``pp2``, ``dp2xzero3``, ...); under TP the rows without checkpointing show the column-parallel
layers' re-gathered inputs.

For each layout, row, sequence length ``S`` and layer count ``L`` a fresh gloo process group
(:func:`ds4sci.spawn.run_workers`) builds a GenSLM and applies the layout and the switches with the trainer's own
functions (as :class:`~ds4sci.train.trainer.Trainer` does, DeepSpeed's engines where the layout needs one), runs a
warm-up step and then one training step at ``S`` tokens, measuring on every rank: ``saved`` (bytes autograd saves
for backward, each storage once), ``host`` (what host offload holds), ``device = saved - host``, ``peak`` (peak RSS
of the step, :class:`ds4sci.bench.memory.PeakMemory`), the blocks held, and the parameter and gradient bytes.

The most loaded rank is reported, in hidden vectors (``h e`` bytes) per token of the full sequence: per layer on the
device (the slope of ``device`` over ``S`` from the two layer counts), the working set (the slope of ``peak -
device`` at the larger ``L``) and the longest sequence within ``--budget-mib`` (from the fit ``peak = a + b S``),
each beside the planner's figure for the same layout (:mod:`ds4sci.planning.genslm`, fp32, the layout's degrees).
"""
from __future__ import annotations

import argparse
import logging
import math
import time

from ds4sci.bench.layout_memory import parse_layout
from ds4sci.bench.report import MIB
from ds4sci.bench.report import add_int_options
from ds4sci.bench.report import check_heads
from ds4sci.bench.report import markdown_table
from ds4sci.bench.report import parse_int_list
from ds4sci.bench.report import plot_peaks
from ds4sci.bench.report import plural
from ds4sci.bench.report import write_files
from ds4sci.distributed import ParallelDims
from ds4sci.progress import progress_bar

logger = logging.getLogger(__name__)

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
ZERO3 = "zero3"  # the --layouts part for ZeRO stage 3
RANK_KEYS = ("saved", "host", "device", "peak", "held", "params", "grads")  # measured per rank


def row_key(row: str) -> str:
    """The name ``--rows`` takes for a row: ``"+ tiled MLP"`` -> ``"tiled-mlp"``."""
    return row.removeprefix("+ ").replace(" ", "-").lower()


def _parts(layout: str) -> tuple[str, int]:
    """``"dp2xzero3"`` -> ``("dp2", 3)``: the degrees and the ZeRO stage of a ``--layouts`` entry."""
    parts = layout.split("x")
    zero = 3 if ZERO3 in parts else 0
    return "x".join(p for p in parts if p != ZERO3), zero


def dims(layout: str) -> ParallelDims:
    """The degrees of a ``--layouts`` entry: ``"1"`` (one process) or degrees joined by ``x``
    (:func:`ds4sci.bench.layout_memory.parse_layout`'s syntax: ``"tp2"``, ``"ulysses2"``, ``"ring2"``, ``"pp2"``,
    ``"tp2xulysses2"``), with ``zero3`` as one more part for ZeRO-3 over the sequence x data ranks (``"dp2xzero3"``).
    ``ValueError`` naming the entry otherwise."""
    if layout == ONE:
        return ParallelDims(dp=1)
    degrees, zero = _parts(layout)
    if not degrees:
        raise ValueError(f"--layouts entry {layout!r}: give the ranks ZeRO-3 partitions over, e.g. dp2xzero3")
    d = parse_layout(degrees, None)
    if zero and d["pp"] > 1:
        raise ValueError(f"--layouts entry {layout!r}: DeepSpeed's pipeline engine runs ZeRO stage 0 or 1, not zero3")
    return ParallelDims(**d)


def zero_stage(layout: str) -> int:
    """3 for a ``--layouts`` entry with a ``zero3`` part, else 0."""
    return 0 if layout == ONE else _parts(layout)[1]


def uses_engine(layout: str) -> bool:
    """Whether ``layout`` runs through the trainer's DeepSpeed engine (data ranks, ZeRO-3: ``build_engine``; pipeline
    stages: ``build_pipeline_engine``); tensor and sequence layouts run the parallelized model itself."""
    d = dims(layout)
    return d.pp > 1 or d.dp > 1 or zero_stage(layout) > 0


def layout_name(layout: str) -> str:
    """``"tp2xulysses2"`` -> ``"TP 2 x Ulysses 2"``; ``"1"`` -> ``"one process"``; ``"dp2xzero3"`` -> ``"DP 2
    (ZeRO-3)"``; ``"pp2"`` -> ``"PP 2 (1 micro-batch in flight)"``."""
    d = dims(layout)
    parts = [f"{name} {n}" for name, n in (("TP", d.tp), ("Ulysses", d.ulysses), ("Ring", d.ring), ("PP", d.pp),
                                           ("DP", d.dp)) if n > 1]
    notes = (["ZeRO-3"] if zero_stage(layout) else []) + (["1 micro-batch in flight"] if d.pp > 1 else [])
    return (" x ".join(parts) or "one process") + (f" ({', '.join(notes)})" if notes else "")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seq-lens", type=parse_int_list, default=(1024, 2048, 4096, 8192), metavar="S,S,...",
                        help="sequence lengths, K = 1024 (default: 1K,2K,4K,8K)")
    parser.add_argument("--layers", type=parse_int_list, default=(4, 8), metavar="L,L",
                        help="two layer counts; the per-layer figures are the difference (default: 4,8)")
    parser.add_argument("--layouts", default=ONE, metavar="LAYOUT,...",
                        help="1 (one process) or degrees joined by x (tp, ulysses, ring, pp, dp), with zero3 for ZeRO "
                             "stage 3, e.g. 1,ulysses2,tp2,ring2,pp2,dp2xzero3: every row runs under each, one process "
                             "per rank (default: 1)")
    parser.add_argument("--rows", default=",".join(row_key(r) for r in ROWS), metavar="ROW,...",
                        help="rows to run (default: %(default)s)")
    add_int_options(parser, {"hidden": (256, "hidden size"), "heads": (8, "attention heads"),
                             "mlp_tile": (1024, "tokens per tiled-MLP tile"),
                             "loss_tile": (1024, "tokens per tiled-loss tile")})
    parser.add_argument("--budget-mib", type=float, default=1024.0,
                        help="per-rank budget for the longest-sequence column (default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="S = 256, 512, L = 1, 2, hidden 32, 4 heads, tiles 64 (a smoke test)")


def _config(shape: dict, layers: int, seq_len: int):
    from ds4sci.models.genslm import GenSLMConfig

    return GenSLMConfig(vocab_size=VOCAB, hidden_size=shape["hidden"], num_layers=layers, num_heads=shape["heads"],
                        max_position_embeddings=seq_len, attention_backend="chunked")


def _measure_layout(switches: dict, shape: dict, layout: str, runs: list[tuple[int, int]]) -> list[dict]:
    """Each run's ``(L, S)`` figures on this rank under ``layout``, in order (module docstring): ``saved``, ``host``,
    ``device`` and ``peak`` bytes, the blocks this rank holds (``held``), its parameter and gradient bytes."""
    import torch
    from deepspeed.runtime.pipe.schedule import ForwardPass

    from ds4sci.bench.memory import PeakMemory
    from ds4sci.bench.memory import distinct_bytes
    from ds4sci.bench.memory import model_states
    from ds4sci.distributed.groups import build_groups
    from ds4sci.models.genslm import GenSLM
    from ds4sci.parallel.genslm_tp import token_loss_for
    from ds4sci.parallel.parallelize import parallelize
    from ds4sci.sequence import shard_sequence
    from ds4sci.train.activation_checkpointing import apply_activation_checkpointing
    from ds4sci.train.config import ActivationCheckpointingConfig
    from ds4sci.train.config import load_config
    from ds4sci.train.engine import build_engine
    from ds4sci.train.loss import global_target_count
    from ds4sci.train.pipeline import BlockStage
    from ds4sci.train.pipeline import build_pipeline_engine
    from ds4sci.train.pipeline import pipeline_reduction_factor
    from ds4sci.train.pipeline import pipeline_train_batch

    groups = build_groups(dims(layout))
    d, zero = groups.dims, zero_stage(layout)
    engine_cfg = load_config(None, [f"zero.stage={zero}", f"parallel.pp={d.pp}"]) if uses_engine(layout) else None
    loss_fn = token_loss_for(groups)
    results = []
    for layers, seq_len in runs:
        torch.manual_seed(0)
        model = GenSLM(_config(shape, layers, seq_len)).train()
        parallelize(model, groups)
        offload = apply_activation_checkpointing(model, ActivationCheckpointingConfig(
            **switches, mlp_tile=shape["mlp_tile"], loss_tile=shape["loss_tile"]))
        storages: dict[int, int] = {}  # storage object -> bytes; an offloaded storage keeps its object, not its memory
        host = [0]  # the most HostOffload held after a checkpointed block's forward (all of them after the last)

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            # parameters, also ZeRO-3's gathered ones, whose storage changes from gather to gather
            if not isinstance(t, torch.nn.Parameter) and storage.nbytes() and storage.data_ptr() not in {
                    p.untyped_storage().data_ptr() for p in model.parameters()}:
                storages[storage._cdata] = storage.nbytes()
            return t

        if model.checkpoint_fn is not None:  # count the checkpoint's inputs, which its reentrant Function keeps itself
            inner = model.checkpoint_fn

            def counted(block, *args, inner=inner):
                for a in args:
                    if isinstance(a, torch.Tensor):
                        pack(a)
                out = inner(block, *args)
                host[0] = max(host[0], offload.offloaded_bytes if offload is not None else 0)
                return out

            model.checkpoint_fn = counted  # before the pipeline's stages read it
        grads = {}
        if d.pp > 1:
            engine = build_pipeline_engine(model, None, engine_cfg, groups, torch.device("cpu"))
            held = sum(isinstance(f, BlockStage) for f in engine.module.forward_funcs)
        elif engine_cfg is not None:
            engine = build_engine(model, engine_cfg, groups, torch.device("cpu"))
            held = layers
        else:
            engine, held = None, layers
        if engine is not None:  # the gradients the optimizer is handed (ZeRO: this rank's partition)
            opt = engine.basic_optimizer
            original = opt.step

            def step_counted(*args, _original=original, _opt=opt, _engine=engine, **kwargs):
                grads["bytes"] = distinct_bytes([p.grad for p in _engine.module.parameters()]
                                                 + [q.grad for g in _opt.param_groups for q in g["params"]])
                return _original(*args, **kwargs)

            opt.step = step_counted

        def step(n: int, hooks: bool) -> None:
            g = torch.Generator().manual_seed(n)
            ids = torch.randint(0, VOCAB, (1, n + 1), generator=g)  # [1, n + 1]: inputs and shifted targets
            batch = {"input_ids": ids[:, :-1], "position_ids": torch.arange(n)[None], "targets": ids[:, 1:]}
            batch = {k: shard_sequence(v, 1, groups.sp_rank, d.sp, d.layout) for k, v in batch.items()}  # [1, n/sp]
            inputs = (batch["input_ids"], batch["position_ids"])
            host[0] = 0
            if d.pp > 1:  # the pipeline engine's 1F1B step over one micro-batch, optimizer step included; the hooks
                # see its forward passes only (backward's recomputation saves what it frees at once)
                engine.reset_activation_shape()  # the stages' send and receive buffers: new length
                instructions = type(engine)._INSTRUCTION_MAP
                forward_pass = instructions[ForwardPass]

                def hooked(self, *args, **kwargs):
                    with torch.autograd.graph.saved_tensors_hooks(pack if hooks else (lambda t: t), lambda t: t):
                        return forward_pass(self, *args, **kwargs)

                engine._INSTRUCTION_MAP = {**instructions, ForwardPass: hooked}  # the schedule's dispatch
                count = global_target_count([batch["targets"]], groups.sdp)
                pipeline_train_batch(engine, groups, [batch], count, pipeline_reduction_factor(d))
                del engine._INSTRUCTION_MAP
                return
            with torch.autograd.graph.saved_tensors_hooks(pack if hooks else (lambda t: t), lambda t: t):
                forward = model if engine is None else engine
                if switches.get("tiled_loss"):  # the head computes the summed loss tile by tile
                    loss = forward(*inputs, targets=batch["targets"])
                else:
                    loss = loss_fn(forward(*inputs), batch["targets"], "sum")
            if engine is None:
                loss.backward()
            else:
                engine.backward(loss)

        def finish() -> None:  # the update, outside the measured step
            if engine is None:
                grads["bytes"] = distinct_bytes([p.grad for p in model.parameters()])
                model.zero_grad(set_to_none=True)
            elif d.pp == 1:
                engine.step()

        step(_WARMUP_TOKENS, hooks=False)
        finish()
        storages.clear()
        with PeakMemory("cpu") as peak:
            step(seq_len, hooks=True)
        finish()
        saved = sum(storages.values())
        params = (model_states(engine, {"grads": 0})["params"] if engine is not None
                  else distinct_bytes(list(model.parameters())))
        results.append({"saved": saved, "host": host[0], "device": saved - host[0], "peak": peak.bytes,
                        "held": held, "params": params, "grads": grads["bytes"]})
        if engine is not None:
            engine.destroy()
    return results


def _worker(rank: int, world: int, switches: dict, shape: dict, layouts: list[str], runs: list[tuple[int, int]]
            ) -> list[list[dict]]:
    """Per layout (one world size), each run's figures on this rank (:func:`_measure_layout`)."""
    from ds4sci.train.engine import init_distributed

    init_distributed()
    return [_measure_layout(switches, shape, layout, runs) for layout in layouts]


def measure(row: str, shape: dict, runs: list[tuple[int, int]], layouts: str | list[str] = ONE) -> list[dict]:
    """One process group measures ``row`` at each ``(L, S)`` of ``runs`` in turn under each of ``layouts`` (a
    layout, or several of one world size, each with its own groups): per layout and run the largest ``saved``,
    ``host``, ``device``, ``peak``, ``held``, ``params`` and ``grads`` over the ranks and each rank's (``ranks``)."""
    from ds4sci.spawn import run_workers

    layouts = [layouts] if isinstance(layouts, str) else list(layouts)
    worlds = {dims(layout).world_size for layout in layouts}
    if len(worlds) != 1:
        raise ValueError(f"layouts {', '.join(layouts)}: one process group runs layouts of one world size")
    start = time.perf_counter()
    per_rank = run_workers(_worker, worlds.pop(), ROWS[row], shape, layouts, list(runs), timeout=3600,
                           env={"DS_ACCELERATOR": "cpu"})
    seconds = round(time.perf_counter() - start, 1)
    out = []
    for j, layout in enumerate(layouts):
        for i, (layers, seq_len) in enumerate(runs):
            ranks = [r[j][i] for r in per_rank]
            out.append({"layout": layout, "row": row, "layers": layers, "seq_len": seq_len,
                        **{k: max(r[k] for r in ranks) for k in RANK_KEYS}, "ranks": ranks, "seconds": seconds})
    return out


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x``: ``(a, b)``."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def planner(row: str, shape: dict, layers: int, seq_len: int, layout: str = ONE) -> dict:
    """The planner's figures for ``row`` under ``layout`` at one length, per rank: bytes per token of the full
    sequence per layer on the device, the working set per token (what backward adds above the saved tensors), host
    bytes, the step's peak, the blocks a rank holds (``held``: ``L / pp`` with one micro-batch in flight) and its
    parameter and gradient bytes (module docstring)."""
    from ds4sci.planning import genslm as plan

    switches = ROWS[row]
    d, zero = dims(layout), zero_stage(layout)
    w = plan.Workload(_config(shape, layers, seq_len), seq_len, dtype="fp32")  # one micro-batch per step
    strategy = plan.Strategy(d, zero_stage=zero, checkpointing=switches["mode"], mlp_tile=shape["mlp_tile"] if
                             switches.get("tiled_mlp") else 0, offload_activations=switches.get("cpu", False),
                             loss_tile=shape["loss_tile"] if switches.get("tiled_loss") else 0)
    held = math.ceil(layers / d.pp) * min(d.pp, w.grad_accum)  # the planner's layers in flight on a rank
    local = d.sp * d.tp  # the planner counts per local token: S / (sp tp) of them on a rank
    per_layer = (plan.layer_activation_bytes(w, strategy, strategy.checkpointing)
                 - plan.offloaded_layer_bytes(w, strategy)) / local
    terms = plan.memory(w, strategy)
    buffers = max(terms.a2a_staging, terms.ring_buffers)  # alive one after the other: the larger counts
    # ZeRO-3 gathers parameters during the step (its partitions and persistent ones exist before it)
    peak = terms.activations + terms.workspace + terms.attention + terms.grads + buffers + terms.gathered_params
    # saved outside the layers (ids, final norm, logits or the tiled loss's targets): the activations without
    # checkpointing less its layers'
    plain = plan.Strategy(d, loss_tile=strategy.loss_tile)
    outside = (plan.memory(w, plain).activations / seq_len
               - held * plan.layer_activation_bytes(w, plain, "none") / local)
    working = (terms.activations + terms.workspace + buffers) / seq_len - held * per_layer - outside
    return {"per_layer": per_layer, "working_per_token": working, "host": terms.host_activations, "peak": peak,
            "held": held, "params": terms.params + terms.persistent_params, "grads": terms.grads}


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
            # per block a rank holds (a pipeline stage: L / pp of them)
            per_layer = [(runs[large, s]["device"] - runs[small, s]["device"])
                         / ((runs[large, s]["held"] - runs[small, s]["held"]) * s) for s in lengths]
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
                         "longest_within_budget": longest, "planner_longest_within_budget": lo,
                         **{k: runs[large, lengths[-1]][k] for k in ("held", "params", "grads")},
                         **{f"planner_{k}": predicted[k] for k in ("held", "params", "grads")}})
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
    lines += ["", "Per layer on device: the slope of saved-minus-offloaded bytes over S x the blocks a rank holds "
              "(L, or L / pp on a pipeline stage). Working set: the slope over S of peak RSS minus the device-side "
              "saved bytes at the larger L. Longest S: the fit `peak = a + b S` at the larger L extrapolated to the "
              "budget; the planner's: its activations + workspace + attention + gradients + sequence-parallel "
              "buffers (+ ZeRO-3's gathered parameters) within the budget. Under TP the "
              "column-parallel layers save this rank's sequence region of their inputs and gather it again in "
              "backward (the rows without checkpointing show it). On a CPU the \"host\" copies of host offload are "
              "in the same process's RSS, so its peak does not fall here as it does on a GPU.", "",
              f"Per rank at L={max(c['layers'])}: the blocks it holds (a pipeline stage's, with one micro-batch in "
              "flight: 1F1B keeps up to `pp` on the first stage when a step has that many), its parameter bytes "
              "(ZeRO-3: its partitions and the tensors kept gathered) and the gradient bytes handed to the optimizer "
              "(ZeRO-3: its partition), measured beside the planner's:", ""]
    states = {s["layout"]: s for s in report["summary"]}  # the same for every row of a layout
    lines += markdown_table(["layout", "blocks held", "planner", "parameter KiB", "planner", "gradient KiB", "planner"],
                            [[layout_name(layout), s["held"], s["planner_held"], f"{s['params'] / 1024:.1f}",
                              f"{s['planner_params'] / 1024:.1f}", f"{s['grads'] / 1024:.1f}",
                              f"{s['planner_grads'] / 1024:.1f}"] for layout, s in states.items()])
    lines += ["", "Peak MiB (RSS above the step's start, the most loaded rank):", ""]
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
    """Peak MiB per rank against S at the larger layer count, one line per layout and row."""
    L = max(report["config"]["layers"])
    curves = {}
    for layout in report["config"]["layouts"]:
        for row in ROWS:
            runs = sorted((r for r in report["runs"] if r["layout"] == layout and r["row"] == row and r["layers"] == L),
                          key=lambda r: r["seq_len"])
            if runs:
                curves[f"{layout_name(layout)}: {row}"] = ([r["seq_len"] for r in runs],
                                                           [r["peak"] / MIB for r in runs])
    plot_peaks(path, curves, report["config"]["budget_mib"], f"peak MiB per rank, {L} layers (forward + backward)")


def _rows(text: str) -> list[str]:
    """``--rows``' names -> the rows, in table order. ``ValueError`` naming an unknown one."""
    keys = {row_key(r): r for r in ROWS}
    given = [t.strip() for t in text.split(",")]
    unknown = [t for t in given if t not in keys]
    if unknown:
        raise ValueError(f"--rows {','.join(unknown)}: not a row (rows: {', '.join(keys)})")
    return [r for r in ROWS if row_key(r) in given]


def run(args: argparse.Namespace) -> int:
    from ds4sci.bench.memory import allocator_settings
    from ds4sci.bench.memory import describe_allocator

    if args.quick:
        seq_lens, layers, shape = (256, 512), (1, 2), {"hidden": 32, "heads": 4, "mlp_tile": 64, "loss_tile": 64}
    else:
        seq_lens, layers = args.seq_lens, args.layers
        shape = {"hidden": args.hidden, "heads": args.heads, "mlp_tile": args.mlp_tile, "loss_tile": args.loss_tile}
    for name, value in (("--hidden", shape["hidden"]), ("--heads", shape["heads"]), ("--mlp-tile", shape["mlp_tile"]),
                        ("--loss-tile", shape["loss_tile"]), ("--budget-mib", args.budget_mib)):
        if value <= 0:
            raise ValueError(f"{name}={value:g}: must be > 0")
    check_heads(shape["hidden"], shape["heads"])
    if len(layers) != 2 or len(seq_lens) < 2:
        raise ValueError(f"--layers {','.join(map(str, layers))}: give two layer counts, and at least two --seq-lens")
    layouts = list(dict.fromkeys(t.strip() for t in args.layouts.split(",")))
    rows = _rows(args.rows)
    for layout in layouts:
        d = dims(layout)
        cfg = _config(shape, min(layers), max(seq_lens))  # the fewer layers: enough for the pipeline's stages?
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
    jobs = [(layout, row, L, s) for layout in layouts for row in rows for L in layers for s in seq_lens]
    bar = progress_bar(True, total=len(jobs), desc="ablation", unit="run")
    for i, (layout, row, L, s) in enumerate(jobs, 1):
        what = f"{layout}, {row_key(row)}, {L} layers, S = {s}"
        if bar.disable:  # a log, not a terminal: one line per run (each takes seconds to a minute)
            logger.info("ablation: run %d of %d: %s", i, len(jobs), what)
        bar.set_postfix_str(what)
        report["runs"] += measure(row, shape, [(L, s)], layout)  # a fresh process group per run: its own peak
        bar.update()
    bar.close()
    report["summary"] = summarize(report)
    write_files(args.out, "ablation", report, markdown(report), plot)
    return 0
