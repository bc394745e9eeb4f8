"""``ds4sci export-hf`` writes, from a ds4sci export or a Hugging Face GPT-NeoX or Llama directory, a directory
transformers loads (``AutoModelForCausalLM``: ``GPTNeoXForCausalLM`` or ``LlamaForCausalLM`` with ds4sci's logits in
fp32; ``AutoTokenizer``: ds4sci's ids) and ds4sci reads back to the same config; a shape neither architecture can
express, or a non-empty OUT without ``--overwrite``, is one ``ds4sci export-hf: error:`` line, exit status 2, nothing
written."""
import dataclasses

import pytest
import torch
from safetensors import safe_open

from ds4sci.cli import main
from ds4sci.data import Tokenizer
from ds4sci.io.export import export_consolidated
from ds4sci.io.weights import load_model
from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm import GenSLMConfig

transformers = pytest.importorskip("transformers")
SEQ = "ACGTTGCAacgtNNAGGCTAGGCAXT"  # lower case, N and another letter; 8 codons and a partial one
LLAMA = dict(mlp="swiglu", norm="rmsnorm", parallel_residual=False, rotary_pct=1.0)  # with any kv heads, bias, tie


def _export(root, kind, **shape):
    """A ds4sci export of a tiny GenSLM (2 layers, hidden 32, 4 heads) with non-trivial weights: (path, model, tok)."""
    tok = Tokenizer.from_name(kind)
    cfg = GenSLMConfig(vocab_size=tok.vocab_size, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=48,
                       max_position_embeddings=64, **shape)
    torch.manual_seed(0)
    model = GenSLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # biases and norms away from their initial 0 / 1 too
            p.add_(0.05 * torch.randn_like(p))
    return export_consolidated(model.state_dict(), cfg, tok, root / f"export-{kind}"), model, tok


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1])[None])


