"""GenSLM split over a tensor-parallel group and composed with Unified SP: :func:`apply_tensor_parallel`.

- Blocks (:class:`TensorParallelBlock`, a :class:`~ds4sci.models.genslm.model.Block` whose branches run the layers of
  :mod:`ds4sci.parallel.tensor_parallel` on sequence regions): Llama's sequential residual keeps ``Block``'s
  composition, one all-gather and one reduce-scatter per branch. GPT-NeoX's parallel residual ``x + attn(ln1(x)) +
  mlp(ln2(x))`` lets both branches share ONE all-gather and ONE reduce-scatter of their summed partials (two, stacked
  into one collective, while dropout is active, since dropout applies to each branch after the reduction).
- Composition with Unified SP (Fang & Zhao 2024, USP, arXiv:2405.07719, section 5; rank order TP < Ulysses < Ring):
  TP ranks of one SP rank hold the same sequence shard. Heads are split TP first, then Ulysses inside
  :class:`~ds4sci.sequence.DistributedAttention`; the ALiBi head offset is ``tp_rank * H/tp + ulysses_rank *
  H/(tp*U)`` (:class:`TensorParallelCore` adds the first term). Rotary tables and document ids use the full local SP
  shard, which is what the attention sees after the all-gather.
- Where the sequence is split over TP: the embedding is all-reduced to the full SP shard (the learned position rows
  the trainer adds are those of the whole SP shard, as without TP), then
  :class:`~ds4sci.parallel.tensor_parallel.SequenceRegionSplit` (in place of ``emb_dropout``) keeps this TP rank's
  contiguous ``1/tp`` piece. The final norm gathers the full SP shard again, so ``GenSLM.forward`` returns hidden
  states ``[B, T, hidden]`` and logits ``[B, T, V_pad/tp]`` (vocabulary-sharded) for the same ``T`` tokens as without
  TP: the trainer's batch sharding and position embeddings are unchanged; only the loss changes
  (:func:`token_loss_for`).
- A tied head (``tie_word_embeddings``) is the embedding's shard itself: both are split on the same padded vocabulary
  rows, so one parameter serves both and its gradient sums both uses, as on one device.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import Tensor
from torch import nn

from ds4sci.distributed.comm import CommCounter
from ds4sci.distributed.comm import reduce_scatter_sequence_region
from ds4sci.distributed.groups import SequenceParallelGroups
from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm import token_loss
from ds4sci.models.genslm.model import MLP
from ds4sci.models.genslm.model import Attention
from ds4sci.models.genslm.model import Block
from ds4sci.models.genslm.model import LayerKV
from ds4sci.parallel.tensor_parallel import ColumnParallelLinear
from ds4sci.parallel.tensor_parallel import QKVParallelLinear
from ds4sci.parallel.tensor_parallel import RegionGather
from ds4sci.parallel.tensor_parallel import RowParallelLinear
from ds4sci.parallel.tensor_parallel import SequenceParallelNorm
from ds4sci.parallel.tensor_parallel import SequenceRegionSplit
from ds4sci.parallel.tensor_parallel import TPGroup
from ds4sci.parallel.tensor_parallel import VocabParallelEmbedding
from ds4sci.parallel.tensor_parallel import VocabParallelOutput
from ds4sci.parallel.tensor_parallel import vocab_parallel_token_loss

__all__ = ["TensorParallelCore", "TensorParallelBlock", "apply_tensor_parallel", "token_loss_for"]


class TensorParallelCore(nn.Module):
    """A local attention (the protocol of :mod:`ds4sci.kernels.local_attention`) on the heads of one TP rank: adds
    ``offset = tp_rank * H/tp`` to the protocol's ``head_offset`` (ALiBi slopes, per-head masks are indexed by
    global head). Wrapped by :class:`~ds4sci.sequence.DistributedAttention`, which adds the Ulysses offset."""

    def __init__(self, core: Callable, offset: int):
        super().__init__()
        self.core = core
        self.offset = offset

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, head_offset: int = 0, **protocol):
        return self.core(q, k, v, head_offset=head_offset + self.offset, **protocol)

    def extra_repr(self) -> str:
        return f"offset={self.offset}"


def _split_attention(attention: Attention, tp: TPGroup, source: RegionGather, slot: int) -> None:
    """GenSLM attention on the heads of one TP rank, in place: column-parallel ``query_key_value``
    (:class:`QKVParallelLinear`, reading slot ``slot`` of ``source``'s region), row-parallel ``dense``
    (:class:`RowParallelLinear`), the core offset to this rank's first head, and the module's head counts made local,
    so its own forward (rotary, grouped q/k/v split) runs on ``H/tp`` query and ``max(Hkv/tp, 1)`` key/value heads
    and returns this rank's partial sum ``[B, T, hidden]``."""
    H, Hkv = attention.num_heads, attention.num_kv_heads
    attention.query_key_value = QKVParallelLinear(attention.query_key_value, H, Hkv, attention.head_dim, tp, source,
                                                  slot)
    attention.num_heads, attention.num_kv_heads = H // tp.size, max(Hkv // tp.size, 1)
    attention.dense = RowParallelLinear(attention.dense, tp)  # [hidden, hidden/tp]
    attention.core = TensorParallelCore(attention.core, tp.rank * attention.num_heads)


def _split_mlp(mlp: MLP, tp: TPGroup, source: RegionGather, slot: int) -> None:
    """GenSLM MLP on ``intermediate/tp`` columns, in place: ``dense_h_to_4h`` (and SwiGLU's ``dense_h_to_4h_gate``)
    column-parallel (:class:`ColumnParallelLinear`, both reading slot ``slot`` of ``source``'s region),
    ``dense_4h_to_h`` row-parallel; its own forward returns this rank's partial sum ``[B, T, hidden]`` (the
    activation, and SwiGLU's product, act on matching columns)."""
    mlp.dense_h_to_4h = ColumnParallelLinear(mlp.dense_h_to_4h, tp, source, slot)  # [I/tp, hidden]
    if mlp.dense_h_to_4h_gate is not None:
        mlp.dense_h_to_4h_gate = ColumnParallelLinear(mlp.dense_h_to_4h_gate, tp, source, slot)
    mlp.dense_4h_to_h = RowParallelLinear(mlp.dense_4h_to_h, tp)  # [hidden, I/tp]


class TensorParallelBlock(Block):
    """A GenSLM :class:`~ds4sci.models.genslm.model.Block` on a sequence region ``x [B, T/tp, hidden]``, its
    attention and MLP split over TP; ``Block.forward`` composes the residual from the branches below.

    Sequential residual (Llama): each branch is norm on the region -> all-gather -> column/row-parallel layers on the
    full SP shard -> reduce-scatter of the partial sums -> dropout on the region. Parallel residual (GPT-NeoX):
    :meth:`parallel_residual_sum` gathers both normalised regions in one all-gather and reduce-scatters the summed
    partials (row-parallel biases included) once. Each all-gather is a :class:`RegionGather` (attention's slot 0 and
    the MLP's slot 1 of one, or one per branch), repeated once in backward for the weight gradients.
    ``recompute_norm`` has no effect: the projections keep this rank's region, not the normalised output.
    """

    def __init__(self, block: Block, tp: TPGroup):
        nn.Module.__init__(self)  # the parts are ``block``'s, split in place: nothing is built from a config
        self.tp = tp
        self.input_layernorm = SequenceParallelNorm(block.input_layernorm, tp)
        self.post_attention_layernorm = SequenceParallelNorm(block.post_attention_layernorm, tp)
        self.parallel_residual = block.parallel_residual
        self.recompute_norm = False
        if self.parallel_residual:  # both normalised regions stacked into one gather: attention slot 0, MLP slot 1
            self.gather_attention = self.gather_mlp = RegionGather(tp)
        else:
            self.gather_attention, self.gather_mlp = RegionGather(tp), RegionGather(tp)
        _split_attention(block.attention, tp, self.gather_attention, 0)
        _split_mlp(block.mlp, tp, self.gather_mlp, 1 if self.parallel_residual else 0)
        self.attention, self.mlp = block.attention, block.mlp
        self.dropout = block.dropout

    def forward(self, x: Tensor, position_ids: Tensor, doc_ids: Tensor | None, kv: LayerKV | None = None) -> Tensor:
        if kv is not None:
            raise ValueError("a tensor-parallel block does not decode with a KV cache")
        out = super().forward(x, position_ids, doc_ids)
        self.gather_attention.release()
        self.gather_mlp.release()
        return out

    def attention_branch(self, x: Tensor, position_ids: Tensor, doc_ids: Tensor | None,
                         kv: LayerKV | None = None) -> Tensor:
        attn_in = self.gather_attention(self.input_layernorm(x).unsqueeze(0))[0]  # [1, B, T/tp, h] -> [B, T, h]
        attn = self.attention(attn_in, position_ids, doc_ids)  # [B, T, hidden], partial over TP
        return self.dropout(reduce_scatter_sequence_region(attn, self.tp.group, 1, self.tp.counter))  # [B, T/tp, h]

    def mlp_branch(self, x: Tensor) -> Tensor:
        mlp = self._mlp(self.gather_mlp(self.post_attention_layernorm(x).unsqueeze(0))[0])  # [B, T, hidden], partial
        return self.dropout(reduce_scatter_sequence_region(mlp, self.tp.group, 1, self.tp.counter))  # [B, T/tp, h]

    def parallel_residual_sum(self, x: Tensor, position_ids: Tensor, doc_ids: Tensor | None,
                              kv: LayerKV | None = None) -> Tensor:
        g, c = self.tp.group, self.tp.counter
        normed = torch.stack([self.input_layernorm(x), self.post_attention_layernorm(x)])  # [2, B, T/tp, hidden]
        attn_in, mlp_in = self.gather_attention(normed).unbind(0)  # 2 x [B, T, hidden]
        attn = self.attention(attn_in, position_ids, doc_ids)  # [B, T, hidden], partial over TP (bias included)
        mlp = self._mlp(mlp_in)
        if self.dropout.training and self.dropout.p > 0:  # dropout acts on each summed branch: reduce both
            attn, mlp = reduce_scatter_sequence_region(torch.stack([attn, mlp]), g, 2, c).unbind(0)  # [B, T/tp, h]
            return x + self.dropout(attn) + self.dropout(mlp)
        return x + reduce_scatter_sequence_region(attn + mlp, g, 1, c)  # [B, T/tp, hidden]

    def _mlp(self, x: Tensor) -> Tensor:
        """The MLP on the gathered region ``x [B, T, hidden]``. A tiled MLP (``mlp.tile``) saves ``x`` itself and
        computes on pieces of it, so its column-parallel layers then read their input as plain linear layers."""
        for layer in (self.mlp.dense_h_to_4h, self.mlp.dense_h_to_4h_gate):
            if layer is not None:
                layer.reads_region = not self.mlp.tile
        return self.mlp(x)


def apply_tensor_parallel(model: GenSLM, groups: SequenceParallelGroups, *, counter: CommCounter | None = None) -> None:
    """Split ``model`` over ``groups.tp`` in place (module swaps; parameter names unchanged); no-op for ``tp = 1``.

    Every rank must build the model with the same seed first, whole or on the meta device (each keeps its pieces;
    :func:`ds4sci.parallel.parallelize.materialize_` then draws a meta model's). Afterwards
    ``model(input_ids, position_ids, ...)`` takes the SP shard as before and returns vocabulary-sharded logits
    ``[B, T, V_pad/tp]``: use :func:`token_loss_for` (``groups``) as the loss. A tied output head
    (``tie_word_embeddings``) stays tied: the output projection uses the vocabulary-parallel embedding's shard, one
    parameter whose gradient sums both uses on each rank.

    Raises:
        ValueError: a degree cannot split the model (:meth:`ParallelDims.check_model`).
    """
    dims = groups.dims
    if dims.tp == 1:
        return
    cfg = model.config
    dims.check_model(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, num_layers=cfg.num_layers,
                     intermediate_size=cfg.intermediate_size)
    if isinstance(model.embed_in, VocabParallelEmbedding):
        raise ValueError("apply_tensor_parallel: the model is already tensor-parallel")
    tp = TPGroup(groups.tp, groups.tp_rank, dims.tp, counter)
    model.embed_in = VocabParallelEmbedding(model.embed_in, tp)
    model.emb_dropout = SequenceRegionSplit(model.emb_dropout, tp)
    for i, block in enumerate(model.layers):
        model.layers[i] = TensorParallelBlock(block, tp)
    head_input = RegionGather(tp)  # the final norm's region, gathered for the output projection
    model.final_layer_norm = SequenceParallelNorm(model.final_layer_norm, tp, gather=head_input)
    model.embed_out = VocabParallelOutput(model.embed_out, tp, cfg.vocab_size, head_input)
    if cfg.tie_word_embeddings:  # the same rows of the same padded vocabulary: one parameter, as in GenSLM
        model.embed_out.weight = model.embed_in.weight


def token_loss_for(groups: SequenceParallelGroups, counter: CommCounter | None = None) -> Callable[..., Tensor]:
    """The loss the trainer calls on the model's logits: ``token_loss`` for ``tp = 1``, else
    :func:`vocab_parallel_token_loss` bound to the TP group; signature ``(logits, targets, reduction="mean")``."""
    if groups.dims.tp == 1:
        return token_loss
    return functools.partial(vocab_parallel_token_loss, group=groups.tp, counter=counter)

