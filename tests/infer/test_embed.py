"""embed: the mean final hidden state over every window of a sequence."""
import numpy as np
import pytest
import torch

from ds4sci.infer.embed import embed_sequence


def test_embed_is_mean_over_tokens(tiny):
    model, cfg, tok = tiny
    seq = "ACGTTGCA" * 5  # 40 tokens: two windows of the 32-token context
    got = embed_sequence(model, tok, seq)
    ids = torch.from_numpy(tok.encode(seq))
    h1 = model(ids[None, :32], torch.arange(32)[None], return_hidden=True)[0]
    h2 = model(ids[None, 32:], torch.arange(8)[None], return_hidden=True)[0]
    np.testing.assert_allclose(got, torch.cat([h1, h2]).mean(0).detach().numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="empty"):
        embed_sequence(model, tok, "")
