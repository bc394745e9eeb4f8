"""The Triton triangle multiplicative update (ds4sci.kernels.triton_trimul) against an fp64 PyTorch reference.

Under the interpreter (``TRITON_INTERPRET=1``, tests/conftest.py) every kernel launch costs about a second on a busy
2-core machine, so the shapes are tiny (N <= 17, c_z = 12, c_hidden = 6) and the cases a covering set: each dtype in
both directions, with and without projection biases (OpenFold's and OpenFold3's convention), odd N that is no
multiple of any tile, masks with fully masked rows and columns, leading batch dims; one case with small tiles runs
every kernel loop several times. Forward and every gradient (z and the 16 weights) must be within 3x PyTorch's own
error in the same dtype (``assert_within_pytorch_error``, as the attention kernels' tests). With
``TRITON_INTERPRET=0`` on a CUDA machine the same tests run the compiled kernels.
"""
import copy
import os
import sys
from dataclasses import fields

import pytest
import torch
import torch.nn.functional as F

from evoformer_checks import assert_within_pytorch_error  # tests/ is on sys.path (its conftest.py)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 or CUDA")
triton = pytest.importorskip("triton")

from ds4sci.kernels import TriMulParams  # noqa: E402
from ds4sci.kernels import triangle_multiplicative_update  # noqa: E402
from ds4sci.kernels import triton_trimul as tt  # noqa: E402
from ds4sci.kernels.triton_common import Tiles  # noqa: E402
from ds4sci.kernels.triton_trimul import trimul_triton  # noqa: E402
from ds4sci.kernels.triton_trimul_tiles import TABLE  # noqa: E402

C_Z, C_HIDDEN, EPS = 12, 6, 1e-5


def _shape(name: str) -> tuple[int, ...]:
    """nn.Linear's layout: [c_out, c_in] weights, [c_out] biases; LayerNorms over their channels."""
    c_out, c_in = {"ln_in": (C_Z, None), "ln_out": (C_HIDDEN, None), "out_proj": (C_Z, C_HIDDEN),
                   "out_gate": (C_Z, C_Z)}.get(name.rsplit("_", 1)[0], (C_HIDDEN, C_Z))
    return (c_out, c_in) if name.endswith("_w") else (c_out,)


def _weights(bias: bool, g: torch.Generator) -> dict:
    """fp64 weights {name: tensor | None}: LayerNorm weights near 1, projections scaled by 1/sqrt(fan-in)."""
    out = {}
    for f in fields(TriMulParams):
        shape = _shape(f.name)
        if f.name.endswith("_b") and not bias:
            out[f.name] = None
        elif f.name.endswith("_w"):
            out[f.name] = torch.randn(shape, generator=g, dtype=torch.float64) / shape[1] ** 0.5
        elif f.name.endswith("weight"):
            out[f.name] = 1 + 0.2 * torch.randn(shape, generator=g, dtype=torch.float64)
        else:
            out[f.name] = 0.2 * torch.randn(shape, generator=g, dtype=torch.float64)
    return out


def reference(z, mask, p: TriMulParams, outgoing: bool, eps: float):
    """AF2 Algorithms 11/12 in plain PyTorch ops, in the inputs' dtype."""
    x = F.layer_norm(z, z.shape[-1:], p.ln_in_weight, p.ln_in_bias, eps)
    m = mask[..., None]
    a = m * torch.sigmoid(F.linear(x, p.a_gate_w, p.a_gate_b)) * F.linear(x, p.a_proj_w, p.a_proj_b)
    b = m * torch.sigmoid(F.linear(x, p.b_gate_w, p.b_gate_b)) * F.linear(x, p.b_proj_w, p.b_proj_b)
    if outgoing:  # p_ij = sum_k a_ik b_jk as [*, c, I, K] @ [*, c, K, J]
        prod = torch.matmul(a.movedim(-1, -3), b.movedim(-1, -3).transpose(-1, -2))
    else:  # p_ij = sum_k a_ki b_kj
        prod = torch.matmul(a.movedim(-1, -3).transpose(-1, -2), b.movedim(-1, -3))
    y = F.layer_norm(prod.movedim(-3, -1), (p.ln_out_weight.shape[0],), p.ln_out_weight, p.ln_out_bias, eps)
    return torch.sigmoid(F.linear(x, p.out_gate_w, p.out_gate_b)) * F.linear(y, p.out_proj_w, p.out_proj_b)


