"""The sequence-partitioned learned position table in training: one class owns it.

DeepSpeed treats every engine parameter as replicated over the sequence x data group (broadcast from its first
rank at start, gradients reduced over the group), which would overwrite and mix the rows a sequence-sharded table
holds per rank. So the table stays out of the engine (:func:`ds4sci.sequence.parallelize` pops it from the model)
and :class:`PositionTable` does for it what the engine does for the rest: its own AdamW with the same
hyper-parameters and schedule, the gradient summed over the data-parallel group only and clipped against its own
global norm (DISCREPANCY: clipping is per parameter group, engine vs table), the full table gathered from the
sequence shards, and checkpoint state saved FULL so a run resumes at another sequence-parallel degree.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ds4sci.models.genslm import LearnedPositionEmbedding
from ds4sci.sequence import SequenceParallelGroups
from ds4sci.train.config import Config
from ds4sci.train.engine import make_optimizer

__all__ = ["PositionTable"]


class PositionTable:
    """A (sequence-sharded) :class:`LearnedPositionEmbedding` with its optimizer, schedule and checkpoint state.

    ``table(position_ids [B, T]) -> [B, T, hidden]`` looks up this rank's rows by global position.
    """

    def __init__(self, module: LearnedPositionEmbedding, groups: SequenceParallelGroups, cfg: Config,
                 device: torch.device):
        self.module = module.to(device)
        self.groups = groups
        self.grad_clip = cfg.optim.grad_clip
        self.optimizer, self.scheduler = make_optimizer(self.module.parameters(), cfg)

    @property
    def weight(self) -> torch.nn.Parameter:
        """This rank's rows ``[R, hidden]``."""
        return self.module.weight

    def __call__(self, position_ids: Tensor) -> Tensor:
        return self.module(position_ids)

    def step(self, reduction_factor: float) -> None:
        """One optimizer step: sum the gradient over the data-parallel ranks (rows differ per sequence rank, so
        never over those), divide by ``reduction_factor`` (the engine's, :mod:`ds4sci.train.loss`), clip by the
        table's global norm across the sequence shards, step AdamW and the schedule."""
        w = self.module.weight
        grad = w.grad if w.grad is not None else torch.zeros_like(w)
        dist.all_reduce(grad, group=self.groups.dp)
        grad.div_(reduction_factor)
        if self.grad_clip > 0:
            norm_sq = (grad.double() ** 2).sum()
            dist.all_reduce(norm_sq, group=self.groups.sp)
            norm = norm_sq.sqrt().item()
            if norm > self.grad_clip:
                grad.mul_(self.grad_clip / (norm + 1e-6))
        w.grad = grad
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def gather(self, tensor: Tensor | None = None) -> Tensor:
        """The full ``[max_positions, hidden]`` table (or optimizer state shaped like it) on the CPU, assembled
        from every sequence shard (collective over the SP group)."""
        tensor = self.module.weight.detach() if tensor is None else tensor
        sp = self.groups.dims.sp
        if sp == 1:
            return tensor.detach().cpu().clone()
        parts = [torch.empty_like(tensor) for _ in range(sp)]
        rows = [torch.empty_like(self.module.rows) for _ in range(sp)]
        dist.all_gather(parts, tensor.contiguous(), group=self.groups.sp)
        dist.all_gather(rows, self.module.rows, group=self.groups.sp)
        return LearnedPositionEmbedding.assemble_full_table(list(zip(rows, parts)), self.module.max_positions)

    def state_dict(self) -> dict:
        """Full (unsharded) weight and AdamW moments, the Adam step and the schedule (collective)."""
        state = self.optimizer.state.get(self.module.weight, {})
        zeros = torch.zeros_like(self.module.weight)
        return {
            "weight": self.gather(),
            "exp_avg": self.gather(state.get("exp_avg", zeros)),
            "exp_avg_sq": self.gather(state.get("exp_avg_sq", zeros)),
            "adam_step": state.get("step", torch.tensor(0.0)),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, full: dict, source: str) -> None:
        """Take this rank's rows of a :meth:`state_dict` saved at any sequence-parallel degree.

        Raises:
            ValueError: the saved table's shape is not this model's (``source`` names the file).
        """
        w = self.module.weight
        expected = (self.module.max_positions, w.shape[1])
        if tuple(full["weight"].shape) != expected:
            raise ValueError(f"{source}: position table {tuple(full['weight'].shape)}, this model needs {expected}")
        rows = self.module.rows.cpu()
        with torch.no_grad():
            w.copy_(full["weight"][rows])
        self.optimizer.state[w] = {
            "step": full["adam_step"].clone(),
            "exp_avg": full["exp_avg"][rows].to(w).clone(),
            "exp_avg_sq": full["exp_avg_sq"][rows].to(w).clone(),
        }
        self.scheduler.load_state_dict(full["scheduler"])
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr  # a scheduler's state does not reach its optimizer before the next scheduler step
