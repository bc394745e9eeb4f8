"""``ds4sci bench evoformer-cp``: the bytes counted at the collectives of Evoformer and Pairformer blocks inside a
sharded stack at P = 2 (1-D) and on a 2 x 2 mesh (2-D, P = 4; odd N_res included) equal the closed forms of
block_comm_bytes per rank and collective kind; every rank's peak of live tensors is at least what it saves for
backward; in 2-D the peak's pair terms fall as 1/P (both kinds); the command writes its three files; bad options are
one-line errors."""
import json

import pytest

from ds4sci import cli

from bench_checks import quick_report  # tests/bench/ is on sys.path
from cli_checks import refused  # tests/ is on sys.path (its conftest.py)


def _peak_at_least_saved(report: dict) -> None:
    """Every rank's peak of live tensors is positive and at least the bytes it saves for backward (both count what
    the step allocates: a saved tensor is live at the end of forward)."""
    for r in report["runs"]:
        peaks, saved = r["peak_bytes_by_rank"], r["saved_bytes_by_rank"]
        assert len(peaks) == len(saved) == r["P"], r
        assert all(p >= s > 0 for p, s in zip(peaks, saved)), r
        assert r["peak_bytes"] == max(peaks) and r["planned_peak"] > 0, r


@pytest.mark.distributed
@pytest.mark.slow
def test_measured_bytes_match_the_closed_forms(tmp_path):
    out = tmp_path / "bench"
    report = quick_report(out, "evoformer-cp")
    runs = [r for r in report["runs"] if r["P"] == 2]
    assert {(r["kind"], r["n_res"]) for r in runs} == {(k, n) for k in ("evoformer", "pairformer") for n in (6, 9)}
    for r in runs:
        assert r["sent_by_rank"] == r["predicted_by_rank"], r  # per rank and collective kind
        assert r["sent_per_block"] == r["sent_per_block_min"] == r["predicted"], r  # every rank the same
        assert r["saved_bytes"] < next(s["saved_bytes"] for s in report["runs"]
                                       if s["P"] == 1 and (s["kind"], s["n_res"]) == (r["kind"], r["n_res"]))
    assert all(r["sent_per_block"] == 0 for r in report["runs"] if r["P"] == 1)
    _peak_at_least_saved(report)
    assert (out / "evoformer_cp.png").stat().st_size > 0
    text = (out / "evoformer_cp.md").read_text()
    assert "| pairformer | 2 | 9 | - |" in text and "ds4sci bench evoformer-cp --layout 1d" in text


@pytest.mark.distributed
@pytest.mark.slow
def test_2d_measured_bytes_match_the_closed_forms_per_rank(tmp_path):
    out = tmp_path / "bench"
    report = quick_report(out, "evoformer-cp", "--layout", "2d")
    runs = [r for r in report["runs"] if r["P"] == 4]
    assert {(r["kind"], r["n_res"]) for r in runs} == {(k, n) for k in ("evoformer", "pairformer") for n in (6, 9)}
    for r in runs:
        assert r["sent_by_rank"] == r["predicted_by_rank"], r  # per rank and collective kind
        # rank (0, 0) moves no tile by swap or skew; rank (1, 0) skews nothing on its column
        assert r["sent_per_block_min"] < r["sent_per_block"] == r["predicted"], r
        assert r["saved_bytes"] < next(s["saved_bytes"] for s in report["runs"]
                                       if s["P"] == 1 and (s["kind"], s["n_res"]) == (r["kind"], r["n_res"]))
    _peak_at_least_saved(report)
    text = (out / "evoformer_cp.md").read_text()
    assert "| evoformer | 4 | 9 | 5 |" in text and "| pairformer | 4 | 9 | - |" in text
    assert "ds4sci bench evoformer-cp --layout 2d" in text


@pytest.mark.distributed
@pytest.mark.slow
def test_2d_peak_pair_terms_fall_as_1_over_p(tmp_path):
    """2-D, Evoformer and Pairformer blocks whose pair terms are mostly C_z-wide (C_z 16 against 2 hidden channels
    and 1 head), P = 1 and a 2 x 2 mesh at N_res 6, 8, 10 (no padding): at every N_res the per-rank peak times P stays
    within 1.55x of the single process's peak, for each kind (measured 1.08-1.15x Evoformer, 1.12-1.13x Pairformer
    with the triangle updates' recomputing steps on the tiles, 1.37-1.43x and 1.38x with their autograd graph: the
    ring's rotating key, value and bias tiles and the Cannon products' tiles, which the single process does not have;
    the counts are exact, so the margin is for later changes to the mesh code; the single process on its torch
    triangle-update path, see ds4sci/bench/evoformer_cp.py). Whole [N_res, N_res, C_z] tensors
    alive on a rank at the peak do not fall with P: with the loss a mean square of the full outputs, whose backward
    makes them, it is 1.74-1.78x for both kinds (seen to fail). The peaks themselves are compared, not their fitted
    N_res^2 coefficients: at these sizes a fit through three points moves by a quarter when the peak's place in the
    step moves (a change that lowered every 2 x 2 peak raised the Evoformer's fitted coefficient from 1.54x to
    1.74x)."""
    out = tmp_path / "bench"
    assert cli.main(["bench", "evoformer-cp", "--layout", "2d", "--degrees", "1,4", "--n-res", "6,8,10", "--n-seq",
                     "2", "--c-m", "4", "--c-z", "16", "--c-hidden", "2", "--heads", "1", "--out", str(out)]) == 0
    report = json.loads((out / "evoformer_cp.json").read_text())
    _peak_at_least_saved(report)
    peak = {(r["kind"], r["P"], r["n_res"]): r["peak_bytes"] for r in report["runs"]}
    ratios = {(kind, n): 4 * peak[kind, 4, n] / peak[kind, 1, n] for kind in ("evoformer", "pairformer")
              for n in (6, 8, 10)}
    assert all(1 < r <= 1.55 for r in ratios.values()), ratios


@pytest.mark.parametrize("argv, message", [
    (["--kinds", "msa"], "--kinds=msa: expected some of evoformer, pairformer"),
    (["--layout", "2d", "--degrees", "1,2"], "--degrees=1,2: the 2d layout runs p x p meshes, 2 is not a square"),
    (["--degrees", "0"], "expected positive integers"),
    (["--heads", "0"], "--heads=0: must be >= 1"),
])
def test_bad_arguments_one_line(argv, message, capsys):
    assert message in refused(capsys, ["bench", "evoformer-cp", *argv, "--out", "/nonexistent/never"])
