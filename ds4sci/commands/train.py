"""``ds4sci train [CONFIG.yaml] [--set key=value ...] [--print-config] [--resume [CHECKPOINT | auto] | --overwrite]``.

A run never mixes with another in ``train.out_dir``: a folder that holds a run is refused unless ``--resume``
continues it or ``--overwrite`` replaces it (:mod:`ds4sci.train.run_dir` has the rules)."""
from __future__ import annotations

import argparse
import logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ds4sci.train.resume_keys import MAY_CHANGE  # the --resume rule, stated where it is enforced

    parser.epilog = ("Every key, its default and its meaning: ds4sci train --print-config. Relative paths in a "
                     "config file are taken from that file's folder; those given with --set from the working "
                     "directory. train.out_dir must be empty or missing unless --resume or --overwrite is given.")
    parser.add_argument("config", nargs="?", help="YAML config (see examples/configs/); defaults if omitted")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config key, e.g. --set train.steps=10 (repeat for more; "
                        "model.overrides.FIELD sets a GenSLMConfig field)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (file, --set, defaults) with each key's description as "
                        "YAML and exit")
    existing = parser.add_mutually_exclusive_group()
    existing.add_argument("--resume", nargs="?", const="", metavar="CHECKPOINT",
                          help="continue the run in train.out_dir from its newest complete checkpoint, or from "
                          "CHECKPOINT (.../checkpoints/stepN: the newest of train.out_dir's run, or any when "
                          "train.out_dir is empty); metrics.jsonl continues from the checkpoint's step. --resume auto: "
                          "continue when the run has a checkpoint, else start it (the one command line for a job that "
                          "restarts: torchrun --max-restarts, a scheduler's requeue; a folder named auto: ./auto). "
                          f"Only {', '.join(MAY_CHANGE)} may change, at the same global batch "
                          "(train.micro_batch_size x dp x train.grad_accum)")
    existing.add_argument("--overwrite", action="store_true",
                          help="replace the run in train.out_dir: delete it (all but token_cache/) first; a folder "
                          "that holds no ds4sci run (config.yaml) is never deleted")


def run(args: argparse.Namespace) -> int:
    from ds4sci.train.config import load_config

    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        print(cfg.to_yaml(), end="")
        return 0
    if cfg.task.kind:  # a task: section: fine-tuning on labelled records (ds4sci.train.finetune)
        from ds4sci.train.finetune import FineTuner as Trainer
    else:
        from ds4sci.train.trainer import Trainer  # after --print-config: DeepSpeed's import prints to stdout

    trainer = Trainer(cfg, resume=args.resume, overwrite=args.overwrite)
    records = trainer.train()
    if trainer.rank == 0:
        last = [r for r in records if "val_bits_per_base" in r]
        if last:
            logging.getLogger(__name__).info("final validation: %.4f bits/base", last[-1]["val_bits_per_base"])
    return 0
