"""``ds4sci bench finetune``: the linear probe, LoRA and full fine-tuning side by side on a labelled binary task (by
default the bundled coding versus intergenic windows, ``examples/data/ecoli_coding_windows.tsv``): test AUROC,
trainable parameters, optimizer-state bytes and time.

The model: ``--init-from`` (a ds4sci export or anything ``model.init_from`` reads), or else a GenSLM of the
``--hidden`` / ``--layers`` / ``--heads`` shape drawn from ``--seed`` with no pre-training (then the figures show the
workflow, not biology). The records: the file's own splits (``--per-class`` records of each class per split, from
the file's start, when not 0). The three ways, each on the same records and base weights:

- ``probe``: :mod:`ds4sci.infer.probe` (mean-pooled final states, ``LogisticRegressionCV`` with ``--folds``);
  trainable parameters: the logistic model's weights and intercept; its optimizer (lbfgs) state is not counted;
- ``lora`` and ``full``: ``ds4sci train`` with a ``task:`` section (:class:`ds4sci.train.finetune.FineTuner`),
  last-token pooling, ``--steps`` steps of ``--batch`` records, LoRA rank ``--lora-r`` on the attention and MLP
  projections; optimizer bytes: the tensors of AdamW's state (first and second moments, step) after the run.

The fine-tunes run in one worker process (a process group of one, :func:`ds4sci.spawn.run_workers`) so the
benchmark's own process holds none. Times are wall and CPU seconds of the fitting (probe: features and fit;
fine-tunes: ``FineTuner.train``, its one validation and the test split at the end included). Writes
``finetune.json``, ``.md`` and ``.png`` to ``--out``.
"""
from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from pathlib import Path

from ds4sci.bench.report import add_int_options
from ds4sci.bench.report import check_heads
from ds4sci.bench.report import check_positive
from ds4sci.bench.report import command_line
from ds4sci.bench.report import describe_machine
from ds4sci.bench.report import int_config
from ds4sci.bench.report import machine
from ds4sci.bench.report import markdown_table
from ds4sci.bench.report import plural
from ds4sci.bench.report import save_figure
from ds4sci.bench.report import shape_options
from ds4sci.bench.report import subplots
from ds4sci.bench.report import write_files

logger = logging.getLogger(__name__)

METHODS = ("probe", "lora", "full")
BUNDLED_TASK = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                            "examples", "data", "ecoli_coding_windows.tsv")
_INT_OPTIONS = {
    "per_class": (0, "records of each class per split from the file's start; 0: all"),
    "seq_len": (256, "tokens per record (data.seq_len: at least the longest record)"),
} | shape_options(hidden=64, layers=2, heads=4) | {
    "steps": (150, "fine-tuning steps"),
    "batch": (16, "records per fine-tuning step"),
    "lora_r": (8, "LoRA rank"),
    "folds": (5, "the probe's cross-validation folds"),
    "threads": (1, "torch threads"),
}
_QUICK = {"per_class": 8, "hidden": 32, "layers": 1, "heads": 2, "steps": 3, "batch": 4, "folds": 2}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The task, model and run options (``--out`` is added by :mod:`ds4sci.bench`)."""
    add_int_options(parser, _INT_OPTIONS, _QUICK)
    parser.add_argument("--data", default=BUNDLED_TASK, help="a labelled binary TSV/CSV or FASTA with given splits "
                        "(default: the bundled coding windows)")
    parser.add_argument("--init-from", default="", help="the base model (a ds4sci export, a transformers directory, "
                        "a GenSLM checkpoint); default: a GenSLM of --hidden/--layers/--heads drawn from --seed")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the drawn model and the runs (default: 0)")


def config_from_args(args: argparse.Namespace) -> dict:
    """The run configuration (``--quick`` overriding the options), checked; ``ValueError`` names a bad value."""
    cfg = int_config(args, _INT_OPTIONS, _QUICK) | {"data": args.data, "init_from": args.init_from, "lr": args.lr,
                                                    "seed": args.seed}
    check_positive(cfg, [name for name in _INT_OPTIONS if name != "per_class"])
    check_heads(cfg["hidden"], cfg["heads"])
    if cfg["per_class"] < 0:
        raise ValueError(f"--per-class={cfg['per_class']}: must be >= 0")
    if cfg["folds"] < 2:
        raise ValueError(f"--folds={cfg['folds']}: cross-validation needs at least 2")
    if not cfg["lr"] > 0:
        raise ValueError(f"--lr={cfg['lr']}: must be > 0")
    for option, path in (("--data", cfg["data"]), ("--init-from", cfg["init_from"])):
        if path and not os.path.exists(path):
            raise ValueError(f"{option} {path}: no such file or directory")
    return cfg


def task_table(cfg: dict, path: Path) -> dict[str, int]:
    """Write the benchmark's records (``cfg["data"]``, ``per_class`` of each class per split) to the TSV ``path``;
    the records per split. ``ValueError``: not a binary task with train, validation and test records."""
    from ds4sci.data.labels import SPLITS
    from ds4sci.data.labels import read_labelled

    data = read_labelled(cfg["data"], "binary")
    if data.split_rule != "given":
        raise ValueError(f"--data {cfg['data']}: the benchmark needs given splits (a split column or split= headers)")
    rows, counts = ["id\tsequence\tlabel\tsplit"], {}
    for split in SPLITS:
        records = data.split(split)
        if cfg["per_class"]:
            records = [r for c in (0, 1) for r in [r for r in records if r.target == c][: cfg["per_class"]]]
        if not records:
            raise ValueError(f"--data {cfg['data']}: no {split} records")
        rows += [f"{r.id}\t{r.sequence}\t{data.classes[r.target]}\t{split}" for r in records]
        counts[split] = len(records)
    path.write_text("\n".join(rows) + "\n")
    return counts


def base_model(cfg: dict, folder: Path) -> str:
    """The base model's path: ``--init-from``, or a GenSLM of the configured shape drawn and exported to ``folder``."""
    if cfg["init_from"]:
        return cfg["init_from"]
    import torch

    from ds4sci.data import NucleotideTokenizer
    from ds4sci.io.export import export_consolidated
    from ds4sci.models.genslm import GenSLM
    from ds4sci.models.genslm import GenSLMConfig

    torch.manual_seed(cfg["seed"])
    tok = NucleotideTokenizer()
    config = GenSLMConfig.preset("debug", vocab_size=tok.vocab_size, hidden_size=cfg["hidden"],
                                 num_layers=cfg["layers"], num_heads=cfg["heads"],
                                 max_position_embeddings=max(512, cfg["seq_len"]))
    return str(export_consolidated(GenSLM(config).state_dict(), config, tok, folder))


