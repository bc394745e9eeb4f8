"""evaluate: windows of each record, and a loss over the real targets only."""
import math

import pytest
import torch

from ds4sci.infer.evaluate import evaluate
from ds4sci.infer.evaluate import windows


def test_evaluate_counts_real_tokens_only(tmp_path, tiny):
    model, cfg, tok = tiny
    fasta = tmp_path / "x.fa"
    fasta.write_text(">a\n" + "ACGT" * 10 + "\n>b\nGGCA\n")
    ds = windows(cfg, tok, str(fasta))  # 40 tokens -> 32 + 8 (padded); 4 tokens (padded)
    assert len(ds) == 3
    got = evaluate(model, tok, ds, batch_size=2)
    total, count = 0.0, 0
    for chunk in ("ACGT" * 10)[:32], ("ACGT" * 10)[32:], "GGCA":
        ids = torch.from_numpy(tok.encode(chunk))[None]
        logits = model(ids, torch.arange(ids.shape[1])[None])
        total += torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum").item()
        count += ids.shape[1] - 1
    assert got["tokens"] == count == 31 + 7 + 3
    assert got["loss"] == pytest.approx(total / count, rel=1e-5)
    assert got["bits_per_base"] == pytest.approx(total / count / math.log(2), rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)
