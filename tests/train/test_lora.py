"""LoRA through peft (ds4sci.train.lora): targets by name and group, only adapters trainable, the adapter state
round trip, and a merge that computes what the adapted model computes."""
import pytest
import torch

from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm import GenSLMConfig
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
