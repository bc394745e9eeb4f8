"""``ds4sci plan --max-seq`` against published long-sequence runs, every input stated: the ablation of Arctic Long
Sequence Training (ALST: Bekman et al. 2025, arXiv:2506.13996; Llama-3.1-8B on one node of 8 H100-80GB, and on one
H100) with each switch the planner models (Ulysses, tiled MLP, host offload of checkpointed inputs, ZeRO-3 offload).
Below, USP's out-of-memory verdicts and longest sequence (Fang & Zhao 2024, arXiv:2405.07719) and the DeepSpeed4Science
GenSLM runs (README's planner table, which tests/test_readme.py holds to README's command).

Each case: the model (``llama3-8B``: Llama-3.1-8B's shape, bf16), the vocabulary (ALST's 128256-word one, or
ds4sci's 69-codon one: what this model would do on genomes), the GPUs and their memory (80 GiB, no user reserve:
the CUDA context, NCCL and DeepSpeed's buffers and fragmentation are the planner's terms), the layout (ZeRO-3, full
checkpointing, one sequence per micro-step, no pipeline, no TP) and the switches. ALST's runs after the baseline
compute the loss over tiles (Liger's fused linear cross entropy: the ``model.type: liger`` of every ArcticTraining
recipe but the baseline's), so those rows take ds4sci's tiled loss, ``--loss-tile 1024``
(``activation_checkpointing.loss_tile``'s default), which keeps no ``8 V`` bytes of logits per token. The predictions
are pinned; README's ALST table gives each ratio to the published figure and what the error is made of."""
import json
import re

import pytest

from ds4sci import cli

LLAMA = ["--preset", "llama3-8B", "--gpu-mem-gib", "80", "--dtype", "bf16", "--zero-stage", "3",
         "--checkpointing", "full", "--tp", "1", "--pp", "1", "--ring", "1", "--max-seq", "--top", "1"]
NODE, ONE = ["--gpus-per-node", "8", "--nodes", "1"], ["--gpus-per-node", "1", "--nodes", "1"]
VOCAB = {"128K": ["--set", "model.overrides.vocab_size=128256"], "codon": []}
LOSS = ["--loss-tile", "1024"]  # ALST's rows after the baseline compute the loss over tiles (Liger's fused loss)
# ALST's rows, each adding a switch to the row above; every ArcticTraining recipe behind them runs ZeRO-3 with the
# optimizer offloaded to the host (``offload_optimizer: cpu``); "all" is read as the parameters offloaded too
SWITCHES = {
    "baseline (ZeRO-3, no SP)": ["--ulysses", "1", "--offload", "optimizer"],
    "Ulysses SP 8": ["--ulysses", "8", "--offload", "optimizer", *LOSS],
    "+ tiled MLP": ["--ulysses", "8", "--offload", "optimizer", "--mlp-tile", "1024", *LOSS],
    "+ checkpoint offload": ["--ulysses", "8", "--offload", "optimizer", "--mlp-tile", "1024", "--offload-activations",
                             *LOSS],
    "+ ZeRO-3 offload (all)": ["--ulysses", "8", "--offload", "all", "--mlp-tile", "1024", "--offload-activations",
                               *LOSS],
}
# (row, GPUs, vocabulary) -> (published longest sequence, the planner's)
CASES = {
    ("baseline (ZeRO-3, no SP)", 8, "128K"): (32_768, 35_605),
    ("Ulysses SP 8", 8, "128K"): (1_100_000, 687_720),
    ("+ tiled MLP", 8, "128K"): (1_200_000, 1_032_464),
    ("+ checkpoint offload", 8, "128K"): (2_400_000, 2_261_992),
    ("+ ZeRO-3 offload (all)", 8, "128K"): (3_700_000, 2_321_856),
    ("Ulysses SP 8", 8, "codon"): (1_100_000, 712_576),
    ("+ tiled MLP", 8, "codon"): (1_200_000, 1_069_920),
    ("+ checkpoint offload", 8, "codon"): (2_400_000, 2_344_048),
    ("+ ZeRO-3 offload (all)", 8, "codon"): (3_700_000, 2_396_080),
    ("+ ZeRO-3 offload (all)", 1, "128K"): (500_000, 259_177),
    ("+ ZeRO-3 offload (all)", 1, "codon"): (500_000, 276_700),
}


def argv(row: str, gpus: int, vocab: str) -> list[str]:
    """The whole ``ds4sci plan`` command line of a case."""
    switches = list(SWITCHES[row])
    if gpus == 1:  # no sequence parallelism on one GPU
        switches[switches.index("--ulysses") + 1] = "1"
    return ["plan", *LLAMA, *(NODE if gpus == 8 else ONE), *VOCAB[vocab], *switches]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}gpu-{c[2]}")
