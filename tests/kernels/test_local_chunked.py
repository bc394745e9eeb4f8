"""chunked_attention (ds4sci.kernels.local_chunked) and memory_efficient_attention (ds4sci.kernels.local_attention)
against sdpa_attention in
fp64: every combination of causal, ALiBi, packed documents with padding, window and GQA on ring-style blocks
(offsets), forward and backward through out and lse, fp32/bf16/fp16 against PyTorch's own error at the same
precision, rows that see no key, many unaligned chunks, explicit masks, nothing ``Sq x Sk`` saved for backward,
and the backend dispatch."""
import functools
import itertools
import logging
import os
import sys
import types

import pytest
import torch

from ds4sci.kernels import local_attention as la
from ds4sci.kernels import local_chunked
from ds4sci.kernels.backends import LOCAL_CHUNK_SIZE
from ds4sci.kernels.backends import LocalBackend
from ds4sci.kernels.local_attention import memory_efficient_attention
from ds4sci.kernels.local_attention import select_backend
from ds4sci.kernels.local_chunked import chunked_attention
from ds4sci.kernels.local_reference import PAD_DOC_ID
from ds4sci.kernels.local_reference import sdpa_attention


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Hundreds of tiny cases: one intra-op thread avoids OpenMP hand-offs that cost more than the arithmetic
    (10-100x per case on a loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625])  # 6 global heads; local heads 1..4
H, D = 4, 8

# (q_offset, k_offset, Sq, Sk) as ring blocks use them; lengths unaligned with the chunk sizes below
BLOCKS = {
    "aligned": (0, 0, 19, 19),
    "keys-behind": (13, 5, 19, 23),  # keys start before the queries and overlap them
    "keys-ahead": (5, 13, 19, 17),  # keys start inside the queries
    "all-future": (0, 19, 19, 19),  # every key after every query (causal: empty)
    "all-past": (24, 0, 19, 21),  # every key before every query
}


def _docs(B, S, gen):
    """Packed documents: ids non-decreasing along the sequence, the last 3 positions padding."""
    doc = (torch.rand(B, S, generator=gen) < 0.2).long().cumsum(1)
    doc[:, -3:] = PAD_DOC_ID
    return doc


def _inputs(block, kv_heads, docs, seed=0):
    qo, ko, Sq, Sk = block
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, Sq, H, D, generator=gen, dtype=torch.float64)
    k = torch.randn(2, Sk, kv_heads, D, generator=gen, dtype=torch.float64)
    v = torch.randn(2, Sk, kv_heads, D, generator=gen, dtype=torch.float64)
    g = torch.randn(2, Sq, H, D, generator=gen, dtype=torch.float64)  # upstream gradient of out
    gl = torch.randn(2, H, Sq, generator=gen, dtype=torch.float64)  # upstream gradient of lse
    q_doc = k_doc = None
    if docs:
        doc = _docs(2, max(qo + Sq, ko + Sk), gen)
        q_doc, k_doc = doc[:, qo:qo + Sq], doc[:, ko:ko + Sk]
    return (q, k, v, g, gl), dict(q_offset=qo, k_offset=ko, head_offset=1, q_doc=q_doc, k_doc=k_doc)


def _run(fn, tensors, dtype, **kw):
    """out, lse and d(loss)/d(q, k, v) in float64, for a loss through both out and lse (ring attention's)."""
    q, k, v, g, gl = tensors
    ins = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = fn(*ins, return_lse=True, **kw)
    assert out.dtype == dtype and lse.dtype == torch.promote_types(dtype, torch.float32)
    if not out.requires_grad:  # a block no query sees: zeros without history, like sdpa_attention
        assert (out == 0).all() and torch.isneginf(lse).all()
        return [out.double(), lse.double()] + [torch.zeros_like(t) for t in (q, k, v)]
    loss = (out * g.to(dtype)).sum() + (torch.where(torch.isfinite(lse), lse, 0) * gl.to(lse.dtype)).sum()
    grads = torch.autograd.grad(loss, ins)
    return [out.double(), lse.double()] + [x.double() for x in grads]


NAMES = ("out", "lse", "dq", "dk", "dv")


def _assert_finite_where(ours, ref):
    assert torch.equal(torch.isneginf(ours[1]), torch.isneginf(ref[1])), "rows that see no key differ"
    for name, x in zip(NAMES, ours):
        if name != "lse":
            assert torch.isfinite(x).all(), name


