"""DeepSpeed set-up: process-group initialisation, the engine config, AdamW with warmup + cosine decay, and the
engine over the sequence x data group (ZeRO 0-3, fp32 or bf16)."""
from __future__ import annotations

import logging
import math
import os
import socket

import torch
import torch.distributed as dist
from torch import nn

from ds4sci.sequence import DeepSpeedMPU, SequenceParallelGroups
from ds4sci.train.config import Config

logger = logging.getLogger(__name__)


def init_distributed() -> None:
    """Initialise torch.distributed through DeepSpeed (nccl on CUDA, gloo on the CPU).

    Under ``torchrun`` / the deepspeed launcher the environment names the rank and world; a lone process gets a
    world of one on a free localhost port. A process group created before (e.g. by a test harness) is kept.
    """
    import deepspeed

    if dist.is_initialized():  # DeepSpeed still needs its communication backend on top of the existing group
        os.environ.setdefault("LOCAL_RANK", str(dist.get_rank() % max(1, torch.cuda.device_count())))
        deepspeed.init_distributed(dist_backend=dist.get_backend())
        return
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")


def lr_lambda(cfg: Config):
    """``step -> factor of optim.lr``: linear warmup over ``warmup_steps`` then cosine decay to ``min_lr`` at
    ``train.steps`` (flat at ``min_lr`` afterwards)."""
    o, steps = cfg.optim, cfg.train.steps

    def factor(step: int) -> float:
        if step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        progress = min(1.0, (step - o.warmup_steps) / max(1, steps - o.warmup_steps))
        return (o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * progress))) / o.lr

    return factor


def make_optimizer(params, cfg: Config) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with ``cfg.optim`` and its warmup/decay schedule (stepped once per optimizer step)."""
    o = cfg.optim
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))


def deepspeed_config(cfg: Config, sp: int) -> dict:
    """The DeepSpeed config dict of a training config (``sp``: sequence-parallel degree)."""
    t = cfg.train
    zero: dict = {"stage": t.zero_stage}
    if t.zero_stage == 3:
        # Pinned: with reduce_scatter off, ZeRO-3 sums small gradient buckets over the sequence ranks but averages
        # large ones, which no loss scale can undo (see ds4sci.train.loss.grad_reduction_factor).
        zero["reduce_scatter"] = True
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "zero_optimization": zero,
        "gradient_clipping": cfg.optim.grad_clip,
        "bf16": {"enabled": t.dtype == "bf16"},
        "sequence_parallel_size": sp,
        "zero_allow_untested_optimizer": True,  # torch AdamW: tested here by the equivalence tests
        "steps_per_print": 10**9,  # the trainer logs
    }


def build_engine(model: nn.Module, cfg: Config, groups: SequenceParallelGroups, device: torch.device):
    """``deepspeed.initialize`` over the sequence x data group of ``groups`` (via the mpu adapter).

    Every parameter of ``model`` must be replicated across that group (DeepSpeed broadcasts them from its first
    rank and reduces/partitions over it): keep sequence-sharded parameters out of ``model``.
    """
    import deepspeed

    sharded = [n for n, p in model.named_parameters() if getattr(p, "ds4sci_sequence_sharded", False)]
    if sharded:
        raise ValueError(f"sequence-sharded parameters {sharded} cannot go into the DeepSpeed engine")
    ds_config = deepspeed_config(cfg, groups.dims.sp)
    model = model.to(device)
    if cfg.train.zero_stage == 3:
        # DeepSpeed 0.19 converts a plain module for ZeRO-3 over mpu.get_data_parallel_group(), the data ranks
        # WITHOUT the sequence ranks, so gradients are never reduced over the sequence shards (measured: every
        # rank kept its local gradient). Converting here, over the sequence x data group, gives the partitioning
        # the engine's ZeRO-3 optimizer assumes.
        deepspeed.zero.Init(module=model, data_parallel_group=groups.sdp, config_dict_or_path=ds_config)
    optimizer, scheduler = make_optimizer([p for p in model.parameters() if p.requires_grad], cfg)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config,
                                           mpu=DeepSpeedMPU(groups), dist_init_required=False)
    return engine