@pytest.mark.parametrize("kind, shape, architecture", [
    ("nucleotide", dict(rotary_pct=0.5, rotary_base=500.0, activation="gelu", layer_norm_eps=1e-6),
     "GPTNeoXForCausalLM"),
    ("codon", dict(rotary_pct=0.25, activation="gelu_tanh"), "GPTNeoXForCausalLM"),
    ("nucleotide", dict(LLAMA, num_kv_heads=2, bias=False, layer_norm_eps=1e-6), "LlamaForCausalLM"),
    # head_dim 8, base 500000: wavelengths 6.3, 168, ... positions; with original 16, low 1, high 4 the Llama-3
    # scaling interpolates the first (4 .. 16) and stretches the rest (> 16)
    ("codon", dict(LLAMA, num_kv_heads=1, bias=True, tie_word_embeddings=True, rotary_base=500000.0,
                   rotary_scaling_factor=8.0, rotary_original_max_positions=16), "LlamaForCausalLM"),
])
def test_a_ds4sci_export_round_trips_through_transformers(tmp_path, kind, shape, architecture):
    source, model, tok = _export(tmp_path, kind, **shape)
    out = tmp_path / "hf"
    assert main(["export-hf", str(source), str(out)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == architecture and hf.dtype == torch.float32
    with safe_open(out / "model.safetensors", "pt") as written:  # each parameter once: a tied head is not copied
        assert len(written.keys()) == len(list(hf.parameters()))
    whole = SEQ if kind == "nucleotide" else SEQ[:24]  # ds4sci drops a trailing partial codon, transformers' [UNK]s it
    ids = tok.encode(whole)
    assert transformers.AutoTokenizer.from_pretrained(out)(whole)["input_ids"] == ids.tolist()
    ids = torch.as_tensor(ids)[None]
    want = _logits(model, ids)
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
    back, config, back_tok = load_model(out)  # ds4sci reads its own publication back
    assert back_tok.kind == kind and config == model.config
    assert torch.equal(_logits(back, ids), want)


def test_a_transformers_gpt_neox_directory_and_a_genslm_checkpoint_round_trip(tmp_path):
    """The directory as transformers saves it, written out in shards; the same model as a GenSLM Lightning
    checkpoint (``model.gpt_neox.*`` keys, the GPT-NeoX config under ``hyper_parameters``)."""
    hf_cfg = transformers.GPTNeoXConfig(
        vocab_size=69, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, rotary_pct=0.25, hidden_act="gelu_fast", tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.GPTNeoXForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "neox")
    from ds4sci.io.export_hf import export_hf

    torch.save({"state_dict": {f"model.{k}": v for k, v in hf.state_dict().items()},
                "hyper_parameters": {"model_architecture": hf_cfg.to_dict()}}, tmp_path / "genslm.ckpt")
    sharded = export_hf(tmp_path / "neox", tmp_path / "hf", max_shard_bytes=1)  # one tensor per shard, an index
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    ids = torch.randint(5, 69, (2, 17))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        for out in (sharded, export_hf(tmp_path / "genslm.ckpt", tmp_path / "from-ckpt")):
            again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
            torch.testing.assert_close(again(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)


def test_un_fusing_gives_back_transformers_own_tensors(tmp_path):
    """A transformers LlamaForCausalLM with grouped-query attention (2 query heads per key/value head) and biases,
    exported: every tensor under its own name, q/k/v split back per key/value head in query-head order."""
    from safetensors.torch import load_file

    from ds4sci.io.export_hf import export_hf

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=10, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, attention_bias=True, mlp_bias=True, max_position_embeddings=64))
    hf.save_pretrained(tmp_path / "llama")
    written = load_file(export_hf(tmp_path / "llama", tmp_path / "hf") / "model.safetensors")
    own = hf.state_dict()
    assert sorted(written) == sorted(own)
    for name, tensor in own.items():
        assert torch.equal(written[name], tensor), name


POSITIONS = "transformers' {} has rotary positions only (no ALiBi bias, no learned absolute position table)"


@pytest.mark.parametrize("shape, refusal", [
    (dict(position_embedding="alibi"), "position_embedding='alibi' cannot be written as a GPT-NeoX model: "
                                       + POSITIONS.format("GPT-NeoX")),
    (dict(position_embedding="learned"), "position_embedding='learned' cannot be written as a GPT-NeoX model: "
                                         + POSITIONS.format("GPT-NeoX")),
    (dict(rotary_pct=0.375), "rotary_pct=0.375 cannot be written as a GPT-NeoX model: it rotates 3 of each head's 8 "
                             "dims, an odd count that ds4sci rounds down to 2 and transformers does not; "
                             "rotary_pct=0.25 is the same ds4sci model"),
    (dict(parallel_residual=False), "parallel_residual=False cannot be written as a GPT-NeoX model: ds4sci reads "
                                    "GPT-NeoX models with the parallel residual only"),
    (dict(LLAMA, position_embedding="alibi"), "position_embedding='alibi' cannot be written as a Llama model: "
                                              + POSITIONS.format("Llama")),
    (dict(LLAMA, rotary_pct=0.5), "rotary_pct=0.5 cannot be written as a Llama model: transformers' Llama rotates "
                                  "every dim of each head (its default rope ignores partial_rotary_factor)"),
    (dict(LLAMA, norm="layernorm"), "norm='layernorm' cannot be written as a Llama model: transformers' LlamaConfig "
                                    "has no equivalent"),
])
def test_a_shape_transformers_cannot_express_is_one_line(tmp_path, capsys, shape, refusal):
    source, _, _ = _export(tmp_path, "nucleotide", **shape)
    out = tmp_path / "hf"
    assert main(["export-hf", str(source), str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"ds4sci export-hf: error: {source}: {refusal}"]
    assert not out.exists()


def test_a_field_the_key_table_lacks_is_refused_not_dropped(tmp_path, capsys, monkeypatch):
    """What refuses a shape option an architecture has no key for: the config written is read back and compared field
    by field; here GPT-NeoX's table loses layer_norm_eps, whose 1e-6 would read back as the default 1e-5."""
    from ds4sci.io.weights import ARCHITECTURES

    source, _, _ = _export(tmp_path, "nucleotide", layer_norm_eps=1e-6)
    neox = ARCHITECTURES["gpt_neox"]
    monkeypatch.setitem(ARCHITECTURES, "gpt_neox", dataclasses.replace(
        neox, keys={key: field for key, field in neox.keys.items() if field != "layer_norm_eps"}))
    assert main(["export-hf", str(source), str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"ds4sci export-hf: error: {source}: layer_norm_eps=1e-06 cannot be written as a GPT-NeoX model: "
        f"transformers' GPTNeoXConfig has no equivalent"]


def test_a_non_empty_out_needs_overwrite(tmp_path, capsys):
    source, _, _ = _export(tmp_path, "nucleotide")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "model-00001-of-00009.safetensors").write_bytes(b"stale")  # a previous, sharded export's
    assert main(["export-hf", str(source), str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"ds4sci export-hf: error: {out}: not empty; pass --overwrite to replace the model files in it"]
    assert main(["export-hf", str(source), str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]
    transformers.AutoModelForCausalLM.from_pretrained(out)
