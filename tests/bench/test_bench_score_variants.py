"""``ds4sci bench score-variants``: the files of a --quick run, the windows each mode scores, the same-LLR guard, bad
options."""
import pytest

from ds4sci.bench import score_variants

from bench_checks import bench_args  # tests/bench/ is on sys.path
from bench_checks import quick_report  # tests/bench/ is on sys.path
from bench_checks import refused_in_one_line  # tests/bench/ is on sys.path


def test_quick_run_writes_the_report(tmp_path):
    report = quick_report(tmp_path, "score-variants")
    c = report["config"]
    assert (c["positions"], c["context"], c["rounds"]) == (6, 64, 2)
    assert report["command"].startswith("ds4sci bench score-variants --positions 6 --start 100000 --context 64 ")
    # 3 SNVs per position; shared: one REF window per position + one ALT window per variant, unshared: two per variant
    assert report["variants"] == 18 and report["windows"] == {"shared": 6 + 18, "unshared": 2 * 18}
    assert report["check"]["max_abs_llr_diff"] <= 1e-4
    assert len(report["rounds"]) == 2
    for r in report["rounds"]:
        assert set(r) == {"wall", "cpu"}
        for t in r.values():
            assert t["shared"] > 0 and t["unshared"] > 0 and t["ratio"] == pytest.approx(t["shared"] / t["unshared"])
    s = report["summary"]
    assert s["cpu"]["ratio_median"] == pytest.approx(sorted(r["cpu"]["ratio"] for r in report["rounds"])[0] / 2
                                                     + sorted(r["cpu"]["ratio"] for r in report["rounds"])[1] / 2)
    markdown = (tmp_path / "score_variants.md").read_text()
    assert markdown.count("| median |") == 1 and f"**{s['cpu']['ratio_median']:.2f}x**" in markdown
    assert "the windows ratio is 1.50" in markdown
    assert (tmp_path / "score_variants.png").read_bytes()[:4] == b"\x89PNG"


def test_guard_refuses_different_llrs(monkeypatch):
    """A way of scoring that changed the LLRs is no speed-up: the run stops before timing it."""
    original = score_variants.unshared_llrs
    monkeypatch.setattr(score_variants, "unshared_llrs", lambda *a: [x + 0.01 for x in original(*a)])
    cfg = score_variants.config_from_args(bench_args(score_variants, "--quick", "--positions", "2"))
    with pytest.raises(RuntimeError, match=r"shared and unshared REF windows give different LLRs: max \|difference\| "
                                           r"= 0.01 nats > 0.001"):
        score_variants.measure(cfg)


def test_region_past_the_record_is_one_error_line(tmp_path, capsys):
    argv = ["--start", "4646330", "--positions", "8"]
    assert refused_in_one_line(capsys, tmp_path, "score-variants", argv) == (
        "--start 4646330 + --positions 8 runs past NC_007779.1 (4646332 bases)")
