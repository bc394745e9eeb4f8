"""``ds4sci bench generate``: tokens/s of ds4sci's cached decoding (:func:`ds4sci.infer.generate.sample`) against
Hugging Face's ``GPTNeoXForCausalLM.generate`` with its cache, on the same weights, and against the uncached loop
``ds4sci generate`` ran before the cache.

The models: one GPT-NeoX configuration builds both, GenSLM's initial weights copied into Hugging Face's model
(:func:`ds4sci.bench.throughput.build_models`), the 69-word codon vocabulary. Random weights give nearly uniform
logits, where a rounding difference could flip a greedy choice between near-tied tokens, so both output heads are
scaled by :data:`HEAD_SCALE`, which makes the greedy outputs a sharp check. Before anything is timed the logits of
both on the prompt must agree (:func:`ds4sci.bench.throughput.check_same_function`).

The work, greedy on ``--num-sequences`` sequences continuing one random codon prompt, special tokens never generated:
``ds4sci`` (``sample``: one prefill, then one cached forward per token), ``hf`` (``model.generate(...,
do_sample=False, use_cache=True, eos_token_id=None)``: exactly ``--new-tokens`` tokens) and ``uncached`` (one forward
over the whole prefix per new token, for ``--uncached-tokens`` only). Every round checks that the tokens agree
(:func:`check_greedy_agreement`).

Timing, in one process (:mod:`ds4sci.bench.rounds`): each round runs the three once, the order reversed every
round, after one untimed run each. tokens/s = sequences x new tokens / seconds of the whole call (prefill included),
on the wall and CPU clocks; :func:`ds4sci.bench.throughput.summarize` gives the ratio ds4sci / Hugging Face.

Writes ``generate.json``, ``.md`` and ``.png`` to ``--out``. Needs transformers (``pip install 'ds4sci[dev]'``);
without it the command says so and exits with 1.
"""
from __future__ import annotations

import argparse
import statistics
from typing import TYPE_CHECKING

from ds4sci.bench import throughput
from ds4sci.bench.report import add_int_options
from ds4sci.bench.report import describe_load
from ds4sci.bench.report import describe_machine
from ds4sci.bench.report import describe_shape
from ds4sci.bench.report import load_average
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

if TYPE_CHECKING:  # imported where used: ``ds4sci bench generate --help`` imports no torch
    import torch

    from ds4sci.data import CodonTokenizer

METHODS = ("ds4sci", "hf", "uncached")
#: both models' output head times this: logits spread enough that no greedy choice is a near tie (see the module doc)
HEAD_SCALE = 20.0
#: option -> (default, help); every one must be >= 1. Defaults: a short prompt continued at length (how GenSLM
#: generates genes), decoding-dominated, about a minute on 2 shared cores
_INT_OPTIONS = shape_options(hidden=256, layers=4, heads=4) | {
    "prompt_len": (64, "prompt tokens (random codons)"),
    "new_tokens": (256, "tokens generated per sequence by ds4sci and Hugging Face"),
    "num_sequences": (4, "sequences decoded together (the batch)"),
    "uncached_tokens": (16, "tokens generated per sequence by the uncached loop (O(L^2) per token)"),
} | round_options(5, "each runs the three once")
_QUICK = {"hidden": 64, "layers": 2, "heads": 4, "prompt_len": 8, "new_tokens": 12, "num_sequences": 2,
          "uncached_tokens": 4, "rounds": 3}
_WARMUP_TOKENS = 4  # tokens of each method's untimed first run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The shape and run options (``--out`` is added by :mod:`ds4sci.bench`)."""
    add_int_options(parser, _INT_OPTIONS, _QUICK)
    throughput.add_model_options(parser, "seed of the weights and prompt")
    parser.add_argument("--rotary-pct", type=float, default=0.25,
                        help="fraction of each head's dims rotated (default: GPT-NeoX's %(default)s)")


def config_from_args(args: argparse.Namespace) -> dict:
    """The run configuration: the options (``--quick`` overriding the shape and lengths), checked; ``ValueError``
    names a bad value."""
    cfg = throughput.model_config(args, _INT_OPTIONS, _QUICK, {"rotary_pct": args.rotary_pct})
    if cfg["uncached_tokens"] > cfg["new_tokens"]:
        raise ValueError(f"--uncached-tokens={cfg['uncached_tokens']}: must be at most --new-tokens="
                         f"{cfg['new_tokens']} (its tokens are checked against ds4sci's)")
    return cfg


def build_models(cfg: dict):
    """ds4sci's GenSLM and Hugging Face's ``GPTNeoXForCausalLM`` holding the same weights, in eval mode, their output
    heads scaled by :data:`HEAD_SCALE`; context ``prompt_len + new_tokens``."""
    import torch

    ours, hf = throughput.build_models({"shape": "gpt-neox", "kv_heads": 0,
                                        "seq_len": cfg["prompt_len"] + cfg["new_tokens"]} | cfg)
    with torch.no_grad():
        ours.embed_out.weight.mul_(HEAD_SCALE)
        hf.get_output_embeddings().weight.mul_(HEAD_SCALE)
    return ours.eval(), hf.eval()


