"""``ds4sci plan-evoformer``: how much memory one GPU needs to run an Evoformer (AlphaFold2) or Pairformer
(AlphaFold3) trunk at a crop of ``N_res`` residues, on one GPU, by axial (1-D) context parallelism over P GPUs or on
a p x p mesh (2-D), in training or inference; and the longest crop that fits (``--max-crop``).

Parses and checks the arguments (one line naming a bad combination) and prints
:func:`ds4sci.planning.evoformer.memory`'s terms as a Markdown table (``--out``: also ``plan_evoformer.json``).
"""
from __future__ import annotations

import argparse
import math
from dataclasses import asdict
from dataclasses import replace

from ds4sci.cli_args import CommandError
from ds4sci.cli_args import nonnegative_float
from ds4sci.cli_args import positive_int
from ds4sci.planning.common import DTYPE_BYTES
from ds4sci.planning.common import GIB
from ds4sci.planning.evoformer import BACKENDS
from ds4sci.planning.evoformer import DEFAULT_N_SEQ
from ds4sci.planning.evoformer import LAYOUTS
from ds4sci.planning.evoformer import MODES
from ds4sci.planning.evoformer import PRESETS
from ds4sci.planning.evoformer import Workload
from ds4sci.planning.evoformer import max_crop
from ds4sci.planning.evoformer import memory
from ds4sci.report import markdown_table
from ds4sci.report import write_report

TERMS = {  # EvoformerMemory's terms in the order the table lists them, each with what it stands for (the reference)
    "parameters": "on every rank: the dtype's bytes per parameter in inference, 16 with gradient and AdamW state in "
    "training",
    "representations": "z and m (Pairformer: s) held between blocks, this rank's share (1/P, or 1/p^2 on a mesh)",
    "checkpoints": "training: each block's checkpointed input (per-block activation checkpointing)",
    "block_saved": "training: what the block being recomputed saves for backward",
    "gathers": "training, 1-D: the all-gathered tensors that do not shrink with P (pair biases, a triangle "
    "multiplication operand, the outer product's b)",
    "working": "training: gradients of the block's outputs and inputs and the largest sub-module's; inference: the "
    "peak of live tensors of one block (--chunk-size lowers it)",
    "exit": "1-D: the stack's exit all-gathers of m and z beyond the working set",
    "reserve": "--reserve-gib: the CUDA context and communication buffers",
    "total": "the sum of the terms, against --gpu-mem-gib",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Predict per-GPU memory of an Evoformer (AlphaFold2) or Pairformer (AlphaFold3) trunk at a "
                          "crop of N_res residues on one GPU, by axial (1-D) context parallelism over P GPUs or on a "
                          "p x p mesh (2-D), in training or inference; --max-crop finds the longest crop that fits.")
    parser.epilog = "Terms and their sources: docs/explanation/planner.md."
    parser.add_argument("--preset", choices=sorted(PRESETS), default="af2",
                        help="af2: OpenFold's Evoformer (48 blocks, c_m 256, c_z 128, 8/4 heads of 32); af3: "
                        "OpenFold3's Pairformer (48 blocks, c_s 384, c_z 128) (default: af2)")
    parser.add_argument("--blocks", type=positive_int, help="blocks of the trunk (default: the preset's 48)")
    parser.add_argument("--n-res", type=positive_int, help="residues (tokens) of the crop; needed without --max-crop")
    parser.add_argument("--n-seq", type=int, help="MSA depth of the Evoformer (default: 512, OpenFold's inference "
                        "max_msa_clusters; the extra MSA stack is not modelled)")
    parser.add_argument("--dtype", choices=tuple(DTYPE_BYTES), default="bf16", help="(default: bf16)")
    parser.add_argument("--mode", choices=MODES, default="inference",
                        help="training: per-block activation checkpointing, AdamW; inference (default: inference)")
    parser.add_argument("--chunk-size", type=positive_int,
                        help="inference chunking of the attentions, transitions and outer product mean (default: off)")
    parser.add_argument("--backend", choices=BACKENDS, default="kernel",
                        help="kernel: ds4sci's Evoformer attention (no logits stored); reference: the plain "
                        "[rows, H, S, S] logits path (default: kernel)")
    parser.add_argument("--layout", choices=LAYOUTS, default="1",
                        help="1: one GPU; 1d: axial over --gpus; 2d: a p x p mesh of --gpus (default: 1)")
    parser.add_argument("--gpus", type=positive_int, default=1, help="GPUs of the layout (default: 1)")
    parser.add_argument("--gpu-mem-gib", type=nonnegative_float, default=80.0, help="GiB per GPU (default: 80)")
    parser.add_argument("--reserve-gib", type=nonnegative_float, default=1.0,
                        help="GiB per GPU kept for the CUDA context and communication buffers (default: 1)")
    parser.add_argument("--max-crop", action="store_true", help="find the longest N_res that fits")
    parser.add_argument("--out", help="also write plan_evoformer.json and plan_evoformer.md to this folder")


