"""The shared spawn helper: results by rank, worker exceptions re-raised with their traceback, no hang."""
import time

import pytest
import torch.distributed as dist

from ds4sci.spawn import run_workers


def _rank_info(rank, world, offset):
    return (rank, world, dist.get_world_size(), offset)


def _fail_on_rank_one(rank, world):
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 would wait here forever for rank 1


@pytest.mark.distributed
def test_run_workers_returns_by_rank_and_propagates_errors():
    assert run_workers(_rank_info, 2, 7) == [(0, 2, 2, 7), (1, 2, 2, 7)]
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        run_workers(_fail_on_rank_one, 2, timeout=60)
    message = str(info.value)
    assert "--- rank 1 ---" in message and "ValueError: boom on rank 1" in message and "_fail_on_rank_one" in message
    assert time.monotonic() - start < 30, "a failed worker must not leave the test waiting for the timeout"
