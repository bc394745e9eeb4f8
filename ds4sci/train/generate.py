"""``ds4sci generate EXPORT_DIR``: sample sequences from a trained GenSLM and write FASTA.

Temperature, top-k and top-p (nucleus, Holtzman et al. 2020) sampling; temperature 0 is greedy. In codon mode the
sampler can stop at a stop codon (TAA/TAG/TGA). Positions are built here (``0..L-1``) and passed to the model.
"""
from __future__ import annotations

import argparse
import logging

import torch
from Bio.Seq import Seq
from Bio.SeqIO import write as write_fasta
from Bio.SeqRecord import SeqRecord

from ds4sci.data import CodonTokenizer, normalize_sequence

logger = logging.getLogger(__name__)


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Keep the ``top_k`` largest logits and the smallest set whose probability reaches ``top_p``; ``[V]`` -> ``[V]``."""
    if top_k < 0 or not 0.0 < top_p <= 1.0:
        raise ValueError(f"need top_k >= 0 and 0 < top_p <= 1, got top_k={top_k}, top_p={top_p}")
    logits = logits.clone()
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, -1) >= top_p  # keep tokens until the mass before them reaches top_p
        logits[order[drop]] = float("-inf")
    return logits


@torch.no_grad()
def sample(model, tokenizer, prompt: str = "", num_tokens: int = 100, *, temperature: float = 1.0, top_k: int = 0,
           top_p: float = 1.0, seed: int = 0, stop_at_stop_codon: bool = False) -> str:
    """Generate ``num_tokens`` tokens after ``prompt``; returns the nucleotide string (prompt included)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if stop_at_stop_codon and not isinstance(tokenizer, CodonTokenizer):
        raise ValueError("stop_at_stop_codon needs the codon tokenizer")
    prompt = normalize_sequence(prompt, where="prompt")  # uppercased; a non-nucleotide character is an error
    ids = tokenizer.encode(prompt).tolist() if prompt else [tokenizer.cls_id]
    limit = model.config.max_position_embeddings
    if len(ids) + num_tokens > limit:
        raise ValueError(f"prompt ({len(ids)} tokens) + num_tokens={num_tokens} exceeds the model's context of {limit}")
    gen = torch.Generator().manual_seed(seed)
    banned = torch.tensor(sorted(tokenizer.special_ids))
    for _ in range(num_tokens):
        x = torch.tensor([ids])
        logits = model(x, torch.arange(len(ids))[None])[0, -1].float()
        logits[banned] = float("-inf")  # generate sequence tokens only
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            probs = torch.softmax(filter_logits(logits / temperature, top_k, top_p), -1)
            nxt = int(torch.multinomial(probs, 1, generator=gen))
        ids.append(nxt)
        if stop_at_stop_codon and nxt in tokenizer.stop_ids:
            break
    return tokenizer.decode(ids)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("export", help="export directory written by ds4sci train (OUT_DIR/export)")
    parser.add_argument("--prompt", default="", help="nucleotide prompt (default: start from [CLS])")
    parser.add_argument("--num-tokens", type=int, default=100)
    parser.add_argument("--num-sequences", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop-at-stop-codon", action="store_true", help="codon models: stop at TAA/TAG/TGA")
    parser.add_argument("--out", default="-", help="FASTA output file (default: stdout)")


def run(args: argparse.Namespace) -> int:
    import sys

    from ds4sci.train.export import load_consolidated

    model, _, tokenizer = load_consolidated(args.export)
    records = []
    for i in range(args.num_sequences):
        seq = sample(model, tokenizer, args.prompt, args.num_tokens, temperature=args.temperature, top_k=args.top_k,
                     top_p=args.top_p, seed=args.seed + i, stop_at_stop_codon=args.stop_at_stop_codon)
        records.append(SeqRecord(Seq(seq), id=f"ds4sci_sample_{i}", description=f"seed={args.seed + i} T={args.temperature}"))
    if args.out == "-":
        write_fasta(records, sys.stdout, "fasta")
    else:
        write_fasta(records, args.out, "fasta")
        logger.info("wrote %d sequence(s) to %s", len(records), args.out)
    return 0
