"""``ds4sci bench generate``: the files of a --quick run (ds4sci's cached decoding, Hugging Face's cached generate
and the uncached loop on the same weights), the greedy-agreement check refusing different tokens, bad options."""
import pytest
import torch

from ds4sci.bench import generate
from ds4sci.data import CodonTokenizer

from bench_checks import bench_args  # tests/bench/ is on sys.path
from bench_checks import quick_report  # tests/bench/ is on sys.path
from bench_checks import refused_in_one_line  # tests/bench/ is on sys.path

pytest.importorskip("transformers")  # the dev extra installs it


def test_quick_run_writes_the_report(tmp_path):
    report = quick_report(tmp_path, "generate", more_threads=True)
    c = report["config"]
    assert (c["hidden"], c["prompt_len"], c["new_tokens"], c["uncached_tokens"], c["rounds"]) == (64, 8, 12, 4, 3)
    assert report["command"].startswith("ds4sci bench generate --hidden 64 --layers 2 --heads 4 --prompt-len 8 ")
    assert report["hf_model"] == "GPTNeoXForCausalLM"
    assert 0 <= report["check"]["max_abs_logit_diff"] < 1e-4 and report["check"]["greedy_tokens_agree"] is True
    assert report["machine"]["cores"] >= 1 and len(report["load"]["start"]) == 3
    assert len(report["rounds"]) == 3
    for r in report["rounds"]:
        assert set(r) == {"wall", "cpu"}
        for t in r.values():
            assert all(t[m] > 0 for m in generate.METHODS) and t["ratio"] == pytest.approx(t["ds4sci"] / t["hf"])
    markdown = (tmp_path / "generate.md").read_text()
    assert markdown.count("| median |") == 1
    for s in report["summary"].values():
        assert s["ratio_min"] <= s["ratio_q1"] <= s["ratio_median"] <= s["ratio_q3"] <= s["ratio_max"]
        assert s["uncached_tokens_per_s_median"] > 0 and s["cached_over_uncached_median"] > 0
        assert f"median **{s['ratio_median']:.3f}**" in markdown
    assert (tmp_path / "generate.png").read_bytes()[:4] == b"\x89PNG"


def test_greedy_check_refuses_different_tokens():
    """The check is computed from the tokens each method generated: a Hugging Face model whose head row of ds4sci's
    first token is negated generates another token and is refused; so is an uncached loop that drifts."""
    cfg = generate.config_from_args(bench_args(generate, "--quick"))
    tok = CodonTokenizer()
    ours, hf = generate.build_models(cfg)
    text, ids = generate.make_prompt(cfg, tok)
    run = generate.runners(ours, hf, tok, text, ids, cfg)
    tokens = {name: fn(cfg["uncached_tokens"] if name == "uncached" else cfg["new_tokens"])
              for name, fn in run.items()}
    generate.check_greedy_agreement(tokens)  # the same weights: the same tokens
    assert tokens["hf"].shape == (cfg["num_sequences"], cfg["new_tokens"])
    drifted = tokens["uncached"].clone()
    drifted[1, 2] = (drifted[1, 2] + 1) % tok.vocab_size
    with pytest.raises(RuntimeError, match=r"greedy tokens of uncached and ds4sci differ first at sequence 1, new "
                                           r"token 2: "):
        generate.check_greedy_agreement(tokens | {"uncached": drifted})
    first = int(tokens["ds4sci"][0, 0])  # ds4sci's first token: its logit, the largest, is > 0
    with torch.no_grad():
        hf.get_output_embeddings().weight[first] *= -1  # now < 0 in Hugging Face's model
    tokens["hf"] = run["hf"](cfg["new_tokens"])
    with pytest.raises(RuntimeError, match="greedy tokens of hf and ds4sci differ first at sequence 0, new token 0: "):
        generate.check_greedy_agreement(tokens)


def test_more_uncached_than_new_tokens_is_one_error_line(tmp_path, capsys):
    argv = ["--new-tokens", "8", "--uncached-tokens", "9"]
    assert refused_in_one_line(capsys, tmp_path, "generate", argv) == (
        "--uncached-tokens=9: must be at most --new-tokens=8 (its tokens are checked against ds4sci's)")
