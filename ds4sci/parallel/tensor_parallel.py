"""Tensor parallelism for GenSLM: Megatron-LM layers with Megatron sequence parallelism, composed with Ulysses x Ring.

Algorithms:

- Megatron-LM tensor parallelism (Shoeybi et al. 2019, arXiv:1909.08053): the fused QKV projection and the MLP's
  first projection (SwiGLU's gate and up projections alike) are column-parallel (TP rank ``t`` holds query heads
  ``[t*H/tp, (t+1)*H/tp)``: in GPT-NeoX's per-head ``[q | k | v]`` layout that is one contiguous block of QKV rows;
  with grouped-query attention, key/value groups whole, or a key/value head shared by ``tp/num_kv_heads`` ranks:
  :class:`QKVParallelLinear`), the attention output ``dense`` and the MLP's second projection are row-parallel
  (each rank produces a partial sum of the full hidden vector).
- Megatron sequence parallelism (Korthikanti et al. 2022, arXiv:2205.05198, "Reducing Activation Recomputation in
  Large Transformer Models"): outside the matmuls the residual stream is sharded on the sequence dim over the TP
  group, so LayerNorms, dropout and the residual hold ``1/tp`` of the activations. An all-gather on the sequence dim
  enters the column-parallel matmuls (its backward: a reduce-scatter), a reduce-scatter on the sequence dim leaves the
  row-parallel ones (its backward: an all-gather); no all-reduce. GPT-NeoX's parallel residual
  ``x + attn(ln1(x)) + mlp(ln2(x))`` lets the attention and MLP partial sums share ONE reduce-scatter (two, stacked
  into one collective, while dropout is active, since dropout applies to each branch after the reduction); Llama's
  sequential residual needs one all-gather and one reduce-scatter per branch. LayerNorm and RMSNorm alike run on the
  regions (:class:`SequenceParallelNorm`).
- Composition with Unified SP (Fang & Zhao 2024, USP, arXiv:2405.07719, section 5; rank order TP < Ulysses < Ring):
  TP ranks of one SP rank hold the same sequence shard. Heads are split TP first, then Ulysses inside
  :class:`~ds4sci.sequence.DistributedAttention`; the ALiBi head offset is ``tp_rank * H/tp + ulysses_rank *
  H/(tp*U)`` (:class:`TensorParallelCore` adds the first term). Rotary tables and document ids use the full local SP
  shard, which is what the attention sees after the all-gather.
- Vocabulary parallelism (Megatron-LM): the input embedding and the output projection are split on the vocabulary,
  padded to a multiple of ``tp`` (GenSLM's codon vocabulary has 69 words); padded logits are ``-inf`` so they
  never win and carry no probability. :func:`vocab_parallel_token_loss` is the cross entropy over vocabulary
  shards (fp32; max, sum of exponentials and target logit reduced over TP; the full logits are never gathered).
  A tied head (``tie_word_embeddings``) is the embedding's shard itself: both are split on the same padded
  vocabulary rows, so one parameter serves both and its gradient sums both uses, as on one device.

Where the sequence is split over TP: the embedding is all-reduced to the full SP shard (the learned position rows
the trainer adds are those of the whole SP shard, as without TP), then :class:`SequenceRegionSplit` (in place of
``emb_dropout``) keeps this TP rank's contiguous ``1/tp`` piece and applies dropout there. The final LayerNorm
gathers the full SP shard again, so ``GenSLM.forward`` returns hidden states ``[B, T, hidden]`` and logits
``[B, T, V_pad/tp]`` (vocabulary-sharded) for the same ``T`` tokens as without TP. So the trainer's batch sharding
(``shard_sequence`` over SP) and position embeddings are unchanged; only the loss changes (:func:`token_loss_for`).

Parameters keep the single-device names (``layers.0.attention.query_key_value.weight``, ...), so a consolidated state
dict (:func:`gather_tensor_parallel`) is the single-device model's. Parameters split over TP carry
``tensor_model_parallel = True`` (what DeepSpeed 0.19.8's ``deepspeed.runtime.utils.is_model_parallel_parameter`` reads:
gradient norms in ``clip_grad_norm_`` and ZeRO 1/2/3 count such a parameter on every TP rank and the others on TP rank 0
only, then sum over the model-parallel group, i.e. the TP group of :class:`~ds4sci.parallel.groups.DeepSpeedMPU`) and
``ds4sci_tp_dim`` / ``ds4sci_tp_size`` / ``ds4sci_tp_padded`` (split dim, unpadded and padded full size). Replicated
LayerNorm parameters, used on sequence shards, get their gradient summed over TP in backward (:func:`sync_grad`); each
row-parallel bias is added as ``bias/tp`` to every partial sum before the reduce-scatter, with its full gradient passed
through (every TP rank sees the same output gradient), so every TP rank holds the same full gradient of every replicated
parameter. Each parameter is used inside its own module's forward, as ZeRO-3's parameter gathering expects.

Why not DeepSpeed AutoTP (checked in deepspeed 0.19.8):

- No sequence-parallel regions: ``module_inject/layers.py``'s ``LinearAllreduce`` all-reduces the full row-parallel
  output (``RowParallel.forward``) and ``LinearLayer``'s input is replicated with an all-reduce in backward
  (``ColumnParallel``); nothing reduce-scatters or all-gathers on the sequence dim, so LayerNorm and dropout
  activations stay replicated over TP (Korthikanti et al.'s memory saving is lost).
- Its own groups: ``DeepSpeedEngine._configure_tensor_parallel_states`` sets ``engine.mpu = deepspeed.utils.groups``
  and ``groups._init_tp_mesh_device`` builds a 2-D (data_parallel x tensor_parallel) mesh with
  ``data_parallel = world / tp``: there is no sequence axis, so the ``mpu`` carrying our Ulysses/ring/sequence-data
  groups is replaced.
- Our attention core: ALiBi slopes are indexed by a global head offset (the local attention protocol's
  ``head_offset``); AutoTP slices weights by module name and knows nothing of the core, so TP ranks would apply the
  slopes of heads ``0..H/tp-1``. (The fused QKV alone would be fine: ``query_key_value`` is in
  ``fusedqkv_utils.require_tp_fused_qkvw``'s list and an unknown block falls back to the ``bloomtype`` split, one
  contiguous block of rows, which is right for GPT-NeoX's per-head layout.)

Activation memory (Megatron-LM's choice, described with sequence parallelism by Korthikanti et al. 2022): the
column-parallel matmuls keep only this TP rank's sequence region of their input ``[k, B, T/tp, hidden]`` for
backward, not the gathered ``[B, T, hidden]``, and all-gather it again in backward to form their weight gradients:
one more all-gather per gathered input per layer, ``(tp-1)/tp * N h`` elements sent, for ``tp`` times less saved
input (:class:`ColumnParallelLinear`, :class:`QKVParallelLinear`; the block's :class:`RegionGather` gathers each
region once in forward and once in backward for all the projections that read it: fused QKV, the MLP's up projection
and SwiGLU's gate; likewise the vocabulary-parallel output projection on the final norm's region).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ds4sci.kernels.tiled_loss import tiled_loss
from ds4sci.models.genslm import IGNORE_INDEX, GenSLM, token_loss
from ds4sci.models.genslm.model import MLP, Attention, Block, RMSNorm, rms_norm
from ds4sci.parallel.groups import SequenceParallelGroups
from ds4sci.sequence.comm import CommCounter, group_rank, group_size

__all__ = [
    "TPShard",
    "reduce_scatter_sequence_region",
    "split_sequence_region",
    "reduce_from_tensor_region",
    "sync_grad",
    "TensorParallelCore",
    "VocabParallelEmbedding",
    "VocabParallelOutput",
    "SequenceRegionSplit",
    "SequenceParallelNorm",
    "RegionGather",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "QKVParallelLinear",
    "TensorParallelBlock",
    "apply_tensor_parallel",
    "vocab_parallel_token_loss",
    "token_loss_for",
    "gather_vocab",
    "tensor_parallel_plan",
    "gather_tensor_parallel",
    "shard_tensor_parallel",
    "load_full_state_dict",
]


# ------------------------------------------------------------------------------------------------- communication
def _nbytes(x: Tensor) -> int:
    return x.numel() * x.element_size()


def _record(counter: CommCounter | None, kind: str, nbytes: int) -> None:
    if counter is not None:
        counter.record(kind, nbytes, nbytes)


#: every rank's tensor gathered into one output tensor: torch 2.13 names it ``all_gather_single`` (the old name,
#: ``all_gather_into_tensor``, warns there); the torch versions before have the old name only
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_gather(x: Tensor, group: dist.ProcessGroup, dim: int, counter: CommCounter | None) -> Tensor:
    """Concatenate every rank's ``x`` (one shape on every rank) along ``dim`` in group-rank order.

    The pieces are received into one buffer, viewed ``[P, *x.shape]`` (:data:`_gather_into`, gloo and NCCL alike:
    NCCL's list ``all_gather`` would stage them in a flat buffer of its own and copy them out). When every dim before
    ``dim`` has size 1 (``dim`` leads in memory) the result is that buffer viewed as ``[..., P X, ...]``: nothing is
    alive beside it but ``x``. Otherwise no strided view is the result: it is copied once into a contiguous result, so the
    buffer and the result are alive together, as the received pieces and their concatenation would be; a caller
    that can take a permuted result gathers along a leading dim instead (the Evoformer stack's exit,
    :func:`ds4sci.parallel.evoformer.common.gather_leading`)."""
    world = dist.get_world_size(group)
    dim = dim % x.ndim
    x = x.contiguous()
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))  # the pieces stacked on dim 0 (gloo's one layout)
    _gather_into(out, x, group=group)
    _record(counter, "all_gather", _nbytes(x) * (world - 1))
    return out.view(world, *x.shape).movedim(0, dim).flatten(dim, dim + 1)


def _reduce_scatter(x: Tensor, group: dist.ProcessGroup, dim: int, counter: CommCounter | None) -> Tensor:
    """Sum ``x`` over the group and keep this rank's ``1/P`` piece along ``dim``.

    NCCL runs ``reduce_scatter_tensor``; gloo has no reduce-scatter, so there it is an all-to-all of the pieces
    followed by a local sum (the same bytes leave each rank: ``(P-1)/P`` of ``x``).
    """
    world = dist.get_world_size(group)
    if x.size(dim) % world:
        raise ValueError(f"reduce-scatter: dim {dim} of shape {tuple(x.shape)} is not divisible by the TP degree {world}")
    send = torch.stack(x.chunk(world, dim=dim)).contiguous()  # [P, ..., X/P, ...]: piece j goes to rank j
    if dist.get_backend(group) == "nccl":
        out = torch.empty_like(send[0])
        dist.reduce_scatter_tensor(out, send.reshape(-1), group=group)
    else:
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)  # recv[j]: rank j's partial sum of my piece
        out = recv.sum(0)
    _record(counter, "reduce_scatter", _nbytes(send[0]) * (world - 1))
    return out


def _all_reduce(x: Tensor, group: dist.ProcessGroup, counter: CommCounter | None, op=dist.ReduceOp.SUM) -> Tensor:
    x = x.clone().contiguous()
    dist.all_reduce(x, op=op, group=group)
    world = dist.get_world_size(group)
    _record(counter, "all_reduce", 2 * _nbytes(x) * (world - 1) // world)  # a ring all-reduce's bytes per rank
    return x


def _piece(x: Tensor, dim: int, rank: int, world: int) -> Tensor:
    return x.chunk(world, dim=dim)[rank].contiguous()


def _split(x: Tensor, group: dist.ProcessGroup, dim: int, counter: CommCounter | None) -> Tensor:
    """This rank's contiguous ``1/P`` piece of ``x`` along ``dim`` (no communication), a copy that owns its storage: a
    view (the piece of a ``[1, T, hidden]`` embedding is one) would keep the whole of ``x`` alive wherever it is saved
    for backward (the first block's norm, or its checkpointed input, which host offload then cannot move)."""
    return x.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)].clone(
        memory_format=torch.contiguous_format)


