"""``ds4sci bench comm-volume``: the bytes counted at the collectives match the closed forms of ds4sci.planning.costs
(Ulysses, ring, and Megatron-LM sequence parallelism measured on ds4sci's tensor-parallel layers), and the command
writes its three files."""
import json

import pytest

from ds4sci import cli
from ds4sci.planning.costs import layer_comm_bytes

from cli_checks import refused  # tests/ is on sys.path (its conftest.py)


@pytest.mark.distributed
def test_measured_bytes_match_the_closed_forms(tmp_path):
    out = tmp_path / "bench"
    assert cli.main(["bench", "comm-volume", "--degrees", "2", "--tokens-per-rank", "16", "--hidden", "16",
                     "--heads", "2", "--out", str(out)]) == 0
    report = json.loads((out / "comm_volume.json").read_text())
    runs = {r["scheme"]: r for r in report["runs"]}
    assert set(runs) == {"ulysses", "ring", "megatron-sp", "tp-sp"}  # hybrid needs P >= 4
    for r in (runs["ulysses"], runs["ring"]):
        data = sum(v for k, v in r["by_kind"].items() if k != "all_gather")  # all_gather: the shape check
        assert data == pytest.approx(r["predicted"], rel=1e-9), r
        assert r["by_kind"].get("all_gather", 0) <= 8 * 8 * 2 * 2  # 8 int64 per group, fwd only, 2 groups
    for r in (runs["megatron-sp"], runs["tp-sp"]):  # ds4sci's tensor-parallel layers, sequence-parallel regions
        data = r["by_kind"]["all_gather"] + r["by_kind"]["reduce_scatter"]
        assert data == pytest.approx(r["predicted"], rel=1e-9), r
        # without backward's re-gather, each all-gather's dual is a reduce-scatter of the same size; the re-gather
        # of both normalised inputs adds 2 (P-1)/P N h e (P = 2, N = 32, h = 16, fp32)
        assert r["by_kind"]["all_gather"] - r["by_kind"]["reduce_scatter"] == 2 * (2 - 1) / 2 * 32 * 16 * 4, r
        assert r["by_kind"]["all_reduce"] == 2 * (2 - 1) // 2 * 4 * 16 * 4  # LayerNorm gradients: 4 h fp32 values
    assert runs["megatron-sp"]["predicted"] == layer_comm_bytes("megatron-sp", 2, 32, 16, 4)
    assert all(r["bytes_per_layer_min"] == r["bytes_per_layer_max"] for r in runs.values())  # symmetric schemes
    assert (out / "comm_volume.png").stat().st_size > 0
    text = (out / "comm_volume.md").read_text()
    assert "| ulysses | 2 | 32 |" in text and "| megatron-sp | 2 | 32 |" in text
    assert "| megatron-sp (formula) | 2 | 32 |" in text


@pytest.mark.parametrize("argv, message", [
    (["--degrees", "3"], "powers of two"),
    (["--heads", "3", "--hidden", "12", "--degrees", "2"],
     "--heads=3: the Ulysses and TP degree P=2 must divide the heads"),
    (["--tokens-per-rank", "5"], "must be even"),
])
def test_bad_arguments_one_line(argv, message, capsys):
    assert message in refused(capsys, ["bench", "comm-volume", *argv, "--out", "/nonexistent/never"])
