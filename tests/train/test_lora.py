"""LoRA through peft (ds4sci.train.lora): targets by name and group, only adapters trainable, the adapter state
round trip, a merge that computes what the adapted model computes, and activation checkpointing (full and
selective) giving the losses and adapter gradients of the plain model."""
import pytest
import torch

from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm import GenSLMConfig
from ds4sci.train.activation_checkpointing import CheckpointedCore
from ds4sci.train.activation_checkpointing import checkpoint
from ds4sci.train.lora import LoraSpec
from ds4sci.train.lora import adapter_state_dict
from ds4sci.train.lora import apply_lora
from ds4sci.train.lora import load_adapter
from ds4sci.train.lora import merge_lora


def _model(seed=0, **over):
    torch.manual_seed(seed)
    return GenSLM(GenSLMConfig.preset("debug", **over)).double()


def _perturb(model):
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)


def test_targets_and_trainable():
    model = apply_lora(_model(mlp="swiglu"), LoraSpec(r=2, targets=("attention", "dense_4h_to_h")))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable}
    assert adapted == {"query_key_value", "dense", "dense_4h_to_h"}
    assert LoraSpec(targets=("mlp",)).modules(_model()) == ["dense_h_to_4h", "dense_4h_to_h"]
    with pytest.raises(ValueError, match="unknown target 'q_proj'"):
        LoraSpec(targets=("q_proj",)).modules(_model())


def test_adapter_round_trip_and_merge_equal_the_adapted_model():
    ids = torch.randint(0, 69, (2, 9))
    pos = torch.arange(9).expand(2, 9)
    spec = LoraSpec(r=3, alpha=6.0, targets=("attention", "mlp"))
    base = _model()(ids, pos)
    adapted = apply_lora(_model(), spec)
    torch.testing.assert_close(adapted(ids, pos), base)  # B = 0: unchanged at the start
    _perturb(adapted)
    want = adapted(ids, pos)
    assert (want - base).abs().max() > 1e-3
    state = adapter_state_dict(adapted)
    assert all(".lora_A.weight" in k or ".lora_B.weight" in k for k in state)
    reloaded = load_adapter(_model(), spec, state)
    torch.testing.assert_close(reloaded(ids, pos), want, rtol=1e-12, atol=1e-12)
    merged = merge_lora(adapted)
    assert set(merged.state_dict()) == set(_model().state_dict())
    torch.testing.assert_close(merged(ids, pos), want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_lora_under_activation_checkpointing_gives_the_losses_and_adapter_grads(mode):
    """The hooks the trainer sets (ds4sci.train.activation_checkpointing: DeepSpeed's reentrant checkpoint around
    each block, or around each attention core): with the embedding frozen, a checkpointed block's input needs no
    grad, and its adapters must get their gradients all the same."""
    ids = torch.randint(0, 69, (2, 9))
    pos = torch.arange(9).expand(2, 9)
    results = []
    for hooked in (False, True):
        model = apply_lora(_model(), LoraSpec(r=2, targets=("attention", "mlp")))
        _perturb(model)  # B != 0: every adapter's A and B get a gradient
        if hooked and mode == "full":
            model.checkpoint_fn = checkpoint
            for block in model.layers:
                block.recompute_norm = True
        elif hooked:
            for block in model.layers:
                block.attention.core = CheckpointedCore(block.attention.core)
        loss = model(ids, pos).pow(2).mean()
        loss.backward()
        results.append((loss, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (loss, grads), (ref_loss, ref_grads) = results[1], results[0]
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    assert set(grads) == set(ref_grads) and len(grads) == 2 * 2 * 4  # A, B x 4 modules x 2 layers
    for name, grad in grads.items():
        assert grad is not None, name
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
