"""The local attention family (ds4sci.kernels.local_reference, local_chunked, local_attention): every mask option,
ALiBi, offsets and GQA against an independent fp64 oracle, rows and blocks that see no key, the threshold-based mask
construction and its memory."""
import math
import types

import pytest
import torch

from ds4sci.kernels import local_reference
from ds4sci.kernels.local_attention import flash_causal_mode
from ds4sci.kernels.local_attention import flex_attention
from ds4sci.kernels.local_chunked import chunked_attention
from ds4sci.kernels.local_reference import attention_mask
from ds4sci.kernels.local_reference import sdpa_attention
from ds4sci.kernels.local_reference import threshold_for_memory


def naive_attention(q, k, v, visible):
    """Independent oracle: fp64 loops-free softmax with a [B, H, Sq, Sk] boolean visibility."""
    B, Sq, H, D = q.shape
    rep = H // k.shape[2]
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)))
    logits = qd @ kd.transpose(-1, -2) / math.sqrt(D)
    logits = logits.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(logits, -1)
    probs = torch.nan_to_num(torch.exp(logits - lse[..., None]), nan=0.0)
    return (probs @ vd).transpose(1, 2), lse


def global_visible(Sq, Sk, qo, ko, B, H, causal=False, window=None, q_doc=None, k_doc=None, mask=None, ho=0):
    vis = torch.ones(B, H, Sq, Sk, dtype=torch.bool)
    for a in range(Sq):
        for b in range(Sk):
            i, j = qo + a, ko + b
            ok = True
            if causal and j > i:
                ok = False
            if window is not None and abs(i - j) >= window:
                ok = False
            if not ok:
                vis[:, :, a, b] = False
    if q_doc is not None:
        vis &= (q_doc[:, None, :, None] == k_doc[:, None, None, :])
    if mask is not None:
        m = mask[..., qo:qo + Sq, ko:ko + Sk]
        vis &= m[:, ho:ho + H] if m.dim() == 4 and m.shape[1] > 1 else m
    return vis


