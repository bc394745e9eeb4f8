"""Checks shared by the Evoformer layer tests (tests/models) and the OpenFold integration tests (tests/integrations)."""
import importlib.util
import math
import os

import pytest
import torch

# The triton backend runs on CPU tensors only under the interpreter (tests/conftest.py sets it; =0 skips these).
HAS_TRITON_BACKEND = (
    importlib.util.find_spec("ds4sci.kernels.triton_evoformer") is not None
    and os.environ.get("TRITON_INTERPRET") == "1"
)
TRITON = pytest.param("triton",
                      marks=pytest.mark.skipif(not HAS_TRITON_BACKEND, reason="no triton backend or interpreter"))


def randomize_(module, seed):
    """Fresh random parameters (AF2's init zeroes the output projection ``linear_o``, which would hide everything)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, prm in module.named_parameters():
            if prm.ndim == 2:
                prm.copy_(torch.randn(prm.shape, generator=g) / math.sqrt(prm.shape[1]))
            elif "layer_norm" in name and name.endswith("weight"):
                prm.copy_(1 + 0.2 * torch.randn(prm.shape, generator=g))
            else:
                prm.copy_(0.2 * torch.randn(prm.shape, generator=g))
    return module


def assert_within_pytorch_error(ours, ref64, ref_same_dtype, dtype, factor=3.0):
    """Every tensor of the dicts: error vs fp64 <= factor * PyTorch's error in ``dtype`` + 10 ulps of its magnitude
    (fp64: <= 1e-10 relative to its magnitude)."""
    assert ours.keys() == ref64.keys() == ref_same_dtype.keys()
    for name in ref64:
        a, r, b = ours[name], ref64[name], ref_same_dtype[name]
        assert a is not None and a.shape == r.shape and a.dtype == dtype, name
        assert torch.isfinite(a).all(), name
        scale = max(1.0, r.abs().max().item())
        err = (a.double() - r).abs().max().item()
        if dtype == torch.float64:
            assert err <= 1e-10 * scale, f"{name}: fp64 error {err:.3g}"
            continue
        err_pt = (b.double() - r).abs().max().item()
        floor = 10 * torch.finfo(dtype).eps * scale
        assert err <= factor * err_pt + floor, f"{name}: error {err:.3g} vs PyTorch {dtype} error {err_pt:.3g}"
