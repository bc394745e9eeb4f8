"""Llama-shaped GenSLMs (issue 26, items 1 and 3): a transformers-written ``LlamaForCausalLM`` directory (GQA, SwiGLU,
RMSNorm, rope_theta 500000 with Llama-3 scaling; safetensors, sharded, ``.bin``; untied, tied, biased) gives
transformers' fp32 logits through ``ds4sci.load_model`` and transformers' loss through ``model.init_from``; the
parameter counts of the new shapes are the models'; tensor parallelism refuses what it cannot split yet."""
import pytest
import torch

import ds4sci
from ds4sci.data import NucleotideTokenizer
from ds4sci.io.weights import load_weights
from ds4sci.models.genslm import GenSLM, GenSLMConfig, lm_loss
from ds4sci.models.genslm.config import PRESETS, describe_preset
from ds4sci.parallel import ParallelDims
from ds4sci.parallel.groups import SequenceParallelGroups
from ds4sci.parallel.parallelize import parallelize
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
        (tmp_path / "gelu" / "config.json").read_text().replace('"num_key_value_heads": 2', '"num_key_value_heads": 2.0'))
    with pytest.raises(ValueError, match=r"kv/config.json: num_key_value_heads=2.0: expected an integer, got float"):
        load_weights(tmp_path / "kv")


@pytest.mark.parametrize("name", ["llama-debug", "llama-debug+tied", "llama-debug+gqa1+bias", "debug+rmsnorm+swiglu"])
def test_parameter_count_of_each_shape_is_the_models(name):
    base, *extra = name.split("+")
    changes = {"tied": {"tie_word_embeddings": True}, "gqa1": {"num_kv_heads": 1}, "bias": {"bias": True},
               "rmsnorm": {"norm": "rmsnorm"}, "swiglu": {"mlp": "swiglu", "intermediate_size": 80}}
    config = GenSLMConfig.preset(base, **{k: v for e in extra for k, v in changes[e].items()})
    model = GenSLM(config, device="meta")
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())


def test_llama_presets():
    eight = GenSLMConfig.preset("llama3-8B")
    assert (eight.hidden_size, eight.num_layers, eight.num_heads, eight.num_kv_heads, eight.intermediate_size,
            eight.rotary_base, eight.rotary_scaling_factor) == (4096, 32, 32, 8, 14336, 500000.0, 8.0)
    # Llama-3.1-8B's 8,030,261,248 parameters less its 128256-word embedding and head, plus ours of 69 words
    assert eight.num_parameters() == 8_030_261_248 - 2 * 128256 * 4096 + 2 * 69 * 4096
    assert describe_preset("llama3-8B") == ("Llama-3.1-8B's shape (hidden 4096, 32 layers, 32 heads (8 key/value), "
                                            "SwiGLU 14336): 6.98B parameters")
    assert all(describe_preset(name) for name in PRESETS)


@pytest.mark.parametrize("field, value", [("num_kv_heads", 2), ("mlp", "swiglu"), ("norm", "rmsnorm"),
                                          ("bias", False), ("parallel_residual", False),
                                          ("tie_word_embeddings", True), ("rotary_scaling_factor", 8.0)])
def test_tensor_parallelism_refuses_llama_shapes_naming_the_field(field, value):
    """Refused before any process group is used (item 2 of issue 26 has not made these shapes tensor-parallel)."""
    config = GenSLMConfig.preset("debug", **{field: value})
    dims = ParallelDims.for_world(2, tp=2)
    groups = SequenceParallelGroups(dims=dims, rank=0, tp=None, ulysses=None, ring=None, sp=None, dp=None, sdp=None,
                                    pp=None)
    with pytest.raises(ValueError, match=rf"^{field}={value!r}: tensor parallelism splits GPT-NeoX-shaped"):
        parallelize(GenSLM(config, device="meta"), groups)


def test_config_refuses_inconsistent_llama_fields():
    with pytest.raises(ValueError, match=r"num_kv_heads=3 does not divide num_heads=4"):
        GenSLMConfig.preset("llama-debug", num_kv_heads=3)
    with pytest.raises(ValueError, match=r"tie_word_embeddings=1: expected true or false, got int"):
        GenSLMConfig.preset("llama-debug", tie_word_embeddings=1)
    with pytest.raises(ValueError, match=r"activation='gelu_tanh' applies to mlp='gelu' only"):
        GenSLMConfig.preset("llama-debug", activation="gelu_tanh")
    with pytest.raises(ValueError, match=r"rotary_high_freq_factor=1.0 must exceed rotary_low_freq_factor=1.0"):
        GenSLMConfig.preset("llama-debug", rotary_high_freq_factor=1.0)
    with pytest.raises(ValueError, match=r"mlp='geglu': expected one of \('gelu', 'swiglu'\)"):
        GenSLMConfig.preset("llama-debug", mlp="geglu")
