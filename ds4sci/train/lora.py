"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") on a GenSLM through the ``peft``
library: adapters injected in place into the named linear layers (``peft.inject_adapter_in_model``), so the model
keeps its class, its forward and its other parameter names; everything but the adapters (and a task head beside the
model) is frozen, and only the adapters are saved (:func:`adapter_state_dict`, peft's own names and files, so
``PeftModel.from_pretrained`` reads them once renamed to transformers' layers: :mod:`ds4sci.io.export_task`).
:func:`merge_lora` folds them into the weights (``W + (alpha / r) B A``) and leaves a plain GenSLM.

Targets are GenSLM module names (the last part of the path: ``query_key_value``, ``dense``, ``dense_h_to_4h``,
``dense_h_to_4h_gate``, ``dense_4h_to_h``) or the groups ``attention`` (the fused q/k/v and output projections) and
``mlp`` (the MLP's projections).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ds4sci.models.genslm import GenSLM

TARGET_GROUPS = {"attention": ("query_key_value", "dense"),
                 "mlp": ("dense_h_to_4h", "dense_h_to_4h_gate", "dense_4h_to_h")}
ADAPTER = "default"  # peft's adapter name; saved state dicts drop it


@dataclass(frozen=True)
class LoraSpec:
    """Rank ``r``, scale ``alpha`` (the update is ``alpha / r * B A``), ``dropout`` on the adapter input, and the
    ``targets`` (names or groups, see the module docstring)."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("attention",)

    def modules(self, model: GenSLM) -> list[str]:
        """The module names LoRA adapts in ``model`` (expanded groups, only those the model has).

        Raises:
            ValueError: an unknown target, or targets that match no linear layer of the model.
        """
        names: list[str] = []
        for target in self.targets:
            expanded = TARGET_GROUPS.get(target, (target,))
            known = {n for group in TARGET_GROUPS.values() for n in group}
            if not set(expanded) <= known:
                raise ValueError(f"task.lora_targets: unknown target {target!r}; expected module names "
                                 f"{', '.join(sorted(known))} or groups {', '.join(TARGET_GROUPS)}")
            names += [n for n in expanded if n not in names]
        present = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        found = [n for n in names if n in present]
        if not found:
            raise ValueError(f"task.lora_targets={list(self.targets)}: no such linear layer in this model")
        return found

    def peft_config(self, model: GenSLM):
        from peft import LoraConfig

        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=self.modules(model), bias="none")


def apply_lora(model: GenSLM, spec: LoraSpec) -> GenSLM:
    """Inject ``spec``'s adapters into ``model`` (in place; returns it) and freeze every other parameter of it.
    ``B`` starts at zero (peft's default), so the model computes what it did before."""
    from peft import inject_adapter_in_model

    if spec.r < 1:
        raise ValueError(f"task.lora_r={spec.r}: the rank must be at least 1")
    inject_adapter_in_model(spec.peft_config(model), model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    return model


def has_lora(model: nn.Module) -> bool:
    return any(".lora_" in name for name, _ in model.named_parameters())


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters of ``model`` under peft's saved names (``layers.0.attention.query_key_value.lora_A.weight``),
    on the CPU, in their dtype."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().cpu() for k, v in get_peft_model_state_dict(model, adapter_name=ADAPTER).items()}


def load_adapter(model: GenSLM, spec: LoraSpec, state: dict[str, torch.Tensor]) -> GenSLM:
    """``model`` with ``spec``'s adapters injected and set to ``state`` (:func:`adapter_state_dict`'s names).

    Raises:
        ValueError: ``state`` lacks an adapter tensor the spec makes, or holds one it does not.
    """
    from peft import set_peft_model_state_dict

    apply_lora(model, spec)
    expected = set(adapter_state_dict(model))
    if expected != set(state):
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ValueError(f"adapter weights do not match the LoRA config: missing {missing[:3]}, unexpected "
                         f"{extra[:3]}")
    set_peft_model_state_dict(model, state, adapter_name=ADAPTER)
    return model


@torch.no_grad()
def merge_lora(model: GenSLM) -> GenSLM:
    """Fold every adapter into its layer's weight and put the plain ``nn.Linear`` back (in place; returns the
    model): a GenSLM with the original parameter names, computing what the adapted model computed."""
    from peft.tuners.lora import LoraLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, module.get_base_layer())
    for p in model.parameters():
        p.requires_grad_(True)
    return model
