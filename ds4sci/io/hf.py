"""How a Hugging Face transformers ``config.json`` names GenSLMConfig's fields: the one table that reading a GPT-NeoX
directory (:mod:`ds4sci.io.weights`) and writing one (:mod:`ds4sci.io.export_hf`, the inverse) both use. Torch-free.

The tensors' names are mapped by :mod:`ds4sci.models.genslm.neox` (``from_gpt_neox_state_dict`` in,
``to_gpt_neox_state_dict`` out).
"""
from __future__ import annotations

# a GPT-NeoX config.json's keys (dotted: inside an object) -> the GenSLMConfig fields they become
GPT_NEOX_KEYS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_layers",
                 "num_attention_heads": "num_heads", "intermediate_size": "intermediate_size",
                 "max_position_embeddings": "max_position_embeddings", "layer_norm_eps": "layer_norm_eps",
                 "rotary_pct": "rotary_pct", "rotary_emb_base": "rotary_base",
                 "rope_parameters.partial_rotary_factor": "rotary_pct", "rope_parameters.rope_theta": "rotary_base"}
# the same, field -> key, where the key is top-level: what a refusal names, and what an export writes (transformers
# 4 reads these keys; 5 moves them into rope_parameters as it reads them)
GPT_NEOX_NAMES = {field: key for key, field in GPT_NEOX_KEYS.items() if "." not in key}
# GenSLMConfig.activation -> the hidden_act an export writes: F.gelu(approximate="tanh") is what both ds4sci's
# "gelu_tanh" and transformers' "gelu_pytorch_tanh" compute (the reader also takes gelu_fast and gelu_new for it)
GPT_NEOX_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}
