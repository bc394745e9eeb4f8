"""``ds4sci bench throughput``: training tokens/s of ds4sci's GenSLM against Hugging Face's ``GPTNeoXForCausalLM``
(``--shape gpt-neox``) or ``LlamaForCausalLM`` (``--shape llama``).

Both models compute the same function. ``gpt-neox``: one GPT-NeoX configuration (rotary positions on ``rotary_pct``
of each head, parallel residual, GELU, untied head: the GPT-NeoX form GenSLM converts,
:mod:`ds4sci.models.genslm.neox`) builds Hugging Face's model, and through
:func:`~ds4sci.models.genslm.config_from_gpt_neox` ds4sci's GenSLM (Zvyagin et al. 2022; Black et al. 2022,
GPT-NeoX-20B); GenSLM's initial weights are copied into Hugging Face's model with
:func:`~ds4sci.models.genslm.to_gpt_neox_state_dict`. ``llama``: the GenSLM of the Llama-shaped presets' block
(Touvron et al. 2023: ``--kv-heads`` key/value heads, grouped-query attention when fewer than ``--heads``; SwiGLU,
RMSNorm, no biases, sequential residual, rotary on every head dim) builds a ``LlamaConfig`` of the same shape
(the config ``ds4sci export-hf`` writes for it: :func:`ds4sci.io.export_hf.hf_config`), and Hugging Face's initial
weights are copied into GenSLM with :func:`~ds4sci.models.genslm.llama.from_llama_state_dict`. Both shapes use
an MLP of ``4 x hidden`` and the 69-word codon vocabulary. Before anything is timed the logits of both on the
benchmark batch must agree (:func:`check_same_function`), so a converter bug cannot pass for a speed-up.

Timing, in one process (:mod:`ds4sci.bench.rounds`): each round times ``--steps`` training steps (forward,
next-token cross entropy :func:`~ds4sci.models.genslm.lm_loss`, backward, ``torch.optim.AdamW`` step) of each model,
the order swapped every round, after ``--warmup`` untimed steps each. tokens/s = batch x sequence length x steps /
seconds, on the wall and CPU clocks; the ratio ds4sci / Hugging Face per round and clock is reported as its median,
quartiles and min/max over the rounds.

Writes ``throughput.json``, ``throughput.md`` and ``throughput.png`` (tokens/s per round and the ratio's spread) to
``--out``. Needs transformers (``pip install 'ds4sci[dev]'``); without it the command says so and exits with 1.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
from typing import TYPE_CHECKING

from ds4sci.bench.report import add_int_options
from ds4sci.bench.report import check_heads
from ds4sci.bench.report import check_positive
from ds4sci.bench.report import describe_shape
from ds4sci.bench.report import int_config
from ds4sci.bench.report import markdown_table
from ds4sci.bench.report import missing_dependency
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
from ds4sci.kernels.backends import LocalBackend

if TYPE_CHECKING:  # imported where used: ``ds4sci bench throughput --help`` imports no torch
    import torch

    from ds4sci.models.genslm import GenSLM

logger = logging.getLogger(__name__)

MODELS = ("ds4sci", "hf")
#: guard of :func:`check_same_function`: max |logits_ds4sci - logits_hf| <= LOGIT_RTOL * max(1, max |logits_hf|)
LOGIT_RTOL = 1e-4
#: option -> (default, help); every one must be >= 1. Defaults: GenSLM's 25M shape (hidden 512, 8 layers, 8 heads)
_INT_OPTIONS = shape_options(hidden=512, layers=8, heads=8) | {
    "seq_len": (512, "tokens per sequence"),
    "batch": (2, "sequences per step"),
    "steps": (1, "timed training steps per model per round (1 pairs the two models' steps most closely)"),
    "warmup": (1, "untimed training steps per model before the first round"),
} | round_options(9, "each times both models")
_QUICK = {"hidden": 64, "layers": 2, "heads": 4, "seq_len": 64, "batch": 2, "rounds": 3, "steps": 1, "warmup": 1}
_VOCAB = 69  # GenSLM's codon vocabulary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The shape and run options (``--out`` is added by :mod:`ds4sci.bench`)."""
    add_int_options(parser, _INT_OPTIONS, _QUICK)
    add_model_options(parser, "seed of the weights and tokens")
    parser.add_argument("--shape", choices=("gpt-neox", "llama"), default="gpt-neox",
                        help="gpt-neox: against GPTNeoXForCausalLM; llama: Llama's block (grouped-query attention, "
                             "SwiGLU, RMSNorm, no biases, sequential residual) against LlamaForCausalLM "
                             "(default: %(default)s)")
    parser.add_argument("--kv-heads", type=int, default=0,
                        help="key/value heads of --shape llama, dividing --heads (0: one per query head; "
                             "default: %(default)s)")
    parser.add_argument("--rotary-pct", type=float,
                        help="fraction of each head's dims rotated (default: GPT-NeoX's 0.25; Llama rotates all, 1.0)")


