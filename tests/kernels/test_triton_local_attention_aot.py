"""Ahead-of-time compile gate of the Triton local-attention kernels (``ds4sci bench kernels-aot --set local``), no GPU.

The gate (ds4sci.bench.kernels_aot, its pieces in ds4sci.bench.aot) compiles with ``triton.compile(ASTSource(...),
target=GPUTarget("cuda", 80 | 90, 32))`` in worker processes started without ``TRITON_INTERPRET``, reads Triton's
shared-memory request and the ``ptxas -v`` registers and spills of Triton's own ptxas run, and checks in the PTX that
every ``ex2`` takes a scaled difference ``(s - m) * log2 e``, never a fused multiply-add whose addend is a separately
scaled maximum (whose rounding error would become the exponent). Launch arguments are recorded from
``triton_attention`` itself (forward and backward on CPU tensors, every launch recorded instead of run).

- ``test_gate_enumerates_every_launch``: ``--set local-full`` holds exactly the (kernel, dtype, BLOCK_D, HAS_DOCS,
  HAS_ALIBI) launches ``triton_attention`` makes, over dtypes, head dims and arguments; ``--set local`` is its flags
  all-off and all-on part for bf16 and fp32 (fp16 shares bf16's tiles).
- ``test_block_dependent_integers_are_not_specialised``: offsets and the causal/window band change from ring step to
  ring step; they are ``do_not_specialize``, so every block of a sequence reuses one compiled kernel.
- The slow test compiles ``--set local`` (2 dtypes x 4 BLOCK_D x 3 kernels x 2 flag sets, for sm_80 and sm_90a: 96
  compilations, 1-3 minutes on 2 cores) and checks shared memory, spills and exponents. ``--set local-full`` (every
  flag combination and fp16: 288 compilations) is run by hand (``ds4sci bench kernels-aot --set local-full``).
"""
import itertools

import pytest
import torch

from ds4sci.bench.aot.calls import LocalCall
from ds4sci.bench.aot.calls import kernel_name
from ds4sci.bench.aot.calls import record_launches
from ds4sci.bench.aot.specialise import specialisation
from ds4sci.bench.aot.specialise import specialisation_key
from ds4sci.bench.aot.variants import LOCAL_DTYPES
from ds4sci.bench.aot.variants import LOCAL_KERNELS
from ds4sci.bench.aot.variants import LocalVariant
from ds4sci.bench.aot.variants import variants_for
from ds4sci.kernels.triton_local_attention import triton_attention

from aot_checks import assert_exponents  # tests/ is on sys.path (its conftest.py)
from aot_checks import assert_gate_compiled  # tests/ is on sys.path (its conftest.py)
from aot_checks import assert_resources  # tests/ is on sys.path (its conftest.py)
from aot_checks import compiles  # tests/ is on sys.path (its conftest.py)
from aot_checks import gate_fixture  # tests/ is on sys.path (its conftest.py)

NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _launched(dtype, d, docs, alibi, **kw):
    """(kernel, dtype, BLOCK_D, HAS_DOCS, HAS_ALIBI) of every launch of one forward + backward."""
    q = torch.randn(1, 20, 4, d, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, 24, 2, d, dtype=dtype, requires_grad=True) for _ in range(2))
    if docs:
        kw["q_doc"], kw["k_doc"] = torch.zeros(1, 20, dtype=torch.int64), torch.zeros(1, 24, dtype=torch.int64)
    if alibi:
        kw["alibi_slopes"] = torch.ones(4)
    with record_launches() as launches:
        out, lse = triton_attention(q, k, v, return_lse=True, **kw)
        (out.sum() + lse.sum()).backward()
    return [(kernel_name(kern), NAMES[dtype], meta["BLOCK_D"], meta["HAS_DOCS"], meta["HAS_ALIBI"])
            for kern, _, meta in launches]


