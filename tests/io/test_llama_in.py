"""``LlamaForCausalLM`` directories in (issue 26, item 3): a transformers-written one (GQA, SwiGLU, RMSNorm, rope_theta
500000 with Llama-3 scaling; safetensors, sharded, ``.bin``; untied, tied, biased) gives transformers' fp32 logits
through ``ds4sci.load_model`` and transformers' loss through ``model.init_from``; what GenSLM cannot hold is refused
naming the key."""
import pytest
import torch

import ds4sci
from ds4sci.data import NucleotideTokenizer
from ds4sci.io.weights import load_weights
from ds4sci.models.genslm import lm_loss
from ds4sci.train.config import load_config
from ds4sci.train.init_from import initial_model

transformers = pytest.importorskip("transformers")

VOCAB = NucleotideTokenizer().vocab_size
# head_dim 16 -> rotary wavelengths 6.3, 32, 167, ... positions: with original 64, low 1, high 4 the Llama-3 scaling
# keeps the first (< 16), interpolates the second (16 .. 64) and stretches the rest (> 64)
LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, hidden_act="silu",
             tie_word_embeddings=False, attention_bias=False, mlp_bias=False, pad_token_id=3,
             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64})


def _hf_llama(tmp_path, layout="safetensors", seed=0, **changes):
    """A LlamaForCausalLM with non-trivial values everywhere (norms too), saved under ``tmp_path``."""
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA, **changes})).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    hf.save_pretrained(tmp_path, max_shard_size="40KB" if layout == "sharded" else "5GB")
    if layout == "sharded":
        assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    if layout == "bin":  # transformers 5 writes safetensors only; < 5 wrote the state dict's pickle under this name
        for file in tmp_path.glob("model*.safetensors*"):
            file.unlink()
        torch.save({k: v.clone() for k, v in hf.state_dict().items()}, tmp_path / "pytorch_model.bin")
    return hf


def _batch(n=2, length=96):
    torch.manual_seed(1)
    return torch.randint(4, VOCAB, (n, length)), torch.arange(length).expand(n, length)


@pytest.mark.parametrize("layout, changes", [
    ("safetensors", {}), ("sharded", {}), ("bin", {}),
    ("safetensors", {"tie_word_embeddings": True}),
    ("safetensors", {"attention_bias": True, "mlp_bias": True, "num_key_value_heads": 1,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
])
def test_llama_directory_gives_transformers_logits(tmp_path, layout, changes):
    hf = _hf_llama(tmp_path, layout, **changes)
    model, config, tokenizer = ds4sci.load_model(tmp_path)
    assert tokenizer.kind == "nucleotide" and not model.training
    assert (config.num_kv_heads, config.mlp, config.norm, config.parallel_residual) == (
        changes.get("num_key_value_heads", 2), "swiglu", "rmsnorm", False)
    assert config.tie_word_embeddings == changes.get("tie_word_embeddings", False)
    assert (model.embed_out.weight is model.embed_in.weight) == config.tie_word_embeddings
    assert config.num_parameters() == sum(p.numel() for p in hf.parameters()) == sum(
        p.numel() for p in model.parameters())
    ids, positions = _batch()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, positions), hf(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_init_from_a_llama_directory_starts_at_transformers_loss(tmp_path):
    """``model.init_from`` builds the run's model from the directory: its first loss on a batch is transformers' own."""
    hf = _hf_llama(tmp_path / "llama")
    (tmp_path / "run.yaml").write_text(f"model:\n  init_from: {tmp_path / 'llama'}\ndata:\n  tokenizer: nucleotide\n")
    model = initial_model(load_config(str(tmp_path / "run.yaml")), NucleotideTokenizer())
    ids, positions = _batch()
    with torch.no_grad():
        ours = lm_loss(model(ids, positions), ids).item()
        theirs = hf(input_ids=ids, labels=ids).loss.item()
    assert abs(ours - theirs) < 1e-5, (ours, theirs)


def test_llama_refusals_name_key_and_sizes(tmp_path):
    _hf_llama(tmp_path / "v32", vocab_size=32)
    with pytest.raises(ValueError, match=r"a vocabulary of 32 ids matches no ds4sci tokenizer \(codon: 69 ids, "
                                         r"nucleotide: 10 ids"):
        load_weights(tmp_path / "v32")
    _hf_llama(tmp_path / "gelu", hidden_act="gelu")
    with pytest.raises(ValueError, match=r"config.json: hidden_act='gelu': GenSLM's SwiGLU MLP is SiLU-gated"):
        load_weights(tmp_path / "gelu")
    _hf_llama(tmp_path / "bias", attention_bias=True)
    with pytest.raises(ValueError, match=r"attention_bias=True with mlp_bias=False"):
        load_weights(tmp_path / "bias")
    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / "config.json").write_text(
        (tmp_path / "gelu" / "config.json").read_text().replace('"num_key_value_heads": 2',
                                                                '"num_key_value_heads": 2.0'))
    with pytest.raises(ValueError, match=r"kv/config.json: num_key_value_heads=2.0: expected an integer, got float"):
        load_weights(tmp_path / "kv")
    _hf_llama(tmp_path / "partial", rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                     "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0.5: transformers' Llama rotates every head dim"):
        load_weights(tmp_path / "partial")


def test_bf16_rms_norm_rounds_as_transformers(tmp_path):
    """In bf16, ds4sci's RMSNorm rounds as transformers' LlamaRMSNorm (normalised in fp32, rounded, then times the
    weight): bitwise equal at the norm, and the whole model's logits no further from the fp32 ones than twice
    transformers' own bf16 error."""
    hf = _hf_llama(tmp_path)
    model, _, _ = ds4sci.load_model(tmp_path)
    ids, positions = _batch()
    with torch.no_grad():
        want = hf(input_ids=ids).logits  # fp32
        hf, model = hf.to(torch.bfloat16), model.to(torch.bfloat16)
        x = 4 * torch.randn(2, 96, LLAMA["hidden_size"], dtype=torch.bfloat16)  # [B, T, hidden]
        assert torch.equal(model.layers[0].input_layernorm(x), hf.model.layers[0].input_layernorm(x))
        ours = (model(ids, positions).float() - want).abs().max()
        theirs = (hf(input_ids=ids).logits.float() - want).abs().max()
    assert ours <= 2 * theirs, (ours, theirs)
