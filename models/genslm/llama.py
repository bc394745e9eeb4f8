"""Conversion of Hugging Face ``LlamaForCausalLM`` configs and state dicts (Touvron et al. 2023, Llama; Llama-3:
Grattafiori et al. 2024) to GenSLM's Llama shape (:class:`~ds4sci.models.genslm.config.GenSLMConfig` with
``mlp="swiglu"``, ``norm="rmsnorm"``, ``parallel_residual=False``), and of such a GenSLM's state dict back
(:func:`to_llama_state_dict`).

Names map one to one (:data:`LLAMA_NAMES`) except the attention's: Llama's separate ``q_proj``, ``k_proj`` and
``v_proj`` become GenSLM's fused ``query_key_value``, grouped per key/value head (:class:`~ds4sci.models.genslm.model.
Attention`'s layout), and are split apart again on the way out (:func:`unfuse_qkv`). Both models rotate the
half-split layout (transformers' ``rotate_half``), so no weight is permuted. A tied model's file holds no
``lm_head.weight``; the head is the embedding.
"""
from __future__ import annotations

import torch

from ds4sci.models.genslm.config import GenSLMConfig

# LlamaForCausalLM's names -> GenSLM's: the model-wide ones, then those of a layer (after "model.layers.{i}.")
LLAMA_NAMES = {"model.embed_tokens.weight": "embed_in.weight", "model.norm.weight": "final_layer_norm.weight",
               "lm_head.weight": "embed_out.weight"}
LLAMA_LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "self_attn.o_proj.weight": "attention.dense.weight", "self_attn.o_proj.bias": "attention.dense.bias",
    "mlp.up_proj.weight": "mlp.dense_h_to_4h.weight", "mlp.up_proj.bias": "mlp.dense_h_to_4h.bias",
    "mlp.gate_proj.weight": "mlp.dense_h_to_4h_gate.weight", "mlp.gate_proj.bias": "mlp.dense_h_to_4h_gate.bias",
    "mlp.down_proj.weight": "mlp.dense_4h_to_h.weight", "mlp.down_proj.bias": "mlp.dense_4h_to_h.bias",
}
_QKV = ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.")  # fused into attention.query_key_value.
_BUFFER_SUFFIXES = (".rotary_emb.inv_freq",)  # stored by some transformers versions; recomputed here


def config_from_llama(hf_config) -> GenSLMConfig:
    """GenSLMConfig of a ``transformers.LlamaConfig``: SiLU required, ``head_dim`` the hidden size's share,
    ``attention_bias`` equal to ``mlp_bias``, rotary type ``"default"`` or ``"llama3"`` on every head dim.

    Raises:
        ValueError: naming the Llama key and value GenSLM cannot express.
    """
    if hf_config.hidden_act != "silu":
        raise ValueError(f"hidden_act={hf_config.hidden_act!r}: GenSLM's SwiGLU MLP is SiLU-gated ('silu')")
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    if head_dim * hf_config.num_attention_heads != hf_config.hidden_size:
        raise ValueError(f"head_dim={head_dim}: GenSLM's heads split hidden_size={hf_config.hidden_size} into "
                         f"num_attention_heads={hf_config.num_attention_heads}")
    attention_bias, mlp_bias = bool(hf_config.attention_bias), bool(getattr(hf_config, "mlp_bias", False))
    if attention_bias != mlp_bias:
        raise ValueError(f"attention_bias={attention_bias} with mlp_bias={mlp_bias}: GenSLM's one bias setting "
                         f"needs both equal")
    # transformers < 5 keeps rope_theta / rope_scaling; 5.x one rope_parameters dict holding both
    rope = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"rope_type={rope_type!r}: GenSLM computes the 'default' and 'llama3' rotary frequencies")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor={rope['partial_rotary_factor']!r}: transformers' Llama rotates every "
                         f"head dim (its default rope ignores the factor, its 'llama3' rope fails on it)")
    base = rope.get("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    scaling = {}
    if rope_type == "llama3":
        scaling = dict(rotary_scaling_factor=float(rope["factor"]),
                       rotary_low_freq_factor=float(rope["low_freq_factor"]),
                       rotary_high_freq_factor=float(rope["high_freq_factor"]),
                       rotary_original_max_positions=rope["original_max_position_embeddings"])
    return GenSLMConfig(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=hf_config.num_key_value_heads or hf_config.num_attention_heads,
        intermediate_size=hf_config.intermediate_size,
        max_position_embeddings=hf_config.max_position_embeddings,
        position_embedding="rotary",
        rotary_pct=1.0,
        rotary_base=float(base),
        layer_norm_eps=hf_config.rms_norm_eps,
        norm="rmsnorm",
        mlp="swiglu",
        bias=attention_bias,
        parallel_residual=False,
        tie_word_embeddings=bool(hf_config.tie_word_embeddings),
        **scaling,
    )


def fuse_qkv(q, k, v, num_kv_heads: int):
    """Llama's ``q_proj`` ``[H*D, ...]``, ``k_proj`` and ``v_proj`` ``[Hkv*D, ...]`` (weights or biases) ->
    ``query_key_value`` ``[(H + 2*Hkv)*D, ...]`` grouped per key/value head: ``[q of its H/Hkv heads | k | v]``.
    Shapes (tuples) fuse to the fused shape, so a state dict's shapes are checked before any tensor is read."""
    if isinstance(q, tuple):
        return (q[0] + k[0] + v[0], *q[1:])
    rest = q.shape[1:]
    grouped = [t.reshape(num_kv_heads, -1, *rest) for t in (q, k, v)]  # [Hkv, g*D | D | D, ...]
    return torch.cat(grouped, dim=1).reshape(-1, *rest)


def unfuse_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, ...]:
    """The inverse of :func:`fuse_qkv`: ``query_key_value`` ``[(H + 2*Hkv)*D, ...]`` (weight or bias), grouped per
    key/value head, -> Llama's ``q_proj`` ``[H*D, ...]``, ``k_proj`` and ``v_proj`` ``[Hkv*D, ...]``."""
    rest = qkv.shape[1:]
    g = num_heads // num_kv_heads  # query heads per key/value head
    grouped = qkv.reshape(num_kv_heads, -1, *rest)  # [Hkv, (g+2)*D, ...]
    d = grouped.shape[1] // (g + 2)  # head_dim
    q, k, v = grouped.split((g * d, d, d), dim=1)  # [Hkv, g*D, ...], [Hkv, D, ...] x 2
    return tuple(t.reshape(-1, *rest) for t in (q, k, v))  # [H*D, ...], [Hkv*D, ...] x 2