def _inputs(lead: tuple[int, ...], n: int, bias: bool, seed: int):
    """fp64 z ``[*lead, N, N, C_Z]``, a mask ``[*lead, N, N]`` (random zeros, row 1 and column N - 2 fully masked),
    dout and the weights."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(*lead, n, n, C_Z, generator=g, dtype=torch.float64)
    mask = (torch.rand(*lead, n, n, generator=g) > 0.15).double()
    mask[..., 1, :] = 0
    mask[..., :, n - 2] = 0
    dout = torch.randn(*lead, n, n, C_Z, generator=g, dtype=torch.float64)
    return z, mask, dout, _weights(bias, g)


def _run(fn, z, mask, dout, weights, outgoing, dtype, device="cpu") -> dict:
    """{out, dz, d<weight>...} of ``fn`` in ``dtype`` on ``device``, returned on the CPU."""
    leaves = {"z": z.detach().to(device, dtype).requires_grad_()}
    leaves |= {k: v.detach().to(device, dtype).requires_grad_() for k, v in weights.items() if v is not None}
    params = TriMulParams(**{k: leaves.get(k) for k in weights})
    out = fn(leaves["z"], mask.to(device, dtype), params, outgoing, EPS)
    out.backward(dout.to(device, dtype))
    return {"out": out.detach().cpu()} | {f"d{k}": v.grad.cpu() for k, v in leaves.items()}


CASES = [  # (dtype, outgoing, biases, leading dims, N)
    (torch.float32, True, True, (2,), 11),
    (torch.float32, False, False, (), 15),
    (torch.bfloat16, True, False, (), 17),
    (torch.bfloat16, False, True, (), 13),
    (torch.float16, True, True, (), 13),
    (torch.float16, False, False, (1, 1), 17),
]


@pytest.mark.parametrize("dtype, outgoing, bias, lead, n", CASES,
                         ids=[f"{str(c[0])[6:]}-{'out' if c[1] else 'in'}-{'bias' if c[2] else 'nobias'}-N{c[4]}"
                              for c in CASES])
def test_within_3x_pytorch_error(dtype, outgoing, bias, lead, n):
    z, mask, dout, weights = _inputs(lead, n, bias, seed=n)
    ref64 = _run(reference, z, mask, dout, weights, outgoing, torch.float64)
    ref_same = _run(reference, z, mask, dout, weights, outgoing, dtype)
    ours = _run(trimul_triton, z, mask, dout, weights, outgoing, dtype, DEVICE)
    assert len(ours) == 1 + 1 + (16 if bias else 10)
    assert_within_pytorch_error(ours, ref64, ref_same, dtype)


def test_loops_over_tiles_programs_and_splits(monkeypatch):
    """Small tiles, few persistent programs, many weight-gradient splits and c_hidden = 20 in steps of 16, so every
    loop runs several times, the last step partly masked (the product's k loop, the row kernels' tile loop, the input
    backward's hidden-channel loop, the splits' position loop): still the fp64 reference in fp32."""
    small = Tiles(16, 16, 4, 1)
    monkeypatch.setitem(TABLE, ("fp32", 32), (small, small, small, small))
    monkeypatch.setattr(tt, "PRODUCT_BLOCK_K", 16)
    monkeypatch.setattr(tt, "WGRAD_BLOCK_K", 16)
    monkeypatch.setattr(tt, "ROW_PROGRAMS", 3)
    monkeypatch.setattr(tt, "WGRAD_SPLITS", 5)
    monkeypatch.setattr(sys.modules[__name__], "C_HIDDEN", 20)
    z, mask, dout, weights = _inputs((), 17, True, seed=3)
    assert weights["a_proj_w"].shape == (20, C_Z)
    ref64 = _run(reference, z, mask, dout, weights, True, torch.float64)
    ref_same = _run(reference, z, mask, dout, weights, True, torch.float32)
    ours = _run(trimul_triton, z, mask, dout, weights, True, torch.float32, DEVICE)
    assert_within_pytorch_error(ours, ref64, ref_same, torch.float32)


WIDE = [  # (dtype, c_z, c_hidden, outgoing, biases, N): channel blocks of 16 (fp32, fp64), 72 = 4 x 16 + 8, ...
    (torch.float32, 64, 64, True, True, 3),
    (torch.float32, 72, 24, False, False, 3),
    (torch.float64, 40, 24, True, True, 3),
    (torch.float16, 40, 72, False, False, 3),  # the projections' hidden channels in steps of 32: 72 = 2 x 32 + 8
]


@pytest.mark.parametrize("dtype, c_z, c_hidden, outgoing, bias, n", WIDE,
                         ids=[f"{str(c[0])[6:]}-cz{c[1]}-ch{c[2]}-N{c[5]}" for c in WIDE])
def test_wide_channels_run_in_blocks(monkeypatch, dtype, c_z, c_hidden, outgoing, bias, n):
    """Channel counts past one block of the row kernels (the table's fp32 entries for 64 and 128 channels, fp64's
    for 64, fp16's for 128; 72, 40 and 24 leave a partial last block), masked rows and columns, odd N: the output and
    every gradient within 3x PyTorch's same-dtype error of the fp64 reference (fp64: within 1e-10); for 72/24 in fp32
    also the row-block inference (N = 3 in blocks of 2 and 1 rows)."""
    monkeypatch.setattr(sys.modules[__name__], "C_Z", c_z)
    monkeypatch.setattr(sys.modules[__name__], "C_HIDDEN", c_hidden)
    z, mask, dout, weights = _inputs((), n, bias, seed=n)
    ref64 = _run(reference, z, mask, dout, weights, outgoing, torch.float64)
    ref_same = _run(reference, z, mask, dout, weights, outgoing, dtype)
    ours = _run(trimul_triton, z, mask, dout, weights, outgoing, dtype, DEVICE)
    assert len(ours) == 1 + 1 + (16 if bias else 10)
    assert_within_pytorch_error(ours, ref64, ref_same, dtype)
    if (c_z, dtype) == (72, torch.float32):
        inferred, _ = _infer(z, mask, weights, outgoing, dtype, 2)
        assert_within_pytorch_error({"out": inferred}, {"out": ref64["out"]}, {"out": ref_same["out"]}, dtype)


def test_rejects_what_the_kernels_cannot_take():
    z = torch.zeros(3, 3, 200)
    w = _weights(False, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="c_z must be in 1..128, got 200"):
        half = TriMulParams(**{k: v if v is None else v.bfloat16() for k, v in w.items()})
        trimul_triton(z.bfloat16(), None, half, True, EPS)
    with pytest.raises(ValueError, match="c_hidden must be in 1..128, got 129"):
        wide = TriMulParams(**(w | {"a_proj_w": torch.zeros(129, C_Z)}))
        trimul_triton(torch.zeros(3, 3, C_Z), None, wide, True, EPS)
    with pytest.raises(TypeError, match="dtype must be one of"):
        trimul_triton(torch.zeros(3, 3, C_Z, dtype=torch.int32), None, TriMulParams(**w), True, EPS)
    with pytest.raises(ValueError, match=r"\[\*, N, N, c_z\], got \(3, 4, 12\)"):
        trimul_triton(torch.zeros(3, 4, C_Z), None, TriMulParams(**w), True, EPS)
    with pytest.raises(ValueError, match="chunk must be at least 1 row, got 0"):  # inference in row blocks
        fp32 = TriMulParams(**{k: v if v is None else v.float() for k, v in w.items()})
        trimul_triton(torch.zeros(3, 3, C_Z), None, fp32, True, EPS, 0)


def test_the_public_function_runs_these_kernels_for_backend_triton_and_auto_only_on_cuda(monkeypatch):
    """``triangle_multiplicative_update(..., backend="triton")`` is ``trimul_triton`` on the same weights, mask and
    direction (bitwise); ``"auto"`` takes the kernels for CUDA tensors only (on the CPU: the chunked path)."""
    z, mask, dout, weights = _inputs((), 9, True, seed=4)
    for outgoing in (True, False):
        direct = _run(trimul_triton, z, mask, dout, weights, outgoing, torch.float32, DEVICE)
        public = _run(lambda *a: triangle_multiplicative_update(*a[:3], outgoing=a[3], eps=a[4], backend="triton"),
                      z, mask, dout, weights, outgoing, torch.float32, DEVICE)
        assert all(torch.equal(public[k], direct[k]) for k in direct), outgoing
    if INTERPRET:
        monkeypatch.setattr(tt, "trimul_triton", lambda *a: pytest.fail("auto ran the Triton kernels on the CPU"))
        auto, chunked = (_run(lambda *a, b=b: triangle_multiplicative_update(*a[:3], outgoing=a[3], eps=a[4],
                                                                             backend=b),
                              z, mask, dout, weights, True, torch.float32) for b in ("auto", "chunked"))
        assert all(torch.equal(auto[k], chunked[k]) for k in chunked)


def _infer(z, mask, weights, outgoing, dtype, chunk, device=DEVICE) -> tuple[torch.Tensor, int]:
    """``trimul_triton`` without autograd (its inference in blocks of ``chunk`` rows) in ``dtype``: (the output on the
    CPU, the peak bytes of live tensors beyond the inputs and weights)."""
    from ds4sci.bench.memory import LiveTensors

    z, mask = z.to(device, dtype), mask.to(device, dtype)
    params = TriMulParams(**{k: None if v is None else v.to(device, dtype) for k, v in weights.items()})
    inputs = [t for t in (z, mask, *params.tensors()) if t is not None]
    with torch.no_grad(), LiveTensors(t.untyped_storage().data_ptr() for t in inputs) as live:
        out = trimul_triton(z, mask, params, outgoing, EPS, chunk)
    return out.cpu(), live.peak


@pytest.mark.parametrize("outgoing", [True, False], ids=["outgoing", "incoming"])
def test_inference_in_row_blocks_holds_one_block(outgoing):
    """Without autograd the kernels run on blocks of rows (odd N = 15 in blocks of 8 and 7 rows, masked rows and
    columns, fp32): the output is within 3x PyTorch's fp32 error of the fp64 reference, and the live tensors beyond
    the inputs peak at the output plus one block's row operand, product and both operands of a block of the other
    (four ``[c, R, N]``) and its LN_in statistics (``[R, N, 2]`` fp32); incoming edges (the working frame is z's
    transpose) also copy that block's z and mask rows contiguous. Never ``a``, ``b`` or ``p`` whole."""
    n, chunk = 15, 8
    z, mask, _, weights = _inputs((), n, True, seed=5)
    ours, peak = _infer(z, mask, weights, outgoing, torch.float32, chunk)
    ref64, ref32 = (reference(z.to(d), mask.to(d), TriMulParams(**{k: None if v is None else v.to(d)
                                                                  for k, v in weights.items()}), outgoing, EPS)
                    for d in (torch.float64, torch.float32))
    assert_within_pytorch_error({"out": ours}, {"out": ref64}, {"out": ref32}, torch.float32)
    block = chunk * n * 4  # bytes of one fp32 channel of a block
    copies = 0 if outgoing else block * (C_Z + 1)
    assert peak == n * n * C_Z * 4 + 4 * C_HIDDEN * block + 2 * block + copies


@pytest.mark.parametrize("dtype, outgoing, bias, lead, n, chunk", [
    (torch.bfloat16, False, False, (2,), 7, 4), (torch.float16, True, True, (1, 1), 9, 4)], ids=["bf16-in", "fp16-out"])
def test_inference_within_3x_pytorch_error_in_half_dtypes(dtype, outgoing, bias, lead, n, chunk):
    """The public function with ``backend="triton"`` without autograd, half dtypes, leading dims, odd N in blocks of
    4 rows (7 = 4 + 3, 9 = 4 + 4 + 1: a last block of one row): within 3x PyTorch's same-dtype error of the fp64
    reference."""
    z, mask, _, weights = _inputs(lead, n, bias, seed=n)

    def run(d, device="cpu", **kw):
        params = TriMulParams(**{k: None if v is None else v.to(device, d) for k, v in weights.items()})
        with torch.no_grad():
            return triangle_multiplicative_update(z.to(device, d), mask.to(device, d), params, outgoing=outgoing,
                                                  eps=EPS, **kw).cpu()

    ours = run(dtype, DEVICE, backend="triton", chunk_size=chunk)
    refs = [run(d, backend="torch") for d in (torch.float64, dtype)]
    assert_within_pytorch_error({"out": ours}, {"out": refs[0]}, {"out": refs[1]}, dtype)


@pytest.mark.parametrize("name", ["TriangleMultiplicationOutgoing", "TriangleMultiplicationIncoming",
                                  "FusedTriangleMultiplicationOutgoing", "FusedTriangleMultiplicationIncoming"])
def test_openfold3_modules_through_the_kernels(name):
    """OpenFold3's module (plain or Multimer-fused) loaded strictly into ds4sci's with ``backend="triton"``: in fp32
    its output and the gradients of z and of every parameter within 3x PyTorch's fp32 error of OpenFold3's own module
    in fp64 (OpenFold3's in fp32 giving PyTorch's error), fully masked row and column included, and without autograd
    (the row-block inference, 4-row blocks of N = 11) its output too; in fp64 (N = 5, blocks of 4 and 1 rows) equal to
    OpenFold3's in fp64 to rounding, as the chunked path (tests/kernels/test_trimul.py), in training and inference."""
    from openfold3.core.model.layers import triangular_multiplicative_update as of3

    from ds4sci.models.evoformer import TriangleMultiplicationIncoming
    from ds4sci.models.evoformer import TriangleMultiplicationOutgoing

    torch.manual_seed(0)
    ref_module = getattr(of3, name)(C_Z, C_HIDDEN).double()
    with torch.no_grad():  # OpenFold3's init zeroes the output projection and opens the gates: random weights instead
        for p in ref_module.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    cls = TriangleMultiplicationIncoming if name.endswith("Incoming") else TriangleMultiplicationOutgoing
    module = cls(C_Z, C_HIDDEN, name.startswith("Fused"), backend="triton")
    module.load_state_dict(ref_module.state_dict(), strict=True)
    z, mask, dout, _ = _inputs((1,), 11, False, seed=7)

    def run(m, dtype, device="cpu"):
        m = m.to(device, dtype)
        leaf = z.to(device, dtype).requires_grad_()
        out = m(leaf, mask.to(device, dtype))
        grads = torch.autograd.grad(out, [leaf, *m.parameters()], dout.to(device, dtype))
        names = ["dz", *(f"d{k}" for k, _ in m.named_parameters())]
        return {"out": out.detach().cpu()} | {k: g.cpu() for k, g in zip(names, grads)}

    ref64 = run(ref_module, torch.float64)
    ref32 = run(copy.deepcopy(ref_module), torch.float32)
    assert_within_pytorch_error(run(module, torch.float32, DEVICE), ref64, ref32, torch.float32)
    with torch.no_grad():
        inferred = module.to(DEVICE)(z.to(DEVICE, torch.float32), mask.to(DEVICE, torch.float32), 4).cpu()
    assert_within_pytorch_error({"out": inferred}, {"out": ref64["out"]}, {"out": ref32["out"]}, torch.float32)
    module.double().load_state_dict(ref_module.state_dict(), strict=True)  # the fp64 weights, not fp32's rounding
    z, mask, dout, _ = _inputs((1,), 5, False, seed=8)
    ref64, ours64 = run(ref_module, torch.float64), run(module, torch.float64, DEVICE)
    assert ours64.keys() == ref64.keys()
    for key, ref in ref64.items():
        tol = 1e-12 if key == "out" else 1e-11
        torch.testing.assert_close(ours64[key], ref, rtol=tol, atol=tol, msg=lambda m: f"fp64 {key}: {m}")
    with torch.no_grad():
        inferred = module.to(DEVICE)(z.to(DEVICE), mask.to(DEVICE), 4).cpu()
    torch.testing.assert_close(inferred, ref64["out"], rtol=1e-12, atol=1e-12)
