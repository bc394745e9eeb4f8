"""``ds4sci export-hf`` of a fine-tuned task model (:mod:`ds4sci.io.task_model`): a transformers
``GPTNeoXForSequenceClassification`` / ``LlamaForSequenceClassification`` (sequence kinds) or
``GPTNeoXForTokenClassification`` / ``LlamaForTokenClassification`` (token kind) directory, its backbone written as
:mod:`ds4sci.io.export_hf` writes a causal LM (same config rules and refusals) and the head as the class's
``score`` (``classifier`` for GPT-NeoX token classification), with ``num_labels``, ``id2label`` and
``problem_type``.

What transformers cannot express is refused, naming why: its sequence classifiers pool the last non-padding token,
so a ``mean`` or ``attention`` pooled head has no equivalent. Regression heads predict standardised targets; the
statistics are kept in ``config.json`` as ``ds4sci_target_mean`` / ``ds4sci_target_std`` (transformers' score has
no bias to fold the mean into).

LoRA: with ``merge`` the adapters are folded into the weights (one plain model); without it the base model is
written and the adapters beside it in ``OUT/adapter`` (peft's ``adapter_config.json`` and
``adapter_model.safetensors``), for ``PeftModel.from_pretrained(model, OUT/adapter)``. GPT-NeoX names match ds4sci's
layer for layer. A Llama model's adapter on the fused q/k/v projection becomes one adapter on each of transformers'
``q_proj``, ``k_proj`` and ``v_proj``: the same ``A`` (``r x hidden``) for the three, ``B``'s rows split as the
weight's (:func:`~ds4sci.models.genslm.llama.unfuse_qkv`), so each update ``B_q A`` is the fused update's rows.
"""
from __future__ import annotations

from pathlib import Path

from safetensors.torch import save_file

from ds4sci.io.export_hf import HFExportWriter
from ds4sci.io.export_hf import export_dir
from ds4sci.io.export_hf import hf_config
from ds4sci.io.task_model import load_task_model
from ds4sci.io.task_model import read_task_meta
from ds4sci.io.weights import load_model
from ds4sci.models.genslm import to_gpt_neox_state_dict
from ds4sci.models.genslm import to_llama_state_dict
from ds4sci.models.genslm.llama import LLAMA_LAYER_NAMES
from ds4sci.models.genslm.llama import unfuse_qkv
from ds4sci.train.lora import merge_lora

PROBLEM_TYPES = {"binary": "single_label_classification", "multiclass": "single_label_classification",
                 "multilabel": "multi_label_classification", "regression": "regression",
                 "token": "single_label_classification"}
ADAPTER_DIR = "adapter"


def export_task_hf(source: str | Path, out: str | Path, overwrite: bool = False, merge: bool = False) -> Path:
    """Write the task model at ``source`` to ``out`` as a transformers classifier (module docstring).

    Raises:
        FileExistsError: ``out`` holds files and ``overwrite`` is false.
        ValueError: a head or model transformers cannot express.
    """
    out = export_dir(out, overwrite)
    spec, lora, base = read_task_meta(source)
    if not spec.per_token and spec.pooling != "last":
        raise ValueError(f"{source}: task.pooling={spec.pooling!r} cannot be written as a transformers sequence "
                         f"classifier: its *ForSequenceClassification classes pool the last non-padding token only "
                         f"(fine-tune with task.pooling=last to export)")
    model, tokenizer = load_task_model(source)
    config = model.model.config
    data = hf_config(config, tokenizer, source)
    llama = data["model_type"] == "llama"
    adapter = lora is not None and not merge
    if lora is not None and merge:
        merge_lora(model.model)
    backbone = load_model(base)[0] if adapter else model.model  # the plain weights the adapters apply to
    prefix = "Llama" if llama else "GPTNeoX"
    kind = "TokenClassification" if spec.per_token else "SequenceClassification"
    names = list(spec.labels) or [str(i) for i in range(spec.num_labels)]
    data.update(architectures=[f"{prefix}For{kind}"], num_labels=spec.num_labels,
                id2label={str(i): n for i, n in enumerate(names)}, label2id={n: i for i, n in enumerate(names)},
                problem_type=PROBLEM_TYPES[spec.kind])
    if spec.kind == "regression" and spec.target_std:
        data.update(ds4sci_target_mean=list(spec.target_mean), ds4sci_target_std=list(spec.target_std))
    state = to_llama_state_dict(backbone) if llama else to_gpt_neox_state_dict(backbone)
    state = {k: v for k, v in state.items() if k not in ("lm_head.weight", "embed_out.weight")}
    head_name = "classifier" if spec.per_token and not llama else "score"
    state.update({f"{head_name}.{k.removeprefix('score.')}": v for k, v in model.head.state_dict().items()})
    writer = HFExportWriter(out, config, tokenizer, data)
    for name, tensor in state.items():
        writer.add(name, tensor)
    writer.close()
    if adapter:
        _write_adapter(model.model, lora, out, llama)
    return out


def _adapter_tensors(backbone, llama: bool) -> dict:
    """The adapters of ``backbone`` (a GenSLM with LoRA injected) under the names peft saves for transformers'
    classifier of that shape (``base_model.model.gpt_neox.layers.0.attention.query_key_value.lora_A.weight``, or
    Llama's ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``: the module docstring), fp32."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(backbone)  # layers.0.attention.query_key_value.lora_A.weight
    if not llama:
        return {f"base_model.model.gpt_neox.{k}": v.detach().float() for k, v in state.items()}
    config = backbone.config
    modules = {ours.removesuffix(".weight"): theirs.removesuffix(".weight")
               for theirs, ours in LLAMA_LAYER_NAMES.items() if ours.endswith(".weight")}
    out = {}
    for name, tensor in state.items():
        _, layer, rest = name.split(".", 2)
        module, lora = rest.split(".lora_")  # attention.query_key_value, A.weight
        prefix = f"base_model.model.model.layers.{layer}."
        if module == "attention.query_key_value":
            # B [(H + 2 Hkv) D, r]: its rows split as the weight's; A [r, hidden]: the same for the three, copied
            parts = (unfuse_qkv(tensor, config.num_heads, config.num_kv_heads) if lora.startswith("B") else
                     [tensor.clone() for _ in range(3)])
            for projection, part in zip(("q_proj", "k_proj", "v_proj"), parts):
                out[f"{prefix}self_attn.{projection}.lora_{lora}"] = part.detach().float()
        else:
            out[f"{prefix}{modules[module]}.lora_{lora}"] = tensor.detach().float()
    return out


def _write_adapter(backbone, lora, out: Path, llama: bool) -> None:
    """peft's files for the adapters of ``backbone`` in ``out/adapter``."""
    from peft import LoraConfig

    folder = out / ADAPTER_DIR
    folder.mkdir(exist_ok=True)
    state = _adapter_tensors(backbone, llama)
    targets = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in state})
    LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
               base_model_name_or_path=str(out)).save_pretrained(str(folder))
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "adapter_model.safetensors"))
