"""The triangle multiplicative update (``ds4sci.kernels.triangle_multiplicative_update``, issue #45): OpenFold3's
modules load strictly into ds4sci's and give their outputs and every gradient in fp64 through the chunked and torch
paths; the input errors; and the memory the chunked path promises, measured at N = 64, c_z = c = 32, fp32 (the
issue's shape): bytes saved for backward (saved-tensor hooks) and the inference peak (live tensors)."""
import pytest
import torch
from openfold3.core.model.layers import triangular_multiplicative_update as of3

from ds4sci.bench.memory import LiveTensors
from ds4sci.kernels import TriMulParams
from ds4sci.kernels import triangle_multiplicative_update
from ds4sci.kernels.trimul import channel_product
from ds4sci.kernels.trimul import triangle_finish
from ds4sci.kernels.trimul import triangle_operand
from ds4sci.kernels.trimul import trimul_torch
from ds4sci.models.evoformer import TriangleMultiplicationIncoming
from ds4sci.models.evoformer import TriangleMultiplicationOutgoing

from activation_checks import SavedBytes  # tests/ is on sys.path (its conftest.py)
from evoformer_checks import assert_within_pytorch_error

C_Z, C_HIDDEN, N = 8, 6, 11  # N odd and not a multiple of the chunks below
OF3 = {  # OpenFold3 class -> (ds4sci class, fused projections)
    "outgoing": (of3.TriangleMultiplicationOutgoing, TriangleMultiplicationOutgoing, False),
    "incoming": (of3.TriangleMultiplicationIncoming, TriangleMultiplicationIncoming, False),
    "fused-outgoing": (of3.FusedTriangleMultiplicationOutgoing, TriangleMultiplicationOutgoing, True),
    "fused-incoming": (of3.FusedTriangleMultiplicationIncoming, TriangleMultiplicationIncoming, True),
}


def _mask(*shape: int) -> torch.Tensor:
    """A random 0/1 pair mask ``[B, N, N]`` with a fully masked row in batch 0 and a fully masked column in batch 1."""
    mask = (torch.rand(*shape) > 0.2).double()
    mask[0, 3, :] = 0
    mask[1, :, 5] = 0
    return mask


@pytest.mark.parametrize("kind", sorted(OF3))
def test_openfold3_modules_load_and_match_in_fp64(kind):
    """OpenFold3's state dict loads strictly into ds4sci's module; its output and the gradients of z and of every
    parameter agree in fp64 (to rounding) through the chunked path (2- and 4-row blocks of 11 rows, and the default)
    and the torch path."""
    of3_cls, ds_cls, fused = OF3[kind]
    torch.manual_seed(0)
    ref_module = of3_cls(C_Z, C_HIDDEN).double()
    with torch.no_grad():  # OpenFold3's init zeroes the output projection and opens the gates: random weights instead
        for p in ref_module.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    module = ds_cls(C_Z, C_HIDDEN, fused).double()
    module.load_state_dict(ref_module.state_dict(), strict=True)
    z = torch.randn(2, N, N, C_Z, dtype=torch.float64, requires_grad=True)
    mask = _mask(2, N, N)
    ref = ref_module(z, mask)
    grad = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, [z, *ref_module.parameters()], grad)
    for backend, chunk_size in (("chunked", 2), ("chunked", 4), ("chunked", None), ("torch", None)):
        module.backend = backend
        out = module(z, mask, chunk_size)
        grads = torch.autograd.grad(out, [z, *module.parameters()], grad)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12, msg=lambda m: f"{backend} {chunk_size}: {m}")
        for name, g, g_ref in zip(["z", *dict(module.named_parameters())], grads, ref_grads):
            torch.testing.assert_close(g, g_ref, rtol=1e-11, atol=1e-11, msg=lambda m: f"{backend} {name}: {m}")


