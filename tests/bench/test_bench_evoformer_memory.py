"""``ds4sci bench evoformer-memory``: the float64 reference of the differences, the report's cells, and OpenFold3's
own attention paths (default, chunked, LMA) beside the reference.

The CLI smoke test of the ds4sci backends alone (peaks measured in subprocesses) is in
tests/kernels/test_evoformer_api.py; here the peaks are measured in this process (monkeypatched), since every
OpenFold3 subprocess would import OpenFold3 again.
"""
import argparse
import json

import pytest
import torch

from ds4sci.bench import evoformer_memory

needs_openfold3 = pytest.mark.skipif(evoformer_memory.openfold3_missing() is not None,
                                     reason="OpenFold3 is not importable")
# OpenFold3's default path enters torch.amp.autocast("cuda"), which warns on a machine without CUDA
pytestmark = pytest.mark.filterwarnings("ignore:CUDA is not available:UserWarning")

# 3 MSA rows per chunk of 7 (uneven), LMA blocks of 8 queries over 24 residues
SMALL = {"batch": 1, "n_seq": 7, "n_res": 24, "heads": 2, "head_dim": 8, "dtype": "fp32", "device": "cpu",
         "seed": 0, "threads": 1, "openfold_chunk": 3, "lma_chunk": 8}


def _run(tmp_path, monkeypatch, *argv):
    """``evoformer-memory ARGV --device cpu --out tmp_path`` with the peaks measured in this process: the JSON report
    and the Markdown."""
    monkeypatch.setattr(evoformer_memory, "_peak", evoformer_memory.peak_bytes)  # in this process
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    evoformer_memory.add_arguments(parser)
    assert evoformer_memory.run(parser.parse_args([*argv, "--device", "cpu", "--out", str(tmp_path)])) == 0
    return (json.loads((tmp_path / "evoformer_memory.json").read_text()),
            (tmp_path / "evoformer_memory.md").read_text())


def test_differences_are_from_a_float64_reference(monkeypatch, tmp_path):
    report, markdown = _run(tmp_path, monkeypatch, "--n-seq", "3", "--n-res", "24", "--heads", "2", "--head-dim",
                            "8", "--no-openfold")
    exact = evoformer_memory.fp64_reference(report["config"])
    assert all(t.dtype == torch.float64 for t in exact.values())
    _, fp32 = evoformer_memory.saved_bytes_and_results(report["config"], "reference")
    ref = report["backends"]["reference"]["max_abs_diff"]
    # the fp32 reference's own rounding error, no longer 0 by construction
    assert ref == {k: (fp32[k].double() - exact[k]).abs().max().item() for k in exact}
    assert 0 < max(ref.values()) < 1e-5 and max(report["backends"]["torch"]["max_abs_diff"].values()) < 1e-5
    assert "float64" in report["max_abs_diff_from"]
    assert "| max abs diff vs fp64 reference |" in markdown and "float64 on the same inputs" in markdown
    row = next(line for line in markdown.splitlines() if line.startswith("| reference |"))
    assert row.split(" | ")[3] == "-" and "lower" not in row


def test_triangle_update_rows(monkeypatch, tmp_path):
    """The triangle update's rows at a 24-residue pair, c = 8: the chunked path saves z, p and the mask (``2 + 1/8``
    times z), the torch path its whole graph; inference: the output and a block of 3 rows (the other operand
    recomputed a block at a time)."""
    report, markdown = _run(tmp_path, monkeypatch, "--n-seq", "1", "--n-res", "8", "--heads", "1", "--head-dim", "4",
                            "--no-openfold", "--trimul-n", "24", "--trimul-c", "8")
    rows = report["triangle_update"]
    assert rows["chunked"]["saved_vs_z"] == 2 + 1 / 8 and rows["chunked"]["peak_vs_z"] == 1 + 7 * 3 / 24
    assert rows["torch"]["saved_vs_z"] > 14
    assert "## Triangle multiplicative update (one outgoing update)" in markdown and "| chunked | " in markdown


@pytest.mark.parametrize("name, ratio, cell", [
    ("reference", 1.0, "-"), ("torch", 9.66, "9.7x lower"), ("torch", 0.5, "2.0x higher"), ("torch", 1.01, "same"),
    ("torch", 0.0, "-"),
])
def test_peak_ratio_cell_says_lower_or_higher(name, ratio, cell):
    assert evoformer_memory.peak_ratio_cell(name, ratio) == cell


@needs_openfold3
@pytest.mark.parametrize("path", evoformer_memory.OPENFOLD_PATHS)
def test_openfold_paths_match_the_reference(path):
    _, want = evoformer_memory.saved_bytes_and_results(SMALL, "reference")
    _, got = evoformer_memory.saved_bytes_and_results(SMALL, path)
    assert set(got) == {"o", "dq", "dk", "dv", "dpair"}
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=f"{path}: {name}")


@needs_openfold3
def test_openfold_chunked_path_saves_less_than_its_default_path():
    default, _ = evoformer_memory.saved_bytes_and_results(SMALL, "openfold3-default")
    chunked, _ = evoformer_memory.saved_bytes_and_results(SMALL, "openfold3-chunked")
    # default keeps the softmax [B, N_seq, H, N_res, N_res] (4 B each); checkpointed chunks keep their inputs only
    assert default >= 7 * 2 * 24 * 24 * 4 and chunked < default


@needs_openfold3
def test_run_reports_openfold_paths(monkeypatch, tmp_path):
    report, markdown = _run(tmp_path, monkeypatch, "--n-seq", "4", "--n-res", "32", "--heads", "2", "--head-dim",
                            "8", "--lma-chunk", "8")
    assert set(report["backends"]) == {"reference", "torch"}
    assert list(report["openfold3"]) == list(evoformer_memory.OPENFOLD_PATHS)
    assert "attention_chunked_trainable" in report["openfold3_paths"]
    for r in report["openfold3"].values():
        assert r["saved_bytes"] > 0 and r["peak_bytes"] >= 0 and "peak_ratio_vs_reference" in r
        assert max(r["max_abs_diff"].values()) < 1e-4
    assert all(markdown.count(f"| {path} |") == 1 for path in evoformer_memory.OPENFOLD_PATHS)
    assert (tmp_path / "evoformer_memory.png").read_bytes()[:4] == b"\x89PNG"


def test_without_openfold3_the_reason_is_reported(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "openfold3.core.model.primitives.attention", None)
    assert "ds4sci[openfold]" in evoformer_memory.openfold3_missing()
