"""Ahead-of-time compile gate of the triangle multiplicative update's Triton kernels (``ds4sci bench kernels-aot --set
trimul``, ds4sci.bench.aot.trimul), no GPU.

- ``test_gate_covers_the_launches``: the set holds every specialisation of the calls it stands for, N = 4096
  specialises exactly as N = 64 (so the representative bf16 / c = 128 entry is the large-N code; its inference in
  default blocks as N = 64 in blocks of 16) and N = 256 adds nothing;
- ``test_narrow_offsets_*``: the 64-bit offset check on hand-written Triton IR;
- slow: ``test_large_n_offsets_are_64_bit`` builds the Triton IR of every launch of the N = 4096, c = 128 call (a
  pair tensor of 2^31 elements; training, and each kernel of its inference) in a process without the interpreter and
  finds a 64-bit term in every position-indexed load and store; ``test_gate_compiles_within_limits`` compiles the
  set for sm_80 and sm_90a (176 kernels, 352 compilations: about 8 minutes with one job on 2 busy cores without
  the shared ``--cache-dir``) and checks shared memory and spills.
"""
import json
import os
import subprocess
import sys

import pytest

from ds4sci.bench.aot.calls import kernel_name
from ds4sci.bench.aot.trimul import INFERENCE_CHUNK
from ds4sci.bench.aot.trimul import LARGE_N
from ds4sci.bench.aot.trimul import TrimulCall
from ds4sci.bench.aot.trimul import narrow_offsets
from ds4sci.bench.aot.trimul import trimul_call_launches
from ds4sci.bench.aot.trimul import trimul_calls
from ds4sci.bench.aot.variants import variants_for

from aot_checks import assert_gate_compiled  # tests/ is on sys.path (its conftest.py)
from aot_checks import assert_resources  # tests/ is on sys.path (its conftest.py)
from aot_checks import compiles  # tests/ is on sys.path (its conftest.py)
from aot_checks import gate_fixture  # tests/ is on sys.path (its conftest.py)

#: calls whose launches all specialise as earlier calls': where the tile table gives two buckets the same tiles (fp32
#: from 32 channels on, fp64 from 16: the same channel blocks), the later bucket's launches differ only in the
#: LayerNorm backward's partials (BLOCK_C), which only the call with biases and outgoing edges (the first) adds
SHARED_TILES = {f"trimul {dtype} c={c} {kind}" for dtype, buckets in (("fp32", (64, 128)), ("fp64", (32, 64, 128)))
                for c in buckets for kind in ("incoming", "inference, bias, outgoing", "inference, incoming")}
#: the calls that name a compiled variant: all but those and the representative one that specialises as N = 4096
NAMING_CALLS = {call.name for call in trimul_calls()} - {"trimul bf16 c=128 bias, outgoing"} - SHARED_TILES
KERNELS = ["in_fwd", "product", "out_fwd", "in_fwd", "out_bwd", "ln_bwd", "product", "product", "in_bwd", "ln_bwd",
           "wgrad", "wgrad"]


def _keys(call):
    import triton
    from triton.backends.compiler import GPUTarget

    from ds4sci.bench.aot.specialise import specialisation_key
    from ds4sci.bench.aot.trimul import TrimulVariant

    backend = triton.compiler.make_backend(GPUTarget("cuda", 80, 32))
    return [specialisation_key(TrimulVariant(kernel_name(k), call.dtype, call.c_z, 0, call.bias, call.outgoing, call),
                               k, args, meta, backend) for k, args, meta in trimul_call_launches(call)]


