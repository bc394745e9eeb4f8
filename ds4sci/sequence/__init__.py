"""ds4sci.sequence: sequence parallelism (DeepSpeed-Ulysses, ring attention, Unified Ulysses x Ring).

Where each concept lives:

- :mod:`~ds4sci.sequence.attention`: :class:`DistributedAttention` around any local attention
  (:mod:`ds4sci.kernels.local_attention`);
- :mod:`~ds4sci.sequence.ring`: the one ring driver (:func:`~ds4sci.sequence.ring.ring_forward`,
  :func:`~ds4sci.sequence.ring.ring_backward`) of the sequence ring and the 2-D Evoformer's rings, and ring
  attention's merge (:func:`merge_attention`, :func:`merge_softmax`);
- :mod:`~ds4sci.sequence.sharding`: the sharding of tokens, labels and positions by a sequence :class:`Layout`
  (contiguous / zigzag; its arithmetic lives with the parallel degrees in :mod:`ds4sci.distributed.dims`).

The collectives (all-to-all, ring shifts, byte counting) live in :mod:`ds4sci.distributed.comm`, the degrees and
process groups in :mod:`ds4sci.distributed`; tensor parallelism and applying parallelism to a GenSLM in
:mod:`ds4sci.parallel`.

Importing this package has no side effects (no process group, no environment edits).
"""
from ds4sci.sequence.attention import DistributedAttention
from ds4sci.sequence.ring import merge_attention
from ds4sci.sequence.ring import merge_softmax
from ds4sci.sequence.sharding import Layout
from ds4sci.sequence.sharding import gather_sequence
from ds4sci.sequence.sharding import pad_to_multiple
from ds4sci.sequence.sharding import shard_positions
from ds4sci.sequence.sharding import shard_sequence
from ds4sci.sequence.sharding import unshard_sequence

__all__ = [
    "DistributedAttention",
    "merge_attention",
    "merge_softmax",
    "Layout",
    "gather_sequence",
    "pad_to_multiple",
    "shard_positions",
    "shard_sequence",
    "unshard_sequence",
]
