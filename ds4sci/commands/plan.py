"""``ds4sci plan``: which parallel layouts train a GenSLM at a given sequence length on a given cluster, how much
memory each GPU needs, how many bytes each GPU sends, and which layout should be fastest.

Parses the model, cluster and fixed choices, checks them (one line naming the value no layout can honour), and
prints the layouts :func:`ds4sci.planning.genslm_search.plan` finds as Markdown tables (``--out``: also
``plan.json``). The arithmetic is :mod:`ds4sci.planning`; its derivations are in ``docs/explanation/planner.md``.

Paper figures (DeepSpeed4Science, Song et al. 2023, arXiv:2310.04610, GenSLM section and Figure 9): on NVIDIA DGX
nodes of 8 A100-40GB GPUs, the new Megatron-DeepSpeed trains GenSLM 25B on 512K-token sequences on 64 GPUs, where
Argonne's original setup reached 42K; tests/planning/test_genslm_published.py sets the planner beside them.
"""
from __future__ import annotations

import argparse
import math
import textwrap
from dataclasses import asdict

from ds4sci.cli_args import CommandError
from ds4sci.cli_args import nonnegative_float
from ds4sci.cli_args import positive_int
from ds4sci.models.genslm.config import GenSLMConfig
from ds4sci.models.genslm.config import describe_preset
from ds4sci.models.genslm.config import describe_presets
from ds4sci.models.genslm.config import format_parameters
from ds4sci.planning.common import GIB
from ds4sci.planning.common import STATE_BYTES
from ds4sci.planning.genslm import CHECKPOINTING
from ds4sci.planning.genslm import CUDA_CONTEXT_BYTES
from ds4sci.planning.genslm import MASKS
from ds4sci.planning.genslm import OFFLOADS
from ds4sci.planning.genslm import Cluster
from ds4sci.planning.genslm import Workload
from ds4sci.planning.genslm import memory
from ds4sci.planning.genslm_search import Constraints
from ds4sci.planning.genslm_search import LayoutPlan
from ds4sci.planning.genslm_search import max_seq_len
from ds4sci.planning.genslm_search import plan
from ds4sci.planning.genslm_search import strategies
from ds4sci.report import markdown_table
from ds4sci.report import plural
from ds4sci.report import write_report