def test_gate_covers_the_launches():
    variants = variants_for("trimul")
    assert [kernel_name(k) for k, _, _ in trimul_call_launches(LARGE_N)] == KERNELS
    small = TrimulCall("small", "bf16", 64, 128, 128, bias=True, outgoing=True)
    assert _keys(LARGE_N) == _keys(small)
    assert _keys(TrimulCall("N=256", "bf16", 256, 128, 128, bias=True, outgoing=True)) == _keys(small)
    assert len(set(_keys(TrimulCall("N=37", "bf16", 37, 128, 128, True, True))) - set(_keys(small))) >= 5
    inference = TrimulCall("inference", "bf16", 64, 128, 128, bias=True, outgoing=True, chunk=INFERENCE_CHUNK)
    large = TrimulCall("N=4096 inference", "bf16", 4096, 128, 128, bias=True, outgoing=True, chunk=4096 // 8)
    assert set(_keys(large)) == set(_keys(inference))  # in its default blocks (an eighth of the rows)
    # the output kernel computing LN_in's statistics; the block product specialises as the whole one here
    assert [k.split("'")[1] for k in set(_keys(inference)) - set(_keys(small))] == ["out_fwd"]
    assert {v.case for v in variants} == NAMING_CALLS
    assert {v.kernel for v in variants} == set(KERNELS)
    assert {(v.dtype, v.block_d) for v in variants} == {(d, c) for d in ("bf16", "fp32", "fp64")
                                                        for c in (16, 32, 64, 128)}
    assert [v for v in variants if v.case == LARGE_N.name][0].kernel == "in_fwd"  # the large-N call comes first


_TTIR = """
  tt.func public @k(%Z: !tt.ptr<bf16> loc("Z"(#loc)), %Wa: !tt.ptr<bf16> loc("Wa"(#loc)), %X: !tt.ptr<f32>) {
    %0 = tt.splat %Z : !tt.ptr<bf16> -> tensor<16x!tt.ptr<bf16>> loc(#loc1)
    %1 = tt.addptr %0, %r64 : tensor<16x!tt.ptr<bf16>>, tensor<16xi64> loc(#loc2)
    %z_2 = tt.load %1, %ok : tensor<16x!tt.ptr<bf16>> loc(#loc3)
    %3 = tt.splat %Z : !tt.ptr<bf16> -> tensor<16x!tt.ptr<bf16>> loc(#loc1)
    %4 = tt.addptr %3, %r32 : tensor<16x!tt.ptr<bf16>>, tensor<16xi32> loc(#loc2)
    tt.store %4, %z_2, %ok : tensor<16x!tt.ptr<bf16>> loc(#loc4)
    %5 = tt.splat %Wa : !tt.ptr<bf16> -> tensor<16x!tt.ptr<bf16>> loc(#loc1)
    %6 = tt.addptr %5, %c32 : tensor<16x!tt.ptr<bf16>>, tensor<16xi32> loc(#loc2)
    %w = tt.load %6 : tensor<16x!tt.ptr<bf16>> loc(#loc5)
    %7 = tt.addptr %X, %base : !tt.ptr<f32>, i64 loc(#loc6)
    %8 = tt.splat %7 : !tt.ptr<f32> -> tensor<16x16x!tt.ptr<f32>> loc(#loc7)
    %9 = tt.addptr %8, %offs : tensor<16x16x!tt.ptr<f32>>, tensor<16x16xi32> loc(#loc8)
    %acc = scf.for %k = %c0 to %n step %c16 iter_args(%acc_1 = %cst, %x_ptrs = %9) -> (tensor<16x16xf32>) : i32 {
      %x = tt.load %x_ptrs : tensor<16x16x!tt.ptr<f32>> loc(#loc9)
      %x_ptrs_2 = tt.addptr %x_ptrs, %step : tensor<16x16x!tt.ptr<f32>>, tensor<16x16xi32> loc(#loc10)
    }
"""


def test_layer_norm_eps_compiles_as_fp64():
    """Compiled, Triton types a plain Python float argument as fp32 (the interpreter keeps it a Python float, fp64):
    the kernels taking LayerNorm's eps declare it ``tl.float64`` so that fp64 rows add eps exactly (on the H200 an
    fp32 eps put OpenFold3's fp64 output 2.5e-12 off), and the gate specialises it as Triton's JIT does."""
    import triton
    from triton.backends.compiler import GPUTarget

    from ds4sci.bench.aot.specialise import specialisation

    backend = triton.compiler.make_backend(GPUTarget("cuda", 80, 32))
    launches = [launch for call in trimul_calls(dtypes=("fp64", "bf16"), buckets=(16,))
                for launch in trimul_call_launches(call)]
    with_eps = [(k, args, meta) for k, args, meta in launches if "eps" in k.arg_names]
    assert {kernel_name(k) for k, _, _ in with_eps} == {"in_fwd", "out_fwd", "out_bwd"}
    for kernel, args, meta in with_eps:
        signature, _, attrs, _ = specialisation(kernel, args, meta, backend)
        assert signature["eps"] == "fp64", kernel_name(kernel)
        assert (kernel.arg_names.index("eps"),) not in attrs  # a float is not specialised


def test_narrow_offsets_finds_the_32_bit_chain_only():
    """The store through ``Z + r32`` is flagged; ``Z + r64``, the weight ``Wa`` and the loop-carried pointer whose
    initial value has a 64-bit base are not."""
    assert narrow_offsets(_TTIR) == ["line 8: tt.store through %Z with 32-bit offsets only"]
    assert narrow_offsets(_TTIR.replace("!tt.ptr<f32>, i64", "!tt.ptr<f32>, i32")) == [
        "line 8: tt.store through %Z with 32-bit offsets only", "line 16: tt.load through %X with 32-bit offsets only"]


_SIBLINGS = """
  tt.func public @k(%Z: !tt.ptr<bf16> loc("Z"(#loc)), %n: i32) {
    %a = scf.for %h = %c0 to %n step %c16 iter_args(%acc = %cst) -> (tensor<16xf32>) : i32 {
      %p = tt.splat %Z : !tt.ptr<bf16> -> tensor<16x!tt.ptr<bf16>> loc(#loc1)
      %p_1 = tt.addptr %p, %r64 : tensor<16x!tt.ptr<bf16>>, tensor<16xi64> loc(#loc2)
      %x = tt.load %p_1 : tensor<16x!tt.ptr<bf16>> loc(#loc3)
    }
    %b = scf.for %h = %c0 to %n step %c16 iter_args(%acc = %cst) -> (tensor<16xf32>) : i32 {
      %p = tt.splat %Z : !tt.ptr<bf16> -> tensor<16x!tt.ptr<bf16>> loc(#loc1)
      %p_1 = tt.addptr %p, %r32 : tensor<16x!tt.ptr<bf16>>, tensor<16xi32> loc(#loc2)
      %x = tt.load %p_1 : tensor<16x!tt.ptr<bf16>> loc(#loc3)
    }
"""


def test_narrow_offsets_follows_names_reused_in_sibling_loops():
    """Two loops one after the other reuse value names (as Triton's IR printer does): each load is traced through
    the definitions in its own loop, so the first (64-bit) passes and the second (32-bit) is flagged."""
    assert narrow_offsets(_SIBLINGS) == ["line 11: tt.load through %Z with 32-bit offsets only"]
    assert narrow_offsets(_SIBLINGS.replace("xi32>", "xi64>")) == []


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_large_n_offsets_are_64_bit():
    """In the N = 4096, c = 128 specialisation (R * c_z = 2^31 elements) every position-indexed access has a 64-bit
    term; the IR is built in a process without ``TRITON_INTERPRET`` (the interpreter's functions have no IR)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import json; from ds4sci.bench.aot.trimul import large_n_narrow_offsets as f; print(json.dumps(f()))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=840)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert sorted(found) == sorted(f"{k} {i}" for k, i in {("in_fwd", 1), ("in_fwd", 2), ("product", 1),
                                                            ("product", 2), ("product", 3), ("out_fwd", 1),
                                                            ("out_bwd", 1), ("ln_bwd", 1), ("ln_bwd", 2),
                                                            ("in_bwd", 1), ("wgrad", 1),
                                                            ("wgrad", 2), ("in_fwd", "inference"),
                                                            ("product", "inference"), ("out_fwd", "inference")})
    assert all(problems == [] for problems in found.values()), found


trimul_gate = gate_fixture("trimul")


@compiles
def test_gate_compiles_within_limits(trimul_gate):
    rc, report, markdown = trimul_gate
    results = report["results"]
    assert_gate_compiled(results, variants_for("trimul"), NAMING_CALLS)
    assert_resources(results)
    assert rc == 0 and report["all_ok"]
    assert "triangle multiplicative update" in markdown


_PTX = """
.visible .entry k(
	.param .u64 k_param_0,
	.param .u32 k_param_1
)
{
	ld.param.u64 	%rd1, [k_param_0];
	ld.param.u32 	%r1, [k_param_1];
	mov.u32 	%r2, %ctaid.x;
	mul.wide.s32 	%rd2, %r2, %r1;
	shl.b64 	%rd3, %rd2, 1;
	add.s64 	%rd4, %rd1, %rd3;
	// begin inline asm
	@%p1 ld.global.b16 { %rs1 }, [ %rd4 + 0 ];
	// end inline asm
	shl.b32 	%r4, %r2, 6;
	mul.wide.u32 	%rd7, %r4, 2;
	add.s64 	%rd8, %rd1, %rd7;
	st.global.b16 	[ %rd8 + 0 ], { %rs1 };
	mul.lo.s32 	%r3, %r2, %r1;
	mul.wide.s32 	%rd5, %r3, 2;
	add.s64 	%rd6, %rd1, %rd5;
	st.global.b16 	[ %rd6 + 0 ], { %rs1 };
	ret;
}
"""


def test_narrow_addresses_flags_the_32_bit_product_only():
    """In PTX: the load through ``ctaid * N`` multiplied in 64 bits (``mul.wide.s32`` of the two, then scaled in 64
    bits) passes, as does a tile offset ``ctaid << 6`` widened; the store through ``ctaid * N`` multiplied in 32 bits
    and widened only by the element size (the overflow past 2^31 elements) is flagged, unless its buffer is skipped."""
    from ds4sci.bench.aot.ptx import narrow_addresses

    problems = narrow_addresses(_PTX)
    assert len(problems) == 1 and problems[0].startswith("line 23: st.global.b16"), problems
    assert "mul.wide.s32 of mul(" in problems[0]
    assert narrow_addresses(_PTX, frozenset({0})) == []


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_large_n_ptx_addresses_are_64_bit():
    """The PTX for sm_80 of every launch of the N = 4096, c = 128 call and of each kernel of its inference (Triton's
    stages, no ptxas, no GPU; ~110 s on 2 busy cores): no global load or store of a position-indexed buffer takes its
    address from a 32-bit product of a position and a size widened at the end, and every launch has global accesses
    to check."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import json; from ds4sci.bench.aot.trimul import large_n_narrow_addresses as f; print(json.dumps(f()))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=840)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert len(found) == len(KERNELS) + 3  # and the inference's in_fwd, product and out_fwd
    assert all(problems == [] for problems in found.values()), found
