"""``ds4sci train CONFIG.yaml [--set key=value ...] [--resume CHECKPOINT]``."""
from __future__ import annotations

import argparse
import logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML config (see examples/configs/); defaults if omitted")
    parser.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[],
                        metavar="KEY=VALUE", help="override config keys, e.g. --set train.steps=10 optim.lr=1e-3 "
                        "(repeatable)")
    parser.add_argument("--resume", help="checkpoint directory (.../checkpoints/stepN) to resume from")


def run(args: argparse.Namespace) -> int:
    from ds4sci.train.checkpoint import load_checkpoint
    from ds4sci.train.config import load_config
    from ds4sci.train.trainer import Trainer

    cfg = load_config(args.config, args.overrides)
    trainer = Trainer(cfg)
    if trainer.rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    if args.resume:
        load_checkpoint(trainer, args.resume)
    records = trainer.train()
    if trainer.rank == 0:
        last = [r for r in records if "val_bits_per_base" in r]
        if last:
            logging.getLogger(__name__).info("final validation: %.4f bits/base", last[-1]["val_bits_per_base"])
    return 0
