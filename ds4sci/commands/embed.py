"""``ds4sci embed MODEL --fasta FILE --out FILE.npz``: one embedding per record (:mod:`ds4sci.infer.embed`)."""
from __future__ import annotations

import argparse
import logging

from ds4sci.cli_args import add_model_argument

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--fasta", required=True)
    parser.add_argument("--out", required=True, help="output .npz with arrays ids [R] and embeddings [R, hidden]")


def run(args: argparse.Namespace) -> int:
    import numpy as np
    from tqdm.auto import tqdm

    from ds4sci.data import read_fasta
    from ds4sci.infer.embed import embed_sequence
    from ds4sci.io.weights import load_model

    model, _, tokenizer = load_model(args.export)
    ids, vectors = [], []
    for rec in tqdm(read_fasta(args.fasta), desc="embed", unit="record"):
        ids.append(rec.id)
        vectors.append(embed_sequence(model, tokenizer, rec.sequence))
    np.savez(args.out, ids=np.array(ids), embeddings=np.stack(vectors))
    logger.info("wrote %d embeddings of size %d to %s", len(ids), vectors[0].shape[0], args.out)
    return 0