def test_gate_enumerates_every_launch():
    full = {(v.kernel, v.dtype, v.block_d, v.has_docs, v.has_alibi) for v in variants_for("local-full")}
    seen = set()
    for dtype, d, docs, alibi in itertools.product(NAMES, (8, 16, 24, 32, 64, 100, 128), (False, True), (False, True)):
        for kw in (dict(), dict(causal=True, window=5, q_offset=30, k_offset=7)):
            launches = _launched(dtype, d, docs, alibi, **kw)
            assert [name for name, *_ in launches] == list(LOCAL_KERNELS)
            assert set(launches) <= full, launches
            seen |= set(launches)
    assert seen == full  # and nothing the launchers never start
    assert len(full) == 3 * 4 * 3 * 4
    local = variants_for("local")
    assert {(v.dtype, v.has_docs, v.has_alibi) for v in local} == {
        (dt, on, on) for dt in LOCAL_DTYPES for on in (False, True)}
    assert {(v.kernel, v.dtype, v.block_d, v.has_docs, v.has_alibi) for v in local} <= full
    assert len(local) == 2 * 4 * 3 * 2
    assert all(v.case == "local representative" for v in local)


def test_representative_launch_records_the_flags():
    v = LocalVariant("bwd_dkdv", "bf16", 64, True, False)
    kernel, args, meta = v.launch()
    assert kernel_name(kernel) == "bwd_dkdv" and meta["HAS_DOCS"] and not meta["HAS_ALIBI"]
    assert (meta["BLOCK_D"], meta["BLOCK_M"], meta["BLOCK_N"]) == (64, 32, 32)
    call = v.as_call()
    assert (call.b, call.sq, call.h, call.hkv, call.d, call.causal) == (1, 256, 8, 2, 64, True)
    with pytest.raises(RuntimeError, match="expected docs"):
        LocalVariant("fwd", "bf16", 64, True, False, call=LocalCall("no docs", "bf16", 1, 32, 32, 2, 2, 64)).launch()


def test_block_dependent_integers_are_not_specialised():
    """Ring blocks at different offsets, causal or windowed (band and shift 0, 1, 16, 17, ...), compile to one
    specialisation; the lengths and strides are still specialised (as Triton does for every launch)."""
    import triton
    from triton.backends.compiler import GPUTarget

    backend = triton.compiler.make_backend(GPUTarget("cuda", 80, 32))
    keys = set()
    blocks = [(0, 0, True, None), (1, 0, True, None), (16, 0, True, None), (17, 3, True, None), (256, 0, True, None),
              (0, 256, False, None), (0, 0, False, 16), (40, 7, True, 1), (0, 0, False, None)]
    for q_offset, k_offset, causal, window in blocks:
        call = LocalCall("ring", "bf16", 1, 256, 256, 8, 2, 64, causal=causal, window=window, q_offset=q_offset,
                         k_offset=k_offset)
        variant = LocalVariant("fwd", "bf16", 64, False, False, call=call)
        kernel, args, meta = variant.launch()
        keys.add(specialisation_key(variant, kernel, args, meta, backend))
        signature, constexprs, attrs, _ = specialisation(kernel, args, meta, backend)
        for name in ("diag_lo", "diag_hi", "shift"):
            assert signature[name] == "i32" and name not in constexprs
            assert (kernel.arg_names.index(name),) not in attrs
    assert len(keys) == 1
    short = LocalCall("short", "bf16", 1, 37, 37, 8, 2, 64)
    variant = LocalVariant("fwd", "bf16", 64, False, False, call=short)
    assert specialisation_key(variant, *variant.launch(), backend) not in keys  # S = 37: not % 16


# ---------------------------------------------------------------------------------------------------------------
# Compiling the kernels
# ---------------------------------------------------------------------------------------------------------------


local_gate = gate_fixture("local")


@compiles  # the module fixture compiles 96 kernels: 1-3 min on 2 cores, more under load
def test_local_kernels_compile_for_sm80_and_sm90_within_smem_spill_free_and_with_safe_exponents(local_gate):
    rc, report, table = local_gate
    results = report["results"]
    assert_gate_compiled(results, variants_for("local"), cases={"local representative"})
    assert len(results) == 96
    assert_resources(results)  # compiled, within shared memory and 255 registers, no spills, both targets
    assert_exponents(results)  # every kernel has ex2, none fed by a fused multiply-add
    assert rc == 0 and report["all_ok"]
    assert table.count("| local representative |") == len(results) // 2 and "| NO |" not in table
