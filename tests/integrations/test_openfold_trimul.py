"""``ds4sci.integrations.openfold.triangle_updates``: OpenFold3's triangle multiplicative updates (plain and fused,
outgoing and incoming) run on ds4sci's kernel with their own parameters, in training (outputs and every gradient,
fp64) and on OpenFold3's in-place inference path; ``triangle_updates_off`` puts back the very same methods."""
import pytest
import torch
from openfold3.core.model.layers import triangular_multiplicative_update as of3

from ds4sci.integrations import openfold as ds4sci_openfold

N, C_Z, C_HIDDEN = 9, 8, 6
CLASSES = (of3.TriangleMultiplicativeUpdate, of3.FusedTriangleMultiplicativeUpdate)
ORIGINALS = [cls.__dict__["forward"] for cls in CLASSES]  # before any switch


@pytest.fixture
def switched():
    yield ds4sci_openfold.triangle_updates("chunked")
    ds4sci_openfold.triangle_updates_off()


@pytest.mark.parametrize("cls", [of3.TriangleMultiplicationIncoming, of3.FusedTriangleMultiplicationOutgoing])
def test_openfold3_update_runs_ds4sci_kernel(cls):
    torch.manual_seed(0)
    module = cls(C_Z, C_HIDDEN).double()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    z = torch.randn(1, N, N, C_Z, dtype=torch.float64, requires_grad=True)
    mask = (torch.rand(1, N, N) > 0.2).double()
    grad = torch.randn(1, N, N, C_Z, dtype=torch.float64)
    runs = []
    for switch in (False, True):
        if switch:
            assert ds4sci_openfold.triangle_updates("chunked") == ["TriangleMultiplicativeUpdate",
                                                                  "FusedTriangleMultiplicativeUpdate"]
        try:
            assert hasattr(type(module).forward, "ds4sci_backend") == switch
            out = module(z, mask)
            grads = torch.autograd.grad(out, [z, *module.parameters()], grad)
            with torch.no_grad():  # OpenFold3's in-place inference path: z overwritten with z + update
                z_inplace = z.detach().clone()
                result = module(z_inplace, mask, inplace_safe=True, _add_with_inplace=True, _inplace_chunk_size=4)
                assert result.data_ptr() == z_inplace.data_ptr()
            runs.append((out, grads, result))
        finally:
            ds4sci_openfold.triangle_updates_off()
    (ref, ref_grads, ref_inplace), (out, grads, inplace) = runs
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for g, g_ref in zip(grads, ref_grads):
        torch.testing.assert_close(g, g_ref, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(inplace, ref_inplace, rtol=1e-12, atol=1e-12)


def test_off_restores_the_same_methods(switched):
    assert of3.TriangleMultiplicativeUpdate.forward.ds4sci_backend.value == "chunked"
    ds4sci_openfold.triangle_updates("torch")  # a second call changes the backend, keeps the originals
    ds4sci_openfold.triangle_updates_off()
    assert [of3.TriangleMultiplicativeUpdate.forward, of3.FusedTriangleMultiplicativeUpdate.forward] == ORIGINALS
