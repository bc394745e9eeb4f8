"""The order training reads its samples in: seeded per epoch, and a function of the global batch alone, so a run
resumed at another split of that batch (micro-batch, data ranks, accumulation) reads the same data."""
from __future__ import annotations

import functools

import numpy as np


@functools.lru_cache(maxsize=2)
def _epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """The training sample order of ``epoch``: a seeded permutation of ``n`` samples, computed once per epoch (not
    once per micro-batch: at 40M windows a permutation takes about 0.5 s)."""
    order = np.random.default_rng((seed, epoch)).permutation(n)
    order.flags.writeable = False
    return order


def train_samples(seed: int, n: int, index: int, micro_batch_size: int, dp: int, grad_accum: int,
                   dp_rank: int) -> tuple[int, np.ndarray]:
    """The epoch and the training samples (positions in the dataset) that data rank ``dp_rank`` reads for global
    micro-batch ``index`` (micro-step ``index % grad_accum`` of step ``index // grad_accum``).

    An epoch is a seeded permutation of the ``n`` samples cut into global batches of ``micro_batch_size x dp x
    grad_accum`` (the remainder is dropped); step ``s`` reads batch ``s`` of it, micro-step by micro-step, each data
    rank its ``micro_batch_size`` consecutive samples. So a step's samples depend on the global batch only, not on how
    it is split into micro-batch, data ranks and accumulation: a run resumed at another split reads the same data.
    """
    per_micro, per_step = micro_batch_size * dp, micro_batch_size * dp * grad_accum
    step, micro = divmod(index, grad_accum)
    epoch, slot = divmod(step, n // per_step)
    first = slot * per_step + micro * per_micro + dp_rank * micro_batch_size
    return epoch, _epoch_order(seed, epoch, n)[first:first + micro_batch_size]
