"""Checkpoints for exact resume: DeepSpeed's engine checkpoint plus the position table saved FULL (gathered from
the sequence shards, with its AdamW state) so a run resumes at another sequence-parallel degree."""
from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def save_checkpoint(trainer) -> Path:
    """Save under ``out_dir/checkpoints/step{N}`` (collective: every rank calls it)."""
    root = trainer.out / "checkpoints"
    tag = f"step{trainer.step}"
    trainer.engine.save_checkpoint(str(root), tag=tag, client_state={"step": trainer.step})
    if trainer.pos_table is not None:
        state = trainer.pos_opt.state.get(trainer.pos_table.weight, {})
        zeros = torch.zeros_like(trainer.pos_table.weight)
        full = {
            "weight": trainer.gather_position_table(),
            "exp_avg": trainer.gather_position_table(state.get("exp_avg", zeros)),
            "exp_avg_sq": trainer.gather_position_table(state.get("exp_avg_sq", zeros)),
            "adam_step": state.get("step", torch.tensor(0.0)),
            "scheduler": trainer.pos_sched.state_dict(),
        }
        if trainer.rank == 0:
            torch.save(full, root / tag / "position_table.pt")
    dist.barrier()
    if trainer.rank == 0:
        logger.info("saved checkpoint %s", root / tag)
    return root / tag


def load_checkpoint(trainer, path: str | Path) -> None:
    """Resume from ``.../checkpoints/stepN`` (the engine's world size must match; the SP degree may differ)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    _, client = trainer.engine.load_checkpoint(str(path.parent), tag=path.name)
    if client is None:
        raise ValueError(f"{path}: DeepSpeed could not load this checkpoint")
    trainer.step = int(client["step"])
    if trainer.pos_table is not None:
        table_file = path / "position_table.pt"
        if not table_file.is_file():
            raise FileNotFoundError(f"{table_file} is missing: this checkpoint has no learned position table")
        full = torch.load(table_file, map_location="cpu")
        rows = trainer.pos_table.rows.cpu()
        w = trainer.pos_table.weight
        expected = (trainer.pos_table.max_positions, w.shape[1])
        if tuple(full["weight"].shape) != expected:
            raise ValueError(f"{table_file}: position table {tuple(full['weight'].shape)}, this model needs {expected}")
        with torch.no_grad():
            w.copy_(full["weight"][rows])
        trainer.pos_opt.state[w] = {
            "step": full["adam_step"].clone(),
            "exp_avg": full["exp_avg"][rows].to(w).clone(),
            "exp_avg_sq": full["exp_avg_sq"][rows].to(w).clone(),
        }
        trainer.pos_sched.load_state_dict(full["scheduler"])
        for group, lr in zip(trainer.pos_opt.param_groups, trainer.pos_sched.get_last_lr()):
            group["lr"] = lr  # a scheduler's state does not reach its optimizer before the next scheduler step
