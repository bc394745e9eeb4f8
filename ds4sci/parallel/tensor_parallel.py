"""Megatron-LM tensor-parallel layers with sequence-parallel regions; a vocabulary-parallel embedding, output and loss.

- Megatron-LM tensor parallelism (Shoeybi et al. 2019, arXiv:1909.08053): column-parallel projections
  (:class:`ColumnParallelLinear`; the fused QKV, :class:`QKVParallelLinear`, TP rank ``t`` holding query heads
  ``[t*H/tp, (t+1)*H/tp)`` with their key/value heads, whole or shared) and row-parallel ones
  (:class:`RowParallelLinear`: each rank produces a partial sum of the full output).
- Megatron sequence parallelism (Korthikanti et al. 2022, arXiv:2205.05198, "Reducing Activation Recomputation in
  Large Transformer Models"): outside the matmuls the residual stream is sharded on the sequence dim over the TP group,
  so norms (:class:`SequenceParallelNorm`), dropout and the residual hold ``1/tp`` of the activations. An all-gather
  on the sequence dim enters the column-parallel matmuls (:class:`RegionGather`; backward: a reduce-scatter), a
  reduce-scatter leaves the row-parallel ones (backward: an all-gather); no all-reduce. The column-parallel matmuls
  save only this rank's region ``[k, B, T/tp, hidden]`` for backward and all-gather it again there for their weight
  gradients (Megatron-LM's choice): one more all-gather per gathered input per layer, ``tp`` times less saved input.
- Vocabulary parallelism (Megatron-LM): the embedding and the output projection are split on the vocabulary, padded
  to a multiple of ``tp``; padded logits are ``-inf``, so they never win and carry no probability.
  :func:`vocab_parallel_token_loss` is the cross entropy over vocabulary shards (fp32; max, sum of exponentials and
  target logit reduced over TP; the full logits are never gathered).

Split parameters keep the single-device names and carry ``tensor_model_parallel = True`` (DeepSpeed's gradient norm
and ZeRO count such a parameter on every TP rank, the others on TP rank 0 only) and their :class:`TPShard`
(:func:`tensor_parallel_plan`; :mod:`ds4sci.train.consolidate` rebuilds the single-device state dict from it).
Replicated norm parameters used on sequence shards get their gradient summed over TP
(:func:`~ds4sci.distributed.comm.sync_grad`); a row-parallel bias is added as ``bias/tp`` to every partial sum. Each
parameter is used inside its own module's forward, as ZeRO-3's parameter gathering expects. DeepSpeed's AutoTP is not
used: it has no sequence-parallel regions and replaces the ``mpu`` (and so the sequence-parallel groups) with its own.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch import nn

from ds4sci.distributed.comm import CommCounter
from ds4sci.distributed.comm import SequenceRegion
from ds4sci.distributed.comm import all_gather
from ds4sci.distributed.comm import all_reduce
from ds4sci.distributed.comm import group_size
from ds4sci.distributed.comm import reduce_from_tensor_region
from ds4sci.distributed.comm import reduce_scatter
from ds4sci.distributed.comm import split_sequence_region
from ds4sci.distributed.comm import sync_grad
from ds4sci.kernels.tiled_loss import tiled_loss
from ds4sci.models.genslm import IGNORE_INDEX
from ds4sci.models.genslm import token_loss
from ds4sci.models.genslm.model import RMSNorm
from ds4sci.models.genslm.model import rms_norm

__all__ = [
    "TPShard",
    "TPGroup",
    "tensor_parallel_plan",
    "RegionGather",
    "VocabParallelEmbedding",
    "VocabParallelOutput",
    "SequenceRegionSplit",
    "SequenceParallelNorm",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "QKVParallelLinear",
    "vocab_parallel_token_loss",
    "gather_vocab",
]


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
        """The single-device tensor in the pieces' order, padded: ``[.., size, ..] -> [.., padded, ..]`` along
        ``dim``."""
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

    def piece(self, full: Tensor, rank: int, world: int) -> Tensor:
        """TP rank ``rank``'s piece of the single-device tensor ``full`` (of ``world`` ranks): :meth:`arrange`, then
        its contiguous ``1/world`` along :attr:`dim`, a copy that owns its storage."""
        return self.arrange(full).chunk(world, dim=self.dim)[rank].clone(memory_format=torch.contiguous_format)


@dataclass(frozen=True)
class TPGroup:
    """The tensor-parallel group as the layers use it: the process group, this rank in it, its size, and the
    :class:`~ds4sci.distributed.comm.CommCounter` recording the layers' collectives (or ``None``)."""

    group: dist.ProcessGroup
    rank: int
    size: int
    counter: CommCounter | None


def tensor_parallel_plan(model: nn.Module) -> dict[str, TPShard]:
    """``{parameter name: TPShard}`` of the parameters split over TP (read from the ``ds4sci_tp_*`` attributes the
    layers set; the names are those of ``model.state_dict()``, both names of a tied embedding included)."""
    return {name: TPShard(p.ds4sci_tp_dim, p.ds4sci_tp_size, p.ds4sci_tp_padded, p.ds4sci_tp_order)
            for name, p in model.named_parameters(remove_duplicate=False) if hasattr(p, "ds4sci_tp_dim")}


def _shard_param(p: Tensor | None, dim: int, tp: TPGroup, padded: int | None = None,
                 order: tuple[int, ...] | None = None) -> nn.Parameter | None:
    """This TP rank's piece of a full parameter (:meth:`TPShard.arrange`: rows reordered by ``order``, zero padded to
    ``padded`` along ``dim``), marked for DeepSpeed and for :func:`tensor_parallel_plan`; ``None`` stays ``None``
    (a bias-free layer)."""
    if p is None:
        return None
    size = p.shape[dim]
    plan = TPShard(dim, size, size if padded is None else padded, order)
    shard = nn.Parameter(plan.piece(p.detach(), tp.rank, tp.size), requires_grad=p.requires_grad)
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


