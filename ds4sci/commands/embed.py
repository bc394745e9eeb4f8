"""``ds4sci embed MODEL --fasta FILE --out FILE.npz``: one embedding per record (:mod:`ds4sci.infer.embed`)."""
from __future__ import annotations

import argparse
import logging

from ds4sci.cli_args import add_model_argument, add_window_arguments, check_windows, positive_int

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--fasta", required=True, help="FASTA file whose records are embedded")
    parser.add_argument("--out", required=True, help="output .npz with arrays ids [R] and embeddings [R, hidden]")
    add_window_arguments(parser)
    parser.add_argument("--batch-size", type=positive_int, default=8, help="windows per forward (default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (none either when stderr is not "
                        "a terminal)")


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from ds4sci.data import read_fasta
    from ds4sci.infer.embed import embed_records
    from ds4sci.io.weights import load_model

    model, config, tokenizer = load_model(args.export)
    check_windows(args, config)
    ids, vectors = embed_records(model, tokenizer, read_fasta(args.fasta), args.seq_len, stride=args.stride,
                                 batch_size=args.batch_size, progress=not args.no_progress)
    np.savez(args.out, ids=np.array(ids), embeddings=vectors)
    logger.info("wrote %d embeddings of size %d to %s", len(ids), vectors.shape[1], args.out)
    return 0
