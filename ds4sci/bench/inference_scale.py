"""``ds4sci bench inference-scale``: records scored per second on a corpus of mixed lengths, one window at a time,
bucketed by length, packed, and with transformers' batched forward.

The corpus: the bundled genes (``examples/data/NZ_CP040672.1_cds_100.fna``, ``--genes`` of them) and ``--pieces``
pieces of the bundled genome of random lengths (``--min-bases`` to ``--max-bases``), shuffled together. The model
is a randomly initialised GPT-NeoX-shaped GenSLM and Hugging Face's ``GPTNeoXForCausalLM`` holding the same weights
(:func:`ds4sci.bench.throughput.build_models`; speed does not depend on the weights), its context ``--context``
tokens, the window; ds4sci's attention backend is its default (``auto``: on the CPU, PyTorch's fused causal kernel
for inference, :func:`~ds4sci.kernels.local_attention.select_backend`), transformers' ``sdpa``. Four ways to score
every record (:func:`ds4sci.infer.score.score_records` for ds4sci's):

- ``one``: each window alone in its forward, one forward after the other (what a loop over records does);
- ``bucketed``: windows sorted by length, batched to ``--max-tokens`` tokens (padding counted), no packing; with
  ``--threads`` above 1, that many batches read at once, one thread each
  (:meth:`~ds4sci.infer.parallel.ShardedForward.map_batches`, what ``ds4sci score`` does on the CPU);
- ``packed``: as ``bucketed``, and short records packed several to a row with document masks;
- ``hf``: ``GPTNeoXForCausalLM`` over the windows in file order, ``--max-tokens / --context`` windows per forward
  padded to the longest (attention mask), the per-record sums taken from its logits.

Every way runs with ``--threads`` torch threads (default: this machine's cores, as ``ds4sci score`` would).
Every way's log-likelihoods must agree with ``one``'s (a guard: a speed-up that changed the numbers says nothing).
Each round times all four, the order reversed every round (:mod:`ds4sci.bench.rounds`); records/s on the wall and
CPU clocks, with the medians and the ratios to ``one`` and to ``hf``. Writes ``inference_scale.json``, ``.md`` and
``.png`` to ``--out``.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
from typing import TYPE_CHECKING

import numpy as np

from ds4sci.bench.report import add_int_options
from ds4sci.bench.report import check_heads
from ds4sci.bench.report import check_positive
from ds4sci.bench.report import describe_machine
from ds4sci.bench.report import describe_shape
from ds4sci.bench.report import int_config
from ds4sci.bench.report import machine
from ds4sci.bench.report import markdown_table
from ds4sci.bench.report import plural
from ds4sci.bench.report import save_figure
from ds4sci.bench.report import shape_options
from ds4sci.bench.report import subplots
from ds4sci.bench.report import usable_cores
from ds4sci.bench.report import versions
from ds4sci.bench.rounds import CLOCKS
from ds4sci.bench.rounds import alternate
from ds4sci.bench.rounds import round_options
from ds4sci.bench.rounds import torch_threads
from ds4sci.bench.rounds import write_rounds
from ds4sci.bench.throughput import transformers_importable

if TYPE_CHECKING:  # the others are imported where used: ``ds4sci bench inference-scale --help`` imports no torch
    from ds4sci.data import FastaRecord

MODES = ("one", "bucketed", "packed", "hf")
#: guard: every way's record log-likelihoods within this of one window at a time's, nats
LL_ATOL = 1e-2
_INT_OPTIONS = {
    "genes": (100, "bundled genes in the corpus"),
    "pieces": (60, "pieces of the bundled genome in the corpus"),
    "min_bases": (20, "shortest genome piece"),
    "max_bases": (2000, "longest genome piece"),
    "context": (256, "model context in tokens, the window"),
} | shape_options(hidden=64, layers=2, heads=4) | {
    "max_tokens": (4096, "tokens per forward (bucketed, packed; hf: max_tokens / context windows)"),
} | round_options(3, "each times the four ways") | {
    "threads": (usable_cores(), "torch threads, every way (default: this machine's cores)"),
}
_QUICK = {"genes": 8, "pieces": 8, "max_bases": 300, "context": 64, "hidden": 32, "layers": 1, "heads": 2,
          "max_tokens": 512, "rounds": 2}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload, shape and run options (``--out`` is added by :mod:`ds4sci.bench`)."""
    add_int_options(parser, _INT_OPTIONS, _QUICK)
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the pieces (default: %(default)s)")


def config_from_args(args: argparse.Namespace) -> dict:
    """The run configuration (``--quick`` overriding the options), checked; ``ValueError`` names a bad value."""
    cfg = int_config(args, _INT_OPTIONS, _QUICK) | {"seed": args.seed}
    check_positive(cfg, _INT_OPTIONS)
    check_heads(cfg["hidden"], cfg["heads"])
    if cfg["min_bases"] > cfg["max_bases"]:
        raise ValueError(f"--min-bases {cfg['min_bases']} is above --max-bases {cfg['max_bases']}")
    return cfg


