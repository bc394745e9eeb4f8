"""The sequence-partitioned learned position table in training: one class owns it.

DeepSpeed treats every engine parameter as replicated over the sequence x data group (broadcast from its first
rank at start, gradients reduced over the group), which would overwrite and mix the rows a sequence-sharded table
holds per rank. So the table stays out of the engine (:func:`~ds4sci.parallel.parallelize.parallelize` pops it from
the model) and :class:`PositionTable` does for it what the engine does for the rest: its own AdamW with the same
hyper-parameters and schedule, the gradient summed over the data-parallel group only and clipped against its own
global norm (DISCREPANCY: clipping is per parameter group, engine vs table), the full table gathered from the
sequence shards for an export, and checkpoint state saved per sequence shard with the global positions of its rows,
so a run resumes at another sequence-parallel degree or layout without any rank holding the whole table.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from ds4sci.distributed.groups import SequenceParallelGroups
from ds4sci.models.genslm import LearnedPositionEmbedding
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

    def gather(self, tensor: Tensor | None = None, dst: int | None = None) -> Tensor | None:
        """The full ``[max_positions, hidden]`` table (or optimizer state shaped like it) on the CPU, assembled
        from every sequence shard (collective over the SP group): on every rank, or (``dst``, a global rank) only
        there; the other ranks return None and only ``dst``'s SP group communicates."""
        tensor = self.module.weight.detach() if tensor is None else tensor
        sp, group = self.groups.dims.sp, self.groups.sp
        if dst is not None and (sp == 1 or dst not in dist.get_process_group_ranks(group)):
            return tensor.detach().cpu().clone() if dist.get_rank() == dst else None
        if sp == 1:
            return tensor.detach().cpu().clone()
        if dst is None:
            parts = [torch.empty_like(tensor) for _ in range(sp)]
            rows = [torch.empty_like(self.module.rows) for _ in range(sp)]
            dist.all_gather(parts, tensor.contiguous(), group=group)
            dist.all_gather(rows, self.module.rows, group=group)
        else:
            here = dist.get_rank() == dst
            parts = [torch.empty_like(tensor) for _ in range(sp)] if here else None
            rows = [torch.empty_like(self.module.rows) for _ in range(sp)] if here else None
            dist.gather(tensor.contiguous(), parts, dst=dst, group=group)
            dist.gather(self.module.rows, rows, dst=dst, group=group)
            if not here:
                return None
        return LearnedPositionEmbedding.assemble_full_table(list(zip(rows, parts)), self.module.max_positions)

    def shard_state(self) -> dict:
        """This rank's rows of the weight and AdamW moments (fp32, CPU) with their global positions (``rows``), the
        table's size, the Adam step and the schedule: what a checkpoint keeps per sequence shard (no collective)."""
        w = self.module.weight
        state = self.optimizer.state.get(w, {})
        zeros = torch.zeros_like(w)
        return {
            "rows": self.module.rows.cpu(),
            "max_positions": torch.tensor(self.module.max_positions),
            "weight": w.detach().float().cpu(),
            "exp_avg": state.get("exp_avg", zeros).float().cpu(),
            "exp_avg_sq": state.get("exp_avg_sq", zeros).float().cpu(),
            "adam_step": state.get("step", torch.tensor(0.0)),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_shards(self, shards: Iterable[tuple[dict, str]]) -> None:
        """Take this rank's rows from the :meth:`shard_state` of every sequence shard of a checkpoint saved at any
        sequence-parallel degree or layout; ``shards`` yields ``(state, source)`` pairs, read one at a time.

        Raises:
            ValueError: a shard's table is not this model's, or a position of this rank is in no shard or in
                several (``source`` names the file).
        """
        w = self.module.weight
        slot = self.module._slot.cpu()  # global position -> row of this rank, or -1
        weight, exp_avg, exp_avg_sq = (torch.zeros(w.shape) for _ in range(3))
        found = torch.zeros(w.shape[0], dtype=torch.long)
        shard, source = None, "the checkpoint"
        for shard, source in shards:
            if int(shard["max_positions"]) != self.module.max_positions or shard["weight"].shape[1] != w.shape[1]:
                raise ValueError(f"{source}: position table of {int(shard['max_positions'])} x "
                                 f"{shard['weight'].shape[1]}, this model needs {self.module.max_positions} x "
                                 f"{w.shape[1]}")
            local = slot[shard["rows"]]
            keep = local >= 0
            for dst, key in ((weight, "weight"), (exp_avg, "exp_avg"), (exp_avg_sq, "exp_avg_sq")):
                dst[local[keep]] = shard[key][keep]
            found[local[keep]] += 1
        if shard is None or not bool((found == 1).all()):
            missing = self.module.rows.cpu()[found != 1][:8].tolist()
            raise ValueError(f"{source}: positions {missing} of this rank are in no saved table shard, or in several")
        with torch.no_grad():
            w.copy_(weight.to(w))
        self.optimizer.state[w] = {"step": shard["adam_step"].clone(), "exp_avg": exp_avg.to(w),
                                   "exp_avg_sq": exp_avg_sq.to(w)}
        self.scheduler.load_state_dict(shard["scheduler"])
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr  # a scheduler's state does not reach its optimizer before the next scheduler step
