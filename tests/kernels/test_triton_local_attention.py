"""The fused Triton local attention (ds4sci.kernels.triton_local_attention) against the fp64 oracle.

The oracle is :func:`ds4sci.kernels.local_reference.sdpa_attention` on float64 inputs: the local attention protocol
(global offsets, causal, window, documents with padding, ALiBi on global indices, GQA, lse with a gradient). Every
case runs forward and backward, with a gradient into both outputs (``out`` and ``lse``: ring attention merges blocks
through the lse), and checks out, lse, dq, dk, dv. Tolerance: the kernel's error against fp64 is at most 3x PyTorch's
own error at the kernel's dtype (:func:`_same_dtype_attention`: the protocol's mask from
:func:`~ds4sci.kernels.local_reference.attention_mask`, every operation in that dtype) plus 2 ulps of the magnitude.

On the CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set in tests/conftest.py): exact
kernel semantics, slow, so S <= 80 and a covering set of cases rather than a product. Several tiles per row and
column come from the ``small_tiles`` fixture (16x16 forward, 16x32 and 32x16 backward tiles instead of the table's
64-wide ones). Block skipping is checked by putting NaN into the K and V tiles that must be skipped: a kernel that
loads one of them returns NaN (``0 * NaN``), one that skips it returns the oracle's values.

With ``TRITON_INTERPRET=0`` on a CUDA machine the same tests run the compiled kernels.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from ds4sci.bench.aot.calls import kernel_name
from ds4sci.bench.aot.calls import record_launches
from ds4sci.kernels import triton_local_attention as tla
from ds4sci.kernels.local_reference import PAD_DOC_ID
from ds4sci.kernels.local_reference import attention_mask
from ds4sci.kernels.local_reference import sdpa_attention
from ds4sci.kernels.triton_evoformer import Tiles
from ds4sci.kernels.triton_local_attention import triton_attention

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 or CUDA")

NAMES = ("out", "lse", "dq", "dk", "dv")
H_TOTAL = 8
#: ALiBi slopes of 8 heads, 2^(-8 (h + 1) / 8) (Press et al. 2022), float64 like the oracle's inputs
SLOPES = torch.tensor([2.0 ** (-(h + 1)) for h in range(H_TOTAL)], dtype=torch.float64)


# ----------------------------------------------------------------------------------------------------------
# Inputs, runs and the comparison
# ----------------------------------------------------------------------------------------------------------


def _qkv(b, sq, sk, h, hkv, d, seed):
    """Fresh random fp64 q ``[B, Sq, H, D]``, k, v ``[B, Sk, Hkv, D]``, dO ``[B, Sq, H, D]``, dlse ``[B, H, Sq]``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, sk, hkv, d, generator=g, dtype=torch.float64) for _ in range(2))
    do = torch.randn(b, sq, h, d, generator=g, dtype=torch.float64)
    dlse = torch.randn(b, h, sq, generator=g, dtype=torch.float64)
    return q, k, v, do, dlse


