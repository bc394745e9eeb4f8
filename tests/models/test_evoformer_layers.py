"""ds4sci.models.evoformer layers vs an fp64 plain-PyTorch formulation of AF2 supplement Algorithms 7, 8, 13, 14.

The reference below is written from the algorithms' index notation (einsum over named indices, the full logits
materialised), independent of the layers and of the kernels. Every layer is checked on every backend for the
output and the gradients of the inputs and of every parameter, with masks, leading batch dims and unaligned
lengths; fp32 (and bf16) errors may be at most 3x the error of the same formulation run by PyTorch in that dtype.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from ds4sci.kernels import EvoformerBackend
from ds4sci.models.evoformer import Convention
from ds4sci.models.evoformer import MSAColumnAttention
from ds4sci.models.evoformer import MSARowAttentionWithPairBias
from ds4sci.models.evoformer import TriangleAttention
from ds4sci.models.evoformer import TriangleAttentionEndingNode
from ds4sci.models.evoformer import TriangleAttentionStartingNode

from evoformer_checks import HAS_TRITON_BACKEND
from evoformer_checks import TRITON
from evoformer_checks import assert_within_pytorch_error
from evoformer_checks import randomize_

# The triton backend runs here on CPU tensors, i.e. under the interpreter (TRITON_INTERPRET=0 skips it).
BACKENDS = ["torch", TRITON, "reference"]
C_M, C_Z, C_HIDDEN, HEADS, INF = 8, 6, 4, 2, 1e9
N_SEQ, N_RES = 3, 7  # small and unaligned (7 is no multiple of any tile)
VARIANTS = ["msa_row", "msa_col", "tri_start", "tri_end"]


# ----------------------------------------------------------------------------------------------------------
# Reference: the algorithms in index notation, fp64-capable, logits materialised
# ----------------------------------------------------------------------------------------------------------


def _ln(x, p, name):
    return F.layer_norm(x, (x.shape[-1],), p[f"{name}.weight"], p[f"{name}.bias"], 1e-5)


def _lin(x, p, name):
    y = x @ p[f"{name}.weight"].T
    return y + p[f"{name}.bias"] if f"{name}.bias" in p else y


def _qkvg(x, p, mha):
    """q, k, v ``[*, a, b, H, c]`` and the gate ``sigmoid(Linear(x)) [*, a, b, H*c]``."""
    q, k, v = (_lin(x, p, f"{mha}.linear_{n}").unflatten(-1, (HEADS, -1)) for n in "qkv")
    return q, k, v, torch.sigmoid(_lin(x, p, f"{mha}.linear_g"))


def _out(o, g, p, mha):
    return _lin(o.flatten(-2) * g, p, f"{mha}.linear_o")


def _mask_term(mask):
    return INF * (mask - 1)


def reference(variant, p, x, z=None, mask=None, transpose_bias=False):
    """The layer's update, from parameters ``p`` (the layer's state-dict names) and inputs."""
    if variant == "msa_row":  # Algorithm 7: m_si, rows s attend over residues j
        m = _ln(x, p, "layer_norm_m")
        q, k, v, g = _qkvg(m, p, "mha")
        b = _lin(_ln(z, p, "layer_norm_z"), p, "linear_z")  # b_ij^h
        s = torch.einsum("...sihc,...sjhc->...shij", q, k) / math.sqrt(C_HIDDEN)
        s = s + torch.einsum("...ijh->...hij", b).unsqueeze(-4)
        if mask is not None:
            s = s + _mask_term(mask)[..., :, None, None, :]  # key j of row s
        o = torch.einsum("...shij,...sjhc->...sihc", torch.softmax(s, -1), v)
        return _out(o, g, p, "mha")
    if variant == "msa_col":  # Algorithm 8: columns i, sequence s attends over sequences t
        m = _ln(x, p, "_msa_att.layer_norm_m")
        q, k, v, g = _qkvg(m, p, "_msa_att.mha")
        s = torch.einsum("...sihc,...tihc->...ihst", q, k) / math.sqrt(C_HIDDEN)
        if mask is not None:
            s = s + _mask_term(mask).transpose(-1, -2)[..., :, None, None, :]  # key t of column i: mask[t, i]
        o = torch.einsum("...ihst,...tihc->...sihc", torch.softmax(s, -1), v)
        return _out(o, g, p, "_msa_att.mha")
    zn = _ln(x, p, "layer_norm")
    q, k, v, g = _qkvg(zn, p, "mha")
    bias_name = "linear_z" if "linear_z.weight" in p else "linear"
    b = _lin(zn, p, bias_name)  # b_jk^h = LinearNoBias(z_jk)
    if transpose_bias:
        b = b.transpose(-2, -3)
    if variant == "tri_start":  # Algorithm 13: o_ij = sum_k softmax_k(q_ij . k_ik + b_jk) v_ik
        s = torch.einsum("...ijhc,...ikhc->...ihjk", q, k) / math.sqrt(C_HIDDEN)
        s = s + torch.einsum("...jkh->...hjk", b).unsqueeze(-4)
        if mask is not None:
            s = s + _mask_term(mask)[..., :, None, None, :]  # key (i, k): mask[i, k]
        o = torch.einsum("...ihjk,...ikhc->...ijhc", torch.softmax(s, -1), v)
    else:  # Algorithm 14: o_ij = sum_k softmax_k(q_ij . k_kj + b_ki) v_kj
        s = torch.einsum("...ijhc,...kjhc->...jhik", q, k) / math.sqrt(C_HIDDEN)
        s = s + torch.einsum("...kih->...hik", b).unsqueeze(-4)
        if mask is not None:
            s = s + _mask_term(mask).transpose(-1, -2)[..., :, None, None, :]  # key (k, j): mask[k, j]
        o = torch.einsum("...jhik,...kjhc->...ijhc", torch.softmax(s, -1), v)
    return _out(o, g, p, "mha")


# ----------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------


def make_layer(variant, backend="torch", convention=Convention.OPENFOLD3):
    kw = dict(backend=backend, convention=convention)
    return {
        "msa_row": lambda: MSARowAttentionWithPairBias(C_M, C_Z, C_HIDDEN, HEADS, INF, **kw),
        "msa_col": lambda: MSAColumnAttention(C_M, C_HIDDEN, HEADS, INF, **kw),
        "tri_start": lambda: TriangleAttentionStartingNode(C_Z, C_HIDDEN, HEADS, INF, **kw),
        "tri_end": lambda: TriangleAttentionEndingNode(C_Z, C_HIDDEN, HEADS, INF, **kw),
    }[variant]()


def make_inputs(variant, batch=(), seed=0, masked=True, n_seq=N_SEQ, n_res=N_RES):
    """fp64 inputs: (x, z, mask) with z None for the layers without pair input; a quarter of the mask is 0 but
    every attention row keeps at least one key (fully masked rows are padding, see DESIGN.md)."""
    g = torch.Generator().manual_seed(seed)
    if variant.startswith("msa"):
        x = torch.randn(*batch, n_seq, n_res, C_M, generator=g, dtype=torch.float64)
        z = torch.randn(*batch, n_res, n_res, C_Z, generator=g, dtype=torch.float64) if variant == "msa_row" else None
        shape = (*batch, n_seq, n_res)
    else:
        x = torch.randn(*batch, n_res, n_res, C_Z, generator=g, dtype=torch.float64)
        z, shape = None, (*batch, n_res, n_res)
    mask = None
    if masked:
        mask = (torch.rand(shape, generator=g) > 0.25).double()
        mask[..., 0, :] = 1
        mask[..., :, 0] = 1
    return x, z, mask


def call(variant, layer, x, z, mask, **kw):
    if variant == "msa_row":
        return layer(x, z, mask, **kw)
    return layer(x, mask, **kw)


def forward_backward(forward, inputs, dtype, seed):
    """``forward(x, z, mask)`` on ``inputs`` cast to ``dtype``, then backward of a random output gradient (``seed``);
    returns {"out", "dx"} and "dz" when there is a z."""
    x, z, mask = (None if t is None else t.detach().to(dtype) for t in inputs)
    x.requires_grad_(True)
    if z is not None:
        z.requires_grad_(True)
    out = forward(x, z, mask)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)
    out.backward(dout)
    res = {"out": out.detach(), "dx": x.grad}
    if z is not None:
        res["dz"] = z.grad
    return res


def run_layer(variant, layer, inputs, dtype, seed=1, **kw):
    """Forward + backward of ``layer`` in ``dtype``; returns {name: tensor} for output, input and param grads."""
    layer = layer.to(dtype)
    layer.zero_grad(set_to_none=True)
    res = forward_backward(lambda x, z, mask: call(variant, layer, x, z, mask, **kw), inputs, dtype, seed)
    assert res["out"].shape == inputs[0].shape and res["out"].dtype == dtype
    return res | {f"d:{n}": prm.grad for n, prm in layer.named_parameters()}


def run_reference(variant, params, inputs, dtype, seed=1, **kw):
    """The reference formulation with the same parameters, in ``dtype``; same keys as :func:`run_layer`."""
    p = {n: t.detach().to(dtype).requires_grad_(True) for n, t in params.items()}
    res = forward_backward(lambda x, z, mask: reference(variant, p, x, z, mask, **kw), inputs, dtype, seed)
    return res | {f"d:{n}": t.grad for n, t in p.items()}


def check_against_reference(variant, backend, dtype, batch, seed, **kw):
    """A layer with random parameters (``seed``) run in ``dtype`` on inputs of seed ``seed + 1`` must be within
    PyTorch's own ``dtype`` error of the reference run in fp64; returns the layer's parameters (fp64) and inputs."""
    layer = randomize_(make_layer(variant, backend), seed=seed)
    params = {n: t.detach().double() for n, t in layer.state_dict().items()}
    inputs = make_inputs(variant, batch=batch, seed=seed + 1)
    ours = run_layer(variant, layer, inputs, dtype, **kw)
    ref64 = run_reference(variant, params, inputs, torch.float64, **kw)
    ref_same_dtype = ref64 if dtype == torch.float64 else run_reference(variant, params, inputs, dtype, **kw)
    assert_within_pytorch_error(ours, ref64, ref_same_dtype, dtype)
    return params, inputs


# ----------------------------------------------------------------------------------------------------------
# Numerics vs the reference
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_reference_fp32(variant, backend):
    """Output, input and parameter gradients with masks, a batch dim of 2 and unaligned lengths."""
    check_against_reference(variant, backend, torch.float32, batch=(2,), seed=0)


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_reference_fp64_unbatched(variant, backend):
    """fp64 end to end (the torch and reference backends support it) and inputs without batch dims."""
    check_against_reference(variant, backend, torch.float64, batch=(), seed=2)


@pytest.mark.parametrize(
    "variant, backend",
    [(v, "torch") for v in VARIANTS] + [pytest.param("msa_row", "triton", marks=TRITON.marks)],
)
def test_matches_reference_bf16(variant, backend):
    """bf16 (triton on one variant only: the interpreter is slow and the kernel tests cover its bf16 numerics)."""
    check_against_reference(variant, backend, torch.bfloat16, batch=(2,), seed=4)


@pytest.mark.parametrize("variant", ["tri_start", "tri_end"])
def test_transpose_bias_matches_reference(variant):
    params, inputs = check_against_reference(variant, "torch", torch.float64, batch=(2,), seed=6, transpose_bias=True)
    transposed = run_reference(variant, params, inputs, torch.float64, transpose_bias=True)["out"]
    plain = run_reference(variant, params, inputs, torch.float64)["out"]
    assert (plain - transposed).abs().max() > 1e-3  # the option changes the result


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunk_size_gives_the_same_result(variant):
    """Chunked inference (3, 2 and 1 rows at a time, the last chunk short) equals the unchunked layer; so do the
    gradients when chunking runs under autograd."""
    layer = randomize_(make_layer(variant, "torch"), seed=8).float()
    inputs = make_inputs(variant, batch=(2,), seed=9, n_seq=5)
    full = run_layer(variant, layer, inputs, torch.float32)
    for chunk in (3, 2):
        chunked = run_layer(variant, layer, inputs, torch.float32, chunk_size=chunk)
        for name in full:
            torch.testing.assert_close(chunked[name], full[name], rtol=1e-5, atol=1e-6, msg=name)
    x, z, mask = (None if t is None else t.float() for t in inputs)
    with torch.no_grad():
        torch.testing.assert_close(call(variant, layer, x, z, mask, chunk_size=1), full["out"], rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not HAS_TRITON_BACKEND, reason="no triton backend or interpreter")
@pytest.mark.parametrize("variant", VARIANTS)
def test_chunk_size_triton_inference(variant):
    """Chunked inference on the triton backend (forward only: chunking itself is backend-independent)."""
    layer = randomize_(make_layer(variant, "triton"), seed=8).float()
    x, z, mask = (None if t is None else t.float() for t in make_inputs(variant, seed=9, n_seq=5))
    with torch.no_grad():
        chunked = call(variant, layer, x, z, mask, chunk_size=2)
        layer.backend = "torch"
        full = call(variant, layer, x, z, mask)
    torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", VARIANTS)
def test_no_mask_equals_all_ones_mask(variant):
    layer = randomize_(make_layer(variant, "torch"), seed=10).double()
    x, z, mask = make_inputs(variant, batch=(2,), seed=11)
    a = call(variant, layer, x, z, None)
    b = call(variant, layer, x, z, torch.ones_like(mask))
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    c = call(variant, layer, x, z, mask.bool())  # a boolean mask means the same as its float version
    torch.testing.assert_close(c, call(variant, layer, x, z, mask), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("variant", VARIANTS)
def test_mask_broadcast_over_batch(variant):
    """A mask (and MSA row attention's z) without the batch dim broadcasts over it."""
    layer = randomize_(make_layer(variant, "torch"), seed=12).double()
    x, z, mask = make_inputs(variant, batch=(2,), seed=13)
    out = call(variant, layer, x, None if z is None else z[0], mask[0])
    ref = call(variant, layer, x, None if z is None else z[0].expand_as(z), mask[0].expand_as(mask))
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("variant", VARIANTS)
def test_fresh_layer_is_zero_update(variant):
    """AF2's init (supplement 1.11.4): the output projection starts at zero, the gate at sigmoid(1)."""
    layer = make_layer(variant, "torch")
    x, z, mask = (None if t is None else t.float() for t in make_inputs(variant))
    assert torch.equal(call(variant, layer, x, z, mask), torch.zeros_like(x))
    gate = layer._msa_att.mha.linear_g if variant == "msa_col" else layer.mha.linear_g
    assert torch.equal(gate.weight, torch.zeros_like(gate.weight))


# ----------------------------------------------------------------------------------------------------------
# Parameter layout and configuration
# ----------------------------------------------------------------------------------------------------------

_MHA = ["mha.linear_q.weight", "mha.linear_k.weight", "mha.linear_v.weight", "mha.linear_o.weight",
        "mha.linear_g.weight"]
_MHA_AF2 = _MHA + ["mha.linear_o.bias", "mha.linear_g.bias"]
# Parameter names of the same modules in OpenFold3 (openfold3 0.5.0) and OpenFold (aqlaboratory/openfold):
# in OpenFold, Attention's linear_g and linear_o carry a bias and the triangle bias projection is `linear`.
EXPECTED_KEYS = {
    ("msa_row", "openfold3"): ["layer_norm_m.weight", "layer_norm_m.bias", "layer_norm_z.weight", "layer_norm_z.bias",
                               "linear_z.weight"] + _MHA,
    ("msa_row", "openfold"): ["layer_norm_m.weight", "layer_norm_m.bias", "layer_norm_z.weight", "layer_norm_z.bias",
                              "linear_z.weight"] + _MHA_AF2,
    ("msa_col", "openfold3"): ["_msa_att.layer_norm_m.weight", "_msa_att.layer_norm_m.bias"]
    + [f"_msa_att.{k}" for k in _MHA],
    ("msa_col", "openfold"): ["_msa_att.layer_norm_m.weight", "_msa_att.layer_norm_m.bias"]
    + [f"_msa_att.{k}" for k in _MHA_AF2],
    ("tri_start", "openfold3"): ["layer_norm.weight", "layer_norm.bias", "linear_z.weight"] + _MHA,
    ("tri_start", "openfold"): ["layer_norm.weight", "layer_norm.bias", "linear.weight"] + _MHA_AF2,
}
EXPECTED_KEYS[("tri_end", "openfold3")] = EXPECTED_KEYS[("tri_start", "openfold3")]
EXPECTED_KEYS[("tri_end", "openfold")] = EXPECTED_KEYS[("tri_start", "openfold")]


@pytest.mark.parametrize("convention", ["openfold3", "openfold"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_state_dict_layout(variant, convention):
    layer = make_layer(variant, convention=convention)
    assert sorted(layer.state_dict()) == sorted(EXPECTED_KEYS[(variant, convention)])
    # a foreign state dict of that layout (random values) loads strictly and is what the layer then computes with
    g = torch.Generator().manual_seed(0)
    foreign = {k: torch.randn(t.shape, generator=g) for k, t in layer.state_dict().items()}
    fresh = make_layer(variant, convention=convention)
    fresh.load_state_dict(foreign, strict=True)
    params = {n: t.double() for n, t in foreign.items()}
    inputs = make_inputs(variant, seed=1)
    ours = call(variant, fresh.double(), *inputs)
    torch.testing.assert_close(ours, reference(variant, params, *inputs), rtol=1e-9, atol=1e-9)


def test_triangle_attention_generic_class():
    """TriangleAttention(starting=...) is the OpenFold3 class; the two named classes fix `starting`."""
    start = TriangleAttention(C_Z, C_HIDDEN, HEADS, starting=True)
    end = TriangleAttention(C_Z, C_HIDDEN, HEADS, starting=False)
    assert start.starting and not end.starting
    assert TriangleAttentionStartingNode(C_Z, C_HIDDEN, HEADS).starting
    assert not TriangleAttentionEndingNode(C_Z, C_HIDDEN, HEADS).starting
    randomize_(end, 0)
    start.load_state_dict(end.state_dict())
    x, _, mask = make_inputs("tri_start", seed=2)
    start, end = start.double(), end.double()
    # ending node on z == starting node on z^T, transposed back (Alg. 14 vs Alg. 13)
    torch.testing.assert_close(
        end(x, mask), start(x.transpose(-2, -3), mask.transpose(-1, -2)).transpose(-2, -3), rtol=1e-12, atol=1e-12
    )


def test_backend_is_one_enum_and_switchable():
    layer = make_layer("msa_col", backend=EvoformerBackend.REFERENCE)
    assert layer.backend is EvoformerBackend.REFERENCE
    layer.backend = "torch"
    assert layer.backend is EvoformerBackend.TORCH and layer._msa_att.backend is EvoformerBackend.TORCH
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        make_layer("msa_row", backend="cuda")
    with pytest.raises(ValueError, match="unknown convention"):
        make_layer("tri_start", convention="alphafold")


# ----------------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------------


def test_bad_shapes_raise_value_errors_naming_shapes():
    row = make_layer("msa_row")
    m, z, mask = (t.float() for t in make_inputs("msa_row"))
    with pytest.raises(ValueError, match=r"m must have shape \[\*, N_seq, N_res, 8\], got \(3, 7, 5\)"):
        row(m[..., :5], z)
    with pytest.raises(ValueError, match=r"z must have shape .*got \(7, 7, 4\)"):
        row(m, z[..., :4])
    with pytest.raises(ValueError, match=r"z .*broadcastable to \(7, 7, 6\), got \(6, 6, 6\)"):
        row(m, z[:6, :6])
    with pytest.raises(ValueError, match=r"mask .*broadcastable to \(3, 7\), got \(3, 6\)"):
        row(m, z, mask[:, :6])
    with pytest.raises(ValueError, match="pair representation z"):
        row(m, None)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        row(m, z, chunk_size=0)
    col = make_layer("msa_col")
    with pytest.raises(ValueError, match=r"MSAColumnAttention: mask .*got \(7, 3\)"):
        col(m, mask.T)
    tri = make_layer("tri_end")
    x, _, pmask = (None if t is None else t.float() for t in make_inputs("tri_end"))
    with pytest.raises(ValueError,
                       match=r"TriangleAttentionEndingNode: the pair representation must be square .*\(7, 5, 6\)"):
        tri(x[:, :5])
    with pytest.raises(ValueError, match=r"x must have shape \[\*, I, J, 6\], got \(7, 7\)"):
        tri(x[..., 0])
    with pytest.raises(ValueError, match=r"mask .*got \(2, 7, 7\)"):
        tri(x, pmask.expand(2, 7, 7))
    with pytest.raises(TypeError, match="floating point"):
        tri(x.long())
