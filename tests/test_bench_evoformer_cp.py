"""``ds4sci bench evoformer-cp``: the bytes counted at the collectives of Evoformer and Pairformer blocks inside a
sharded stack at P = 2 (odd N_res included) equal the closed forms of block_comm_bytes per collective kind, on every
rank; the command writes its three files; bad options are one-line errors."""
import json

import pytest

from ds4sci import cli
from cli_checks import refused  # tests/ is on sys.path (its conftest.py)


@pytest.mark.distributed
@pytest.mark.slow
def test_measured_bytes_match_the_closed_forms(tmp_path):
    out = tmp_path / "bench"
    assert cli.main(["bench", "evoformer-cp", "--quick", "--out", str(out)]) == 0
    report = json.loads((out / "evoformer_cp.json").read_text())
    runs = [r for r in report["runs"] if r["P"] == 2]
    assert {(r["kind"], r["n_res"]) for r in runs} == {(k, n) for k in ("evoformer", "pairformer") for n in (6, 9)}
    for r in runs:
        assert r["sent_by_kind"] == r["predicted_by_kind"], r
        assert r["sent_per_block"] == r["sent_per_block_min"] == r["predicted"], r  # every rank the same
        assert r["saved_bytes"] < next(s["saved_bytes"] for s in report["runs"]
                                       if s["P"] == 1 and (s["kind"], s["n_res"]) == (r["kind"], r["n_res"]))
    assert all(r["sent_per_block"] == 0 for r in report["runs"] if r["P"] == 1)
    assert (out / "evoformer_cp.png").stat().st_size > 0
    text = (out / "evoformer_cp.md").read_text()
    assert "| pairformer | 2 | 9 | - |" in text and "ds4sci bench evoformer-cp --layout 1d" in text


@pytest.mark.parametrize("argv, message", [
    (["--kinds", "msa"], "--kinds=msa: expected some of evoformer, pairformer"),
    (["--degrees", "0"], "expected positive integers"),
    (["--heads", "0"], "--heads=0: must be >= 1"),
])
def test_bad_arguments_one_line(argv, message, capsys):
    assert message in refused(capsys, ["bench", "evoformer-cp", *argv, "--out", "/nonexistent/never"])
