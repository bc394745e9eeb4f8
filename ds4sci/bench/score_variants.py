"""``ds4sci bench score-variants``: variants scored per second by ``ds4sci score-variants``
(:func:`ds4sci.infer.variants.score_variants`), with its REF windows shared and without.

The workload is a saturation-mutagenesis scan, the common zero-shot variant-effect use (every base of a region
mutated to the three others): ``--positions`` consecutive positions of the reference from ``--start`` (1-based),
3 SNVs each, written as a VCF and read back with :func:`~ds4sci.infer.variants.read_variants`. The model is a
randomly initialised nucleotide GenSLM of the given shape (speed does not depend on the weights), its context
``--context`` tokens, the REF window the whole context (``--context`` bases, as ``--window`` would ask).

Two ways to score the same variants, each one :func:`~ds4sci.infer.score.score_records` call over both strands:

- ``shared`` (what the command does): each distinct REF window once, plus one ALT window per variant; the 3 ALTs of
  a position share their REF window, so ``4/3`` windows per variant.
- ``unshared``: each variant's REF window scored for it alone, 2 windows per variant.

The LLRs of both must agree (``max_abs_llr_diff``, a guard: a speed-up that changed the numbers says nothing).
Each round times both (:mod:`ds4sci.bench.rounds`), the order swapped every round; variants/s = variants / seconds
on the wall and CPU clocks, reported per round and clock with the median and the median per-round ratio shared /
unshared, beside the ratio of windows scored (``2 / (4/3) = 1.5`` away from the record ends), the speed-up were time
proportional to windows.

Writes ``score_variants.json``, ``score_variants.md`` and ``score_variants.png`` to ``--out``.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

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
from ds4sci.bench.report import versions
from ds4sci.bench.rounds import CLOCKS
from ds4sci.bench.rounds import alternate
from ds4sci.bench.rounds import round_options
from ds4sci.bench.rounds import round_rows
from ds4sci.bench.rounds import torch_threads
from ds4sci.bench.rounds import write_rounds

MODES = ("shared", "unshared")
#: guard: the two modes' LLRs may differ by float rounding only (their windows are batched differently), nats
LLR_ATOL = 1e-3
#: option -> (default, help); every one must be >= 1
_INT_OPTIONS = {
    "positions": (64, "consecutive reference positions mutated, 3 SNVs each"),
    "start": (100_000, "1-based position of the first"),
    "context": (256, "model context in tokens, and the REF window in bases"),
} | shape_options(hidden=128, layers=4, heads=4) | {
    "batch_size": (8, "windows per forward"),
} | round_options(3, "each times both modes")
_QUICK = {"positions": 6, "context": 64, "hidden": 32, "layers": 1, "heads": 2, "batch_size": 8, "rounds": 2}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload, shape and run options (``--out`` is added by :mod:`ds4sci.bench`)."""
    add_int_options(parser, _INT_OPTIONS, _QUICK)
    parser.add_argument("--reference", default=None,
                        help="FASTA whose first record is mutated (default: the bundled E. coli K-12 genome)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights (default: %(default)s)")


def config_from_args(args: argparse.Namespace) -> dict:
    """The run configuration: the options (``--quick`` overriding them), checked; ``ValueError`` names a bad value."""
    from ds4sci.train.config import BUNDLED_GENOME

    cfg = int_config(args, _INT_OPTIONS, _QUICK) | {"reference": args.reference or BUNDLED_GENOME, "seed": args.seed}
    check_positive(cfg, _INT_OPTIONS)
    check_heads(cfg["hidden"], cfg["heads"])
    return cfg


