"""Ahead-of-time compile gate of the Triton Evoformer kernels (``ds4sci bench kernels-aot``), no GPU needed.

The gate compiles with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 80 | 90, 32))`` in worker processes
started without ``TRITON_INTERPRET`` (this test process runs the kernels under the interpreter), reads Triton's
shared-memory request and the ``ptxas -v`` registers and spills of Triton's own ptxas run, and checks in the PTX that
every ``ex2`` takes a scaled difference ``(s - m) * log2 e``: the GPU compiler contracts ``s*LOG2E - m*LOG2E`` into
``fma(s, LOG2E, -round(m*LOG2E))``, and for a maximum near -1e9 that rounding error (up to 64) becomes the exponent.

Launch arguments come from the public path itself: ``call_launches`` runs a forward and backward on CPU tensors with
every Triton launch recorded instead of run, so these tests follow the launchers' argument lists.

- ``test_gate_enumerates_every_launch``: the ``shipped`` set covers every launch the public path makes for every
  dtype, head dim and bias/gradient combination, and nothing else.
- ``test_callers_*``: OpenFold's and OpenFold3's launches (D = 8/16/24/32/64, S odd and a multiple of 16, N = 1,
  permuted pair bias, fp32 mask with bf16/fp16 q) specialise differently from the shipped representative launch, and
  the gate compiles each distinct specialisation (62 kernels, 124 compilations, 1-4 minutes on 2 shared cores):
  within shared memory, without spills, and every exponent is a scaled difference.
- The PTX checker is tested on hand-written PTX of both forms and on PTX that Triton compiles from the two forms
  of one line (``exp2(s*LOG2E - m*LOG2E)`` is flagged, ``exp2((s - m)*LOG2E)`` is not).
- Every shipped variant is compiled in ``test_triton_aot_shipped.py`` (its own module, so that the suite's two
  workers can compile both gates at once).
"""
import itertools
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from ds4sci.bench.aot.calls import CALLERS
from ds4sci.bench.aot.calls import kernel_name
from ds4sci.bench.aot.calls import launch_flags
from ds4sci.bench.aot.calls import record_launches
from ds4sci.bench.aot.compile import TARGETS
from ds4sci.bench.aot.ptx import parse_ptx
from ds4sci.bench.aot.ptx import unsafe_exponents
from ds4sci.bench.aot.specialise import describe_specialisation
from ds4sci.bench.aot.specialise import specialisation
from ds4sci.bench.aot.specialise import specialisation_key
from ds4sci.bench.aot.variants import caller_variants
from ds4sci.bench.aot.variants import shipped_variants
from ds4sci.kernels import evoformer_attention

from aot_checks import SM80_SMEM  # tests/ is on sys.path (its conftest.py)
from aot_checks import SM90_SMEM  # tests/ is on sys.path (its conftest.py)
from aot_checks import assert_compiled_within_smem  # tests/ is on sys.path (its conftest.py)
from aot_checks import assert_exponents  # tests/ is on sys.path (its conftest.py)
from aot_checks import assert_gate_compiled  # tests/ is on sys.path (its conftest.py)
from aot_checks import assert_spill_free  # tests/ is on sys.path (its conftest.py)
from aot_checks import compiles  # tests/ is on sys.path (its conftest.py)
from aot_checks import gate_fixture  # tests/ is on sys.path (its conftest.py)

NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}

def test_targets_and_limits():
    assert TARGETS == {80: ("sm_80", SM80_SMEM), 90: ("sm_90a", SM90_SMEM)}


# ---------------------------------------------------------------------------------------------------------------
# What the gate compiles
# ---------------------------------------------------------------------------------------------------------------


