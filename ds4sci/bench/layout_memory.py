"""``ds4sci bench layouts``: per-rank model states, activations and bytes sent of real training steps, layout by
layout, beside :mod:`ds4sci.planning.genslm`'s prediction of each term.

For each layout (``tp2xulysses2``, ``pp2xring2``, ...; data parallelism fills the rest of ``--world``) and ZeRO stage,
``--world`` gloo processes (:func:`ds4sci.spawn.run_workers`) build the real training stack,
:class:`ds4sci.train.trainer.Trainer`, on a synthetic nucleotide FASTA (fp32, one sequence of ``--seq-len`` tokens
per data rank, rotary positions, no activation checkpointing). Step 1 runs unmeasured (DeepSpeed and AdamW allocate
their state lazily); step 2 is measured on every rank:

- ``params``, ``grads`` (when the optimizer steps) and ``optimizer`` (AdamW's moments plus DeepSpeed's fp32 master
  copies): :func:`ds4sci.bench.memory.model_states`, each storage once;
- ``activations``: the peak over the step of the bytes saved for backward and not yet released (every storage
  packed through ``saved_tensors_hooks``, parameters left out, from its packing until autograd drops it, so 1F1B's
  micro-batches in flight count as they overlap);
- bytes sent per process group and collective kind, counted at the methods of ``torch.distributed.ProcessGroup``
  (every library's collectives pass there) with :class:`~ds4sci.distributed.comm.CommCounter`'s conventions.

The prediction is :func:`ds4sci.planning.genslm.memory` and :func:`ds4sci.planning.genslm.comm` for the same model and
layout, fp32; the report gives measured / predicted per term for the most loaded rank. Measured ``dp`` is everything
sent over the sequence x data group, ``pp`` the pipeline's sends, ``other`` what fits no term (pipeline bookkeeping and
ZeRO-3 broadcasts on the default group).
"""
from __future__ import annotations

import argparse
import contextlib
import re
import tempfile
import time
import weakref
from dataclasses import asdict
from pathlib import Path

from ds4sci.bench.report import MIB
from ds4sci.bench.report import add_int_options
from ds4sci.bench.report import markdown_table
from ds4sci.bench.report import plural
from ds4sci.bench.report import save_figure
from ds4sci.bench.report import shape_options
from ds4sci.bench.report import subplots
from ds4sci.bench.report import write_files
from ds4sci.distributed import ParallelDims

MEMORY_TERMS = ("params", "grads", "optimizer", "activations")
COMM_TERMS = ("tp", "ulysses", "ring", "pp", "dp")
AXES = ("tp", "ulysses", "ring", "pp", "dp")
DEFAULT_LAYOUTS = "dp4,ulysses4,ring4,ulysses2xring2,tp2xulysses2,tp4,pp2xulysses2,tp2xpp2"
_AXIS = re.compile(r"(tp|ulysses|ring|pp|dp)([1-9][0-9]*)")


def parse_layout(text: str, world: int | None) -> dict[str, int]:
    """``"tp2xulysses2"`` -> ``{"tp": 2, "ulysses": 2, "ring": 1, "pp": 1, "dp": world / 4}``: degrees joined by
    ``x``; data parallelism fills the rest of ``world`` unless given (``world=None``: the world is the degrees'
    product). ``ValueError`` naming ``text`` otherwise."""
    degrees = dict.fromkeys(AXES, 1)
    given = set()
    for part in text.split("x"):
        m = _AXIS.fullmatch(part)
        if m is None or m.group(1) in given:
            raise ValueError(f"layout {text!r}: expected degrees like tp2xulysses2 (axes {', '.join(AXES)}, each once)")
        given.add(m.group(1))
        degrees[m.group(1)] = int(m.group(2))
    product = degrees["tp"] * degrees["ulysses"] * degrees["ring"] * degrees["pp"] * degrees["dp"]
    world = product if world is None else world
    if "dp" not in given and world % product == 0:
        degrees["dp"] = world // product
    elif product != world:
        raise ValueError(f"layout {text!r}: its degrees multiply to {product}, not --world={world}")
    return degrees


