"""``ds4sci probe MODEL --data FILE --kind KIND --out DIR``: a linear probe on the model's frozen embeddings
(:mod:`ds4sci.infer.probe`) of labelled records (:mod:`ds4sci.data.labels`), fitted on the train split with
cross-validated regularisation; the validation and test metrics go to ``DIR/metrics.json`` (``{"validation": {...},
"test": {...}}``, :mod:`ds4sci.data.metrics`), the settings to ``DIR/probe.json`` and a short table to stdout."""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from ds4sci.cli_args import CommandError
from ds4sci.cli_args import add_device_argument
from ds4sci.cli_args import add_model_argument
from ds4sci.cli_args import positive_int
from ds4sci.commands.embed import layer
from ds4sci.commands.inference import add_reading_arguments
from ds4sci.commands.inference import load_reader

logger = logging.getLogger(__name__)

KINDS = ("binary", "multiclass", "multilabel", "regression", "token")  # ds4sci.data.labels.KINDS, without its import
SPLITS = ("train", "validation", "test")


def data_argument(text: str) -> tuple[str | None, str]:
    """argparse ``type=``: ``PATH`` or ``SPLIT=PATH`` (every record of the file in that split)."""
    split, sep, path = text.partition("=")
    if sep and split in SPLITS:
        return split, path
    return None, text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    add_device_argument(parser)
    parser.add_argument("--data", type=data_argument, action="append", required=True, metavar="[SPLIT=]FILE",
                        help="labelled records: a FASTA with labels in its headers (>id label=1 split=test), a TSV/CSV "
                        "with columns id, sequence, label (and split), or with --fasta a table of id, label; repeat "
                        "as train=FILE, test=FILE ... for files that each hold one split. Without splits, records "
                        "are split by a hash of their id (10%% validation, 10%% test)")
    parser.add_argument("--fasta", help="the sequences of a --data table keyed by id")
    parser.add_argument("--bed", help="BED intervals labelling the bases of the --data FASTA (kind token)")
    parser.add_argument("--kind", choices=KINDS, default="binary", help="the task (default: %(default)s)")
    parser.add_argument("--classes", type=lambda text: text.split(","), default=None, metavar="A,B,...",
                        help="class names in index order (binary: negative,positive; default: sorted from the train "
                        "split, binary 0,1)")
    parser.add_argument("--layer", type=layer, default=None, metavar="K",
                        help="the states probed: 'final' (the final norm's output, the default), or block K's output "
                        "(0: the token and position embeddings)")
    parser.add_argument("--pool", choices=("mean", "last"), default="mean",
                        help="a record's feature: the mean of its tokens' states or its last token's (default: "
                        "%(default)s; a token task probes every base's state)")
    parser.add_argument("--folds", type=positive_int, default=5,
                        help="cross-validation folds choosing the regularisation (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the cross-validation folds (default: 0)")
    parser.add_argument("--out", default="runs/probe", help="output folder for metrics.json and probe.json (default: "
                        "%(default)s; made if missing)")
    add_reading_arguments(parser)


def _table(metrics: dict[str, dict[str, float]]) -> str:
    """Summary metrics (names without a ``/``) by split, one row per metric."""
    splits = list(metrics)
    names = [k for k in metrics[splits[-1]] if "/" not in k]
    width = max(map(len, names))
    lines = [f"{'':<{width}}  " + "  ".join(f"{s:>10}" for s in splits)]
    for name in names:
        cells = [f"{int(metrics[s][name]):>10}" if name == "n" else f"{metrics[s][name]:>10.4f}" for s in splits]
        lines.append(f"{name:<{width}}  " + "  ".join(cells))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from ds4sci.data.labels import LabelSource
    from ds4sci.data.labels import read_labelled
    from ds4sci.data.metrics import write_metrics
    from ds4sci.infer.probe import fit_probe
    from ds4sci.infer.probe import probe_features

    if args.bed is not None and args.kind != "token":
        raise CommandError(f"--bed labels bases: use it with --kind token, not --kind {args.kind}")
    if args.bed is not None and args.fasta is not None:
        raise CommandError("--bed labels the bases of the --data FASTA: give --bed or --fasta, not both")
    sources = [LabelSource(path, fasta=args.fasta, bed=args.bed, split=split) for split, path in args.data]
    data = read_labelled(sources, args.kind, classes=args.classes)

    def check_layer(config, tokenizer) -> None:
        if args.layer is not None and args.layer > config.num_layers:
            raise CommandError(f"--layer {args.layer}: the model has blocks 0..{config.num_layers} (0: the embeddings)")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, config, tokenizer, runner = load_reader(args, check=check_layer)
    features = {split: probe_features(model, tokenizer, data.split(split), data.kind, pool=args.pool,
                                      layer=args.layer, seq_len=args.seq_len, stride=args.stride,
                                      batch_size=args.batch_size, progress=not args.no_progress, runner=runner)
                for split in SPLITS if data.split(split)}
    if not runner.is_writer:  # rank 0 fits and writes
        return 0
    result = fit_probe(data, features, folds=args.folds, seed=args.seed)
    write_metrics(out / "metrics.json", result.metrics)
    settings = {"model": str(args.export), "kind": data.kind, "classes": list(data.classes),
                "layer": "final" if args.layer is None else args.layer, "pool": args.pool,
                "split_rule": data.split_rule, "records": {s: len(data.split(s)) for s in SPLITS},
                "fitted_on": result.train, "regularisation": result.regularisation,
                "estimator": "RidgeCV (alpha)" if data.kind == "regression" else "LogisticRegressionCV (C)"}
    (out / "probe.json").write_text(json.dumps(settings, indent=2) + "\n")
    print(_table(result.metrics))
    logger.info("wrote %s and %s", out / "metrics.json", out / "probe.json")
    return 0
