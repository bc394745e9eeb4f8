"""A fine-tuned task model on disk, and read back (``ds4sci predict``, ``ds4sci export-hf``).

The folder a fine-tuning run exports (``train.out_dir/export``):

- ``task.json``: the task (:class:`~ds4sci.models.genslm.task.TaskSpec`: kind, classes, pooling, regression
  statistics), the LoRA settings (or null: full fine-tuning) and, with LoRA, ``base``: the ``model.init_from`` the
  adapters apply to;
- ``head.safetensors``: the head (``score.weight``, ``score.bias``, ``pool.weight`` ...);
- full fine-tuning: the backbone as a ds4sci export (``model.safetensors``, ``config.json``, ``tokenizer.json``:
  :mod:`ds4sci.io.export`, so ``ds4sci.load_model`` reads it as a language model too);
- LoRA: ``adapter_model.safetensors`` (peft's names, e.g. ``layers.0.attention.query_key_value.lora_A.weight``)
  and no backbone weights: the base (its weights, config and tokenizer) is read from ``base``.

:func:`load_task_model` builds the :class:`~ds4sci.models.genslm.task.GenSLMForTask` (adapters injected, not
merged: :func:`ds4sci.train.lora.merge_lora` folds them in). :func:`merge_task_model` (``ds4sci merge``) writes a
LoRA model merged, as the folder of a full fine-tune; ``ds4sci export-hf --merge`` writes it as transformers'.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ds4sci.data import Tokenizer
from ds4sci.io.export import export_consolidated
from ds4sci.io.export import read_trained_length
from ds4sci.io.tensors import read_tensors
from ds4sci.io.weights import load_model
from ds4sci.models.genslm import GenSLMForTask
from ds4sci.models.genslm import TaskSpec
from ds4sci.train.lora import LoraSpec
from ds4sci.train.lora import load_adapter
from ds4sci.train.lora import merge_lora

TASK_FILE, HEAD_FILE, ADAPTER_FILE = "task.json", "head.safetensors", "adapter_model.safetensors"


def write_task_files(folder: str | Path, spec: TaskSpec, head: dict[str, torch.Tensor], lora: LoraSpec | None = None,
                     base: str | None = None, adapter: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``task.json``, the head and (LoRA) the adapter into ``folder`` (beside an export's files)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"task": spec.to_dict(), "lora": None if lora is None else {"r": lora.r, "alpha": lora.alpha,
            "dropout": lora.dropout, "targets": list(lora.targets)}, "base": base}
    save_file({k: v.contiguous() for k, v in head.items()}, str(folder / HEAD_FILE))
    if adapter is not None:
        save_file({k: v.contiguous() for k, v in adapter.items()}, str(folder / ADAPTER_FILE))
    (folder / TASK_FILE).write_text(json.dumps(meta, indent=1))
    return folder


def read_task_meta(folder: str | Path) -> tuple[TaskSpec, LoraSpec | None, str | None]:
    """``(task, LoRA settings or None, base)`` of a task folder.

    Raises:
        FileNotFoundError: not a fine-tuned task model (no ``task.json``); ValueError: a malformed one.
    """
    path = Path(folder) / TASK_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{folder} is not a fine-tuned task model: {TASK_FILE} is missing (a language model "
                                f"has no head; fine-tune one with a task: section)")
    try:
        meta = json.loads(path.read_text())
        spec = TaskSpec.from_dict(meta["task"])
        lora = meta["lora"]
        lora = None if lora is None else LoraSpec(int(lora["r"]), float(lora["alpha"]), float(lora["dropout"]),
                                                  tuple(lora["targets"]))
        return spec, lora, meta.get("base")
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{path}: not a task description ({err})") from None


def load_task_model(folder: str | Path, device: str | torch.device = "cpu") -> tuple[GenSLMForTask, Tokenizer]:
    """The task model of ``folder`` in fp32, eval mode, and its tokenizer."""
    folder = Path(folder)
    spec, lora, base = read_task_meta(folder)
    if lora is None:
        backbone, _, tokenizer = load_model(folder, device="cpu")
    else:
        if not base:
            raise ValueError(f"{folder / TASK_FILE}: LoRA adapters without a base model")
        backbone, _, tokenizer = load_model(base, device="cpu")
        load_adapter(backbone, lora, read_tensors(folder / ADAPTER_FILE))
    model = GenSLMForTask(backbone, spec)
    head = read_tensors(folder / HEAD_FILE)
    model.head.load_state_dict({k: v.float() for k, v in head.items()}, strict=True)
    return model.float().to(device).eval(), tokenizer



def merge_task_model(source: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    """Write the LoRA task model at ``source`` to ``out`` with its adapters folded into the weights: the folder of a
    full fine-tune (a ds4sci export of the backbone, which ``ds4sci score`` / ``embed`` and ``ds4sci.load_model`` read
    as a language model, with ``task.json`` and the head for ``predict`` and ``export-hf``), fp32; the base's
    ``trained_length`` kept.

    Raises:
        FileExistsError: ``out`` holds files and ``overwrite`` is false.
        ValueError: ``source`` has no LoRA adapters (a full fine-tune is merged already).
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out}: not empty; pass --overwrite to replace the model files in it")
    spec, lora, base = read_task_meta(source)
    if lora is None:
        raise ValueError(f"{source}: a full fine-tune, with no LoRA adapters to merge (it is a plain export already)")
    model, tokenizer = load_task_model(source)
    backbone = merge_lora(model.model)
    export_consolidated(backbone.state_dict(), backbone.config, tokenizer, out,
                        trained_length=read_trained_length(base))
    write_task_files(out, spec, model.head.state_dict())
    return out
