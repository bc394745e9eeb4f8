"""ds4sci.integrations.openfold with OpenFold3 (installed through the ``openfold`` extra), and ds4sci's Evoformer
layers loaded from OpenFold3 state dicts.

Each OpenFold3 attention module runs twice with the same weights and inputs (with masks): on its default PyTorch
path and on its ``use_deepspeed_evo_attention=True`` path with ds4sci enabled. Outputs and the gradients of the
inputs and of every parameter must agree: in fp32 and bf16 each path's error against the default path run in fp64
may be at most 3x the default path's own error in that dtype (plus a few ulps). The kernels run on the CPU: the
torch backend, and the triton backend under TRITON_INTERPRET=1 (set in tests/conftest.py).
"""
import importlib.util
import json
import math
import sys
import types
from pathlib import Path

# imported at collection: importing it adds a warnings filter ('once' for every Warning), which, added inside a test,
# would go in front of this module's filterwarnings mark and let OpenFold3's CUDA-autocast warning through
import openfold3.core.model.latent.evoformer  # noqa: F401  (the EvoformerStack of the example and the bench)
import openfold3.core.model.primitives.attention as of3_attention
import pytest
import torch
from openfold3.core.model.layers.msa import MSAColumnAttention as OF3MSAColumnAttention
from openfold3.core.model.layers.msa import MSARowAttentionWithPairBias as OF3MSARowAttentionWithPairBias
from openfold3.core.model.layers.triangular_attention import TriangleAttention as OF3TriangleAttention
from openfold3.core.model.layers.triangular_attention import (
    TriangleAttentionEndingNode as OF3TriangleAttentionEndingNode,
)

import ds4sci.integrations.openfold as ds4sci_openfold
from ds4sci.integrations.openfold import EvoAttentionAdapter
from ds4sci.kernels import EvoformerBackend
from ds4sci.models import evoformer

from evoformer_checks import TRITON
from evoformer_checks import assert_within_pytorch_error
from evoformer_checks import randomize_

# OpenFold3's default path enters torch.amp.autocast("cuda"), which warns on a machine without CUDA
pytestmark = pytest.mark.filterwarnings("ignore:CUDA is not available:UserWarning")

BACKENDS = ["torch", TRITON]
C_M, C_Z, C_HIDDEN, HEADS = 8, 6, 4, 2
SMALL = 3  # the dim that is not the attention length (MSA depth for row attention, residues for column)

# name -> (OpenFold3 module, ds4sci layer); both built with (C_*, C_HIDDEN, HEADS)
VARIANTS = {
    "msa_row": (lambda: OF3MSARowAttentionWithPairBias(C_M, C_Z, C_HIDDEN, HEADS),
                lambda backend: evoformer.MSARowAttentionWithPairBias(C_M, C_Z, C_HIDDEN, HEADS, backend=backend)),
    "msa_col": (lambda: OF3MSAColumnAttention(C_M, C_HIDDEN, HEADS),
                lambda backend: evoformer.MSAColumnAttention(C_M, C_HIDDEN, HEADS, backend=backend)),
    "tri_start": (lambda: OF3TriangleAttention(C_Z, C_HIDDEN, HEADS),
                  lambda backend: evoformer.TriangleAttentionStartingNode(C_Z, C_HIDDEN, HEADS, backend=backend)),
    "tri_end": (lambda: OF3TriangleAttentionEndingNode(C_Z, C_HIDDEN, HEADS),
                lambda backend: evoformer.TriangleAttentionEndingNode(C_Z, C_HIDDEN, HEADS, backend=backend)),
}


# ----------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------


def make_inputs(variant, s, batch=(), seed=0):
    """fp64 (x, z, mask) with attention length ``s``; a quarter of the mask is 0, but every attention row keeps
    a key (fully masked rows are padding, see DESIGN.md). z is None except for MSA row attention."""
    g = torch.Generator().manual_seed(seed)
    shape = {"msa_row": (SMALL, s), "msa_col": (s, SMALL)}.get(variant, (s, s))
    c = C_M if variant.startswith("msa") else C_Z
    x = torch.randn(*batch, *shape, c, generator=g, dtype=torch.float64)
    z = torch.randn(*batch, s, s, C_Z, generator=g, dtype=torch.float64) if variant == "msa_row" else None
    mask = (torch.rand(*batch, *shape, generator=g) > 0.25).double()
    mask[..., 0, :] = 1
    mask[..., :, 0] = 1
    return x, z, mask


