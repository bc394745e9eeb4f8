"""Sequence-parallel-aware loss normalisation for DeepSpeed.

The training loss is the mean cross entropy over every real (non ``IGNORE_INDEX``, -100) target of the GLOBAL batch: all
data-parallel ranks, all sequence shards, all gradient-accumulation micro-batches. Padding never counts.

Each rank computes the SUM of its shard's token losses; targets are shifted on the full window BEFORE sharding
(``ds4sci.models.genslm.shift_labels``), so the target of a shard's last token, which is the first token of the
next shard, is never lost. A rank then back-propagates ``local_sum / global_count * K`` where ``K`` undoes the
gradient reduction DeepSpeed applies over the sequence x data group (:func:`grad_reduction_factor`).

Tensor parallelism (``parallel.tp``, :mod:`ds4sci.parallel.tensor_parallel`) changes neither the count nor ``K``
(DeepSpeed 0.19.8, read in its source and proven by ``tests/distributed/test_train_tensor_parallel.py`` against
single-process training, ZeRO 0-3, clipped and unclipped):

- The TP ranks of a sequence shard hold the same tokens and compute the same (vocabulary-parallel) loss, so the
  global count and the logged sums run over the sequence x data group ``groups.sdp``, never over the TP ranks.
- The engine reduces and partitions over the mpu's ``get_sequence_data_parallel_group()`` (``engine.py``:
  ``seq_data_parallel_group``), which :class:`~ds4sci.distributed.groups.DeepSpeedMPU` makes the ``sdp`` group of this
  TP rank: TP ranks never mix gradients, so the per-stage reduction, and ``K``, are the ones without TP.
- A TP-split parameter's gradient is complete on its rank. A replicated one (LayerNorms, row-parallel biases) is
  used on sequence regions, so each TP rank's autograd gradient would be partial; the model makes it whole before
  DeepSpeed sees it (``sync_grad`` all-reduces LayerNorm gradients over TP, a row-parallel bias enters each partial
  sum as ``bias/tp`` with its gradient passed through whole), so every TP rank holds the same full gradient.
- Gradient clipping needs no change: the norms (``runtime/utils.py`` ``clip_grad_norm_`` at stage 0,
  ``stage_1_and_2.py`` / ``stage3.py`` ``get_grad_norm_direct``) count a parameter marked ``tensor_model_parallel``
  on every TP rank and the others on TP rank 0 only, then sum over the mpu's model-parallel group (the TP group).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ds4sci.models.genslm import IGNORE_INDEX


def grad_reduction_factor(stage: int, dp: int, sp: int) -> float:
    """``K``: the factor that makes DeepSpeed's reduced gradient of ``local_sum / global_count * K`` equal to the
    gradient of the global mean loss.

    The reduction over the sequence x data group (``dp * sp`` ranks) depends on the ZeRO ``stage``
    (``zero.stage``); offloading (``zero.offload_*``) does not change it. Measured with
    DeepSpeed 0.19.8 on gloo (per-parameter gradient ratios against one process) and proven per stage by
    ``tests/distributed/test_train_equivalence.py``:

    - stages 0, 1, 2: gradients are divided by ``dp`` and summed over the group: SUM over the sequence ranks,
      MEAN over the data ranks, so ``K = dp``;
    - stage 3 (``reduce_scatter`` on, its default, which the trainer pins): a reduce-scatter that divides by the
      whole group: MEAN over ``dp * sp`` ranks, so ``K = dp * sp``. (With ``reduce_scatter`` off, buckets up to
      ``reduce_bucket_size`` elements are summed over the sequence ranks but larger ones averaged, so no single
      ``K`` is right; the trainer never turns it off.)
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if dp < 1 or sp < 1:
        raise ValueError(f"dp and sp must be >= 1, got dp={dp}, sp={sp}")
    return float(dp * sp) if stage == 3 else float(dp)


def global_target_count(targets: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Number of real targets in ``targets`` (local ``[B, S/P]`` shards of all accumulation micro-batches),
    summed over ``group`` (the sequence x data group: every rank of the global batch). float64 scalar."""
    local = sum(int((t != IGNORE_INDEX).sum()) for t in targets)
    count = torch.tensor(float(local), dtype=torch.float64, device=targets[0].device)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(count, group=group)
    return count


def scaled_shard_loss(local_sum: torch.Tensor, global_count: torch.Tensor, factor: float) -> torch.Tensor:
    """``local_sum / global_count * factor``: what a rank back-propagates (``factor`` from
    :func:`grad_reduction_factor`, times the accumulation steps when the engine divides by them)."""
    if float(global_count) <= 0:
        raise ValueError(f"the global batch has no real target (count={float(global_count)}): nothing to learn from")
    return local_sum / global_count.to(local_sum.dtype) * factor
