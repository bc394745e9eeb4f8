"""Fine-tuned task heads learn a planted motif: a tiny GenSLM with a binary head, trained in process (full
fine-tuning with mean pooling, LoRA with the attention pool), reaches test AUROC >= 0.95 on records that hold the motif
or not, and stays near 0.5 when the labels are shuffled (tests/motif_checks.py's task, the probe's too)."""
import numpy as np
import pytest
import torch

from ds4sci.data import NucleotideTokenizer
from ds4sci.data import read_labelled
from ds4sci.data.metrics import task_metrics
from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm import GenSLMConfig
from ds4sci.models.genslm import GenSLMForTask
from ds4sci.models.genslm import TaskSpec
from ds4sci.models.genslm import task_loss
from ds4sci.train.lora import LoraSpec
from ds4sci.train.lora import apply_lora

from motif_checks import motif_table  # tests/ is on sys.path (its conftest.py)

TOK = NucleotideTokenizer()
STEPS = 15


def _batch(records):
    """Token ids ``[R, T]`` (every record has the same length), positions, mask, class ids ``[R]``."""
    ids = torch.from_numpy(np.stack([TOK.encode(r.sequence) for r in records]))
    R, T = ids.shape
    return ids, torch.arange(T).expand(R, T), torch.ones(R, T, dtype=torch.bool), torch.tensor([r.target for r in
                                                                                                records])


def _test_auroc(path, pooling, lora):
    """Train a fresh tiny model's head (and adapters, or every weight) on the train split, full batch, ``STEPS``
    AdamW steps; the test split's AUROC."""
    data = read_labelled(path, "binary")
    torch.manual_seed(0)
    backbone = GenSLM(GenSLMConfig.preset("debug", vocab_size=TOK.vocab_size, hidden_size=32, num_layers=1,
                                          num_heads=2, max_position_embeddings=64))
    if lora:
        apply_lora(backbone, LoraSpec(r=4, targets=("attention", "mlp")))
    model = GenSLMForTask(backbone, TaskSpec("binary", pooling=pooling))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids, pos, mask, y = _batch(data.split("train"))
    for _ in range(STEPS):
        loss, count = task_loss(model(ids, pos, mask), y, model.spec)
        optimizer.zero_grad()
        (loss / count).backward()
        optimizer.step()
    ids, pos, mask, y = _batch(data.split("test"))
    with torch.no_grad():
        p = model.spec.predictions(model.eval()(ids, pos, mask))[:, 1]
    return task_metrics("binary", y.numpy(), p.numpy(), data.classes)["auroc"]


@pytest.mark.parametrize("pooling,lora", [("mean", False), ("attention", True)])
def test_a_fine_tuned_head_finds_a_planted_motif_and_not_shuffled_labels(tmp_path, pooling, lora):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small matrices: threads only contend for the suite's 2 cores
    try:
        found = _test_auroc(motif_table(tmp_path / "motif.tsv"), pooling, lora)
        chance = _test_auroc(motif_table(tmp_path / "shuffled.tsv", shuffle=True), pooling, lora)
    finally:
        torch.set_num_threads(threads)
    assert found >= 0.95, found
    assert abs(chance - 0.5) < 0.15, chance  # 100 test records: the AUROC of chance has sd ~0.06
