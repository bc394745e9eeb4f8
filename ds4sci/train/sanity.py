"""Start-up check that DeepSpeed reduces gradients the way the loss scale assumes.

The trainer back-propagates ``local_sum / global_count * K * grad_accum`` (:mod:`ds4sci.train.loss`), where ``K``
(:func:`~ds4sci.train.loss.grad_reduction_factor`) undoes how DeepSpeed reduces gradients over the sequence x data
group, and ``grad_accum`` undoes ``engine.backward``'s division by the accumulation steps. Both are facts of one
DeepSpeed version, not of its API: a release that averages where this one sums would mis-scale every gradient by
the sequence-parallel degree without any error.

:func:`check_gradient_reduction` measures it on the process group of the real run: a one-element probe module goes
through the same engine construction as the model (same DeepSpeed config: ZeRO stage, offload, bf16, accumulation
steps; same mpu; ZeRO-3 partitioning over the sequence x data group), every rank back-propagates a different
known gradient for every accumulation micro-step, and the gradient DeepSpeed hands its optimizer is read back with
``deepspeed.utils.safe_get_full_grad`` before any step. The probe engine is then dropped: the model's engine,
optimizer and random state are untouched. It does not exercise bucket-size-dependent paths (a one-element
gradient always fits one bucket); the trainer pins ``reduce_scatter`` so that ZeRO-3 has none.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ds4sci.distributed.groups import SequenceParallelGroups
from ds4sci.train.config import Config
from ds4sci.train.loss import grad_reduction_factor


class _Probe(nn.Module):
    """``w * c`` with one weight ``w = 1``: its gradient on a rank is that rank's ``c``."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.weight * c.to(self.weight.dtype)).sum()


def measure_division(initialize: Callable[[nn.Module], object], groups: SequenceParallelGroups, grad_accum: int,
                     device: torch.device) -> torch.Tensor:
    """What DeepSpeed divides the summed gradient of the sequence x data group by, as seen on this rank.

    Rank ``r`` of the group (``W`` ranks) back-propagates gradient ``c_r = r + 1`` (exact in bf16) through
    ``engine.backward`` in each of the ``grad_accum`` micro-steps (``engine.step`` between them, as in training);
    the reduced gradient ``G`` is read after the last backward, before its step. Returns ``grad_accum * sum(c) / G``
    (float64 scalar): ``K * grad_accum`` when DeepSpeed behaves as :func:`grad_reduction_factor` says.

    Args:
        initialize: builds an engine the way the model's is built (``module -> engine``).
    """
    from deepspeed.utils import safe_get_full_grad

    engine = initialize(_Probe())
    W, r = dist.get_world_size(groups.sdp), dist.get_rank(groups.sdp)
    c = torch.tensor(float(r + 1), device=device)
    for micro in range(grad_accum):
        engine.backward(engine(c))
        if micro < grad_accum - 1:
            engine.step()  # as the trainer does: counts the micro-step, no optimizer step before the last
    grad = safe_get_full_grad(engine.module.weight)
    reduced = float(grad.float().sum()) if grad is not None else 0.0
    engine.destroy()
    total = grad_accum * W * (W + 1) / 2
    return torch.tensor(total / reduced if reduced else float("inf"), dtype=torch.float64)


def check_gradient_reduction(initialize: Callable[[nn.Module], object], cfg: Config, groups: SequenceParallelGroups,
                             device: torch.device) -> None:
    """Refuse to train when DeepSpeed's measured gradient reduction is not the one the loss scale undoes (a
    collective over the whole world; skipped when the sequence x data group is one rank).

    Raises:
        RuntimeError: naming DeepSpeed's version, the ZeRO stage, the degrees, and the measured vs expected factor.
    """
    if dist.get_world_size(groups.sdp) == 1:
        return  # nothing is reduced: K = 1 at every stage (engine.backward's division by grad_accum is tested)
    d, accum = groups.dims, cfg.train.grad_accum
    expected = grad_reduction_factor(cfg.zero.stage, d.dp, d.sp) * accum
    refuse_mismatch(measure_division(initialize, groups, accum, device), expected, device,
                    settings=f"zero.stage={cfg.zero.stage}, dp={d.dp}, sp={d.sp}, train.grad_accum={accum}",
                    factor="grad_reduction_factor x grad_accum", fix="ds4sci.train.loss.grad_reduction_factor")


def refuse_mismatch(measured: torch.Tensor, expected: float, device: torch.device, settings: str, factor: str,
                    fix: str) -> None:
    """Raise on every rank when any rank's ``measured`` division (a float64 scalar) is not ``expected`` (collective
    over the whole world: all ranks fail together, a rank that passed would hang in the next collective).

    Raises:
        RuntimeError: naming DeepSpeed's version, ``settings``, the measured divisions and ``factor = expected``, and
            what to ``fix``.
    """
    import deepspeed

    gathered = [torch.zeros((), dtype=torch.float64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, measured.to(device))
    values = sorted({float(m) for m in gathered})
    if any(abs(m - expected) > 1e-2 * expected for m in values):  # bf16 is exact here; a wrong one is >= 2x off
        raise RuntimeError(
            f"DeepSpeed {deepspeed.__version__} reduces gradients differently from what ds4sci's loss scale assumes "
            f"({settings}): it divides the summed gradient by {' / '.join(f'{m:g}' for m in values)} (over the "
            f"ranks), the loss is scaled by {factor} = {expected:g}. "
            f"Training would mis-scale every gradient; use a tested DeepSpeed version (see setup.py) or update {fix}")
