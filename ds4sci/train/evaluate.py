"""``ds4sci evaluate EXPORT_DIR --fasta FILE``: loss, perplexity and bits per base over real tokens.

Every record is cut into consecutive non-overlapping windows of ``seq_len`` tokens (the last one padded), so each
token is scored at most once; padding never counts, and perplexity is ``exp`` of the full mean loss.
Bits per base = loss (nats/token) / ln 2 / bases per token (a uniform model over A/C/G/T scores 2.0).
"""
from __future__ import annotations

import argparse
import json
import math

import torch

from ds4sci.cli import CommandError, positive_int
from ds4sci.data import RecordDataset, collate, read_fasta
from ds4sci.models.genslm import IGNORE_INDEX, shift_labels, token_loss


def windows(model_config, tokenizer, fasta: str, seq_len: int | None = None) -> RecordDataset:
    """Consecutive windows of every record of ``fasta`` (padded at the end of each record)."""
    limit = model_config.max_position_embeddings
    if seq_len is None:
        seq_len = limit
    elif not 1 <= seq_len <= limit:
        raise ValueError(f"seq_len={seq_len} must be between 1 and the model's context of {limit} tokens")
    chunks = []
    for rec in read_fasta(fasta):
        ids = tokenizer.encode(rec.sequence)
        chunks.extend(ids[s : s + seq_len] for s in range(0, len(ids), seq_len))
    if not chunks:
        raise ValueError(f"{fasta}: no tokens to evaluate")
    return RecordDataset(chunks, tokenizer, seq_len)


@torch.no_grad()
def evaluate(model, tokenizer, dataset, batch_size: int = 8) -> dict[str, float]:
    """Mean next-token loss over the real targets of ``dataset``; perplexity; bits per base."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    total, count = 0.0, 0
    for start in range(0, len(dataset), batch_size):
        batch = collate([dataset[i] for i in range(start, min(len(dataset), start + batch_size))])
        logits = model(batch["input_ids"], batch["position_ids"])
        targets = shift_labels(batch["labels"])
        total += token_loss(logits, targets, "sum").item()
        count += int((targets != IGNORE_INDEX).sum())
    if count == 0:
        raise ValueError("no real target token to evaluate")
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(loss), "bits_per_base": loss / math.log(2) / tokenizer.bases_per_token,
            "tokens": count}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("export", help="export directory written by ds4sci train (OUT_DIR/export)")
    parser.add_argument("--fasta", required=True, help="FASTA file to score")
    parser.add_argument("--seq-len", type=positive_int, default=None,
                        help="window length in tokens, at most the model's context (default: the model's context)")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="windows per forward (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    from ds4sci.train.export import load_consolidated

    model, config, tokenizer = load_consolidated(args.export)
    if args.seq_len is not None and args.seq_len > config.max_position_embeddings:
        raise CommandError(f"--seq-len {args.seq_len} exceeds the model's context of {config.max_position_embeddings} "
                           f"tokens")
    result = evaluate(model, tokenizer, windows(config, tokenizer, args.fasta, args.seq_len), args.batch_size)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>14}: {value:.4f}" if isinstance(value, float) else f"{key:>14}: {value}")
    return 0
