"""Checkpoints for exact resume: DeepSpeed's engine checkpoint plus the learned position table's full state
(:meth:`ds4sci.train.position_table.PositionTable.state_dict`), so a run resumes at another sequence-parallel degree."""
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
        full = trainer.pos_table.state_dict()
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
        trainer.pos_table.load_state_dict(torch.load(table_file, map_location="cpu"), str(table_file))