def _clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(start: tuple[float, float]) -> dict[str, float]:
    wall, cpu = _clocks()
    return {"wall_s": round(wall - start[0], 2), "cpu_s": round(cpu - start[1], 2)}


def run_probe(cfg: dict, base: str, table: Path) -> dict:
    """The probe's row: test and validation AUROC, trainable parameters, time."""
    from ds4sci.data.labels import read_labelled
    from ds4sci.infer.probe import fit_probe
    from ds4sci.infer.probe import probe_features
    from ds4sci.io.weights import load_model

    model, config, tok = load_model(base, "cpu")
    data = read_labelled(table, "binary")
    start = _clocks()
    features = {s: probe_features(model, tok, data.split(s), "binary", seq_len=cfg["seq_len"])
                for s in ("train", "validation", "test")}
    result = fit_probe(data, features, folds=cfg["folds"], seed=cfg["seed"])
    return {"method": "probe", "test_auroc": result.metrics["test"]["auroc"],
            "validation_auroc": result.metrics["validation"]["auroc"], "trainable_parameters": config.hidden_size + 1,
            "optimizer_bytes": None} | _since(start)


def optimizer_bytes(engine) -> int:
    """Bytes of the tensors in the state of the torch optimizer inside ``engine`` (DeepSpeed wraps it)."""
    import torch

    opt = engine.optimizer
    while not isinstance(opt, torch.optim.Optimizer):
        opt = opt.optimizer
    return sum(t.numel() * t.element_size() for state in opt.state.values() for t in state.values()
               if torch.is_tensor(t))


def run_finetune(cfg: dict, base: str, table: Path, method: str, out: Path) -> dict:
    """The row of ``method`` (``lora`` or ``full``): ``ds4sci train`` with a ``task:`` section, in this process."""
    import json

    from ds4sci.train.config import load_config
    from ds4sci.train.finetune import FineTuner

    sets = ["task.kind=binary", f"task.data={table}", "task.pooling=last", f"task.method={method}",
            "task.lora_targets=[attention,mlp]", f"task.lora_r={cfg['lora_r']}", f"task.lora_alpha={2 * cfg['lora_r']}",
            f"model.init_from={base}", f"data.seq_len={cfg['seq_len']}", f"train.micro_batch_size={cfg['batch']}",
            f"train.steps={cfg['steps']}", "train.eval_every=0", "train.eval_batches=1000",
            f"train.log_every={max(1, cfg['steps'] // 10)}", "train.progress=false", f"train.seed={cfg['seed']}",
            f"train.out_dir={out / method}", f"optim.lr={cfg['lr']}", f"optim.min_lr={cfg['lr'] / 10}",
            f"optim.warmup_steps={min(10, cfg['steps'] // 10)}"]
    trainer = FineTuner(load_config(None, sets))
    start = _clocks()
    trainer.train()
    clocks = _since(start)
    metrics = json.loads((out / method / "metrics.json").read_text())
    return {"method": method, "test_auroc": metrics["test"]["auroc"],
            "validation_auroc": metrics["validation"]["auroc"],
            "trainable_parameters": trainer.trainable_parameters, "parameters": trainer.num_parameters,
            "optimizer_bytes": optimizer_bytes(trainer.engine)} | clocks


