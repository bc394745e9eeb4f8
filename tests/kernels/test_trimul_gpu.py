"""The triangle multiplicative update's chunked path on a CUDA GPU (``pytest -m gpu``; skips without CUDA): fp32,
bf16 and fp16 against an fp64 reference within 3x PyTorch's own error in the same dtype (outputs, the gradient of z
and of every weight), masks with a fully masked row and column, N not a multiple of the block; and the peak CUDA
memory of a forward+backward against the torch path's at N = 512, c = 128. Nothing here has run on a GPU yet."""
import pytest
import torch

from ds4sci.models.evoformer import TriangleMultiplicationIncoming
from ds4sci.models.evoformer import TriangleMultiplicationOutgoing

from evoformer_checks import assert_within_pytorch_error  # tests/ is on sys.path (its conftest.py)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU (run on the device machine: pytest -m gpu)")]


def _module(cls, c: int, dtype: torch.dtype):
    torch.manual_seed(0)
    module = cls(c, c, convention="openfold")
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return module.to("cuda", dtype)


def _run(module, backend: str, z: torch.Tensor, mask: torch.Tensor, grad: torch.Tensor) -> dict:
    module.backend = backend
    z = z.detach().clone().requires_grad_()
    out = module(z, mask)
    grads = torch.autograd.grad(out, [z, *module.parameters()], grad.to(out.dtype))
    return {"out": out.detach(), "z": grads[0]} | dict(zip(dict(module.named_parameters()), grads[1:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("cls", [TriangleMultiplicationOutgoing, TriangleMultiplicationIncoming])
def test_chunked_within_pytorch_error(cls, dtype):
    n, c = 203, 64  # the default block is 26 rows: 8 blocks, the last one shorter
    g = torch.Generator(device="cuda").manual_seed(1)
    z = torch.randn(1, n, n, c, device="cuda", dtype=torch.float64, generator=g)
    grad = torch.randn(1, n, n, c, device="cuda", dtype=torch.float64, generator=g)
    mask = (torch.rand(1, n, n, device="cuda", generator=g) > 0.1).double()
    mask[0, 7, :] = 0
    mask[0, :, 11] = 0
    ref64 = _run(_module(cls, c, torch.float64), "torch", z, mask, grad)
    module = _module(cls, c, dtype)
    same_dtype = _run(module, "torch", z.to(dtype), mask.to(dtype), grad)
    ours = _run(module, "chunked", z.to(dtype), mask.to(dtype), grad)
    assert_within_pytorch_error(ours, ref64, same_dtype, dtype)


def test_chunked_peak_below_torch():
    """fp32, N = 512, c_z = c_hidden = 128 (z 128 MiB): the chunked path's forward+backward peaks at most 3/4 of the
    torch path's (it saves 2 pair-sized tensors where the torch path saves 14)."""
    n, c = 512, 128
    module = _module(TriangleMultiplicationOutgoing, c, torch.float32)
    z = torch.randn(1, n, n, c, device="cuda")
    mask = torch.ones(1, n, n, device="cuda")
    peaks = {}
    for backend in ("torch", "chunked"):
        module.backend = backend
        zg = z.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        module(zg, mask).backward(torch.ones_like(z))
        torch.cuda.synchronize()
        peaks[backend] = torch.cuda.max_memory_allocated() - base
        del zg
        module.zero_grad(set_to_none=True)
    assert peaks["chunked"] <= 0.75 * peaks["torch"], peaks
