"""``ds4sci export-hf MODEL OUT``: a trained model as a Hugging Face transformers directory
(:mod:`ds4sci.io.export_hf`), for ``AutoModelForCausalLM.from_pretrained(OUT)`` and
``AutoTokenizer.from_pretrained(OUT)``; a fine-tuned task model as a transformers classifier
(:mod:`ds4sci.io.export_hf_task`), for ``AutoModelForSequenceClassification`` / ``AutoModelForTokenClassification``,
its LoRA adapter merged (``--merge``) or for ``PeftModel.from_pretrained``."""
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
    parser.add_argument("--merge", action="store_true",
                        help="a fine-tuned task model with LoRA adapters: fold them into the weights (default: the "
                        "base model, and the adapters in OUT/adapter for peft's PeftModel.from_pretrained)")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ds4sci.io.export_hf import export_hf
    from ds4sci.io.export_hf_task import export_task_hf
    from ds4sci.io.task_model import TASK_FILE

    if (Path(args.export) / TASK_FILE).is_file():  # a fine-tuned task model: a transformers classifier
        out = export_task_hf(args.export, args.out, overwrite=args.overwrite, merge=args.merge)
        logger.info("wrote %s: load it with transformers' AutoModelForSequenceClassification (or "
                    "AutoModelForTokenClassification) and AutoTokenizer.from_pretrained", out)
        return 0
    if args.merge:
        raise ValueError(f"--merge: {args.export} is not a fine-tuned task model (no {TASK_FILE}): nothing to merge")
    out = export_hf(args.export, args.out, overwrite=args.overwrite)
    logger.info("wrote %s: load it with transformers' AutoModelForCausalLM.from_pretrained and "
                "AutoTokenizer.from_pretrained", out)
    return 0
