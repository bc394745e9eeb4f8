"""``ds4sci train [CONFIG.yaml] [--set key=value ...] [--print-config] [--resume CHECKPOINT]``."""
from __future__ import annotations

import argparse
import logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("Every key, its default and its meaning: ds4sci train --print-config. Relative paths in a "
                     "config file are taken from that file's folder; those given with --set from the working "
                     "directory.")
    parser.add_argument("config", nargs="?", help="YAML config (see examples/configs/); defaults if omitted")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config key, e.g. --set train.steps=10 (repeat for more; "
                        "model.overrides.FIELD sets a GenSLMConfig field)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (file, --set, defaults) with each key's description as "
                        "YAML and exit")
    parser.add_argument("--resume", help="checkpoint directory (.../checkpoints/stepN) to resume from")


def run(args: argparse.Namespace) -> int:
    from ds4sci.train.checkpoint import load_checkpoint
    from ds4sci.train.config import load_config
    from ds4sci.train.trainer import Trainer

    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        print(cfg.to_yaml(), end="")
        return 0
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
