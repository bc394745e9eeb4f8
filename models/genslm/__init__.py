"""ds4sci.models.genslm: GenSLM-style GPT for genome sequences (single-device modules)."""
from ds4sci.models.genslm.config import POSITION_EMBEDDINGS, PRESETS, GenSLMConfig
from ds4sci.models.genslm.model import IGNORE_INDEX, AttentionCore, GenSLM, lm_loss, shift_labels, token_loss
from ds4sci.models.genslm.neox import config_from_gpt_neox, from_gpt_neox_state_dict, to_gpt_neox_state_dict
from ds4sci.models.genslm.position import LearnedPositionEmbedding, alibi_slopes

__all__ = [
    "POSITION_EMBEDDINGS", "PRESETS", "GenSLMConfig", "IGNORE_INDEX", "AttentionCore", "GenSLM", "lm_loss",
    "shift_labels", "token_loss", "config_from_gpt_neox", "from_gpt_neox_state_dict", "to_gpt_neox_state_dict",
    "LearnedPositionEmbedding", "alibi_slopes",
]