def _packed_docs(b, total, seed, pad=0):
    """Document ids ``[B, total]`` over global positions: sorted packed documents of random lengths, then ``pad``
    positions of PAD_DOC_ID."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((b, total), PAD_DOC_ID, dtype=torch.int64)
    for row in ids:
        pos, doc = 0, 0
        while pos < total - pad:
            n = int(torch.randint(3, 30, (1,), generator=g))
            row[pos : min(pos + n, total - pad)] = doc
            pos, doc = pos + n, doc + 1
    return ids


def _same_dtype_attention(q, k, v, *, q_offset=0, k_offset=0, head_offset=0, q_doc=None, k_doc=None,
                          return_lse=False, causal=False, window=None, alibi_slopes=None, scale=None):
    """The protocol computed entirely in q's dtype (logits, softmax, both matmuls): PyTorch's same-dtype error."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    visible = attention_mask(sq, sk, q_offset=q_offset, k_offset=k_offset, q_doc=q_doc, k_doc=k_doc, causal=causal,
                             window=window, device=q.device)  # [B|1, 1, Sq, Sk] or None
    qh = q.transpose(1, 2)  # [B, H, Sq, D]
    kh, vh = (x.repeat_interleave(h // hkv, dim=2).transpose(1, 2) for x in (k, v))  # [B, H, Sk, D]
    s = (qh @ kh.transpose(-1, -2)) * scale  # [B, H, Sq, Sk]
    if alibi_slopes is not None:
        dist = (torch.arange(q_offset, q_offset + sq)[:, None] - torch.arange(k_offset, k_offset + sk)[None, :]).abs()
        s = s - alibi_slopes[head_offset : head_offset + h].to(q.dtype)[:, None, None] * dist.to(q.dtype)
    if visible is not None:
        s = s.masked_fill(~visible, -math.inf)
    m = s.detach().amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    l = e.sum(dim=-1, keepdim=True)  # [B, H, Sq, 1]
    out = ((e / torch.where(l == 0, torch.ones_like(l), l)) @ vh).transpose(1, 2)  # [B, Sq, H, D]
    lse = torch.where(l == 0, torch.full_like(l, -math.inf), m + torch.log(l)).squeeze(-1)  # [B, H, Sq]
    return (out, lse) if return_lse else out


def _run(fn, inputs, dtype, device="cpu", **kw):
    """{out, lse, dq, dk, dv} of ``fn`` on the inputs cast to ``dtype`` (CPU results), gradient into out and lse."""
    q, k, v, do, dlse = inputs
    leaves = [x.detach().to(device, dtype, copy=True).requires_grad_() for x in (q, k, v)]
    kw = {key: val.to(device) if isinstance(val, torch.Tensor) else val for key, val in kw.items()}
    out, lse = fn(*leaves, return_lse=True, **kw)
    torch.autograd.backward((out, lse), (do.to(device, out.dtype), dlse.to(device, lse.dtype)))
    return {name: t.detach().cpu() for name, t in zip(NAMES, (out, lse, *(x.grad for x in leaves)))}


def _assert_close(ours, ref, same, dtype, factor=3.0):
    """Each tensor of ``ours`` within ``factor`` x PyTorch's same-dtype error of the fp64 oracle (+ 2 ulps of the
    largest magnitude); non-finite exactly where the oracle is (lse -inf on rows that see no key)."""
    for name in NAMES:
        a, r, p = ours[name], ref[name], same[name]
        assert a.shape == r.shape, f"{name}: {tuple(a.shape)} vs {tuple(r.shape)}"
        assert a.dtype == (torch.float32 if name == "lse" else dtype), f"{name}: {a.dtype}"
        finite = torch.isfinite(r)
        assert torch.equal(torch.isfinite(a), finite), f"{name}: non-finite where the oracle is finite, or back"
        if name == "lse":
            assert torch.equal(a[~finite], r[~finite].float()), "lse: -inf rows"
        if not finite.any():
            continue
        scale = max(1.0, r[finite].abs().max().item())
        err = (a.double()[finite] - r[finite]).abs().max().item()
        err_pt = (p.double()[finite] - r[finite]).abs().max().item()
        floor = 2 * torch.finfo(dtype).eps * scale  # PyTorch's own error may happen to be ~0
        assert err <= factor * err_pt + floor, f"{name}: error {err:.3g} vs PyTorch {dtype} error {err_pt:.3g}"


def _check(inputs, dtype, **kw):
    ours = _run(triton_attention, inputs, dtype, DEVICE, **kw)
    ref = _run(sdpa_attention, inputs, torch.float64, **kw)
    same = _run(_same_dtype_attention, inputs, dtype, **kw)
    _assert_close(ours, ref, same, dtype)
    return ours, ref


@pytest.fixture
def small_tiles(monkeypatch):
    """Every table entry with 16-row tiles (forward 16x16, dQ 16x32 and dK/dV 32x16, or the reverse for fp32):
    several tiles per row and column at S <= 80, and BLOCK_M != BLOCK_N in the backward."""
    for (fp32, block_d), _ in list(tla._TABLE.items()):
        wide, tall = Tiles(16, 32, 4, 1), Tiles(32, 16, 4, 1)
        dq, dkdv = (tall, wide) if fp32 else (wide, tall)
        monkeypatch.setitem(tla._TABLE, (fp32, block_d), (Tiles(16, 16, 4, 1), dq, dkdv))


# ----------------------------------------------------------------------------------------------------------
# The protocol: masks, offsets, ALiBi, documents, GQA (fp32, D = 24: unaligned head dim and lengths)
# ----------------------------------------------------------------------------------------------------------

DOCS_57 = _packed_docs(2, 57, seed=11, pad=6)  # global positions 0..56: packed documents, 6 padding positions

# (id, Hkv, kwargs): the block q [q_offset, q_offset + 37) x k [k_offset, k_offset + 45) of 2 sequences of 57 tokens,
# 4 query heads (Hkv = 2: GQA groups of 2; 1: MQA; 4: no grouping)
PROTOCOL = [
    ("dense", 2, dict()),
    ("causal", 2, dict(causal=True)),
    ("causal ring block q after k", 2, dict(causal=True, q_offset=20, k_offset=5)),
    ("causal ring block q before k", 1, dict(causal=True, q_offset=3, k_offset=12)),
    ("window", 2, dict(window=7, q_offset=10, k_offset=4)),
    ("causal window", 4, dict(causal=True, window=9, q_offset=20, k_offset=10)),
    ("alibi", 2, dict(alibi_slopes=SLOPES, head_offset=2, q_offset=3, k_offset=12)),
    ("alibi causal mha", 4, dict(alibi_slopes=SLOPES, head_offset=4, causal=True, q_offset=12, k_offset=0)),
    ("docs with padding", 2, dict(q_doc=DOCS_57[:, 20:57], k_doc=DOCS_57[:, 12:57], q_offset=20, k_offset=12)),
    ("docs mqa", 1, dict(q_doc=DOCS_57[:, 20:57], k_doc=DOCS_57[:, 12:57], q_offset=20, k_offset=12)),
    ("all", 2, dict(causal=True, window=20, alibi_slopes=SLOPES, head_offset=1, q_doc=DOCS_57[:, 20:57],
                    k_doc=DOCS_57[:, 12:57], q_offset=20, k_offset=12)),
    ("all mqa", 1, dict(causal=True, window=20, alibi_slopes=SLOPES, head_offset=1, q_doc=DOCS_57[:, 20:57],
                        k_doc=DOCS_57[:, 12:57], q_offset=20, k_offset=12)),
]


@pytest.mark.parametrize("hkv,case", [c[1:] for c in PROTOCOL], ids=[c[0] for c in PROTOCOL])
def test_protocol_matches_fp64_oracle(hkv, case):
    batch = 2 if case.get("q_doc") is not None or not case else 1  # per-sequence ids; dense: batch strides
    _check(_qkv(batch, 37, 45, 4, hkv, 24, seed=1), torch.float32, **case)


# ----------------------------------------------------------------------------------------------------------
# Dtypes, head dims, several tiles
# ----------------------------------------------------------------------------------------------------------

DOCS_80 = _packed_docs(1, 80, seed=12, pad=9)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d,case", [
    (64, dict(causal=True, alibi_slopes=SLOPES, q_doc=DOCS_80[:, 16:80], k_doc=DOCS_80[:, :72], q_offset=16)),
    (16, dict(window=13, q_offset=5, k_offset=0)),
], ids=["D64-causal-alibi-docs", "D16-window"])
def test_half_precision_matches_fp64_oracle(dtype, d, case):
    """fp16/bf16: tensor-core dots on half operands (P and dS rounded to the input dtype), fp32 statistics."""
    _check(_qkv(1, 64, 72, 2, 1, d, seed=2), dtype, **case)


