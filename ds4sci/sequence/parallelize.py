"""Apply sequence parallelism to a single-device GenSLM from outside (torchtitan's ``parallelize`` step).

The model in :mod:`ds4sci.models.genslm` knows nothing of process groups. :func:`parallelize` is the one place
that changes it for sequence parallelism: it wraps every block's attention core in
:class:`~ds4sci.sequence.DistributedAttention` over the Ulysses and ring groups, and takes out the learned
position table and keeps only the rows of the positions this rank's sequence shard holds. The caller (the
trainer) shards tokens, targets, positions and document ids with the same ``dims``.
"""
from __future__ import annotations

from ds4sci.models.genslm import GenSLM, LearnedPositionEmbedding
from ds4sci.sequence.attention import DistributedAttention
from ds4sci.sequence.comm import CommCounter
from ds4sci.sequence.groups import SequenceParallelGroups
from ds4sci.sequence.sharding import shard_positions

__all__ = ["parallelize"]


def parallelize(
    model: GenSLM, groups: SequenceParallelGroups, *, counter: CommCounter | None = None
) -> LearnedPositionEmbedding | None:
    """Make ``model`` sequence-parallel over ``groups`` in place; return its learned position table, if any.

    - ``groups.dims.sp > 1``: each ``block.attention.core`` becomes
      ``DistributedAttention(core, groups.ulysses, groups.ring, layout=groups.dims.layout)``.
    - A learned position table (``position_embedding="learned"``) is popped from the model
      (:meth:`GenSLM.pop_position_embedding`; ``forward`` then takes ``position_embeds``) and, under SP, sharded
      to the rows of the global positions shard ``groups.sp_rank`` holds (Megatron-DeepSpeed's sequence-parallel
      position embedding, generalised to the zigzag layout). It is returned so the caller can keep it out of
      an engine that treats every parameter as replicated over the sequence x data group.

    Returns:
        The (sharded) :class:`LearnedPositionEmbedding`, or ``None`` for rotary and ALiBi models.
    """
    dims = groups.dims
    dims.check_heads(model.config.num_heads)
    if dims.sp > 1:
        for block in model.layers:
            block.attention.core = DistributedAttention(
                block.attention.core, groups.ulysses, groups.ring, layout=dims.layout, counter=counter
            )
    if model.config.position_embedding != "learned":
        return None
    table = model.pop_position_embedding()
    if dims.sp > 1:
        rows = shard_positions(table.max_positions, groups.sp_rank, dims.sp, dims.layout, device=table.weight.device)
        table.shard_(rows)
    return table
