"""Whole Evoformer and Pairformer blocks (ds4sci.models.evoformer.blocks) against OpenFold3's, and their pieces.

OpenFold3's ``EvoformerBlock`` and ``PairFormerBlock`` state dicts (random values) load strictly into ds4sci's, and
both then give the same outputs and the same gradients of the inputs and of every parameter (fp64: to rounding;
fp32 with the triton kernel under the interpreter: within 3x OpenFold3's own fp32 error). OpenFold (AlphaFold2,
not installable here) is checked by its parameter names only.
"""
import itertools

import pytest
import torch

from ds4sci.models import evoformer
from ds4sci.models.evoformer import EvoformerBlock
from ds4sci.models.evoformer import OuterProductMean
from ds4sci.models.evoformer import PairformerBlock
from ds4sci.models.evoformer import SharedDropout
from ds4sci.models.evoformer import Transition

from evoformer_checks import TRITON
from evoformer_checks import assert_within_pytorch_error

of3_evoformer = pytest.importorskip("openfold3.core.model.latent.evoformer")
of3_pairformer = pytest.importorskip("openfold3.core.model.latent.pairformer")
pytestmark = pytest.mark.filterwarnings("ignore:CUDA is not available:UserWarning")

C_M, C_Z, C_S = 8, 6, 8
EVO = dict(c_m=C_M, c_z=C_Z, c_hidden_msa_att=4, c_hidden_opm=3, c_hidden_mul=5, c_hidden_pair_att=4, no_heads_msa=2,
           no_heads_pair=2, transition_n=2, msa_dropout=0.15, pair_dropout=0.25, no_column_attention=False,
           opm_first=False, fuse_projection_weights=False, inf=1e9, eps=1e-8)
PAIR = dict(c_s=C_S, c_z=C_Z, c_hidden_pair_bias=4, no_heads_pair_bias=2, c_hidden_mul=5, c_hidden_pair_att=4,
            no_heads_pair=2, transition_n=2, pair_dropout=0.25, fuse_projection_weights=False, inf=1e9)


def _foreign(module, seed):
    """Random values (std 0.3, so no layer is the identity) for every entry of ``module``'s state dict."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(t.shape, generator=g, dtype=torch.float64) * 0.3 for k, t in module.state_dict().items()}


def _pair(kind, seed, dtype=torch.float64, backend="torch", **kw):
    """(OpenFold3 block, ds4sci block) holding the same random weights, in eval mode."""
    if kind == "evoformer":
        kw = {**EVO, "transition_type": "relu", **kw}
        ref, ours = of3_evoformer.EvoformerBlock(**kw), EvoformerBlock(backend=backend, **kw)
    else:
        kw = {**PAIR, "transition_type": "swiglu", **kw}
        ref, ours = of3_pairformer.PairFormerBlock(**kw), PairformerBlock(backend=backend, **kw)
    weights = _foreign(ref, seed)
    ref.load_state_dict(weights, strict=True)
    ours.load_state_dict(weights, strict=True)
    return ref.eval().to(dtype), ours.eval().to(dtype)


def _inputs(kind, seed, batch=(2,), n_seq=5, n_res=7):
    """Representations and masks (some zeros) in fp64; the pair mask of the Pairformer is the single mask's outer."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(*batch, n_res, n_res, C_Z, generator=g, dtype=torch.float64)
    if kind == "evoformer":
        m = torch.randn(*batch, n_seq, n_res, C_M, generator=g, dtype=torch.float64)
        msa_mask = (torch.rand(*batch, n_seq, n_res, generator=g) > 0.2).double()
        pair_mask = (torch.rand(*batch, n_res, n_res, generator=g) > 0.2).double()
        return [m, z, msa_mask, pair_mask]
    s = torch.randn(*batch, n_res, C_S, generator=g, dtype=torch.float64)
    single = (torch.rand(*batch, n_res, generator=g) > 0.2).double()
    single[..., 0] = 1.0  # a fully masked single row is padding whose values are rounding noise on every path
    return [s, z, single, single[..., :, None] * single[..., None, :]]