# (dtype, D, kwargs) with 16-row tiles: 5 query x 5 key tiles at S = 80, crossing the band and document edges
SEVERAL_TILES = [
    (torch.float32, 24, dict(causal=True, window=40, alibi_slopes=SLOPES, head_offset=3, q_doc=DOCS_80,
                             k_doc=DOCS_80)),
    (torch.float32, 16, dict(q_doc=torch.randint(0, 3, (1, 80), generator=torch.Generator().manual_seed(4)),
                             k_doc=torch.randint(0, 3, (1, 80), generator=torch.Generator().manual_seed(5)))),
    (torch.bfloat16, 64, dict(causal=True, alibi_slopes=SLOPES, q_offset=7)),
]


@pytest.mark.parametrize("dtype,d,case", SEVERAL_TILES, ids=["fp32-all-flags", "fp32-interleaved-docs", "bf16-causal"])
def test_several_tiles_match_fp64_oracle(small_tiles, dtype, d, case):
    """Online softmax across 5 key tiles, dK/dV across 5 query tiles, skipped tiles in between; interleaved
    (unsorted) document ids: tile ranges overlap, so little is skipped, and nothing visible may be."""
    _check(_qkv(1, 80, 80, 2, 1, d, seed=3), dtype, **case)


def test_head_dim_128_unaligned_lengths():
    _check(_qkv(1, 19, 33, 2, 2, 128, seed=4), torch.float32, causal=True, q_offset=14)


