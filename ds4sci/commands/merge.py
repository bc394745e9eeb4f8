"""``ds4sci merge MODEL OUT``: a fine-tuned task model's LoRA adapters folded into the weights
(:func:`ds4sci.io.task_model.merge_task_model`), written as a plain ds4sci export with its head: what a full
fine-tune exports, so ``score``, ``embed`` and ``predict`` read it without the base model."""
from __future__ import annotations

import argparse
import logging

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("export", metavar="MODEL", help="a fine-tuned task model with LoRA adapters: OUT_DIR/export "
                        "of a ds4sci train run with task.method=lora")
    parser.add_argument("out", metavar="OUT", help="directory to write (config.json, model.safetensors, "
                        "tokenizer.json, task.json, head.safetensors); refused when it holds files, unless --overwrite")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into a non-empty OUT, replacing the files of the same names")


def run(args: argparse.Namespace) -> int:
    from ds4sci.io.task_model import merge_task_model

    out = merge_task_model(args.export, args.out, overwrite=args.overwrite)
    logger.info("wrote %s: the adapters merged into a plain export with its task head", out)
    return 0
