"""Consolidated model export: one directory with the full GenSLM state dict (position table unsharded) in
``model.safetensors`` or, past :data:`MAX_SHARD_BYTES`, in ``model-0000i-of-0000n.safetensors`` shards with a
``model.safetensors.index.json`` weight map (Hugging Face's convention), ``config.json`` (GenSLMConfig, tokenizer
name and, when known, ``trained_length``: the tokens per sequence the model was trained on, what inference windows
default to, :func:`read_trained_length`) and ``tokenizer.json``. :class:`ExportWriter` takes the tensors one at a
time and writes each shard as it fills, so the writer never holds more than one shard. Read back with
:func:`ds4sci.load_model` (:mod:`ds4sci.io.weights`), which also reads Hugging Face GPT-NeoX directories and GenSLM
checkpoints."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from ds4sci.data import Tokenizer
from ds4sci.io.tensors import read_checked
from ds4sci.models.genslm import GenSLMConfig

MAX_SHARD_BYTES = 4 * 1024**3  # per safetensors file of an export
INDEX = "model.safetensors.index.json"
#: The ``config.json`` key (of a ds4sci export and of an ``export-hf`` directory) holding the training sequence length.
TRAINED_LENGTH = "trained_length"


def follow_umask(path: str | Path) -> None:
    """Give the file ``path`` the mode a plain ``open`` would (0666 less the umask): safetensors writes its files
    owner-only (0600), and an export or a checkpoint on a shared cluster is read by the group under umask 0002 or
    0022."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


class ExportWriter:
    """Writes an export directory from tensors given one at a time (:meth:`add`), then :meth:`close`: the tensors go
    into shards of at most ``max_shard_bytes`` (a larger tensor gets a shard of its own), each written when full;
    one shard is ``model.safetensors``, several are ``model-0000i-of-0000n.safetensors`` plus :data:`INDEX`.
    ``trained_length``: the training sequence length in tokens (``data.seq_len``), recorded as ``config.json``'s
    ``trained_length`` (None: not recorded)."""

    def __init__(self, out_dir: str | Path, config: GenSLMConfig, tokenizer: Tokenizer,
                 max_shard_bytes: int | None = None, *, trained_length: int | None = None):
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        for old in (*self.out.glob("model*.safetensors"), self.out / INDEX):  # a previous export's files
            old.unlink(missing_ok=True)
        self.config, self.tokenizer, self.trained_length = config, tokenizer, trained_length
        self.max_shard_bytes = MAX_SHARD_BYTES if max_shard_bytes is None else max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[set[str]] = []  # the names in each written shard
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Add ``tensor`` under ``name`` (each name once)."""
        if name in self.pending or any(name in shard for shard in self.shards):
            raise ValueError(f"{self.out}: tensor {name!r} was already added to this export")
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        value = tensor.detach().cpu().contiguous()
        if any(value.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in self.pending.values()):
            value = value.clone()  # a tied weight (tie_word_embeddings): a safetensors file holds no shared storage
        self.pending[name] = value
        self.pending_bytes += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        shard = self.out / f"shard-{len(self.shards):05d}.tmp"
        save_file(self.pending, str(shard))
        follow_umask(shard)
        self.shards.append(set(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> Path:
        if self.pending or not self.shards:
            self._flush()
        n = len(self.shards)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, name in enumerate(names):
            (self.out / f"shard-{i:05d}.tmp").replace(self.out / name)
        if n > 1:
            weight_map = {key: name for name, keys in zip(names, self.shards) for key in keys}
            (self.out / INDEX).write_text(json.dumps({"metadata": {"total_size": self.total},
                                                      "weight_map": weight_map}, indent=1))
        self.describe()
        return self.out

    def describe(self) -> None:
        """Write the files beside the weights that say what they are: ``config.json`` (GenSLMConfig, tokenizer
        name, ``trained_length`` when known) and ``tokenizer.json`` (ds4sci's;
        :class:`ds4sci.io.export_hf.HFExportWriter` writes transformers')."""
        meta = {"model": self.config.to_dict(), "tokenizer": self.tokenizer.kind}
        if self.trained_length is not None:
            meta[TRAINED_LENGTH] = self.trained_length
        (self.out / "config.json").write_text(json.dumps(meta, indent=1))
        self.tokenizer.save(self.out / "tokenizer.json")


def export_consolidated(state_dict: dict[str, torch.Tensor], config: GenSLMConfig, tokenizer: Tokenizer,
                        out_dir: str | Path, rank: int = 0, max_shard_bytes: int | None = None, *,
                        trained_length: int | None = None) -> Path:
    """Write the export of ``state_dict`` (only on ``rank`` 0; other ranks return the path); ``trained_length``: see
    :class:`ExportWriter`."""
    if rank != 0:
        return Path(out_dir)
    writer = ExportWriter(out_dir, config, tokenizer, max_shard_bytes, trained_length=trained_length)
    for name, tensor in state_dict.items():
        writer.add(name, tensor)
    return writer.close()


def read_consolidated(path: str | Path) -> tuple[dict[str, torch.Tensor], GenSLMConfig, Tokenizer]:
    """``(state dict, config, tokenizer)`` of an export directory, checked against each other (the config against
    the tokenizer and against the tensors' shapes, read from the safetensors headers before any tensor:
    :func:`ds4sci.io.tensors.check_config`); no model built."""
    path = Path(path)
    sharded = (path / INDEX).is_file() and not (path / "model.safetensors").is_file()
    for name in (INDEX if sharded else "model.safetensors", "config.json", "tokenizer.json"):
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path} is not a ds4sci export: {name} is missing")
    try:
        meta = json.loads((path / "config.json").read_text())
        model = meta["model"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{path / 'config.json'}: not a ds4sci export config ({err})") from None
    if not isinstance(model, dict):
        raise ValueError(f"{path / 'config.json'}: model: expected an object of GenSLMConfig fields, got "
                         f"{type(model).__name__}")
    try:
        config = GenSLMConfig.from_dict(model)
    except ValueError as err:
        raise ValueError(f"{path / 'config.json'}: {err}") from None
    tokenizer = Tokenizer.load(path / "tokenizer.json")
    if tokenizer.vocab_size != config.vocab_size:
        raise ValueError(f"{path / 'config.json'}: vocab_size={config.vocab_size} but tokenizer.json has "
                         f"{tokenizer.vocab_size} ids")
    files = ["model.safetensors"]
    if sharded:
        try:
            files = sorted(set(json.loads((path / INDEX).read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{path / INDEX}: not a safetensors index ({err})") from None
    missing = [file for file in files if not (path / file).is_file()]
    if missing:
        raise FileNotFoundError(f"{path / missing[0]} is missing (named by {INDEX})")
    return read_checked([path / file for file in files], config, path / "config.json"), config, tokenizer


def read_trained_length(source: str | Path) -> int | None:
    """The training sequence length (tokens) recorded in ``source``'s ``config.json`` (a ds4sci export or an
    ``export-hf`` directory), or None: a source that records none (a checkpoint file, an export written before the
    length was recorded, a model trained elsewhere).

    Raises:
        ValueError: the recorded value is not a positive integer (naming the file and the value).
    """
    path = Path(source) / "config.json"
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text()).get(TRAINED_LENGTH)
    except (json.JSONDecodeError, AttributeError) as err:
        raise ValueError(f"{path}: not a JSON object ({err})") from None
    if value is not None and (type(value) is not int or value < 1):
        raise ValueError(f"{path}: {TRAINED_LENGTH}={value!r}: expected a positive integer (tokens)")
    return value
