"""``ds4sci bench NAME``: benchmarks that write their results to files (JSON plus a readable table).

Each benchmark is a module exposing ``add_arguments(parser)`` and ``run(args) -> int``; results go under
``--out`` (default ``runs/bench``). Speed and memory targets are shown here, never by timed tests. The memory
benchmarks measure through :mod:`ds4sci.bench.memory`, the speed comparisons time through
:mod:`ds4sci.bench.rounds`; :mod:`ds4sci.bench.report` declares the shared options and writes the files.

A benchmark that needs several processes starts its own (:func:`ds4sci.spawn.run_workers`, a group of the given size
on a private store), so ``ds4sci bench`` itself runs as one process: under a launcher of more than one it would run
once per process into one ``--out``, and it is refused (the launch read by
:func:`~ds4sci.distributed.launch.resolve_launch`, a malformed one named in one line as for every command).
"""
from __future__ import annotations

import argparse

from ds4sci.cli_args import CommandError
from ds4sci.cli_args import LazyParser
from ds4sci.distributed.launch import resolve_launch

# name -> (module, one-line help)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "evoformer-memory": (
        "ds4sci.bench.evoformer_memory",
        "bytes saved for backward and peak memory of Evoformer attention per backend",
    ),
    "evoformer-cp": (
        "ds4sci.bench.evoformer_cp",
        "bytes sent and memory per rank per Evoformer / Pairformer block under axial context parallelism as N_res "
        "and P grow, beside the closed forms",
    ),
    "openfold-stack": (
        "ds4sci.bench.openfold_stack",
        "peak memory and bytes saved for backward of an OpenFold3 EvoformerStack training step, with and without "
        "ds4sci",
    ),
    "evoformer-speed": (
        "ds4sci.bench.evoformer_speed",
        "forward and backward times of Evoformer attention on a CUDA GPU: ds4sci triton/torch, OpenFold3's Triton "
        "kernel and DeepSpeed's kernel where installed",
    ),
    "genslm-attention-memory": (
        "ds4sci.bench.genslm_attention_memory",
        "peak memory, bytes saved for backward and time of one GenSLM attention layer forward+backward vs sequence "
        "length (causal, ALiBi, packed documents), before (sdpa) and after (memory_efficient_attention)",
    ),
    "comm-volume": (
        "ds4sci.bench.comm_volume",
        "bytes sent per rank per GenSLM layer under Ulysses, ring and hybrid sequence parallelism as the sequence "
        "grows with the degree, beside the closed forms and Megatron-LM sequence parallelism's",
    ),
    "seq-scaling": (
        "ds4sci.bench.seq_scaling",
        "peak memory per rank of one GenSLM training step vs sequence length under Ulysses, ring and hybrid "
        "sequence parallelism at P = 1, 2, 4, and the longest sequence within a per-rank budget",
    ),
    "ablation": (
        "ds4sci.bench.ablation",
        "bytes per token per layer left on the device, working set and peak memory per rank of one GenSLM training "
        "step with each long-sequence switch on in turn (tiled loss, full checkpointing, tiled MLP, host offload), on "
        "one process or per rank under Ulysses and tensor parallelism (the TP re-gather), beside the planner's",
    ),
    "memory-breakdown": (
        "ds4sci.bench.memory_breakdown",
        "bytes per rank of the learned position table (partitioned or not) and of the attention mask per policy, "
        "measured here and evaluated at the DeepSpeed4Science paper's sequence lengths",
    ),
    "kernels-aot": (
        "ds4sci.bench.kernels_aot",
        "compile every Triton kernel variant (Evoformer, OpenFold's launches, local attention) for sm_80/sm_90 "
        "without a GPU: shared memory, registers, spills, exponents built from fused multiply-adds",
    ),
    "throughput": (
        "ds4sci.bench.throughput",
        "training tokens/s of ds4sci's GenSLM vs Hugging Face's GPTNeoXForCausalLM with the same configuration and "
        "weights, alternating in one process: the ratio's median and spread over rounds",
    ),
    "generate": (
        "ds4sci.bench.generate",
        "generated tokens/s of ds4sci's cached decoding vs Hugging Face's GPTNeoXForCausalLM.generate with its cache "
        "(same weights, greedy, tokens checked equal) and vs the uncached loop, alternating in one process",
    ),
    "layouts": (
        "ds4sci.bench.layout_memory",
        "per-rank parameter, gradient, optimizer-state and activation bytes and bytes sent per group of real "
        "training steps for each parallel layout and ZeRO stage, beside ds4sci.planning's prediction of each term",
    ),
    "score-variants": (
        "ds4sci.bench.score_variants",
        "variants/s of ds4sci score-variants on a saturation-mutagenesis scan (3 SNVs per position), REF windows "
        "shared vs scored per variant",
    ),
    "inference-scale": (
        "ds4sci.bench.inference_scale",
        "records/s of ds4sci score on a corpus of mixed lengths: one window at a time, bucketed by length, packed "
        "with document masks, and transformers' batched forward on the same weights",
    ),
    "finetune": (
        "ds4sci.bench.finetune",
        "the linear probe, LoRA and full fine-tuning side by side on the bundled coding task: test AUROC, trainable "
        "parameters, optimizer-state bytes, time",
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One subcommand per benchmark; its module is imported only when it runs or shows its help
    (:class:`ds4sci.cli_args.LazyParser`), so ``ds4sci bench --help`` imports no torch."""
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True, parser_class=LazyParser)
    for name, (module_name, help_text) in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, module=module_name, run_key="_bench_run")
        p.add_argument("--out", default="runs/bench", help="output directory (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark ``args.benchmark``, as one process.

    Raises:
        LaunchError: a launcher's environment that cannot form its group (naming the variable).
        CommandError: a launch of more than one process (naming the launcher and the count).
    """
    launch = resolve_launch()
    if launch.world_size > 1:
        raise CommandError(f"this {launch.launcher} launch has {launch.world_size} processes: ds4sci bench starts "
                           "the processes a benchmark needs itself, run it as one process")
    return int(args._bench_run(args) or 0)
