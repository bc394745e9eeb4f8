"""The training data order: a step reads the same samples however its global batch is split into micro-batch, data
ranks and accumulation (what lets a run resume at another process count with the uninterrupted run's losses)."""
from collections import Counter

import pytest

from ds4sci.train.data_order import train_samples

SPLITS = [(4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2), (1, 4, 1), (1, 1, 4)]  # micro-batch, dp, accumulation: 4


def _step(n: int, step: int, micro: int, dp: int, accum: int) -> Counter:
    """The samples every data rank reads over step ``step``'s micro-steps, and their epoch."""
    read = Counter()
    for a in range(accum):
        for rank in range(dp):
            epoch, positions = train_samples(7, n, step * accum + a, micro, dp, accum, rank)
            read.update((epoch, int(i)) for i in positions)
    return read


@pytest.mark.parametrize("n", [10, 11, 12])
def test_a_step_reads_the_same_samples_at_every_split_of_its_global_batch(n):
    for step in range(7):  # three epochs and more: two steps each, the remainder dropped
        reference = _step(n, step, *SPLITS[0])
        assert sum(reference.values()) == 4 and {epoch for epoch, _ in reference} == {step // (n // 4)}
        for split in SPLITS[1:]:
            assert _step(n, step, *split) == reference, (n, step, split)
    epoch = [i for step in range(n // 4) for _, i in _step(n, step, *SPLITS[0])]
    assert len(set(epoch)) == len(epoch)  # within an epoch no sample twice