class _SequenceRegion(torch.autograd.Function):
    """A collective over the TP group in forward and its adjoint in backward, each ``f(x, group, dim, counter)``;
    on the sequence dim: full SP shard <-> this rank's sequence region. The pairs in use: reduce-scatter /
    all-gather (leaving the row-parallel matmuls, Korthikanti et al. 2022's ``g-bar``), slice / all-gather (the
    embedding's replicated output to a region) and all-gather / reduce-scatter (a shared key/value head's projection
    rows, :class:`QKVParallelLinear`). Entering the column-parallel matmuls (``g``) is :class:`_GatherRegion`."""

    @staticmethod
    def forward(ctx, x, group, dim, counter, collective, adjoint):
        ctx.group, ctx.dim, ctx.counter, ctx.adjoint = group, dim, counter, adjoint
        return collective(x, group, dim, counter)

    @staticmethod
    def backward(ctx, grad):
        return ctx.adjoint(grad, ctx.group, ctx.dim, ctx.counter), None, None, None, None, None


class _Region:
    """One forward's input of the column-parallel matmuls of a block (or of the output projection): this TP rank's
    sequence regions ``local [k, B, T/tp, hidden]`` (``k`` normalised tensors gathered in one collective) and, in
    backward, from the first weight gradient that needs it until the gather's own backward, their re-gathered copy
    ``full [k, B, T, hidden]``."""

    def __init__(self, local: Tensor, tp: "_TP"):
        self.local, self.tp = local, tp
        self.full: Tensor | None = None

    def gathered(self, local: Tensor) -> Tensor:
        """``[k, B, T, hidden]``: all-gathered once (counted) for all the matmuls reading the region."""
        if self.full is None:
            self.full = _all_gather(local, self.tp.group, 2, self.tp.counter)
        return self.full


