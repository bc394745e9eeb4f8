"""Conversion between Hugging Face ``GPTNeoXForCausalLM`` state dicts (GenSLM's released format) and GenSLM.

GenSLM's module names mirror GPT-NeoX's, so conversion is a prefix rename: ``gpt_neox.<name>`` <-> ``<name>``,
``embed_out.weight`` unchanged. Non-parameter buffers some transformers versions store (rotary ``inv_freq``,
causal ``bias``/``masked_bias``) are dropped on load. Only rotary GenSLMs have a GPT-NeoX counterpart.
"""
from __future__ import annotations

import torch

from ds4sci.models.genslm.config import GenSLMConfig
from ds4sci.models.genslm.model import GenSLM

_BUFFER_SUFFIXES = (".attention.rotary_emb.inv_freq", ".attention.bias", ".attention.masked_bias")
# transformers' hidden_act names -> GenSLMConfig.activation; gelu_fast / gelu_new / gelu_pytorch_tanh are the same
# tanh approximation (GenSLM's released models use gelu_fast)
_ACTIVATIONS = {"gelu": "gelu", "gelu_fast": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def config_from_gpt_neox(hf_config) -> GenSLMConfig:
    """GenSLMConfig from a ``transformers.GPTNeoXConfig`` (parallel residual, untied head, a GELU required)."""
    if not getattr(hf_config, "use_parallel_residual", True):
        raise ValueError("only GPT-NeoX models with use_parallel_residual=True are supported")
    if getattr(hf_config, "tie_word_embeddings", False):
        raise ValueError("only GPT-NeoX models with untied input/output embeddings are supported")
    if hf_config.hidden_act not in _ACTIVATIONS:
        raise ValueError(f"hidden_act must be one of {sorted(_ACTIVATIONS)}, got {hf_config.hidden_act!r}")
    # transformers < 5 keeps rotary_pct / rotary_emb_base; 5.x moved them into rope_parameters.
    rope = getattr(hf_config, "rope_parameters", None) or {}
    rotary_pct = getattr(hf_config, "rotary_pct", None) or rope.get("partial_rotary_factor", 1.0)
    rotary_base = getattr(hf_config, "rotary_emb_base", None) or rope.get("rope_theta", 10000.0)
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"only default rotary embeddings are supported, got rope_type={rope['rope_type']!r}")
    return GenSLMConfig(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=hf_config.num_attention_heads,
        intermediate_size=hf_config.intermediate_size,
        max_position_embeddings=hf_config.max_position_embeddings,
        position_embedding="rotary",
        rotary_pct=float(rotary_pct),
        rotary_base=float(rotary_base),
        layer_norm_eps=hf_config.layer_norm_eps,
        activation=_ACTIVATIONS[hf_config.hidden_act],
    )


def from_gpt_neox_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a ``GPTNeoXForCausalLM`` state dict to GenSLM's names."""
    out = {}
    for name, tensor in state_dict.items():
        if name.endswith(_BUFFER_SUFFIXES):
            continue
        if name.startswith("gpt_neox."):
            out[name[len("gpt_neox."):]] = tensor
        elif name in ("embed_out.weight", "lm_head.weight"):  # transformers >= 5 calls the head lm_head
            out["embed_out.weight"] = tensor
        else:
            raise KeyError(f"unexpected GPT-NeoX key {name!r}")
    return out


def to_gpt_neox_state_dict(model: GenSLM, head_key: str = "embed_out.weight") -> dict[str, torch.Tensor]:
    """GenSLM (rotary, GPT-NeoX-shaped: :meth:`GenSLMConfig.check_gpt_neox_shape`) parameters under
    ``GPTNeoXForCausalLM`` names (``head_key="lm_head.weight"`` for transformers >= 5)."""
    if model.config.position_embedding != "rotary":
        raise ValueError(f"GPT-NeoX has rotary positions only; this model uses {model.config.position_embedding!r}")
    model.config.check_gpt_neox_shape("GPTNeoXForCausalLM's names hold")
    return {(head_key if k == "embed_out.weight" else f"gpt_neox.{k}"): v for k, v in model.state_dict().items()}
