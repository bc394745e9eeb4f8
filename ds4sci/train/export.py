"""Consolidated model export: one directory with ``model.safetensors`` (the full GenSLM state dict, position table
unsharded), ``config.json`` (GenSLMConfig + tokenizer name) and ``tokenizer.json``. Read back with :func:`ds4sci.load_model`
(:mod:`ds4sci.train.init_from`), which also reads Hugging Face GPT-NeoX directories and GenSLM checkpoints."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ds4sci.data import Tokenizer
from ds4sci.models.genslm import GenSLMConfig


def export_consolidated(state_dict: dict[str, torch.Tensor], config: GenSLMConfig, tokenizer: Tokenizer,
                        out_dir: str | Path, rank: int = 0) -> Path:
    """Write the export (only on ``rank`` 0; other ranks return the path)."""
    out = Path(out_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state_dict.items()}, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps({"model": config.to_dict(), "tokenizer": tokenizer.kind}, indent=1))
        tokenizer.save(out / "tokenizer.json")
    return out


def read_consolidated(path: str | Path) -> tuple[dict[str, torch.Tensor], GenSLMConfig, Tokenizer]:
    """``(state dict, config, tokenizer)`` of an export directory, checked against each other; no model built."""
    path = Path(path)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path} is not a ds4sci export: {name} is missing")
    try:
        meta = json.loads((path / "config.json").read_text())
        config = GenSLMConfig.from_dict(meta["model"])
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{path / 'config.json'}: not a ds4sci export config ({err})") from None
    tokenizer = Tokenizer.load(path / "tokenizer.json")
    if tokenizer.vocab_size != config.vocab_size:
        raise ValueError(f"{path}: tokenizer has {tokenizer.vocab_size} ids but the model {config.vocab_size}")
    try:
        state_dict = load_file(str(path / "model.safetensors"))
    except SafetensorError as err:
        raise ValueError(f"{path / 'model.safetensors'}: cannot be read, truncated or corrupt ({err})") from None
    return state_dict, config, tokenizer