def call(variant, module, x, z, mask, **kw):
    if variant == "msa_row":
        return module(x, z=z, mask=mask, **kw)
    return module(x, mask=mask, **kw)


def fwd_bwd(variant, module, inputs, dtype, **kw):
    """Output and the gradients of x, z and every parameter ({name: tensor}); ``module`` is cast to ``dtype``."""
    module = module.to(dtype)
    module.zero_grad(set_to_none=True)
    x, z, mask = (None if t is None else t.detach().to(dtype) for t in inputs)
    leaves = [t.requires_grad_(True) for t in (x, z) if t is not None]
    out = call(variant, module, x, z, mask, **kw)
    assert out.dtype == dtype and out.shape == x.shape
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(123), dtype=torch.float64).to(dtype)
    grads = torch.autograd.grad(out, leaves + list(module.parameters()), dout, allow_unused=True)
    names = ["dx", "dz"][: len(leaves)] + [f"d:{n}" for n, _ in module.named_parameters()]
    return {"out": out.detach(), **dict(zip(names, grads))}


class CountingAttention:
    """Wraps whatever ``_deepspeed_evo_attn`` is installed and counts the calls (and the dtypes it saw)."""

    def __init__(self, inner):
        self.inner, self.calls, self.dtypes = inner, 0, set()

    def __call__(self, q, k, v, biases):
        self.calls += 1
        self.dtypes.add(q.dtype)
        return self.inner(q, k, v, biases)


def compare_paths(variant, backend, s, batch, dtype, seed=0, **kw):
    """OpenFold3's module on its default path vs the DeepSpeed path with ds4sci enabled; returns the call count."""
    of3_module = randomize_(VARIANTS[variant][0](), seed)
    inputs = make_inputs(variant, s, batch, seed + 1)
    ref64 = fwd_bwd(variant, of3_module, inputs, torch.float64, **kw)
    default = fwd_bwd(variant, of3_module, inputs, dtype, **kw)
    with ds4sci_openfold.enabled(backend):
        counter = CountingAttention(of3_attention._deepspeed_evo_attn)
        of3_attention._deepspeed_evo_attn = counter  # restored by the context manager on exit
        ours = fwd_bwd(variant, of3_module, inputs, dtype, use_deepspeed_evo_attention=True, **kw)
    assert_within_pytorch_error(ours, ref64, default, dtype)
    assert counter.dtypes <= {dtype}  # the kernel ran in the caller's dtype (OpenFold would cast fp32 to bf16)
    return counter.calls


# ----------------------------------------------------------------------------------------------------------
# OpenFold3 modules: default path vs use_deepspeed_evo_attention=True with ds4sci
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_openfold3_module_fp32(variant, backend):
    """Unaligned S = 19 (17 for triangle attention on triton, to keep the interpreter quick), batch 2 for the
    MSA layers; outputs and every gradient."""
    tri_triton = variant.startswith("tri") and backend == "triton"
    s, batch = (17, ()) if tri_triton else (19, (2,))
    assert compare_paths(variant, backend, s, batch, torch.float32) == 1


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_openfold3_module_fp32_more_shapes(variant):
    """S = 32 (tile-aligned) with two batch dims, and S = 17 (the smallest S the DeepSpeed path takes)."""
    assert compare_paths(variant, "torch", 32, (2, 1), torch.float32, seed=5) == 1
    assert compare_paths(variant, "torch", 17, (), torch.float32, seed=6) == 1


