"""A small learned-position nucleotide GenSLM in eval mode, shared by the inference tests."""
import pytest
import torch

from ds4sci.data import NucleotideTokenizer
from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm import GenSLMConfig


@pytest.fixture
def tiny():
    """``(model, config, tokenizer)``: a 32-token context, so a 40-token sequence needs two windows."""
    torch.manual_seed(0)
    tok = NucleotideTokenizer()
    cfg = GenSLMConfig.preset("debug", vocab_size=tok.vocab_size, max_position_embeddings=32,
                              position_embedding="learned")
    model = GenSLM(cfg).eval()
    return model, cfg, tok