class _GatherRegion(torch.autograd.Function):
    """``[k, B, T/tp, hidden] -> [k, B, T, hidden]``: all-gather in forward, saving nothing (each reader saves the
    region itself); backward reduce-scatters the gradient summed over the readers (Korthikanti et al.'s ``g``) and
    drops the region and its re-gathered copy, which every reader's backward has used by then."""

    @staticmethod
    def forward(ctx, local, region):
        ctx.region = region
        return _all_gather(local, region.tp.group, 2, region.tp.counter)

    @staticmethod
    def backward(ctx, grad):
        region, ctx.region = ctx.region, None
        region.local = region.full = None
        return _reduce_scatter(grad, region.tp.group, 2, region.tp.counter), None


class _ColumnParallelMatmul(torch.autograd.Function):
    """``x [B, T, in] @ weight.T + bias`` (or ``x [B*T, in]``) for ``x`` the gathered slot ``slot`` of ``region``,
    saving the region (``[k, B, T/tp, in]``, shared by its readers) instead of ``x``; backward re-gathers it for the
    weight gradient. The gradients are computed as autograd computes ``F.linear``'s (folded to 2-D, the same ``mm``
    calls), so they equal those of a linear layer saving ``x``."""

    @staticmethod
    def forward(ctx, x, weight, bias, region, slot):
        ctx.save_for_backward(region.local, weight)
        ctx.region, ctx.slot, ctx.bias = region, slot, bias is not None
        # [..., out]; the attention passes its tokens folded, [B*T, in], so the fused qkv output is addmm's own
        # tensor, not a view, and the in-place rotary (apply_rotary_qkv_) may write it
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        local, weight = ctx.saved_tensors
        grad2 = grad.reshape(-1, grad.shape[-1])  # [B*T, out]
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = grad2.mm(weight).view(*grad.shape[:-1], weight.shape[1])  # [B, T, in]
        if ctx.needs_input_grad[1]:
            x = ctx.region.gathered(local)[ctx.slot]  # [B, T, in]: the re-gathered input
            grad_w = x.reshape(-1, x.shape[-1]).t().mm(grad2).t()  # [out, in]
        if ctx.bias and ctx.needs_input_grad[2]:
            grad_b = grad2.sum(0)
        ctx.region = None
        return grad_x, grad_w, grad_b, None, None