def _stages(text: str) -> tuple[int, ...]:
    """``"0,1,3"`` -> ``(0, 1, 3)``: distinct ZeRO stages 0-3, sorted (the ``type=`` of ``--zero-stages``)."""
    items = [t.strip() for t in text.split(",")]
    if not all(t in ("0", "1", "2", "3") for t in items):
        raise argparse.ArgumentTypeError(f"{text!r}: expected ZeRO stages 0-3 separated by commas, e.g. 0,1,3")
    return tuple(sorted({int(t) for t in items}))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The shape and run options (``--out`` is added by :mod:`ds4sci.bench`)."""
    parser.add_argument("--layouts", default=DEFAULT_LAYOUTS, metavar="L,L,...",
                        help="layouts: degrees joined by x (tp, ulysses, ring, pp, dp; dp fills the rest of --world) "
                             "(default: %(default)s)")
    parser.add_argument("--world", type=int, default=4, help="processes (default: %(default)s)")
    parser.add_argument("--zero-stages", type=_stages, default=(0, 1, 2, 3), metavar="Z,Z,...",
                        help="ZeRO stages 0-3; with pp > 1 only 0 and 1 run (default: 0,1,2,3)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default: %(default)s)")
    # at hidden 256 the block's matrices exceed ZeRO-3's persistence threshold: gathered per layer, as at scale
    add_int_options(parser, shape_options(hidden=256, layers=4, heads=8))
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="world 2: dp2 at ZeRO 1, tp2 at ZeRO 0; S = 64, hidden 32, 2 layers (a smoke test)")


# ------------------------------------------------------------------------------------------------ measurement
class _SentBytes:
    """Bytes this rank sends, by (process group label, collective kind), while installed on ``ProcessGroup``."""

    # ProcessGroup method -> (kind, index of the argument holding this rank's contribution, bytes sent from its size n,
    # the group size P and whether this rank is the root)
    RULES = {
        "allreduce": ("all_reduce", 0, lambda n, P, root: 2 * n * (P - 1) // P),
        "allreduce_coalesced": ("all_reduce", 0, lambda n, P, root: 2 * n * (P - 1) // P),
        **{m: ("all_gather", 1, lambda n, P, root: n * (P - 1))
           for m in ("allgather", "allgather_coalesced", "allgather_into_tensor_coalesced", "_allgather_base",
                     "all_gather_single", "all_gather_single_coalesced")},
        **{m: ("all_to_all", 1, lambda n, P, root: n * (P - 1) // P)
           for m in ("alltoall", "alltoall_base", "all_to_all_single")},
        **{m: ("reduce_scatter", 1, lambda n, P, root: n * (P - 1) // P)
           for m in ("reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single",
                     "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced")},
        "broadcast": ("broadcast", 0, lambda n, P, root: n * (P - 1) if root else 0),
        "reduce": ("reduce", 0, lambda n, P, root: 0 if root else n),
        "gather": ("gather", 1, lambda n, P, root: 0 if root else n),
        "scatter": ("scatter", 1, lambda n, P, root: n * (P - 1) // P if root else 0),
        "send": ("p2p", 0, lambda n, P, root: n),
    }

    def __init__(self, labels) -> None:
        self.labels = labels  # ProcessGroup -> label
        self.sent: dict[str, dict[str, int]] = {}

    def _record(self, pg, method: str, args, kwargs) -> None:
        import torch

        kind, index, rule = self.RULES[method]
        arg = args[index] if len(args) > index else next(iter(kwargs.values()))
        tensors = [t for t in _flatten(arg) if isinstance(t, torch.Tensor)]
        n = sum(t.numel() * t.element_size() for t in tensors)
        opts = next((a for a in args[index + 1:] if hasattr(a, "rootRank")), None)
        root = opts is not None and opts.rootRank == pg.rank()
        label = self.labels(pg)
        by_kind = self.sent.setdefault(label, {})
        by_kind[kind] = by_kind.get(kind, 0) + rule(n, pg.size(), root)

    @contextlib.contextmanager
    def installed(self):
        import torch.distributed as dist

        cls = dist.ProcessGroup
        # from the class dict: pybind11 methods go back as they were (``getattr`` gives an unbound function)
        originals = {m: cls.__dict__[m] for m in self.RULES if m in cls.__dict__}

        def wrap(method, original):
            def counted(pg, *args, **kwargs):
                self._record(pg, method, args, kwargs)
                return original.__get__(pg)(*args, **kwargs)
            return counted

        for method, original in originals.items():
            setattr(cls, method, wrap(method, original))
        try:
            yield self
        finally:
            for method, original in originals.items():
                setattr(cls, method, original)


def _flatten(x):
    if isinstance(x, (list, tuple)):
        for item in x:
            yield from _flatten(item)
    else:
        yield x


def _group_labels(groups):
    """A function ProcessGroup -> label: the name of ds4sci's group (``tp``, ``ulysses``, ``ring``, ``sp``, ``dp``,
    ``sdp``, ``pp``), ``world`` for the default group, or for a group built elsewhere (DeepSpeed's pipeline engine
    builds its own data-parallel groups) ``group(AXES)``, the axes its ranks span (``group()``: one rank)."""
    import torch.distributed as dist

    known = {id(dist.group.WORLD): "world"}
    for name in ("tp", "ulysses", "ring", "sp", "dp", "sdp", "pp"):
        known.setdefault(id(getattr(groups, name)), name)
    dims = groups.dims

    def label(pg) -> str:
        if id(pg) in known:
            return known[id(pg)]
        coords = [dims.coords(r) for r in dist.get_process_group_ranks(pg)]
        return f"group({'+'.join(a for a in coords[0]._fields if len({getattr(c, a) for c in coords}) > 1)})"

    return label


class _LiveSaved:
    """Peak bytes saved for backward and not yet released (unique storages; parameters left out)."""

    def __init__(self, params) -> None:
        self.params = params  # data pointers of parameter storages
        self.live: dict[int, list[int]] = {}  # data pointer -> [bytes, references]
        self.now = self.peak = 0

    def _release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[ptr]

    def pack(self, t):
        import torch

        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if isinstance(t, torch.nn.Parameter) or ptr in self.params or storage.nbytes() == 0:
            return t
        entry = self.live.setdefault(ptr, [storage.nbytes(), 0])
        if entry[1] == 0:
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        box = _Box(t)
        weakref.finalize(box, self._release, ptr)
        return box

    @staticmethod
    def unpack(x):
        return x.tensor if isinstance(x, _Box) else x


class _Box:
    """What the pack hook hands autograd: the saved tensor, whose release autograd signals by dropping the box."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor) -> None:
        self.tensor = tensor