OPTIONS = list(itertools.product([False, True], [False, True], [False, True], [None, 6], [4, 2]))


@pytest.mark.parametrize("block", list(BLOCKS), ids=str)
@pytest.mark.parametrize("causal,alibi,docs,window,kv_heads", OPTIONS)
def test_matches_fp64_sdpa_oracle(block, causal, alibi, docs, window, kv_heads):
    tensors, protocol = _inputs(BLOCKS[block], kv_heads, docs)
    opts = dict(causal=causal, window=window, alibi_slopes=SLOPES.double() if alibi else None, **protocol)
    ref = _run(sdpa_attention, tensors, torch.float64, **opts)
    ours = _run(chunked_attention, tensors, torch.float64, chunk_size=4, **opts)
    _assert_finite_where(ours, ref)
    for name, a, b in zip(NAMES, ours, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, equal_nan=False, msg=lambda m: f"{name}: {m}")


TOLERANCE_EPS = {torch.float32: 1e-6, torch.bfloat16: 1e-3, torch.float16: 1e-4}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block", ["aligned", "keys-behind"])
@pytest.mark.parametrize("causal,alibi,docs,window", list(itertools.product([False, True], [False, True],
                                                                            [False, True], [None, 6])))
def test_low_precision_error_within_pytorchs_own(dtype, block, causal, alibi, docs, window):
    """|ours - fp64| <= 2 |sdpa_attention at the same dtype - fp64| + eps, per output and gradient."""
    tensors, protocol = _inputs(BLOCKS[block], 2, docs, seed=1)
    tensors = tuple(t.to(dtype).double() for t in tensors)  # representable inputs: fp64 sees the same numbers
    opts = dict(causal=causal, window=window, alibi_slopes=SLOPES if alibi else None, **protocol)
    ref = _run(sdpa_attention, tensors, torch.float64, **opts)
    theirs = _run(sdpa_attention, tensors, dtype, **opts)
    ours = _run(chunked_attention, tensors, dtype, chunk_size=4, **opts)
    _assert_within_pytorchs_error(ours, theirs, ref, TOLERANCE_EPS[dtype])


def _assert_within_pytorchs_error(ours, theirs, ref, eps):
    _assert_finite_where(ours, ref)
    for name, a, b, r in zip(NAMES, ours, theirs, ref):
        seen = torch.isfinite(r)
        err, bound = (a - r)[seen].abs().max(), 2 * (b - r)[seen].abs().max() + eps
        assert err <= bound, f"{name}: error {err:.3g} > {bound:.3g} (PyTorch's own: {(b - r)[seen].abs().max():.3g})"


