"""Checks of ``ds4sci bench kernels-aot`` results shared by the Evoformer and local-attention AOT tests."""
import argparse
import json
import os

import pytest

from ds4sci.bench import kernels_aot

SM80_SMEM, SM90_SMEM = 166912, 232448  # max dynamic shared memory per block: 163 KB (A100), 227 KB (H100)


# Compiling a gate's variants takes minutes on 2 cores (the 408 shipped ones about 4-10 min, depending on load): more
# than the suite's 600 s per-test limit allows for one test that sets the shared fixture up.
COMPILE_TIMEOUT = 1800


def compiles(test):
    """Marks a test of a compiling fixture: slow, with :data:`COMPILE_TIMEOUT`, and its module scheduled first."""
    return pytest.mark.first(pytest.mark.slow(pytest.mark.timeout(COMPILE_TIMEOUT)(test)))


def shared_cache() -> str:
    """The ``--cache-dir`` of every gate: ``$XDG_CACHE_HOME/ds4sci/kernels-aot`` (``~/.cache`` by default), kept
    across runs and clones on this machine like Triton's own cache. A record is keyed by everything that decides its
    figures (the kernel's source and what it calls, Triton's version, the specialisation, the target and ds4sci's
    checking code), so a run compiles exactly what changed since a run before it; a first run (a fresh machine)
    compiles all of it (about 15 worker-minutes)."""
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(home, "ds4sci", "kernels-aot")


def gate(tmp_path, cache_dir, *argv):
    """``ds4sci bench kernels-aot --out tmp_path --jobs 2 --cache-dir cache_dir *argv``: ``(exit status, JSON
    report, Markdown table)``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    kernels_aot.add_arguments(parser)
    rc = kernels_aot.run(parser.parse_args(["--out", str(tmp_path), "--jobs", "2", "--cache-dir", cache_dir, *argv]))
    report = json.loads((tmp_path / "kernels_aot.json").read_text())
    return rc, report, (tmp_path / "kernels_aot.md").read_text()


def gate_fixture(variant_set: str):
    """A module fixture ``<variant_set>_gate``: :func:`gate` of ``--set variant_set``, compiled once for the tests of
    a module (minutes on 2 cores)."""
    @pytest.fixture(scope="module", name=f"{variant_set.replace('-', '_')}_gate")
    def compiled(tmp_path_factory):
        return gate(tmp_path_factory.mktemp(variant_set), shared_cache(), "--set", variant_set)
    return compiled


def where(r):
    """The compilation a failure message names."""
    return f"{r['case']}: {r['kernel']} {r['dtype']} BLOCK_D={r['block_d']} {r['flags']} {r['target']}"


def assert_gate_compiled(results, variants, cases):
    """The gate compiled each of ``variants`` once for sm_80 and once for sm_90a, and nothing else; their cases
    (the calls that launch them) are ``cases``."""
    compiled = sorted((r["case"], r["kernel"], r["dtype"], r["block_d"], r["flags"], r["target"]) for r in results)
    wanted = sorted((v.case, v.kernel, v.dtype, v.block_d, v.flags, target) for v in variants
                    for target in ("sm_80", "sm_90a"))
    assert compiled == wanted and len(results) == 2 * len(variants)
    assert {r["case"] for r in results} == cases


def assert_compiled_within_smem(results):
    for r in results:
        at = where(r)
        assert r["error"] is None, f"{at}: {r['error']}"
        limit = SM80_SMEM if r["target"] == "sm_80" else SM90_SMEM
        assert 0 < r["shared_bytes"] <= limit, f"{at}: {r['shared_bytes']} B of shared memory"
        assert 0 < r["registers"] <= 255, at
    assert {r["target"] for r in results} == {"sm_80", "sm_90a"}


def assert_spill_free(results):
    spilling = [f"{where(r)}: {r['spill_stores']}/{r['spill_loads']} B" for r in results
                if (r["spill_stores"], r["spill_loads"]) != (0, 0)]
    assert not spilling, f"{len(spilling)} compilations spill:\n" + "\n".join(spilling)
    assert all(r["resources_ok"] for r in results)


def assert_resources(results):
    assert_compiled_within_smem(results)
    assert_spill_free(results)


def assert_exponents(results):
    for r in results:
        assert r["error"] is None, f"{where(r)}: {r['error']}"
        if r["kernel"] != "bwd_preprocess":
            assert r["ex2"] > 0, where(r)
        assert r["unsafe_ex2"] == [], f"{where(r)}: {len(r['unsafe_ex2'])} of {r['ex2']}: {r['unsafe_ex2'][0]}"
        assert r["exponents_ok"], where(r)
