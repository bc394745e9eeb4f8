"""``ds4sci export-hf``: a model :func:`ds4sci.load_model` reads (a ds4sci export, a Hugging Face GPT-NeoX or Llama
directory, a GenSLM checkpoint) written as a Hugging Face transformers directory: ``AutoModelForCausalLM.
from_pretrained(OUT)`` loads it as ``GPTNeoXForCausalLM`` (a GELU MLP) or ``LlamaForCausalLM`` (a SwiGLU MLP) with
ds4sci's logits, ``AutoTokenizer.from_pretrained(OUT)`` as a ``PreTrainedTokenizerFast`` that gives ds4sci's token ids,
and ``ds4sci.load_model(OUT)`` reads it back.

The directory holds ``config.json`` (a ``GPTNeoXConfig`` or ``LlamaConfig``, written from :mod:`ds4sci.io.hf`'s table
of that architecture, the one the reader uses, plus the source's ``trained_length`` when it records one), the
weights under that architecture's names (:func:`ds4sci.models.genslm.to_gpt_neox_state_dict`,
:func:`ds4sci.models.genslm.to_llama_state_dict`) in ``model.safetensors`` or, past a size, safetensors shards with an
index (:class:`ds4sci.io.export.ExportWriter`), and the tokenizer's files
(``PreTrainedTokenizerFast.save_pretrained``'s: ``tokenizer.json``, ``tokenizer_config.json``).

The MLP picks the architecture; every other field must then fit it. A model it cannot express is refused before
anything is written, naming the field: ALiBi and a learned absolute position table (both have rotary positions
only); for GPT-NeoX grouped-query attention, RMSNorm, a sequential residual, a tied head, Llama-3 rotary scaling, an
activation transformers does not compute as ds4sci does; for Llama LayerNorm, a parallel residual, a partial rotary
(transformers' Llama rotates every head dim). The check is the reader's own mapping: the config written must read
back (:func:`ds4sci.io.weights.load_weights`) as the model's config, field by field, so a GenSLMConfig field the table
does not carry (a shape option the architecture lacks) is refused, never dropped.

The tokenizer is a ``tokenizers`` WordLevel model over ds4sci's vocabulary (same ids), with lower-case bases
upper-cased and the text split one base (nucleotide) or three (codon) at a time; any other letter is ``[UNK]``, as in
ds4sci. One difference: a trailing partial codon becomes ``[UNK]`` (as in GenSLM's own tokenizer), where ds4sci's
codon tokenizer drops it.
"""
from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

from ds4sci.data import Tokenizer
from ds4sci.io.export import TRAINED_LENGTH
from ds4sci.io.export import ExportWriter
from ds4sci.io.export import read_trained_length
from ds4sci.io.hf import GPT_NEOX_ACTIVATIONS
from ds4sci.io.hf import LLAMA3_KEYS
from ds4sci.io.weights import ARCHITECTURES
from ds4sci.io.weights import config_from_hf_json
from ds4sci.io.weights import load_model
from ds4sci.models.genslm import GenSLMConfig
from ds4sci.models.genslm import to_gpt_neox_state_dict
from ds4sci.models.genslm import to_llama_state_dict

# GenSLMConfig fields that set how ds4sci trains or runs a model, not what it computes: written (dropout and init_std
# under transformers' names, pad_token_id as the tokenizer's) but not read back, so not compared
NOT_COMPARED = ("attention_backend", "dropout", "init_std", "pad_token_id")
# why an architecture cannot express a field's value, where "transformers' <its config class> has no equivalent" says
# too little or is untrue; "{}" is the architecture's name
_POSITIONS = "transformers' {} has rotary positions only (no ALiBi bias, no learned absolute position table)"
_WHY = {"gpt_neox": {"position_embedding": _POSITIONS,
                     # transformers' GPTNeoXConfig has keys for these; ds4sci's GPT-NeoX reader does not map them yet
                     "parallel_residual": "ds4sci reads GPT-NeoX models with the parallel residual only",
                     "tie_word_embeddings": "ds4sci reads GPT-NeoX models with an untied head only"},
        "llama": {"position_embedding": _POSITIONS,
                  "rotary_pct": "transformers' {} rotates every dim of each head (its default rope ignores "
                                "partial_rotary_factor)"}}