@pytest.mark.parametrize(
    "variant, backend", [(v, "torch") for v in VARIANTS] + [pytest.param("msa_row", "triton", marks=TRITON.marks)]
)
def test_openfold3_module_bf16(variant, backend):
    """bf16: within 3x the default path's bf16 error against fp64 (triton on one variant: the interpreter is slow,
    the kernel tests cover its bf16 numerics)."""
    assert compare_paths(variant, backend, 19, (2,), torch.bfloat16, seed=2) == 1


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_openfold3_short_sequences_keep_openfold_fallback(variant):
    """S <= 16: OpenFold3 itself routes to its default path (the DeepSpeed kernel asserts S > 16); enabled or
    not, ds4sci is never called and the result is bitwise the default path's."""
    of3_module = randomize_(VARIANTS[variant][0](), 3).float()
    inputs = [None if t is None else t.float() for t in make_inputs(variant, 16, (2,), 4)]
    default = call(variant, of3_module, *inputs)
    with ds4sci_openfold.enabled("torch"):
        counter = CountingAttention(of3_attention._deepspeed_evo_attn)
        of3_attention._deepspeed_evo_attn = counter
        out = call(variant, of3_module, *inputs, use_deepspeed_evo_attention=True)
    assert counter.calls == 0
    assert torch.equal(out, default)


