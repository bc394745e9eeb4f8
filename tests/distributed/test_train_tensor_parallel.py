"""Training with tensor parallelism (Megatron-LM with sequence-parallel regions, ``parallel.tp``) equals
single-process training: per-step losses and every parameter after three steps (fp32, ~1e-5) for TP2 under ZeRO
0-3, TP2 x Ulysses2 and TP2 x Ring2 (zigzag), gradient clipping active throughout (the global norm counts the
TP-split parameters once per TP rank and the replicated ones once), with activation checkpointing (full,
selective, on the CPU), and the consolidated export a TP run writes equals the single-process run's.

The helpers (config overrides, the per-case worker, the comparison) are those of ``test_train_equivalence``.
"""
from pathlib import Path

import pytest
import torch

from ds4sci.spawn import run_workers
from test_train_equivalence import CLIP, ENV, _baseline, _compare, _overrides, _train_cases

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TP2 = ["parallel.tp=2"]
FULL, SELECTIVE, CPU = (["activation_checkpointing.mode=full"], ["activation_checkpointing.mode=selective"],
                        ["activation_checkpointing.cpu=true"])


def _train_and_export(rank, world, overrides):
    """``Trainer.train()`` end to end (evaluation, checkpoint, export); rank 0 returns the logged training losses,
    the final validation loss and the exported ``model.safetensors``."""
    from safetensors.torch import load_file

    from ds4sci.train.config import load_config
    from ds4sci.train.trainer import Trainer

    records = Trainer(load_config(None, overrides)).train()
    if rank != 0:
        return None
    losses = [r["loss"] for r in records if "loss" in r]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    state = load_file(str(Path(overrides[-1].split("=", 1)[1]) / "export" / "model.safetensors"))
    return losses, val, {k: v.numpy() for k, v in state.items()}


def test_tp2_every_stage_and_activation_checkpointing(tmp_path):
    stages = [0, 1, 2, 3]
    cases = [_overrides(tmp_path / f"tp{z}", z, extra=TP2 + CLIP) for z in stages] + [
        _overrides(tmp_path / "full", 2, pe="rotary", extra=TP2 + CLIP + FULL),
        _overrides(tmp_path / "sel", 3, pe="alibi", extra=TP2 + CLIP + SELECTIVE + CPU),
    ]
    got = run_workers(_train_cases, 2, cases, env=ENV, timeout=400)[0]
    want = _baseline([_overrides(tmp_path / f"b{z}", z, extra=CLIP) for z in stages] + [
        _overrides(tmp_path / "bfull", 2, pe="rotary", extra=CLIP),
        _overrides(tmp_path / "bsel", 3, pe="alibi", extra=CLIP),
    ])
    for z, g, w in zip(stages, got, want):
        _compare(g, w, f"tp=2 zero={z} clipped")
    _compare(got[4], want[4], "tp=2 zero=2 rotary, full checkpointing")
    _compare(got[5], want[5], "tp=2 zero=3 alibi, selective checkpointing on the CPU")
