"""Ahead-of-time compile gate of the Triton Evoformer kernels (``ds4sci bench kernels-aot``), no GPU needed.

The gate compiles with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 80 | 90, 32))`` in worker processes
started without ``TRITON_INTERPRET`` (this test process runs the kernels under the interpreter) and reads Triton's
shared-memory request and the ``ptxas -v`` registers and spills of Triton's own ptxas run.

The slow test compiles every shipped variant: each entry of the tile table (fp16, bf16, fp32 x BLOCK_D 16/32/64/128)
x each kernel (forward, backward preprocess, dK/dV, dQ, dpair) x each flag combination (HAS_MASK, HAS_PAIR,
MASK_GRAD), for sm_80 and sm_90: 408 compilations, about 4 minutes on 2 cores. Flag-off variants are compiled too:
ptxas allocates registers per variant, and flag-off variants were seen to spill where the all-flags one did not.
``test_gate_enumerates_every_launch`` checks that the enumeration the gate compiles covers
every launch the launchers can make.
"""
import argparse
import itertools
import json

import pytest
import torch

from ds4sci.bench import kernels_aot
from ds4sci.kernels import triton_evoformer

SM80_SMEM, SM90_SMEM = 166912, 232448  # max dynamic shared memory per block: 163 KB (A100), 227 KB (H100)


def test_targets_and_limits():
    assert kernels_aot.TARGETS == {80: ("sm_80", SM80_SMEM), 90: ("sm_90a", SM90_SMEM)}


def _launched(dtype, d, use_mask, use_pair, need_mask, need_pair):
    """(kernel name, Variant flags) of every kernel the launchers start for one call, from their own arguments."""
    te = triton_evoformer
    z, n, s, h = 1, 2, 32, 2
    q = torch.empty(z, n, s, h, d, dtype=dtype)
    mask = torch.empty(z, n, s, dtype=dtype) if use_mask else None
    pair = torch.empty(z, h, s, s, dtype=dtype) if use_pair else None
    lse = torch.empty(z, n, h, s)
    need_mask, need_pair = need_mask and use_mask, need_pair and use_pair
    _, _, meta = te.fwd_launch(q, q, q, mask, pair, q, lse)
    out = [("fwd", meta["HAS_MASK"], meta["HAS_PAIR"], False, meta["BLOCK_D"])]
    launches = te.bwd_launches(q, q, q, q, q, lse, mask, pair, lse, q, q, q, lse if need_mask else None,
                               torch.empty(z, h, s, s) if need_pair else None)
    for kernel, _, _, meta in launches:
        name = kernel.__name__.removeprefix("_").removesuffix("_kernel")
        flags = (meta.get("HAS_MASK", False), meta.get("HAS_PAIR", name == "bwd_dpair"), meta.get("MASK_GRAD", False))
        out.append((name, *flags, meta["BLOCK_D"]))
    return out


def test_gate_enumerates_every_launch():
    shipped = {(v.kernel, v.has_mask, v.has_pair, v.mask_grad, v.block_d, v.dtype)
               for v in kernels_aot.shipped_variants()}
    seen = set()
    names = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
    for dtype, d, *flags in itertools.product(names, (8, 16, 24, 32, 64, 128), *[(False, True)] * 4):
        for launch in _launched(dtype, d, *flags):
            assert (*launch, names[dtype]) in shipped, launch
            seen.add((*launch, names[dtype]))
    assert seen == shipped  # and nothing the launchers never start
    assert len(shipped) == 3 * 4 * (4 + 1 + 6 + 4 + 2)
    worst = kernels_aot.shipped_variants(worst_case_only=True)
    assert len(worst) == 3 * 4 * 5
    for v in worst:  # every flag on (the preprocess kernel has none)
        on = v.kernel != "bwd_preprocess"
        assert (v.has_mask, v.has_pair, v.mask_grad) == (on, on, v.kernel == "bwd_dkdv"), v


@pytest.mark.slow
def test_every_table_entry_compiles_for_sm80_and_sm90_within_smem_and_spill_free(tmp_path):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    kernels_aot.add_arguments(parser)
    args = parser.parse_args(["--out", str(tmp_path), "--jobs", "2"])
    rc = kernels_aot.run(args)
    report = json.loads((tmp_path / "kernels_aot.json").read_text())
    results = report["results"]
    expected = kernels_aot.shipped_variants(worst_case_only=False)
    assert len(results) == 2 * len(expected)
    for r in results:
        where = f"{r['kernel']} {r['dtype']} BLOCK_D={r['block_d']} {r['flags']} {r['target']}"
        assert r["error"] is None, f"{where}: {r['error']}"
        limit = SM80_SMEM if r["target"] == "sm_80" else SM90_SMEM
        assert 0 < r["shared_bytes"] <= limit, f"{where}: {r['shared_bytes']} B of shared memory"
        spills = (r["spill_stores"], r["spill_loads"])
        assert spills == (0, 0), f"{where}: spills {spills} B"
        assert 0 < r["registers"] <= 255, where
        assert r["ok"], where
    assert {r["target"] for r in results} == {"sm_80", "sm_90a"}
    assert rc == 0 and report["all_ok"]
    table = (tmp_path / "kernels_aot.md").read_text()
    assert table.count("| yes |") == len(expected) and "| NO |" not in table