@pytest.mark.parametrize(
    "variant, backend", [(v, "torch") for v in VARIANTS] + [pytest.param("msa_row", "triton", marks=TRITON.marks)]
)
def test_openfold3_chunked_inference(variant, backend):
    """chunk_size: OpenFold3's chunk_layer flattens the batch dims and, for pair-biased layers, expands the pair
    bias per chunk row ([chunk, H, S, S] with q [chunk, H, S, C]); the adapter handles that layout."""
    of3_module = randomize_(VARIANTS[variant][0](), 7).float()
    inputs = [None if t is None else t.float() for t in make_inputs(variant, 19, (2,), 8)]
    with torch.no_grad():
        default = call(variant, of3_module, *inputs)
        with ds4sci_openfold.enabled(backend):
            counter = CountingAttention(of3_attention._deepspeed_evo_attn)
            of3_attention._deepspeed_evo_attn = counter
            chunked = call(variant, of3_module, *inputs, chunk_size=5, use_deepspeed_evo_attention=True)
    assert counter.calls > 1
    torch.testing.assert_close(chunked, default, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("variant", ["tri_start", "tri_end"])
def test_openfold3_transpose_bias(variant):
    """OpenFold3's PairBlock calls triangle attention with transpose_bias=True."""
    assert compare_paths(variant, "torch", 19, (), torch.float32, seed=9, transpose_bias=True) == 1


def test_works_without_deepspeed_cutlass(monkeypatch):
    """ds4sci's path needs neither deepspeed.ops.deepspeed4science nor its CUTLASS op."""

    def no_cutlass(*args, **kwargs):
        raise RuntimeError("DeepSpeed's CUTLASS op must not be called")

    monkeypatch.setattr(of3_attention, "ds4s_is_installed", False)
    monkeypatch.setattr(of3_attention, "DS4Sci_EvoformerAttention", no_cutlass, raising=False)
    of3_module = randomize_(VARIANTS["tri_start"][0](), 10).float()
    x, _, mask = (None if t is None else t.float() for t in make_inputs("tri_start", 17))
    with pytest.raises(ValueError, match="requires that DeepSpeed be installed"):
        of3_module(x, mask=mask, use_deepspeed_evo_attention=True)  # OpenFold3's own function
    with ds4sci_openfold.enabled():
        out = of3_module(x, mask=mask, use_deepspeed_evo_attention=True)
    torch.testing.assert_close(out, of3_module(x, mask=mask), rtol=1e-5, atol=2e-6)


# ----------------------------------------------------------------------------------------------------------
# ds4sci layers loaded from OpenFold3 state dicts
# ----------------------------------------------------------------------------------------------------------


def compare_loaded_layer(variant, backend, s, batch, dtype, seed, **kw):
    """ds4sci's layer loaded (strict=True) from an OpenFold3 module with random parameters (``seed``) vs that module on
    its default path, on inputs of seed ``seed + 1``: output, input gradients and (name by name) parameter gradients
    within 3x the default path's ``dtype`` error against fp64. Returns (ds4sci layer, OpenFold3 module, inputs)."""
    of3_module = randomize_(VARIANTS[variant][0](), seed)
    ours = VARIANTS[variant][1](backend)
    ours.load_state_dict(of3_module.state_dict(), strict=True)
    inputs = make_inputs(variant, s, batch, seed + 1)
    ref64 = fwd_bwd(variant, of3_module, inputs, torch.float64, **kw)
    default = fwd_bwd(variant, of3_module, inputs, dtype, **kw)
    ds = fwd_bwd(variant, ours, inputs, dtype, **kw)
    assert_within_pytorch_error(ds, ref64, default, dtype)
    return ours, of3_module, inputs


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ds4sci_layer_from_openfold3_state_dict(variant):
    """strict=True load; same output, input gradients and (name by name) parameter gradients as OpenFold3's
    module on its default path. Our layers have no S <= 16 fallback, so S = 7 exercises the kernel. (The loaded
    weights do not depend on the backend; the layers on the triton backend against the fp64 formulation, batched:
    tests/models/test_evoformer_layers.py::test_matches_reference_fp32.)"""
    compare_loaded_layer(variant, "torch", 7, (2,), torch.float32, seed=11)


@pytest.mark.parametrize("variant", ["tri_start", "tri_end"])
def test_ds4sci_triangle_layer_transpose_bias_matches_openfold3(variant):
    compare_loaded_layer(variant, "torch", 7, (2,), torch.float32, seed=13, transpose_bias=True)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ds4sci_layer_bf16_and_chunked_from_openfold3_state_dict(variant):
    ours, of3_module, inputs = compare_loaded_layer(variant, "torch", 19, (2,), torch.bfloat16, seed=15)
    x, z, mask = (None if t is None else t.float() for t in inputs)
    with torch.no_grad():
        torch.testing.assert_close(
            call(variant, ours.float(), x, z, mask, chunk_size=2),
            call(variant, of3_module.float(), x, z, mask, chunk_size=2),
            rtol=1e-5, atol=2e-6,
        )


# ----------------------------------------------------------------------------------------------------------
# The adapter's layout handling, against OpenFold3's plain attention
# ----------------------------------------------------------------------------------------------------------

# (q shape [*, H, Q, C], bias shapes in the [*, H, Q, K] frame)
ADAPTER_CASES = [
    ((2, 3, 2, 19, 4), [(2, 3, 1, 1, 19), (2, 1, 2, 19, 19)]),  # MSA row: mask + pair bias
    ((3, 2, 19, 4), [(3, 1, 1, 19), (1, 2, 19, 19)]),  # no batch dim: N only
    ((2, 19, 4), [(1, 1, 19)]),  # a single row, mask only
    ((2, 19, 4), [(1, 1, 19), (2, 19, 19)]),  # a single row, mask and pair bias
    ((5, 2, 19, 4), [(5, 1, 1, 19), (5, 2, 19, 19)]),  # chunk_layer: pair bias expanded per row
    ((2, 2, 3, 2, 19, 4), [(2, 1, 3, 1, 1, 19), (2, 1, 1, 2, 19, 19)]),  # two batch dims, mask broadcast
    ((2, 3, 2, 19, 4), [(2, 1, 1, 1, 19), (1, 19, 19)]),  # mask broadcast over N, pair over batch and heads
    ((2, 3, 2, 19, 4), [(2, 3, 1, 1, 19), (2, 3, 1, 1, 19)]),  # two masks (summed)
    ((2, 3, 2, 19, 4), []),  # no bias
]


@pytest.mark.parametrize("q_shape, bias_shapes", ADAPTER_CASES)
def test_adapter_layouts_match_openfold3_plain_attention(q_shape, bias_shapes):
    g = torch.Generator().manual_seed(17)
    q, k, v = (torch.randn(q_shape, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    biases = [torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True) for s in bias_shapes]
    out = EvoAttentionAdapter("torch")(q, k, v, list(biases))  # [*, Q, H, C]
    ref = of3_attention._attention(q / math.sqrt(q.shape[-1]), k, v, list(biases)).transpose(-2, -3)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(out, [q, k, v, *biases], dout)
    ref_grads = torch.autograd.grad(ref, [q, k, v, *biases], dout)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_adapter_rejects_three_biases():
    q = torch.randn(1, 2, 2, 19, 4)
    with pytest.raises(ValueError, match="at most two biases"):
        EvoAttentionAdapter()(q, q, q, [torch.zeros(1, 2, 1, 1, 19)] * 3)


# ----------------------------------------------------------------------------------------------------------
# enable / disable / enabled
# ----------------------------------------------------------------------------------------------------------


def test_enable_disable_restores_the_original_object():
    original = of3_attention._deepspeed_evo_attn
    assert not ds4sci_openfold.is_enabled()
    assert ds4sci_openfold.enable() == ["openfold3"]
    installed = of3_attention._deepspeed_evo_attn
    assert isinstance(installed, EvoAttentionAdapter) and installed.backend is EvoformerBackend.AUTO
    assert installed.original is original
    assert ds4sci_openfold.enable(EvoformerBackend.TORCH) == ["openfold3"]  # again: new backend, same original
    assert of3_attention._deepspeed_evo_attn.backend is EvoformerBackend.TORCH
    ds4sci_openfold.disable()
    assert of3_attention._deepspeed_evo_attn is original
    assert not ds4sci_openfold.is_enabled()
    ds4sci_openfold.disable()  # a no-op
    assert of3_attention._deepspeed_evo_attn is original


def test_context_manager_restores_exactly_including_nesting_and_errors():
    original = of3_attention._deepspeed_evo_attn
    with ds4sci_openfold.enabled("torch") as patched:
        assert patched == ["openfold3"]
        outer = of3_attention._deepspeed_evo_attn
        assert outer.backend is EvoformerBackend.TORCH
        with pytest.raises(RuntimeError, match="boom"):
            with ds4sci_openfold.enabled("reference"):
                assert of3_attention._deepspeed_evo_attn.backend is EvoformerBackend.REFERENCE
                raise RuntimeError("boom")
        assert of3_attention._deepspeed_evo_attn is outer
        assert ds4sci_openfold.is_enabled()
    assert of3_attention._deepspeed_evo_attn is original
    assert not ds4sci_openfold.is_enabled()
    # entered while enable() is in force: leaves it in force, with the very same adapter object
    ds4sci_openfold.enable()
    adapter = of3_attention._deepspeed_evo_attn
    with ds4sci_openfold.enabled("torch"):
        pass
    assert of3_attention._deepspeed_evo_attn is adapter
    ds4sci_openfold.disable()
    assert of3_attention._deepspeed_evo_attn is original


def test_bad_backend_changes_nothing():
    original = of3_attention._deepspeed_evo_attn
    with pytest.raises(ValueError, match="unknown backend 'cutlass'"):
        ds4sci_openfold.enable("cutlass")
    assert of3_attention._deepspeed_evo_attn is original and not ds4sci_openfold.is_enabled()


@pytest.fixture
def fake_openfold(monkeypatch):
    """A stand-in for aqlaboratory/openfold's ``openfold.model.primitives`` (not on PyPI): the same module-level
    ``_deepspeed_evo_attn(q, k, v, biases)`` that its ``Attention.forward`` looks up at call time."""
    modules = {name: types.ModuleType(name) for name in ("openfold", "openfold.model", "openfold.model.primitives")}

    def _deepspeed_evo_attn(q, k, v, biases):
        raise AssertionError("OpenFold's DeepSpeed function must not run while ds4sci is enabled")

    primitives = modules["openfold.model.primitives"]
    primitives._deepspeed_evo_attn = _deepspeed_evo_attn
    primitives.attend = lambda q, k, v, biases: primitives._deepspeed_evo_attn(q, k, v, biases)  # as Attention does
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return primitives


def test_openfold_alphafold2_is_patched_and_restored_too(fake_openfold):
    original_of, original_of3 = fake_openfold._deepspeed_evo_attn, of3_attention._deepspeed_evo_attn
    with ds4sci_openfold.enabled("torch") as patched:
        assert sorted(patched) == ["openfold", "openfold3"]
        g = torch.Generator().manual_seed(18)
        q, k, v = (torch.randn(1, 20, 2, 21, 4, generator=g) for _ in range(3))  # [B, N, H, S, C]
        mask = torch.randn(1, 20, 1, 1, 21, generator=g)
        pair = torch.randn(1, 1, 2, 21, 21, generator=g)
        out = fake_openfold.attend(q, k, v, [mask, pair])
        ref = of3_attention._attention(q / 2.0, k, v, [mask, pair]).transpose(-2, -3)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert fake_openfold._deepspeed_evo_attn is original_of
    assert of3_attention._deepspeed_evo_attn is original_of3


def test_openfold_without_the_function_is_left_alone(monkeypatch, fake_openfold):
    monkeypatch.delattr(fake_openfold, "_deepspeed_evo_attn")
    assert ds4sci_openfold.enable() == ["openfold3"]
    assert not hasattr(fake_openfold, "_deepspeed_evo_attn")


# ----------------------------------------------------------------------------------------------------------
# The example and `ds4sci bench openfold-stack`
# ----------------------------------------------------------------------------------------------------------

TINY_STACK = ["--n-res", "20", "--n-seq", "17", "--backend", "torch"]  # above OpenFold's 16-residue fallback


def test_example_ds4sci_step_agrees():
    """examples/openfold_attention.py at a tiny shape: one EvoformerStack training step with ds4sci enabled agrees
    with OpenFold3's default path, and the patch is gone afterwards."""
    path = Path(__file__).resolve().parents[2] / "examples" / "openfold_attention.py"
    spec = importlib.util.spec_from_file_location("openfold_attention_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    diff = example.main(TINY_STACK)
    assert set(diff) == {"m", "z", "param_grads"}
    assert 0 < max(diff.values()) < 1e-4  # 0 would mean both steps took the same path
    assert not isinstance(of3_attention._deepspeed_evo_attn, EvoAttentionAdapter)


@pytest.mark.slow
def test_openfold_stack_bench_ds4sci_saves_less(tmp_path, monkeypatch):
    """`ds4sci bench openfold-stack` at a tiny shape: both paths run in processes of their own and agree, the files
    are written, and ds4sci's step saves fewer bytes for backward (deterministic, unlike the peak RSS at this size).
    The processes are forked from the tests' fork server (tests/harness_checks.py), not fresh interpreters."""
    from ds4sci import cli
    from ds4sci.bench import memory

    from harness_checks import run_in_forked_process  # tests/ is on sys.path (its conftest.py)

    monkeypatch.setattr(memory, "run_in_subprocess", run_in_forked_process)
    assert cli.main(["bench", "openfold-stack", "--quick", "--backend", "torch", "--device", "cpu",
                     "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "openfold_stack.json").read_text())
    assert (tmp_path / "openfold_stack.png").read_bytes()[:4] == b"\x89PNG"
    markdown = (tmp_path / "openfold_stack.md").read_text()
    assert markdown.count("| default |") == 1 and markdown.count("| ds4sci |") == 1 and "Allocator:" in markdown
    assert report["command"].startswith("ds4sci bench openfold-stack --n-seq 17 --n-res 20 --blocks 1 ")
    assert report["config"]["backend"] == "torch" and report["config"]["n_res"] == 20
    assert "VmHWM" in report["peak_method"] and isinstance(report["allocator"], dict)
    default, ds4sci = report["results"]["default"], report["results"]["ds4sci"]
    for r in (default, ds4sci):
        assert set(r) == {"peak_bytes", "saved_bytes", "seconds"}
        assert r["peak_bytes"] > 0 and r["saved_bytes"] > 0 and r["seconds"] > 0
    assert ds4sci["saved_bytes"] < default["saved_bytes"]
    assert report["saved_ratio"] == default["saved_bytes"] / ds4sci["saved_bytes"] > 1
    assert set(report["relative_diff"]) == {"m", "z", "param_grads"}
    assert 0 < max(report["relative_diff"].values()) < 1e-4


def test_openfold_stack_bench_without_openfold3(monkeypatch, tmp_path, caplog):
    """Without OpenFold3 the subcommand logs one error naming the extra and exits with 1, before writing anything."""
    from ds4sci import cli

    monkeypatch.setitem(sys.modules, "openfold3.core.model.latent.evoformer", None)  # makes the import fail
    out = tmp_path / "out"
    with caplog.at_level("ERROR"):
        assert cli.main(["bench", "openfold-stack", "--out", str(out)]) == 1
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and errors[0].exc_info is None
    assert "needs OpenFold3" in errors[0].getMessage() and "ds4sci[openfold]" in errors[0].getMessage()
    assert not out.exists()


def test_openfold_stack_bench_refuses_a_non_positive_shape(tmp_path, capsys):
    from ds4sci import cli

    assert cli.main(["bench", "openfold-stack", "--n-res", "0", "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == "ds4sci bench: error: --n-res=0: must be >= 1"