def make_prompt(cfg: dict, tokenizer: CodonTokenizer) -> tuple[str, list[int]]:
    """``(text, ids)``: ``prompt_len`` random codons (no special token) and their ids."""
    import torch

    codons = sorted(set(range(tokenizer.vocab_size)) - tokenizer.special_ids)
    g = torch.Generator().manual_seed(cfg["seed"] + 1)
    ids = [codons[i] for i in torch.randint(0, len(codons), (cfg["prompt_len"],), generator=g).tolist()]
    return tokenizer.decode(ids), ids


def runners(ours, hf, tokenizer: CodonTokenizer, text: str, ids: list[int], cfg: dict) -> dict:
    """``name -> run(new_tokens) -> [N, new_tokens] generated ids`` for each of :data:`METHODS`."""
    import torch

    from ds4sci.infer.generate import sample

    n = cfg["num_sequences"]
    prompt = torch.tensor([ids]).expand(n, len(ids))  # [N, P]
    special = sorted(tokenizer.special_ids)

    def ds4sci(new_tokens: int) -> torch.Tensor:
        out = sample(ours, tokenizer, text, new_tokens, num_sequences=n, temperature=0)
        return torch.tensor([tokenizer.encode(s[len(text):]).tolist() for s in out])  # [N, new]

    @torch.no_grad()
    def hf_generate(new_tokens: int) -> torch.Tensor:
        out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                          do_sample=False, use_cache=True, suppress_tokens=special, eos_token_id=None,
                          pad_token_id=tokenizer.pad_id)  # [N, P + new]
        return out[:, len(ids):]

    @torch.no_grad()
    def uncached(new_tokens: int) -> torch.Tensor:
        x = prompt
        for _ in range(new_tokens):
            logits = ours(x, torch.arange(x.shape[1]).expand_as(x))[:, -1]  # [N, V]: the whole prefix again
            logits[:, special] = float("-inf")
            x = torch.cat([x, logits.argmax(-1)[:, None]], dim=1)  # [N, L + 1]
        return x[:, len(ids):]

    return {"ds4sci": ds4sci, "hf": hf_generate, "uncached": uncached}


def check_greedy_agreement(tokens: dict[str, torch.Tensor]) -> None:
    """``RuntimeError`` naming the first sequence and token where Hugging Face's greedy tokens differ from ds4sci's,
    or the uncached loop's from the start of ds4sci's (``tokens``: name -> ``[N, new]`` ids, any subset of
    :data:`METHODS` with ``"ds4sci"``)."""
    ours = tokens["ds4sci"]
    for name, theirs in tokens.items():
        n = theirs.shape[1]
        if theirs.shape[0] != ours.shape[0] or n > ours.shape[1] or (name == "hf" and n != ours.shape[1]):
            raise RuntimeError(f"{name} generated {tuple(theirs.shape)} tokens [N, new], ds4sci {tuple(ours.shape)}")
        differ = (theirs != ours[:, :n]).nonzero()
        if len(differ):
            i, t = differ[0].tolist()
            raise RuntimeError(f"greedy tokens of {name} and ds4sci differ first at sequence {i}, new token {t}: "
                               f"{int(theirs[i, t])} vs {int(ours[i, t])}; the timings compare different work")


def measure(cfg: dict) -> dict:
    """Build both models, check they agree, time the three methods alternately with ``cfg["threads"]`` torch
    threads: the report's ``hf_model``, ``check``, ``rounds`` and ``load``."""
    import torch

    from ds4sci.data import CodonTokenizer

    with torch_threads(cfg["threads"]):
        tokenizer = CodonTokenizer()
        ours, hf = build_models(cfg)
        text, ids = make_prompt(cfg, tokenizer)
        diff = throughput.check_same_function(ours, hf, torch.tensor([ids]), torch.arange(len(ids))[None])
        run = runners(ours, hf, tokenizer, text, ids, cfg)
        for fn in run.values():
            fn(min(_WARMUP_TOKENS, cfg["uncached_tokens"]))
        new = {"ds4sci": cfg["new_tokens"], "hf": cfg["new_tokens"], "uncached": cfg["uncached_tokens"]}
        start_load = load_average()
        rounds = alternate({name: lambda name=name: run[name](new[name]) for name in METHODS},
                           {name: cfg["num_sequences"] * new[name] for name in METHODS}, cfg["rounds"], "tokens",
                           check=check_greedy_agreement)
    return {"hf_model": type(hf).__name__,
            "check": {"max_abs_logit_diff": diff, "logit_rtol": throughput.LOGIT_RTOL, "greedy_tokens_agree": True},
            "rounds": rounds, "load": {"start": start_load, "end": load_average()}}