CASES = [
    dict(causal=False),
    dict(causal=True),
    dict(causal=True, window=3),
    dict(causal=False, window=4),
    dict(causal=True, docs=True),
    dict(causal=False, mask=True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("offsets", [(0, 0), (8, 3), (5, 9)])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_sdpa_attention_matches_oracle(case, offsets, kv_heads):
    torch.manual_seed(0)
    B, Sq, Sk, H, D, S = 2, 7, 6, 4, 8, 20
    qo, ko = offsets
    q = torch.randn(B, Sq, H, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Sk, kv_heads, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, Sk, kv_heads, D, dtype=torch.float64, requires_grad=True)
    kw = dict(causal=case.get("causal", False), window=case.get("window"))
    q_doc = k_doc = mask = None
    if case.get("docs"):
        doc = torch.randint(0, 2, (B, S)).cumsum(1)
        q_doc, k_doc = doc[:, qo:qo + Sq], doc[:, ko:ko + Sk]
    if case.get("mask"):
        mask = torch.rand(1, 8, S, S) > 0.4
    vis = global_visible(Sq, Sk, qo, ko, B, H, q_doc=q_doc, k_doc=k_doc, mask=mask, ho=2, **kw)
    ref_out, ref_lse = naive_attention(q, k, v, vis)
    common = dict(q_offset=qo, k_offset=ko, head_offset=2, q_doc=q_doc, k_doc=k_doc, mask=mask, **kw)
    out_fast = sdpa_attention(q, k, v, **common)
    out, lse = sdpa_attention(q, k, v, return_lse=True, **common)
    torch.testing.assert_close(out_fast, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)
    assert lse.dtype == torch.float64
    if not vis.any():
        return
    g = torch.randn_like(ref_out)
    ref_grads = torch.autograd.grad((ref_out * g).sum(), (q, k, v))
    for o in (out_fast, out):
        grads = torch.autograd.grad((o * g).sum(), (q, k, v), retain_graph=True)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-11)
            assert torch.isfinite(a).all()


def test_sdpa_attention_empty_rows_and_blocks():
    q = torch.randn(1, 4, 2, 8)
    k = torch.randn(1, 4, 2, 8)
    out, lse = sdpa_attention(q, k, k, q_offset=0, k_offset=4, causal=True, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all() and lse.dtype == torch.float32
    # queries 0..3 against keys 2..5: rows 0 and 1 see nothing
    out, lse = sdpa_attention(q, k, k, q_offset=0, k_offset=2, causal=True, return_lse=True)
    assert (out[:, :2] == 0).all() and torch.isneginf(lse[..., :2]).all() and torch.isfinite(lse[..., 2:]).all()
    torch.testing.assert_close(sdpa_attention(q, k, k, q_offset=0, k_offset=2, causal=True), out)


def test_aligned_causal_builds_no_mask(monkeypatch):
    """Pure aligned causal attention runs SDPA's causal kernel without building any S x S mask; the lse path and
    offset blocks do build one."""
    built = []
    real = local_reference.attention_mask
    monkeypatch.setattr(local_reference, "attention_mask", lambda *a, **kw: built.append(a) or real(*a, **kw))
    q = torch.randn(1, 16, 2, 8, dtype=torch.float64)
    out = local_reference.sdpa_attention(q, q, q, causal=True)
    assert built == []
    ref, _ = naive_attention(q, q, q, global_visible(16, 16, 0, 0, 1, 2, causal=True))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    local_reference.sdpa_attention(q, q, q, causal=True, return_lse=True)
    local_reference.sdpa_attention(q[:, 8:], q, q, q_offset=8, causal=True)
    assert len(built) == 2


def test_alibi_bias_on_global_indices():
    """ALiBi: ``-slope[head_offset + h] * |i - j|`` on global indices, so offset blocks match the full sequence."""
    torch.manual_seed(4)
    B, S, H, D = 1, 10, 2, 8
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
    q, k, v = (torch.randn(B, S, H, D, dtype=torch.float64) for _ in range(3))
    i = torch.arange(S)
    bias = -slopes[2:4, None, None] * (i[:, None] - i[None, :]).abs()  # [H, S, S], heads 2 and 3
    logits = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(D) + bias
    both_ways = torch.einsum("bhij,bjhd->bihd", logits.softmax(-1), v)  # symmetric: future keys are far too
    torch.testing.assert_close(sdpa_attention(q, k, v, alibi_slopes=slopes, head_offset=2), both_ways, rtol=0,
                               atol=1e-12)
    logits = logits.masked_fill(i[None, :] > i[:, None], -math.inf)
    want = torch.einsum("bhij,bjhd->bihd", logits.softmax(-1), v)
    got = sdpa_attention(q, k, v, causal=True, alibi_slopes=slopes, head_offset=2)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    rows = sdpa_attention(q[:, 6:], k, v, q_offset=6, causal=True, alibi_slopes=slopes, head_offset=2)
    torch.testing.assert_close(rows, want[:, 6:], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="head_offset=3 \\+ 2 local heads exceeds the 4 ALiBi slopes"):
        sdpa_attention(q, k, v, causal=True, alibi_slopes=slopes, head_offset=3)


def test_attention_mask_errors():
    with pytest.raises(ValueError, match="window=0"):
        attention_mask(4, 4, window=0)
    with pytest.raises(ValueError, match="does not cover"):
        attention_mask(4, 4, q_offset=6, mask=torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="must be bool"):
        attention_mask(4, 4, mask=torch.ones(8, 8))
    with pytest.raises(ValueError, match="multiple of key/value heads 3"):
        sdpa_attention(torch.randn(1, 4, 4, 8), torch.randn(1, 4, 3, 8), torch.randn(1, 4, 3, 8))


@pytest.mark.parametrize("case", [dict(causal=True), dict(causal=True, window=5), dict(docs=True)],
                         ids=["causal", "window", "docs"])
def test_flex_attention_forward_matches_sdpa(case):
    torch.manual_seed(2)
    B, H, D = 2, 4, 8
    q = torch.randn(B, 8, H, D)
    k, v = torch.randn(B, 12, 2, D), torch.randn(B, 12, 2, D)
    q_doc = k_doc = None
    if case.get("docs"):
        doc = torch.randint(0, 2, (B, 20)).cumsum(1)
        q_doc, k_doc = doc[:, 8:16], doc[:, 2:14]
    kw = dict(q_offset=8, k_offset=2, q_doc=q_doc, k_doc=k_doc, causal=case.get("causal", False),
              window=case.get("window"), return_lse=True)
    out, lse = flex_attention(q, k, v, block_size=8, **kw)
    ref, ref_lse = sdpa_attention(q, k, v, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)


def test_flex_attention_backward_on_cpu_is_unsupported():
    q = torch.randn(1, 8, 2, 8, requires_grad=True)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        flex_attention(q, q.detach(), q.detach(), causal=True, block_size=8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention backward needs a GPU (CPU raises)")
def test_flex_attention_gradients_match_sdpa_on_gpu():
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 64, 2, 16, device="cuda", requires_grad=True) for _ in range(3))
    g = torch.randn(1, 64, 2, 16, device="cuda")
    grads = torch.autograd.grad((flex_attention(q, k, v, causal=True, window=9) * g).sum(), (q, k, v))
    ref = torch.autograd.grad((sdpa_attention(q, k, v, causal=True, window=9) * g).sum(), (q, k, v))
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_flash_causal_mode():
    assert flash_causal_mode(0, 4, 4, 4) == "empty"
    assert flash_causal_mode(8, 4, 0, 8) == "full"
    assert flash_causal_mode(4, 4, 4, 4) == "causal"
    assert flash_causal_mode(4, 4, 0, 8) == "causal"
    assert flash_causal_mode(0, 8, 0, 4) == "unsupported"


@pytest.mark.parametrize("docs", [False, True])
@pytest.mark.parametrize("offsets", [(0, 0), (8, 0), (0, 4)])
def test_mask_paths_identical_and_correct(docs, offsets):
    q_len, k_len = 10, 12
    q_doc = torch.randint(0, 3, (2, q_len)).sort(-1).values if docs else None
    k_doc = torch.randint(0, 3, (2, k_len)).sort(-1).values if docs else None
    kw = dict(q_offset=offsets[0], k_offset=offsets[1], q_doc=q_doc, k_doc=k_doc, chunk_rows=3)
    on_device = attention_mask(q_len, k_len, causal=True, threshold=None, **kw)
    via_cpu = attention_mask(q_len, k_len, causal=True, threshold=4, **kw)
    assert on_device.dtype == torch.bool and torch.equal(on_device, via_cpu)
    qp = torch.arange(offsets[0], offsets[0] + q_len)[:, None]
    kp = torch.arange(offsets[1], offsets[1] + k_len)[None, :]
    want = (kp <= qp)[None, None]
    if docs:
        want = want & (q_doc[:, None, :, None] == k_doc[:, None, None, :])
    assert torch.equal(on_device, want.expand_as(on_device))


def test_unconstrained_needs_no_mask_and_threshold_rule():
    assert attention_mask(8, 8, causal=False) is None
    assert threshold_for_memory(40 * 2**30) == 16384  # DeepSpeed4Science's 16K on an A100-40GB
    assert threshold_for_memory(80 * 2**30) == 23170


_MASK_PEAK = r"""
import sys, torch
from ds4sci.kernels.local_reference import attention_mask

def status_kib(key):  # VmRSS (now) or VmHWM (peak since the last reset), Linux
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key + ":"))

S = int(sys.argv[1])
doc = (torch.arange(S) // 1000)[None]  # 1000-token documents
attention_mask(2048, 2048, causal=True, q_doc=doc[:, :2048], k_doc=doc[:, :2048])  # warm up kernels (4 MiB)
open("/proc/self/clear_refs", "w").write("5")  # reset the peak to the current RSS: imports and warm-up leave it
before = status_kib("VmRSS")
if sys.argv[2] == "ours":
    mask = attention_mask(S, S, causal=True, q_doc=doc, k_doc=doc, chunk_rows=512)
else:  # the usual construction: a float tril, then comparisons on full S x S tensors
    mask = (torch.tril(torch.ones(S, S)) > 0) & (doc[0, :, None] == doc[0, None, :])
print(max(0, status_kib("VmHWM") - before) * 1024)
"""


@pytest.mark.slow
def test_mask_construction_peak_memory_is_near_one_mask(tmp_path):
    """Peak RSS growth while building an 8192 x 8192 causal document mask (64 MiB of bool), each way in a process of
    its own (forked from the tests' fork server, torch imported: tests/fork_checks.py)."""
    import functools

    from fork_checks import run_in_fork  # tests/ is on sys.path (its conftest.py)
    from fork_checks import run_script

    S = 8192
    mask_bytes = S * S

    def grow(how):
        # one torch thread: no thread stacks appearing mid-measurement
        out = run_in_fork([str(S), how], tmp_path, main=functools.partial(run_script, _MASK_PEAK),
                          env={"OMP_NUM_THREADS": "1"})
        assert out.returncode == 0, out.stderr[-3000:]
        return int(out.stdout.strip().splitlines()[-1])

    ours, naive = grow("ours"), grow("naive")
    assert ours <= 2 * mask_bytes, f"chunked construction grew RSS by {ours / mask_bytes:.2f} masks"
    assert naive >= 4 * mask_bytes, f"the naive construction grew RSS by only {naive / mask_bytes:.2f} masks"




def test_threshold_rule_builds_where_it_says(monkeypatch):
    """Each branch of the rule, on a device that is not the CPU ("meta", with a faked threshold): a key length at
    or below the threshold is built on the device; above it, on the CPU and then moved to the device."""
    built_on = []
    real_empty = torch.empty

    def spy_empty(*shape, **kw):
        if kw.get("dtype") is torch.bool:
            built_on.append(torch.device(kw["device"]).type)
        return real_empty(*shape, **kw)

    monkeypatch.setattr(torch, "empty", spy_empty)
    doc = torch.zeros(1, 8, dtype=torch.long)
    for threshold, where in ((8, "meta"), (None, "meta"), (7, "cpu")):
        built_on.clear()
        mask = attention_mask(8, 8, causal=True, q_doc=doc, k_doc=doc, device="meta", threshold=threshold)
        assert built_on == [where], (threshold, built_on)
        assert mask.device.type == "meta" and mask.shape == (1, 1, 8, 8)
    # threshold="auto" asks mask_threshold about the device
    for limit, where in ((16, "meta"), (4, "cpu")):
        monkeypatch.setattr(local_reference, "mask_threshold", lambda device, limit=limit: limit)
        built_on.clear()
        assert attention_mask(8, 8, causal=True, device="meta").device.type == "meta"
        assert built_on == [where], (limit, built_on)
    # on CUDA the threshold comes from the device's memory: 16K for 40 GiB
    monkeypatch.undo()
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(total_memory=40 * 2**30))
    assert local_reference.mask_threshold("cuda:0") == 16384
    assert local_reference.mask_threshold("cpu") is None


@pytest.mark.parametrize("fn", [sdpa_attention, chunked_attention], ids=["sdpa", "chunked"])
def test_protocol_checks_zero_kv_heads_and_float_document_ids(fn):
    # One protocol check (local_reference.check_qkv) serves every local attention, the Triton kernel included.
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="key/value heads 0"):
        fn(q, q[:, :, :0], q[:, :, :0])
    docs = torch.zeros(1, 4)
    with pytest.raises(TypeError, match="document ids must be integers"):
        fn(q, q, q, q_doc=docs, k_doc=docs)
