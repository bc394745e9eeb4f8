"""SP-aware loss: global-mean normalisation per ZeRO stage, targets shifted before sharding."""
import pytest
import torch

from ds4sci.models.genslm import IGNORE_INDEX, lm_loss, shift_labels, token_loss
from ds4sci.sequence import shard_sequence
from ds4sci.train.loss import global_target_count, grad_reduction_factor, scaled_shard_loss


def test_grad_reduction_factor_per_stage():
    # stages 0-2: SUM over sequence ranks, MEAN over data ranks; stage 3: MEAN over all (measured, DeepSpeed 0.19)
    assert [grad_reduction_factor(z, dp=3, sp=2) for z in (0, 1, 2, 3)] == [3.0, 3.0, 3.0, 6.0]
    assert grad_reduction_factor(3, dp=1, sp=4) == 4.0 and grad_reduction_factor(1, dp=1, sp=4) == 1.0
    with pytest.raises(ValueError, match="ZeRO stage must be 0, 1, 2 or 3, got 4"):
        grad_reduction_factor(4, 1, 1)
    with pytest.raises(ValueError, match="sp=0"):
        grad_reduction_factor(1, 1, 0)


@pytest.mark.parametrize("layout, world", [("contiguous", 2), ("contiguous", 4), ("zigzag", 2)])
def test_shift_before_sharding_keeps_every_target(layout, world):
    torch.manual_seed(0)
    B, T, V = 3, 16, 7  # batch, window, vocabulary
    logits = torch.randn(B, T, V, dtype=torch.float64)
    labels = torch.randint(0, V, (B, T))
    labels[1, 11:] = IGNORE_INDEX  # padding at the end of a short record
    full = lm_loss(logits, labels, "sum")
    targets = shift_labels(labels)  # [B, T]: targets[:, t] = labels[:, t + 1]
    shards = [(shard_sequence(logits, 1, r, world, layout), shard_sequence(targets, 1, r, world, layout))
              for r in range(world)]
    torch.testing.assert_close(sum(token_loss(lg, tg, "sum") for lg, tg in shards), full)
    assert sum(int((tg != IGNORE_INDEX).sum()) for _, tg in shards) == int((labels[:, 1:] != IGNORE_INDEX).sum())
    # Shifting inside each shard instead loses the target of every shard's last token (it lives on the next shard):
    naive = sum(lm_loss(lg, shard_sequence(labels, 1, r, world, layout), "sum") for r, (lg, _) in enumerate(shards))
    assert not torch.allclose(naive, full)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dp, sp", [(1, 2), (2, 2), (3, 1)])
def test_scaled_shard_loss_under_the_stage_reduction_gives_the_global_mean_gradient(stage, dp, sp):
    """A model of DeepSpeed's reduction (the equivalence tests check the real engine): ranks of a dp x sp grid each
    hold a sequence shard of their data rank's samples; the reduced gradient must be that of the global mean."""
    torch.manual_seed(1)
    B, T, H, V = 2, 8, 4, 5  # per-rank batch, window, hidden, vocabulary
    w = torch.randn(H, V, dtype=torch.float64, requires_grad=True)
    x = torch.randn(dp, B, T, H, dtype=torch.float64)
    targets = torch.randint(0, V, (dp, B, T))
    targets[0, 0, 5:] = IGNORE_INDEX  # ranks hold different numbers of real targets
    (ref,) = torch.autograd.grad(token_loss(x.reshape(dp * B, T, H) @ w, targets.reshape(dp * B, T)), w)

    count = torch.tensor(float((targets != IGNORE_INDEX).sum()), dtype=torch.float64)
    factor = grad_reduction_factor(stage, dp, sp)
    grads = torch.zeros(dp, sp, H, V, dtype=torch.float64)
    for d in range(dp):
        for s in range(sp):
            logits = shard_sequence(x[d], 1, s, sp) @ w
            local_sum = token_loss(logits, shard_sequence(targets[d], 1, s, sp), "sum")
            (grads[d, s],) = torch.autograd.grad(scaled_shard_loss(local_sum, count, factor), w)
    reduced = grads.mean(dim=(0, 1)) if stage == 3 else grads.sum(dim=1).mean(dim=0)
    torch.testing.assert_close(reduced, ref)


def test_global_target_count_and_empty_batches():
    targets = [torch.tensor([[1, 2, IGNORE_INDEX]]), torch.tensor([[IGNORE_INDEX, 0, 4]])]
    count = global_target_count(targets)  # one process: no reduction
    assert count.dtype == torch.float64 and float(count) == 4
    with pytest.raises(ValueError, match="no real target"):
        scaled_shard_loss(torch.tensor(0.0), torch.tensor(0.0, dtype=torch.float64), 1.0)
