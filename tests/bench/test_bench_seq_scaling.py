"""``ds4sci bench seq-scaling``: the fit, the budget column, the report, and one real measurement."""
import pytest

from ds4sci.bench import seq_scaling
from ds4sci.bench.report import MIB

from bench_checks import quick_report  # tests/bench/ is on sys.path
from cli_checks import refused  # tests/ is on sys.path (its conftest.py)


def _run(scheme, P, S, mib):
    return {"scheme": scheme, "P": P, "seq_len": S, "peak_bytes_max": mib * MIB, "peak_bytes": [mib * MIB] * P}


def test_fit_and_longest_within_budget():
    # baseline: 1 MiB + 2 KiB per token; Ulysses P=2: the same per LOCAL token (the paper's claim)
    runs = [_run("baseline", 1, S, 1 + 2 * S / 1024) for S in (1024, 2048, 4096)]
    runs += [_run("ulysses", 2, S, 1 + 2 * S / 2 / 1024) for S in (1024, 2048, 4096)]
    report = {"command": "ds4sci bench seq-scaling", "runs": runs,
              "config": {"seq_lens": [1024, 2048, 4096], "degrees": [1, 2], "hidden": 8, "heads": 2, "layers": 1,
                         "budget_mib": 5.0}}
    summary = {(s["scheme"], s["P"]): s for s in seq_scaling.summarize(report)}
    a, b = seq_scaling.fit_per_token(runs[:3])
    assert a == pytest.approx(MIB) and b == pytest.approx(2 * 1024)
    assert summary["ulysses", 2]["bytes_per_local_token"] == pytest.approx(2 * 1024)
    assert summary["baseline", 1]["longest_within_budget"] == 2048  # 1 + 4 = 5 MiB fits, 9 MiB does not
    assert summary["ulysses", 2]["longest_within_budget"] == 4096
    report["summary"] = list(summary.values())
    text = seq_scaling.markdown(report)
    assert "| ulysses | 2 | 2.0 | 1.0 | 4096 | 4096 |" in text and "| baseline | 1 | 3.0 | 5.0 | 9.0 |" in text
    assert "hidden 8, 2 heads, 1 layer, rotary" in text  # counts pluralised


@pytest.mark.distributed
def test_quick_run_measures_every_rank_and_writes_the_three_files(tmp_path):
    """The CI smoke run: real gloo measurements (one peak per rank), then JSON, Markdown and PNG."""

    report = quick_report(tmp_path, "seq-scaling")
    runs = {(r["scheme"], r["P"], r["seq_len"]): r for r in report["runs"]}
    assert set(runs) == {(scheme, P, S) for scheme, P in (("baseline", 1), ("ulysses", 2), ("ring", 2))
                         for S in (256, 512)}
    for (_, P, _), run in runs.items():
        assert len(run["peak_bytes"]) == P and all(p >= 0 for p in run["peak_bytes"])
        assert run["peak_bytes_max"] == max(run["peak_bytes"])
    assert {(s["scheme"], s["P"]) for s in report["summary"]} == {("baseline", 1), ("ulysses", 2), ("ring", 2)}
    text = (tmp_path / "seq_scaling.md").read_text()
    assert "`ds4sci bench seq-scaling --quick --budget-mib 256`" in text and "| ulysses | 2 |" in text
    assert (tmp_path / "seq_scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, message", [
    (["--seq-lens", "1004", "--degrees", "1,4"], "--seq-lens [1004]: must be multiples of 8 for ring at P=4"),
    (["--layers", "0"], "--layers=0: must be > 0"),
    (["--heads", "6", "--hidden", "12", "--degrees", "4"], "--heads=6: the ulysses Ulysses degree 4 at P=4"),
])
def test_bad_arguments_one_line(argv, message, capsys):
    assert message in refused(capsys, ["bench", "seq-scaling", *argv, "--out", "/nonexistent/never"])
