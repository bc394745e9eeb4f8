"""``ds4sci export-hf`` writes, from a ds4sci export or a Hugging Face GPT-NeoX directory, a directory transformers
loads (``AutoModelForCausalLM``: ``GPTNeoXForCausalLM`` with ds4sci's logits in fp32; ``AutoTokenizer``: ds4sci's
ids) and ds4sci reads back; a shape GPT-NeoX cannot express, or a non-empty OUT without ``--overwrite``, is one
``ds4sci export-hf: error:`` line, exit status 2, nothing written."""
import pytest
import torch

from ds4sci.cli import main
from ds4sci.data import Tokenizer
from ds4sci.io.export import export_consolidated
from ds4sci.io.weights import load_model
from ds4sci.models.genslm import GenSLM, GenSLMConfig

transformers = pytest.importorskip("transformers")
SEQ = "ACGTTGCAacgtNNAGGCTAGGCAXT"  # lower case, N and another letter; 8 codons and a partial one


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


@pytest.mark.parametrize("kind, shape", [
    ("nucleotide", dict(rotary_pct=0.5, rotary_base=500.0, activation="gelu", layer_norm_eps=1e-6)),
    ("codon", dict(rotary_pct=0.25, activation="gelu_tanh")),
])
def test_a_ds4sci_export_round_trips_through_transformers(tmp_path, kind, shape):
    source, model, tok = _export(tmp_path, kind, **shape)
    out = tmp_path / "hf"
    assert main(["export-hf", str(source), str(out)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "GPTNeoXForCausalLM" and hf.dtype == torch.float32
    whole = SEQ if kind == "nucleotide" else SEQ[:24]  # ds4sci drops a trailing partial codon, transformers' [UNK]s it
    ids = tok.encode(whole)
    assert transformers.AutoTokenizer.from_pretrained(out)(whole)["input_ids"] == ids.tolist()
    ids = torch.as_tensor(ids)[None]
    want = _logits(model, ids)
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
    back, config, back_tok = load_model(out)  # ds4sci reads its own publication back
    assert back_tok.kind == kind and config.activation == shape["activation"]
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


NEOX_POSITIONS = "transformers' GPT-NeoX has rotary positions only (no ALiBi bias, no learned absolute position table)"


@pytest.mark.parametrize("shape, refusal", [
    (dict(position_embedding="alibi"), f"position_embedding='alibi' cannot be written as a GPT-NeoX model: "
                                       f"{NEOX_POSITIONS}"),
    (dict(position_embedding="learned"), f"position_embedding='learned' cannot be written as a GPT-NeoX model: "
                                         f"{NEOX_POSITIONS}"),
    (dict(rotary_pct=0.375), "rotary_pct=0.375 cannot be written as a GPT-NeoX model: it rotates 3 of each head's 8 "
                             "dims, an odd count that ds4sci rounds down to 2 and transformers does not; "
                             "rotary_pct=0.25 is the same ds4sci model"),
])
def test_a_shape_gpt_neox_cannot_express_is_one_line(tmp_path, capsys, shape, refusal):
    source, _, _ = _export(tmp_path, "nucleotide", **shape)
    out = tmp_path / "hf"
    assert main(["export-hf", str(source), str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"ds4sci export-hf: error: {source}: {refusal}"]
    assert not out.exists()


def test_a_field_the_key_table_lacks_is_refused_not_dropped(tmp_path, capsys, monkeypatch):
    """What refuses a shape option GPT-NeoX has no key for (a Llama shape's): the config written is read back and
    compared field by field; here the table loses layer_norm_eps, whose 1e-6 would read back as the default 1e-5."""
    import ds4sci.io.export_hf

    source, _, _ = _export(tmp_path, "nucleotide", layer_norm_eps=1e-6)
    names = {field: key for field, key in ds4sci.io.export_hf.GPT_NEOX_NAMES.items() if field != "layer_norm_eps"}
    monkeypatch.setattr(ds4sci.io.export_hf, "GPT_NEOX_NAMES", names)
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