_FIXERS = ("tp", "ulysses", "ring", "pp", "dp")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Predict per-GPU memory and communication of every parallel layout (TP, Ulysses, Ring, PP, "
                          "DP, ZeRO stage, offload, activation checkpointing) of a GenSLM at a sequence length on a "
                          "cluster, and list those that fit, fastest first.")
    parser.epilog = ("Cost model: step time = FLOPs / (GPUs x peak x efficiency) / (1 - pipeline bubble) + sum of "
                     "bytes sent per group / that group's bandwidth (intra-node when the group lies inside a node in "
                     "the rank order TP < Ulysses < Ring < DP < PP, inter-node otherwise; offload over PCIe), no "
                     "overlap; FLOPs = 6 x tokens x params + 6 B L h S^2 (causal attention) + recomputation; bubble = "
                     "(pp-1)/(m+pp-1). Memory and byte formulas: docs/explanation/planner.md.")
    model = parser.add_argument_group("model (--preset, or a training config's model and data.seq_len)")
    model.add_argument("--preset",
                       help=f"model shape (parameters with the nucleotide vocabulary): {describe_presets()}")
    model.add_argument("--config", help="training config YAML; its model.* and data.seq_len are used (the layout "
                       "keys are searched, fix them with the options below)")
    model.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key as in ds4sci train, e.g. --set model.overrides.num_layers=84")
    model.add_argument("--seq-len", type=positive_int, help="tokens per sequence (default: the config's data.seq_len)")
    model.add_argument("--micro-batch", type=positive_int, default=1, help="sequences per micro-step (default: 1)")
    model.add_argument("--grad-accum", type=positive_int,
                       help="micro-steps per optimizer step, m of the pipeline bubble (default: 1; with --max-seq, "
                       "pipeline layouts take m = pp, which fills 1F1B's pipeline)")
    model.add_argument("--dtype", choices=tuple(STATE_BYTES), default="bf16", help="training dtype (default: bf16)")
    model.add_argument("--position-table", choices=("partitioned", "replicated"), default="partitioned",
                       help="learned position table: S/sp rows per rank (ds4sci) or S (default: partitioned)")
    model.add_argument("--mask", choices=MASKS, default="none",
                       help="attention mask policy; none: causal masking inside the kernel (default: none)")
    cluster = parser.add_argument_group("cluster (defaults: NVIDIA DGX A100)")
    cluster.add_argument("--gpus-per-node", type=positive_int, default=8, help="(default: 8)")
    cluster.add_argument("--nodes", type=positive_int, default=1, help="(default: 1)")
    cluster.add_argument("--gpu-mem-gib", type=nonnegative_float, default=40.0, help="GiB per GPU (default: 40)")
    cluster.add_argument("--reserve-gib", type=nonnegative_float, default=0.0,
                         help="GiB per GPU the user keeps free beyond every modelled term (default: 0)")
    cluster.add_argument("--peak-tflops", type=nonnegative_float, default=312.0, help="per GPU (default: 312)")
    cluster.add_argument("--efficiency", type=nonnegative_float, default=0.4,
                         help="fraction of peak the matmuls reach (default: 0.4)")
    cluster.add_argument("--intra-gbps", type=nonnegative_float, default=150.0,
                         help="GB/s per GPU inside a node (default: 150)")
    cluster.add_argument("--inter-gbps", type=nonnegative_float, default=25.0,
                         help="GB/s per GPU between nodes (default: 25)")
    cluster.add_argument("--pcie-gbps", type=nonnegative_float, default=25.0,
                         help="GB/s per GPU to host memory, for offload (default: 25)")
    device = parser.add_argument_group("device memory outside the model (each a term of the total)")
    device.add_argument("--cuda-context-gib", type=nonnegative_float, default=CUDA_CONTEXT_BYTES / GIB,
                        help="GiB the CUDA context takes per GPU (default: 0.267, PyTorch's measurement with lazy "
                        "module loading, pull request #86509)")
    device.add_argument("--nccl-buffsize-mib", type=nonnegative_float, default=4.0,
                        help="NCCL_BUFFSIZE in MiB: buffer per channel of each communicator (default: 4, NCCL's)")
    device.add_argument("--nccl-channels", type=positive_int, default=16,
                        help="NCCL channels per communicator (default: 16; NCCL picks 2-32 by topology)")
    device.add_argument("--fragmentation", type=nonnegative_float, default=0.3,
                        help="allocator fragmentation, as a fraction of the bytes allocated and freed within a step "
                        "(activations, working set, attention workspace, masks, sequence-parallel buffers) (default: "
                        "0.3: ZeRO found out-of-memory with over 30%% of memory still free; 0 for an allocator "
                        "that does not fragment, e.g. expandable segments)")
    fixed = parser.add_argument_group("fixed choices (searched when left out)")
    for name in _FIXERS:
        fixed.add_argument(f"--{name}", type=positive_int, help=f"{name} degree")
    fixed.add_argument("--zero-stage", type=int, choices=range(4), help="ZeRO stage")
    fixed.add_argument("--offload", choices=OFFLOADS, help="none, optimizer (ZeRO-Offload) or all (ZeRO-Infinity)")
    fixed.add_argument("--checkpointing", choices=CHECKPOINTING, help="activation checkpointing mode")
    fixed.add_argument("--mlp-tile", type=positive_int,
                       help="tiled MLP (activation_checkpointing.tiled_mlp) with tiles of this many tokens")
    fixed.add_argument("--loss-tile", type=positive_int,
                       help="tiled loss (activation_checkpointing.tiled_loss) with tiles of this many tokens")
    fixed.add_argument("--offload-activations", action="store_true", default=None,
                       help="checkpointed inputs in host memory (activation_checkpointing.cpu; needs checkpointing)")
    parser.add_argument("--max-seq", action="store_true", help="find the longest sequence some layout fits")
    parser.add_argument("--top", type=positive_int, default=10, help="layouts to list (default: 10)")
    parser.add_argument("--out", help="also write plan.json and plan.md to this folder")


