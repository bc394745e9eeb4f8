"""Activation checkpointing applied from outside GenSLM keeps parameter and state-dict names (exports,
checkpoints); the model's hook recomputes blocks exactly. DeepSpeed's own recomputation under SP, ZeRO and dropout
is proven in tests/distributed/test_train_offload_checkpointing.py."""
import functools

import pytest
import torch
from torch import nn

from ds4sci.models.genslm import GenSLM, GenSLMConfig
from ds4sci.train.activation_checkpointing import CheckpointedCore


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
