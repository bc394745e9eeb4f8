"""``ds4sci bench kernels-aot --quick``: the CI smoke run of the compile gate through the command line (16
compilations, about 40 s of CPU time, 1.5 minutes on 2 busy cores; worker processes compile without
``TRITON_INTERPRET``, :mod:`ds4sci.bench.aot.pool`). The gate itself: tests/kernels/test_triton_aot.py and
test_triton_local_attention_aot.py.
"""
import json

from ds4sci import cli
from ds4sci.bench.aot.variants import KERNELS
from ds4sci.bench.aot.variants import LOCAL_KERNELS
from ds4sci.bench.aot.variants import QUICK
from ds4sci.bench.aot.variants import quick_variants


def test_quick_variants_are_one_entry_per_family_with_every_flag_on():
    variants = quick_variants()
    evoformer = [v for v in variants if hasattr(v, "has_mask")]
    local = [v for v in variants if hasattr(v, "has_docs")]
    assert [v.kernel for v in evoformer] == list(KERNELS) and [v.kernel for v in local] == list(LOCAL_KERNELS)
    assert {(v.dtype, v.block_d) for v in evoformer} == {QUICK["shipped"]}
    assert {(v.dtype, v.block_d) for v in local} == {QUICK["local"]}
    assert all(v.has_docs and v.has_alibi for v in local)
    assert all(v.has_mask and v.has_pair for v in evoformer if v.kernel != "bwd_preprocess")


def test_quick_run_writes_json_markdown_and_png(tmp_path):
    assert cli.main(["bench", "kernels-aot", "--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "kernels_aot.json").read_text())
    assert report["quick"] is True and report["set"] is None and report["callers"] == []
    assert len(report["results"]) == 2 * len(quick_variants()) == 16
    assert all(r["ok"] for r in report["results"]), [r for r in report["results"] if not r["ok"]]
    text = (tmp_path / "kernels_aot.md").read_text()
    assert "`--quick`: a smoke test" in text and "16 compilations" in text and "0 errors" in text
    assert (tmp_path / "kernels_aot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