def _launched(dtype, d, use_mask, use_pair, need_mask, need_pair):
    """(kernel name, mask, pair, mask_grad, BLOCK_D) of every kernel one public call launches, forward and backward."""
    z, n, s, h = 1, 2, 32, 2
    q, k, v = (torch.randn(z, n, s, h, d, dtype=dtype, requires_grad=True) for _ in range(3))
    biases = []
    if use_mask:
        biases.append(torch.randn(z, n, 1, 1, s, dtype=dtype, requires_grad=need_mask))
    if use_pair:
        biases.append(torch.randn(z, 1, h, s, s, dtype=dtype, requires_grad=need_pair))
    with record_launches() as launches:
        evoformer_attention(q, k, v, biases, backend="triton").sum().backward()
    out = []
    for kernel, _, meta in launches:
        name = kernel_name(kernel)
        out.append((name, *launch_flags(name, meta), meta["BLOCK_D"]))
    assert out[0][0] == "fwd" and len(out) >= 4
    return out


def test_gate_enumerates_every_launch():
    shipped = {(v.kernel, v.has_mask, v.has_pair, v.mask_grad, v.block_d, v.dtype) for v in shipped_variants()}
    seen = set()
    for dtype, d, *flags in itertools.product(NAMES, (8, 16, 24, 32, 64, 128), *[(False, True)] * 4):
        for launch in _launched(dtype, d, *flags):
            assert (*launch, NAMES[dtype]) in shipped, launch
            seen.add((*launch, NAMES[dtype]))
    assert seen == shipped  # and nothing the launchers never start
    assert len(shipped) == 3 * 4 * (4 + 1 + 6 + 4 + 2)
    worst = shipped_variants(worst_case_only=True)
    assert len(worst) == 3 * 4 * 5
    for v in worst:  # every flag on (the preprocess kernel has none)
        on = v.kernel != "bwd_preprocess"
        assert (v.has_mask, v.has_pair, v.mask_grad) == (on, on, v.kernel == "bwd_dkdv"), v


def test_record_launches_runs_nothing_and_restores_triton():
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    runs = (JITFunction.run, InterpretedFunction.run)
    q = torch.randn(1, 1, 20, 1, 8)
    with record_launches() as launches:
        o = evoformer_attention(q, q, q, None, backend="triton")
    assert len(launches) == 1 and kernel_name(launches[0][0]) == "fwd"
    assert launches[0][1][0] is not None and launches[0][2]["HAS_MASK"] is False
    assert (JITFunction.run, InterpretedFunction.run) == runs
    assert o.shape == q.shape


def test_callers_cover_openfold_launches():
    calls = CALLERS
    assert {c.d for c in calls} >= {8, 24, 32, 64}
    assert any(c.s % 2 for c in calls) and any(c.s % 16 == 0 for c in calls)
    assert any(c.n == 1 for c in calls) and any(c.n > 1 for c in calls)
    assert {c.pair for c in calls} >= {"start", "end", None}
    assert {(c.dtype, c.mask) for c in calls} >= {("bf16", "fp32"), ("fp16", "fp32")}
    assert any(c.openfold for c in calls) and not all(c.openfold for c in calls)


def test_caller_shapes_specialise_unlike_the_representative_launch():
    """What OpenFold launches is compiled code the shipped set never produces; the callers set compiles it."""
    import triton
    from triton.backends.compiler import GPUTarget

    backend = triton.compiler.make_backend(GPUTarget("cuda", 80, 32))

    def key(variant):
        return specialisation_key(variant, *variant.launch(), backend)

    shipped = {key(v) for v in shipped_variants(("bf16", "fp16", "fp32"))}
    callers = caller_variants()
    keys = [key(v) for v in callers]
    assert len(set(keys)) == len(keys)  # each distinct specialisation once
    assert {v.case for v in callers} == {c.name for c in CALLERS}
    for call in CALLERS:  # every caller's forward is new code
        (fwd,) = [v for v in callers if v.call == call and v.kernel == "fwd"] or [None]
        assert fwd is not None and key(fwd) not in shipped, call.name

    def spec(case, kernel="fwd"):
        (v,) = [v for v in callers if v.case == case and v.kernel == kernel]
        k, args, meta = v.launch()
        return describe_specialisation(k, *specialisation(k, args, meta, backend)[:3])

    assert "==1: " in spec("msa-row N=1") and ", N" in spec("msa-row N=1").split(";")[0]
    assert "Mask *fp32" in spec("msa-row") and "Q *bf16" in spec("msa-row")
    assert "stride_pj" in spec("msa-row").split("not %16: ")[1]  # permuted pair bias: key stride H = 8
    assert "stride_ph" in spec("msa-row").split(";")[0]  # ... and unit head stride
    assert " S" in spec("msa-row S odd").split("not %16: ")[1]
    assert " D" in spec("extra-msa-row D=8").split("not %16: ")[1]


