"""Llama-shaped GenSLMs (issue 26, item 1): the shape options of the one GenSLM model are counted as the model holds
them, checked field by field, named by the presets; tensor parallelism (item 2) takes them where ``tp`` and the
key/value heads divide one another, and ``parallelize``, the run config and the planner refuse the rest alike."""
import pytest

from ds4sci import cli
from ds4sci.distributed import ParallelDims
from ds4sci.distributed.groups import SequenceParallelGroups
from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm import GenSLMConfig
from ds4sci.models.genslm.config import PRESETS
from ds4sci.models.genslm.config import describe_preset
from ds4sci.parallel.parallelize import parallelize
from ds4sci.planning.genslm import Cluster
from ds4sci.planning.genslm import Workload
from ds4sci.planning.genslm_search import strategies
from ds4sci.train.config import load_config


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


def test_tensor_parallelism_refuses_key_value_heads_that_do_not_divide_tp():
    """Refused before any process group is used."""
    config = GenSLMConfig.preset("llama-debug", hidden_size=96, num_heads=12, num_kv_heads=6)
    dims = ParallelDims.for_world(4, tp=4)
    groups = SequenceParallelGroups(dims=dims, rank=0, tp=None, ulysses=None, ring=None, sp=None, dp=None, sdp=None,
                                    pp=None)
    with pytest.raises(ValueError, match=r"^tp=4 and num_kv_heads=6: one must divide the other"):
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


def test_run_config_refuses_what_its_layout_cannot_split():
    load_config(overrides=["model.preset=llama-debug", "parallel.tp=2"]).validate()
    with pytest.raises(ValueError, match=r"parallel.tp=4, .*: tp=4 and num_kv_heads=6: one must divide the other"):
        load_config(overrides=["model.preset=llama-debug", "model.overrides.hidden_size=96",
                               "model.overrides.num_heads=12", "model.overrides.num_kv_heads=6",
                               "parallel.tp=4"]).validate()
    load_config(overrides=["model.preset=llama-debug", "model.overrides.tie_word_embeddings=true",
                           "parallel.pp=2"]).validate()  # DeepSpeed's tied layers keep the two stages' copies equal


def test_planner_offers_tensor_parallel_layouts_for_a_llama_shape(capsys):
    layouts = strategies(Workload(GenSLMConfig.preset("llama3-8B"), 8192), Cluster())
    assert {s.dims.tp for s in layouts} == {1, 2, 4, 8}  # 8 key/value heads: tp 8 gives one to each rank
    assert cli.main(["plan", "--preset", "llama-100M", "--seq-len", "8192", "--gpus-per-node", "6", "--tp", "6"]) == 2
    assert capsys.readouterr().err == ("ds4sci plan: error: --tp=6 and the model's 4 key/value heads: one must divide "
                                       "the other\n")


def test_gpt_neox_names_refuse_a_llama_shape():
    from ds4sci.models.genslm import to_gpt_neox_state_dict

    with pytest.raises(ValueError, match=r"^num_kv_heads=2: GPTNeoXForCausalLM's names hold GPT-NeoX-shaped GenSLMs "
                                         r"only \(num_kv_heads=4\)$"):
        to_gpt_neox_state_dict(GenSLM(GenSLMConfig.preset("llama-debug"), device="meta"))
