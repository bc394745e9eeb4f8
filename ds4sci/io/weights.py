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
transformers reads it), then against the shapes of the tensors (:mod:`ds4sci.io.tensors`), and nothing pickled is
ever executed. Names are GenSLM's, GPT-NeoX's or Llama's (:data:`ARCHITECTURES` holds, per ``model_type``, its keys
and converters).

Vocabularies: ds4sci's codon tokenizer has the ids of GenSLM's 69-word codon vocabulary
(``codon_wordlevel_69vocab.json``), so GenSLM's 69-id models fine-tune on ``data.tokenizer=codon`` unchanged. A
source without a ds4sci ``tokenizer.json`` is matched by its vocabulary size (69 ids: codon, 10: nucleotide) and,
when a Hugging Face ``tokenizer.json`` lies beside it, by that file's token -> id map. Any other vocabulary is
refused, never re-mapped: e.g. GenSLM's 71-word codon vocabulary, whose ``[BOS]``/``[EOS]`` shift every id.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ds4sci.data import Tokenizer
from ds4sci.io.export import read_consolidated
from ds4sci.io.hf import GPT_NEOX_KEYS
from ds4sci.io.hf import LLAMA_KEYS
from ds4sci.io.tensors import check_config
from ds4sci.io.tensors import read_checked
from ds4sci.io.tensors import read_tensors
from ds4sci.io.tensors import short_list
from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm import GenSLMConfig
from ds4sci.models.genslm import config_from_gpt_neox
from ds4sci.models.genslm import config_from_llama
from ds4sci.models.genslm import from_gpt_neox_state_dict
from ds4sci.models.genslm import from_llama_state_dict
from ds4sci.models.genslm.config import check_field

TOKENIZERS = ("codon", "nucleotide")
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
        config = config_from_hf_json(meta, path / "config.json", arch)
        state = read_checked(_hf_weight_files(path), config, path / "config.json", arch.names,
                             lambda tensors: _genslm_names(tensors, path, arch, config))
        return state, config, _tokenizer_kind(config.vocab_size, path)
    if "model" in meta and "tokenizer" in meta:
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
                         f"{model.config.num_layers} layers): missing {short_list(missing)}, unexpected "
                         f"{short_list(unexpected)}")
    for name, want in own.items():  # the model's order: the first mismatch a reader meets
        got = state_dict[name]
        if got.shape != want.shape:
            vocab = (f"; vocabulary: {got.shape[0]} ids in the source, {want.shape[0]} in the model"
                     if name in ("embed_in.weight", "embed_out.weight") else "")
            raise ValueError(f"{source}: tensor {name!r} has shape {tuple(got.shape)} in the source but "
                             f"{tuple(want.shape)} in the model{vocab}")


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


def config_from_hf_json(data: dict, where: Path | str, arch: Architecture) -> GenSLMConfig:
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


def _load_checkpoint_file(file: Path) -> tuple[dict[str, torch.Tensor], GenSLMConfig | None, str | None]:
    obj = read_tensors(file)
    config = None
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):  # a Lightning checkpoint
        arch = (obj.get("hyper_parameters") or {}).get("model_architecture")  # GenSLM's GPT-NeoX config.json
        if isinstance(arch, dict):
            config = config_from_hf_json(arch, f"{file} (hyper_parameters.model_architecture)",
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


