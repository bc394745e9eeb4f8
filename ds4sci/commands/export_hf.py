"""``ds4sci export-hf MODEL OUT``: a trained model as a Hugging Face transformers directory
(:mod:`ds4sci.io.export_hf`), for ``AutoModelForCausalLM.from_pretrained(OUT)`` and
``AutoTokenizer.from_pretrained(OUT)``."""
from __future__ import annotations

import argparse
import logging

from ds4sci.cli_args import add_model_argument

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("out", metavar="OUT", help="directory to write (config.json, model.safetensors, the "
                        "tokenizer's files); refused when it holds files, unless --overwrite")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into a non-empty OUT, replacing the files of the same names")


def run(args: argparse.Namespace) -> int:
    from ds4sci.io.export_hf import export_hf

    out = export_hf(args.export, args.out, overwrite=args.overwrite)
    logger.info("wrote %s: load it with transformers' AutoModelForCausalLM.from_pretrained and "
                "AutoTokenizer.from_pretrained", out)
    return 0
