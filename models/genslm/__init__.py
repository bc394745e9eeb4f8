"""ds4sci.models.genslm: GenSLM-style GPT for genome sequences (single-device modules).

The names below load their module on first access (PEP 562), so that ``ds4sci.models.genslm.config`` (torch-free)
imports without torch.
"""
from __future__ import annotations

from ds4sci.kernels.lazy import lazy_exports

# name -> submodule defining it
_EXPORTS = {
    "POSITION_EMBEDDINGS": "config", "PRESETS": "config", "GenSLMConfig": "config",
    "IGNORE_INDEX": "model", "AttentionCore": "model", "GenSLM": "model", "KVCache": "model", "lm_loss": "model",
    "shift_labels": "model", "token_loss": "model",
    "config_from_gpt_neox": "neox", "from_gpt_neox_state_dict": "neox", "to_gpt_neox_state_dict": "neox",
    "config_from_llama": "llama", "from_llama_state_dict": "llama", "to_llama_state_dict": "llama",
    "LearnedPositionEmbedding": "position", "alibi_slopes": "position",
    "GenSLMForTask": "task", "TaskHead": "task", "TaskSpec": "task", "task_loss": "task",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