def _workload(args: argparse.Namespace) -> tuple[Workload, dict]:
    from ds4sci.data.tokenizers import CodonTokenizer
    from ds4sci.data.tokenizers import NucleotideTokenizer
    from ds4sci.train.config import load_config

    if args.preset and args.config:
        raise CommandError(f"--preset={args.preset} and --config={args.config}: give one (or set model.preset)")
    overrides = ([f"model.preset={args.preset}"] if args.preset else []) + list(args.overrides)
    cfg = load_config(args.config, overrides)
    vocab = (CodonTokenizer() if cfg.data.tokenizer == "codon" else NucleotideTokenizer()).vocab_size
    model = GenSLMConfig.preset(cfg.model.preset, **{"vocab_size": vocab, **cfg.model.overrides})
    seq_len = args.seq_len or cfg.data.seq_len
    w = Workload(model, seq_len, micro_batch=args.micro_batch, grad_accum=args.grad_accum or 1, dtype=args.dtype,
                 position_table=args.position_table, mask=args.mask)
    return w, {"preset": cfg.model.preset, "overrides": cfg.model.overrides, "parameters": w.model_params}


def _check_fixed(w: Workload, cluster: Cluster, fixed: Constraints) -> None:
    """One line naming the fixed value no layout can honour."""
    given = fixed.degrees()
    product = math.prod(given.values())
    if cluster.world % product:
        raise CommandError(f"{' x '.join(f'--{a}={v}' for a, v in given.items())} = {product} does not divide the "
                           f"{cluster.world} GPUs (--nodes={cluster.nodes} x --gpus-per-node={cluster.gpus_per_node})")
    tp, u, pp = fixed.tp or 1, fixed.ulysses or 1, fixed.pp or 1
    m = w.model
    if m.num_heads % (tp * u):
        raise CommandError(f"--tp={tp} x --ulysses={u} = {tp * u} must divide the model's "
                           f"{plural(m.num_heads, 'head')}")
    if m.num_kv_heads % tp and tp % m.num_kv_heads:
        raise CommandError(f"--tp={tp} and the model's {plural(m.num_kv_heads, 'key/value head')}: one must divide "
                           f"the other")
    if (cluster.gpus_per_node % tp and tp % cluster.gpus_per_node) or m.intermediate_size % tp:
        raise CommandError(f"--tp={tp} must divide the MLP width {m.intermediate_size} and either divide "
                           f"--gpus-per-node={cluster.gpus_per_node} or span whole nodes (a multiple of it)")
    if pp > m.num_layers:
        raise CommandError(f"--pp={pp}: the model has only {plural(m.num_layers, 'layer')}")
    z = fixed.zero_stage
    if z is not None and z > 1 and pp > 1:
        raise CommandError(f"--zero-stage={z}: DeepSpeed's pipeline engine (--pp={pp}) supports stage 0 or 1")
    off = fixed.offload
    if z is not None and ((off == "optimizer" and z < 1) or (off == "all" and z != 3)):
        raise CommandError(f"--offload={off} needs --zero-stage {'>= 1' if off == 'optimizer' else '3'}, got {z}")
    if fixed.offload_activations and fixed.checkpointing == "none":
        raise CommandError("--offload-activations moves checkpointed inputs to host memory: it needs --checkpointing "
                           "full or selective, got none")
    if cluster.gpu_mem_gib <= cluster.reserve_gib + cluster.cuda_context_gib:
        raise CommandError(f"--gpu-mem-gib={cluster.gpu_mem_gib:g} must exceed --reserve-gib={cluster.reserve_gib:g} "
                           f"plus --cuda-context-gib={cluster.cuda_context_gib:g}")


def _leanest(w: Workload, cluster: Cluster, fixed: Constraints) -> str:
    leanest = min(strategies(w, cluster, fixed), key=lambda s: memory(w, s, cluster).total)
    return (f"the leanest layout, {leanest.name()}, needs {memory(w, leanest, cluster).total / GIB:.1f} GiB per "
            "GPU")


def _shortest_multiple(w: Workload, cluster: Cluster, fixed: Constraints) -> int:
    """The shortest sequence some strategy splits evenly."""
    return min(s.dims.sequence_multiple for s in strategies(w, cluster, fixed, split_seq=False))


