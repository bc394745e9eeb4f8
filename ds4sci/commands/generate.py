"""``ds4sci generate MODEL``: sample sequences from a trained GenSLM (:mod:`ds4sci.infer.generate`) and write
FASTA."""
from __future__ import annotations

import argparse
import logging
import sys

from ds4sci.cli_args import add_device_argument
from ds4sci.cli_args import add_model_argument
from ds4sci.cli_args import nonnegative_float
from ds4sci.cli_args import nonnegative_int
from ds4sci.cli_args import positive_int
from ds4sci.cli_args import probability

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    add_device_argument(parser)
    parser.add_argument("--prompt", default="",
                        help="nucleotide prompt (default: start from [CLS]); read as training data is (uppercased, U "
                        "as T, IUPAC codes R Y S W K M B D H V as N). Codon models: the length must be a multiple of 3 "
                        "(otherwise an error; it is never cut or completed), and a codon with N is [UNK] to the "
                        "model. The output starts with the prompt as read")
    parser.add_argument("--num-tokens", type=positive_int, default=100,
                        help="tokens to generate (bases, or codons for a codon model); prompt + these must fit the "
                        "model's context (default: %(default)s)")
    parser.add_argument("--num-sequences", type=positive_int, default=1,
                        help="sequences to sample, decoded together as one batch; sequence i draws from seed + i, so "
                        "it is the one --num-sequences 1 --seed SEED+i gives (default: %(default)s)")
    parser.add_argument("--temperature", type=nonnegative_float, default=1.0, help="0 = greedy (default: %(default)s)")
    parser.add_argument("--top-k", type=nonnegative_int, default=0, help="0 = no top-k filter (default: %(default)s)")
    parser.add_argument("--top-p", type=probability, default=1.0, help="in (0, 1]; 1 = no nucleus filter")
    parser.add_argument("--seed", type=int, default=0,
                        help="random seed of the first sequence (sequence i uses seed + i) (default: %(default)s)")
    parser.add_argument("--stop-at-stop-codon", action="store_true", help="codon models: stop at TAA/TAG/TGA")
    parser.add_argument("--out", default="-", help="FASTA output file (default: stdout)")


def run(args: argparse.Namespace) -> int:
    from Bio.Seq import Seq
    from Bio.SeqIO import write as write_fasta
    from Bio.SeqRecord import SeqRecord

    from ds4sci.infer.generate import sample
    from ds4sci.infer.parallel import inference_device
    from ds4sci.io.weights import load_model

    model, _, tokenizer = load_model(args.export, inference_device(args.device))
    seqs = sample(model, tokenizer, args.prompt, args.num_tokens, num_sequences=args.num_sequences,
                  temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                  stop_at_stop_codon=args.stop_at_stop_codon)  # sequence i draws from seed + i
    records = [SeqRecord(Seq(seq), id=f"ds4sci_sample_{i}", description=f"seed={args.seed + i} T={args.temperature}")
               for i, seq in enumerate(seqs)]
    if args.out == "-":
        write_fasta(records, sys.stdout, "fasta")
    else:
        write_fasta(records, args.out, "fasta")
        logger.info("wrote %d sequence(s) to %s", len(records), args.out)
    return 0