def corpus(cfg: dict) -> list[FastaRecord]:
    """``genes`` bundled genes and ``pieces`` random pieces of the bundled genome, shuffled (seeded)."""
    from ds4sci.data import FastaRecord
    from ds4sci.data import read_fasta
    from ds4sci.train.config import BUNDLED_GENOME

    rng = random.Random(cfg["seed"])
    genes = list(read_fasta(os.path.join(os.path.dirname(BUNDLED_GENOME), "NZ_CP040672.1_cds_100.fna")))
    genes = genes[: cfg["genes"]]
    genome = next(iter(read_fasta(BUNDLED_GENOME))).sequence
    pieces = []
    for i in range(cfg["pieces"]):
        n = rng.randint(cfg["min_bases"], cfg["max_bases"])
        start = rng.randrange(len(genome) - n)
        pieces.append(FastaRecord(f"piece{i}", "", genome[start : start + n]))
    records = genes + pieces
    rng.shuffle(records)
    return records


def hf_scores(hf, tokenizer, records, context: int, batch: int) -> list[float]:
    """Each record's log-likelihood (nats) through Hugging Face's model: the windows of ``context`` tokens in file
    order, ``batch`` per forward padded to the longest (attention mask, positions from 0 in each window)."""
    import torch

    from ds4sci.infer.evaluate import record_windows

    windows = [(r, w) for r, rec in enumerate(records) for w in record_windows(tokenizer.encode(rec.sequence), context)]
    totals = np.zeros(len(records))
    with torch.no_grad():
        for start in range(0, len(windows), batch):
            chunk = windows[start : start + batch]
            width = max(len(w.ids) for _, w in chunk)
            ids = torch.full((len(chunk), width), tokenizer.pad_id)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for b, (_, w) in enumerate(chunk):
                ids[b, : len(w.ids)] = torch.from_numpy(w.ids)
                mask[b, : len(w.ids)] = 1
            logits = hf(input_ids=ids, attention_mask=mask,
                        position_ids=torch.arange(width).expand_as(ids)).logits  # [b, T, V]
            logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]  # [b, T-1]
            logp = (logp * mask[:, 1:]).sum(1).double()
            for (r, _), value in zip(chunk, logp.tolist()):
                totals[r] += value
    return totals.tolist()