def test_published_case(case, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    published, pinned = CASES[case]
    assert cli.main(argv(*case)) == 0
    predicted = int(re.search(r"Longest sequence that fits: (\d+) tokens", capsys.readouterr().out).group(1))
    assert predicted == pinned, (case, predicted, published)
    ratio = predicted / published
    # every row within 2x of the published figure (the lowest, one GPU with Llama's vocabulary, 0.52: there the
    # planner keeps the bf16 gradients, 15 GiB, on the device, which ZeRO-Infinity moves to the host)
    assert 0.5 <= ratio <= 2, (case, ratio)


# USP (Fang & Zhao 2024, arXiv:2405.07719), Tables 5 and 6 as issue #28 quotes them (the tables themselves were not
# found in the material searched): LLaMA3-8B on 2 x 8 A800-80GB runs out of memory at 120K with sequence parallelism
# alone and reaches 208K (the paper's longest; its layout not quoted); LLaMA2-7B on 8 A800-80GB runs out of memory at
# 64K with sequence parallelism alone. Inputs: the Llama shapes (``llama3-8B`` with Llama-3's 128256-word vocabulary;
# LLaMA2-7B as 32 key/value heads, SwiGLU 11008, a 32000-word vocabulary: 6.74B parameters), bf16, one sequence per
# micro-step, no pipeline, and, as the paper's Megatron-LM runs are taken here, ZeRO-1 (Megatron-LM's distributed
# optimizer), no offload and no activation checkpointing: assumed, not quoted (with full checkpointing the planner
# fits Ulysses 8 x ring 2 at 436K on 16 GPUs, against the paper's out-of-memory at 120K). K = 1024 tokens.
USP = ["--gpu-mem-gib", "80", "--dtype", "bf16", "--zero-stage", "1", "--checkpointing", "none", "--offload", "none",
       "--pp", "1", "--top", "1"]
USP_MODELS = {
    "LLaMA3-8B": ["--preset", "llama3-8B", "--set", "model.overrides.vocab_size=128256", "--nodes", "2",
                  "--gpus-per-node", "8"],
    "LLaMA2-7B": ["--preset", "llama3-8B", "--set", "model.overrides.vocab_size=32000", "--set",
                  "model.overrides.num_kv_heads=32", "--set", "model.overrides.intermediate_size=11008", "--nodes", "1",
                  "--gpus-per-node", "8"],
}
# (model, ulysses, ring) with tp = 1 -> (the sequence USP reports out of memory, the planner's longest)
USP_SP_ONLY = {
    ("LLaMA3-8B", 8, 2): (120 * 1024, 101_088),
    ("LLaMA3-8B", 4, 4): (120 * 1024, 101_088),
    ("LLaMA3-8B", 16, 1): (120 * 1024, 99_552),
    ("LLaMA2-7B", 8, 1): (64 * 1024, 58_680),
    ("LLaMA2-7B", 4, 2): (64 * 1024, 58_144),
    ("LLaMA2-7B", 1, 8): (64 * 1024, 60_512),
}


def _longest(argv: list[str], capsys) -> int:
    assert cli.main(argv) == 0
    return int(re.search(r"Longest sequence that fits: (\d+) tokens", capsys.readouterr().out).group(1))


@pytest.mark.parametrize("case", USP_SP_ONLY, ids=lambda c: f"{c[0]}-u{c[1]}-r{c[2]}")
def test_usp_sequence_parallelism_alone_runs_out_of_memory_where_the_paper_does(case, capsys, monkeypatch, tmp_path):
    """The planner's out-of-memory verdict for sequence parallelism alone (TP 1) at the length USP reports out of
    memory, and its longest sequence for that layout (pinned), below it. The verdicts rest on the fragmentation term
    (0.3 of the step's short-lived bytes): with ``--fragmentation 0`` the planner fits these layouts at 129-131K
    (LLaMA3-8B) and 76-79K (LLaMA2-7B), past the paper's out-of-memory lengths."""
    monkeypatch.chdir(tmp_path)
    model, u, r = case
    oom_at, pinned = USP_SP_ONLY[case]
    layout = ["--tp", "1", "--ulysses", str(u), "--ring", str(r)]
    assert cli.main(["plan", *USP_MODELS[model], *USP, *layout, "--seq-len", str(oom_at)]) == 2
    assert "no layout fits" in capsys.readouterr().err
    assert _longest(["plan", *USP_MODELS[model], *USP, *layout, "--max-seq"], capsys) == pinned < oom_at


def test_usp_longest_llama3_8b_sequence_within_2x(capsys, monkeypatch, tmp_path):
    """LLaMA3-8B on 16 A800-80GB, every layout searched (TP hybrids included): the planner's longest sequence
    (pinned: 144,928 tokens, TP 8 x ring 2, where the model states shrink by TP) against USP's 208K: ratio 0.68,
    within 2x. The remaining error is made of the assumed inputs above (no checkpointing; the paper's layout for 208K
    is not quoted) and the loss: ds4sci keeps fp32 logits and their log-softmax, 8 V / tp bytes per local token."""
    monkeypatch.chdir(tmp_path)
    predicted = _longest(["plan", *USP_MODELS["LLaMA3-8B"], *USP, "--max-seq", "--out", "."], capsys)
    assert predicted == 144_928
    assert 0.5 <= predicted / (208 * 1024) <= 2
    best = json.loads((tmp_path / "plan.json").read_text())["layouts"][0]["layout"]
    assert (best["tp"], best["ulysses"], best["ring"]) == (8, 1, 2)


# The DeepSpeed4Science GenSLM long-sequence runs (Song et al. 2023, arXiv:2310.04610; the longest sequences per GPU
# count are Argonne's published plot data for GPT25B and GPT33B on DGX A100-40GB nodes, K = 1024 tokens): the new
# Megatron-DeepSpeed release against the old one. The shapes are Argonne's ``ALCF/models.sh`` (hidden 6144, 64 heads,
# 4x MLP, learned positions; 64 or 80 layers). The layout as published: Megatron-LM sequence parallelism, i.e. TP over
# every GPU (their 4-node throughput table states TPSIZE=32; 8 nodes are read as TP 64), ZeRO-1 (their example
# command), one sequence per micro-step. The new release added FlashAttention (no S x S scores, and no S x S mask on the
# GPU: at 384K a boolean one would be 144 GiB), the CPU-built mask and the partitioned position table; the old runs
# are the same layout without them (``sdpa``: the scores materialised; the mask built on the GPU; the table
# replicated). Full checkpointing is assumed for both, not quoted: without it the planner fits 99,840 tokens for the
# 25B model on 64 GPUs, a quarter of the published 384K. Not covered: the 128-GPU points (TP cannot exceed the 64 heads
# and the data-parallel split used there is not stated).
DS4SCI = ["--preset", "25B", "--set", "model.overrides.position_embedding=learned", "--set",
          "model.overrides.hidden_size=6144", "--set", "model.overrides.num_heads=64", "--set",
          "model.overrides.intermediate_size=24576", "--gpus-per-node", "8", "--gpu-mem-gib", "40", "--ulysses", "1",
          "--ring", "1", "--pp", "1", "--zero-stage", "1", "--offload", "none", "--checkpointing", "full", "--max-seq",
          "--top", "1"]
DS4SCI_RELEASE = {"new": ["--mask", "none", "--position-table", "partitioned"],
                  "old": ["--set", "model.overrides.attention_backend=sdpa", "--mask", "bool-device",
                          "--position-table", "replicated"]}
# (model, GPUs, release) -> (published longest sequence, the planner's)
DS4SCI_CASES = {
    ("25B", 32, "new"): (128 * 1024, 184_288),
    ("25B", 64, "new"): (384 * 1024, 279_680),
    ("33B", 32, "new"): (192 * 1024, 151_200),
    ("33B", 64, "new"): (448 * 1024, 256_448),
    ("25B", 32, "old"): (28 * 1024, 30_208),
    ("25B", 64, "old"): (32 * 1024, 44_800),
    ("33B", 32, "old"): (36 * 1024, 27_744),
    ("33B", 64, "old"): (42 * 1024, 43_328),
}


def ds4sci_argv(model: str, gpus: int, release: str) -> list[str]:
    """The whole ``ds4sci plan`` command line of a DeepSpeed4Science case."""
    layers = {"25B": 64, "33B": 80}[model]
    return ["plan", *DS4SCI, "--set", f"model.overrides.num_layers={layers}", "--nodes", str(gpus // 8), "--tp",
            str(gpus), *DS4SCI_RELEASE[release]]


@pytest.mark.parametrize("case", DS4SCI_CASES, ids=lambda c: f"{c[0]}-{c[1]}gpu-{c[2]}")
def test_deepspeed4science_case_within_2x(case, capsys, monkeypatch, tmp_path):
    """Each DeepSpeed4Science point (pinned) within 2x of the published longest sequence: 0.56-1.41."""
    monkeypatch.chdir(tmp_path)
    published, pinned = DS4SCI_CASES[case]
    predicted = _longest(ds4sci_argv(*case), capsys)
    assert predicted == pinned, (case, predicted, published)
    assert 0.5 <= predicted / published <= 2, (case, predicted / published)