TERMS = {  # Memory's terms in the order the breakdown lists them, each with what it stands for
    "params": "parameters (ZeRO-3: this rank's partition)",
    "grads": "gradients (ZeRO >= 1: the partition the optimizer is handed)",
    "optimizer": "optimizer state (AdamW's moments, fp32 master copy)",
    "activations": "activations saved for backward, held micro-batches, logits",
    "workspace": "backward's working set (one layer's activation gradients, ring blocks, MLP tile)",
    "attention": "attention kernel workspace",
    "position_table": "learned position table with its gradient and AdamW state",
    "mask": "attention mask",
    "reduce_bucket": "DeepSpeed's gradient-reduction buffers (reduce_bucket_size, contiguous gradients)",
    "allgather_bucket": "DeepSpeed's parameter all-gather (in place)",
    "gathered_params": "ZeRO-3 parameters gathered at the peak (reuse distance, prefetch bucket)",
    "persistent_params": "ZeRO-3 parameters kept gathered (under the persistence threshold)",
    "a2a_staging": "Ulysses all-to-all send and receive buffers (the larger of this and ring_buffers counts)",
    "ring_buffers": "the ring's received and arriving key/value blocks in forward",
    "cuda_context": "CUDA context (--cuda-context-gib)",
    "cublas_workspace": "cuBLAS workspace (CUBLAS_WORKSPACE_CONFIG=:4096:8)",
    "nccl_buffers": "NCCL buffers: communicators x --nccl-channels x --nccl-buffsize-mib",
    "fragmentation": "allocator fragmentation: --fragmentation x the step's short-lived bytes",
    "reserve": "the user's reserve (--reserve-gib)",
}


def layout_record(row: LayoutPlan) -> dict:
    """One layout as ``plan.json`` records it: degrees and switches (with ``grad_accum``), memory terms, bytes sent
    by group and step time."""
    return {"layout": {**row.strategy.to_dict(), "grad_accum": row.grad_accum}, "memory": asdict(row.memory),
            "comm": asdict(row.comm), "time": asdict(row.time)}


def markdown_rows(rows: list[LayoutPlan]) -> tuple[list[str], list[list]]:
    """Header and rows of the layout table: degrees, switches, GiB per GPU (the total), GiB sent per GPU per step,
    seconds per step, tokens/s and the time per token over the fastest's (:func:`memory_rows` has the memory terms:
    two tables, so each fits 120 columns)."""
    header = ["#", "tp", "ulysses", "ring", "pp", "dp", "m", "zero", "offload", "ckpt", "GiB", "sent GiB", "step s",
              "tokens/s", "rel. time"]
    best = rows[0].time.tokens_per_s if rows else 1.0
    out = []
    for i, r in enumerate(rows, 1):
        s, d = r.strategy, r.strategy.dims
        out.append([i, d.tp, d.ulysses, d.ring, d.pp, d.dp, r.grad_accum, s.zero_stage, s.offload, s.checkpointing,
                    f"{r.memory.total / GIB:.2f}", f"{r.comm.total / GIB:.2f}", f"{r.time.total_s:.3g}",
                    f"{r.time.tokens_per_s:.4g}", f"{best / r.time.tokens_per_s:.2f}"])
    return header, out


def memory_rows(rows: list[LayoutPlan]) -> tuple[list[str], list[list]]:
    """Header and rows of the layouts' memory terms, GiB per GPU, numbered as in :func:`markdown_rows`;
    ``buffers``: the framework's buffers as the total counts them, ``device``: the CUDA context, cuBLAS, NCCL,
    fragmentation and the reserve (:data:`TERMS`)."""
    header = ["#", "params", "grads", "optim", "activ", "bwd ws", "attn", "pos table", "mask", "buffers", "device",
              "total GiB"]
    out = []
    for i, r in enumerate(rows, 1):
        mem = r.memory
        out.append([i] + [f"{b / GIB:.2f}" for b in (mem.params, mem.grads, mem.optimizer, mem.activations,
                                                     mem.workspace, mem.attention, mem.position_table, mem.mask,
                                                     mem.buffers, mem.device, mem.total)])
    return header, out


