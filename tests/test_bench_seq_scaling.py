"""``ds4sci bench seq-scaling`` (issue #15): the fit, the budget column, the report, and one real measurement."""
import pytest

from ds4sci import cli
from ds4sci.bench import seq_scaling
from ds4sci.bench.report import MIB


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


@pytest.mark.distributed
def test_one_real_measurement_per_rank():
    run = seq_scaling.measure("ring", 2, 512, {"hidden": 32, "heads": 4, "layers": 1})
    assert run["P"] == 2 and len(run["peak_bytes"]) == 2 and all(p >= 0 for p in run["peak_bytes"])
    assert run["peak_bytes_max"] == max(run["peak_bytes"])


@pytest.mark.parametrize("argv, message", [
    (["--seq-lens", "1004", "--degrees", "1,4"], "--seq-lens [1004]: must be multiples of 8 for ring at P=4"),
    (["--layers", "0"], "--layers=0: must be > 0"),
    (["--heads", "6", "--hidden", "12", "--degrees", "4"], "--heads=6: the ulysses Ulysses degree 4 at P=4"),
])
def test_bad_arguments_one_line(argv, message, capsys):
    assert cli.main(["bench", "seq-scaling", *argv, "--out", "/nonexistent/never"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
