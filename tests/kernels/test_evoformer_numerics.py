"""Softmax numerics of every Evoformer backend at extreme masks, where three things can go wrong: (1) a fused
multiply-add builds the exponent from a large, separately scaled row max; (2) a row whose keys are all ``-inf``
computes ``-inf - -inf`` (NaN) unless its max is guarded; (3) a log-sum-exp ``m + log l`` stored as one fp32 number
loses ``log l`` when |m| is huge.

Masks of OpenFold's ``-1e9``, ``torch.finfo(dtype).min`` (Hugging Face's convention) and ``-inf``, on one
partially masked slice (n = 0: about half of its keys, in runs across tiles) and one fully masked slice (n = 1: every
key), with enough keys for many key tiles: S = 453 is 8 tiles of the widest key tile in the triton backend's table at
D = 16 (64 keys) and 15 of the fp32 backward's 32, so a per-tile error compounds as it would at real lengths. Under
Triton's interpreter the triton backend runs S = 197 (4 and 7 tiles, still unaligned): its cost grows as the square of
the tiles, and failure 1, the one that compounds over tiles, cannot show there (below).

What is expected (forward and backward, against fp64):

- Real rows (n = 0): the fp64 reference, within 3x PyTorch's own same-dtype error (``assert_within_pytorch_error``).
- Fully masked rows with a finite mask: in fp32 every logit of such a row rounds to the mask value (1e9 has a float32
  spacing of 64), so PyTorch's softmax in the input dtype is uniform attention over the row. The fp64 truth for
  those rows is therefore uniform attention computed in fp64 (:func:`_uniform_fp64`), not the fp64 reference (which
  still resolves the logits): outputs and gradients match it, not S times it (what a stored ``lse = m + log(l)``
  that loses ``log(l)`` to rounding produced: failure 3).
- Fully masked rows with ``-inf``: zeros, never NaN.

Failure 1 only shows on a GPU: with ``TRITON_INTERPRET=0`` on a CUDA machine these tests run the compiled kernels
(``DEVICE``), where the old arithmetic turned the fully masked ``-1e9`` rows into NaN after a few key tiles. Under the
interpreter every operation rounds separately, so only failures 2 and 3 can show here.
"""
import importlib.util
import math
import os

import pytest
import torch

from ds4sci.kernels import evoformer_attention
from ds4sci.kernels import evoformer_chunked
from ds4sci.kernels import evoformer_reference

from evoformer_checks import assert_within_pytorch_error

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
# The kernels run interpreted on the CPU, or compiled on a CUDA GPU with TRITON_INTERPRET=0
KERNELS_RUN = importlib.util.find_spec("ds4sci.kernels.triton_evoformer") is not None and (
    INTERPRET or torch.cuda.is_available())
TRITON = pytest.param("triton", marks=pytest.mark.skipif(not KERNELS_RUN, reason="needs TRITON_INTERPRET=1 or CUDA"))

B, N, H, D = 1, 2, 1, 16
S_COMPILED, S_INTERPRETED = 453, 197  # keys (see the module docstring)
REAL, MASKED = 0, 1  # n = 0: partially masked rows; n = 1: every key masked
NAMES = ("o", "dq", "dk", "dv", "dmask", "dpair")


def _keys(backend: str) -> int:
    """S for ``backend``: :data:`S_INTERPRETED` for the triton backend under the interpreter, else S_COMPILED."""
    return S_INTERPRETED if backend == "triton" and INTERPRET else S_COMPILED


