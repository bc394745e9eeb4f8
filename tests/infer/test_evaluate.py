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


def test_evaluate_on_threads_equals_one_batch_after_the_other(tmp_path, tiny):
    """Batches read at once on the CPU (``ShardedForward.map_batches``, one thread per operator) give every window's
    loss bitwise as the batches read one after the other on one thread."""
    from ds4sci.infer.evaluate import window_losses
    from ds4sci.infer.parallel import ShardedForward

    model, cfg, tok = tiny
    fasta = tmp_path / "x.fa"
    fasta.write_text(">a\n" + "ACGTTGCA" * 20 + "\n>b\nGGCA\n>c\n" + "TTGACA" * 7 + "\n")
    ds = windows(cfg, tok, str(fasta), stride=8)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = window_losses(model, ds, batch_size=2, runner=ShardedForward(model, workers=1))
        three = window_losses(model, ds, batch_size=2, runner=ShardedForward(model, workers=3))
    finally:
        torch.set_num_threads(threads)
    assert len(ds) >= 12 and (one[1] > 0).all()
    assert one[0].tolist() == three[0].tolist() and one[1].tolist() == three[1].tolist()
    alone = ShardedForward(model, workers=1)
    for w in range(len(ds)):  # each window's own numbers, in its place
        (_, batch), = alone.batches(ds, [w], 1)
        loss, count = alone.losses(batch)
        assert three[0][w] == pytest.approx(loss[0], rel=1e-5) and three[1][w] == count[0]
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        window_losses(model, ds, batch_size=0)
