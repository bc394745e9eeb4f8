"""ds4sci.parallel.tensor_parallel in one process: how parameters are split and marked (no communication happens when
a layer is built), and the mark DeepSpeed reads. The layers' forward and backward run in
tests/distributed/test_tensor_parallel.py."""
import pytest
import torch
from torch import nn

from ds4sci.parallel.tensor_parallel import ColumnParallelLinear
from ds4sci.parallel.tensor_parallel import RegionGather
from ds4sci.parallel.tensor_parallel import RowParallelLinear
from ds4sci.parallel.tensor_parallel import TPGroup
from ds4sci.parallel.tensor_parallel import TPShard
from ds4sci.parallel.tensor_parallel import VocabParallelEmbedding
from ds4sci.parallel.tensor_parallel import tensor_parallel_plan


def _layers(rank: int, tp: int = 2) -> nn.ModuleDict:
    torch.manual_seed(0)
    group = TPGroup(None, rank, tp, None)  # building a layer only cuts this rank's piece
    return nn.ModuleDict({
        "up": ColumnParallelLinear(nn.Linear(4, 6), group, RegionGather(group), 0),
        "down": RowParallelLinear(nn.Linear(6, 4), group),
        "embed": VocabParallelEmbedding(nn.Embedding(5, 4), group),
    })


def test_split_parameters_are_the_pieces_of_the_single_device_ones():
    torch.manual_seed(0)
    full = {"up": nn.Linear(4, 6), "down": nn.Linear(6, 4), "embed": nn.Embedding(5, 4)}
    pieces = [_layers(rank) for rank in range(2)]
    plan = tensor_parallel_plan(pieces[0])
    assert plan == {"up.weight": TPShard(0, 6, 6), "up.bias": TPShard(0, 6, 6), "down.weight": TPShard(1, 6, 6),
                    "embed.weight": TPShard(0, 5, 6)}  # the row-parallel bias is replicated; the vocabulary padded
    for name, shard in plan.items():
        module, attr = name.split(".")
        whole = getattr(full[module], attr).detach()
        held = torch.cat([getattr(p[module], attr).detach() for p in pieces], dim=shard.dim)
        torch.testing.assert_close(shard.restore(held), whole, rtol=0, atol=0)
        for rank in range(2):
            assert torch.equal(shard.piece(whole, rank, 2), getattr(pieces[rank][module], attr))
    assert torch.equal(pieces[1]["embed"].weight[-1], torch.zeros(4))  # the padded vocabulary row


def test_tpshard_order_permutes_rows_and_rejects_a_wrong_size():
    shard = TPShard(0, 4, 4, order=(2, 0, 3, 1))
    full = torch.arange(4.0)[:, None].expand(4, 3)
    assert shard.piece(full, 0, 2)[:, 0].tolist() == [2.0, 0.0]
    assert shard.piece(full, 1, 2)[:, 0].tolist() == [3.0, 1.0]
    assert torch.equal(shard.restore(shard.arrange(full)), full)
    with pytest.raises(ValueError, match="full size 5 along dim 0, expected 4"):
        shard.piece(torch.zeros(5, 3), 0, 2)


def test_deepspeed_counts_split_parameters_by_their_tensor_model_parallel_mark():
    """DeepSpeed's gradient norm and ZeRO count a parameter on every TP rank when
    ``deepspeed.runtime.utils.is_model_parallel_parameter`` says so (else on TP rank 0 only): it reads the
    ``tensor_model_parallel`` attribute the split parameters carry, and replicated ones lack."""
    from deepspeed.runtime.utils import is_model_parallel_parameter

    layers = _layers(0)
    split = set(tensor_parallel_plan(layers))
    for name, p in layers.named_parameters():
        assert is_model_parallel_parameter(p) == (name in split), name
    assert "down.bias" not in split