def add_model_options(parser: argparse.ArgumentParser, seed_help: str) -> None:
    """``--attention-backend`` (ds4sci's), ``--hf-attention`` (Hugging Face's) and ``--seed`` (``seed_help``): the
    options of a benchmark that compares GenSLM with Hugging Face's model of the same weights."""
    parser.add_argument("--attention-backend", choices=[b.value for b in LocalBackend], default="auto",
                        help="ds4sci GenSLM attention backend (default: %(default)s)")
    parser.add_argument("--hf-attention", choices=("sdpa", "eager"), default="sdpa",
                        help="Hugging Face attn_implementation (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help=f"{seed_help} (default: %(default)s)")


def model_config(args: argparse.Namespace, options: dict[str, tuple[int, str]], quick: dict[str, int],
                 extra: dict) -> dict:
    """A configuration of a benchmark that compares GenSLM with Hugging Face's model: the integer ``options``
    (``--quick`` setting ``quick``'s, :func:`~ds4sci.bench.report.int_config`), ``extra`` (with ``"rotary_pct"``)
    and :func:`add_model_options`' options, checked: ``ValueError`` names a bad value."""
    cfg = int_config(args, options, quick) | extra | {
        "attention_backend": args.attention_backend, "hf_attention": args.hf_attention, "seed": args.seed}
    check_positive(cfg, options)
    check_heads(cfg["hidden"], cfg["heads"])
    if not 0 <= cfg["rotary_pct"] <= 1:
        raise ValueError(f"--rotary-pct={cfg['rotary_pct']}: must be in [0, 1]")
    return cfg


def config_from_args(args: argparse.Namespace) -> dict:
    """The run configuration: the options (``--quick`` overriding the shape), checked; ``ValueError`` names a bad
    value."""
    llama = args.shape == "llama"
    rotary_pct = (1.0 if llama else 0.25) if args.rotary_pct is None else args.rotary_pct
    cfg = model_config(args, _INT_OPTIONS, _QUICK, {"shape": args.shape, "kv_heads": args.kv_heads,
                                                    "rotary_pct": rotary_pct})
    if cfg["kv_heads"] < 0 or (cfg["kv_heads"] and cfg["heads"] % cfg["kv_heads"]):
        raise ValueError(f"--kv-heads={cfg['kv_heads']}: must divide --heads={cfg['heads']} (or be 0)")
    if not llama and cfg["kv_heads"] not in (0, cfg["heads"]):
        raise ValueError(f"--kv-heads={cfg['kv_heads']}: GPT-NeoX has one key/value head per query head; "
                         "grouped-query attention needs --shape llama")
    if llama and cfg["rotary_pct"] != 1:
        raise ValueError(f"--rotary-pct={cfg['rotary_pct']}: LlamaForCausalLM rotates every head dim (1.0)")
    return cfg


def transformers_importable(benchmark: str) -> bool:
    """Whether ``transformers.GPTNeoXForCausalLM``, which ``ds4sci bench BENCHMARK`` compares with, imports here;
    when not, one error line says why and what to install."""
    missing = missing_dependency("transformers", f"ds4sci bench {benchmark} needs transformers ({{err}}); install it "
                                 "with pip install 'ds4sci[dev]'", name="GPTNeoXForCausalLM")
    if missing:
        logger.error(missing)
    return not missing


def build_models(cfg: dict) -> tuple[GenSLM, torch.nn.Module]:
    """ds4sci's GenSLM and Hugging Face's ``GPTNeoXForCausalLM`` (``cfg["shape"]`` ``"gpt-neox"``: from one GPT-NeoX
    configuration, GenSLM's initial weights copied into Hugging Face's model) or ``LlamaForCausalLM`` (``"llama"``:
    from GenSLM's Llama-shaped configuration, Hugging Face's initial weights copied into GenSLM); both in training
    mode, fp32, on the CPU."""
    import torch
    import transformers

    from ds4sci.data import CodonTokenizer
    from ds4sci.io.export_hf import hf_config as transformers_config
    from ds4sci.models.genslm import GenSLM
    from ds4sci.models.genslm import GenSLMConfig
    from ds4sci.models.genslm import config_from_gpt_neox
    from ds4sci.models.genslm import to_gpt_neox_state_dict
    from ds4sci.models.genslm.llama import from_llama_state_dict

    torch.manual_seed(cfg["seed"])
    if cfg["shape"] == "llama":
        # the Llama-shaped presets' block (GQA, SwiGLU, RMSNorm, no biases, sequential residual, rotary base 500000)
        config = GenSLMConfig.preset("llama-debug", vocab_size=_VOCAB, hidden_size=cfg["hidden"],
                                     num_layers=cfg["layers"], num_heads=cfg["heads"], num_kv_heads=cfg["kv_heads"],
                                     intermediate_size=4 * cfg["hidden"], max_position_embeddings=cfg["seq_len"],
                                     attention_backend=cfg["attention_backend"])
        data = transformers_config(config, CodonTokenizer(), "ds4sci bench throughput")  # what export-hf writes for it
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**data, attn_implementation=cfg["hf_attention"]))
        ours = GenSLM(config)
        ours.load_state_dict(from_llama_state_dict(hf.state_dict(), config))  # strict: every weight, once
        return ours.train(), hf.train()
    hf_config = transformers.GPTNeoXConfig(
        vocab_size=_VOCAB, hidden_size=cfg["hidden"], num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"], intermediate_size=4 * cfg["hidden"],
        max_position_embeddings=cfg["seq_len"], rotary_pct=cfg["rotary_pct"], use_parallel_residual=True,
        hidden_act="gelu", tie_word_embeddings=False, attention_dropout=0.0, hidden_dropout=0.0,
        attn_implementation=cfg["hf_attention"],
    )
    ours = GenSLM(dataclasses.replace(config_from_gpt_neox(hf_config), attention_backend=cfg["attention_backend"]))
    hf = transformers.GPTNeoXForCausalLM(hf_config)
    head_key = "lm_head.weight" if "lm_head.weight" in hf.state_dict() else "embed_out.weight"  # transformers >= 5
    missing, unexpected = hf.load_state_dict(to_gpt_neox_state_dict(ours, head_key=head_key), strict=False)
    missing = [k for k in missing if k in dict(hf.named_parameters())]  # buffers (rotary inv_freq) are not weights
    if missing or unexpected:
        raise RuntimeError(f"GenSLM -> GPT-NeoX weights do not line up: missing {missing}, unexpected {unexpected}")
    return ours.train(), hf.train()