def _worker(rank: int, world: int, cases: list[dict], common: dict) -> list[dict]:
    """Every case in this process group: a Trainer, one unmeasured step, one measured step."""
    import torch

    from ds4sci.bench.memory import distinct_bytes
    from ds4sci.bench.memory import model_states
    from ds4sci.train.config import load_config
    from ds4sci.train.trainer import Trainer

    results = []
    for i, case in enumerate(cases):
        d = case["degrees"]
        overrides = [
            f"data.fasta={common['fasta']}", f"data.seq_len={common['seq_len']}", "data.val_fraction=0.01",
            f"data.cache_dir={common['tmp']}/cache", "data.tokenizer=nucleotide", "model.preset=debug",
            f"model.overrides.hidden_size={common['hidden']}", f"model.overrides.num_heads={common['heads']}",
            f"model.overrides.num_layers={common['layers']}", "model.overrides.position_embedding=rotary",
            f"model.overrides.max_position_embeddings={common['seq_len']}",
            *(f"parallel.{a}={d[a]}" for a in ("tp", "ulysses", "ring", "pp")), f"zero.stage={case['zero']}",
            "train.micro_batch_size=1", "train.steps=2", "train.progress=false", "train.eval_every=0",
            f"train.out_dir={common['tmp']}/run{i}", "optim.grad_clip=1.0",
        ]
        trainer = Trainer(load_config(None, overrides))
        trainer.train_step()  # DeepSpeed's buffers and AdamW's moments appear in the first step
        engine = trainer.engine
        at_step = {}
        opt = engine.basic_optimizer
        original_step = opt.step

        def step(*args, _original=original_step, _engine=engine, **kwargs):
            grads = [p.grad for p in _engine.module.parameters()]
            grads += [q.grad for g in opt.param_groups for q in g["params"]]
            at_step["grads"] = distinct_bytes(grads)
            return _original(*args, **kwargs)

        opt.step = step
        params = {p.untyped_storage().data_ptr() for p in engine.module.parameters() if p.numel()}
        saved = _LiveSaved(params)
        sent = _SentBytes(_group_labels(trainer.groups))
        start = time.perf_counter()
        with sent.installed(), torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            trainer.train_step()
        seconds = time.perf_counter() - start
        del opt.step
        results.append({**model_states(engine, at_step), "activations": saved.peak, "sent": sent.sent,
                        "coords": trainer.groups.coords._asdict(), "step_seconds": seconds})
        del trainer, engine
    return results


