"""``ds4sci bench memory-breakdown``: the bytes ds4sci's position table and masks really allocate equal
the closed forms the report evaluates at the paper's lengths."""

from ds4sci import cli
from ds4sci.bench import memory_breakdown as bench

from bench_checks import quick_report  # tests/bench/ is on sys.path


def test_measured_equals_formula(tmp_path):
    out = tmp_path / "bench"
    report = quick_report(out, "memory-breakdown")
    assert [(r["seq_len"], r["P"]) for r in report["table"]] == [(256, 1), (256, 4), (512, 1), (512, 4)]
    for r in report["table"]:
        assert r["measured"] == r["formula"] == 16 * r["seq_len"] // r["P"] * 64, r
    for r in report["masks"]:
        assert r["measured"] == r["formula"], r
    assert (out / "memory_breakdown.png").stat().st_size > 0
    text = (out / "memory_breakdown.md").read_text()
    assert "| 100000 | 12.2 | 0.76 | 37.3 | 9.31 | 9.31 | 0.000745 |" in text  # hidden 8192, P = 16


def test_partitioned_table_is_one_over_p_of_the_rows():
    assert bench.measure_table(1024, 8, 8) * 8 == bench.measure_table(1024, 8, 1)


def test_bad_degree_one_line(capsys):
    assert cli.main(["bench", "memory-breakdown", "--seq-lens", "100", "--degree", "3", "--out", "/nonexistent"]) == 2
    assert "--seq-lens [100]: must be multiples of --degree=3" in capsys.readouterr().err
