"""``ds4sci bench inference-scale``: the files of a --quick run, the corpus, the agreement guard, bad options."""
import pytest

from ds4sci.bench import inference_scale

from bench_checks import bench_args  # tests/bench/ is on sys.path
from bench_checks import quick_report  # tests/bench/ is on sys.path


def test_quick_run_writes_the_report(tmp_path):
    report = quick_report(tmp_path, "inference-scale")
    assert report["records"] == 16 and report["config"]["context"] == 64
    threads = report["config"]["threads"]  # one window at a time is a plain loop; the batched ways read in parallel
    assert report["batches_in_flight"] == {"one": 1, "bucketed": threads, "packed": threads}
    assert max(report["check"]["max_abs_ll_diff"].values()) <= inference_scale.LL_ATOL
    assert len(report["rounds"]) == 2
    for r in report["rounds"]:
        assert set(r) == {"wall", "cpu"} and all(r["cpu"][mode] > 0 for mode in inference_scale.MODES)
    s = report["summary"]
    for clock in ("wall", "cpu"):
        assert s[clock]["packed_over_one_median"] == pytest.approx(
            sum(r[clock]["packed"] / r[clock]["one"] for r in report["rounds"]) / 2)
    markdown = (tmp_path / "inference_scale.md").read_text()
    assert markdown.count("| median |") == 1 and f"packed **{s['wall']['packed_over_one_median']:.2f}x**" in markdown
    assert f"per CPU second packed {s['cpu']['packed_over_one_median']:.2f}x" in markdown
    assert (tmp_path / "inference_scale.png").read_bytes()[:4] == b"\x89PNG"


def test_corpus_mixes_genes_and_genome_pieces():
    cfg = inference_scale.config_from_args(bench_args(inference_scale, "--quick"))
    records = inference_scale.corpus(cfg)
    assert sorted(r.id.startswith("piece") for r in records) == [False] * 8 + [True] * 8
    assert all(20 <= len(r.sequence) <= 300 for r in records if r.id.startswith("piece"))
    with pytest.raises(ValueError, match="--min-bases 400 is above --max-bases 300"):
        inference_scale.config_from_args(bench_args(inference_scale, "--quick", "--min-bases", "400"))
