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

from ds4sci.data import RecordDataset, collate, read_fasta
from ds4sci.models.genslm import IGNORE_INDEX, shift_labels, token_loss


def windows(model_config, tokenizer, fasta: str, seq_len: int | None = None) -> RecordDataset:
    """Consecutive windows of every record of ``fasta`` (padded at the end of each record)."""
    seq_len = seq_len or model_config.max_position_embeddings
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
    parser.add_argument("--seq-len", type=int, default=None, help="window length (default: the model's context)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    from ds4sci.train.export import load_consolidated

    model, config, tokenizer = load_consolidated(args.export)
    result = evaluate(model, tokenizer, windows(config, tokenizer, args.fasta, args.seq_len), args.batch_size)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>14}: {value:.4f}" if isinstance(value, float) else f"{key:>14}: {value}")
    return 0