def saturation_vcf(path: Path, chrom: str, sequence: str, start: int, positions: int) -> None:
    """Write a VCF of the 3 SNVs at each of ``positions`` positions of ``sequence`` from ``start`` (1-based);
    ``ValueError`` when the region runs past the record or holds a base other than A/C/G/T."""
    region = sequence[start - 1 : start - 1 + positions]
    if len(region) < positions:
        raise ValueError(f"--start {start} + --positions {positions} runs past {chrom} ({len(sequence)} bases)")
    if set(region) - set("ACGT"):
        raise ValueError(f"{chrom}:{start}-{start + positions - 1} holds bases other than A/C/G/T")
    lines = ["##fileformat=VCFv4.2", f"##contig=<ID={chrom},length={len(sequence)}>",
             "#CHROM\tPOS\tID\tREF\tALT\tQUAL\tFILTER\tINFO"]
    lines += [f"{chrom}\t{start + i}\t.\t{base}\t{','.join(b for b in 'ACGT' if b != base)}\t.\t.\t."
              for i, base in enumerate(region)]
    path.write_text("\n".join(lines) + "\n")


def unshared_llrs(model, tokenizer, reference: dict[str, str], variants, batch_size: int) -> list[float]:
    """The LLRs of ``variants`` with every variant's REF window scored for it alone (one ``score_records`` call)."""
    from ds4sci.data import FastaRecord
    from ds4sci.infer.score import score_records
    from ds4sci.infer.variants import variant_windows

    context = model.config.max_position_embeddings
    windows = variant_windows(reference, variants, context, context)
    records = [FastaRecord(f"ref{i}", "", reference[chrom][start:end])
               for i, (chrom, start, end) in enumerate(windows.keys[k] for k in windows.ref_of)]
    records += [FastaRecord(f"alt{i}", "", sequence) for i, sequence in enumerate(windows.alt)]
    scores = [r["log_likelihood"] for r in score_records(model, tokenizer, records, context, True,
                                                         batch_size=batch_size)]
    return [alt - ref for ref, alt in zip(scores[: len(variants)], scores[len(variants) :])]


def measure(cfg: dict) -> dict:
    """Build the workload and the model, then time both modes ``cfg["rounds"]`` times (torch threads set to
    ``cfg["threads"]`` for the run, restored after)."""
    import torch

    from ds4sci.data import NucleotideTokenizer
    from ds4sci.data import read_fasta
    from ds4sci.infer.variants import read_variants
    from ds4sci.infer.variants import score_variants
    from ds4sci.infer.variants import variant_windows
    from ds4sci.models.genslm import GenSLM
    from ds4sci.models.genslm import GenSLMConfig

    record = next(iter(read_fasta(cfg["reference"])))
    reference = {record.id: record.sequence}
    with tempfile.TemporaryDirectory() as tmp:
        vcf = Path(tmp) / "saturation.vcf"
        saturation_vcf(vcf, record.id, record.sequence, cfg["start"], cfg["positions"])
        variants = read_variants(vcf, reference)
    tok = NucleotideTokenizer()
    torch.manual_seed(cfg["seed"])
    config = GenSLMConfig.preset("debug", vocab_size=tok.vocab_size, hidden_size=cfg["hidden"],
                                 num_layers=cfg["layers"], num_heads=cfg["heads"],
                                 intermediate_size=4 * cfg["hidden"], max_position_embeddings=cfg["context"])
    model = GenSLM(config).eval()
    context = cfg["context"]
    windows = variant_windows(reference, variants, context, context)
    runs = {"shared": lambda: [r["llr"] for r in score_variants(model, tok, reference, variants, context,
                                                                batch_size=cfg["batch_size"])],
            "unshared": lambda: unshared_llrs(model, tok, reference, variants, cfg["batch_size"])}
    with torch_threads(cfg["threads"]):
        llrs = {mode: run() for mode, run in runs.items()}  # warm-up, and the guard's numbers
        diff = max(abs(a - b) for a, b in zip(llrs["shared"], llrs["unshared"]))
        if diff > LLR_ATOL:
            raise RuntimeError(f"shared and unshared REF windows give different LLRs: max |difference| = {diff:.3g} "
                               f"nats > {LLR_ATOL}")
        rounds = alternate(runs, dict.fromkeys(MODES, len(variants)), cfg["rounds"], "variants")
    return {"chrom": record.id, "variants": len(variants), "windows": {"shared": len(windows.keys) + len(variants),
                                                   "unshared": 2 * len(variants)},
            "check": {"max_abs_llr_diff": diff, "llr_atol": LLR_ATOL}, "rounds": rounds}