def measure(cfg: dict) -> dict:
    """Build the corpus and the models, check the four ways agree, then time them ``cfg["rounds"]`` times."""
    from ds4sci.bench import throughput
    from ds4sci.data import NucleotideTokenizer
    from ds4sci.infer.evaluate import record_windows
    from ds4sci.infer.parallel import ShardedForward
    from ds4sci.infer.score import score_records

    records = corpus(cfg)
    tok = NucleotideTokenizer()
    ours, hf = throughput.build_models({"shape": "gpt-neox", "kv_heads": 0, "seq_len": cfg["context"],
                                        "rotary_pct": 0.25, "hf_attention": "sdpa", "attention_backend": "auto"} | cfg)
    ours, hf = ours.eval(), hf.eval()
    context, budget = cfg["context"], cfg["max_tokens"]

    runners = {"one": ShardedForward(ours, workers=1), "bucketed": ShardedForward(ours),
               "packed": ShardedForward(ours)}

    def ours_run(mode: str, max_tokens: int, pack: bool):
        return lambda: [r["log_likelihood"] for r in score_records(ours, tok, records, context, max_tokens=max_tokens,
                                                                   pack=pack, runner=runners[mode])]

    runs = {"one": ours_run("one", 1, False), "bucketed": ours_run("bucketed", budget, False),
            "packed": ours_run("packed", budget, True),
            "hf": lambda: hf_scores(hf, tok, records, context, max(1, budget // context))}
    with torch_threads(cfg["threads"]):
        in_flight = {mode: runner.batch_workers() for mode, runner in runners.items()}
        scores = {mode: run() for mode, run in runs.items()}  # warm-up, and the guard's numbers
        diff = {mode: float(np.abs(np.subtract(scores[mode], scores["one"])).max()) for mode in MODES}
        if max(diff.values()) > LL_ATOL:
            raise RuntimeError(f"the ways disagree with one window at a time: max |difference| {diff} > {LL_ATOL}")
        rounds = alternate(runs, dict.fromkeys(MODES, len(records)), cfg["rounds"], "records")
    windows = [w for rec in records for w in record_windows(tok.encode(rec.sequence), context)]
    lengths = [len(rec.sequence) for rec in records]
    return {"records": len(records), "windows": len(windows), "tokens": int(sum(lengths)),
            "lengths": {"min": min(lengths), "median": statistics.median(lengths), "max": max(lengths)},
            "batches_in_flight": in_flight, "check": {"max_abs_ll_diff": diff, "ll_atol": LL_ATOL}, "rounds": rounds}


def summarize(rounds: list[dict]) -> dict:
    """Medians over ``rounds`` (of one clock) of records/s per way and of the per-round ratios to ``one`` and
    ``hf``."""
    out = {f"{mode}_records_per_s_median": statistics.median(r[mode] for r in rounds) for mode in MODES}
    for base in ("one", "hf"):
        out |= {f"{mode}_over_{base}_median": statistics.median(r[mode] / r[base] for r in rounds) for mode in MODES
                if mode != base}
    return out


def markdown(report: dict) -> str:
    """The Markdown summary of an inference-scale report."""
    c, s, n = report["config"], report["summary"], report["lengths"]
    rows = [[i, *[f"{r[clock][mode]:.2f}" for clock in CLOCKS for mode in MODES]]
            for i, r in enumerate(report["rounds"])]
    rows.append(["median", *[f"{s[clock][f'{mode}_records_per_s_median']:.2f}" for clock in CLOCKS for mode in MODES]])
    ratios = [[mode, *[f"{s[clock][f'{mode}_over_{base}_median']:.2f}" if mode != base else "1"
                       for base in ("one", "hf") for clock in CLOCKS]] for mode in MODES]
    lines = [
        "# inference-scale: records per second on a corpus of mixed lengths",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Corpus: {plural(c['genes'], 'bundled gene')} and {plural(c['pieces'], 'genome piece')} of "
        f"{c['min_bases']}-{c['max_bases']} bases, shuffled: {report['records']} records, {report['tokens']:,} bases "
        f"(min {n['min']}, median {n['median']:.0f}, max {n['max']}), {report['windows']} windows of up to "
        f"{c['context']}. Random GPT-NeoX-shaped GenSLM and GPTNeoXForCausalLM with the same weights: "
        f"{describe_shape(c)}; attention: ds4sci's default (auto), transformers' sdpa; fp32 on the CPU, "
        f"{plural(c['threads'], 'torch thread')}; {c['max_tokens']} tokens per forward, bucketed and packed reading "
        f"{plural(report['batches_in_flight']['packed'], 'batch', 'batches')} at once (one thread each). torch "
        f"{report['versions']['torch']}, transformers {report['versions']['transformers']}. Machine: "
        f"{describe_machine(report['machine'])}. Log-likelihoods checked against one window at a time: max "
        f"|difference| {max(report['check']['max_abs_ll_diff'].values()):.1e} nats.",
        "",
        *markdown_table(("round", *[f"{mode} records/{'s' if clock == 'wall' else 'CPU-s'}" for clock in CLOCKS
                                    for mode in MODES]), rows),
        "",
        *markdown_table(("way", "/ one (wall)", "/ one (CPU)", "/ hf (wall)", "/ hf (CPU)"), ratios),
        "",
        f"Records per second: packed **{s['wall']['packed_over_one_median']:.2f}x** one window at a time and "
        f"**{s['wall']['packed_over_hf_median']:.2f}x** transformers' batched forward, bucketed "
        f"{s['wall']['bucketed_over_one_median']:.2f}x and {s['wall']['bucketed_over_hf_median']:.2f}x; per CPU "
        f"second packed {s['cpu']['packed_over_one_median']:.2f}x and {s['cpu']['packed_over_hf_median']:.2f}x, "
        f"bucketed {s['cpu']['bucketed_over_one_median']:.2f}x and {s['cpu']['bucketed_over_hf_median']:.2f}x "
        f"(medians over {plural(len(report['rounds']), 'round')}, {plural(c['threads'], 'torch thread')}).",
    ]
    return "\n".join(lines) + "\n"


def plot(report: dict, path) -> None:
    """Records per second (wall clock) of each way, per round and the median."""
    fig, ax = subplots(1, 1, figsize=(7, 4.5))
    medians = [report["summary"]["wall"][f"{mode}_records_per_s_median"] for mode in MODES]
    ax.bar(MODES, medians, color=["tab:gray", "tab:orange", "tab:blue", "tab:green"])
    for i, mode in enumerate(MODES):
        ax.scatter([i] * len(report["rounds"]), [r["wall"][mode] for r in report["rounds"]], color="black", s=10)
    ax.set_ylabel(f"records per second, {plural(report['config']['threads'], 'torch thread')}")
    ax.set_title(f"{report['records']} records of mixed length, window {report['config']['context']}")
    save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    """``ds4sci bench inference-scale``: exit status 1, with one error line, when transformers is not importable."""
    cfg = config_from_args(args)
    if not transformers_importable("inference-scale"):
        return 1
    write_rounds("inference-scale", cfg, args.out, {"machine": machine(),
                 "versions": versions("torch", "transformers")}, measure(cfg), summarize, markdown, plot)
    return 0
