"""``ds4sci plan --max-seq`` against published long-sequence runs, every input stated: the ablation of Arctic Long
Sequence Training (ALST: Bekman et al. 2025, arXiv:2506.13996; Llama-3.1-8B on one node of 8 H100-80GB, and on one
H100) with each switch the planner models (Ulysses, tiled MLP, host offload of checkpointed inputs, ZeRO-3 offload).
The DeepSpeed4Science GenSLM rows are README's planner table (tests/test_readme.py).

Each case: the model (``llama3-8B``: Llama-3.1-8B's shape, bf16), the vocabulary (ALST's 128256-word one, or
ds4sci's 69-codon one: what this model would do on genomes), the GPUs and their memory (80 GiB, 1 GiB reserved,
the planner's default), the layout (ZeRO-3, full checkpointing, one sequence per micro-step, no pipeline, no TP)
and the switches. ALST's runs after the baseline compute the loss over tiles (Liger's fused linear cross entropy: the
``model.type: liger`` of every ArcticTraining recipe but the baseline's), so those rows take ds4sci's tiled loss,
``--loss-tile 1024`` (``activation_checkpointing.loss_tile``'s default), which keeps no ``8 V`` bytes of logits per
token. The predictions are pinned; the ratio to the published figure is in NOTES-tiledloss.md's table."""
import re

import pytest

from ds4sci import cli

LLAMA = ["--preset", "llama3-8B", "--gpu-mem-gib", "80", "--reserve-gib", "1", "--dtype", "bf16", "--zero-stage", "3",
         "--checkpointing", "full", "--tp", "1", "--pp", "1", "--ring", "1", "--max-seq", "--top", "1"]
NODE, ONE = ["--gpus-per-node", "8", "--nodes", "1"], ["--gpus-per-node", "1", "--nodes", "1"]
VOCAB = {"128K": ["--set", "model.overrides.vocab_size=128256"], "codon": []}
LOSS = ["--loss-tile", "1024"]  # ALST's rows after the baseline compute the loss over tiles (Liger's fused loss)
SWITCHES = {  # ALST's rows, each adding a switch to the row above
    "baseline (ZeRO-3, no SP)": ["--ulysses", "1", "--offload", "none"],
    "Ulysses SP 8": ["--ulysses", "8", "--offload", "none", *LOSS],
    "+ tiled MLP": ["--ulysses", "8", "--offload", "none", "--mlp-tile", "1024", *LOSS],
    "+ checkpoint offload": ["--ulysses", "8", "--offload", "none", "--mlp-tile", "1024", "--offload-activations", *LOSS],
    "+ ZeRO-3 offload (all)": ["--ulysses", "8", "--offload", "all", "--mlp-tile", "1024", "--offload-activations",
                               *LOSS],
}
# (row, GPUs, vocabulary) -> (published longest sequence, the planner's)
CASES = {
    ("baseline (ZeRO-3, no SP)", 8, "128K"): (32_768, 39_855),
    ("Ulysses SP 8", 8, "128K"): (1_100_000, 787_936),
    ("+ tiled MLP", 8, "128K"): (1_200_000, 1_190_816),
    ("+ checkpoint offload", 8, "128K"): (2_400_000, 2_667_544),
    ("+ ZeRO-3 offload (all)", 8, "128K"): (3_700_000, 3_234_824),
    ("Ulysses SP 8", 8, "codon"): (1_100_000, 831_624),
    ("+ tiled MLP", 8, "codon"): (1_200_000, 1_257_080),
    ("+ checkpoint offload", 8, "codon"): (2_400_000, 2_815_976),
    ("+ ZeRO-3 offload (all)", 8, "codon"): (3_700_000, 3_309_040),
    ("+ ZeRO-3 offload (all)", 1, "128K"): (500_000, 326_690),
    ("+ ZeRO-3 offload (all)", 1, "codon"): (500_000, 344_869),
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
    assert 0.5 <= ratio <= 2, (case, ratio)  # every row within 2x of the published figure