def summarize(rounds: list[dict]) -> dict:
    """:func:`ds4sci.bench.throughput.summarize` of ``rounds`` of one clock, plus the uncached loop's median tokens/s
    and how many times faster ds4sci's cached decoding is (median over rounds of the per-round ratio)."""
    return throughput.summarize(rounds) | {
        "uncached_tokens_per_s_median": statistics.median(r["uncached"] for r in rounds),
        "cached_over_uncached_median": statistics.median(r["ds4sci"] / r["uncached"] for r in rounds),
    }


def markdown(report: dict) -> str:
    """The Markdown summary of a generate report."""
    c, s = report["config"], report["summary"]

    def cells(r: dict) -> list[str]:
        return [f"{r['wall'][m]:.1f}" for m in METHODS] + [f"{r[clock]['ratio']:.3f}" for clock in CLOCKS]

    rows = round_rows(report, METHODS, "tokens", cells)
    lines = [
        f"# Generation: ds4sci cached decoding vs Hugging Face {report['hf_model']}.generate",
        "",
        f"GPT-NeoX shape: {describe_shape(c)}, MLP {4 * c['hidden']}, rotary_pct {c['rotary_pct']}, codon vocabulary, "
        f"same weights (output head x{HEAD_SCALE:g} in both); fp32 on the CPU, {plural(c['threads'], 'torch thread')}. "
        "Greedy, "
        f"{plural(c['num_sequences'], 'sequence')} decoded together after a {c['prompt_len']}-token prompt: "
        f"{c['new_tokens']} new tokens each by ds4sci (`sample`, KV cache; attention backend "
        f"{c['attention_backend']!r}) and Hugging Face (`generate(use_cache=True)`, attn_implementation "
        f"{c['hf_attention']!r}), {c['uncached_tokens']} by the uncached loop (whole prefix per token). tokens/s = "
        "sequences x new tokens / seconds of the whole call, prefill included. "
        f"{plural(c['rounds'], 'round')}, order reversed each round; torch {report['versions']['torch']}, transformers "
        f"{report['versions']['transformers']}; {describe_machine(report['machine'])}, 1-minute load "
        f"{describe_load(report['load']['start'], report['load']['end'])}. Checked: max |logits difference| "
        f"{report['check']['max_abs_logit_diff']:.1e}; greedy tokens of all three equal in every round.",
        "",
        *markdown_table(("round", "ds4sci cached tokens/s", "HF cached tokens/s", "ds4sci uncached tokens/s",
                         "ratio ds4sci / HF (wall)", "ratio (CPU time)"), rows),
        "",
        *(f"Ratio ds4sci / Hugging Face, {label}: median **{s[clock]['ratio_median']:.3f}**, quartiles "
          f"{s[clock]['ratio_q1']:.3f} - {s[clock]['ratio_q3']:.3f}, min/max {s[clock]['ratio_min']:.3f} - "
          f"{s[clock]['ratio_max']:.3f} over {plural(len(report['rounds']), 'round')}; cached over uncached "
          f"{s[clock]['cached_over_uncached_median']:.1f}x; median tokens/{unit}: ds4sci "
          f"{s[clock]['ds4sci_tokens_per_s_median']:.1f}, HF {s[clock]['hf_tokens_per_s_median']:.1f}, uncached "
          f"{s[clock]['uncached_tokens_per_s_median']:.1f}."
          for clock, label, unit in (("wall", "wall clock", "s"), ("cpu", "CPU time of this process", "CPU-s"))),
    ]
    return "\n".join(lines) + "\n"


def plot(report: dict, path) -> None:
    """Left: tokens/s (wall clock) of each method per round, log scale; right: the per-round ratios ds4sci / HF on
    both clocks as box plots with their points."""
    rounds, c = report["rounds"], report["config"]
    fig, (left, right) = subplots(1, 2, figsize=(10, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    labels = {"ds4sci": "ds4sci cached (sample)", "hf": f"HF {report['hf_model']}.generate", "uncached":
              "ds4sci uncached loop"}
    for name, label in labels.items():
        left.plot(range(len(rounds)), [r["wall"][name] for r in rounds], marker="o", label=label)
    left.set_xticks(range(len(rounds)))
    left.set_xlabel("round")
    left.set_ylabel("generated tokens/s")
    left.set_yscale("log")
    left.legend()
    throughput.plot_ratios(right, rounds)
    fig.suptitle(f"hidden {c['hidden']}, {c['layers']} layers, {c['num_sequences']} sequences, prompt "
                 f"{c['prompt_len']} + {c['new_tokens']} new tokens, {plural(c['threads'], 'thread')}")
    save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    """``ds4sci bench generate``: exit status 1, with one error line, when transformers is not importable."""
    cfg = config_from_args(args)
    if not throughput.transformers_importable("generate"):
        return 1
    write_rounds("generate", cfg, args.out, {"machine": machine(), "versions": versions("torch", "transformers")},
                 measure(cfg), summarize, markdown, plot)
    return 0
