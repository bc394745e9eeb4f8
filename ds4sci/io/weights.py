"""Reading existing GenSLM weights (:func:`load_weights`, :func:`load_into`) and whole models (:func:`load_model`,
what :func:`ds4sci.load_model` returns); a run's ``model.init_from`` is read here too (:mod:`ds4sci.train.init_from`).

Three sources, told apart by their files:

- a ds4sci export: ``model.safetensors`` (or its shards with an index), ``config.json`` and ``tokenizer.json``
  (:mod:`ds4sci.io.export`);
- a Hugging Face ``GPTNeoXForCausalLM`` or ``LlamaForCausalLM`` directory as ``save_pretrained`` writes it:
  ``config.json`` with ``"model_type": "gpt_neox"`` or ``"llama"`` and ``model.safetensors`` or ``pytorch_model.bin``
  (or their sharded form with a ``*.index.json``);
- a checkpoint file (``.pt``, ``.ckpt``, ``.bin``, ``.safetensors``): a state dict, or a PyTorch Lightning checkpoint
  holding one under ``"state_dict"``. GenSLM's released checkpoints are Lightning checkpoints of a module that keeps
  a ``GPTNeoXForCausalLM`` as ``self.model``: their keys read ``model.gpt_neox.layers.0...`` and their
  ``hyper_parameters["model_architecture"]`` is the GPT-NeoX ``config.json``, which then gives the model's shape.

A model folder is untrusted input. Its config's every value is checked for type and range
(:func:`ds4sci.models.genslm.config.check_field`; a GPT-NeoX or Llama ``config.json`` under its own key names, before
transformers reads it), then against the shapes of the tensors (:func:`check_config`: layer count, hidden, vocabulary
and MLP sizes, learned position table; a safetensors file's shapes from its header, before any tensor is read), so
a config that claims more than its weights hold is refused before any layer is built, naming the file, the key and
the value.

Names are GenSLM's, GPT-NeoX's or Llama's (:mod:`ds4sci.models.genslm.neox` and :mod:`ds4sci.models.genslm.llama`
convert them; :data:`ARCHITECTURES` holds, per ``model_type``, its keys and converters). Nothing pickled is ever
executed: safetensors, or ``torch.load(weights_only=True)``, which reads tensors and plain containers only
(:data:`_SAFE_GLOBALS` adds the ``pathlib`` paths GenSLM's Lightning hyper-parameters hold).

Vocabularies: ds4sci's codon tokenizer has the ids of GenSLM's 69-word codon vocabulary
(``codon_wordlevel_69vocab.json``), so GenSLM's 69-id models fine-tune on ``data.tokenizer=codon`` unchanged. A
source without a ds4sci ``tokenizer.json`` is matched by its vocabulary size (69 ids: codon, 10: nucleotide) and,
when a Hugging Face ``tokenizer.json`` lies beside it, by that file's token -> id map. Any other vocabulary is
refused, never re-mapped: e.g. GenSLM's 71-word codon vocabulary, whose ``[BOS]``/``[EOS]`` shift every id.
"""
from __future__ import annotations

import json
import pathlib
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ds4sci.data import Tokenizer
from ds4sci.io.hf import GPT_NEOX_KEYS, LLAMA_KEYS
from ds4sci.models.genslm import (GenSLM, GenSLMConfig, config_from_gpt_neox, config_from_llama,
                                  from_gpt_neox_state_dict, from_llama_state_dict)
from ds4sci.models.genslm.config import check_field

TOKENIZERS = ("codon", "nucleotide")
# pathlib paths are plain values (constructing one runs no code); a checkpoint pickled by Python < 3.13 names them
# pathlib.PosixPath, by 3.13 pathlib._local.PosixPath.
_SAFE_GLOBALS = [(cls, f"pathlib.{cls.__name__}") for cls in
                 (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath)]
_HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin")