def predicted(common: dict, degrees: dict, zero: int) -> tuple[dict, dict]:
    """:func:`ds4sci.planning.genslm.memory` and :func:`~ds4sci.planning.genslm.comm` of the benchmarked model and
    layout (fp32), as dicts by term and by group."""
    from ds4sci.data import NucleotideTokenizer
    from ds4sci.models.genslm import GenSLMConfig
    from ds4sci.planning import genslm as plan

    model = GenSLMConfig.preset("debug", vocab_size=NucleotideTokenizer().vocab_size, hidden_size=common["hidden"],
                                num_heads=common["heads"], num_layers=common["layers"], position_embedding="rotary",
                                max_position_embeddings=common["seq_len"])
    w = plan.Workload(model, common["seq_len"], dtype="fp32")
    strategy = plan.Strategy(ParallelDims(**degrees), zero_stage=zero)
    mem = asdict(plan.memory(w, strategy))
    # measured between steps: ZeRO-3's partitions and the parameters it keeps gathered (persistent), not the ones
    # it gathers for a module's use
    return {**mem, "params": mem["params"] + mem["persistent_params"]}, asdict(plan.comm(w, strategy))


def _term(label: str, kind: str) -> str:
    """The planner's term of bytes sent by ``kind`` on group ``label`` (:func:`_group_labels`)."""
    if label in ("tp", "ulysses", "ring", "pp"):
        return label
    if label in ("sdp", "sp", "dp"):  # ZeRO's gradient and parameter traffic, the trainer's loss sums
        return "dp"
    if kind == "p2p":  # DeepSpeed's pipeline sends activations and gradients on the default group
        return "pp"
    axes = set(label[len("group("):-1].split("+")) if label.startswith("group(") else set()
    if axes and axes <= {"dp", "ring", "ulysses"}:  # the pipeline engine's own data-parallel group
        return "dp"
    return "other"


def comm_terms(sent: dict[str, dict[str, int]]) -> dict[str, int]:
    """Measured bytes sent, by the planner's terms (:data:`COMM_TERMS`) plus ``other`` (what fits none)."""
    out = dict.fromkeys((*COMM_TERMS, "other"), 0)
    for label, kinds in sent.items():
        for kind, nbytes in kinds.items():
            out[_term(label, kind)] += nbytes
    return out


def run_cases(cases: list[dict], common: dict, world: int, threads: int) -> list[dict]:
    """Measure ``cases`` (``{"layout", "degrees", "zero"}``) in one group of ``world`` processes; one row per case."""
    import numpy as np

    from ds4sci.spawn import run_workers

    with tempfile.TemporaryDirectory() as tmp:
        rng = np.random.default_rng(0)
        fasta = Path(tmp) / "synthetic.fasta"
        genome = "".join(rng.choice(list("ACGT"), common["seq_len"] * 40))
        fasta.write_text(">synthetic\n" + genome + "\n")
        per_rank = run_workers(_worker, world, cases, {**common, "fasta": str(fasta), "tmp": tmp},
                               timeout=3600, env={"DS_ACCELERATOR": "cpu"}, threads=threads)
    rows = []
    for i, case in enumerate(cases):
        ranks = [r[i] for r in per_rank]
        mem, com = predicted(common, case["degrees"], case["zero"])
        measured = {k: max(r[k] for r in ranks) for k in MEMORY_TERMS}
        sent = [comm_terms(r["sent"]) for r in ranks]
        measured_comm = {k: max(s[k] for s in sent) for k in (*COMM_TERMS, "other")}
        rows.append({**case, "measured": measured, "measured_sent": measured_comm,
                     "predicted": {k: mem[k] for k in MEMORY_TERMS},
                     "predicted_sent": {k: com[k] for k in COMM_TERMS},
                     "ranks": ranks})
    return rows


# ----------------------------------------------------------------------------------------------------- report
def _ratio(measured: float, predicted: float) -> str:
    if predicted == 0:
        return "-" if measured == 0 else "inf"
    return f"{measured / predicted:.2f}"