# ------------------------------------------------------------------------------------------------ regions
class _Region:
    """One forward's input of the column-parallel matmuls of a block (or of the output projection): this TP rank's
    sequence regions ``local [k, B, T/tp, hidden]`` (``k`` normalised tensors gathered in one collective) and, in
    backward, from the first weight gradient that needs it until the gather's own backward, their re-gathered copy
    ``full [k, B, T, hidden]``."""

    def __init__(self, local: Tensor, tp: TPGroup):
        self.local, self.tp = local, tp
        self.full: Tensor | None = None

    def gathered(self, local: Tensor) -> Tensor:
        """``[k, B, T, hidden]``: all-gathered once (counted) for all the matmuls reading the region."""
        if self.full is None:
            self.full = all_gather(local, self.tp.group, 2, self.tp.counter)
        return self.full


class _GatherRegion(torch.autograd.Function):
    """``[k, B, T/tp, hidden] -> [k, B, T, hidden]``: all-gather in forward, saving nothing (each reader saves the
    region itself); backward reduce-scatters the gradient summed over the readers (Korthikanti et al.'s ``g``) and
    drops the region and its re-gathered copy, which every reader's backward has used by then."""

    @staticmethod
    def forward(ctx, local, region):
        ctx.region = region
        return all_gather(local, region.tp.group, 2, region.tp.counter)

    @staticmethod
    def backward(ctx, grad):
        region, ctx.region = ctx.region, None
        region.local = region.full = None
        return reduce_scatter(grad, region.tp.group, 2, region.tp.counter), None


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

    def __init__(self, tp: TPGroup):
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


# ------------------------------------------------------------------------------------------------------- modules
class VocabParallelEmbedding(nn.Module):
    """Embedding split on the vocabulary (padded to a multiple of tp): rows ``[t*V_pad/tp, (t+1)*V_pad/tp)`` on TP
    rank ``t``; each rank looks up the ids it holds (zeros elsewhere) and the lookups are all-reduced, so the output
    ``[B, T, hidden]`` is the full, replicated embedding of the SP shard."""

    def __init__(self, embedding: nn.Embedding, tp: TPGroup):
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

    def __init__(self, linear: nn.Linear, tp: TPGroup, vocab_size: int, source: RegionGather):
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

    def __init__(self, dropout: nn.Module, tp: TPGroup):
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

    def __init__(self, norm: nn.LayerNorm | RMSNorm, tp: TPGroup, gather: RegionGather | None = None):
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
    not ``x``, for backward. With :attr:`reads_region` False (a tiled MLP, whose tiles are pieces of the region and
    which saves its input itself: :class:`~ds4sci.parallel.genslm_tp.TensorParallelBlock`) it is a plain linear layer
    on ``x``."""

    def __init__(self, linear: nn.Linear, tp: TPGroup, source: RegionGather, slot: int):
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

    def __init__(self, linear: nn.Linear, tp: TPGroup):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.tp = tp
        self.weight = _shard_param(linear.weight, 1, tp)
        self.bias = linear.bias

    def forward(self, x: Tensor) -> Tensor:
        bias = None if self.bias is None else _ShareBias.apply(self.bias, self.tp.size)
        return F.linear(x, self.weight, bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}/{self.tp.size}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


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

    def __init__(self, linear: nn.Linear, num_heads: int, num_kv_heads: int, head_dim: int, tp: TPGroup,
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
        heads = SequenceRegion.apply(kv, self.tp.group, 0, self.tp.counter, all_gather, reduce_scatter)
        j, D = self.tp.rank // self.kv_ranks, self.head_dim
        return torch.cat([q, heads.narrow(0, j * 2 * D, 2 * D)])  # [(g/r) D + 2D, ...]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (this rank's), "
                f"kv_ranks={self.kv_ranks}, bias={self.bias is not None}, slot={self.slot}")


# ---------------------------------------------------------------------------------------------------------- loss
class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy of vocabulary-sharded logits ``[N, V/tp]`` (fp32), without gathering them."""

    @staticmethod
    def forward(ctx, logits, targets, group, counter):
        rows = logits.shape[-1]
        start = dist.get_rank(group) * rows
        x = logits.float()
        m = all_reduce(x.max(-1).values, group, counter, op=dist.ReduceOp.MAX)  # [N], finite: real columns exist
        exp = torch.exp(x - m.unsqueeze(-1))  # [N, V/tp]
        valid = targets != IGNORE_INDEX
        local = targets - start
        mine = valid & (local >= 0) & (local < rows)  # [N]: this rank holds the target column
        local = torch.where(mine, local, torch.zeros_like(local))
        target_logit = torch.where(mine, x.gather(-1, local.unsqueeze(-1)).squeeze(-1) - m, torch.zeros_like(m))
        sums = all_reduce(torch.stack([exp.sum(-1), target_logit]), group, counter)  # [2, N]
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



@torch.no_grad()
def gather_vocab(logits: Tensor, group: dist.ProcessGroup | None, vocab_size: int) -> Tensor:
    """Full logits ``[B, T, vocab_size]`` from the vocabulary shards (not differentiable; generation, evaluation,
    tests). Collective over ``group``."""
    if group_size(group) > 1:
        logits = all_gather(logits, group, -1, None)
    return logits[..., :vocab_size]
