"""The compiled Triton Evoformer kernels on a CUDA GPU against the fp64 reference (``pytest -m gpu``).

Run on a machine with a CUDA GPU, with the interpreter off (tests/conftest.py sets ``TRITON_INTERPRET=1`` only when the
variable is unset, so an explicit 0 wins and the kernels are compiled for the GPU)::

    TRITON_INTERPRET=0 pytest -m gpu tests/kernels/test_gpu.py

Without CUDA every test here skips with the reason "needs a CUDA GPU (run on the device machine: pytest -m gpu)";
with CUDA but the interpreter on (a plain ``pytest -m gpu``) they skip saying so: interpreted kernels would not test
the compiled code.

What the GPU shows and the interpreter hides (../shared/DESIGN.md "What the interpreter hides"): the
compiler contracts ``s*LOG2E - m*LOG2E`` into ``fma(s, LOG2E, -round(m*LOG2E))``, so for a row max m near -1e9 the
rounding error of ``m*LOG2E`` (up to 64) becomes the exponent, and for ``finfo.min`` the scaled max overflows. And a
log-sum-exp saved as one fp32 number loses ``log l`` when |m| is 1e9. So a query row whose keys are all masked with a
finite bias is the case to check:

- ``test_masks_match_fp64_reference``: masks of -1e9, ``finfo(float32).min`` and ``-inf`` over part of the keys,
  several query and key tiles (S = 300, not a multiple of 16), forward and backward (q, k, v and the pair bias):
  error against the fp64 reference within 3x PyTorch's error in the same dtype.
- ``test_fully_masked_rows``: one n whose keys are all masked. With ``-inf`` its output and gradients are exactly 0;
  with -1e9 or ``finfo.min`` every fp32 logit of the row rounds to the mask value (|q.k/sqrt(D) + pair| < 32, half
  the float32 spacing at 1e9), so the exact answer for the logits the kernel computes is uniform attention over the
  keys, checked against that computed in fp64 (3x the same formula's error in the same dtype). The other n are
  checked against the fp64 reference as above.

The mask bias is fp32 while q, k, v and the pair bias are in the tested dtype, as OpenFold passes it under autocast.
"""
import math
import os

import pytest
import torch

from ds4sci.kernels import evoformer_attention

from evoformer_checks import assert_within_pytorch_error  # tests/ is on sys.path (its conftest.py)

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
GPU_MARKS = (
    pytest.mark.gpu,
    pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (run on the device machine: pytest -m gpu)"),
    pytest.mark.skipif(CUDA and INTERPRET, reason="TRITON_INTERPRET=1 would interpret the kernels, not run the "
                       "compiled ones: run TRITON_INTERPRET=0 pytest -m gpu tests/kernels/test_gpu.py"),
    pytest.mark.usefixtures("compiled_kernels"),
)


def gpu(test):
    """The marks of a GPU test: ``gpu``, the skips without CUDA or with the interpreter, the compiled-kernel check."""
    for mark in GPU_MARKS:
        test = mark(test)
    return test

Z, N, S, H = 1, 3, 300, 4  # S = 300: 3 to 19 query and 5 to 19 key tiles for every tile-table entry, partial last tiles
MASKS = {"-1e9": -1e9, "finfo.min": torch.finfo(torch.float32).min, "-inf": -math.inf}
# (dtype, head dim): each dtype once, head dims of OpenFold's callers (extra MSA 8, MSA/pair 32, triangle 64)
CASES = [(torch.float32, 32), (torch.bfloat16, 8), (torch.float16, 64), (torch.bfloat16, 32)]
CASE_IDS = ["fp32-D32", "bf16-D8", "fp16-D64", "bf16-D32"]


@pytest.fixture(scope="module")
def compiled_kernels():
    from triton.runtime.jit import JITFunction

    from ds4sci.kernels import triton_evoformer

    assert isinstance(triton_evoformer._fwd_kernel, JITFunction), "the kernels are interpreted, not compiled"


