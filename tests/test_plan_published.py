"""``ds4sci plan --max-seq`` against published long-sequence runs, every input stated: the ablation of Arctic Long
Sequence Training (ALST: Bekman et al. 2025, arXiv:2506.13996; Llama-3.1-8B on one node of 8 H100-80GB, and on one
H100) with each switch the planner models (Ulysses, tiled MLP, host offload of checkpointed inputs, ZeRO-3 offload).
The DeepSpeed4Science GenSLM rows are README's planner table (tests/test_readme.py).

Each case: the model (``llama3-8B``: Llama-3.1-8B's shape, bf16), the vocabulary (ALST's 128256-word one, or
ds4sci's 69-codon one: what this model would do on genomes), the GPUs and their memory (80 GiB, no user reserve:
the CUDA context, NCCL and DeepSpeed's buffers and fragmentation are the planner's terms), the layout (ZeRO-3, full
checkpointing, one sequence per micro-step, no pipeline, no TP) and the switches. The predictions are pinned; the ratio to the published figure is printed in NOTES-planner.md's
table. The remaining error of the 128K-vocabulary rows is the loss: ds4sci's loss keeps fp32 logits and their
log-softmax, ``8 V`` bytes per local token (1 MiB at V = 128256), where ALST computes the loss over sequence tiles."""
import re

import pytest

from ds4sci import cli

LLAMA = ["--preset", "llama3-8B", "--gpu-mem-gib", "80", "--dtype", "bf16", "--zero-stage", "3",
         "--checkpointing", "full", "--tp", "1", "--pp", "1", "--ring", "1", "--max-seq", "--top", "1"]
NODE, ONE = ["--gpus-per-node", "8", "--nodes", "1"], ["--gpus-per-node", "1", "--nodes", "1"]
VOCAB = {"128K": ["--set", "model.overrides.vocab_size=128256"], "codon": []}
SWITCHES = {  # ALST's rows, each adding a switch to the row above
    "baseline (ZeRO-3, no SP)": ["--ulysses", "1", "--offload", "none"],
    "Ulysses SP 8": ["--ulysses", "8", "--offload", "none"],
    "+ tiled MLP": ["--ulysses", "8", "--offload", "none", "--mlp-tile", "1024"],
    "+ checkpoint offload": ["--ulysses", "8", "--offload", "none", "--mlp-tile", "1024", "--offload-activations"],
    "+ ZeRO-3 offload (all)": ["--ulysses", "8", "--offload", "all", "--mlp-tile", "1024", "--offload-activations"],
}
# (row, GPUs, vocabulary) -> (published longest sequence, the planner's)
CASES = {
    ("baseline (ZeRO-3, no SP)", 8, "128K"): (32_768, 29_908),
    ("Ulysses SP 8", 8, "128K"): (1_100_000, 237_312),
    ("+ tiled MLP", 8, "128K"): (1_200_000, 272_672),
    ("+ checkpoint offload", 8, "128K"): (2_400_000, 326_688),
    ("+ ZeRO-3 offload (all)", 8, "128K"): (3_700_000, 396_392),
    ("Ulysses SP 8", 8, "codon"): (1_100_000, 610_632),
    ("+ tiled MLP", 8, "codon"): (1_200_000, 910_776),
    ("+ checkpoint offload", 8, "codon"): (2_400_000, 1_953_632),
    ("+ ZeRO-3 offload (all)", 8, "codon"): (3_700_000, 2_303_832),
    ("+ ZeRO-3 offload (all)", 1, "128K"): (500_000, 41_371),
    ("+ ZeRO-3 offload (all)", 1, "codon"): (500_000, 259_799),
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
    # the codon-vocabulary rows and the baseline hold within 2x; the 128K-vocabulary SP rows do not (the loss)
    assert (0.5 <= ratio <= 2) == (case[2] == "codon" or case[0].startswith("baseline")), (case, ratio)