def to_llama_state_dict(model) -> dict[str, torch.Tensor]:
    """A Llama-shaped GenSLM's parameters (:meth:`GenSLMConfig.check_llama_shape`) under ``LlamaForCausalLM``'s names
    (:data:`LLAMA_NAMES`, :data:`LLAMA_LAYER_NAMES`), ``query_key_value`` split into q/k/v (:func:`unfuse_qkv`); a
    tied model's has no ``lm_head.weight`` (transformers ties it to the embedding, as ``tie_word_embeddings``
    says).

    Raises:
        ValueError: naming the first field whose value LlamaForCausalLM does not compute.
    """
    config = model.config
    config.check_llama_shape("LlamaForCausalLM computes")
    names = {ours: theirs for theirs, ours in LLAMA_NAMES.items()}
    layer_names = {ours: theirs for theirs, ours in LLAMA_LAYER_NAMES.items()}
    out = {}
    for name, tensor in model.state_dict().items():
        if name in names:
            if not (name == "embed_out.weight" and config.tie_word_embeddings):
                out[names[name]] = tensor
            continue
        _, layer, rest = name.split(".", 2)  # layers.{i}.<rest>
        if rest.startswith("attention.query_key_value."):
            kind = rest.rsplit(".", 1)[1]
            for projection, part in zip(_QKV, unfuse_qkv(tensor, config.num_heads, config.num_kv_heads)):
                out[f"model.layers.{layer}.{projection}{kind}"] = part
        else:
            out[f"model.layers.{layer}.{layer_names[rest]}"] = tensor
    return out


def from_llama_state_dict(state_dict: dict, config: GenSLMConfig) -> dict:
    """A ``LlamaForCausalLM`` state dict (or its names -> shapes) under GenSLM's names, q/k/v fused
    (:func:`fuse_qkv`); for a tied ``config``, ``embed_out.weight`` is ``embed_in.weight``.

    Raises:
        KeyError: a name that is not a Llama model's, or a layer missing one of q/k/v.
    """
    out, qkv = {}, {}
    for name, value in state_dict.items():
        if name.endswith(_BUFFER_SUFFIXES):
            continue
        if name in LLAMA_NAMES:
            if not (name == "lm_head.weight" and config.tie_word_embeddings):
                out[LLAMA_NAMES[name]] = value
            continue
        layer, _, rest = name.removeprefix("model.layers.").partition(".")
        if not (name.startswith("model.layers.") and layer.isdigit()):
            raise KeyError(f"unexpected Llama key {name!r}")
        if rest in LLAMA_LAYER_NAMES:
            out[f"layers.{layer}.{LLAMA_LAYER_NAMES[rest]}"] = value
        elif rest.startswith(_QKV) and rest.count(".") == 2:
            projection, kind = rest.rsplit(".", 1)
            qkv.setdefault((layer, kind), {})[projection] = value
        else:
            raise KeyError(f"unexpected Llama key {name!r}")
    for (layer, kind), parts in qkv.items():
        missing = [p + kind for p in _QKV if p[:-1] not in parts]
        if missing:
            raise KeyError(f"Llama layer {layer} has no {missing[0]!r}")
        out[f"layers.{layer}.attention.query_key_value.{kind}"] = fuse_qkv(
            *(parts[p[:-1]] for p in _QKV), config.num_kv_heads)
    if config.tie_word_embeddings and "embed_in.weight" in out:
        out["embed_out.weight"] = out["embed_in.weight"]
    return out