# ---------------------------------------------------------------------------------------------------------------
# The PTX check: what feeds each ex2
# ---------------------------------------------------------------------------------------------------------------

LOG2E = "0f3FB8AA3B"
# s*LOG2E - m*LOG2E as the GPU compiler emits it: m scaled first, then one fma with the scaled max as addend
FUSED = f"""
	mul.f32 	%r10, %r2, {LOG2E};
	selp.f32 	%r11, 0f00000000, %r10, %p1;
	neg.f32 	%r12, %r11;
	fma.rn.f32 	%r13, %r1, {LOG2E}, %r12;
	ex2.approx.ftz.f32 	%r14, %r13;
"""
# (s - m) * LOG2E: the max subtracted first
DIFFERENCE = f"""
$L__BB0_2:
	selp.f32 	%r11, 0f00000000, %r2, %p1;
	sub.f32 	%r12, %r1, %r11;
	mul.f32 	%r13, %r12, {LOG2E};
	mov.b32 	%r15, %r13;
	@%p2 ex2.approx.ftz.f32 	%r14, %r15;  // predicated
"""


def test_ptx_checker_flags_a_fused_scaled_max():
    count, problems = unsafe_exponents(FUSED)
    assert count == 1 and len(problems) == 1
    assert "fused multiply-add" in problems[0] and "%r12" in problems[0] and "mul(" in problems[0]


def test_ptx_checker_accepts_a_scaled_difference():
    assert unsafe_exponents(DIFFERENCE) == (1, [])
    fma_zero = DIFFERENCE.replace(f"mul.f32 	%r13, %r12, {LOG2E}", f"fma.rn.f32 	%r13, {LOG2E}, %r12, 0f00000000")
    assert unsafe_exponents(fma_zero) == (1, [])
    add_neg = DIFFERENCE.replace("sub.f32 	%r12, %r1, %r11", "neg.f32 %r16, %r11;\n\tadd.f32 	%r12, %r1, %r16")
    assert unsafe_exponents(add_neg) == (1, [])
    scaled_apart = (f"mul.f32 %r3, %r1, {LOG2E};\nmul.f32 %r4, %r2, {LOG2E};\n"
                    "sub.f32 %r5, %r3, %r4;\nex2.approx.f32 %r6, %r5;")
    assert unsafe_exponents(scaled_apart) == (1, [])
    assert unsafe_exponents("ex2.approx.f32 %r6, 0f3F800000;") == (1, [])
    assert unsafe_exponents("add.f32 %r1, %r2, %r3;") == (0, [])


@pytest.mark.parametrize("ptx", [
    f"mul.f32 %r3, %r1, {LOG2E};\nex2.approx.f32 %r4, %r3;",  # a product of no difference
    f"fma.rn.f32 %r3, %r1, {LOG2E}, %r2;\nsub.f32 %r5, %r3, %r4;\nex2.approx.f32 %r6, %r5;",  # difference of an fma
    "add.f32 %r3, %r1, %r2;\nex2.approx.f32 %r4, %r3;",  # a sum
    "ex2.approx.f32 %r4, %r3;",  # a parameter
    # loop-carried register: one definition safe, the other fused
    DIFFERENCE + f"\n\tfma.rn.f32 	%r15, %r1, {LOG2E}, %r12;",
], ids=["mul-no-difference", "difference-of-fma", "sum", "parameter", "loop-carried"])
def test_ptx_checker_flags_other_exponent_arguments(ptx):
    count, problems = unsafe_exponents(ptx)
    assert count == 1 and len(problems) == 1, problems