def summarize(rounds: list[dict]) -> dict:
    """Medians of variants/s per mode and of the per-round ratio over ``rounds`` of one clock (``{"shared":
    variants/s, "unshared": variants/s, "ratio": ...}`` each)."""
    return {f"{mode}_variants_per_s_median": statistics.median(r[mode] for r in rounds) for mode in MODES} | {
        "ratio_median": statistics.median(r["ratio"] for r in rounds)}


def markdown(report: dict) -> str:
    """The Markdown summary of a score-variants report."""
    c, s, w = report["config"], report["summary"], report["windows"]

    def cells(r: dict) -> list[str]:
        return [f"{r[clock][mode]:.2f}" for clock in CLOCKS for mode in MODES] + [
            f"{r[clock]['ratio']:.3f}" for clock in CLOCKS]

    rows = round_rows(report, MODES, "variants", cells)
    windows_ratio = w["unshared"] / w["shared"]
    lines = [
        "# score-variants: variants per second, REF windows shared and not",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Saturation mutagenesis: {plural(c['positions'], 'position')} from {report['chrom']}:{c['start']}, 3 SNVs "
        f"each ({plural(report['variants'], 'variant')}); windows of {c['context']} bases, both strands. Random "
        f"nucleotide GenSLM: {describe_shape(c)}, "
        f"context {c['context']}; fp32 on the CPU, {plural(c['threads'], 'torch thread')}, batch {c['batch_size']} "
        f"windows; torch {report['versions']['torch']}. Machine: {describe_machine(report['machine'])}. Windows "
        f"scored: shared {w['shared']:,}, unshared {w['unshared']:,} (ratio {windows_ratio:.3f}). Same LLRs "
        f"checked: max |difference| {report['check']['max_abs_llr_diff']:.1e} nats.",
        "",
        *markdown_table(("round", "shared variants/s", "unshared variants/s", "shared variants/CPU-s",
                         "unshared variants/CPU-s", "ratio shared / unshared (wall)", "ratio (CPU time)"), rows),
        "",
        f"Sharing the REF windows scores **{s['cpu']['ratio_median']:.2f}x** the variants per CPU second "
        f"({s['wall']['ratio_median']:.2f}x per wall second; medians over {plural(len(report['rounds']), 'round')}); "
        f"the windows ratio is {windows_ratio:.2f}.",
    ]
    return "\n".join(lines) + "\n"


def plot(report: dict, path) -> None:
    """Left: variants/s of each mode per round on both clocks; right: windows scored by each mode."""
    rounds, c = report["rounds"], report["config"]
    fig, (left, right) = subplots(1, 2, figsize=(10, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    for mode in MODES:
        for clock, style in (("wall", "-"), ("cpu", "--")):
            left.plot(range(len(rounds)), [r[clock][mode] for r in rounds], marker="o", linestyle=style,
                      color="tab:blue" if mode == "shared" else "tab:orange", label=f"REF windows {mode} ({clock})")
    left.set_xticks(range(len(rounds)))
    left.set_xlabel("round")
    left.set_ylabel("variants per second (wall) / per CPU second")
    left.set_ylim(bottom=0)
    left.legend()
    right.bar(MODES, [report["windows"][mode] for mode in MODES], color=["tab:blue", "tab:orange"])
    right.set_ylabel("windows scored (each on both strands)")
    fig.suptitle(f"{plural(report['variants'], 'SNV')} (3 per position), window {c['context']}, hidden {c['hidden']}, "
                 f"{plural(c['layers'], 'layer')}")
    save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    write_rounds("score-variants", cfg, args.out, {"machine": machine(), "versions": versions("torch")}, measure(cfg),
                 summarize, markdown, plot)
    return 0