@dataclass(frozen=True)
class Architecture:
    """A transformers causal LM that GenSLM can hold: its ``config.json`` keys (dotted: inside an object) -> the
    GenSLMConfig fields they become (checked by :func:`~ds4sci.models.genslm.config.check_field` before transformers
    reads the file), its config class in transformers, and the converters of its config and state dict."""

    name: str  # for messages
    prefix: str  # what its state dicts' names start with (their head's aside)
    keys: dict[str, str]
    config_class: str
    config: Callable  # transformers config -> GenSLMConfig
    state_dict: Callable  # (state dict or names -> shapes, GenSLMConfig) -> the same under GenSLM's names

    @property
    def names(self) -> dict[str, str]:
        """Field -> the top-level key that sets it: what a refusal names, and what an export writes
        (:mod:`ds4sci.io.export_hf`; transformers 4 reads these keys, 5 moves the rotary ones into rope_parameters as
        it reads them)."""
        return {field: key for key, field in self.keys.items() if "." not in key}


# config.json's model_type -> the architecture
ARCHITECTURES = {
    "gpt_neox": Architecture(
        "GPT-NeoX", "gpt_neox.", GPT_NEOX_KEYS,
        "GPTNeoXConfig", config_from_gpt_neox, lambda state, config: from_gpt_neox_state_dict(state)),
    "llama": Architecture(
        "Llama", "model.", LLAMA_KEYS,
        "LlamaConfig", config_from_llama, from_llama_state_dict),
}