class RegionGather:
    """Gathers normalised sequence regions for the column-parallel matmuls that read them and tells those which
    region they read: a block (or the final norm) calls it on ``local [k, B, T/tp, hidden]`` and gets ``[k, B, T,
    hidden]``; each reader (:class:`ColumnParallelLinear`, :class:`QKVParallelLinear`, :class:`VocabParallelOutput`)
    holds this object and a slot ``< k`` and, inside its own forward, takes :attr:`current`, the region of this
    forward (so that ZeRO-3 still finds each parameter used in its own module); the caller resets it once its readers
    have run (:meth:`release`: the readers' autograd contexts then hold the region alone). A plain object, not a
    module: it holds no parameters and is shared by several modules."""

    def __init__(self, tp: "_TP"):
        self.tp = tp
        self.current: _Region | None = None

    def __call__(self, local: Tensor) -> Tensor:
        self.current = _Region(local, self.tp)
        return _GatherRegion.apply(local, self.current)

    def release(self) -> None:
        self.current = None

    def region(self, x: Tensor, slot: int) -> _Region:
        """The current region, checked against the reader's input ``x [B, T, in]`` (or its tokens folded, ``[B*T,
        in]``)."""
        region = self.current
        k, B, T_local, h = (0, 0, 0, 0) if region is None or region.local is None else region.local.shape
        if (B * T_local * self.tp.size, h) != (x.numel() // max(x.shape[-1], 1), x.shape[-1]) or slot >= k:
            raise ValueError(f"a column-parallel layer reads its block's gathered sequence region; got an input of "
                             f"shape {tuple(x.shape)}, not the block's last gathered region (slot {slot})")
        return region


class _ReduceFromTensor(torch.autograd.Function):
    """Partial results of a vocabulary shard -> replicated sum: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group, counter):
        return _all_reduce(x, group, counter)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _SyncGrad(torch.autograd.Function):
    """A replicated parameter used on sequence shards: identity forward, gradient all-reduced over TP in backward."""

    @staticmethod
    def forward(ctx, p, group, counter):
        ctx.group, ctx.counter = group, counter
        return p.view_as(p)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, ctx.counter), None, None


def reduce_scatter_sequence_region(x: Tensor, group, dim: int = 1, counter: CommCounter | None = None) -> Tensor:
    """Partial sums ``[B, T, ...]`` -> this rank's summed piece ``[B, T/tp, ...]`` (backward: all-gather)."""
    return x if group_size(group) == 1 else _SequenceRegion.apply(x, group, dim, counter, _reduce_scatter, _all_gather)


def split_sequence_region(x: Tensor, group, dim: int = 1, counter: CommCounter | None = None) -> Tensor:
    """Replicated ``[B, T, ...]`` -> this rank's contiguous piece ``[B, T/tp, ...]`` (backward: all-gather)."""
    return x if group_size(group) == 1 else _SequenceRegion.apply(x, group, dim, counter, _split, _all_gather)


def reduce_from_tensor_region(x: Tensor, group, counter: CommCounter | None = None) -> Tensor:
    """Sum partial results over TP (all-reduce); backward passes the (replicated) gradient through."""
    return x if group_size(group) == 1 else _ReduceFromTensor.apply(x, group, counter)


def sync_grad(p: Tensor, group, counter: CommCounter | None = None) -> Tensor:
    """``p`` unchanged; its gradient is summed over the TP group (LayerNorm weights on sequence shards)."""
    return p if group_size(group) == 1 else _SyncGrad.apply(p, group, counter)


# ------------------------------------------------------------------------------------------------------ sharding
@dataclass(frozen=True)
class TPShard:
    """How a parameter is split over TP: along ``dim``, ``size`` rows in the single-device model, padded to
    ``padded`` (a multiple of tp; only the vocabulary is ever padded). ``order``: the single-device rows in the order
    the TP pieces hold them, rank after rank (a permutation of ``range(size)``); ``None``: in order, TP rank ``t``
    holding the contiguous piece ``t`` (only the fused QKV of a model with fewer key/value heads than TP ranks is
    permuted: :class:`QKVParallelLinear`)."""

    dim: int
    size: int
    padded: int
    order: tuple[int, ...] | None = None

    def arrange(self, full: Tensor) -> Tensor:
        """The single-device tensor in the pieces' order, padded: ``[.., size, ..] -> [.., padded, ..]`` along ``dim``."""
        if full.shape[self.dim] != self.size:
            raise ValueError(f"full size {full.shape[self.dim]} along dim {self.dim}, expected {self.size}")
        if self.order is not None:
            full = full.index_select(self.dim, torch.tensor(self.order, device=full.device))
        if self.padded > self.size:
            pad_shape = list(full.shape)
            pad_shape[self.dim] = self.padded - self.size
            full = torch.cat([full, full.new_zeros(pad_shape)], dim=self.dim)
        return full

    def restore(self, pieces: Tensor) -> Tensor:
        """Inverse of :meth:`arrange`: the pieces concatenated along ``dim`` -> the single-device tensor."""
        pieces = pieces.narrow(self.dim, 0, self.size)
        if self.order is None:
            return pieces.clone()
        order = torch.tensor(self.order, device=pieces.device)
        return torch.empty_like(pieces).index_copy_(self.dim, order, pieces)


@dataclass(frozen=True)
class _TP:
    group: dist.ProcessGroup
    rank: int
    size: int
    counter: CommCounter | None


def _shard_param(p: Tensor | None, dim: int, tp: _TP, padded: int | None = None,
                 order: tuple[int, ...] | None = None) -> nn.Parameter | None:
    """This TP rank's piece of a full parameter (:meth:`TPShard.arrange`: rows reordered by ``order``, zero padded to
    ``padded`` along ``dim``), marked for DeepSpeed and for :func:`gather_tensor_parallel`; ``None`` stays ``None``
    (a bias-free layer)."""
    if p is None:
        return None
    size = p.shape[dim]
    plan = TPShard(dim, size, size if padded is None else padded, order)
    shard = nn.Parameter(_piece(plan.arrange(p.detach()), dim, tp.rank, tp.size).clone(), requires_grad=p.requires_grad)
    _mark(shard, plan)
    return shard


def _mark(p: nn.Parameter, shard: TPShard) -> None:
    p.tensor_model_parallel = True  # deepspeed.runtime.utils.is_model_parallel_parameter
    p.ds4sci_tp_dim = shard.dim
    p.ds4sci_tp_size = shard.size
    p.ds4sci_tp_padded = shard.padded
    p.ds4sci_tp_order = shard.order


def _padded_vocab(vocab_size: int, tp: int) -> int:
    return math.ceil(vocab_size / tp) * tp


# ------------------------------------------------------------------------------------------------------- modules
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


class VocabParallelEmbedding(nn.Module):
    """Embedding split on the vocabulary (padded to a multiple of tp): rows ``[t*V_pad/tp, (t+1)*V_pad/tp)`` on TP
    rank ``t``; each rank looks up the ids it holds (zeros elsewhere) and the lookups are all-reduced, so the output
    ``[B, T, hidden]`` is the full, replicated embedding of the SP shard."""

    def __init__(self, embedding: nn.Embedding, tp: _TP):
        super().__init__()
        self.tp = tp
        self.num_embeddings = embedding.num_embeddings
        padded = _padded_vocab(self.num_embeddings, tp.size)
        self.weight = _shard_param(embedding.weight, 0, tp, padded)
        self.start = tp.rank * self.weight.shape[0]

    def forward(self, input_ids: Tensor) -> Tensor:
        local = input_ids - self.start
        held = (local >= 0) & (local < self.weight.shape[0])  # [B, T]
        out = F.embedding(torch.where(held, local, torch.zeros_like(local)), self.weight)  # [B, T, hidden]
        out = out.masked_fill(~held.unsqueeze(-1), 0.0)
        return reduce_from_tensor_region(out, self.tp.group, self.tp.counter)

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, rows=[{self.start}, {self.start + self.weight.shape[0]})"


class VocabParallelOutput(nn.Module):
    """Output projection split on the vocabulary (column-parallel): hidden ``[B, T, hidden]``, the final norm's
    region gathered by ``source`` (a :class:`RegionGather`, whose backward sums the ranks' partial input gradients)
    -> this rank's logits ``[B, T, V_pad/tp]``; padded columns are ``-inf``. Saves the region, not the hidden
    states, for backward.

    With ``targets [B, T]``, :class:`~ds4sci.models.genslm.model.OutputHead`'s tiled loss on the vocabulary shards
    (``tile`` tokens, :attr:`tile` set by ``activation_checkpointing.tiled_loss``): per tile this rank's logits and the
    vocabulary-parallel cross entropy (:func:`vocab_parallel_token_loss`, whose max and sums are all-reduced over TP
    per tile); the summed loss, the same on every TP rank. The tiled function saves the gathered hidden states
    ``[B, T, hidden]`` (its tiles are pieces of them), not the region."""

    def __init__(self, linear: nn.Linear, tp: _TP, vocab_size: int, source: RegionGather):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("VocabParallelOutput: GenSLM's embed_out has no bias; got one")
        self.tp, self.source = tp, source
        self.vocab_size = vocab_size
        self.weight = _shard_param(linear.weight, 0, tp, _padded_vocab(vocab_size, tp.size))
        rows = self.weight.shape[0]
        self.start = tp.rank * rows
        padding = torch.arange(self.start, self.start + rows) >= vocab_size
        device = "cpu" if self.weight.is_meta else self.weight.device  # a meta model's buffers stay real
        self.register_buffer("padding", padding.to(device), persistent=False)  # [V_pad/tp]
        self.tile = 0  # tokens per tile of the loss (see the class docstring)

    def forward(self, x: Tensor, targets: Tensor | None = None) -> Tensor:
        region = self.source.region(x, 0)
        self.source.release()  # the only reader of the final norm's region
        if targets is not None:
            if not self.tile:
                raise ValueError("VocabParallelOutput: a loss needs a tile (activation_checkpointing.tiled_loss); "
                                 "got tile=0")
            loss_fn = functools.partial(vocab_parallel_token_loss, reduction="none", group=self.tp.group,
                                        counter=self.tp.counter)
            return tiled_loss(lambda piece: self._masked(F.linear(piece, self.weight)), loss_fn, x, targets,
                              [self.weight], self.tile)
        return self._masked(_ColumnParallelMatmul.apply(x, self.weight, None, region, 0))  # [B, T, V_pad/tp]

    def _masked(self, logits: Tensor) -> Tensor:
        """``logits [..., V_pad/tp]`` with the padded columns ``-inf``."""
        return logits.masked_fill(self.padding, -math.inf) if bool(self.padding.any()) else logits

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, columns=[{self.start}, {self.start + self.weight.shape[0]})"


class SequenceRegionSplit(nn.Module):
    """Takes the place of ``GenSLM.emb_dropout``: keeps this TP rank's contiguous piece ``[B, T/tp, hidden]`` of the
    (replicated) embedded SP shard, then applies the dropout there."""

    def __init__(self, dropout: nn.Module, tp: _TP):
        super().__init__()
        self.dropout = dropout
        self.tp = tp

    def forward(self, x: Tensor) -> Tensor:
        T = x.shape[1]
        if T % self.tp.size:
            raise ValueError(
                f"the local sequence shard has {T} tokens, not divisible by tp={self.tp.size} (tensor parallelism's "
                f"sequence regions); pad the global sequence to a multiple of ParallelDims.sequence_multiple"
            )
        return self.dropout(split_sequence_region(x, self.tp.group, 1, self.tp.counter))


class SequenceParallelNorm(nn.Module):
    """The block's norm (``nn.LayerNorm`` or GenSLM's :class:`~ds4sci.models.genslm.model.RMSNorm`, as the model's
    config chose) on a sequence region, with replicated ``weight`` (and LayerNorm's ``bias``) whose gradients are
    summed over TP; with ``gather`` (the output projection's :class:`RegionGather`; GenSLM's final norm) its output
    is all-gathered to the full SP shard ``[B, T, hidden]``."""

    def __init__(self, norm: nn.LayerNorm | RMSNorm, tp: _TP, gather: RegionGather | None = None):
        super().__init__()
        self.rms = isinstance(norm, RMSNorm)
        self.weight, self.bias = norm.weight, getattr(norm, "bias", None)
        self.eps = norm.eps
        self.tp = tp
        self.gather = gather

    def forward(self, x: Tensor) -> Tensor:
        g, c = self.tp.group, self.tp.counter
        weight = sync_grad(self.weight, g, c)
        if self.rms:
            y = rms_norm(x, weight, self.eps)
        else:
            y = F.layer_norm(x, self.weight.shape, weight, sync_grad(self.bias, g, c), self.eps)
        return y if self.gather is None else self.gather(y.unsqueeze(0))[0]  # [1, B, T/tp, h] -> [B, T, h]

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, rms={self.rms}, gather={self.gather is not None}"


class ColumnParallelLinear(nn.Module):
    """Megatron-LM's column-parallel linear layer on a gathered sequence region: ``weight [out/tp, in]``, ``bias
    [out/tp]`` (if any), TP rank ``t``'s contiguous rows of ``linear``'s; ``forward(x [B, T, in]) -> [B, T, out/tp]``
    for ``x`` slot ``slot`` of the block's gathered region (``source``, a :class:`RegionGather`), saving the region,
    not ``x``, for backward. With :attr:`reads_region` False (set by the tiled MLP, whose tiles are pieces of the
    region and which saves its input itself: :func:`ds4sci.train.activation_checkpointing.apply_tiled_mlp`) it is a
    plain linear layer on ``x``."""

    def __init__(self, linear: nn.Linear, tp: _TP, source: RegionGather, slot: int):
        super().__init__()
        self.in_features = linear.in_features
        self.weight, self.bias = _shard_param(linear.weight, 0, tp), _shard_param(linear.bias, 0, tp)
        self.out_features = self.weight.shape[0]
        self.source, self.slot = source, slot
        self.reads_region = True

    def forward(self, x: Tensor) -> Tensor:
        if not self.reads_region:
            return F.linear(x, self.weight, self.bias)
        return _ColumnParallelMatmul.apply(x, self.weight, self.bias, self.source.region(x, self.slot), self.slot)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (this rank's), "
                f"bias={self.bias is not None}, slot={self.slot}")


class _ShareBias(torch.autograd.Function):
    """A replicated bias added to each of ``tp`` partial sums: ``b / tp`` forward, gradient passed through whole.

    The partials are summed by a reduce-scatter whose backward all-gathers, so every TP rank receives the same full
    output gradient ``G``; the bias gradient of the summed output, ``sum_tokens G``, is then what each rank computes
    locally: exact, identical on every rank, and no all-reduce.
    """

    @staticmethod
    def forward(ctx, bias, tp):
        return bias / tp

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class RowParallelLinear(nn.Module):
    """Row-parallel linear layer: ``weight [out, in/tp]`` (input columns of this TP rank) and the replicated ``bias``;
    ``forward`` returns this rank's partial sum ``x @ weight.T + bias/tp`` (the caller reduce-scatters the partials).

    The bias is used inside this module's own forward (ZeRO-3 gathers a module's parameters around its forward).
    """

    def __init__(self, linear: nn.Linear, tp: _TP):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.tp = tp
        self.weight = _shard_param(linear.weight, 1, tp)
        self.bias = linear.bias

    def forward(self, x: Tensor) -> Tensor:
        bias = None if self.bias is None else _ShareBias.apply(self.bias, self.tp.size)
        return F.linear(x, self.weight, bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}/{self.tp.size}, out_features={self.out_features}, bias={self.bias is not None}"


def _qkv_order(num_heads: int, num_kv_heads: int, head_dim: int, tp: int) -> tuple[int, ...] | None:
    """:attr:`TPShard.order` of the fused QKV rows (:class:`QKVParallelLinear`); ``None`` when ``tp`` divides
    ``num_kv_heads`` (each rank's groups are one contiguous block of rows)."""
    if num_kv_heads % tp == 0:
        return None
    r = tp // num_kv_heads  # ranks sharing a key/value head
    g, D = num_heads // num_kv_heads, head_dim
    q_rows, kv_rows = g // r * D, 2 * D // r  # per rank: its query heads, its part of the shared [k | v]
    rows: list[int] = []
    for t in range(tp):
        j, i = divmod(t, r)  # key/value head, index among its sharers
        group = j * (g + 2) * D  # first row of group j: [q of its g query heads | k_j | v_j]
        rows += range(group + i * q_rows, group + (i + 1) * q_rows)
        rows += range(group + g * D + i * kv_rows, group + g * D + (i + 1) * kv_rows)
    return tuple(rows)


class QKVParallelLinear(nn.Module):
    """GenSLM's fused ``query_key_value`` (rows grouped per key/value head ``j``: ``[q of its g query heads | k_j |
    v_j]``, :class:`~ds4sci.models.genslm.model.Attention`) on the heads of one TP rank: ``[B, T, hidden] ->
    [B, T, Hkv_loc * (g_loc + 2) * D]`` in the same per-group layout, for ``H_loc = H/tp`` query heads.

    - ``tp`` divides ``num_kv_heads``: TP rank ``t`` holds the ``Hkv/tp`` groups ``[t*Hkv/tp, (t+1)*Hkv/tp)``, one
      contiguous block of rows (Megatron-LM's split of query groups, which requires this divisibility); with one
      key/value head per query head that is GPT-NeoX's per-head split.
    - ``num_kv_heads`` divides ``tp``: the ``r = tp/Hkv`` ranks ``j*r .. j*r + r-1`` share key/value head ``j`` and
      split its ``g`` query heads, ``g/r`` each (the key/value head replication of vLLM's ``QKVParallelLinear``).
      DISCREPANCY: the shared head's ``2D`` key/value rows are not stored replicated: each sharer stores ``2D/r``
      of them (``weight [(g/r) D + 2D/r, hidden]``, single-device rows in :attr:`TPShard.order`), and forward
      all-gathers them over TP, whose backward reduce-scatter sums the sharers' gradients. Every element lives on
      one rank, so DeepSpeed's gradient norm (``tensor_model_parallel``) and ZeRO count it once, and no extra
      process group is needed.
    """

    def __init__(self, linear: nn.Linear, num_heads: int, num_kv_heads: int, head_dim: int, tp: _TP,
                 source: RegionGather, slot: int):
        super().__init__()
        self.tp, self.head_dim = tp, head_dim
        self.source, self.slot = source, slot
        self.kv_ranks = max(tp.size // num_kv_heads, 1)  # r: ranks sharing one key/value head
        if 2 * head_dim % self.kv_ranks:
            raise ValueError(f"head_dim={head_dim}: tp={tp.size} ranks split {num_kv_heads} key/value head(s), "
                             f"{self.kv_ranks} per head, which must divide its 2 * head_dim key/value rows")
        self.kv_rows = 2 * head_dim // self.kv_ranks if self.kv_ranks > 1 else 0  # rows of the shared head held here
        order = _qkv_order(num_heads, num_kv_heads, head_dim, tp.size)
        self.weight = _shard_param(linear.weight, 0, tp, order=order)
        self.bias = _shard_param(linear.bias, 0, tp, order=order)
        # this rank's output: its query heads and its (whole) key/value heads
        self.in_features = linear.in_features
        self.out_features = (num_heads // tp.size + 2 * max(num_kv_heads // tp.size, 1)) * head_dim

    def forward(self, x: Tensor) -> Tensor:
        bias = None if self.bias is None else self._with_kv_head(self.bias)
        region = self.source.region(x, self.slot)  # x: slot `slot` of the block's gathered region
        weight = self._with_kv_head(self.weight)
        return _ColumnParallelMatmul.apply(x, weight, bias, region, self.slot)  # [B, T, Hkv_loc * (g_loc + 2) * D]

    def _with_kv_head(self, p: Tensor) -> Tensor:
        """This rank's rows in the single-device group layout: its query rows, then the whole shared head's
        ``[k_j | v_j]`` (gathered from its sharers); the stored rows themselves when no head is shared."""
        if self.kv_ranks == 1:
            return p
        q, kv = p.split((p.shape[0] - self.kv_rows, self.kv_rows))  # [(g/r) D, ...], [2D/r, ...]
        # every rank's 2D/r rows -> [tp * 2D/r, ...] = [k_0 | v_0 | k_1 | v_1 ...] (ranks j*r.. hold head j's rows)
        heads = _SequenceRegion.apply(kv, self.tp.group, 0, self.tp.counter, _all_gather, _reduce_scatter)
        j, D = self.tp.rank // self.kv_ranks, self.head_dim
        return torch.cat([q, heads.narrow(0, j * 2 * D, 2 * D)])  # [(g/r) D + 2D, ...]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (this rank's), "
                f"kv_ranks={self.kv_ranks}, bias={self.bias is not None}, slot={self.slot}")


def _split_attention(attention: Attention, tp: _TP, source: RegionGather, slot: int) -> None:
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


def _split_mlp(mlp: MLP, tp: _TP, source: RegionGather, slot: int) -> None:
    """GenSLM MLP on ``intermediate/tp`` columns, in place: ``dense_h_to_4h`` (and SwiGLU's ``dense_h_to_4h_gate``)
    column-parallel (:class:`ColumnParallelLinear`, both reading slot ``slot`` of ``source``'s region),
    ``dense_4h_to_h`` row-parallel; its own forward returns this rank's partial sum ``[B, T, hidden]`` (the
    activation, and SwiGLU's product, act on matching columns)."""
    mlp.dense_h_to_4h = ColumnParallelLinear(mlp.dense_h_to_4h, tp, source, slot)  # [I/tp, hidden]
    if mlp.dense_h_to_4h_gate is not None:
        mlp.dense_h_to_4h_gate = ColumnParallelLinear(mlp.dense_h_to_4h_gate, tp, source, slot)
    mlp.dense_4h_to_h = RowParallelLinear(mlp.dense_4h_to_h, tp)  # [hidden, I/tp]


class TensorParallelBlock(nn.Module):
    """GenSLM block on a sequence region ``x [B, T/tp, hidden]``.

    Parallel residual ``x + attn(ln1(x)) + mlp(ln2(x))`` (GPT-NeoX): norms on the region -> one all-gather of both
    normalised tensors -> column/row-parallel attention and MLP on the full SP shard -> one reduce-scatter of their
    summed partials (row-parallel biases included) -> the residual on the region. Sequential residual (Llama):
    ``y = x + attn(ln1(x))``, then ``y + mlp(ln2(y))``, each branch with its own all-gather and reduce-scatter.
    Each all-gather is a :class:`RegionGather` (attention's slot 0 and the MLP's slot 1 of one, or one per branch),
    repeated once in backward for the weight gradients.
    """

    def __init__(self, block: Block, tp: _TP):
        super().__init__()
        self.tp = tp
        self.input_layernorm = SequenceParallelNorm(block.input_layernorm, tp)
        self.post_attention_layernorm = SequenceParallelNorm(block.post_attention_layernorm, tp)
        self.parallel_residual = block.parallel_residual
        if self.parallel_residual:  # both normalised regions stacked into one gather: attention slot 0, MLP slot 1
            self.gather_attention = self.gather_mlp = RegionGather(tp)
        else:
            self.gather_attention, self.gather_mlp = RegionGather(tp), RegionGather(tp)
        _split_attention(block.attention, tp, self.gather_attention, 0)
        _split_mlp(block.mlp, tp, self.gather_mlp, 1 if self.parallel_residual else 0)
        self.attention, self.mlp = block.attention, block.mlp
        self.dropout = block.dropout

    def forward(self, x: Tensor, position_ids: Tensor, doc_ids: Tensor | None) -> Tensor:
        out = self._residual(x, position_ids, doc_ids)
        self.gather_attention.release()
        self.gather_mlp.release()
        return out

    def _residual(self, x: Tensor, position_ids: Tensor, doc_ids: Tensor | None) -> Tensor:
        g, c = self.tp.group, self.tp.counter
        if not self.parallel_residual:
            attn_in = self.gather_attention(self.input_layernorm(x).unsqueeze(0))[0]  # [1, B, T/tp, h] -> [B, T, h]
            attn = self.attention(attn_in, position_ids, doc_ids)
            x = x + self.dropout(reduce_scatter_sequence_region(attn, g, 1, c))  # [B, T/tp, hidden]
            mlp = self.mlp(self.gather_mlp(self.post_attention_layernorm(x).unsqueeze(0))[0])
            return x + self.dropout(reduce_scatter_sequence_region(mlp, g, 1, c))
        normed = torch.stack([self.input_layernorm(x), self.post_attention_layernorm(x)])  # [2, B, T/tp, hidden]
        attn_in, mlp_in = self.gather_attention(normed).unbind(0)  # 2 x [B, T, hidden]
        attn = self.attention(attn_in, position_ids, doc_ids)  # [B, T, hidden], partial over TP (bias included)
        mlp = self.mlp(mlp_in)
        if self.dropout.training and self.dropout.p > 0:  # dropout acts on each summed branch: reduce both
            attn, mlp = reduce_scatter_sequence_region(torch.stack([attn, mlp]), g, 2, c).unbind(0)  # [B, T/tp, h]
            return x + self.dropout(attn) + self.dropout(mlp)
        return x + reduce_scatter_sequence_region(attn + mlp, g, 1, c)  # [B, T/tp, hidden]


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
    tp = _TP(groups.tp, groups.tp_rank, dims.tp, counter)
    model.embed_in = VocabParallelEmbedding(model.embed_in, tp)
    model.emb_dropout = SequenceRegionSplit(model.emb_dropout, tp)
    for i, block in enumerate(model.layers):
        model.layers[i] = TensorParallelBlock(block, tp)
    head_input = RegionGather(tp)  # the final norm's region, gathered for the output projection
    model.final_layer_norm = SequenceParallelNorm(model.final_layer_norm, tp, gather=head_input)
    model.embed_out = VocabParallelOutput(model.embed_out, tp, cfg.vocab_size, head_input)
    if cfg.tie_word_embeddings:  # the same rows of the same padded vocabulary: one parameter, as in GenSLM
        model.embed_out.weight = model.embed_in.weight


# ---------------------------------------------------------------------------------------------------------- loss
class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy of vocabulary-sharded logits ``[N, V/tp]`` (fp32), without gathering them."""

    @staticmethod
    def forward(ctx, logits, targets, group, counter):
        rows = logits.shape[-1]
        start = dist.get_rank(group) * rows
        x = logits.float()
        m = _all_reduce(x.max(-1).values, group, counter, op=dist.ReduceOp.MAX)  # [N], finite: real columns exist
        exp = torch.exp(x - m.unsqueeze(-1))  # [N, V/tp]
        valid = targets != IGNORE_INDEX
        local = targets - start
        mine = valid & (local >= 0) & (local < rows)  # [N]: this rank holds the target column
        local = torch.where(mine, local, torch.zeros_like(local))
        target_logit = torch.where(mine, x.gather(-1, local.unsqueeze(-1)).squeeze(-1) - m, torch.zeros_like(m))
        sums = _all_reduce(torch.stack([exp.sum(-1), target_logit]), group, counter)  # [2, N]
        loss = torch.where(valid, torch.log(sums[0]) - sums[1], torch.zeros_like(m))  # [N]
        exp /= sums[0].unsqueeze(-1)  # softmax over the full vocabulary, this rank's columns
        ctx.save_for_backward(exp, local, mine, valid)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine, valid = ctx.saved_tensors
        grad_logits = softmax  # reused in place, as Megatron-LM does: one backward per forward
        rows = mine.nonzero().squeeze(1)
        grad_logits[rows, local[rows]] -= 1.0  # softmax - one_hot(target)
        grad_logits *= torch.where(valid, grad.float(), torch.zeros_like(grad, dtype=torch.float32)).unsqueeze(-1)
        return grad_logits.to(ctx.dtype), None, None, None


def vocab_parallel_token_loss(logits: Tensor, targets: Tensor, reduction: str = "mean", *,
                              group: dist.ProcessGroup | None, counter: CommCounter | None = None) -> Tensor:
    """:func:`~ds4sci.models.genslm.token_loss` for vocabulary-sharded logits ``[B, T, V_pad/tp]`` (TP rank ``t``
    holds columns ``[t*V_pad/tp, (t+1)*V_pad/tp)``) against aligned ``targets [B, T]`` (-100 ignored): fp32, sum or
    mean over the non-ignored targets, or each token's ``[B, T]`` (``"none"``), the same value on every TP rank.
    Collective over ``group``."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree on [B, T]")
    world = group_size(group)
    if world == 1:
        return token_loss(logits, targets, reduction)
    vocab = logits.shape[-1] * world
    valid = targets != IGNORE_INDEX
    real = targets[valid]
    if bool(((real < 0) | (real >= vocab)).any()):
        raise ValueError(f"targets must be in [0, {vocab}) or {IGNORE_INDEX}, got range "
                         f"[{int(real.min())}, {int(real.max())}]")
    per_token = _VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), group,
                                                 counter)
    if reduction == "none":
        return per_token.view(targets.shape)
    total = per_token.sum()
    return total if reduction == "sum" else total / valid.sum()


