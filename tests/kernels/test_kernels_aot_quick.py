"""``ds4sci bench kernels-aot --quick``: the CI smoke run of the compile gate through the command line (16
compilations, about 40 s of CPU time, 1.5 minutes on 2 busy cores; worker processes compile without
``TRITON_INTERPRET``, :mod:`ds4sci.bench.aot.pool`). The gate itself: tests/kernels/test_triton_aot.py and
test_triton_local_attention_aot.py. It reads what a gate (or an earlier run) compiled
from the shared ``--cache-dir`` (:func:`aot_checks.shared_cache`; all 16 are gate compilations), and compiles it
otherwise.
"""
import json

from ds4sci import cli
from ds4sci.bench.aot.compile import COMPILED_FIELDS
from ds4sci.bench.aot.pool import compile_all
from ds4sci.bench.aot.variants import KERNELS
from ds4sci.bench.aot.variants import LOCAL_KERNELS
from ds4sci.bench.aot.variants import QUICK
from ds4sci.bench.aot.variants import Variant
from ds4sci.bench.aot.variants import quick_variants

from aot_checks import shared_cache  # tests/ is on sys.path (its conftest.py)


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
    cache = shared_cache()
    assert cli.main(["bench", "kernels-aot", "--quick", "--out", str(tmp_path), "--cache-dir", cache]) == 0
    report = json.loads((tmp_path / "kernels_aot.json").read_text())
    assert report["quick"] is True and report["set"] is None and report["callers"] == []
    assert report["cache_dir"] == cache
    assert len(report["results"]) == 2 * len(quick_variants()) == 16
    assert all(r["ok"] for r in report["results"]), [r for r in report["results"] if not r["ok"]]
    text = (tmp_path / "kernels_aot.md").read_text()
    assert "`--quick`: a smoke test" in text and "16 compilations" in text and "0 errors" in text
    assert (tmp_path / "kernels_aot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cache_dir_serves_a_compilation_only_to_the_same_specialisation(tmp_path):
    """One worker, three tasks in order: the first compiles and keeps its figures, the second (the same variant) reads
    them back unchanged, the third (the same kernel and flags for fp16: another specialisation) is compiled."""
    bf16, fp16 = (Variant("bwd_preprocess", dtype, 16, False, False) for dtype in ("bf16", "fp16"))
    first, again, other = compile_all([bf16, bf16, fp16], (80,), jobs=1, cache_dir=str(tmp_path))
    assert (first["cached"], again["cached"], other["cached"]) == (False, True, False)
    assert all(r["ok"] for r in (first, again, other))
    assert {f: again[f] for f in COMPILED_FIELDS} == {f: first[f] for f in COMPILED_FIELDS}
    assert (first["dtype"], again["dtype"], other["dtype"]) == ("bf16", "bf16", "fp16")
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".json", ".json"]  # no half-written record left


def test_a_cache_dir_that_cannot_be_a_folder_is_one_line_before_any_compile(tmp_path, capsys):
    taken = tmp_path / "a file"
    taken.write_text("")
    assert cli.main(["bench", "kernels-aot", "--quick", "--out", str(tmp_path), "--cache-dir", str(taken / "c")]) == 2
    err = capsys.readouterr().err
    assert str(taken / "c") in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "kernels_aot.json").exists()
