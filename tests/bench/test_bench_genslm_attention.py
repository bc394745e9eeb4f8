"""``ds4sci bench genslm-attention-memory``: one GenSLM attention layer's memory vs sequence length.

The end-to-end tests run the command at tiny sizes (S = 256, 512, 1024, hidden 32), each run in a process of its
own forked from the tests' fork server (tests/harness_checks.py) rather than a fresh interpreter; the rest checks the
pieces in this process: both paths compute the same step, the growth-exponent fit, the prediction that keeps
over-limit runs from starting, the address-space cap behind it (in a fresh interpreter, as the command runs it), and
one error line for a user's mistake.
"""
import json
import logging

import pytest
import torch

from ds4sci import cli
from ds4sci.bench import genslm_attention_memory as bench
from ds4sci.bench import genslm_attention_step
from ds4sci.bench import memory

from harness_checks import run_in_forked_process  # tests/ is on sys.path (its conftest.py)

TINY = {"hidden": 32, "heads": 4, "batch": 1, "position": "rotary", "doc_len": 100, "dtype": "fp32",
        "device": "cpu", "threads": 1, "seed": 0, "time_limit_s": None, "memory_limit_bytes": 2**30}


def test_alibi_saved_bytes_linear_after_quadratic_before(tmp_path, monkeypatch):
    """The memory-efficient core's claim at tiny sizes: with ALiBi the old path saves an S x S softmax, the default
    core O(S)."""
    monkeypatch.setattr(memory, "run_in_subprocess", run_in_forked_process)
    out = tmp_path / "bench"
    assert cli.main(["bench", "genslm-attention-memory", "--seq-lens", "256,512,1K", "--modes", "alibi",
                     "--hidden", "32", "--heads", "4", "--threads", "1", "--device", "cpu", "--out", str(out)]) == 0
    report = json.loads((out / "genslm_attention_memory.json").read_text())
    markdown = (out / "genslm_attention_memory.md").read_text()
    assert (out / "genslm_attention_memory.png").stat().st_size > 0  # matplotlib is an install requirement
    runs = {(r["path"], r["seq_len"]): r for r in report["runs"]}
    assert len(runs) == 6 and all(r["status"] == "ok" for r in runs.values())
    assert runs["after", 1024]["kernel"] == "chunked" and runs["before", 1024]["kernel"] == "sdpa"
    exponents = report["exponents"]["alibi"]
    assert exponents["after"]["saved"] < 1.3, exponents
    assert exponents["before"]["saved"] > 1.7, exponents
    # the explicit softmax alone: [B, H, S, S] fp32 probabilities
    assert runs["before", 1024]["saved_bytes"] >= 4 * 1024**2 * 4 > 10 * runs["after", 1024]["saved_bytes"]
    assert report["ratios"]["alibi"]["seq_len"] == 1024 and report["ratios"]["alibi"]["saved"] > 10
    assert "| S | alibi before | alibi after |" in markdown and "| 1024 |" in markdown
    assert f"| alibi | after (auto) | {exponents['after']['peak']:.2f} | {exponents['after']['saved']:.2f} | 3 |" \
        in markdown
    assert report["command"].startswith("ds4sci bench genslm-attention-memory --seq-lens 256,512,1024 --modes alibi ")