def token_loss_for(groups: SequenceParallelGroups, counter: CommCounter | None = None) -> Callable[..., Tensor]:
    """The loss the trainer calls on the model's logits: ``token_loss`` for ``tp = 1``, else
    :func:`vocab_parallel_token_loss` bound to the TP group; signature ``(logits, targets, reduction="mean")``."""
    if groups.dims.tp == 1:
        return token_loss
    return functools.partial(vocab_parallel_token_loss, group=groups.tp, counter=counter)


@torch.no_grad()
def gather_vocab(logits: Tensor, group: dist.ProcessGroup | None, vocab_size: int) -> Tensor:
    """Full logits ``[B, T, vocab_size]`` from the vocabulary shards (not differentiable; generation, evaluation,
    tests). Collective over ``group``."""
    if group_size(group) > 1:
        logits = _all_gather(logits, group, -1, None)
    return logits[..., :vocab_size]


# ------------------------------------------------------------------------------------------------ state dicts
def tensor_parallel_plan(model: nn.Module) -> dict[str, TPShard]:
    """``{parameter name: TPShard}`` of the parameters :func:`apply_tensor_parallel` split (read from the
    ``ds4sci_tp_*`` attributes; the names are those of ``model.state_dict()``, both names of a tied embedding
    included)."""
    return {name: TPShard(p.ds4sci_tp_dim, p.ds4sci_tp_size, p.ds4sci_tp_padded, p.ds4sci_tp_order)
            for name, p in model.named_parameters(remove_duplicate=False) if hasattr(p, "ds4sci_tp_dim")}