def breakdown_rows(row: LayoutPlan) -> tuple[list[str], list[list]]:
    """Header and rows of one layout's memory by term (:data:`TERMS`), GiB per GPU."""
    return ["term", "GiB", "what it is"], [[k, f"{getattr(row.memory, k) / GIB:.3f}", TERMS[k]] for k in TERMS]


def run(args: argparse.Namespace) -> int:
    w, model_info = _workload(args)
    cluster = Cluster(args.gpus_per_node, args.nodes, args.gpu_mem_gib, args.reserve_gib, args.peak_tflops,
                      args.efficiency, args.intra_gbps, args.inter_gbps, args.pcie_gbps, args.cuda_context_gib,
                      args.nccl_buffsize_mib, args.nccl_channels, args.fragmentation)
    fixed = Constraints(args.tp, args.ulysses, args.ring, args.pp, args.dp, args.zero_stage, args.offload,
                        args.checkpointing, args.mlp_tile, args.loss_tile, args.offload_activations)
    _check_fixed(w, cluster, fixed)
    given = {k: v for k, v in asdict(fixed).items() if v is not None}
    result = {"model": model_info, "cluster": asdict(cluster), "fixed": given}
    fill = args.max_seq and args.grad_accum is None  # pipelines run m = pp micro-batches (filled)
    if args.max_seq:
        S = max_seq_len(w, cluster, fixed, fill_pipeline=fill)
        if S == 0:
            raise CommandError(f"no layout fits even the shortest sequence in --gpu-mem-gib={cluster.gpu_mem_gib:g}: "
                               f"{_leanest(w.with_seq_len(_shortest_multiple(w, cluster, fixed)), cluster, fixed)}")
        w = w.with_seq_len(S)
        result["max_seq_len"] = S
    if not strategies(w, cluster, fixed):
        q = _shortest_multiple(w, cluster, fixed)
        raise CommandError(f"--seq-len={w.seq_len}: no layout of {cluster.world} GPUs splits it evenly (a multiple of "
                           f"sp x tp, twice that with a ring, is needed; {q} at least)")
    rows = plan(w, cluster, fixed, fill_pipeline=fill)
    if not rows:
        raise CommandError(f"no layout fits --seq-len={w.seq_len} in --gpu-mem-gib={cluster.gpu_mem_gib:g} "
                           f"(--reserve-gib={cluster.reserve_gib:g}): {_leanest(w, cluster, fixed)}")
    result.update(workload=w.to_dict(), fitting=len(rows), layouts=[layout_record(r) for r in rows[: args.top]])
    preset, overrides = model_info["preset"], model_info["overrides"]
    model = (f"GenSLM's {preset} preset with overrides {overrides}: {format_parameters(w.model.num_parameters())} "
             "parameters" if overrides else describe_preset(preset, w.model))
    lines = [f"# plan: {model}", "", f"S = {w.seq_len}, {cluster.nodes} x {cluster.gpus_per_node} GPUs of "
             f"{cluster.gpu_mem_gib:g} GiB, {w.dtype}.", ""]
    if args.max_seq:
        lines += [f"Longest sequence that fits: {w.seq_len} tokens.", ""]
    if fill and any(r.strategy.dims.pp > 1 for r in rows):
        lines += ["Pipeline layouts run m = pp micro-batches per step (1F1B's first stage holds pp; --grad-accum "
                  "fixes m).", ""]
    listed = ("" if len(rows) == 1 else f"; the {args.top} fastest" if args.top < len(rows) else ", fastest first")
    lines += [*textwrap.wrap(f"{plural(len(rows), 'layout fits', 'layouts fit')}{listed} (GiB: total per GPU; sent "
                             "GiB: per GPU per step; rel. time: time per token over the fastest's):", 120), ""]
    lines += markdown_table(*markdown_rows(rows[: args.top]))
    lines += ["", "Their memory by term (GiB per GPU; buffers and device: their terms in the breakdown below):", ""]
    lines += markdown_table(*memory_rows(rows[: args.top]))
    lines += ["", "Memory of layout #1 by term (GiB per GPU; the total counts the larger of a2a_staging and "
              "ring_buffers):", ""]
    lines += markdown_table(*breakdown_rows(rows[0]))
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        path = write_report(args.out, "plan", result, text)
        print(f"plan: wrote {path} and {path.with_suffix('.md')}")
    return 0

