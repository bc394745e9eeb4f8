"""GenSLM: a GPT-NeoX- or Llama-shaped causal language model over genome tokens (Zvyagin et al. 2022, GenSLMs;
Black et al. 2022, GPT-NeoX-20B; Touvron et al. 2023, Llama), written for one device. The shape is the config's
(:class:`~ds4sci.models.genslm.config.GenSLMConfig`): grouped-query attention, SwiGLU, RMSNorm, biases, residual
form and tied embeddings are options of this one model.

Parameter names mirror Hugging Face's ``GPTNeoXForCausalLM`` (without the ``gpt_neox.`` prefix), so GenSLM's
released checkpoints convert by renaming (:mod:`ds4sci.models.genslm.neox`); a ``LlamaForCausalLM`` converts by
renaming and fusing its q/k/v projections (:mod:`ds4sci.models.genslm.llama`).

Sequence parallelism is applied from outside (``ds4sci.sequence.parallelize``): every block's ``attention.core``
is an :class:`AttentionCore` implementing the local attention protocol (:mod:`ds4sci.kernels.local_attention`) and
is swapped for ``ds4sci.sequence.DistributedAttention(core, ...)``. Positions are an input, so the trainer shards
tokens, labels and positions together.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor
from torch import nn

from ds4sci.kernels.backends import LocalBackend
from ds4sci.kernels.backends import parse_backend
from ds4sci.kernels.local_attention import memory_efficient_attention
from ds4sci.kernels.recompute import recompute_saved
from ds4sci.kernels.rotary import apply_rotary_qkv_
from ds4sci.kernels.tiled_loss import tiled_loss
from ds4sci.kernels.tiled_mlp import tiled_mlp
from ds4sci.models.genslm.config import GenSLMConfig
from ds4sci.models.genslm.position import LearnedPositionEmbedding
from ds4sci.models.genslm.position import RotaryScaling
from ds4sci.models.genslm.position import alibi_slopes
from ds4sci.models.genslm.position import rotary_cos_sin

IGNORE_INDEX = -100
"""Target id that the loss skips (padding, document starts, a shard's missing next token); PyTorch's default."""


class AttentionCore(nn.Module):
    """GenSLM's local attention: causal masking and, for ALiBi models, the slopes of all ``num_heads`` global heads
    (indexed by the protocol's ``head_offset``), bound to
    :func:`~ds4sci.kernels.local_attention.memory_efficient_attention`, the one dispatch.

    ``backend`` (a :class:`~ds4sci.kernels.backends.LocalBackend` or its value): ``"auto"`` (flash-attn, the Triton
    kernel or the chunked PyTorch path, and off CUDA SDPA for a cached decode step's one query row and, in eval mode
    without gradients, PyTorch's fused causal kernel, see :func:`~ds4sci.kernels.local_attention.select_backend`; no
    ``S x S`` tensor beyond one chunked block), ``"chunked"``, ``"triton"``,
    ``"flash"``, or ``"sdpa"``:
    :func:`~ds4sci.kernels.local_reference.sdpa_attention`, the readable O(S^2) oracle.

    ``forward(q, k, v, *, q_offset=0, k_offset=0, head_offset=0, q_doc=None, k_doc=None, return_lse=False)`` is the
    local attention protocol (see :mod:`ds4sci.kernels.local_attention`): q ``[B, Sq, H, D]``, k and v
    ``[B, Sk, Hkv, D]`` -> ``[B, Sq, H, D]`` (and lse ``[B, H, Sq]``), so sequence parallelism swaps it for
    ``ds4sci.sequence.DistributedAttention(core, ...)`` without touching the model.
    """

    def __init__(self, num_heads: int, alibi: bool = False, backend: str | LocalBackend = "auto"):
        super().__init__()
        self.backend = parse_backend(backend, LocalBackend)
        self.num_heads = num_heads
        self.alibi = alibi
        self.register_buffer("slopes", alibi_slopes(num_heads) if alibi else torch.empty(0), persistent=False)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, **protocol) -> Tensor | tuple[Tensor, Tensor]:
        slopes = self.slopes if self.alibi else None
        return memory_efficient_attention(q, k, v, causal=True, alibi_slopes=slopes, backend=self.backend,
                                          inference=not self.training, **protocol)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, alibi={self.alibi}, backend={self.backend.value!r}"


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """:class:`RMSNorm`'s computation, ``[..., hidden] -> [..., hidden]`` in ``x``'s dtype, for the modules that hold
    the weight elsewhere (tensor parallelism's sequence-region norm)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # [..., hidden], fp32
    return (weight * normed.to(x.dtype)).to(x.dtype)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim (Zhang & Sennrich 2019): ``[..., hidden] -> [..., hidden]``,
    ``weight * x / sqrt(mean(x^2) + eps)`` in the rounding order of transformers' ``LlamaRMSNorm``: normalised in
    fp32, rounded to ``x``'s dtype, then times the weight (rounded to ``x``'s dtype again). ``torch.nn.RMSNorm`` applies
    the weight before rounding, which in bf16 gives a different value in about a quarter of the outputs than the
    Llama checkpoints ds4sci reads and writes compute."""

    def __init__(self, hidden_size: int, eps: float, device: torch.device | str | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def norm(config: GenSLMConfig, device: torch.device | str | None = None) -> nn.Module:
    """The config's norm over ``hidden_size``: ``nn.LayerNorm`` (weight, bias) or :class:`RMSNorm` (weight), both with
    ``layer_norm_eps``."""
    if config.norm == "layernorm":
        return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, device=device)
    return RMSNorm(config.hidden_size, config.layer_norm_eps, device)


class LayerKV:
    """One layer's key/value cache: ``keys`` and ``values`` ``[B, Hkv, S_max, D]``, preallocated, of which the first
    ``length`` positions are filled. Only the ``num_kv_heads`` key/value heads are kept (never repeated per query
    head). Head-major, so each head's cached keys are one contiguous ``[length, D]`` block: a decode step reads them
    in one pass (Hugging Face's cache has the same layout)."""

    def __init__(self, keys: Tensor, values: Tensor):
        self.keys, self.values = keys, values
        self.length = 0

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``k, v [B, T, Hkv, D]`` at positions ``length .. length + T - 1`` and return the filled keys and
        values in the local attention protocol's layout, ``[B, length + T, Hkv, D]`` (views of the cache)."""
        B, T, Hkv, D = k.shape  # batch, new tokens, key/value heads, head dim
        S_max = self.keys.shape[2]
        if (B, Hkv, D) != (*self.keys.shape[:2], self.keys.shape[3]) or self.length + T > S_max:
            raise ValueError(f"cannot append keys {tuple(k.shape)} at position {self.length} to a cache of "
                             f"{tuple(self.keys.shape)} [B, Hkv, S_max, D]")
        end = self.length + T
        self.keys[:, :, self.length:end] = k.transpose(1, 2)  # [B, Hkv, T, D]
        self.values[:, :, self.length:end] = v.transpose(1, 2)
        self.length = end
        return self.keys[:, :, :end].transpose(1, 2), self.values[:, :, :end].transpose(1, 2)  # [B, end, Hkv, D]


class KVCache:
    """Key/value cache for decoding with :class:`GenSLM` (the standard autoregressive KV cache of Transformer
    decoders, e.g. Pope et al. 2022, "Efficiently Scaling Transformer Inference"): one :class:`LayerKV` per layer,
    ``[B, Hkv, S_max, D]`` with ``S_max`` the most tokens a sequence will hold (prompt + new tokens), so
    ``2 * num_layers * B * S_max * num_kv_heads * head_dim`` elements in all, allocated once.

    Pass it to ``GenSLM.forward(input_ids [B, T], position_ids [B, T], cache=cache)``: the first call (the prompt,
    prefill) and each later one (decoding, usually ``T = 1``) go through the same forward, the new tokens' queries
    attending causally to everything cached before them and to themselves (``q_offset`` = :attr:`length`); causal
    masks and ALiBi read that index, learned and rotary positions read ``position_ids``, which for one uninterrupted
    sequence are ``length .. length + T - 1``. Every sequence of the batch holds the same number of tokens.
    """

    def __init__(self, config: GenSLMConfig, batch_size: int, max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None):
        shape = (batch_size, config.num_kv_heads, max_len, config.head_dim)  # [B, Hkv, S_max, D]
        self.layers = [LayerKV(torch.empty(shape, dtype=dtype, device=device),
                               torch.empty(shape, dtype=dtype, device=device)) for _ in range(config.num_layers)]

    @property
    def length(self) -> int:
        """Tokens cached per sequence so far."""
        return self.layers[0].length


class Attention(nn.Module):
    """Self-attention with fused QKV and rotary on a fraction of head dims; ``num_kv_heads`` key/value heads, each
    shared by a group of ``g = num_heads / num_kv_heads`` query heads (grouped-query attention, Ainslie et al. 2023).

    ``query_key_value`` rows, per key/value group ``j``: ``[q of query heads j*g .. (j+1)*g-1 | k_j | v_j]``, each
    head ``head_dim`` rows. With ``g = 1`` that is GPT-NeoX's per-head ``[q | k | v]`` layout, so a multi-head model's
    weights are GPT-NeoX's unchanged. K and V go to the core with ``num_kv_heads`` heads, never repeated."""

    def __init__(self, config: GenSLMConfig, device: torch.device | str | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.rotary_dim = config.rotary_dim
        self.rotary_base = config.rotary_base
        self.rotary_scaling = (
            RotaryScaling(config.rotary_scaling_factor, config.rotary_low_freq_factor, config.rotary_high_freq_factor,
                          config.rotary_original_max_positions)
            if config.rotary_scaling_factor != 1.0 else None
        )
        qkv_size = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.query_key_value = nn.Linear(config.hidden_size, qkv_size, bias=config.bias, device=device)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=config.bias, device=device)
        self.core = AttentionCore(config.num_heads, alibi=config.position_embedding == "alibi",
                                  backend=config.attention_backend)

    def forward(self, x: Tensor, position_ids: Tensor, doc_ids: Tensor | None, kv: LayerKV | None = None) -> Tensor:
        """``x [B, T, hidden]`` -> ``[B, T, hidden]``. With ``kv`` (cached decoding, :class:`KVCache`), the T new
        tokens' keys and values are appended to the layer's cache and their queries attend to every cached key, at
        global index ``q_offset = kv.length``."""
        B, T, _ = x.shape  # batch, local tokens, hidden
        Hkv, D = self.num_kv_heads, self.head_dim
        g = self.num_heads // Hkv  # query heads per key/value head
        # [B*T, Hkv * (g+2) * D]: on the folded tokens, so that the layer's output is its own tensor, not a view (an
        # in-place op on a view would make autograd copy the whole gradient buffer in backward)
        qkv = self.query_key_value(x.flatten(0, 1))
        if self.rotary_dim:  # in place: the core saves views of this one buffer, not rotated copies
            cos, sin = rotary_cos_sin(position_ids, self.rotary_dim, self.rotary_base, qkv.dtype,
                                      scaling=self.rotary_scaling)  # [B, T, 1, rotary_dim]
            qkv = apply_rotary_qkv_(qkv, cos.flatten(0, 1), sin.flatten(0, 1), g, D)
        q, k, v = qkv.view(B, T, Hkv, (g + 2) * D).split((g * D, D, D), dim=-1)  # [B, T, Hkv, g*D], [B, T, Hkv, D] x 2
        q = q.reshape(B, T, self.num_heads, D)  # [B, T, H, D]: query head j*g + i of group j (a copy if Hkv, g > 1)
        if kv is None:
            out = self.core(q, k, v, q_doc=doc_ids, k_doc=doc_ids)  # [B, T, H, D]
        else:
            q_offset = kv.length
            k, v = kv.append(k, v)  # [B, q_offset + T, Hkv, D]: the cached keys and values, these T included
            out = self.core(q, k, v, q_offset=q_offset)  # [B, T, H, D]
        return self.dense(out.reshape(B, T, -1))


class MLP(nn.Module):
    """GELU MLP ``dense_4h_to_h(gelu(dense_h_to_4h(x)))`` (GPT-NeoX) or, for ``mlp="swiglu"``,
    ``dense_4h_to_h(silu(dense_h_to_4h_gate(x)) * dense_h_to_4h(x))`` (Shazeer 2020; Llama's
    ``down(silu(gate(x)) * up(x))``): ``[B, T, hidden] -> [B, T, intermediate] -> [B, T, hidden]``.

    :attr:`tile` (tokens, 0 by default: untiled) is set from outside (``activation_checkpointing.tiled_mlp``,
    ``ds4sci.train.activation_checkpointing``): a positive tile computes the MLP over tiles of that many tokens and
    recomputes them in backward (:func:`~ds4sci.kernels.tiled_mlp.tiled_mlp`), so no ``[B, T, intermediate]`` activation
    is saved. An attribute, not a wrapper module, so parameter names do not change.
    """

    def __init__(self, config: GenSLMConfig, device: torch.device | str | None = None):
        super().__init__()
        h, f, bias = config.hidden_size, config.intermediate_size, config.bias
        self.dense_h_to_4h = nn.Linear(h, f, bias=bias, device=device)
        self.dense_h_to_4h_gate = nn.Linear(h, f, bias=bias, device=device) if config.mlp == "swiglu" else None
        self.dense_4h_to_h = nn.Linear(f, h, bias=bias, device=device)
        self.approximate = "tanh" if config.activation == "gelu_tanh" else "none"  # F.gelu's name for it
        self.tile = 0  # see the class docstring

    def forward(self, x: Tensor) -> Tensor:
        if self.tile:
            return tiled_mlp(self.untiled, x, list(self.parameters()), self.tile)
        return self.untiled(x)

    def untiled(self, x: Tensor) -> Tensor:
        """The MLP on all of ``x [B, T, hidden]`` at once."""
        up = self.dense_h_to_4h(x)  # [B, T, intermediate]
        if self.dense_h_to_4h_gate is not None:
            return self.dense_4h_to_h(F.silu(self.dense_h_to_4h_gate(x)) * up)
        return self.dense_4h_to_h(F.gelu(up, approximate=self.approximate))


class OutputHead(nn.Linear):
    """The output projection, a bias-free ``nn.Linear``: ``forward(x [B, T, hidden]) -> logits [B, T, V]``; with
    ``targets [B, T]`` (aligned, -100 ignored), the summed token loss of those logits instead (fp32 scalar), computed
    over tiles of :attr:`tile` tokens and recomputed in backward (:func:`~ds4sci.kernels.tiled_loss.tiled_loss`), so
    no ``[B, T, V]`` tensor is alive.

    :attr:`tile` (tokens, 0 by default: no loss here) is set from outside (``activation_checkpointing.tiled_loss``,
    ``ds4sci.train.activation_checkpointing``). A subclass, not a wrapper module, so parameter names do not change; the
    loss is computed inside this module's forward, where ZeRO-3 has gathered the weight.
    """

    def __init__(self, hidden_size: int, vocab_size: int, device: torch.device | str | None = None):
        super().__init__(hidden_size, vocab_size, bias=False, device=device)
        self.tile = 0  # see the class docstring

    def forward(self, x: Tensor, targets: Tensor | None = None) -> Tensor:
        if targets is None:
            return super().forward(x)
        if not self.tile:
            raise ValueError("OutputHead: a loss needs a tile (activation_checkpointing.tiled_loss); got tile=0")
        return tiled_loss(super().forward, functools.partial(token_loss, reduction="none"), x, targets, [self.weight],
                          self.tile)


class Block(nn.Module):
    """Pre-norm block: GPT-NeoX's parallel residual ``x + attn(ln1(x)) + mlp(ln2(x))``, or with
    ``parallel_residual=False`` Llama's sequential one, ``y = x + attn(ln1(x)); y + mlp(ln2(y))``.

    :attr:`recompute_norm` (False by default) is set from outside (full activation checkpointing,
    ``ds4sci.train.activation_checkpointing``): the first norm's output ``[B, T, hidden]``, which the fused q/k/v
    projection saves, is then rebuilt from the block input when backward needs it
    (:func:`~ds4sci.kernels.recompute.recompute_saved`) instead of kept, one hidden vector per token less while the
    attention's backward runs; the attention's other saved tensors are handed to backward once, so its backward frees
    its output early (one more). Backward then runs once through the block's graph, as in a reentrant checkpoint's
    recomputation. An attribute, not a wrapper module, so parameter names do not change.

    :meth:`forward` composes the residual from :meth:`attention_branch`, :meth:`mlp_branch` and, for the parallel
    residual, :meth:`parallel_residual_sum`: a parallelised block (tensor parallelism) overrides those, not the
    composition.
    """

    def __init__(self, config: GenSLMConfig, device: torch.device | str | None = None):
        super().__init__()
        self.input_layernorm = norm(config, device)
        self.post_attention_layernorm = norm(config, device)
        self.attention = Attention(config, device)
        self.mlp = MLP(config, device)
        self.dropout = nn.Dropout(config.dropout)
        self.parallel_residual = config.parallel_residual
        self.recompute_norm = False  # see the class docstring

    def forward(self, x: Tensor, position_ids: Tensor, doc_ids: Tensor | None, kv: LayerKV | None = None) -> Tensor:
        if self.parallel_residual:
            return self.parallel_residual_sum(x, position_ids, doc_ids, kv)
        x = x + self.attention_branch(x, position_ids, doc_ids, kv)
        return x + self.mlp_branch(x)

    def attention_branch(self, x: Tensor, position_ids: Tensor, doc_ids: Tensor | None,
                         kv: LayerKV | None = None) -> Tensor:
        """``dropout(attn(ln1(x)))`` ``[B, T, hidden]``, the residual's first branch."""
        normed = self.input_layernorm(x)  # [B, T, hidden]
        recompute = (recompute_saved(normed, functools.partial(self.input_layernorm, x)) if self.recompute_norm
                     else contextlib.nullcontext())
        with recompute:
            return self.dropout(self.attention(normed, position_ids, doc_ids, kv))

    def mlp_branch(self, x: Tensor) -> Tensor:
        """``dropout(mlp(ln2(x)))`` ``[B, T, hidden]``, the residual's second branch."""
        return self.dropout(self.mlp(self.post_attention_layernorm(x)))

    def parallel_residual_sum(self, x: Tensor, position_ids: Tensor, doc_ids: Tensor | None,
                              kv: LayerKV | None = None) -> Tensor:
        """GPT-NeoX's ``x + attn(ln1(x)) + mlp(ln2(x))``, both branches reading the block input."""
        return x + self.attention_branch(x, position_ids, doc_ids, kv) + self.mlp_branch(x)


class GenSLM(nn.Module):
    """GenSLM causal LM.

    ``forward(input_ids [B, T], position_ids [B, T], doc_ids=None [B, T], return_hidden=False)`` returns logits
    ``[B, T, V]`` (or the final normalised hidden states ``[B, T, hidden]`` with ``return_hidden``).
    ``stop_after=k`` (``0..num_layers``) returns the hidden states ``[B, T, hidden]`` output by block ``k`` instead,
    before the final norm (0: the token and position embeddings): the layer ``ds4sci embed --layer`` reads.
    ``position_ids`` are global positions (under sequence parallelism: those of the local shard), never built
    inside. ``doc_ids`` restrict attention to the same document (packed windows). ``position_embeds [B, T, hidden]``
    replaces the learned table's output after :meth:`pop_position_embedding`. ``targets [B, T]`` (aligned, -100
    ignored; with a tiled output head, :class:`OutputHead`): returns the summed token loss (fp32 scalar) instead of the
    logits, computed by the head. ``cache`` (a :class:`KVCache`, eval
    mode, no ``doc_ids``): cached decoding, the ``T`` tokens continuing the ``cache.length`` cached ones.

    ``device="meta"`` builds the parameters without storage; a trainer parallelizes the model and then draws only the
    pieces a rank keeps from :meth:`initial_value` (``ds4sci.sequence.materialize_``), equal to building it whole.

    Activation checkpointing hook (Hugging Face's ``gradient_checkpointing`` pattern): :attr:`checkpoint_fn`, None
    by default, is set from outside (``ds4sci.train.checkpointing``) to a function called as
    ``checkpoint_fn(block, x, position_ids, doc_ids)`` in place of ``block(x, position_ids, doc_ids)`` while training,
    e.g. ``deepspeed.checkpointing.checkpoint``, which recomputes the block in backward. A hook rather than a
    wrapper module so that parameter names (checkpoints, exports) do not change; the model imports no engine.
    """

    def __init__(self, config: GenSLMConfig, device: torch.device | str | None = None):
        super().__init__()
        self.config = config
        # One draw of the global RNG seeds every parameter (see initial_value); building consumes nothing else, so
        # a model built on the meta device and materialized piece by piece equals one built whole, and the RNG
        # stream after construction (dropout) is the same either way.
        self.init_seed = int(torch.randint(0, 2**62, (), device="cpu"))
        with torch.random.fork_rng(devices=[]):
            self.embed_in = nn.Embedding(config.vocab_size, config.hidden_size, device=device)
            self.embed_pos = (
                LearnedPositionEmbedding(config.max_position_embeddings, config.hidden_size, config.init_std,
                                         device=device)
                if config.position_embedding == "learned"
                else None
            )
            self.emb_dropout = nn.Dropout(config.dropout)
            self.layers = nn.ModuleList(Block(config, device) for _ in range(config.num_layers))
            self.final_layer_norm = norm(config, device)
            self.embed_out = OutputHead(config.hidden_size, config.vocab_size, device=device)
            if config.tie_word_embeddings:  # one parameter, named embed_in.weight in named_parameters()
                self.embed_out.weight = self.embed_in.weight
        self.checkpoint_fn = None  # see the class docstring
        # Weights to start from (fine-tuning), by parameter name, any float dtype, possibly memory-mapped: when set,
        # initial_value reads them instead of drawing (set it on a meta-built model before materializing).
        self.init_source: Mapping[str, Tensor] | None = None
        self._init_weights()

    INIT_ROWS = 4096  # matrices are drawn in blocks of this many rows, each from its own generator

    def initial_value(self, name: str, shape: torch.Size | tuple[int, ...], rows: Tensor | None = None) -> Tensor:
        """The initial value of parameter ``name`` (its full single-device ``shape``), fp32 on the CPU: a function of
        ``init_seed`` and the name alone, so any rank can draw exactly the pieces it keeps (tensor-parallel shards,
        its pipeline stage's layers) without building the rest. Matrices ``N(0, init_std^2)`` (GPT-NeoX), drawn in
        blocks of :attr:`INIT_ROWS` rows seeded by (seed, name, block); biases 0, LayerNorm weights 1.

        ``rows [R]``: only these rows (of a matrix), drawing only the blocks that hold them: a sequence shard of a
        learned table of a million positions draws its own rows, not the whole table.

        With :attr:`init_source` set, the value is that tensor's (its ``rows``), as fp32."""
        if self.init_source is not None:
            value = self.init_source[name]
            if tuple(value.shape) != tuple(shape):
                raise ValueError(f"init_source[{name!r}] has shape {tuple(value.shape)}, the model {tuple(shape)}")
            rows = None if rows is None else torch.as_tensor(rows, dtype=torch.long).cpu()
            return (value if rows is None else value[rows]).to(torch.float32, copy=True)
        if len(shape) < 2:
            return torch.zeros(shape) if name.endswith("bias") else torch.ones(shape)
        rows = torch.arange(shape[0]) if rows is None else torch.as_tensor(rows, dtype=torch.long).cpu()
        out = torch.empty(rows.numel(), *shape[1:])
        blocks = torch.div(rows, self.INIT_ROWS, rounding_mode="floor")
        for b in torch.unique(blocks).tolist():
            digest = hashlib.sha256(f"{self.init_seed}:{name}:{b}".encode()).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
            start = b * self.INIT_ROWS
            block = torch.empty(min(self.INIT_ROWS, shape[0] - start), *shape[1:])
            block.normal_(0.0, self.config.init_std, generator=gen)  # [block rows, ...]
            mine = blocks == b
            out[mine] = block[rows[mine] - start]
        return out

    @torch.no_grad()
    def _init_weights(self) -> None:
        for name, p in self.named_parameters():
            if not p.is_meta:  # meta parameters are drawn when materialized (ds4sci.sequence.materialize_)
                p.copy_(self.initial_value(name, p.shape))

    def pop_position_embedding(self) -> LearnedPositionEmbedding:
        """Detach the learned position table from the model and return it.

        Afterwards ``forward`` takes ``position_embeds``: a sequence-parallel trainer keeps the sharded table out of
        the DeepSpeed engine (which would broadcast and reduce it as if it were replicated) and adds its output.
        """
        if self.embed_pos is None:
            raise ValueError("this model has no learned position table "
                             f"(position_embedding={self.config.position_embedding!r})")
        table, self.embed_pos = self.embed_pos, None
        return table

    def forward(self, input_ids: Tensor, position_ids: Tensor, doc_ids: Tensor | None = None,
                return_hidden: bool = False, position_embeds: Tensor | None = None,
                cache: KVCache | None = None, stop_after: int | None = None,
                targets: Tensor | None = None) -> Tensor:
        if input_ids.ndim != 2 or position_ids.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and position_ids must both be [B, T], got {tuple(input_ids.shape)} and "
                f"{tuple(position_ids.shape)}"
            )
        if doc_ids is not None and doc_ids.shape != input_ids.shape:
            raise ValueError(f"doc_ids must be [B, T] = {tuple(input_ids.shape)}, got {tuple(doc_ids.shape)}")
        if input_ids.numel() and (input_ids.min() < 0 or input_ids.max() >= self.config.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size}), got range "
                             f"[{int(input_ids.min())}, {int(input_ids.max())}]")
        if self.config.position_embedding != "learned" and position_ids.numel() and position_ids.min() < 0:
            raise ValueError(f"position ids must be >= 0, got {int(position_ids.min())}")
        if stop_after is not None and not 0 <= stop_after <= len(self.layers):
            raise ValueError(f"stop_after={stop_after} must be a block index in 0..{len(self.layers)}")
        if cache is not None and (doc_ids is not None or self.training):
            raise ValueError("a KVCache is for decoding one sequence per row: pass no doc_ids, and call model.eval()")
        x = self.embed_in(input_ids)  # [B, T, hidden]
        if self.config.position_embedding == "learned":
            if (self.embed_pos is None) == (position_embeds is None):
                raise ValueError("pass position_embeds exactly when the position table was popped from the model")
            x = x + (self.embed_pos(position_ids) if position_embeds is None else position_embeds.to(x.dtype))
        x = self.emb_dropout(x)
        if self.checkpoint_fn is not None and self.training and torch.is_grad_enabled() and not x.requires_grad:
            # A frozen embedding (LoRA): a reentrant checkpoint's output needs grad only when an input does, so the
            # blocks' trainable weights (the adapters) would silently get none without this
            x = x.requires_grad_()
        for i, block in enumerate(self.layers[:stop_after]):
            if self.checkpoint_fn is not None and self.training:
                x = self.checkpoint_fn(block, x, position_ids, doc_ids)  # recomputed in backward
            elif cache is not None:
                x = block(x, position_ids, None, cache.layers[i])
            else:
                x = block(x, position_ids, doc_ids)
        if stop_after is not None:
            return x  # [B, T, hidden], the output of block stop_after
        x = self.final_layer_norm(x)
        if targets is not None:
            if return_hidden:
                raise ValueError("pass targets (the loss) or return_hidden (the hidden states), not both")
            return self.embed_out(x, targets)  # the summed loss
        return x if return_hidden else self.embed_out(x)


def lm_loss(logits: Tensor, labels: Tensor, reduction: str = "mean") -> Tensor:
    """Next-token cross entropy: ``logits[:, t]`` predicts ``labels[:, t + 1]``; ``-100`` labels are ignored.

    ``reduction="sum"`` returns the summed loss (for normalising over a global token count, e.g. under
    sequence parallelism where the shift must be done before sharding: see :func:`shift_labels`).
    """
    return token_loss(logits[:, :-1], labels[:, 1:], reduction)


def shift_labels(labels: Tensor) -> Tensor:
    """``[B, T]`` -> ``[B, T]`` targets aligned with the logits: ``out[:, t] = labels[:, t + 1]``, last = -100."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def token_loss(logits: Tensor, targets: Tensor, reduction: str = "mean") -> Tensor:
    """Cross entropy of ``logits [B, T, V]`` against already aligned ``targets [B, T]`` (-100 ignored), in fp32: the
    mean or sum over the real targets, or with ``reduction="none"`` each token's ``[B, T]`` (0 where ignored)."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction=reduction)
    return loss.view(targets.shape) if reduction == "none" else loss
