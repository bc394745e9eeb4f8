"""One embedding per sequence (``ds4sci embed``).

The embedding is the mean of the final (normalised) hidden states over the record's real tokens; records longer
than the model's context are cut into consecutive windows and the mean runs over all their tokens.
"""
from __future__ import annotations

import numpy as np
import torch


@torch.no_grad()
def embed_sequence(model, tokenizer, sequence: str) -> np.ndarray:
    """Mean final hidden state ``[hidden]`` over the tokens of ``sequence``."""
    ids = torch.from_numpy(tokenizer.encode(sequence))
    if ids.numel() == 0:
        raise ValueError("cannot embed an empty sequence")
    T = model.config.max_position_embeddings
    total = torch.zeros(model.config.hidden_size, dtype=torch.float64)
    for s in range(0, ids.numel(), T):
        chunk = ids[s : s + T][None]
        hidden = model(chunk, torch.arange(chunk.shape[1])[None], return_hidden=True)[0]  # [t, hidden]
        total += hidden.double().sum(0)
    return (total / ids.numel()).float().numpy()