def _inputs(d, mask_value, fully_masked=(), seed=0):
    """fp64 q, k, v, do ``[Z, N, S, H, D]``, pair ``[Z, 1, H, S, S]`` and an fp32 mask bias ``[Z, N, 1, 1, S]``:
    about 30% of the keys of each n masked with ``mask_value`` (never all of them, never key 0), every key of the
    slices in ``fully_masked``."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(Z, N, S, H, d, generator=g, dtype=torch.float64) for _ in range(4))
    pair = torch.randn(Z, 1, H, S, S, generator=g, dtype=torch.float64)
    masked = torch.rand(Z, N, 1, 1, S, generator=g) < 0.3
    masked[..., 0] = False
    for n in fully_masked:
        masked[:, n] = True
    mask = torch.where(masked, torch.tensor(mask_value, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64))
    return q, k, v, do, pair, mask.float()


def _run(q, k, v, do, pair, mask, dtype, backend):
    """Forward and backward through the public API on CUDA: {o, dq, dk, dv, dpair} on the CPU."""
    leaves = [t.to("cuda", dtype).requires_grad_() for t in (q, k, v, pair)]
    mask = mask.to("cuda", torch.float64 if dtype == torch.float64 else torch.float32)
    o = evoformer_attention(leaves[0], leaves[1], leaves[2], [mask, leaves[3]], backend=backend)
    o.backward(do.to("cuda", dtype))
    torch.cuda.synchronize()
    return dict(zip(("o", "dq", "dk", "dv", "dpair"), [o.detach().cpu()] + [t.grad.cpu() for t in leaves]))


def _slices(result, ns):
    """The n slices ``ns`` of o, dq, dk, dv (the pair-bias gradient is summed over n)."""
    return {name: t[:, list(ns)] for name, t in result.items() if name != "dpair"}


def _uniform_attention(q, k, v, do, dtype):
    """o, dq, dk, dv of attention with equal logits on every key (P = 1/S), computed in ``dtype`` on CUDA."""
    q, k, v, do = (t.to("cuda", dtype) for t in (q, k, v, do))
    s = q.shape[2]
    p = torch.full((q.shape[0], q.shape[1], q.shape[3], s, s), 1.0 / s, dtype=dtype, device="cuda")  # [Z, N, H, i, j]
    o = torch.einsum("znhij,znjhd->znihd", p, v)
    dv = torch.einsum("znhij,znihd->znjhd", p, do)
    dp = torch.einsum("znihd,znjhd->znhij", do, v)
    delta = torch.einsum("znihd,znihd->znhi", do, o)[..., None]
    ds = p * (dp - delta)
    scale = 1.0 / math.sqrt(q.shape[-1])
    dq = torch.einsum("znhij,znjhd->znihd", ds, k) * scale
    dk = torch.einsum("znhij,znihd->znjhd", ds, q) * scale
    return {name: t.cpu() for name, t in zip(("o", "dq", "dk", "dv"), (o, dq, dk, dv))}


def _check_against_fp64_reference(inputs, dtype, ns=None):
    ours = _run(*inputs, dtype, "triton")
    ref64 = _run(*inputs, torch.float64, "reference")
    ref_same = _run(*inputs, dtype, "reference")
    if ns is not None:
        ours, ref64, ref_same = (_slices(r, ns) for r in (ours, ref64, ref_same))
    assert_within_pytorch_error(ours, ref64, ref_same, dtype)


@gpu
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("dtype,d", CASES, ids=CASE_IDS)
def test_masks_match_fp64_reference(dtype, d, mask):
    _check_against_fp64_reference(_inputs(d, MASKS[mask]), dtype)


@gpu
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("dtype,d", CASES, ids=CASE_IDS)
def test_fully_masked_rows(dtype, d, mask):
    full = 1
    inputs = _inputs(d, MASKS[mask], fully_masked=(full,), seed=1)
    ours = _run(*inputs, dtype, "triton")
    for name, t in ours.items():
        assert torch.isfinite(t).all(), f"{name}: {(~torch.isfinite(t)).sum().item()} non-finite values"
    _check_against_fp64_reference(inputs, dtype, ns=(0, 2))  # the partly masked slices

    got = _slices(ours, (full,))
    if mask == "-inf":  # defined as zeros: no key contributes, nothing flows back
        for name, t in got.items():
            assert torch.equal(t, torch.zeros_like(t)), f"{name}: max |x| {t.abs().max().item():.3g}, expected 0"
        return
    q, k, v, do = (t[:, full:full + 1].to(dtype).double() for t in inputs[:4])  # what the kernel sees
    scale = 1.0 / math.sqrt(d)
    logits = torch.einsum("znihd,znjhd->znhij", q, k).abs().max().item() * scale + inputs[4].abs().max().item()
    assert logits < 32, "the test's premise: every logit of the row rounds to the mask value in fp32"
    assert_within_pytorch_error(got, _uniform_attention(q, k, v, do, torch.float64),
                                _uniform_attention(q, k, v, do, dtype), dtype)


# ---------------------------------------------------------------------------------------------------------------
# ds4sci bench evoformer-speed without a GPU (CPU tests, not gpu-marked)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(CUDA, reason="checks the command on a machine without CUDA")
def test_speed_benchmark_fails_cleanly_without_cuda(tmp_path, capsys):
    import argparse

    from ds4sci.bench import evoformer_speed

    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    evoformer_speed.add_arguments(parser)
    rc = evoformer_speed.run(parser.parse_args(["--out", str(tmp_path), "--quick"]))
    captured = capsys.readouterr()
    assert rc != 0
    assert captured.err.strip() == "evoformer-speed needs a CUDA GPU; none is visible here"
    assert not any(tmp_path.iterdir())  # no report pretending to have measured something


def _registered():
    from ds4sci.bench import BENCHMARKS

    return "evoformer-speed" in BENCHMARKS


@pytest.mark.skipif(CUDA, reason="checks the command on a machine without CUDA")
@pytest.mark.skipif(not _registered(), reason="evoformer-speed is not registered in ds4sci.bench.BENCHMARKS")
def test_speed_command_fails_cleanly_without_cuda(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "ds4sci.cli", "bench", "evoformer-speed", "--quick", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "evoformer-speed needs a CUDA GPU; none is visible here" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
