"""``ds4sci embed EXPORT_DIR --fasta FILE --out FILE.npz``: one embedding per record.

The embedding is the mean of the final (normalised) hidden states over the record's real tokens; records longer
than the model's context are cut into consecutive windows and the mean runs over all their tokens.
"""
from __future__ import annotations

import argparse
import logging

import numpy as np
import torch

from ds4sci.cli import add_model_argument
from ds4sci.data import read_fasta

logger = logging.getLogger(__name__)


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--fasta", required=True)
    parser.add_argument("--out", required=True, help="output .npz with arrays ids [R] and embeddings [R, hidden]")


def run(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from ds4sci.train.init_from import load_model

    model, _, tokenizer = load_model(args.export)
    ids, vectors = [], []
    for rec in tqdm(read_fasta(args.fasta), desc="embed", unit="record"):
        ids.append(rec.id)
        vectors.append(embed_sequence(model, tokenizer, rec.sequence))
    np.savez(args.out, ids=np.array(ids), embeddings=np.stack(vectors))
    logger.info("wrote %d embeddings of size %d to %s", len(ids), vectors[0].shape[0], args.out)
    return 0
