"""Weight files read safely, and a config checked against their shapes before any model is built.

:func:`read_checked` reads safetensors or PyTorch state dicts (shards included) once the config has passed
:func:`check_config` against the tensors' shapes (a safetensors file's from its header, before any tensor is read), so
a config that claims more than its weights hold (a billion layers, a huge vocabulary) is refused at once, naming the
file, the key and the value. Nothing pickled is ever executed: safetensors, or ``torch.load(weights_only=True)``,
which reads tensors and plain containers only (``pathlib`` paths added: GenSLM's Lightning hyper-parameters hold
them). Both readers of models use it: :mod:`ds4sci.io.export` (ds4sci exports) and :mod:`ds4sci.io.weights`
(Hugging Face directories and checkpoints).
"""
from __future__ import annotations

import pathlib
import pickle
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ds4sci.models.genslm import GenSLMConfig

# pathlib paths are plain values (constructing one runs no code); a checkpoint pickled by Python < 3.13 names them
# pathlib.PosixPath, by 3.13 pathlib._local.PosixPath.
_SAFE_GLOBALS = [(cls, f"pathlib.{cls.__name__}") for cls in
                 (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath)]


def read_checked(files: list[Path], config: GenSLMConfig, config_file: Path, names: dict[str, str] | None = None,
                 rename=lambda tensors: tensors) -> dict[str, torch.Tensor]:
    """The tensors of the weight ``files`` (safetensors, or PyTorch state dicts) under GenSLM's names (``rename``
    maps the stored names), once ``config`` has passed :func:`check_config` against their shapes: a safetensors
    file's shapes come from its header, before any tensor is read; a PyTorch file's from its tensors,
    memory-mapped (read when used)."""
    missing = [file for file in files if not file.is_file()]
    if missing:
        raise FileNotFoundError(f"{missing[0]}: no such file (named by the directory's index)")
    torch_files = {file: read_tensors(file) for file in files if file.suffix != ".safetensors"}
    shapes = {}
    for file in files:
        if file in torch_files:
            tensors = torch_files[file]
            if not (isinstance(tensors, dict) and all(isinstance(t, torch.Tensor) for t in tensors.values())):
                raise ValueError(f"{file}: not a state dict (names -> tensors)")
            shapes.update({name: tuple(t.shape) for name, t in tensors.items()})
        else:
            shapes.update(_safetensors_shapes(file))
    weights = files[0].name if len(files) == 1 else f"the shard set {files[0].name} .. {files[-1].name}"
    check_config(config, rename(shapes), config_file, weights, names)
    state = {}
    for file in files:
        state.update(torch_files[file] if file in torch_files else read_tensors(file))
    return rename(state)


def _safetensors_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the tensors in a safetensors ``file``, from its header (no tensor read)."""
    try:
        with safe_open(str(file), framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except Exception as err:  # safetensors raises its own SafetensorError for a damaged file
        raise ValueError(f"{file}: cannot be read, truncated or corrupt ({err})") from None


def read_tensors(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors ``file``, or the object of a PyTorch one (read by the safe loader)."""
    if file.suffix == ".safetensors":
        try:
            return load_file(str(file))
        except Exception as err:  # safetensors raises its own SafetensorError for a damaged file
            raise ValueError(f"{file}: cannot be read, truncated or corrupt ({err})") from None
    return _torch_load(file)


def _torch_load(file: Path):
    """``torch.load(weights_only=True)``: a pickle that needs any other class is refused, never run."""
    try:
        with torch.serialization.safe_globals(_SAFE_GLOBALS):
            try:  # memory-mapped: a rank reads only the pages of the pieces it keeps
                return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as err:
                if "mmap" not in str(err):  # only the legacy (non-zip) format cannot be mapped
                    raise
                return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        culprit = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        if culprit is None:
            detail = re.search(r"WeightsUnpickler error: \s*(.+)", str(err))
            raise ValueError(f"{file}: not a readable PyTorch file ({detail[1] if detail else err})") from None
        raise ValueError(
            f"{file}: holds a {culprit[1]} object, which the safe loader (torch.load(weights_only=True)) refuses "
            f"to construct; if you trust the file, save its tensors alone (a GenSLM checkpoint: 'state_dict' and "
            f"'hyper_parameters': {{'model_architecture': ...}}) with torch.load(weights_only=False) and torch.save, "
            f"and point to that file") from None
    except (RuntimeError, EOFError, OSError) as err:
        raise ValueError(f"{file}: not a readable PyTorch file ({err})") from None


def check_config(config: GenSLMConfig, shapes: dict[str, tuple[int, ...]], config_file: str | Path, weights: str,
                 names: dict[str, str] | None = None) -> None:
    """``config`` (read from ``config_file``) has the layer count and sizes of the tensors ``shapes`` (GenSLM's names
    -> shapes, of the weights described by ``weights``), checked from the shapes alone, before any model is built:
    a config that claims more than its weights hold (a billion layers, a huge vocabulary) is refused at once
    instead of building layers until memory runs out. Once it passes, the model is as large as the weights;
    :func:`check_weights` then compares every tensor. ``names``: the file's names of the config's fields where they
    differ (a GPT-NeoX config.json's ``num_hidden_layers``).

    Raises:
        ValueError: naming ``config_file``, the key and its value, and what the weights hold instead.
    """
    names = names or {}

    def refuse(field: str, holds: str):
        raise ValueError(f"{config_file}: {names.get(field, field)}={getattr(config, field)!r} but {weights} {holds}")

    layers = sorted({int(m[1]) for name in shapes if (m := re.match(r"layers\.(\d+)\.", name))})
    if len(layers) != config.num_layers or layers[-1] != len(layers) - 1:  # exactly 0 .. num_layers - 1
        refuse("num_layers", f"holds {_layer_range(layers)}")
    expected = {"embed_in.weight": ("vocab_size", "hidden_size"), "embed_out.weight": ("vocab_size", "hidden_size"),
                "layers.0.mlp.dense_h_to_4h.weight": ("intermediate_size", "hidden_size")}
    if config.position_embedding == "learned":
        expected["embed_pos.weight"] = ("max_position_embeddings", "hidden_size")
    for name, fields in expected.items():
        if name not in shapes:
            refuse("position_embedding" if name == "embed_pos.weight" else fields[0], f"holds no tensor {name!r}")
        shape = tuple(shapes[name])
        for i, field in enumerate(fields):
            if len(shape) != len(fields) or shape[i] != getattr(config, field):
                refuse(field, f"holds {name!r} of shape {shape}")
    qkv = shapes.get("layers.0.attention.query_key_value.weight")
    if qkv is not None and qkv[0] != (config.num_heads + 2 * config.num_kv_heads) * config.head_dim:
        refuse("num_kv_heads", f"holds 'layers.0.attention.query_key_value.weight' of shape {tuple(qkv)}")


def _layer_range(layers: list[int]) -> str:
    """``"layers 0-1 (2 layers)"``: the layer indices a state dict holds."""
    if not layers:
        return "no layers"
    if layers[-1] - layers[0] == len(layers) - 1:  # sorted, each once: no gap
        return f"layers {layers[0]}-{layers[-1]} ({len(layers)} layers)"
    return f"layers {short_list([str(i) for i in layers])} ({len(layers)} layers)"


def short_list(keys: list[str], limit: int = 6) -> str:
    """``keys`` for a message: the first ``limit`` of them and how many more (``"none"`` when empty)."""
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return "none" if not keys else ", ".join(keys[:limit]) + more
