"""ds4sci.sequence: sequence parallelism (DeepSpeed-Ulysses, ring attention, Unified Ulysses x Ring).

Process groups are built from one validated :class:`ParallelDims` and passed explicitly; nothing here keeps a
global process group. Importing this package has no side effects (no process group, no environment edits).
"""
from ds4sci.sequence.attention import DistributedAttention
from ds4sci.sequence.comm import CommCounter, RingShift, all_gather_seq, all_to_all
from ds4sci.sequence.groups import DeepSpeedMPU, ParallelDims, SequenceParallelGroups, build_groups
from ds4sci.sequence.local_attention import (
    attention_mask,
    flash_attention,
    flash_causal_mode,
    flex_attention,
    sdpa_attention,
)
from ds4sci.sequence.sharding import (
    LAYOUTS,
    PAD_DOC_ID,
    gather_sequence,
    layout_multiple,
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
    "DeepSpeedMPU",
    "ParallelDims",
    "SequenceParallelGroups",
    "build_groups",
    "attention_mask",
    "flash_attention",
    "flash_causal_mode",
    "flex_attention",
    "sdpa_attention",
    "LAYOUTS",
    "PAD_DOC_ID",
    "gather_sequence",
    "layout_multiple",
    "pad_to_multiple",
    "shard_positions",
    "shard_sequence",
    "unshard_sequence",
]
