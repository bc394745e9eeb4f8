"""GenSLM: a GPT-NeoX-style causal language model over genome tokens (Zvyagin et al. 2022, GenSLMs;
Black et al. 2022, GPT-NeoX-20B), written for one device.

Parameter names mirror Hugging Face's ``GPTNeoXForCausalLM`` (without the ``gpt_neox.`` prefix), so GenSLM's
released checkpoints convert by renaming (:mod:`ds4sci.models.genslm.neox`).

Sequence parallelism is applied from outside: every block's ``attention.core`` is an :class:`AttentionCore`
implementing the local attention protocol (global ``q_offset``/``k_offset``/``head_offset``, document ids,
optional log-sum-exp) and can be swapped for ``ds4sci.sequence.DistributedAttention(core, group)``. Positions are an
input, so the trainer shards tokens, labels and positions together.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ds4sci.models.genslm.config import GenSLMConfig
from ds4sci.models.genslm.masks import make_attention_mask
from ds4sci.models.genslm.position import LearnedPositionEmbedding, alibi_slopes, apply_rotary, rotary_cos_sin

IGNORE_INDEX = -100


class AttentionCore(nn.Module):
    """Causal scaled-dot-product attention with optional ALiBi and document masking (the local attention protocol).

    ``forward(q, k, v, *, q_offset=0, k_offset=0, head_offset=0, q_doc=None, k_doc=None, return_lse=False)``
    with q ``[B, Sq, H, D]``, k and v ``[B, Sk, Hkv, D]`` (Hkv divides H) returns ``[B, Sq, H, D]`` (and the
    log-sum-exp ``[B, H, Sq]`` in at least fp32 with ``return_lse``; rows that see no key give lse = -inf and 0).
    Offsets are the global indices of the first query/key row; ``head_offset`` the global index of local head 0
    (ALiBi slopes). Pure causal attention without ALiBi runs SDPA's causal kernel with no mask tensor.
    """

    def __init__(self, num_heads: int, alibi: bool = False):
        super().__init__()
        self.num_heads = num_heads
        self.alibi = alibi
        self.register_buffer("slopes", alibi_slopes(num_heads) if alibi else torch.empty(0), persistent=False)

    def forward(self, q, k, v, *, q_offset=0, k_offset=0, head_offset=0, q_doc=None, k_doc=None, return_lse=False):
        B, Sq, H, D = q.shape  # batch, query rows, local heads, head dim
        Sk, Hkv = k.shape[1], k.shape[2]
        if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D or H % Hkv:
            raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} are not [B,Sq,H,D]/[B,Sk,Hkv,D]")
        if Hkv != H:  # GQA/MQA: each KV head serves H/Hkv query heads
            k, v = (t.repeat_interleave(H // Hkv, dim=2) for t in (k, v))
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
        mask = make_attention_mask(Sq, Sk, q_offset=q_offset, k_offset=k_offset, causal=True,
                                   q_doc=q_doc, k_doc=k_doc, device=q.device)
        if not return_lse and not self.alibi:
            if mask is None:
                out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=q_offset == k_offset and Sq == Sk)
            else:
                out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
                out = out.masked_fill(~mask.any(-1, keepdim=True), 0.0)  # rows that see no key
            return out.transpose(1, 2)
        # Explicit path (log-sum-exp for ring merging, ALiBi bias): softmax in at least fp32.
        acc = torch.promote_types(q.dtype, torch.float32)
        scores = torch.matmul(qh.to(acc), kh.to(acc).transpose(-1, -2)) / math.sqrt(D)  # [B, H, Sq, Sk]
        if self.alibi:
            slopes = self.slopes[head_offset : head_offset + H]
            if slopes.numel() != H:
                raise ValueError(f"head_offset={head_offset} + {H} local heads exceeds {self.num_heads} ALiBi heads")
            q_pos = torch.arange(q_offset, q_offset + Sq, device=q.device)
            k_pos = torch.arange(k_offset, k_offset + Sk, device=q.device)
            distance = (q_pos[:, None] - k_pos[None, :]).to(acc)  # [Sq, Sk]
            scores = scores - slopes.to(acc)[:, None, None] * distance
        if mask is None:  # aligned pure causal attention: the plain lower triangle
            mask = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [B, H, Sq]
        probs = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
        out = torch.matmul(probs, vh.to(acc)).to(q.dtype).transpose(1, 2)
        return (out, lse) if return_lse else out


class Attention(nn.Module):
    """Multi-head self-attention with fused QKV (GPT-NeoX layout: per head ``[q | k | v]``) and rotary on a
    fraction of head dims."""

    def __init__(self, config: GenSLMConfig):
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.rotary_dim = config.rotary_dim if config.position_embedding == "rotary" else 0
        self.rotary_base = config.rotary_base
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.core = AttentionCore(config.num_heads, alibi=config.position_embedding == "alibi")

    def forward(self, x: Tensor, position_ids: Tensor, doc_ids: Tensor | None) -> Tensor:
        B, T, _ = x.shape  # batch, local tokens, hidden
        qkv = self.query_key_value(x).view(B, T, self.num_heads, 3 * self.head_dim)  # [B, T, H, 3*D]
        q, k, v = qkv.split(self.head_dim, dim=-1)  # each [B, T, H, D]
        if self.rotary_dim:
            cos, sin = rotary_cos_sin(position_ids, self.rotary_dim, self.rotary_base, q.dtype)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.core(q, k, v, q_doc=doc_ids, k_doc=doc_ids)  # [B, T, H, D]
        return self.dense(out.reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config: GenSLMConfig):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.intermediate_size)
        self.dense_4h_to_h = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))


class Block(nn.Module):
    """GPT-NeoX block with parallel residual: ``x + attn(ln1(x)) + mlp(ln2(x))``."""

    def __init__(self, config: GenSLMConfig):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = Attention(config)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, position_ids: Tensor, doc_ids: Tensor | None) -> Tensor:
        attn = self.dropout(self.attention(self.input_layernorm(x), position_ids, doc_ids))
        return x + attn + self.dropout(self.mlp(self.post_attention_layernorm(x)))


class GenSLM(nn.Module):
    """GenSLM causal LM.

    ``forward(input_ids [B, T], position_ids [B, T], doc_ids=None [B, T], return_hidden=False)`` returns logits
    ``[B, T, V]`` (or the final normalised hidden states ``[B, T, hidden]`` with ``return_hidden``).
    ``position_ids`` are global positions (under sequence parallelism: those of the local shard), never built
    inside. ``doc_ids`` restrict attention to the same document (packed windows). ``position_embeds [B, T, hidden]``
    replaces the learned table's output after :meth:`pop_position_embedding`.
    """

    def __init__(self, config: GenSLMConfig):
        super().__init__()
        self.config = config
        self.embed_in = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_pos = (
            LearnedPositionEmbedding(config.max_position_embeddings, config.hidden_size, config.init_std)
            if config.position_embedding == "learned"
            else None
        )
        self.emb_dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.embed_out = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        std = self.config.init_std
        for name, p in self.named_parameters():
            if name.startswith("embed_pos"):
                continue  # drawn in LearnedPositionEmbedding.__init__
            if p.ndim >= 2:
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                nn.init.ones_(p)

    def pop_position_embedding(self) -> LearnedPositionEmbedding:
        """Detach the learned position table from the model and return it.

        Afterwards ``forward`` takes ``position_embeds``: a sequence-parallel trainer keeps the sharded table out of
        the DeepSpeed engine (which would broadcast and reduce it as if it were replicated) and adds its output.
        """
        if self.embed_pos is None:
            raise ValueError(f"this model has no learned position table (position_embedding={self.config.position_embedding!r})")
        table, self.embed_pos = self.embed_pos, None
        return table

    def forward(self, input_ids: Tensor, position_ids: Tensor, doc_ids: Tensor | None = None,
                return_hidden: bool = False, position_embeds: Tensor | None = None) -> Tensor:
        if input_ids.ndim != 2 or position_ids.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and position_ids must both be [B, T], got {tuple(input_ids.shape)} and {tuple(position_ids.shape)}"
            )
        if doc_ids is not None and doc_ids.shape != input_ids.shape:
            raise ValueError(f"doc_ids must be [B, T] = {tuple(input_ids.shape)}, got {tuple(doc_ids.shape)}")
        if input_ids.numel() and (input_ids.min() < 0 or input_ids.max() >= self.config.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size}), got range "
                             f"[{int(input_ids.min())}, {int(input_ids.max())}]")
        if self.config.position_embedding != "learned" and position_ids.numel() and position_ids.min() < 0:
            raise ValueError(f"position ids must be >= 0, got {int(position_ids.min())}")
        x = self.embed_in(input_ids)  # [B, T, hidden]
        if self.config.position_embedding == "learned":
            if (self.embed_pos is None) == (position_embeds is None):
                raise ValueError("pass position_embeds exactly when the position table was popped from the model")
            x = x + (self.embed_pos(position_ids) if position_embeds is None else position_embeds.to(x.dtype))
        x = self.emb_dropout(x)
        for block in self.layers:
            x = block(x, position_ids, doc_ids)
        x = self.final_layer_norm(x)
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
    """Cross entropy of ``logits [B, T, V]`` against already aligned ``targets [B, T]`` (-100 ignored)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction=reduction)
