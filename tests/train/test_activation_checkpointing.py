"""Activation checkpointing applied from outside GenSLM keeps parameter and state-dict names (exports,
checkpoints); the model's hook recomputes blocks exactly. DeepSpeed's own recomputation under SP, ZeRO and dropout
is proven in tests/distributed/test_train_offload_checkpointing.py."""
import functools

import pytest
import torch
from torch import nn

from ds4sci.models.genslm import GenSLM, GenSLMConfig
from ds4sci.train.activation_checkpointing import CheckpointedCore, apply_activation_checkpointing
from ds4sci.train.config import ActivationCheckpointingConfig


def _model():
    torch.manual_seed(0)
    return GenSLM(GenSLMConfig.preset("debug", vocab_size=11, pad_token_id=3))


def test_selective_wrapper_keeps_every_name():
    model = _model()
    names, keys = [n for n, _ in model.named_parameters()], list(model.state_dict())
    for block in model.layers:
        block.attention.core = CheckpointedCore(block.attention.core)
    assert [n for n, _ in model.named_parameters()] == names and list(model.state_dict()) == keys


def test_selective_wrapper_refuses_a_core_with_parameters():
    with pytest.raises(ValueError, match=r"parameterless attention cores; Linear has .*\['weight', 'bias'"):
        CheckpointedCore(nn.Linear(2, 2))


def test_model_checkpoint_hook_recomputes_blocks_exactly_and_only_in_training():
    ids = torch.randint(0, 11, (2, 16))
    pos = torch.arange(16).expand(2, 16)
    grads = []
    for hook in (None, functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)):
        model = _model()
        model.checkpoint_fn = hook
        calls = []
        for block in model.layers:
            block.register_forward_pre_hook(lambda *_: calls.append(1))  # recomputation may stop early
        model(ids, pos).float().pow(2).mean().backward()
        assert len(calls) == len(model.layers) * (1 if hook is None else 2)  # recomputed in backward
        grads.append([p.grad for p in model.parameters()])
        calls.clear()
        with torch.no_grad():
            model.eval()(ids, pos)
        assert len(calls) == len(model.layers)  # evaluation: the plain path
    for g, ref in zip(*grads):
        torch.testing.assert_close(g, ref, rtol=0, atol=0)


def test_tiled_mlp_is_set_on_every_block_as_a_zero3_leaf_and_keeps_every_name():
    """``tiled_mlp`` (any mode; here without checkpointing): every block's MLP tiles with ``mlp_tile`` and is a ZeRO-3
    leaf module (its parameters gathered once for all tiles); names unchanged; a bad tile is named."""
    from deepspeed.utils import z3_leaf_module

    model = _model()
    names, keys = [n for n, _ in model.named_parameters()], list(model.state_dict())
    apply_activation_checkpointing(model, ActivationCheckpointingConfig(tiled_mlp=True, mlp_tile=7))
    assert [b.mlp.tile for b in model.layers] == [7] * len(model.layers)
    assert all(z3_leaf_module(b.mlp) for b in model.layers) and not z3_leaf_module(model.layers[0])
    assert model.checkpoint_fn is None
    assert [n for n, _ in model.named_parameters()] == names and list(model.state_dict()) == keys
    plain = _model()
    apply_activation_checkpointing(plain, ActivationCheckpointingConfig(mlp_tile=7))  # tiled_mlp off: untouched
    assert [b.mlp.tile for b in plain.layers] == [0] * len(plain.layers)
    for bad in (0, -3, True):
        with pytest.raises(ValueError, match=rf"activation_checkpointing.mlp_tile={bad!r}: must be an integer >= 1"):
            apply_activation_checkpointing(plain, ActivationCheckpointingConfig(tiled_mlp=True, mlp_tile=bad))