def test_default_mask_and_batch_dims():
    """mask=None is all ones, a mask broadcasts over leading dims, and extra leading dims pass through."""
    torch.manual_seed(1)
    module = TriangleMultiplicationIncoming(C_Z, C_HIDDEN, convention="openfold").double()
    params = TriMulParams.from_module(module)
    z = torch.randn(2, 3, 7, 7, C_Z, dtype=torch.float64)
    mask = _mask(3, 7, 7)
    for backend in ("chunked", "torch"):
        full = triangle_multiplicative_update(z, torch.ones(7, 7), params, outgoing=False, backend=backend)
        none = triangle_multiplicative_update(z, None, params, outgoing=False, backend=backend)
        torch.testing.assert_close(none, full, rtol=0, atol=0)
    chunked = triangle_multiplicative_update(z, mask, params, outgoing=False, chunk_size=3)
    plain = triangle_multiplicative_update(z, mask.expand(2, 3, 7, 7), params, outgoing=False, backend="torch")
    torch.testing.assert_close(chunked, plain, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("outgoing", [True, False], ids=["outgoing", "incoming"])
def test_inference_path_is_exact(outgoing):
    """Without autograd the chunked path recomputes the other operand block by block: in fp64 it gives the torch
    path's output to rounding, with 2-, 3- and 4-row blocks of 11 rows and the default, masked rows and columns."""
    torch.manual_seed(4)
    cls = TriangleMultiplicationOutgoing if outgoing else TriangleMultiplicationIncoming
    params = TriMulParams.from_module(cls(C_Z, C_HIDDEN, convention="openfold").double().requires_grad_(False))
    for t in params.tensors():
        t.normal_()
    z, mask = torch.randn(2, N, N, C_Z, dtype=torch.float64), _mask(2, N, N)
    ref = trimul_torch(z, mask, params, outgoing, 1e-5)
    for chunk_size in (2, 3, 4, None):
        out = triangle_multiplicative_update(z, mask, params, outgoing=outgoing, backend="chunked",
                                             chunk_size=chunk_size)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12, msg=lambda m: f"{chunk_size}: {m}")


@pytest.mark.parametrize("call, error, message", [
    (lambda z, m, p: triangle_multiplicative_update(z[:, :5], m, p, outgoing=True), ValueError,
     r"\[\*, N, N, C_z\].*\(1, 5, 6, 8\)"),
    (lambda z, m, p: triangle_multiplicative_update(z[..., :4], m, p, outgoing=True), ValueError, "C_z = 8"),
    (lambda z, m, p: triangle_multiplicative_update(z, m[:, :5], p, outgoing=True), ValueError,
     r"mask of shape \(1, 5, 6\)"),
    (lambda z, m, p: triangle_multiplicative_update(z, m, p, outgoing=True, chunk_size=0), ValueError,
     "chunk_size must be a positive int or None, got 0"),
    (lambda z, m, p: triangle_multiplicative_update(z, m, p, outgoing=True, backend="cueq"), ValueError,
     "unknown backend 'cueq'"),
    (lambda z, m, p: triangle_multiplicative_update(z, m, p, outgoing=True, eps=0.0), ValueError, "eps"),
    (lambda z, m, p: triangle_multiplicative_update(z.long(), m, p, outgoing=True), TypeError, "torch.int64"),
    (lambda z, m, p: triangle_multiplicative_update(z, m, {}, outgoing=True), TypeError, "TriMulParams"),
])
def test_input_errors(call, error, message):
    module = TriangleMultiplicationOutgoing(C_Z, C_HIDDEN)
    with pytest.raises(error, match=message):
        call(torch.randn(1, 6, 6, C_Z), torch.ones(1, 6, 6), TriMulParams.from_module(module))


MEM_N, MEM_C = 64, 32  # the measurement: N = 64, c_z = c_hidden = 32, fp32


def _measure(module, backend: str) -> tuple[float, float]:
    """(bytes saved for backward, inference peak of live tensors beyond the inputs), in units of z's bytes."""
    module.backend = backend
    torch.manual_seed(2)
    z = torch.randn(1, MEM_N, MEM_N, MEM_C)
    mask = torch.ones(1, MEM_N, MEM_N)
    with SavedBytes(module) as saved:
        module(z.requires_grad_(), mask)
    z = z.detach()
    ignore = [t.untyped_storage().data_ptr() for t in (*module.parameters(), z, mask)]
    with torch.no_grad(), LiveTensors(ignore) as live:
        module(z, mask)
    return saved.total / z.nbytes, live.peak / z.nbytes


