"""How a Hugging Face transformers ``config.json`` names GenSLMConfig's fields, one table per architecture
(GPT-NeoX, Llama) that reading a directory (:mod:`ds4sci.io.weights`) and writing one (:mod:`ds4sci.io.export_hf`,
the inverse) both use. Torch-free.

The tensors' names are mapped by :mod:`ds4sci.models.genslm.neox` (``from_gpt_neox_state_dict`` in,
``to_gpt_neox_state_dict`` out) and :mod:`ds4sci.models.genslm.llama` (``from_llama_state_dict``,
``to_llama_state_dict``).
"""
from __future__ import annotations

# config.json keys both architectures share (dotted: inside an object) -> the GenSLMConfig fields they become
_SHARED_KEYS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_layers",
                "num_attention_heads": "num_heads", "intermediate_size": "intermediate_size",
                "max_position_embeddings": "max_position_embeddings",
                "rope_parameters.partial_rotary_factor": "rotary_pct", "rope_parameters.rope_theta": "rotary_base"}
# a GPT-NeoX config.json's keys -> the GenSLMConfig fields they become
GPT_NEOX_KEYS = {**_SHARED_KEYS, "layer_norm_eps": "layer_norm_eps", "rotary_pct": "rotary_pct",
                 "rotary_emb_base": "rotary_base"}
# GenSLMConfig.activation -> the hidden_act an export writes: F.gelu(approximate="tanh") is what both ds4sci's
# "gelu_tanh" and transformers' "gelu_pytorch_tanh" compute (the reader also takes gelu_fast and gelu_new for it)
GPT_NEOX_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}

# Llama-3's rotary scaling (rope_type "llama3") keys, inside rope_scaling (what transformers 4 reads and 5 converts;
# an export writes them there) or rope_parameters (transformers 5's own) -> the GenSLMConfig fields they become
LLAMA3_KEYS = {"factor": "rotary_scaling_factor", "low_freq_factor": "rotary_low_freq_factor",
               "high_freq_factor": "rotary_high_freq_factor",
               "original_max_position_embeddings": "rotary_original_max_positions"}
# a Llama config.json's keys -> the GenSLMConfig fields they become. No partial rotary: transformers' Llama rotates
# every dim of a head (its default rope ignores partial_rotary_factor; with "llama3" the shapes fail to broadcast)
LLAMA_KEYS = {**{key: field for key, field in _SHARED_KEYS.items() if field != "rotary_pct"},
              "num_key_value_heads": "num_kv_heads", "rms_norm_eps": "layer_norm_eps", "rope_theta": "rotary_base",
              "tie_word_embeddings": "tie_word_embeddings",
              **{f"{parent}.{key}": field for parent in ("rope_scaling", "rope_parameters")
                 for key, field in LLAMA3_KEYS.items()}}