def test_parse_ptx_operands():
    (st, mma) = parse_ptx(
        "\t@%p28 st.global.v4.b32 [ %rd35 + 0 ], { %r59, %r60 };\n"
        "$L__tmp1:\n\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%r1, %r2}, {%r3}, {%r4}, {%r5, %r6}; // x\n"
        ".reg .b32 %r<10>;\n"
    )
    assert st.opcode == "st.global.v4.b32" and st.operands == ("[ %rd35 + 0 ]", "{ %r59, %r60 }")
    assert mma.operands[0] == "{%r1, %r2}" and len(mma.operands) == 4 and mma.line == 3


_TWO_FORMS = '''
import json, sys, triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from ds4sci.bench.aot.ptx import unsafe_exponents

L = tl.constexpr(1.4426950408889634)

@triton.jit
def fused(S, M, O):  # scaled, then subtracted: the compiler fuses it into an fma
    i = tl.arange(0, 128)
    s = tl.load(S + i)
    m = tl.load(M + i)
    tl.store(O + i, tl.math.exp2(s * L - m * L))

@triton.jit
def difference(S, M, O):  # subtracted, then scaled: the kernels' form
    i = tl.arange(0, 128)
    s = tl.load(S + i)
    m = tl.load(M + i)
    tl.store(O + i, tl.math.exp2((s - m) * L))

out = {}
for cc in (80, 90):
    for fn in (fused, difference):
        sig = {"S": "*fp32", "M": "*fp32", "O": "*fp32"}
        src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs={}, attrs={})
        ptx = triton.compile(src, target=GPUTarget("cuda", cc, 32)).asm["ptx"]
        out[f"{fn.__name__}_{cc}"] = unsafe_exponents(ptx)
print(json.dumps(out))
'''


@pytest.mark.slow
def test_ptx_checker_on_triton_output_of_both_forms(tmp_path):
    """Triton's own PTX for one line in each form: the fused form is flagged, the difference form passes."""
    script = tmp_path / "two_forms.py"
    script.write_text(textwrap.dedent(_TWO_FORMS))
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for cc in (80, 90):
        count, problems = result[f"fused_{cc}"]
        assert count > 0 and len(problems) == count, (cc, problems)
        assert all("fused multiply-add" in p for p in problems)
        count, problems = result[f"difference_{cc}"]
        assert count > 0 and problems == [], (cc, problems)


# ---------------------------------------------------------------------------------------------------------------
# Compiling the real kernels
# ---------------------------------------------------------------------------------------------------------------


callers_gate = gate_fixture("callers")


@compiles
def test_callers_compile_within_smem(callers_gate):
    rc, report, table = callers_gate
    assert_gate_compiled(report["results"], caller_variants(), cases={c.name for c in CALLERS})
    assert report["set"] == "callers" and len(report["callers"]) == len(CALLERS)
    assert_compiled_within_smem(report["results"])
    assert "msa-row N=1" in table and "not %16" in table


@compiles
def test_callers_are_spill_free(callers_gate):
    # Found by this gate before the tile table covered callers: 24 of 124 compilations spilled (bwd_dq bf16 D=32
    # with the permuted pair bias on sm_90a, 120/88 B; fwd fp16 D=24 on sm_80, 260/232 B).
    assert_spill_free(callers_gate[1]["results"])


@compiles
def test_callers_exponents_are_scaled_differences(callers_gate):
    assert_exponents(callers_gate[1]["results"])