def make_batch(cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codon tokens ``[B, S]`` and their positions ``[B, S]`` (0..S-1 in every row)."""
    import torch

    g = torch.Generator().manual_seed(cfg["seed"] + 1)
    ids = torch.randint(0, _VOCAB, (cfg["batch"], cfg["seq_len"]), generator=g)
    return ids, torch.arange(cfg["seq_len"]).expand_as(ids)


def _logits(name: str, model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return model(ids, pos) if name == "ds4sci" else model(input_ids=ids, position_ids=pos).logits


def check_same_function(ours: GenSLM, hf: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor) -> float:
    """max |logits_ds4sci - logits_hf| on ``ids``; ``RuntimeError`` when it exceeds ``LOGIT_RTOL`` x max(1, max
    |logits_hf|), i.e. when the two models do not compute the same function and their speeds say nothing."""
    import torch

    with torch.no_grad():
        got, want = _logits("ds4sci", ours, ids, pos), _logits("hf", hf, ids, pos)
    diff, scale = (got - want).abs().max().item(), max(1.0, want.abs().max().item())
    if not diff <= LOGIT_RTOL * scale:
        raise RuntimeError(f"ds4sci's GenSLM and Hugging Face's {type(hf).__name__} disagree after the weight copy: "
                           f"max |logits difference| = {diff:.3e} > {LOGIT_RTOL:g} x {scale:.3g}; not timing "
                           "models that compute different functions")
    return diff


def _trainer(name: str, model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor):
    """A function running one training step of ``model``: forward, next-token loss, backward, AdamW step."""
    import torch

    from ds4sci.models.genslm import lm_loss

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train_step() -> None:
        opt.zero_grad(set_to_none=True)
        lm_loss(_logits(name, model, ids, pos), ids).backward()
        opt.step()

    return train_step


def measure(cfg: dict) -> dict:
    """Build both models, check they agree, time them alternately with ``cfg["threads"]`` torch threads: the
    report's ``hf_model`` (the class timed against), ``check`` and ``rounds``."""
    with torch_threads(cfg["threads"]):
        ours, hf = build_models(cfg)
        ids, pos = make_batch(cfg)
        diff = check_same_function(ours, hf, ids, pos)
        steps = {"ds4sci": _trainer("ds4sci", ours, ids, pos), "hf": _trainer("hf", hf, ids, pos)}
        tokens = cfg["batch"] * cfg["seq_len"] * cfg["steps"]
        for train_step in steps.values():
            for _ in range(cfg["warmup"]):
                train_step()
        rounds = alternate({name: lambda step=step: [step() for _ in range(cfg["steps"])]
                            for name, step in steps.items()}, dict.fromkeys(MODELS, tokens), cfg["rounds"], "tokens")
    return {"hf_model": type(hf).__name__, "check": {"max_abs_logit_diff": diff, "logit_rtol": LOGIT_RTOL},
            "rounds": rounds}


def summarize(rounds: list[dict]) -> dict:
    """Medians of tokens/s per model, and the median, quartiles and min/max of the per-round ratio, over
    ``rounds`` of one clock (``{"ds4sci": tokens/s, "hf": tokens/s, "ratio": ...}`` each)."""
    ratios = [r["ratio"] for r in rounds]
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    return {f"{name}_tokens_per_s_median": statistics.median(r[name] for r in rounds) for name in MODELS} | {
        "ratio_median": statistics.median(ratios), "ratio_q1": q1, "ratio_q3": q3,
        "ratio_min": min(ratios), "ratio_max": max(ratios),
    }


def markdown(report: dict) -> str:
    """The Markdown summary of a throughput report."""
    c, s = report["config"], report["summary"]

    def cells(r: dict) -> list[str]:
        return [f"{r[clock][key]:.0f}" for clock in CLOCKS for key in MODELS] + [
            f"{r[clock]['ratio']:.3f}" for clock in CLOCKS]

    llama = c["shape"] == "llama"
    shape = "Llama shape (SwiGLU, RMSNorm, no biases, sequential residual)" if llama else "GPT-NeoX shape"
    kv = f" ({c['kv_heads'] or c['heads']} key/value)" if llama else ""
    rows = round_rows(report, MODELS, "tokens", cells)
    lines = [
        f"# Training throughput: ds4sci GenSLM vs Hugging Face {report['hf_model']}",
        "",
        f"{shape}: {describe_shape(c)}{kv}, MLP {4 * c['hidden']}, rotary_pct {c['rotary_pct']}, vocabulary {_VOCAB}; "
        f"batch {c['batch']} x {c['seq_len']} tokens, fp32 on the CPU, {plural(c['threads'], 'torch thread')}. ds4sci "
        f"attention backend {c['attention_backend']!r}, Hugging Face attn_implementation {c['hf_attention']!r}; torch "
        f"{report['versions']['torch']}, transformers {report['versions']['transformers']}. One step = forward + "
        "next-token cross entropy + backward + AdamW. "
        f"{plural(c['rounds'], 'round')} of {plural(c['steps'], 'timed step')} per model, alternating (order swapped "
        f"each round), after {plural(c['warmup'], 'warm-up step')} each. Same function checked first: max |logits "
        "difference| "
        f"{report['check']['max_abs_logit_diff']:.1e}.",
        "",
        *markdown_table(("round", "ds4sci tokens/s", "HF tokens/s", "ds4sci tokens/CPU-s", "HF tokens/CPU-s",
                         "ratio ds4sci / HF (wall)", "ratio (CPU time)"), rows),
        "",
        *(f"Ratio ds4sci / Hugging Face, {label}: median **{s[clock]['ratio_median']:.3f}**, quartiles "
          f"{s[clock]['ratio_q1']:.3f} - {s[clock]['ratio_q3']:.3f}, min/max {s[clock]['ratio_min']:.3f} - "
          f"{s[clock]['ratio_max']:.3f} over {plural(len(report['rounds']), 'round')}."
          for clock, label in (("wall", "wall clock"), ("cpu", "CPU time of this process"))),
    ]
    return "\n".join(lines) + "\n"


def plot(report: dict, path) -> None:
    """Left: tokens/s (wall clock) of each model per round; right: the per-round ratios on both clocks as box
    plots with their points."""
    rounds = report["rounds"]
    fig, (left, right) = subplots(1, 2, figsize=(10, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    for name, label in (("ds4sci", "ds4sci GenSLM"), ("hf", f"HF {report['hf_model']}")):
        left.plot(range(len(rounds)), [r["wall"][name] for r in rounds], marker="o", label=label)
    left.set_xticks(range(len(rounds)))
    left.set_xlabel("round")
    left.set_ylabel("training tokens/s")
    left.set_ylim(bottom=0)
    left.legend()
    plot_ratios(right, rounds)
    c = report["config"]
    fig.suptitle(f"hidden {c['hidden']}, {c['layers']} layers, batch {c['batch']} x {c['seq_len']}, "
                 f"{plural(c['threads'], 'thread')}")
    save_figure(fig, path)


def plot_ratios(ax, rounds: list[dict]) -> None:
    """The ds4sci / Hugging Face tokens/s ratio of every round (``round[clock]["ratio"]``) on ``ax``: a box and the
    points per clock, with 1 (parity) dashed."""
    ratios = [[r[clock]["ratio"] for r in rounds] for clock in CLOCKS]
    ax.boxplot(ratios)
    for i, values in enumerate(ratios, start=1):
        ax.scatter([i] * len(values), values, color="black", s=12, zorder=3)
    ax.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
    ax.set_xticks([1, 2], ["wall clock", "CPU time"])
    ax.set_ylabel("tokens/s ratio ds4sci / HF")


def run(args: argparse.Namespace) -> int:
    """``ds4sci bench throughput``: exit status 1, with one error line, when transformers is not importable."""
    cfg = config_from_args(args)
    if not transformers_importable("throughput"):
        return 1
    write_rounds("throughput", cfg, args.out, {"versions": versions("torch", "transformers")}, measure(cfg), summarize,
                 markdown, plot)
    return 0