def markdown(report: dict) -> str:
    c = report["config"]
    lines = [f"# layouts: per-rank bytes of one training step, GenSLM hidden {c['hidden']}, "
             f"{plural(c['heads'], 'head')}, {plural(c['layers'], 'layer')}, S = {c['seq_len']}, fp32, "
             f"world {c['world']}", "",
             f"Command: `{report['command']}`", "",
             "Memory (MiB per rank, most loaded rank; in brackets measured / ds4sci.planning's prediction):", ""]
    rows = []
    for r in report["runs"]:
        m, p = r["measured"], r["predicted"]
        rows.append([r["layout"], r["zero"]] + [f"{m[k] / MIB:.3f} ({_ratio(m[k], p[k])})" for k in MEMORY_TERMS])
    lines += markdown_table(["layout", "ZeRO", *MEMORY_TERMS], rows)
    lines += ["", "Bytes sent per rank in the step (MiB, most loaded rank; measured / predicted):", ""]
    rows = []
    for r in report["runs"]:
        m, p = r["measured_sent"], r["predicted_sent"]
        rows.append([r["layout"], r["zero"]] + [f"{m[k] / MIB:.3f} ({_ratio(m[k], p[k])})" for k in COMM_TERMS]
                    + [f"{m['other']:,} B"])
    lines += markdown_table(["layout", "ZeRO", *COMM_TERMS, "other"], rows)
    lines += ["", "How each term is measured: the docstring of ds4sci.bench.layout_memory. `-`: both zero; `inf`: "
              "measured where the planner predicts nothing. params are counted after the step: ZeRO-3's gathered "
              "copies in flight during forward and backward (the planner's two layers) are not. dp: everything sent "
              "over the sequence x data group (ZeRO's reductions and gathers, the trainer's loss sums); pp: the "
              "pipeline's sends; other: small collectives on other groups (the pipeline engine's bookkeeping, ZeRO-3's "
              "broadcasts on the default group)."]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    runs = report["runs"]
    names = [f"{r['layout']} z{r['zero']}" for r in runs]
    fig, axes = subplots(2, 1, figsize=(max(7, 0.6 * len(runs)), 9))
    for ax, key, terms, title in ((axes[0], "measured", MEMORY_TERMS, "MiB per rank (most loaded)"),
                                  (axes[1], "measured_sent", COMM_TERMS, "MiB sent per rank per step")):
        bottom = [0.0] * len(runs)
        for term in terms:
            values = [r[key][term] / MIB for r in runs]
            ax.bar(names, values, bottom=bottom, label=term)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_ylabel(title)
        ax.legend(fontsize=8)
        ax.tick_params(axis="x", rotation=60, labelsize=8)
    save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    if args.quick:
        world, names, stages = 2, ("dp2", "tp2"), (1, 0)
        pairs = [("dp2", 1), ("tp2", 0)]
        common = {"seq_len": 64, "hidden": 32, "heads": 4, "layers": 2}
    else:
        world, stages = args.world, args.zero_stages
        names = tuple(dict.fromkeys(t.strip() for t in args.layouts.split(",") if t.strip()))
        pairs = [(name, z) for name in names for z in stages]
        common = {"seq_len": args.seq_len, "hidden": args.hidden, "heads": args.heads, "layers": args.layers}
    for name, value in (("--world", world), ("--threads", args.threads), *((f"--{k.replace('_', '-')}", v)
                                                                           for k, v in common.items())):
        if value < 1:
            raise ValueError(f"{name}={value}: must be >= 1")
    degrees_of = {}
    for name in names:
        degrees = parse_layout(name, world)
        tp_u = degrees["tp"] * degrees["ulysses"]
        if common["heads"] % tp_u or common["hidden"] % common["heads"]:
            raise ValueError(f"layout {name}: tp x ulysses = {tp_u} must divide --heads={common['heads']}, which must "
                             f"divide --hidden={common['hidden']}")
        multiple = ParallelDims(**degrees).sequence_multiple  # the trainer's: zigzag with a ring
        if common["seq_len"] % multiple:
            raise ValueError(f"layout {name}: --seq-len={common['seq_len']} must be a multiple of {multiple}")
        if degrees["pp"] > common["layers"]:
            raise ValueError(f"layout {name}: pp={degrees['pp']} exceeds --layers={common['layers']}")
        degrees_of[name] = degrees
    # DeepSpeed's pipeline engine takes ZeRO 0 and 1 only
    cases = [{"layout": name, "degrees": degrees_of[name], "zero": z} for name, z in pairs
             if degrees_of[name]["pp"] == 1 or z <= 1]
    command = "ds4sci bench layouts " + ("--quick" if args.quick else (
        f"--layouts {','.join(names)} --world {world} --zero-stages {','.join(map(str, stages))} "
        f"--seq-len {common['seq_len']} --hidden {common['hidden']} --heads {common['heads']} "
        f"--layers {common['layers']}")) + f" --threads {args.threads}"
    start = time.perf_counter()
    runs = run_cases(cases, common, world, args.threads)
    report = {"command": command, "config": {**common, "world": world, "zero_stages": list(stages),
                                             "layouts": list(names), "threads": args.threads},
              "seconds": round(time.perf_counter() - start, 1), "runs": runs}
    write_files(args.out, "layouts", report, markdown(report), plot)
    return 0
