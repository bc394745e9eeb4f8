"""The ahead-of-time compile gate over every shipped Evoformer variant (``ds4sci bench kernels-aot --set shipped``),
no GPU needed; how the gate compiles and what it reads is in ``test_triton_aot.py``.

Each entry of the tile table (fp16, bf16, fp32 x BLOCK_D 16/32/64/128) x each kernel (forward, backward preprocess,
dK/dV, dQ, dpair) x each flag combination (HAS_MASK, HAS_PAIR, MASK_GRAD), for sm_80 and sm_90: 408 compilations,
4-10 minutes on 2 shared cores. Flag-off variants are compiled too: ptxas allocates registers per variant, and
flag-off variants were seen to spill where the all-flags one did not.
"""
from ds4sci.bench.aot.variants import shipped_variants

from aot_checks import assert_exponents  # tests/ is on sys.path (its conftest.py)
from aot_checks import assert_gate_compiled  # tests/ is on sys.path (its conftest.py)
from aot_checks import assert_resources  # tests/ is on sys.path (its conftest.py)
from aot_checks import compiles  # tests/ is on sys.path (its conftest.py)
from aot_checks import gate_fixture  # tests/ is on sys.path (its conftest.py)

shipped_gate = gate_fixture("shipped")


@compiles
def test_every_table_entry_compiles_for_sm80_and_sm90_within_smem_and_spill_free(shipped_gate):
    rc, report, table = shipped_gate
    expected = shipped_variants(worst_case_only=False)
    assert_gate_compiled(report["results"], expected, cases={"representative"})
    assert_resources(report["results"])
    assert table.count("| representative |") == len(expected) and "| error |" not in table


@compiles
def test_every_table_entry_computes_exponents_from_differences(shipped_gate):
    rc, report, table = shipped_gate
    assert_exponents(report["results"])
    assert rc == 0 and report["all_ok"]
    assert table.count("| yes |") == len(report["results"]) // 2 and "| NO |" not in table