def _worker(rank: int, world: int, cfg: dict, tmp: str) -> list[dict]:
    folder = Path(tmp)
    base = base_model(cfg, folder / "base")
    rows = [run_probe(cfg, base, folder / "task.tsv")]
    rows += [run_finetune(cfg, base, folder / "task.tsv", method, folder / "runs") for method in ("lora", "full")]
    rows[0]["parameters"] = rows[-1]["parameters"]
    return rows


def measure(cfg: dict) -> dict:
    """The records (checked here: a bad file is one error line) and the three rows, measured in one worker process
    (module docstring)."""
    from ds4sci.spawn import run_workers

    with tempfile.TemporaryDirectory(prefix="ds4sci-bench-finetune-") as tmp:
        records = task_table(cfg, Path(tmp) / "task.tsv")
        rows = run_workers(_worker, 1, cfg, tmp, timeout=6 * 3600, env={"DS_ACCELERATOR": "cpu"},
                           threads=cfg["threads"])[0]
    return {"records": records, "rows": rows}


def _bytes(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def markdown(report: dict) -> str:
    """The Markdown summary of a finetune report."""
    c, n = report["config"], report["records"]
    model = (f"`{c['init_from']}`" if c["init_from"] else
             f"a GenSLM drawn at random (no pre-training): hidden {c['hidden']}, {plural(c['layers'], 'layer')}, "
             f"{plural(c['heads'], 'head')}")
    rows = [[r["method"], f"{r['test_auroc']:.3f}", f"{r['validation_auroc']:.3f}",
             f"{r['trainable_parameters']:,} of {r['parameters']:,}", _bytes(r["optimizer_bytes"]),
             f"{r['wall_s']:.1f}", f"{r['cpu_s']:.1f}"] for r in report["rows"]]
    lines = [
        "# finetune: the linear probe, LoRA and full fine-tuning side by side",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Task: `{os.path.basename(c['data'])}`, {n['train']} train / {n['validation']} validation / {n['test']} test "
        f"records. Model: {model}. Probe: mean-pooled final states, logistic regression with {c['folds']}-fold "
        f"cross-validation. Fine-tunes: last-token pooling, {c['steps']} steps of {c['batch']} records, AdamW lr "
        f"{c['lr']:g}; LoRA rank {c['lora_r']} on the attention and MLP projections. fp32 on the CPU, "
        f"{plural(c['threads'], 'torch thread')}; torch {report['versions']['torch']}, peft "
        f"{report['versions']['peft']}. Machine: {describe_machine(report['machine'])}.",
        "",
        *markdown_table(("method", "test AUROC", "validation AUROC", "trainable parameters", "optimizer bytes",
                         "wall s", "CPU s"), rows),
    ]
    return "\n".join(lines) + "\n"


def plot(report: dict, path) -> None:
    """Test AUROC and CPU seconds per method, each bar labelled with its trainable parameters."""
    rows = report["rows"]
    names = [r["method"] for r in rows]
    fig, (left, right) = subplots(1, 2, figsize=(9, 4))
    colors = ["tab:gray", "tab:blue", "tab:orange"]
    left.bar(names, [r["test_auroc"] for r in rows], color=colors)
    left.set_ylim(0.5, 1.0)
    left.set_ylabel("test AUROC")
    right.bar(names, [r["cpu_s"] for r in rows], color=colors)
    right.set_ylabel("CPU seconds")
    for i, r in enumerate(rows):
        left.text(i, r["test_auroc"], f"{r['test_auroc']:.3f}", ha="center", va="bottom", fontsize="small")
        right.text(i, r["cpu_s"], f"{r['trainable_parameters']:,} trained", ha="center", va="bottom",
                   fontsize="small")
    fig.suptitle(f"{os.path.basename(report['config']['data'])}: probe, LoRA and full fine-tuning")
    save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    """``ds4sci bench finetune``."""
    import peft
    import torch

    cfg = config_from_args(args)
    shown = {k: v for k, v in cfg.items() if v != ""}  # no --init-from: the drawn model
    report = {"command": command_line("finetune", shown, args.out), "config": cfg, "machine": machine(),
              "versions": {"torch": torch.__version__, "peft": peft.__version__}} | measure(cfg)
    write_files(args.out, "finetune", report, markdown(report), plot)
    return 0