def load_weights(path: str | Path) -> tuple[dict[str, torch.Tensor], GenSLMConfig | None, str | None]:
    """``(state dict under GenSLM's names, config or None, tokenizer kind or None)`` of a ds4sci export, a Hugging
    Face GPT-NeoX or Llama directory or a checkpoint file (see the module docstring). The config is None for a
    checkpoint that does not keep one; the tokenizer kind (``"codon"`` or ``"nucleotide"``) is None only for a state
    dict without an input embedding.

    Raises:
        FileNotFoundError: ``path`` does not exist, or a directory lacks the files of both formats.
        ValueError: a file the format needs cannot be read or fits no ds4sci model or tokenizer.
    """
    path = Path(path)
    if path.is_file():
        return _load_checkpoint_file(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no config.json; expected a ds4sci export (model.safetensors, config.json, "
                                f"tokenizer.json) or a Hugging Face GPT-NeoX or Llama directory (config.json and "
                                f"{' or '.join(_HF_WEIGHTS)})")
    meta = _read_json(path / "config.json")
    arch = ARCHITECTURES.get(meta.get("model_type"))
    if arch is not None:
        config = _config_from_hf_json(meta, path / "config.json", arch)
        state = read_checked(_hf_weight_files(path), config, path / "config.json", arch.names,
                             lambda tensors: _genslm_names(tensors, path, arch, config))
        return state, config, _tokenizer_kind(config.vocab_size, path)
    if "model" in meta and "tokenizer" in meta:
        from ds4sci.io.export import read_consolidated

        state, config, tokenizer = read_consolidated(path)
        return state, config, tokenizer.kind
    raise ValueError(f"{path / 'config.json'}: neither a ds4sci export config (keys model, tokenizer) nor a Hugging "
                     f"Face one GenSLM can hold (model_type={meta.get('model_type')!r}, expected one of "
                     f"{sorted(ARCHITECTURES)})")


def load_into(model: GenSLM, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """Copy ``state_dict`` into ``model`` (single-device GenSLM, before any parallelism), every tensor exactly once.

    Raises:
        ValueError: naming ``source`` and the missing / unexpected keys, or the first tensor whose shape differs
        (both shapes; for the embeddings, both vocabulary sizes).
    """
    check_weights(model, state_dict, source)
    model.load_state_dict(state_dict, strict=True)


def check_weights(model: GenSLM, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """``state_dict`` has exactly ``model``'s keys and shapes (``model`` may be on the meta device); the errors of
    :func:`load_into`."""
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
    if missing or unexpected:
        raise ValueError(f"{source}: the weights do not fit the model ({model.config.position_embedding} positions, "
                         f"{model.config.num_layers} layers): missing {_names(missing)}, unexpected "
                         f"{_names(unexpected)}")
    for name, want in own.items():  # the model's order: the first mismatch a reader meets
        got = state_dict[name]
        if got.shape != want.shape:
            vocab = (f"; vocabulary: {got.shape[0]} ids in the source, {want.shape[0]} in the model"
                     if name in ("embed_in.weight", "embed_out.weight") else "")
            raise ValueError(f"{source}: tensor {name!r} has shape {tuple(got.shape)} in the source but "
                             f"{tuple(want.shape)} in the model{vocab}")


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
    return f"layers {_names([str(i) for i in layers])} ({len(layers)} layers)"


def load_model(path: str | Path, device: str | torch.device = "cpu") -> tuple[GenSLM, GenSLMConfig, Tokenizer]:
    """``(model in eval mode on device, config, tokenizer)`` from any source :func:`load_weights` reads that keeps
    its config (what :func:`ds4sci.load_model` returns)."""
    state, config, kind = load_weights(path)
    if config is None:
        raise ValueError(f"{path}: the checkpoint keeps no model config; build GenSLM(GenSLMConfig(...)) yourself and "
                         f"copy the weights with ds4sci.io.weights.load_into")
    model = GenSLM(config)
    load_into(model, state, str(path))
    return model.to(device).eval(), config, Tokenizer.from_name(kind)


# --------------------------------------------------------------------------------------------------- reading
def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _config_from_hf_json(data: dict, where: Path | str, arch: Architecture) -> GenSLMConfig:
    """GenSLMConfig of a transformers ``config.json`` of architecture ``arch`` (read by its transformers config
    class: its defaults and key renames across versions)."""
    try:
        import transformers
    except ImportError:
        raise ValueError(f"{where}: reading a Hugging Face {arch.name} config needs transformers "
                         f"(pip install 'transformers>=4.40')") from None
    try:  # transformers >= 5 checks its configs' field types and raises this
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        StrictDataclassError = ValueError
    for key, field in arch.keys.items():  # before transformers, whose versions check types or not
        parent, _, name = key.rpartition(".")
        section = data.get(parent) if parent else data
        value = section.get(name) if isinstance(section, dict) else None
        if value is not None:  # absent: transformers' default
            try:
                check_field(field, value)
            except ValueError as err:
                raise ValueError(f"{where}: {key}={value!r}: {err}") from None
    try:
        return arch.config(getattr(transformers, arch.config_class).from_dict(data))
    except (TypeError, ValueError, StrictDataclassError) as err:  # transformers' message may span lines
        raise ValueError(f"{where}: {' '.join(str(err).split())}") from None


def _hf_weight_files(path: Path) -> list[Path]:
    for name in _HF_WEIGHTS:
        if (path / name).is_file():
            return [path / name]
        index = path / f"{name}.index.json"
        if index.is_file():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index}: no weight_map")
            return [path / file for file in sorted(set(weight_map.values()))]
    raise FileNotFoundError(f"{path}: a Hugging Face model directory without weights: expected "
                            f"{' or '.join(_HF_WEIGHTS)} (or a sharded *.index.json)")


def read_checked(files: list[Path], config: GenSLMConfig, config_file: Path, names: dict[str, str] | None = None,
                 rename=lambda tensors: tensors) -> dict[str, torch.Tensor]:
    """The tensors of the weight ``files`` (safetensors, or PyTorch state dicts) under GenSLM's names (``rename``
    maps the stored names), once ``config`` has passed :func:`check_config` against their shapes: a safetensors
    file's shapes come from its header, before any tensor is read; a PyTorch file's from its tensors,
    memory-mapped (read when used)."""
    missing = [file for file in files if not file.is_file()]
    if missing:
        raise FileNotFoundError(f"{missing[0]}: no such file (named by the directory's index)")
    torch_files = {file: _read_tensors(file) for file in files if file.suffix != ".safetensors"}
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
        state.update(torch_files[file] if file in torch_files else _read_tensors(file))
    return rename(state)


def _safetensors_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the tensors in a safetensors ``file``, from its header (no tensor read)."""
    try:
        with safe_open(str(file), framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except Exception as err:  # safetensors raises its own SafetensorError for a damaged file
        raise ValueError(f"{file}: cannot be read, truncated or corrupt ({err})") from None


def _read_tensors(file: Path) -> dict[str, torch.Tensor]:
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


def _load_checkpoint_file(file: Path) -> tuple[dict[str, torch.Tensor], GenSLMConfig | None, str | None]:
    obj = _read_tensors(file)
    config = None
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):  # a Lightning checkpoint
        arch = (obj.get("hyper_parameters") or {}).get("model_architecture")  # GenSLM's GPT-NeoX config.json
        if isinstance(arch, dict):
            config = _config_from_hf_json(arch, f"{file} (hyper_parameters.model_architecture)",
                                          ARCHITECTURES["gpt_neox"])
        obj = obj["state_dict"]
    if not (isinstance(obj, dict) and obj and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                   for k, v in obj.items())):
        raise ValueError(f"{file}: not a state dict (names -> tensors) nor a checkpoint with one under 'state_dict'")
    if all(k.startswith("model.") for k in obj):  # a LightningModule holding the network as self.model
        obj = {k[len("model."):]: v for k, v in obj.items()}
    state = _genslm_names(obj, file, ARCHITECTURES["gpt_neox"], config)
    if config is not None:
        check_config(config, {name: tuple(t.shape) for name, t in state.items()},
                     f"{file} (hyper_parameters.model_architecture)", "its state_dict",
                     ARCHITECTURES["gpt_neox"].names)
    vocab = config.vocab_size if config else (state["embed_in.weight"].shape[0] if "embed_in.weight" in state else None)
    return state, config, (_tokenizer_kind(vocab, file) if vocab is not None else None)


def _genslm_names(state: dict, where: Path, arch: Architecture, config: GenSLMConfig | None) -> dict:
    """``arch``'s names (GPT-NeoX's ``gpt_neox.*``, Llama's ``model.*``; heads ``embed_out`` / ``lm_head``) converted
    to GenSLM's; GenSLM's kept. ``state``: tensors, or their shapes."""
    if not any(k.startswith(arch.prefix) for k in state):
        return state
    try:
        return arch.state_dict(state, config)
    except KeyError as err:
        raise ValueError(f"{where}: {err.args[0]}") from None


def _tokenizer_kind(vocab_size: int, where: Path) -> str:
    """The ds4sci tokenizer whose ids a ``vocab_size``-id model was trained on (module docstring)."""
    sizes = {Tokenizer.from_name(kind).vocab_size: kind for kind in TOKENIZERS}
    if vocab_size not in sizes:
        known = ", ".join(f"{kind}: {size} ids" for size, kind in sizes.items())
        raise ValueError(f"{where}: a vocabulary of {vocab_size} ids matches no ds4sci tokenizer ({known}; the codon "
                         f"one is GenSLM's 69-word vocabulary); other vocabularies (e.g. GenSLM's 71-word one) are "
                         f"not supported")
    kind = sizes[vocab_size]
    hf_tokenizer = where / "tokenizer.json" if where.is_dir() else None
    if hf_tokenizer is not None and hf_tokenizer.is_file():
        vocab = (_read_json(hf_tokenizer).get("model") or {}).get("vocab")
        ours = {token: i for i, token in enumerate(Tokenizer.from_name(kind).vocab)}
        if vocab != ours:
            raise ValueError(f"{hf_tokenizer}: its token -> id map differs from ds4sci's {kind} tokenizer (both "
                             f"{vocab_size} ids); the weights' ids would be mis-read")
    return kind


def _names(keys: list[str], limit: int = 6) -> str:
    return "none" if not keys else ", ".join(keys[:limit]) + (f" and {len(keys) - limit} more" if len(keys) > limit else "")
