"""The learned position table's checkpoint state is kept per sequence shard (its rows and their global positions) and
re-split on load at any degree or layout; no rank writes or reads the whole table at once."""
import math

import pytest
import torch

from ds4sci.models.genslm import LearnedPositionEmbedding
from ds4sci.train.config import load_config
from ds4sci.train.position_table import PositionTable

CFG = load_config(None, [])


def _table(rows, seed=0) -> PositionTable:
    torch.manual_seed(seed)
    module = LearnedPositionEmbedding(8, 4)
    if rows is not None:
        module.shard_(torch.tensor(rows))
    return PositionTable(module, None, CFG, torch.device("cpu"))  # groups: unused without collectives


def _saved(rows, full, step=3.0):
    """The shard state a rank holding ``rows`` of table ``full`` (with moments 2x and 3x it) would have saved."""
    t = _table(rows)
    with torch.no_grad():
        t.weight.copy_(full[rows])
    t.optimizer.state[t.weight] = {"step": torch.tensor(step), "exp_avg": 2 * full[rows], "exp_avg_sq": 3 * full[rows]}
    return t.shard_state()


def test_a_shard_takes_its_rows_from_shards_of_another_layout():
    full = torch.randn(8, 4)
    saved = [(_saved([0, 7, 1, 6], full), "sp0"), (_saved([2, 5, 3, 4], full), "sp1")]  # zigzag over 2 ranks
    assert saved[0][0]["weight"].shape == (4, 4) and torch.equal(saved[0][0]["rows"], torch.tensor([0, 7, 1, 6]))
    mine = _table([4, 1, 6])  # another degree / layout
    mine.load_shards(iter(saved))
    assert torch.equal(mine.weight, full[[4, 1, 6]])
    state = mine.optimizer.state[mine.weight]
    assert torch.equal(state["exp_avg"], 2 * full[[4, 1, 6]]) and torch.equal(state["exp_avg_sq"], 3 * full[[4, 1, 6]])
    assert float(state["step"]) == 3.0
    whole = _table(None)
    whole.load_shards(iter(saved))
    assert torch.equal(whole.weight, full)


@pytest.mark.parametrize("shards, needle", [
    ([[0, 1, 2, 3]], "positions [5, 6] of this rank are in no saved table shard, or in several"),
    ([[0, 1, 2, 3, 5], [4, 5, 6, 7]], "positions [5] of this rank"),
    ([], "positions [1, 5, 6]"),
])
def test_missing_or_doubled_positions_are_named(shards, needle):
    full = torch.randn(8, 4)
    mine = _table([1, 5, 6])
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        mine.load_shards((_saved(rows, full), f"sp{i}") for i, rows in enumerate(shards))


def test_another_table_is_refused():
    other = LearnedPositionEmbedding(16, 4)
    state = PositionTable(other, None, CFG, torch.device("cpu")).shard_state()
    with pytest.raises(ValueError, match="sp9: position table of 16 x 4, this model needs 8 x 4"):
        _table([1]).load_shards([(state, "sp9")])


def _trained(steps: int, seed=1) -> PositionTable:
    """A whole table after ``steps`` AdamW steps and schedule steps (what PositionTable.step does without the
    collectives), gradients drawn from ``seed``."""
    t = _table(None)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        t.weight.grad = torch.randn(t.weight.shape, generator=gen)
        t.optimizer.step()
        t.optimizer.zero_grad(set_to_none=True)
        t.scheduler.step()
    return t


def test_load_shards_restores_the_learning_rate_schedule_and_adam_step():
    """After ``load_shards`` the optimizer's param group carries the learning rate of the saved step (13: past the
    10 warmup steps, on the cosine; by hand from the config), the config's weight decay, betas and eps; the
    schedule and Adam step counts are 13; and the next step equals the uninterrupted run's, bit for bit."""
    o, steps = CFG.optim, 13
    assert (o.warmup_steps, CFG.train.steps) == (10, 100)
    lr = o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * (steps - 10) / (100 - 10)))
    source = _trained(steps)
    assert source.optimizer.param_groups[0]["lr"] == pytest.approx(lr, rel=1e-12)

    resumed = _table(None, seed=5)  # other weights, a fresh optimizer at step 0 (lr of warmup step 0: lr / 10)
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(o.lr / 10, rel=1e-12)
    resumed.load_shards([(source.shard_state(), "sp0")])
    (group,) = resumed.optimizer.param_groups
    assert group["lr"] == pytest.approx(lr, rel=1e-12), group["lr"]
    assert (group["weight_decay"], tuple(group["betas"]), group["eps"]) == (o.weight_decay, tuple(o.betas), o.eps)
    assert resumed.scheduler.last_epoch == steps and resumed.scheduler.get_last_lr() == pytest.approx([lr], rel=1e-12)
    assert float(resumed.optimizer.state[resumed.weight]["step"]) == steps

    grad = torch.randn(8, 4, generator=torch.Generator().manual_seed(7))
    for t in (source, resumed):
        t.weight.grad = grad.clone()
        t.optimizer.step()
        t.scheduler.step()
    assert torch.equal(resumed.weight, source.weight)
    assert resumed.optimizer.param_groups[0]["lr"] == source.optimizer.param_groups[0]["lr"]