def hf_config(config: GenSLMConfig, tokenizer: Tokenizer, where: str | Path) -> dict:
    """The ``config.json`` of ``config`` as a ``GPTNeoXForCausalLM`` (``mlp="gelu"``) or a ``LlamaForCausalLM``
    (``mlp="swiglu"``); ``where`` (the source) is what a refusal names.

    Raises:
        ValueError: ``where``, the field the architecture cannot express, its value and why.
    """
    model_type = "llama" if config.mlp == "swiglu" else "gpt_neox"
    arch = ARCHITECTURES[model_type]

    def refuse(field: str, why: str = ""):
        why = why or f"transformers' {arch.config_class} has no equivalent"
        raise ValueError(f"{where}: {field}={getattr(config, field)!r} cannot be written as a {arch.name} model: "
                         f"{why}")

    data = {"architectures": [arch.config_class.removesuffix("Config") + "ForCausalLM"], "model_type": model_type,
            **{key: getattr(config, field) for field, key in arch.names.items()},
            "attention_dropout": config.dropout, "initializer_range": config.init_std,
            "pad_token_id": tokenizer.pad_id, "bos_token_id": tokenizer.cls_id, "eos_token_id": None}
    if model_type == "gpt_neox":
        if config.activation not in GPT_NEOX_ACTIVATIONS:
            refuse("activation")
        data.update(hidden_act=GPT_NEOX_ACTIVATIONS[config.activation], use_parallel_residual=True,
                    tie_word_embeddings=False, attention_bias=True, hidden_dropout=config.dropout)
    else:
        data.update(hidden_act="silu", attention_bias=config.bias, mlp_bias=config.bias)
        if config.rotary_scaling_factor != 1.0:
            data["rope_scaling"] = {"rope_type": "llama3",
                                    **{key: getattr(config, field) for key, field in LLAMA3_KEYS.items()}}
    back = config_from_hf_json(copy.deepcopy(data), where, arch)  # transformers edits rope dicts in place
    for field in dataclasses.fields(config):
        if field.name not in NOT_COMPARED and getattr(back, field.name) != getattr(config, field.name):
            refuse(field.name, _WHY[model_type].get(field.name, "").format(arch.name))
    # transformers' count; ds4sci's rotary_dim rounds it down to even
    rotated = int(config.head_dim * config.rotary_pct)
    if rotated != config.rotary_dim:
        refuse("rotary_pct", f"it rotates {rotated} of each head's {config.head_dim} dims, an odd count that ds4sci "
                             f"rounds down to {config.rotary_dim} and transformers does not; rotary_pct="
                             f"{config.rotary_dim / config.head_dim:g} is the same ds4sci model")
    return data


def write_hf_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    """``tokenizer`` as a transformers ``PreTrainedTokenizerFast`` in ``out`` (``save_pretrained``'s files): the same
    ids for every sequence of bases (codons: of a multiple of 3 bases; module docstring)."""
    from tokenizers import Regex
    from tokenizers import Tokenizer as WordLevelTokenizer
    from tokenizers import models
    from tokenizers import normalizers
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    unk, cls, sep, pad, mask = (tokenizer.vocab[i] for i in (tokenizer.unk_id, tokenizer.cls_id, tokenizer.sep_id,
                                                            tokenizer.pad_id, tokenizer.mask_id))
    words = WordLevelTokenizer(models.WordLevel(tokenizer.token_to_id, unk_token=unk))
    words.normalizer = normalizers.Sequence([normalizers.Replace(base.lower(), base) for base in "ACGTN"])
    # every character counts, newlines too, as in ds4sci's byte tables
    words.pre_tokenizer = pre_tokenizers.Split(Regex(f"[\\s\\S]{{{tokenizer.bases_per_token}}}"), "isolated")
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token=unk, cls_token=cls, bos_token=cls, sep_token=sep,
                            pad_token=pad, mask_token=mask).save_pretrained(out)


class HFExportWriter(ExportWriter):
    """:class:`ExportWriter` (the same safetensors files and index) that describes the weights for transformers:
    ``hf_config`` as ``config.json`` and the tokenizer's files (:func:`write_hf_tokenizer`)."""

    def __init__(self, out_dir: str | Path, config: GenSLMConfig, tokenizer: Tokenizer, hf_config: dict,
                 max_shard_bytes: int | None = None):
        super().__init__(out_dir, config, tokenizer, max_shard_bytes)
        self.hf_config = hf_config

    def describe(self) -> None:
        (self.out / "config.json").write_text(json.dumps(self.hf_config, indent=1))
        write_hf_tokenizer(self.tokenizer, self.out)


def export_dir(out: str | Path, overwrite: bool) -> Path:
    """``out`` as a :class:`~pathlib.Path` when a transformers export may be written to it: missing, empty, or a
    directory whose files ``overwrite`` lets the export replace.

    Raises:
        FileExistsError: ``out`` is not a directory, or holds files and ``overwrite`` is false.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out}: not empty; pass --overwrite to replace the model files in it")
    return out


def export_hf(source: str | Path, out: str | Path, overwrite: bool = False,
              max_shard_bytes: int | None = None) -> Path:
    """Write the model at ``source`` (anything :func:`ds4sci.load_model` reads) to ``out`` as a transformers
    ``GPTNeoXForCausalLM`` or ``LlamaForCausalLM`` directory (module docstring). ``out`` must be missing or empty
    unless ``overwrite``: then the files written replace those of the same names, and a previous export's safetensors
    weights go.

    Raises:
        FileExistsError: ``out`` holds files and ``overwrite`` is false.
        ValueError: the source cannot be read, or the architecture its MLP picks cannot express its model
            (:func:`hf_config`).
    """
    out = export_dir(out, overwrite)
    model, config, tokenizer = load_model(source)
    data = hf_config(config, tokenizer, source)
    trained = read_trained_length(source)
    if trained is not None:  # an extra key transformers keeps as a config attribute; read back by ds4sci
        data[TRAINED_LENGTH] = trained
    writer = HFExportWriter(out, config, tokenizer, data, max_shard_bytes)
    state = to_llama_state_dict(model) if data["model_type"] == "llama" else to_gpt_neox_state_dict(model)
    for name, tensor in state.items():
        writer.add(name, tensor)
    return writer.close()