def workload_from_args(args: argparse.Namespace) -> Workload:
    """The :class:`Workload` the command line describes; a bad combination is one :class:`CommandError` line."""
    shape = PRESETS[args.preset]
    if args.blocks:
        shape = replace(shape, blocks=args.blocks)
    n_seq = DEFAULT_N_SEQ[args.preset] if args.n_seq is None else args.n_seq
    if n_seq < 0:
        raise CommandError(f"--n-seq={n_seq}: expected a number of MSA sequences >= 0")
    if n_seq == 0 and shape.evoformer:
        raise CommandError(f"--n-seq={n_seq}: the Evoformer needs an MSA of at least one sequence")
    if n_seq and not shape.evoformer:
        raise CommandError(f"--n-seq={n_seq}: the Pairformer (--preset {args.preset}) has no MSA")
    if args.chunk_size and args.mode == "training":
        raise CommandError(f"--chunk-size={args.chunk_size} is inference chunking; training checkpoints each block "
                           "instead")
    if args.layout == "1" and args.gpus != 1:
        raise CommandError(f"--gpus={args.gpus} needs --layout 1d or 2d (--layout 1 is one GPU)")
    if args.layout == "2d" and math.isqrt(args.gpus) ** 2 != args.gpus:
        raise CommandError(f"--layout 2d needs a square number of GPUs (a p x p mesh), got --gpus={args.gpus}")
    if args.gpu_mem_gib <= args.reserve_gib:
        raise CommandError(f"--gpu-mem-gib={args.gpu_mem_gib:g} must exceed --reserve-gib={args.reserve_gib:g}")
    if not args.max_crop and args.n_res is None:
        raise CommandError("give --n-res N or --max-crop")
    return Workload(shape, args.n_res or 1, n_seq, args.dtype, args.mode, args.chunk_size, args.backend, args.layout,
                    args.gpus, args.gpu_mem_gib, args.reserve_gib)


def run(args: argparse.Namespace) -> int:
    w = workload_from_args(args)
    if args.max_crop:
        n = max_crop(w)
        if n == 0:
            need = memory(w.with_n_res(1)).total / GIB
            raise CommandError(f"not even one residue fits in --gpu-mem-gib={w.gpu_mem_gib:g}: the parameters and "
                               f"reserve alone need {need:.1f} GiB per GPU")
        w = w.with_n_res(n)
    mem = memory(w)
    where = {"1": "1 GPU", "1d": f"1-D axial over {w.gpus} GPUs", "2d": f"a {w.side} x {w.side} mesh"}[w.layout]
    msa = f", N_seq {w.n_seq}" if w.shape.evoformer else ""
    chunk = f", chunk {w.chunk_size}" if w.chunk_size else ""
    lines = [f"# plan-evoformer: {args.preset} ({w.shape.kind}, {w.shape.blocks} blocks, "
             f"{w.shape.block_parameters() * w.shape.blocks:,} parameters), {w.mode}, {w.dtype}, {w.backend}{chunk}; "
             f"N_res {w.n_res}{msa}; {where} of {w.gpu_mem_gib:g} GiB", ""]
    if args.max_crop:
        lines += [f"Longest crop that fits: {w.n_res} residues.", ""]
    lines += ["GiB per GPU:", ""]
    lines += markdown_table(list(TERMS), [[f"{getattr(mem, t) / GIB:.2f}" for t in TERMS]])
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        report = {"workload": {**asdict(w), "shape": asdict(w.shape)}, "memory": asdict(mem),
                  "max_crop": w.n_res if args.max_crop else None}
        path = write_report(args.out, "plan_evoformer", report, text)
        print(f"plan-evoformer: wrote {path} and {path.with_suffix('.md')}")
    return 0

