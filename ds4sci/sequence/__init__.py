"""ds4sci.sequence: sequence parallelism (DeepSpeed-Ulysses, ring attention, Unified Ulysses x Ring).

Where each concept lives:

- :mod:`~ds4sci.sequence.attention`: :class:`DistributedAttention` around any local attention
  (:mod:`ds4sci.kernels.local_attention`);
- :mod:`~ds4sci.sequence.comm`: the differentiable all-to-all, ring shifts, byte counting;
- :mod:`~ds4sci.sequence.sharding`: the sharding of tokens, labels and positions by a sequence :class:`Layout`
  (contiguous / zigzag; its arithmetic lives with the parallel degrees in :mod:`ds4sci.parallel.dims`).

The rest of parallelism lives in :mod:`ds4sci.parallel`: the degrees and rank arithmetic (``ParallelDims``), the
process groups, Megatron tensor parallelism and ``parallelize``, which applies tensor and sequence parallelism to a
GenSLM from outside.

Importing this package has no side effects (no process group, no environment edits).
"""
from ds4sci.sequence.attention import DistributedAttention
from ds4sci.sequence.comm import CommCounter, RingShift, all_gather_seq, all_to_all
from ds4sci.sequence.sharding import (
    Layout,
    gather_sequence,
    pad_to_multiple,
    shard_positions,
    shard_sequence,
    unshard_sequence,
)

__all__ = [
    "DistributedAttention",
    "CommCounter",
    "RingShift",
    "all_gather_seq",
    "all_to_all",
    "Layout",
    "gather_sequence",
    "pad_to_multiple",
    "shard_positions",
    "shard_sequence",
    "unshard_sequence",
]
