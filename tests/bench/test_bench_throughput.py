"""``ds4sci bench throughput``: the files of a --quick run (GPT-NeoX's shape against GPTNeoXForCausalLM, Llama's
against LlamaForCausalLM), the same-function guard, the summary, bad options."""
import pytest
import torch

from ds4sci.bench import throughput

from bench_checks import bench_args  # tests/bench/ is on sys.path
from bench_checks import quick_report  # tests/bench/ is on sys.path
from bench_checks import refused_in_one_line  # tests/bench/ is on sys.path

pytest.importorskip("transformers")  # the dev extra installs it


def test_quick_run_writes_the_report(tmp_path):
    report = quick_report(tmp_path, "throughput", more_threads=True)
    c = report["config"]
    assert (c["hidden"], c["layers"], c["seq_len"], c["rounds"]) == (64, 2, 64, 3)
    assert report["command"].startswith("ds4sci bench throughput --hidden 64 --layers 2 --heads 4 --seq-len 64 ")
    assert report["hf_model"] == "GPTNeoXForCausalLM"
    assert 0 <= report["check"]["max_abs_logit_diff"] < 1e-5  # the two models compute the same function
    assert len(report["rounds"]) == 3
    for r in report["rounds"]:
        assert set(r) == {"wall", "cpu"}
        for t in r.values():
            assert t["ds4sci"] > 0 and t["hf"] > 0 and t["ratio"] == pytest.approx(t["ds4sci"] / t["hf"])
    markdown = (tmp_path / "throughput.md").read_text()
    assert markdown.count("| median |") == 1
    for s in report["summary"].values():
        assert s["ratio_min"] <= s["ratio_q1"] <= s["ratio_median"] <= s["ratio_q3"] <= s["ratio_max"]
        assert f"median **{s['ratio_median']:.3f}**" in markdown
    assert (tmp_path / "throughput.png").read_bytes()[:4] == b"\x89PNG"


def test_quick_llama_run_compares_against_llama_for_causal_lm(tmp_path):
    """Llama's shape with grouped-query attention (4 heads, 2 key/value) against transformers' LlamaForCausalLM
    holding the same weights."""
    report = quick_report(tmp_path, "throughput", "--shape", "llama", "--kv-heads", "2")
    assert (report["config"]["shape"], report["config"]["kv_heads"], report["config"]["heads"]) == ("llama", 2, 4)
    assert report["hf_model"] == "LlamaForCausalLM"  # the class built and timed
    assert "--shape llama --kv-heads 2 --rotary-pct 1.0 " in report["command"]
    assert 0 <= report["check"]["max_abs_logit_diff"] < 1e-5  # the two models compute the same function
    assert all(t["ds4sci"] > 0 and t["hf"] > 0 for r in report["rounds"] for t in r.values())
    markdown = (tmp_path / "throughput.md").read_text()
    assert markdown.startswith("# Training throughput: ds4sci GenSLM vs Hugging Face LlamaForCausalLM\n")
    assert "Llama shape (SwiGLU, RMSNorm, no biases, sequential residual): hidden 64, 2 layers, 4 heads (2 key/value)" \
        in markdown


@pytest.mark.parametrize("argv, weight", ids=["gpt-neox", "llama"], argvalues=[
    (["--quick"], lambda hf: hf.gpt_neox.layers[1].mlp.dense_4h_to_h.weight),
    (["--quick", "--shape", "llama", "--kv-heads", "1"], lambda hf: hf.model.layers[1].mlp.down_proj.weight),
])
def test_guard_refuses_models_that_differ(argv, weight):
    cfg = throughput.config_from_args(bench_args(throughput, *argv))
    ours, hf = throughput.build_models(cfg)
    ids, pos = throughput.make_batch(cfg)
    assert throughput.check_same_function(ours, hf, ids, pos) < 1e-5
    with torch.no_grad():  # one weight of one layer off by a little
        weight(hf)[3, 5] += 0.05
    with pytest.raises(RuntimeError, match=rf"{type(hf).__name__} disagree after the weight copy: max \|logits "
                                           r"difference\| = "):
        throughput.check_same_function(ours, hf, ids, pos)


def test_summary_statistics():
    rounds = [{"ds4sci": d, "hf": 1.0, "ratio": d} for d in (1.0, 4.0, 2.0, 3.0, 5.0)]
    s = throughput.summarize(rounds)
    assert (s["ratio_min"], s["ratio_q1"], s["ratio_median"], s["ratio_q3"], s["ratio_max"]) == (1, 2, 3, 4, 5)
    assert s["ds4sci_tokens_per_s_median"] == 3 and s["hf_tokens_per_s_median"] == 1


@pytest.mark.parametrize("argv, message", [
    (["--kv-heads", "2"], "--kv-heads=2: GPT-NeoX has one key/value head per query head; grouped-query attention "
                          "needs --shape llama"),
    (["--shape", "llama", "--kv-heads", "3"], "--kv-heads=3: must divide --heads=8 (or be 0)"),
    (["--shape", "llama", "--rotary-pct", "0.25"], "--rotary-pct=0.25: LlamaForCausalLM rotates every head dim (1.0)"),
])
def test_bad_options_give_one_line(argv, message, tmp_path, capsys):
    assert refused_in_one_line(capsys, tmp_path, "throughput", argv) == message