def test_quick_run_writes_json_markdown_and_png(tmp_path, monkeypatch):
    """The CI smoke run: S = 256 and 512 (--quick overrides --seq-lens), here the causal mode alone (4 runs)."""
    monkeypatch.setattr(memory, "run_in_subprocess", run_in_forked_process)
    assert cli.main(["bench", "genslm-attention-memory", "--quick", "--seq-lens", "64K", "--modes", "causal",
                     "--threads", "1", "--device", "cpu", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "genslm_attention_memory.json").read_text())
    assert report["config"]["seq_lens"] == [256, 512] and len(report["runs"]) == 4
    assert all(r["status"] == "ok" for r in report["runs"])
    assert "| 512 |" in (tmp_path / "genslm_attention_memory.md").read_text()
    assert (tmp_path / "genslm_attention_memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("mode", bench.MODES)
def test_both_paths_compute_the_same_step(mode):
    """Before and after run the same layer, inputs and loss, so the benchmark compares memory of one computation;
    documents restart positions at 0 and never span the window edge."""
    cfg = TINY | {"doc_len": 60}
    inputs = genslm_attention_step.make_inputs(cfg, mode, 300)
    if mode == "documents":
        lengths = genslm_attention_step.document_lengths(300, 60, 0)
        assert sum(lengths) == 300 and all(1 <= n <= 90 for n in lengths) and len(lengths) >= 4
        starts = torch.nonzero(inputs["position_ids"][0] == 0).flatten().tolist()
        assert len(starts) == len(lengths) == int(inputs["doc_ids"].max()) + 1
    else:
        assert inputs["doc_ids"] is None
    results = {}
    for path in bench.PATHS:
        x = inputs["x"].detach().clone().requires_grad_(True)
        layer = genslm_attention_step.build_layer(cfg, mode, path)
        loss = genslm_attention_step.step(layer, inputs | {"x": x})
        results[path] = (loss, x.grad, layer.query_key_value.weight.grad)
    for a, b in zip(results["before"], results["after"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_growth_exponent_recovers_the_power():
    lengths = [4096, 8192, 16384, 32768, 65536]
    for p in (1.0, 2.0):
        values = [50e6 + 3e3 * s**p for s in lengths]  # a constant plus a power
        assert bench.growth_exponent(lengths, values) == pytest.approx(p, abs=0.02)
    assert bench.growth_exponent([1024, 4096], [10.0, 160.0]) == pytest.approx(2.0)  # two points: the slope
    assert bench.growth_exponent([1024], [10.0]) is None
    assert bench.growth_exponent([1024, 2048], [0.0, 5.0]) is None


def test_over_limit_runs_are_predicted_and_not_launched(tmp_path, monkeypatch):
    """Quadratic extrapolation from the largest smaller S; runs over the memory or time limit, and larger S after
    a failure, are reported and never launched."""
    assert bench.predict_peak_bytes(TINY, "alibi", "before", 8192, {2048: 10, 4096: 100}) == 400
    assert bench.predict_peak_bytes(TINY, "alibi", "before", 4096, {}) == bench.analytic_peak_bytes(
        TINY, "before", 4096) > 8 * 4 * 4096**2 * 4
    launched = []

    def fake_run(target, cfg, mode, path, seq_len, env=None):
        launched.append((path, seq_len))
        if path == "after" and seq_len == 512:
            raise RuntimeError("measure failed in its subprocess:\nRuntimeError: out of memory")
        return {"peak_bytes": seq_len**2 * (64 if path == "before" else 0.01), "saved_bytes": seq_len * 100,
                "seconds": 0.1 if path == "before" else seq_len / 1000, "kernel": "x"}

    monkeypatch.setattr(memory, "run_in_subprocess", fake_run)
    out = tmp_path / "bench"
    status = cli.main(["bench", "genslm-attention-memory", "--seq-lens", "256,512,1024,2048", "--modes", "alibi",
                       "--memory-limit-gib", "0.1", "--time-limit-s", "10", "--hidden", "32", "--out", str(out)])
    assert status == 1  # a run failed
    # before: 256^2 * 64 = 4 MiB, 16 MiB, 64 MiB; 2048 predicted 256 MiB > 102 MiB
    assert launched == [("before", 256), ("after", 256), ("before", 512), ("after", 512), ("before", 1024)]
    report = json.loads((out / "genslm_attention_memory.json").read_text())
    runs = {(r["path"], r["seq_len"]): r for r in report["runs"]}
    assert runs["before", 2048]["reason"] == "predicted 0.25 GiB > limit 0.10 GiB"
    assert runs["after", 512]["status"] == "failed" and runs["after", 512]["error"] == "RuntimeError: out of memory"
    assert runs["after", 1024]["reason"] == "a smaller S failed"
    markdown = (out / "genslm_attention_memory.md").read_text()
    assert "not run (predicted 0.25 GiB > limit 0.10 GiB)" in markdown
    assert "failed: RuntimeError: out of memory" in markdown
    assert [bench.format_bytes(n) for n in (12 * 2**20, 2**28, 17.14 * 2**30)] == ["12 MiB", "0.25 GiB", "17.1 GiB"]
    limits = TINY | {"memory_limit_bytes": 2**20, "time_limit_s": 5.0}
    assert bench._skip_reason(limits, 2**19, 6.0) == "predicted 6 s > time limit 5 s"
    assert bench._skip_reason(limits, 2**19, 4.0) is None


def test_a_fresh_interpreter_measures_what_a_forked_process_does():
    """The command's own runner (``python -m ds4sci.bench.memory`` in a fresh interpreter) returns the measurement's
    JSON, the same saved bytes and kernel as the forked process the end-to-end tests run it in."""
    fresh = memory.run_in_subprocess(bench.MEASURE, TINY, "alibi", "after", 256)
    forked = run_in_forked_process(bench.MEASURE, TINY, "alibi", "after", 256)
    assert set(fresh) == {"peak_bytes", "saved_bytes", "seconds", "kernel"}
    assert (fresh["saved_bytes"], fresh["kernel"]) == (forked["saved_bytes"], forked["kernel"])
    assert fresh["saved_bytes"] > 0 and fresh["seconds"] > 0


def test_a_run_over_the_limit_fails_to_allocate_instead_of_exhausting_memory():
    """The subprocess caps its address space at the limit: the before path's S x S softmax (64 MiB per tensor at
    S = 2048) cannot be allocated under a 32 MiB limit."""
    cfg = TINY | {"memory_limit_bytes": 32 * 2**20, "seq_lens": [2048]}
    with pytest.raises(RuntimeError, match=r"(?is)failed in its subprocess.*(allocat|memory)"):
        memory.run_in_subprocess(bench.MEASURE, cfg, "alibi", "before", 2048)


@pytest.mark.parametrize("argv, message", [
    (["--seq-lens", "4K,abc"], "argument --seq-lens: '4K,abc': expected positive integers separated by commas"),
    (["--seq-lens", "0"], "argument --seq-lens: '0': expected positive integers separated by commas"),
    (["--modes", "causal,sliding"], "argument --modes: unknown mode 'sliding'; choose from causal,alibi,documents"),
    (["--paths", "middle"], "argument --paths: unknown path 'middle'"),
])
def test_bad_argument_is_one_error_line(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "genslm-attention-memory", *argv, "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and message in err
    assert len([line for line in err.splitlines() if "error:" in line]) == 1


def test_impossible_shape_is_one_error_line(caplog, tmp_path):
    with caplog.at_level(logging.ERROR):
        status = cli.main(["bench", "genslm-attention-memory", "--hidden", "30", "--heads", "4",
                           "--out", str(tmp_path / "bench")])
    assert status == 2 and not (tmp_path / "bench").exists()
    assert [r.getMessage() for r in caplog.records] == [
        "genslm-attention-memory: --hidden 30 is not divisible by --heads 4"]
