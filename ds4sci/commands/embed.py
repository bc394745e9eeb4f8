"""``ds4sci embed MODEL --fasta FILE --out FILE.npz``: embeddings of every record (:mod:`ds4sci.infer.embed`), the
mean over its tokens or (``--per-token``) every token's, of the final norm or of ``--layer K``."""
from __future__ import annotations

import argparse
import logging

from ds4sci.cli_args import CommandError
from ds4sci.cli_args import add_device_argument
from ds4sci.cli_args import add_model_argument
from ds4sci.cli_args import add_out_argument
from ds4sci.cli_args import out_folder
from ds4sci.commands.inference import add_reading_arguments
from ds4sci.commands.inference import add_record_arguments
from ds4sci.commands.inference import load_reader
from ds4sci.commands.inference import write_records

logger = logging.getLogger(__name__)


def layer(text: str) -> int | None:
    """argparse ``type=``: ``final`` (None) or a block index >= 0 (checked against the model by :func:`run`)."""
    if text == "final":
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 'final' or a block index >= 0, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    add_device_argument(parser)
    parser.add_argument("--fasta", required=True, help="FASTA file whose records are embedded (ids must be unique)")
    add_out_argument(parser, "embed", "embeddings.npz", "output .npz: arrays ids [R] and embeddings [R, hidden] "
                     "(float32); with --per-token, one float32 array [tokens, hidden] per record, named by its id; "
                     "or .parquet: columns id, layer, embedding (hidden floats; with --per-token, tokens x hidden), "
                     "written in rank shards as it goes and resumable")
    parser.add_argument("--layer", type=layer, default=None, metavar="K",
                        help="the states embedded: 'final' (the final norm's output, the default), or block K's output "
                        "(0: the token and position embeddings, num_layers: the last block's, before the final norm)")
    parser.add_argument("--per-token", action="store_true",
                        help="every token's state instead of the record's mean, written record by record")
    add_reading_arguments(parser)
    add_record_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from ds4sci.data import read_fasta
    from ds4sci.infer.embed import embed_records
    from ds4sci.infer.embed import save_token_embeddings
    from ds4sci.infer.embed import token_embeddings
    from ds4sci.infer.length import default_length

    def check_layer(config, tokenizer) -> None:
        if args.layer is not None and args.layer > config.num_layers:
            raise CommandError(f"--layer {args.layer}: the model has blocks 0..{config.num_layers} (0: the embeddings)")

    parquet = args.out.endswith(".parquet")
    if args.resume and not parquet:
        raise CommandError(f"--resume needs a .parquet --out (got {args.out!r}): an .npz is written at the end")
    out_folder(args.out)
    model, config, tokenizer, runner = load_reader(args, check=check_layer)
    what = "final norm" if args.layer is None else f"block {args.layer}"
    seq_len = args.seq_len or default_length(args.export, config)
    if parquet:
        import os

        from ds4sci.infer.embed import embed_stream

        records = list(read_fasta(args.fasta))
        name = "final" if args.layer is None else str(args.layer)

        def stream(skip, progress):
            for index, key, states in embed_stream(model, tokenizer, records, seq_len, stride=args.stride,
                                                   batch_size=args.batch_size, max_tokens=args.max_tokens_per_batch,
                                                   pack=args.pack, layer=args.layer, per_token=args.per_token,
                                                   skip=skip, progress=progress, runner=runner):
                yield index, (key, name, states)

        job = {"command": "embed", "export": os.path.abspath(args.export), "seq_len": seq_len,
                  "stride": args.stride, "layer": args.layer, "per_token": args.per_token,
                  "batch_size": args.batch_size, "max_tokens": args.max_tokens_per_batch, "pack": args.pack}
        count = write_records(args, runner, job, stream, "parquet", "embed", len(records))
        if count:
            logger.info("wrote the embeddings (%s) of %d record(s) to %s", what, count, args.out)
        return 0
    options = dict(stride=args.stride, batch_size=args.batch_size, max_tokens=args.max_tokens_per_batch,
                   progress=not args.no_progress, layer=args.layer, runner=runner)
    if not args.per_token:
        options["pack"] = args.pack
    if args.per_token:
        states = token_embeddings(model, tokenizer, read_fasta(args.fasta), seq_len, **options)
        if not runner.is_writer:  # its records go to rank 0, which writes them
            for _ in states:
                pass
            return 0
        count = save_token_embeddings(args.out, states)
        logger.info("wrote the per-token states (%s) of %d record(s) to %s", what, count, args.out)
        return 0
    ids, vectors = embed_records(model, tokenizer, read_fasta(args.fasta), seq_len, **options)
    if runner.is_writer:
        np.savez(args.out, ids=np.array(ids), embeddings=vectors)
        logger.info("wrote %d embeddings (%s) of size %d to %s", len(ids), what, vectors.shape[1], args.out)
    return 0