def _forward_backward(block, inputs, dtype, seed=3):
    """``{name: tensor}``: the two outputs, the gradients of the two representations and of every parameter, of
    ``sum(w1 * out1) + sum(w2 * out2)`` (random w)."""
    x = [t.detach().to(dtype, copy=True).requires_grad_(i < 2) for i, t in enumerate(inputs)]
    block.zero_grad()
    outs = block(*x)
    g = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=torch.float64).to(dtype)).sum() for o in outs)
    loss.backward()
    return {"out0": outs[0], "out1": outs[1], "grad_in0": x[0].grad, "grad_in1": x[1].grad,
            **{n: p.grad for n, p in block.named_parameters()}}


EVO_OPTIONS = [dict(transition_type=t, fuse_projection_weights=f, opm_first=o, no_column_attention=c)
               for t, f, o, c in itertools.product(["relu", "swiglu"], [False, True], [False, True], [False, True])]


@pytest.mark.parametrize("options", EVO_OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_evoformer_block_equals_openfold3_fp64(options):
    ref, ours = _pair("evoformer", seed=1, **options)
    inputs = _inputs("evoformer", seed=2)
    theirs, mine = _forward_backward(ref, inputs, torch.float64), _forward_backward(ours, inputs, torch.float64)
    assert theirs.keys() == mine.keys()
    for name in theirs:
        torch.testing.assert_close(mine[name], theirs[name], rtol=1e-10, atol=1e-11, msg=name)


@pytest.mark.parametrize("transition_type", ["swiglu", "relu"])
@pytest.mark.parametrize("batch", [(2,), ()])
def test_pairformer_block_equals_openfold3_fp64(transition_type, batch):
    ref, ours = _pair("pairformer", seed=4, transition_type=transition_type)
    inputs = _inputs("pairformer", seed=5, batch=batch)
    theirs, mine = _forward_backward(ref, inputs, torch.float64), _forward_backward(ours, inputs, torch.float64)
    assert theirs.keys() == mine.keys()
    for name in theirs:
        torch.testing.assert_close(mine[name], theirs[name], rtol=1e-10, atol=1e-11, msg=name)


@pytest.mark.parametrize("kind,backend", [("evoformer", "torch"), ("pairformer", "torch"),
                                          pytest.param("evoformer", "triton", marks=TRITON.marks)])
def test_blocks_fp32_within_openfold3_error(kind, backend):
    """fp32 outputs and gradients: within 3x OpenFold3's own fp32 error against its fp64 run (the interpreted triton
    kernel on the Evoformer block only, which holds all four attention layers, at a smaller size)."""
    ref64, _ = _pair(kind, seed=6)
    ref32, ours = _pair(kind, seed=6, dtype=torch.float32, backend=backend)
    inputs = _inputs(kind, seed=7, **(dict(batch=(), n_seq=3, n_res=5) if backend == "triton" else dict(n_res=9)))
    exact = _forward_backward(ref64, inputs, torch.float64)
    theirs = _forward_backward(ref32, inputs, torch.float32)
    mine = _forward_backward(ours, inputs, torch.float32)
    assert_within_pytorch_error(mine, exact, theirs, torch.float32)


@pytest.mark.parametrize("kind", ["evoformer", "pairformer"])
def test_chunk_size_gives_the_same_result(kind):
    _, ours = _pair(kind, seed=8)
    inputs = _inputs(kind, seed=9, n_res=7)
    whole = ours(*inputs)
    for chunk in (1, 3, 7, 50):
        for a, b in zip(ours(*inputs, chunk_size=chunk), whole):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_backend_is_set_on_every_attention_layer():
    block = EvoformerBlock(**EVO, backend="reference")
    layers = [m for m in block.modules() if isinstance(m, evoformer.primitives.GatedAttentionLayer)]
    assert len(layers) == 4 and block.backend.value == "reference"
    block.backend = "torch"
    assert {layer.backend.value for layer in layers} == {"torch"}
    pair = PairformerBlock(**PAIR, backend="reference")
    pair.backend = "torch"
    assert pair.attn_pair_bias.backend.value == "torch" and pair.pair_stack.tri_att_end.backend.value == "torch"


# OpenFold (aqlaboratory/openfold, AlphaFold2): biases on the transitions' linear_1/linear_2, on the outer product
# mean's projections and on every triangle-multiplication projection; the triangle bias projection is `linear`;
# Attention's linear_g and linear_o carry a bias.
_MHA_AF2 = ["linear_q.weight", "linear_k.weight", "linear_v.weight", "linear_o.weight", "linear_o.bias",
            "linear_g.weight", "linear_g.bias"]
_LN = ["weight", "bias"]
_TRI_MUL_AF2 = ([f"layer_norm_{s}.{p}" for s in ("in", "out") for p in _LN]
                + [f"linear_{n}.{p}" for n in ("a_p", "a_g", "b_p", "b_g", "g", "z") for p in ("weight", "bias")])
_TRI_ATT_AF2 = [f"layer_norm.{p}" for p in _LN] + ["linear.weight"] + [f"mha.{k}" for k in _MHA_AF2]
_TRANSITION_AF2 = [f"layer_norm.{p}" for p in _LN] + [f"linear_{i}.{p}" for i in (1, 2) for p in ("weight", "bias")]
OPENFOLD_EVOFORMER_KEYS = sorted(
    [f"msa_att_row.{k}" for k in [f"layer_norm_m.{p}" for p in _LN] + [f"layer_norm_z.{p}" for p in _LN]
     + ["linear_z.weight"] + [f"mha.{k}" for k in _MHA_AF2]]
    + [f"msa_att_col._msa_att.{k}" for k in [f"layer_norm_m.{p}" for p in _LN] + [f"mha.{k}" for k in _MHA_AF2]]
    + [f"msa_transition.{k}" for k in _TRANSITION_AF2]
    + [f"outer_product_mean.{k}" for k in [f"layer_norm.{p}" for p in _LN]
       + [f"linear_{n}.{p}" for n in ("1", "2", "out") for p in ("weight", "bias")]]
    + [f"pair_stack.tri_mul_{d}.{k}" for d in ("out", "in") for k in _TRI_MUL_AF2]
    + [f"pair_stack.tri_att_{d}.{k}" for d in ("start", "end") for k in _TRI_ATT_AF2]
    + [f"pair_stack.pair_transition.{k}" for k in _TRANSITION_AF2])


def test_openfold_convention_parameter_names():
    block = EvoformerBlock(**EVO, convention="openfold")
    assert sorted(block.state_dict()) == OPENFOLD_EVOFORMER_KEYS
    m, z, msa_mask, pair_mask = _inputs("evoformer", seed=10)
    out_m, out_z = block.double()(m, z, msa_mask, pair_mask)  # runs; a fresh block's updates are zero-initialised
    assert out_m.shape == m.shape and out_z.shape == z.shape


def test_shared_dropout_shares_its_mask_and_is_off_in_eval():
    x = torch.ones(2, 50, 40, 3)
    rows = SharedDropout(0.5, dim=-3).train()(x)
    assert torch.equal(rows, rows[:, :1].expand_as(rows)) and (rows == 0).any() and (rows == 2).any()
    cols = SharedDropout(0.5, dim=-2).train()(x)
    assert torch.equal(cols, cols[:, :, :1].expand_as(cols)) and (cols == 0).any()
    assert torch.equal(SharedDropout(0.5, dim=-3).eval()(x), x)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="transition_type must be one of .* got 'gelu'"):
        Transition(4, 2, "gelu")
    with pytest.raises(ValueError, match="no SwiGLU transition"):
        Transition(4, 2, "swiglu", convention="openfold")
    with pytest.raises(ValueError, match=r"OuterProductMean: mask must have shape .* got \(5, 6\)"):
        OuterProductMean(C_M, C_Z, 3)(torch.randn(5, 7, C_M), torch.ones(5, 6))
    with pytest.raises(ValueError, match=r"m must have shape \[\*, N_seq, N_res, 8\], got \(5, 7, 9\)"):
        OuterProductMean(C_M, C_Z, 3)(torch.randn(5, 7, 9))
    with pytest.raises(ValueError, match="p must be in"):
        SharedDropout(1.0, dim=-3)