def _masked_keys(s: int) -> torch.Tensor:
    """Keys masked in the partial slice: runs of 40 keys on and off (crossing tile edges) plus every 7th key."""
    j = torch.arange(s)
    return ((j // 40) % 2 == 1) | (j % 7 == 0)


def _leaves(seed: int, s: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Fresh random fp64 q, k, v ``[B, N, S, H, D]``, pair ``[B, 1, H, S, S]`` and dO (never zeros)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(B, N, s, H, D, generator=g, dtype=torch.float64) for _ in range(4))
    pair = torch.randn(B, 1, H, s, s, generator=g, dtype=torch.float64)
    return [q, k, v, pair], do


def _mask(fill: float, dtype: torch.dtype, s: int) -> torch.Tensor:
    """Mask bias ``[B, N, 1, 1, S]`` in ``dtype``: 0 on kept keys, ``fill`` on masked ones."""
    mask = torch.zeros(B, N, 1, 1, s, dtype=dtype)
    mask[0, REAL, 0, 0, _masked_keys(s)] = fill
    mask[0, MASKED] = fill
    return mask


def _fill(kind: str, mask_dtype: torch.dtype) -> float:
    return {"-1e9": -1e9, "min": torch.finfo(mask_dtype).min, "-inf": -math.inf}[kind]


def _run(backend, q, k, v, mask, pair, do, dtype, mask_dtype, device="cpu") -> dict:
    """Forward and backward through the public API: {o, dq, dk, dv, dmask, dpair} on the CPU."""
    qkv = [t.detach().to(device, dtype).requires_grad_() for t in (q, k, v)]
    mask_ = mask.detach().to(device, mask_dtype).requires_grad_()
    pair_ = pair.detach().to(device, dtype).requires_grad_()
    o = evoformer_attention(*qkv, [mask_, pair_], backend=backend)
    o.backward(do.to(device, dtype))
    return dict(zip(NAMES, [o.detach().cpu()] + [t.grad.cpu() for t in (*qkv, mask_, pair_)]))


def _uniform_fp64(q, k, v, do) -> dict:
    """fp64 outputs and gradients of uniform attention (p = 1/S) for one slice, q, k, v, dO ``[S, D]``.

    dS = P * (dP - rowsum(dO * O)) with dP = dO V^T (the softmax backward): dQ = dS K / sqrt(D), dK = dS^T Q / sqrt(D),
    dV = P^T dO, dmask = colsum(dS), dpair = dS.
    """
    s_len, d = q.shape
    scale = 1.0 / math.sqrt(d)
    o = v.mean(0).expand(s_len, d)
    dp = do @ v.T  # [S, S]
    ds = (dp - (do * o).sum(-1, keepdim=True)) / s_len
    dv = (do.sum(0) / s_len).expand(s_len, d)
    return dict(o=o, dq=scale * ds @ k, dk=scale * ds.T @ q, dv=dv, dmask=ds.sum(0), dpair=ds)


def _truth_fp64(q, k, v, mask, pair, do, kind: str) -> dict:
    """The fp64 truth: the reference on the real slice; on the fully masked slice uniform attention (finite mask)
    or zeros (``-inf``, which the fp64 reference gives by itself)."""
    if kind == "-inf":
        return _run("reference", q, k, v, mask, pair, do, torch.float64, torch.float64)
    real = _run(
        "reference", q[:, :1], k[:, :1], v[:, :1], mask[:, :1], pair, do[:, :1], torch.float64, torch.float64
    )
    uni = _uniform_fp64(*(t[0, MASKED, :, 0] for t in (q, k, v, do)))  # [S, D] each
    s = q.shape[2]
    truth = {}
    for name in ("o", "dq", "dk", "dv"):
        truth[name] = torch.cat([real[name], uni[name][None, None, :, None]], dim=1)  # [B, N, S, H, D]
    truth["dmask"] = torch.cat([real["dmask"], uni["dmask"].view(1, 1, 1, 1, s)], dim=1)  # [B, N, 1, 1, S]
    truth["dpair"] = real["dpair"] + uni["dpair"].view(1, 1, 1, s, s)  # summed over N
    return truth


BACKENDS = [TRITON, "torch", "reference"]
FILLS = ["-1e9", "min", "-inf"]


@pytest.mark.parametrize("kind", FILLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_extreme_masks_match_fp64_on_real_and_fully_masked_rows(backend, dtype, kind):
    """Mask in the input dtype: every output and gradient (both slices, dpair summed over them) within 3x PyTorch's
    same-dtype error of the fp64 truth; fully masked rows are uniform attention (finite mask) or zeros (-inf)."""
    (q, k, v, pair), do = _leaves(seed=12, s=_keys(backend))
    mask = _mask(_fill(kind, dtype), dtype, s=_keys(backend))
    device = DEVICE if backend == "triton" else "cpu"
    ours = _run(backend, q, k, v, mask, pair, do, dtype, dtype, device=device)
    pt = _run("reference", q, k, v, mask, pair, do, dtype, dtype)
    truth = _truth_fp64(q, k, v, mask.double(), pair, do, kind)
    for name in NAMES:
        assert not torch.isnan(ours[name]).any(), f"{name} has NaN"
    if kind == "-inf":
        for name in ("o", "dq", "dk", "dv", "dmask"):
            assert torch.all(ours[name][:, MASKED] == 0), name
    assert_within_pytorch_error(ours, truth, pt, dtype)


MIXED = [(torch.bfloat16, "-1e9"), (torch.bfloat16, "min"), (torch.bfloat16, "-inf"),
         (torch.float16, "-1e9"), (torch.float16, "min")]


@pytest.mark.parametrize("dtype,kind", MIXED, ids=[f"{str(d)[6:]}-{k}" for d, k in MIXED])
@pytest.mark.parametrize("backend", [TRITON, "torch"])
def test_fp32_mask_with_half_inputs(backend, dtype, kind):
    """An fp32 mask (down to ``finfo(float32).min``, which overflows bf16 and fp16) with bf16/fp16 q, k, v, pair: the
    real rows match the fp64 reference within 3x PyTorch's error; fully masked rows are finite and either uniform
    attention (the backends add the mask in fp32) or zeros (PyTorch, whose cast to the input dtype makes it -inf)."""
    (q, k, v, pair), do = _leaves(seed=13, s=_keys(backend))
    mask = _mask(_fill(kind, torch.float32), torch.float32, s=_keys(backend))
    device = DEVICE if backend == "triton" else "cpu"
    ours = _run(backend, q, k, v, mask, pair, do, dtype, torch.float32, device=device)
    pt = _run("reference", q, k, v, mask, pair, do, dtype, torch.float32)
    truth = _truth_fp64(q, k, v, mask.double(), pair, do, kind)
    for name in NAMES:
        assert torch.isfinite(ours[name]).all(), f"{name} is not finite"
    real = {name: ours[name][:, :1] for name in ("o", "dq", "dk", "dv", "dmask")}
    assert_within_pytorch_error(
        {n: t for n, t in real.items() if n != "dmask"},
        {n: truth[n][:, :1] for n in real if n != "dmask"},
        {n: pt[n][:, :1] for n in real if n != "dmask"},
        dtype,
    )
    # dmask is returned in the mask's dtype (fp32); compare it to fp64 with the half-precision yardstick
    err = (real["dmask"].double() - truth["dmask"][:, :1]).abs().max().item()
    err_pt = (pt["dmask"][:, :1].double() - truth["dmask"][:, :1]).abs().max().item()
    assert err <= 3 * err_pt + 10 * torch.finfo(dtype).eps * max(1.0, truth["dmask"].abs().max().item())
    if kind != "-inf":  # the backends compute in fp32, where the mask stays finite: uniform attention
        for name in ("o", "dv"):
            got, want = ours[name][:, MASKED].double(), truth[name][:, MASKED]
            assert (got - want).abs().max().item() <= 1e-2 * max(1.0, want.abs().max().item()), name


# ----------------------------------------------------------------------------------------------------------
# The softmax statistics saved for backward (backend contract)
# ----------------------------------------------------------------------------------------------------------


def _contract_backends():
    backends = [pytest.param(evoformer_chunked, id="torch"), pytest.param(evoformer_reference, id="reference")]
    if KERNELS_RUN:
        from ds4sci.kernels import triton_evoformer

        backends.insert(0, pytest.param(triton_evoformer, id="triton"))
    return backends


@pytest.mark.parametrize("module", _contract_backends())
@pytest.mark.parametrize("fill", [-1e9, torch.finfo(torch.float32).min, -math.inf], ids=["-1e9", "min", "-inf"])
def test_saved_statistics_keep_the_row_sum_under_a_huge_max(module, fill):
    """stats ``[Z, N, H, S, 2]`` = (row max, row sum) apart: for a fully masked finite row the max is the mask value
    and the sum is S (whose log ``max + log(sum)`` in fp32 would round away); -inf rows store (+inf, +inf)."""
    z, n, s, h, d = 1, 2, 40, 2, 16
    device = DEVICE if module.__name__.endswith("triton_evoformer") else "cpu"
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(z, n, s, h, d, generator=g).to(device) for _ in range(3))
    mask = torch.zeros(z, n, s)
    mask[0, 1] = fill
    o, stats = module.forward(q, k, v, mask.to(device), None)
    stats = stats.cpu()
    assert stats.shape == (z, n, h, s, 2) and stats.dtype == torch.float32
    assert not torch.isnan(stats).any() and not torch.isnan(o).any()
    row_max, row_sum = stats[0, 1, ..., 0], stats[0, 1, ..., 1]
    if fill == -math.inf:
        assert torch.all(row_max == math.inf) and torch.all(row_sum == math.inf)
        assert torch.all(o[0, 1] == 0)
    else:
        assert torch.all(row_max == torch.tensor(fill, dtype=torch.float32))
        torch.testing.assert_close(row_sum, torch.full_like(row_sum, float(s)), rtol=1e-5, atol=0)
    assert torch.isfinite(stats[0, 0]).all() and torch.all(stats[0, 0, ..., 1] >= 1)
