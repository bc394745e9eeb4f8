"""``ds4sci export-hf``: a model :func:`ds4sci.load_model` reads (a ds4sci export, a Hugging Face GPT-NeoX directory,
a GenSLM checkpoint) written as a Hugging Face transformers directory: ``AutoModelForCausalLM.from_pretrained(OUT)``
loads it as ``GPTNeoXForCausalLM`` with ds4sci's logits, ``AutoTokenizer.from_pretrained(OUT)`` as a
``PreTrainedTokenizerFast`` that gives ds4sci's token ids, and ``ds4sci.load_model(OUT)`` reads it back.

The directory holds ``config.json`` (a ``GPTNeoXConfig``, written from :mod:`ds4sci.io.hf`'s table, the one the
reader uses), the weights under GPT-NeoX's names (:func:`ds4sci.models.genslm.to_gpt_neox_state_dict`) in
``model.safetensors`` or, past a size, safetensors shards with an index (:class:`ds4sci.io.export.ExportWriter`), and
the tokenizer's files (``PreTrainedTokenizerFast.save_pretrained``'s: ``tokenizer.json``,
``tokenizer_config.json``).

A model GPT-NeoX cannot express is refused before anything is written, naming the field: ALiBi and a learned
absolute position table (GPT-NeoX has rotary positions only), an activation transformers' GPT-NeoX does not compute
as ds4sci does. The check is the reader's own mapping: the config written must read back
(:func:`ds4sci.io.weights.load_weights`) as the model's config, field by field, so a GenSLMConfig field the table
does not carry (a shape option GPT-NeoX lacks) is refused, never dropped.

The tokenizer is a ``tokenizers`` WordLevel model over ds4sci's vocabulary (same ids), with lower-case bases
upper-cased and the text split one base (nucleotide) or three (codon) at a time; any other letter is ``[UNK]``, as in
ds4sci. One difference: a trailing partial codon becomes ``[UNK]`` (as in GenSLM's own tokenizer), where ds4sci's
codon tokenizer drops it.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ds4sci.data import Tokenizer
from ds4sci.io.export import ExportWriter
from ds4sci.io.hf import GPT_NEOX_ACTIVATIONS, GPT_NEOX_NAMES
from ds4sci.io.weights import ARCHITECTURES, _config_from_hf_json, load_model
from ds4sci.models.genslm import GenSLMConfig, to_gpt_neox_state_dict

# GenSLMConfig fields that set how ds4sci trains or runs a model, not what it computes: written (dropout and init_std
# under GPT-NeoX's names, pad_token_id as the tokenizer's) but not read back, so not compared
NOT_COMPARED = ("attention_backend", "dropout", "init_std", "pad_token_id")
# why GPT-NeoX cannot express a field's value, where "no equivalent" says too little
_WHY = {"position_embedding": "transformers' GPT-NeoX has rotary positions only (no ALiBi bias, no learned absolute "
                              "position table)"}


def gpt_neox_config(config: GenSLMConfig, tokenizer: Tokenizer, where: str | Path) -> dict:
    """The ``config.json`` of ``config`` as a ``GPTNeoXForCausalLM``; ``where`` (the source) is what a refusal names.

    Raises:
        ValueError: ``where``, the field GPT-NeoX cannot express, its value and why.
    """
    def refuse(field: str, why: str = "transformers' GPTNeoXConfig has no equivalent"):
        raise ValueError(f"{where}: {field}={getattr(config, field)!r} cannot be written as a GPT-NeoX model: {why}")

    if config.activation not in GPT_NEOX_ACTIVATIONS:
        refuse("activation")
    data = {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox",
            **{key: getattr(config, field) for field, key in GPT_NEOX_NAMES.items()},
            "hidden_act": GPT_NEOX_ACTIVATIONS[config.activation], "use_parallel_residual": True,
            "tie_word_embeddings": False, "attention_bias": True, "hidden_dropout": config.dropout,
            "attention_dropout": config.dropout, "initializer_range": config.init_std,
            "pad_token_id": tokenizer.pad_id, "bos_token_id": tokenizer.cls_id, "eos_token_id": None}
    back = _config_from_hf_json(data, where, ARCHITECTURES["gpt_neox"])
    for field in dataclasses.fields(config):
        if field.name not in NOT_COMPARED and getattr(back, field.name) != getattr(config, field.name):
            refuse(field.name, _WHY.get(field.name, "transformers' GPTNeoXConfig has no equivalent"))
    rotated = int(config.head_dim * config.rotary_pct)  # transformers' count; ds4sci's rotary_dim rounds it down to even
    if rotated != config.rotary_dim:
        refuse("rotary_pct", f"it rotates {rotated} of each head's {config.head_dim} dims, an odd count that ds4sci "
                             f"rounds down to {config.rotary_dim} and transformers does not; rotary_pct="
                             f"{config.rotary_dim / config.head_dim:g} is the same ds4sci model")
    return data


def write_hf_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    """``tokenizer`` as a transformers ``PreTrainedTokenizerFast`` in ``out`` (``save_pretrained``'s files): the same
    ids for every sequence of bases (codons: of a multiple of 3 bases; module docstring)."""
    from tokenizers import Regex, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as WordLevelTokenizer
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


def export_hf(source: str | Path, out: str | Path, overwrite: bool = False,
              max_shard_bytes: int | None = None) -> Path:
    """Write the model at ``source`` (anything :func:`ds4sci.load_model` reads) to ``out`` as a transformers
    ``GPTNeoXForCausalLM`` directory (module docstring). ``out`` must be missing or empty unless ``overwrite``: then
    the files written replace those of the same names, and a previous export's safetensors weights go.

    Raises:
        FileExistsError: ``out`` holds files and ``overwrite`` is false.
        ValueError: the source cannot be read, or GPT-NeoX cannot express its model (:func:`gpt_neox_config`).
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out}: not empty; pass --overwrite to replace the model files in it")
    model, config, tokenizer = load_model(source)
    writer = HFExportWriter(out, config, tokenizer, gpt_neox_config(config, tokenizer, source), max_shard_bytes)
    for name, tensor in to_gpt_neox_state_dict(model).items():
        writer.add(name, tensor)
    return writer.close()