@pytest.mark.parametrize("cls", [TriangleMultiplicationOutgoing, TriangleMultiplicationIncoming])
def test_memory_per_update(cls):
    """Training: the chunked path saves z, the product p (two pair-sized tensors) and the mask (N^2 numbers),
    ``2 + 1/32`` times z's bytes, where the torch path saves 14.16 times. Inference: the output and one block of N/8
    rows (the default; the other operand is recomputed a block at a time, never whole), whose widest moment is 7
    tensors of the block's ``[R, N, 32]`` (the row block's operand and product beside a block of the other operand
    being built: x, its gate, projection and two products): ``1 + 7/8`` times z (the issue's target, a chunk beyond
    the input and the output), against 6 for the torch path."""
    module = cls(MEM_C, MEM_C)
    saved, peak = _measure(module, "chunked")
    assert saved == 2 + 1 / MEM_C
    assert peak == 1 + 7 / 8
    saved_torch, peak_torch = _measure(module, "torch")
    assert saved_torch == pytest.approx(14.16, abs=0.01)
    assert peak_torch == 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cls", [TriangleMultiplicationOutgoing, TriangleMultiplicationIncoming])
def test_chunked_within_pytorch_error(cls, dtype):
    """fp32 and bf16 on the CPU: the chunked path's output and every gradient against the fp64 reference, within 3x
    the torch path's error in the same dtype (tests/kernels/test_trimul_gpu.py does the same on CUDA, fp16 too)."""
    n, c = 23, 8  # 3-row blocks, the last one of 2 rows
    torch.manual_seed(0)
    ref_module = cls(c, c, convention="openfold").double()
    with torch.no_grad():
        for p in ref_module.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    module = cls(c, c, convention="openfold").to(dtype)
    module.load_state_dict(ref_module.state_dict())
    z, grad = torch.randn(2, 1, n, n, c, dtype=torch.float64)
    mask = _mask(2, n, n)[1:]  # a fully masked column

    def run(m, backend, t):
        m.backend = backend
        t = t.to(m.layer_norm_in.weight.dtype).requires_grad_()
        out = m(t, mask.to(t.dtype))
        grads = torch.autograd.grad(out, [t, *m.parameters()], grad.to(t.dtype))
        return {"out": out.detach(), "z": grads[0]} | dict(zip(dict(m.named_parameters()), grads[1:]))

    assert_within_pytorch_error(run(module, "chunked", z), run(ref_module, "torch", z), run(module, "torch", z), dtype)


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("outgoing", [True, False], ids=["outgoing", "incoming"])
def test_steps_are_the_update_and_save_z_operands_p(outgoing, fused):
    """The steps the context-parallel forms run on shards and tiles (triangle_operand, channel_product,
    triangle_finish) give the torch path's output and every gradient in fp64, and save for backward only z, the
    mask, the two operands (the product's inputs) and p: ``C_z + 3 c`` numbers per pair beside the mask."""
    torch.manual_seed(3)
    cls = TriangleMultiplicationOutgoing if outgoing else TriangleMultiplicationIncoming
    module = cls(C_Z, C_HIDDEN, fused, convention="openfold").double()
    for p in module.parameters():
        p.data.normal_()
    z, mask = torch.randn(2, N, N, C_Z, dtype=torch.float64), _mask(2, N, N)
    params, grad = TriMulParams.from_module(module), torch.randn(2, N, N, C_Z, dtype=torch.float64)
    outs = []
    for steps in (False, True):
        zz = z.clone().requires_grad_()
        with SavedBytes(module) as saved:
            if steps:
                a, b = (triangle_operand(zz, mask, params, which, 1e-5) for which in "ab")
                out = triangle_finish(zz, channel_product(a, b, outgoing), params, 1e-5)
            else:
                out = trimul_torch(zz, mask, params, outgoing, 1e-5)
        outs.append((out, torch.autograd.grad(out, [zz, *module.parameters()], grad)))
    (ref, ref_grads), (out, grads) = outs
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-11)
    assert saved.total == z.nbytes + mask.nbytes + 3 * z.nbytes // C_Z * C_HIDDEN