def gather_tensor_parallel(state: nn.Module | Mapping[str, Tensor], groups: SequenceParallelGroups,
                           plan: Mapping[str, TPShard] | None = None) -> dict[str, Tensor]:
    """The single-device state dict from this TP rank's (collective over ``groups.tp``; every rank gets it).

    ``state``: a tensor-parallel model (its ``state_dict()`` and plan are used), or a state dict with the same keys
    (e.g. gradients, Adam moments or ZeRO-3 gathered weights) together with ``plan`` (:func:`tensor_parallel_plan`
    of the model). Split entries are all-gathered along their dim, cut back to the unpadded size and put back in
    the single-device order (:meth:`TPShard.restore`); the others are returned as they are.
    """
    if isinstance(state, nn.Module):
        plan = tensor_parallel_plan(state) if plan is None else plan
        state = state.state_dict()
    if plan is None:
        raise ValueError("gather_tensor_parallel: pass the plan (tensor_parallel_plan(model)) with a state dict")
    group = groups.tp
    full = {}
    for name, value in state.items():
        shard = plan.get(name)
        if shard is None or group_size(group) == 1:
            full[name] = value
            continue
        full[name] = shard.restore(_all_gather(value.detach(), group, shard.dim, None))
    return full


def shard_tensor_parallel(full: Mapping[str, Tensor], plan: Mapping[str, TPShard], rank: int, world: int) -> dict[str, Tensor]:
    """Inverse of :func:`gather_tensor_parallel`: TP rank ``rank``'s state dict from the single-device one (local,
    no communication)."""
    out = {}
    for name, value in full.items():
        shard = plan.get(name)
        if shard is None:
            out[name] = value
            continue
        try:
            value = shard.arrange(value)
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
        out[name] = _piece(value, shard.dim, rank, world).clone()
    return out


def load_full_state_dict(model: nn.Module, full: Mapping[str, Tensor], groups: SequenceParallelGroups,
                         strict: bool = True):
    """Load a single-device state dict into a tensor-parallel model (each rank keeps its pieces; local)."""
    local = shard_tensor_parallel(full, tensor_parallel_plan(model), group_rank(groups.tp), groups.dims.tp)
    return model.load_state_dict(local, strict=strict)