# ----------------------------------------------------------------------------------------------------------
# Block skipping: K and V tiles that must be skipped hold NaN
# ----------------------------------------------------------------------------------------------------------


def _nan_keys(inputs, keys):
    """The inputs with k and v NaN at key rows ``keys``; the oracle runs on the original (finite) values."""
    q, k, v, do, dlse = inputs
    k, v = k.clone(), v.clone()
    k[:, keys], v[:, keys] = math.nan, math.nan
    return q, k, v, do, dlse


SKIPS = {
    # causal ring block partly in the future: queries 0..39 see keys up to 39, local key rows 32..71 never
    "causal": (40, 72, slice(32, 72), dict(causal=True, k_offset=8)),
    # window: queries 40..55 see keys 33..62 (|i - j| < 8), tiles [0, 32) and [64, 80) never
    "window": (16, 80, [*range(0, 32), *range(64, 80)], dict(window=8, q_offset=40)),
    # documents: queries of documents 1 and 2; keys [0, 32) are document 0, [64, 80) padding
    "documents": (24, 80, [*range(0, 32), *range(64, 80)],
                  dict(q_doc=torch.tensor([[1] * 10 + [2] * 14]),
                       k_doc=torch.tensor([[0] * 32 + [1] * 12 + [2] * 20 + [PAD_DOC_ID] * 16]))),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("mode", list(SKIPS))
def test_skipped_tiles_are_never_read(small_tiles, mode, dtype):
    """Tiles no query of the block can see (aligned to the 16- and 32-row tiles of every kernel) are never loaded:
    forward, dQ and dK/dV give the oracle's values (dK = dV = 0 on those rows), not NaN."""
    sq, sk, keys, case = SKIPS[mode]
    inputs = _qkv(1, sq, sk, 2, 1, 16, seed=5)
    ours = _run(triton_attention, _nan_keys(inputs, keys), dtype, DEVICE, **case)
    ref = _run(sdpa_attention, inputs, torch.float64, **case)
    same = _run(_same_dtype_attention, inputs, dtype, **case)
    _assert_close(ours, ref, same, dtype)
    assert torch.all(ours["dk"][:, keys] == 0) and torch.all(ours["dv"][:, keys] == 0)


# ----------------------------------------------------------------------------------------------------------
# Rows and blocks that see nothing; ring blocks
# ----------------------------------------------------------------------------------------------------------


def test_rows_that_see_no_key():
    """Causal queries before the first key, a document absent from the keys, padding queries without padding keys:
    out 0, lse -inf, exact zero dQ, finite everything; the other rows as the oracle."""
    q_doc = torch.tensor([[0] * 12 + [5] * 6 + [1] * 10 + [PAD_DOC_ID] * 5])  # 33 queries: doc 5 has no key
    k_doc = torch.tensor([[0] * 20 + [1] * 21])  # 41 keys, no padding
    case = dict(causal=True, q_offset=0, k_offset=4, q_doc=q_doc, k_doc=k_doc)
    ours, _ = _check(_qkv(1, 33, 41, 4, 2, 24, seed=6), torch.float32, **case)
    empty = torch.zeros(33, dtype=torch.bool)
    empty[:4] = True  # global queries 0..3 precede key 4
    empty[12:18] = True  # document 5
    empty[18:24] = True  # document 1 before its first key (global 24)
    empty[28:] = True  # padding
    assert torch.all(ours["out"][:, empty] == 0) and torch.all(ours["dq"][:, empty] == 0)
    assert torch.all(ours["lse"][:, :, empty] == -math.inf) and torch.isfinite(ours["lse"][:, :, ~empty]).all()


def test_block_in_the_past_is_dense_attention():
    """A causal ring block whose keys all precede its queries equals the same block without causal."""
    inputs = _qkv(1, 24, 40, 2, 1, 16, seed=7)
    past = _run(triton_attention, inputs, torch.float32, DEVICE, causal=True, q_offset=64, k_offset=24)
    dense = _run(triton_attention, inputs, torch.float32, DEVICE, q_offset=64, k_offset=24)
    for name in NAMES:
        assert torch.equal(past[name], dense[name]), name
    _assert_close(past, _run(sdpa_attention, inputs, torch.float64, causal=True, q_offset=64, k_offset=24),
                  _run(_same_dtype_attention, inputs, torch.float32, causal=True, q_offset=64, k_offset=24),
                  torch.float32)


@pytest.mark.parametrize("case", [dict(causal=True, q_offset=0, k_offset=30), dict(window=4, q_offset=0, k_offset=30)],
                         ids=["causal-future", "window-out-of-reach"])
def test_empty_block_launches_nothing(case):
    """A block no query of which sees any key: out 0, lse -inf, zero gradients (with autograd history), and no kernel
    launch in the forward or the backward."""
    q, k, v, do, dlse = (x.to(DEVICE, torch.float32) for x in _qkv(1, 20, 16, 2, 1, 16, seed=8))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    with record_launches() as launches:
        out, lse = triton_attention(q, k, v, return_lse=True, **case)
        torch.autograd.backward((out, lse), (do, dlse))
    assert launches == []
    assert torch.all(out == 0) and torch.all(lse == -math.inf) and lse.dtype == torch.float32
    for x in (q, k, v):
        assert torch.all(x.grad == 0)


# ----------------------------------------------------------------------------------------------------------
# Interface: outputs, strides, determinism, variants, validation
# ----------------------------------------------------------------------------------------------------------


def test_output_only_and_lse_only_gradients():
    """``return_lse=False`` returns the output alone; a loss on the lse alone (no gradient into out) backpropagates
    ``dL/ds = P * dlse``."""
    q, k, v, do, dlse = _qkv(1, 21, 21, 2, 1, 16, seed=9)
    out = triton_attention(*(x.to(DEVICE, torch.float32) for x in (q, k, v)), causal=True)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape

    def lse_grads(fn, dtype, device="cpu"):
        leaves = [x.detach().to(device, dtype, copy=True).requires_grad_() for x in (q, k, v)]
        _, lse = fn(*leaves, return_lse=True, causal=True)
        (lse * dlse.to(device, lse.dtype)).sum().backward()
        return [torch.zeros_like(x) if x.grad is None else x.grad.cpu().double() for x in leaves]

    ours = lse_grads(triton_attention, torch.float32, DEVICE)
    for name, a, r, p in zip(("dq", "dk", "dv"), ours, lse_grads(sdpa_attention, torch.float64),
                             lse_grads(_same_dtype_attention, torch.float32)):
        err, err_pt = (a - r).abs().max().item(), (p - r).abs().max().item()
        assert err <= 3 * err_pt + 2 * torch.finfo(torch.float32).eps * max(1.0, r.abs().max().item()), name
    assert torch.all(ours[2] == 0)  # the lse does not depend on v


def test_strided_inputs_and_determinism():
    """q, k, v as views of a fused projection (non-contiguous, head-dim stride 1), dO non-contiguous: the same
    values as contiguous copies, and two runs bitwise equal (no atomics)."""
    g = torch.Generator().manual_seed(10)
    b, s, h, hkv, d = 1, 29, 4, 2, 16
    qkv = torch.randn(b, s, h + 2 * hkv, d + 8, generator=g).to(DEVICE)  # [B, S, H + 2 Hkv, D + 8]
    q, k, v = qkv[..., :h, :d], qkv[..., h : h + hkv, 8:], qkv[..., h + hkv :, :d]
    do = torch.randn(b, h, s, d, generator=g).to(DEVICE).transpose(1, 2)  # [B, S, H, D], non-contiguous
    assert not (q.is_contiguous() or k.is_contiguous() or do.is_contiguous())
    kw = dict(causal=True, alibi_slopes=SLOPES.float(), q_doc=DOCS_57[:1, :s], k_doc=DOCS_57[:1, :s])

    def run(q, k, v, do):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out, lse = triton_attention(*leaves, return_lse=True, **kw)
        torch.autograd.backward((out, lse), (do, torch.ones_like(lse)))
        return [out, lse] + [x.grad for x in leaves]

    first = run(q, k, v, do)
    for a, b_, c in zip(first, run(q, k, v, do), run(q.contiguous(), k.contiguous(), v.contiguous(), do.contiguous())):
        assert torch.equal(a, b_) and torch.equal(a, c)


def test_launches_pick_the_table_and_flags():
    """Forward then dQ then dK/dV; HAS_DOCS / HAS_ALIBI follow the arguments; causal and window change no flag."""
    q = torch.randn(1, 20, 2, 24, device=DEVICE)
    k = torch.randn(1, 20, 1, 24, device=DEVICE)

    def launched(**kw):
        leaves = [x.clone().requires_grad_() for x in (q, k, k)]
        with record_launches() as launches:
            triton_attention(*leaves, **kw).sum().backward()
        return [(kernel_name(kern), meta["HAS_DOCS"], meta["HAS_ALIBI"], meta["BLOCK_D"]) for kern, _, meta in launches]

    names = ["fwd", "bwd_dq", "bwd_dkdv"]
    assert launched() == [(n, False, False, 32) for n in names]
    assert launched(causal=True, window=3) == [(n, False, False, 32) for n in names]
    docs = torch.zeros(1, 20, dtype=torch.int64, device=DEVICE)
    assert launched(q_doc=docs, k_doc=docs, alibi_slopes=SLOPES) == [(n, True, True, 32) for n in names]
    assert tla._config(torch.bfloat16, 128).block_d == 128 and tla._config(torch.float32, 1).block_d == 16


@pytest.mark.parametrize("kwargs,error", [
    (dict(q=(1, 8, 3, 16)), ValueError),  # 3 query heads, 2 kv heads
    (dict(k=(1, 8, 2, 8)), ValueError),  # head dims differ
    (dict(dtype=torch.float64), TypeError),
    (dict(q=(1, 8, 2, 129), k=(1, 8, 2, 129)), ValueError),
    (dict(window=0), ValueError),
    (dict(q_doc=torch.zeros(1, 8, dtype=torch.int64)), ValueError),  # k_doc missing
    (dict(q_doc=torch.zeros(1, 7, dtype=torch.int64), k_doc=torch.zeros(1, 8, dtype=torch.int64)), ValueError),
    (dict(q_doc=torch.zeros(1, 8), k_doc=torch.zeros(1, 8)), TypeError),  # float ids
    (dict(alibi_slopes=torch.ones(3), head_offset=2), ValueError),  # slopes for heads 2, 3 missing
    (dict(q_offset=2**31 - 4), ValueError),
], ids=["heads", "head-dim", "fp64", "D-129", "window-0", "one-doc", "doc-shape", "float-docs", "slopes", "int32"])
def test_invalid_arguments(kwargs, error):
    kwargs = dict(kwargs)
    q_shape, k_shape = kwargs.pop("q", (1, 8, 4, 16)), kwargs.pop("k", (1, 8, 2, 16))
    dtype = kwargs.pop("dtype", torch.float32)
    q = torch.randn(q_shape, dtype=dtype, device=DEVICE)
    k = torch.randn(k_shape, dtype=dtype, device=DEVICE)
    with pytest.raises(error):
        triton_attention(q, k, k, **kwargs)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.randn(1, 4, 1, 16)
    with pytest.raises(ValueError, match="CUDA"):
        triton_attention(q, q, q)