def test_rows_that_see_no_key():
    """Causal queries 0..7 against keys 3..11: rows 0-2 see nothing (out 0, lse -inf, zero gradients); with
    documents, a query whose document has no key in the block as well."""
    tensors, protocol = _inputs((0, 3, 8, 9), 2, docs=False, seed=2)
    q_doc = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]] * 2)
    k_doc = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 0, 0]] * 2)  # queries 4..7 are in document 1: no key
    for docs in (None, (q_doc, k_doc)):
        kw = dict(protocol, q_doc=docs and docs[0], k_doc=docs and docs[1])
        out, lse, dq, dk, dv = _run(chunked_attention, tensors, torch.float32, causal=True, chunk_size=2, **kw)
        blind = torch.tensor([True, True, True, False] + [docs is not None] * 4)
        assert (out[:, blind] == 0).all() and torch.isneginf(lse[:, :, blind]).all()
        assert torch.isfinite(lse[:, :, ~blind]).all()
        assert (dq[:, blind] == 0).all() and all(torch.isfinite(x).all() for x in (dq, dk, dv))
        ref = _run(sdpa_attention, tensors, torch.float64, causal=True, **kw)
        for name, a, b in zip(NAMES, (out, lse, dq, dk, dv), ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_huge_logits_do_not_overflow(dtype):
    """Logits far from zero: |s| ~ 1e4 mixed, and rows whose every logit is about -1000 and whose first key
    chunks are invisible to them (documents): the running max is subtracted before exp, never inf or NaN."""
    eps = TOLERANCE_EPS.get(dtype, 1e-9)  # float64: logits ~1e4 leave ~1e-12 relative
    tensors, protocol = _inputs((0, 0, 12, 12), 4, docs=True, seed=3)
    big = (tensors[0] * 300, *tensors[1:])
    ref = _run(sdpa_attention, big, torch.float64, causal=True, **protocol)
    theirs = _run(sdpa_attention, big, dtype, causal=True, **protocol)
    ours = _run(chunked_attention, big, dtype, causal=True, chunk_size=3, **protocol)
    _assert_within_pytorchs_error(ours, theirs, ref, eps)
    u = torch.ones(D, dtype=torch.float64) * (1000 * D**0.5 / D) ** 0.5  # q.k * scale = -1000 for q = u, k = -u
    q, k, v, g, gl = tensors
    q = u.expand_as(q) + 0.01 * q
    k = -u.expand_as(k) + 0.01 * k
    doc = torch.tensor([[1] * 12, [0] * 6 + [1] * 6])  # row 1: keys 0..5 are another document
    kw = dict(q_doc=doc, k_doc=torch.tensor([[0] * 6 + [1] * 6] * 2))
    ref = _run(sdpa_attention, (q, k, v, g, gl), torch.float64, **kw)
    theirs = _run(sdpa_attention, (q, k, v, g, gl), dtype, **kw)
    ours = _run(chunked_attention, (q, k, v, g, gl), dtype, chunk_size=3, **kw)
    assert ref[1][torch.isfinite(ref[1])].max() < -900
    _assert_within_pytorchs_error(ours, theirs, ref, eps)


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 64])
def test_many_unaligned_chunks(chunk_size):
    tensors, protocol = _inputs((10, 4, 37, 41), 2, docs=True, seed=4)
    opts = dict(causal=True, window=11, alibi_slopes=SLOPES, **protocol)
    ref = _run(sdpa_attention, tensors, torch.float64, **opts)
    ours = _run(chunked_attention, tensors, torch.float64, chunk_size=chunk_size, **opts)
    for name, a, b in zip(NAMES, ours, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("per_head", [False, True])
def test_explicit_mask_sliced_per_block(per_head):
    gen = torch.Generator().manual_seed(5)
    S = 40
    mask = torch.rand(1, 6, S, S, generator=gen) < 0.6 if per_head else torch.rand(S, S, generator=gen) < 0.6
    tensors, protocol = _inputs((13, 5, 19, 23), 2, docs=True, seed=5)
    opts = dict(causal=True, mask=mask, alibi_slopes=SLOPES, **protocol)
    ref = _run(sdpa_attention, tensors, torch.float64, **opts)
    ours = _run(chunked_attention, tensors, torch.float64, chunk_size=4, **opts)
    _assert_finite_where(ours, ref)
    for name, a, b in zip(NAMES, ours, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=lambda m: f"{name}: {m}")


def test_skipped_blocks_are_not_computed(monkeypatch):
    """Causal, window and document blocks that no query sees are skipped; blocks a term keeps whole build no mask."""
    calls = []
    real = local_chunked._block_logits
    monkeypatch.setattr(local_chunked, "_block_logits", lambda q, k, blk, *a: calls.append(blk) or real(q, k, blk, *a))
    q = torch.randn(1, 16, 2, 8)
    chunked_attention(q, q, q, causal=True, chunk_size=4)
    assert len(calls) == 10  # 4 query chunks x (1..4 key chunks), not 16
    assert sum(blk.causal for blk in calls) == 4  # only the diagonal blocks need the causal term
    calls.clear()
    chunked_attention(q, q, q, causal=True, window=4, chunk_size=4)
    assert len(calls) == 7  # the diagonal and the one just behind it
    calls.clear()
    doc = torch.tensor([[0] * 8 + [1] * 8])
    chunked_attention(q, q, q, q_doc=doc, k_doc=doc, chunk_size=4)
    assert len(calls) == 8 and not any(blk.docs for blk in calls)  # two 2x2 document squares, each one id
    out, lse = chunked_attention(q[:, :4], q, q, k_offset=4, causal=True, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all() and not out.requires_grad


def _saved_numels(fn):
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sizes


def test_saves_nothing_of_size_sq_sk():
    """The old explicit path saves [B, H, Sq, Sk] logits; chunked attention saves O(S) tensors only."""
    B, S, Hkv = 1, 256, 2
    q = torch.randn(B, S, H, D, requires_grad=True)
    k, v = (torch.randn(B, S, Hkv, D, requires_grad=True) for _ in range(2))
    doc = (torch.arange(S) // 100)[None]
    kw = dict(causal=True, alibi_slopes=SLOPES, q_doc=doc, k_doc=doc, head_offset=1, return_lse=True)
    old = _saved_numels(lambda: sdpa_attention(q, k, v, **kw))
    new = _saved_numels(lambda: chunked_attention(q, k, v, chunk_size=32, **kw))
    assert max(old) >= S * S, old  # the check would see an S x S tensor
    assert max(new) < S * S and sum(new) <= 8 * B * S * H * D, new
    new = _saved_numels(lambda: memory_efficient_attention(q, k, v, **kw))
    assert max(new) < S * S, new


# ---------------------------------------------------------------------------------------------- dispatch
def test_bad_backend_names_the_value():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"unknown backend 'math'; choose one of \['auto', 'chunked', 'triton', "
                                         r"'flash', 'sdpa'\]"):
        memory_efficient_attention(q, q, q, backend="math")
    with pytest.raises(ValueError, match="chunk_size=0"):
        chunked_attention(q, q, q, chunk_size=0)


def test_sdpa_backend_runs_the_oracle_by_name_only():
    """backend="sdpa" is sdpa_attention with every protocol argument and option (chunk_size ignored); "auto" never
    picks it for more than one query row of a pass that needs gradients, on any device, nor on CUDA."""
    tensors, protocol = _inputs((13, 5, 12, 10), 2, docs=True, seed=7)
    opts = dict(causal=True, window=9, alibi_slopes=SLOPES.double(), scale=0.3, **protocol)
    for a, b in zip(_run(memory_efficient_attention, tensors, torch.float64, backend="sdpa", chunk_size=2, **opts),
                    _run(sdpa_attention, tensors, torch.float64, **opts)):
        assert torch.equal(a, b)
    q = torch.randn(1, 4, 2, 8, requires_grad=True)
    for device_type in ("cpu", "cuda"):
        assert select_backend(q, q, q, causal=True, device_type=device_type) is not LocalBackend.SDPA
    with torch.no_grad():
        assert select_backend(q, q, q, causal=True, device_type="cuda") is not LocalBackend.SDPA
    assert select_backend(q, q, q, backend="sdpa") is LocalBackend.SDPA


@pytest.mark.parametrize("kv_heads, alibi", [(4, False), (4, True), (2, False), (1, True)])
@pytest.mark.parametrize("q_offset", [22, 11], ids=["decode", "keys-on-both-sides"])
def test_cpu_decode_step_runs_sdpa_equal_to_chunked(kv_heads, alibi, q_offset):
    """One query row (a cached decode step) off CUDA: "auto" runs sdpa_attention's one pass over every key (on CUDA
    it does not), equal to the chunked path in fp32, out and lse, with GQA and ALiBi. Keys come head-major as
    GenSLM's KVCache holds them. "decode": the query after all 23 keys; "keys-on-both-sides": causal masking
    matters."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 1, H, D, generator=gen)  # [B, 1, H, D]
    k, v = (torch.randn(2, kv_heads, 23, D, generator=gen).transpose(1, 2) for _ in range(2))  # [B, Sk, Hkv, D]
    opts = dict(causal=True, q_offset=q_offset, alibi_slopes=SLOPES if alibi else None, return_lse=True)
    assert select_backend(q, k, v, **opts) is LocalBackend.SDPA
    assert select_backend(q, k, v, device_type="cuda", **opts) is not LocalBackend.SDPA
    assert select_backend(torch.randn(2, 2, H, D), k, v, **opts) is LocalBackend.CHUNKED  # two query rows
    got, want = (f(q, k, v, head_offset=1, **opts) for f in (memory_efficient_attention,
                                                              functools.partial(chunked_attention, chunk_size=8)))
    for got, want in zip(got, want):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_cpu_inference_causal_pass_runs_sdpa_equal_to_chunked(kv_heads):
    """Off CUDA, an inference pass (eval mode) without gradients: "auto" runs SDPA's causal kernel for a causal block
    whose queries are its keys, equal to the chunked path in fp32 (GQA too), and with document ids up to
    LOCAL_CHUNK_SIZE queries; not in inference (a checkpointed training forward runs without gradients too, and its
    recomputation must run the same kernel), needing gradients, with offsets, a window, ALiBi, the lse or longer
    packed rows it keeps the chunked path, and on CUDA it never picks sdpa."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(3, 37, H, D, generator=gen)
    k, v = (torch.randn(3, 37, kv_heads, D, generator=gen) for _ in range(2))
    docs = torch.arange(37).div(10, rounding_mode="floor").expand(3, 37)
    long = torch.zeros(1, LOCAL_CHUNK_SIZE + 1, H, D)
    select = functools.partial(select_backend, causal=True, inference=True)
    assert select(q, k, v) is LocalBackend.SDPA  # no input needs a gradient
    assert select_backend(q, k, v, causal=True) is LocalBackend.CHUNKED  # not an inference pass
    assert select(q, k, v, q_doc=docs) is LocalBackend.SDPA
    assert select(q, k, v, device_type="cuda") is not LocalBackend.SDPA
    assert select(long, long, long) is LocalBackend.SDPA
    assert select(long, long, long, q_doc=torch.zeros(1, LOCAL_CHUNK_SIZE + 1, dtype=torch.long)) is \
        LocalBackend.CHUNKED
    for opts in (dict(q_offset=5, k_offset=4), dict(window=9), dict(alibi_slopes=SLOPES), dict(return_lse=True),
                 dict(causal=False)):
        assert select(q, k, v, **opts) is LocalBackend.CHUNKED, opts
    assert select(q.requires_grad_(), k, v) is LocalBackend.CHUNKED  # a gradient through attention: chunked
    with torch.no_grad():
        assert select(q, k, v) is LocalBackend.SDPA
        got = memory_efficient_attention(q, k, v, causal=True, inference=True)
        got_docs = memory_efficient_attention(q, k, v, causal=True, q_doc=docs, k_doc=docs, inference=True)
    torch.testing.assert_close(got, chunked_attention(q, k, v, causal=True, chunk_size=8), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_docs, chunked_attention(q, k, v, causal=True, q_doc=docs, k_doc=docs, chunk_size=8),
                               rtol=1e-5, atol=1e-6)


def test_cpu_auto_runs_chunked(monkeypatch):
    calls = []
    monkeypatch.setattr(la, "chunked_attention", lambda *a, **kw: calls.append(kw) or "chunked")
    q = torch.randn(1, 4, 2, 8, requires_grad=True)
    assert memory_efficient_attention(q, q, q, causal=True, chunk_size=16) == "chunked"
    assert calls[0]["causal"] and calls[0]["chunk_size"] == 16
    assert select_backend(q, q, q, causal=True, alibi_slopes=SLOPES) == "chunked"


#: select_backend as on a CUDA device: the device type is the one thing of the device the rule reads
cuda_select = functools.partial(select_backend, device_type="cuda")


@pytest.fixture
def fake_cuda(monkeypatch):
    """Dispatch with CPU tensors as on a CUDA device (memory_efficient_attention selects with :data:`cuda_select`),
    flash-attn 'installed' (a stand-in module), and a fake Triton kernel module recording its calls."""
    calls = {"triton": [], "flash": []}
    module = types.ModuleType("ds4sci.kernels.triton_local_attention")
    module.triton_attention = lambda q, k, v, **kw: calls["triton"].append(kw) or "triton"
    monkeypatch.setitem(sys.modules, "ds4sci.kernels.triton_local_attention", module)
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setattr(la, "select_backend", cuda_select)
    monkeypatch.setattr(la, "flash_attention", lambda q, k, v, **kw: calls["flash"].append(kw) or "flash")
    yield calls
    la._triton_import_error.cache_clear()  # whether the (fake or missing) kernel module imported is cached


def test_cuda_auto_routing(fake_cuda):
    half = torch.randn(1, 8, 4, 16, dtype=torch.bfloat16)
    kv = torch.randn(1, 8, 2, 16, dtype=torch.bfloat16)
    doc = torch.zeros(1, 8, dtype=torch.long)
    assert cuda_select(half, kv, kv, causal=True) == "flash"  # GQA is fine for flash-attn
    assert cuda_select(half, kv, kv, causal=True, q_offset=8, return_lse=True) == "flash"  # no grad needed
    for why, kw in {
        "fp32": dict(),
        "documents": dict(q_doc=doc),
        "window": dict(window=4),
        "ALiBi": dict(alibi_slopes=SLOPES),
        "causal block not bottom-right aligned": dict(k_offset=4),
    }.items():
        q, k = (half.float(), kv.float()) if why == "fp32" else (half, kv)
        assert cuda_select(q, k, k, causal=True, **kw) == "triton", why
    # what the Triton kernel cannot run goes to the chunked path
    big = torch.randn(1, 8, 4, 256, dtype=torch.bfloat16)
    assert cuda_select(big, big, big, causal=True, alibi_slopes=SLOPES) == "chunked"  # D > 128
    assert cuda_select(half.double(), kv.double(), kv.double(), causal=True) == "chunked"  # float64
    assert cuda_select(half.float(), kv, kv, causal=True) == "chunked"  # mixed dtypes
    mask = torch.ones(8, 8, dtype=torch.bool)
    assert cuda_select(half, kv, kv, causal=True, mask=mask) == "chunked"
    with pytest.raises(NotImplementedError, match="backend='triton' takes no explicit mask"):
        memory_efficient_attention(half, kv, kv, mask=mask, backend="triton")
    grad_q = half.clone().requires_grad_()
    assert cuda_select(grad_q, kv, kv, causal=True, return_lse=True) == "triton"  # ring training: lse grad
    with torch.no_grad():
        assert cuda_select(grad_q, kv, kv, causal=True, return_lse=True) == "flash"
    assert cuda_select(half, kv, kv, causal=True, backend="chunked") == "chunked"

    assert memory_efficient_attention(half, kv, kv, causal=True, q_offset=8, k_offset=8) == "flash"
    assert fake_cuda["flash"][-1] == dict(causal=True, scale=None, q_offset=8, k_offset=8, head_offset=0,
                                          q_doc=None, k_doc=None, return_lse=False)
    out = memory_efficient_attention(half, kv, kv, causal=True, alibi_slopes=SLOPES, head_offset=2, q_doc=doc,
                                     k_doc=doc, return_lse=True, window=3)
    assert out == "triton"
    call = fake_cuda["triton"][-1]
    assert call["alibi_slopes"] is SLOPES and call["q_doc"] is doc and call["window"] == 3
    assert (call["head_offset"], call["return_lse"], call["causal"]) == (2, True, True) and "mask" not in call
    with pytest.raises(NotImplementedError, match=r"backend='flash' does not take \['window'\]"):
        memory_efficient_attention(half, kv, kv, window=3, backend="flash")


def test_missing_triton_module_falls_back_to_chunked(fake_cuda, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "ds4sci.kernels.triton_local_attention", None)  # import raises ImportError
    la._triton_import_error.cache_clear()  # forget that the fake module imported
    q = torch.randn(1, 8, 2, 8)
    with caplog.at_level(logging.WARNING, logger=la.__name__):
        out = memory_efficient_attention(q, q, q, causal=True, alibi_slopes=SLOPES)
        assert cuda_select(q, q, q, causal=True, alibi_slopes=SLOPES) == "chunked"
    assert "using chunked_attention" in caplog.text
    assert len(caplog.records) == 1  # logged once per process
    torch.testing.assert_close(out, sdpa_attention(q, q, q, causal=True, alibi_slopes=SLOPES), rtol=1e-5, atol=1e-6)
    with pytest.raises(ImportError):
        memory_efficient_attention(q, q, q, causal=True, backend="triton")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="the Triton kernel needs CUDA or TRITON_INTERPRET=1 (tests/conftest.py sets it)")
def test_triton_backend_speaks_the_same_protocol():
    """backend="triton" reaches ds4sci.kernels.triton_local_attention with every protocol argument: a ring-style
    block with ALiBi, GQA and padded documents, out and lse and their gradients, against chunked_attention."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tensors, protocol = _inputs((13, 5, 12, 10), 2, docs=True, seed=6)
    tensors = tuple(t.to(device) for t in tensors)
    protocol = {k: v.to(device) if torch.is_tensor(v) else v for k, v in protocol.items()}
    opts = dict(causal=True, window=9, alibi_slopes=SLOPES.to(device), **protocol)
    ours = _run(chunked_attention, tensors, torch.float32, chunk_size=4, **opts)
    kernel = _run(memory_efficient_attention, tensors, torch.float32, backend="triton", **opts)
    _assert_finite_where(kernel, ours)
    for name, a, b in zip(NAMES, kernel, ours):
        seen = torch.isfinite(b)
        torch.testing.assert_close(a[seen], b[seen], rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")
