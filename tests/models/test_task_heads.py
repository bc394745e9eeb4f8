"""Task heads (ds4sci.models.genslm.task): each pooling against its plain definition, each loss kind against
PyTorch's, the head on a GenSLM, and a sharded pooling that equals the whole record's."""
import math
import threading

import pytest
import torch
import torch.nn.functional as F

from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm import GenSLMConfig
from ds4sci.models.genslm import GenSLMForTask
from ds4sci.models.genslm import TaskHead
from ds4sci.models.genslm import TaskSpec
from ds4sci.models.genslm import task_loss


def _batch(B=3, T=10, h=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, h, generator=g, dtype=torch.float64)
    lengths = torch.tensor([T, 6, 1])[:B]
    mask = torch.arange(T) < lengths[:, None]  # [B, T]: right padding
    pos = torch.arange(T).expand(B, T).contiguous()
    return hidden, mask, pos, lengths


def _reference_pool(head, hidden, lengths):
    out = []
    for b, n in enumerate(lengths.tolist()):
        h = hidden[b, :n]  # [n, hidden]
        if head.spec.pooling == "mean":
            out.append(h.mean(0))
        elif head.spec.pooling == "last":
            out.append(h[-1])
        else:
            w = torch.softmax(head.pool(h).squeeze(-1), 0)
            out.append((w[:, None] * h).sum(0))
    return torch.stack(out)


@pytest.mark.parametrize("pooling", ["mean", "last", "attention"])
def test_pooling_equals_its_definition(pooling):
    torch.manual_seed(0)
    head = TaskHead(8, TaskSpec("multiclass", 3, pooling)).double()
    hidden, mask, pos, lengths = _batch()
    got = head.pooled(hidden, mask, pos)
    torch.testing.assert_close(got, _reference_pool(head, hidden, lengths), rtol=1e-12, atol=1e-12)
    assert head(hidden, mask, pos).shape == (3, 3)


class _Exchange:
    """The reduction of shard ``rank`` of two, each shard pooled in its own thread: every sum / max waits for the
    other shard's partial result and returns the total, as the sequence-parallel all-reduce does."""

    def __init__(self, rank, slots, barrier):
        self.rank, self.slots, self.barrier = rank, slots, barrier

    def _reduce(self, x, op):
        self.slots[self.rank] = x
        self.barrier.wait()
        total = op(*self.slots)
        self.barrier.wait()
        return total

    def sum(self, x):
        return self._reduce(x, torch.add)

    def max(self, x):
        return self._reduce(x, torch.maximum)


@pytest.mark.parametrize("pooling", ["mean", "last", "attention"])
def test_sharded_pooling_adds_up_to_the_whole(pooling):
    """Two shards (zigzag-like: the first holds both ends), each pooled with partial results exchanged the way the
    sequence-parallel reduction does: both shards' pooled vectors equal one device's."""
    torch.manual_seed(0)
    hidden, mask, pos, lengths = _batch()
    pieces = [torch.tensor([0, 1, 2, 7, 8, 9]), torch.tensor([3, 4, 5, 6])]
    slots, barrier, got = [None, None], threading.Barrier(2, timeout=30), [None, None]
    heads = []
    for rank in range(2):
        torch.manual_seed(0)  # the same head on both shards
        head = TaskHead(8, TaskSpec("binary", 2, pooling)).double()
        head.reduction = _Exchange(rank, slots, barrier)
        heads.append(head)

    def pool(rank):
        idx = pieces[rank]
        got[rank] = heads[rank].pooled(hidden[:, idx], mask[:, idx], pos[:, idx])

    threads = [threading.Thread(target=pool, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    heads[0].reduction = None
    for g in got:
        torch.testing.assert_close(g, _reference_pool(heads[0], hidden, lengths), rtol=1e-12, atol=1e-12)


def test_losses_equal_torch():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 3, generator=g)
    labels = torch.tensor([0, 2, -100, 1])
    loss, count = task_loss(logits, labels, TaskSpec("multiclass", 3))
    torch.testing.assert_close(loss, F.cross_entropy(logits[[0, 1, 3]], labels[[0, 1, 3]], reduction="sum"))
    assert count == 3
    y = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0], [math.nan] * 3, [1.0, 1.0, 0.0]])
    loss, count = task_loss(logits, y, TaskSpec("multilabel", 3))
    keep = [0, 1, 3]
    torch.testing.assert_close(loss, 3 * F.binary_cross_entropy_with_logits(logits[keep], y[keep]))
    spec = TaskSpec("regression", 3, target_mean=(1.0, 2.0, 3.0), target_std=(2.0, 4.0, 0.5))
    loss, count = task_loss(logits, y, spec)
    z = (y[keep] - torch.tensor([1.0, 2.0, 3.0])) / torch.tensor([2.0, 4.0, 0.5])
    torch.testing.assert_close(loss, 3 * F.mse_loss(logits[keep], z))
    torch.testing.assert_close(spec.predictions(spec.standardize(y[keep])), y[keep])
    tok = torch.randn(2, 5, 4, generator=g)
    tl = torch.tensor([[0, 1, 2, 3, -100], [3, -100, -100, 0, 1]])
    loss, count = task_loss(tok, tl, TaskSpec("token", 4))
    torch.testing.assert_close(loss, F.cross_entropy(tok.reshape(-1, 4), tl.reshape(-1), reduction="sum"))
    assert count == 7


def test_bad_specs_are_named():
    for kwargs, words in [(dict(kind="ranking"), "task.kind='ranking'"), (dict(kind="binary", num_labels=3), "2"),
                          (dict(kind="multiclass", pooling="max"), "task.pooling='max'")]:
        with pytest.raises(ValueError, match=words):
            TaskSpec(**kwargs)
    assert TaskSpec.from_dict(TaskSpec("token", 3).to_dict()) == TaskSpec("token", 3)


@pytest.mark.parametrize("shape", ["debug", "llama"])
def test_head_on_a_genslm_trains_the_backbone_and_head(shape):
    cfg = (GenSLMConfig.preset("debug") if shape == "debug" else
           GenSLMConfig.preset("debug", mlp="swiglu", norm="rmsnorm", parallel_residual=False,
                               position_embedding="rotary", rotary_pct=1.0))
    torch.manual_seed(0)
    task = GenSLMForTask(GenSLM(cfg), TaskSpec("token", 3))
    ids = torch.randint(0, cfg.vocab_size, (2, 7))
    pos = torch.arange(7).expand(2, 7)
    logits = task(ids, pos, torch.ones(2, 7, dtype=torch.bool))
    assert logits.shape == (2, 7, 3)
    task_loss(logits, torch.randint(0, 3, (2, 7)), task.spec)[0].backward()
    assert task.model.embed_out.weight.grad is None  # the LM's head is not used
    assert task.head.score.weight.grad.abs().sum() > 0
    assert task.model.layers[0].mlp.dense_h_to_4h.weight.grad.abs().sum() > 0
