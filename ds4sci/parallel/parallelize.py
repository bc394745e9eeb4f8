"""Apply tensor and sequence parallelism to a single-device GenSLM from outside (torchtitan's ``parallelize`` step).

The model in :mod:`ds4sci.models.genslm` knows nothing of process groups. :func:`parallelize` is the one place
that changes it: tensor parallelism first (:func:`~ds4sci.parallel.genslm_tp.apply_tensor_parallel`: Megatron
column/row-parallel layers with sequence-parallel norms, vocabulary-parallel embedding and output), then every
block's attention core is wrapped in :class:`~ds4sci.sequence.DistributedAttention` over the Ulysses and ring groups,
and the learned position table is taken out and keeps only the rows of the positions this rank's sequence shard
holds. The caller (the trainer) shards tokens, targets, positions and document ids over SP with the same ``dims``
and, under TP, uses :func:`~ds4sci.parallel.genslm_tp.token_loss_for` as the loss.
"""
from __future__ import annotations

import torch
from torch import nn

from ds4sci.distributed.comm import CommCounter
from ds4sci.distributed.groups import SequenceParallelGroups
from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm import LearnedPositionEmbedding
from ds4sci.parallel.genslm_tp import apply_tensor_parallel
from ds4sci.parallel.tensor_parallel import tensor_parallel_plan
from ds4sci.sequence.attention import DistributedAttention
from ds4sci.sequence.sharding import shard_positions

__all__ = ["parallelize", "materialize_"]


def parallelize(
    model: GenSLM, groups: SequenceParallelGroups, *, counter: CommCounter | None = None,
    keep_position_table: bool = False,
) -> LearnedPositionEmbedding | None:
    """Make ``model`` tensor- and sequence-parallel over ``groups`` in place; return its learned position table, if any.

    - ``groups.dims.tp > 1``: :func:`~ds4sci.parallel.genslm_tp.apply_tensor_parallel` (the model's logits become
      vocabulary-sharded ``[B, T, V_pad/tp]``; parameter names are unchanged, split ones carry
      ``tensor_model_parallel = True``). Every rank must have built the model with the same seed, whole or on the
      meta device (then :func:`materialize_` draws this rank's pieces).
    - ``groups.dims.sp > 1``: each ``block.attention.core`` becomes
      ``DistributedAttention(core, groups.ulysses, groups.ring, layout=groups.dims.layout)``.
    - A learned position table (``position_embedding="learned"``) is popped from the model
      (:meth:`GenSLM.pop_position_embedding`; ``forward`` then takes ``position_embeds``) and, under SP, sharded
      to the rows of the global positions shard ``groups.sp_rank`` holds (Megatron-DeepSpeed's sequence-parallel
      position embedding, generalised to the zigzag layout). It is returned so the caller can keep it out of
      an engine that treats every parameter as replicated over the sequence x data group.
    - ``keep_position_table`` (inference): a learned table stays in the model, whole, and ``None`` is returned. Its
      rows are sharded by the context's layout, which a window shorter than the context does not follow; each rank
      then looks up the global positions of its shard, whatever the window's length.

    ``counter`` records every TP and SP collective of the model.

    Raises:
        ValueError: a degree cannot split the model (heads, MLP width, layers), naming the degree and the size.

    Returns:
        The (sharded) :class:`LearnedPositionEmbedding`, or ``None`` for rotary and ALiBi models.
    """
    dims = groups.dims
    cfg = model.config
    dims.check_model(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, num_layers=cfg.num_layers,
                     intermediate_size=cfg.intermediate_size)
    apply_tensor_parallel(model, groups, counter=counter)
    if dims.sp > 1:
        for block in model.layers:
            block.attention.core = DistributedAttention(
                block.attention.core, groups.ulysses, groups.ring, layout=dims.layout, counter=counter
            )
    if model.config.position_embedding != "learned" or keep_position_table:
        return None
    table = model.pop_position_embedding()
    if dims.sp > 1:
        rows = shard_positions(table.max_positions, groups.sp_rank, dims.sp, dims.layout, device=table.rows.device)
        table.shard_(rows)
    return table


@torch.no_grad()
def materialize_(model: GenSLM, table: LearnedPositionEmbedding | None, groups: SequenceParallelGroups,
                 keep: nn.Module | None = None) -> int:
    """Draw the meta parameters of a ``GenSLM(config, device="meta")`` after :func:`parallelize`: each becomes a CPU
    parameter holding exactly this rank's piece of :meth:`GenSLM.initial_value` (its tensor-parallel shard, with the
    vocabulary padding zeroed; the position table's rows of this sequence shard), so the result equals building the
    whole model with the same seed and then parallelizing it, while a rank never holds more than one full parameter
    beyond its own pieces. ``keep``: draw only the parameters of this module (a pipeline stage; the others stay on
    the meta device, costing nothing). Attributes set on a parameter (tensor-parallel marks) carry over.

    Returns:
        The number of elements drawn.
    """
    plan = tensor_parallel_plan(model)
    named = dict(model.named_parameters())
    if table is not None:
        named["embed_pos.weight"] = table.weight
    wanted = None if keep is None else {id(p) for p in keep.parameters()}
    new: dict[int, nn.Parameter] = {}
    for name, p in named.items():
        if not p.is_meta or (wanted is not None and id(p) not in wanted):
            continue
        shape = list(p.shape)  # this rank's piece -> the single-device parameter's shape
        if name in plan:
            shape[plan[name].dim] = plan[name].size
        if name == "embed_pos.weight":
            shape[0] = table.max_positions
        # the position table: only this SP shard's rows [R, hidden] are drawn
        value = model.initial_value(name, shape, rows=table.rows if name == "embed_pos.weight" else None)
        if name in plan:
            value = plan[name].piece(value, groups.tp_rank, groups.dims.tp)
        param = nn.Parameter(value, requires_grad=p.requires_grad)
        param.__dict__.update(p.__dict__)
        new[id(p)] = param
    for root in (model, table, keep):  # keep (a pipeline stage) may wrap the model's modules in its own
        for module in root.modules() if root is not None else ():
            for attr, p in module._parameters.items():
                if p is not None and id(p) in new:
                    module._parameters[attr] = new[id(p)]
    if keep is not None:
        left = [name for name, p in keep.named_parameters() if p.is_meta]
        if left:
            raise RuntimeError(f"materialize_: {left[:4]} of the kept module are not parameters of the model")
    return sum(p.numel() for p in new.values())
