"""ds4sci.sequence: sequence parallelism (DeepSpeed-Ulysses, ring attention, Unified Ulysses x Ring).

Where each concept lives:

- :mod:`~ds4sci.sequence.groups`: :class:`ParallelDims` (every degree, the layout, every rank coordinate),
  :func:`build_groups` (explicit process groups, no global singleton) and DeepSpeed's ``mpu`` adapter;
- :mod:`~ds4sci.sequence.sharding`: :class:`Layout` (contiguous / zigzag arithmetic) and the sharding of
  tokens, labels and positions;
- :mod:`~ds4sci.sequence.comm`: the differentiable all-to-all, ring shifts, byte counting;
- :mod:`~ds4sci.sequence.attention`: :class:`DistributedAttention` around any local attention
  (:mod:`ds4sci.kernels.local_attention`);
- :mod:`~ds4sci.sequence.tensor_parallel`: Megatron tensor parallelism with sequence-parallel norms and a
  vocabulary-parallel embedding, output and loss (:func:`token_loss_for`), and TP state-dict consolidation;
- :mod:`~ds4sci.sequence.parallelize`: :func:`parallelize`, applying all of it to a GenSLM from outside.

Importing this package has no side effects (no process group, no environment edits).
"""
from ds4sci.sequence.attention import DistributedAttention
from ds4sci.sequence.comm import CommCounter, RingShift, all_gather_seq, all_to_all
from ds4sci.sequence.groups import Coords, DeepSpeedMPU, ParallelDims, SequenceParallelGroups, build_groups
from ds4sci.sequence.parallelize import materialize_, parallelize
from ds4sci.sequence.sharding import (
    Layout,
    gather_sequence,
    pad_to_multiple,
    shard_positions,
    shard_sequence,
    unshard_sequence,
)
from ds4sci.sequence.tensor_parallel import (
    gather_tensor_parallel,
    gather_vocab,
    load_full_state_dict,
    shard_tensor_parallel,
    tensor_parallel_plan,
    token_loss_for,
    vocab_parallel_token_loss,
)

__all__ = [
    "DistributedAttention",
    "CommCounter",
    "RingShift",
    "all_gather_seq",
    "all_to_all",
    "Coords",
    "DeepSpeedMPU",
    "ParallelDims",
    "SequenceParallelGroups",
    "build_groups",
    "materialize_",
    "parallelize",
    "Layout",
    "gather_sequence",
    "pad_to_multiple",
    "shard_positions",
    "shard_sequence",
    "unshard_sequence",
    "gather_tensor_parallel",
    "gather_vocab",
    "load_full_state_dict",
    "shard_tensor_parallel",
    "tensor_parallel_plan",
    "token_loss_for",
    "vocab_parallel_token_loss",
]
