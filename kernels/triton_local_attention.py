"""Fused local attention in Triton for GenSLM: the ds4sci local attention protocol, forward and recomputing backward.

:func:`triton_attention` follows the protocol of :mod:`ds4sci.kernels.local_attention` (oracle:
:func:`~ds4sci.kernels.local_reference.sdpa_attention`): one block of queries against one block of keys, masks and
ALiBi on *global* indices, so Ulysses, ring and Unified sequence parallelism call it per block. q ``[B, Sq, H, D]``,
k, v ``[B, Sk, Hkv, D]`` (query head h reads kv head ``h // (H / Hkv)`` through strides: GQA never repeats K/V),
out ``[B, Sq, H, D]``, lse ``[B, H, Sq]`` fp32, document ids ``q_doc [B, Sq]``, ``k_doc [B, Sk]``.

Algorithm: FlashAttention-2 (Dao 2023, Algorithms 1 and 2), the tiled online softmax of Rabe & Staats 2021
("Self-attention does not need O(n^2) memory") and Milakov & Gimelshein 2018, with ALiBi (Press et al. 2022) on
global distances: ``s = q.k * scale - slope[h] * |i - j|``, -inf where invisible, never stored; O and lse = m + log l
are. The per-tile step is :func:`ds4sci.kernels.triton_common.online_softmax_update`. Backward recomputes P from lse:
``_bwd_dq_kernel`` (per query tile; also stores ``delta = rowsum(dO * O) - dlse``, through which ring attention's
lse gradient flows) then ``_bwd_dkdv_kernel`` (per key tile and kv head, summing its GQA group in registers). No
atomics: two backward passes are bitwise equal. Rows that see no key give out 0, lse -inf, zero gradients.

Visibility: causal ``j <= i``, window ``|i - j| < window`` (one-sided with causal) are one runtime *band* of local
diagonals ``diag_lo <= a - c <= diag_hi`` (:func:`_band`), written once in :func:`_logits`; every block (dense,
causal, windowed, ring) runs the same compiled code and loops only over the tiles the band meets. Documents
(``q_doc[i] == k_doc[j]``) skip tiles whose id range (:func:`_tile_doc_ranges`) cannot meet the resident tile's.
Per-program set-up (program ids, tile pointers, slope, document ranges, loop bounds) is in the jit helpers, shared by
the three kernels. Variants: ``HAS_DOCS`` and ``HAS_ALIBI`` constexprs; the per-block integers are
``do_not_specialize``. Tiles come from :data:`_TABLE`; ``ds4sci bench kernels-aot --set local`` compiles them.

Limitations: compiled ahead of time and run under the interpreter here, never timed on a GPU; fp16, bf16, fp32 (IEEE),
head dims 1..128; every visited tile applies the full predicate; ``|i - j|`` fits in int32 (ALiBi exact to 2^24),
``BLOCK * stride`` in int32; no gradient for the slopes or the document ids.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd.function import once_differentiable

from .local_reference import check_qkv
from .triton_common import BLOCK_D_BUCKETS
from .triton_common import LOG2E
from .triton_common import SUPPORTED_DTYPES
from .triton_common import Tiles
from .triton_common import cast
from .triton_common import dot
from .triton_common import online_softmax_update
from .triton_common import table_entry
from .triton_common import tile_bounds
from .triton_common import tile_offsets

__all__ = ["triton_attention", "SUPPORTED_DTYPES", "BLOCK_D_BUCKETS"]

_INT32_MAX = 2**31 - 1
# Integers that change from block to block (ring steps, offsets): not specialised, one kernel serves every block.
_PER_BLOCK = ("diag_lo", "diag_hi", "shift")


# ---- Tile configuration ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelConfig:
    block_d: int  # head dim padded to a power of two >= 16
    fwd: Tiles
    dq: Tiles  # the dQ kernel: q, dO resident, loops over key tiles
    dkdv: Tiles  # the dK/dV kernel: k, v resident, loops over query tiles


# (fp32?, BLOCK_D) -> (forward, dQ, dK/dV tiles), every entry compiled by ``ds4sci bench kernels-aot --set local`` for
# sm_80 and sm_90 within shared memory and without spills (``--set local-full``: every flag combination).
# - fp16/bf16 (tensor cores): the backward keeps four fp32 [BLOCK_M, BLOCK_N] tiles live (s, p, dp, ds), hence fewer
#   query rows than the forward from D = 32 on, and 32 x 32 backward tiles at D = 64 (64 resident keys spilled).
# - fp32 is IEEE (no TF32), FMA loops in which a thread holds whole operand rows: registers grow with BLOCK * D, so
#   small tiles and one pipeline stage, except where ptxas spilled at D = 128 (dQ: two stages; dK/dV: 8 warps).
_TABLE: dict[tuple[bool, int], tuple[Tiles, Tiles, Tiles]] = {
    (False, 16): (Tiles(64, 64, 4, 2), Tiles(64, 64, 4, 2), Tiles(64, 64, 4, 2)),
    (False, 32): (Tiles(64, 64, 4, 2), Tiles(32, 64, 4, 2), Tiles(32, 64, 4, 2)),
    (False, 64): (Tiles(64, 64, 4, 2), Tiles(32, 32, 4, 2), Tiles(32, 32, 4, 2)),
    (False, 128): (Tiles(64, 64, 8, 2), Tiles(32, 64, 8, 2), Tiles(32, 64, 8, 2)),
    (True, 16): (Tiles(64, 64, 4, 1), Tiles(32, 32, 4, 1), Tiles(32, 32, 4, 1)),
    (True, 32): (Tiles(32, 32, 4, 1), Tiles(32, 32, 4, 1), Tiles(32, 32, 4, 1)),
    (True, 64): (Tiles(32, 32, 4, 1), Tiles(16, 16, 4, 1), Tiles(16, 16, 4, 1)),
    (True, 128): (Tiles(16, 16, 4, 1), Tiles(16, 16, 4, 2), Tiles(16, 16, 8, 1)),
}
assert {d for _, d in _TABLE} == set(BLOCK_D_BUCKETS)  # one entry per head-dim bucket


def _config(dtype: torch.dtype, head_dim: int) -> KernelConfig:
    """Tiles, warps and stages for ``dtype`` and ``head_dim`` (see ``_TABLE``); the only tile heuristic."""
    block_d, tiles = table_entry(_TABLE, dtype, head_dim, "triton_attention")
    return KernelConfig(block_d, *tiles)


# ---- @triton.jit helpers: the per-program set-up and per-tile steps the forward, dQ and dK/dV kernels share ----


@triton.jit
def _split_pid(S, heads, BLOCK: tl.constexpr):
    """(b, head, start) of this program over tiles of BLOCK rows of S (tiles fastest, then ``heads``, then b): batch
    row b (int64), head index and the first row ``start`` of its tile."""
    pid = tl.program_id(0)
    num_tiles = tl.cdiv(S, BLOCK)
    bh = pid // num_tiles
    return (bh // heads).to(tl.int64), bh % heads, (pid % num_tiles) * BLOCK


@triton.jit
def _tile(X, b, h, start, stride_b, stride_h, stride_s, stride_d, offs, offs_d):
    """Rows ``start + offs`` of x[b, :, h, :] (x ``[B, S, H, D]``, columns ``offs_d``) as a scalar base pointer (64-bit
    offset) and loop-invariant 32-bit offsets ``[len(offs), BLOCK_D]`` (a tensor of 64-bit pointers would cost twice
    the registers); a loop over tiles advances the base."""
    base = X + (b * stride_b + tl.cast(h, tl.int64) * stride_h + tl.cast(start, tl.int64) * stride_s)
    return base, offs[:, None] * stride_s + offs_d[None, :] * stride_d


@triton.jit
def _slope(Slopes, h, HAS_ALIBI: tl.constexpr):
    """The ALiBi slope of query head h as fp32 (0.0 without ALiBi, never read)."""
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Slopes + h).to(tl.float32)
    return slope


@triton.jit
def _doc_ids(Doc, row0, idx, ok, HAS_DOCS: tl.constexpr):
    """Document ids ``[BLOCK]`` of rows ``idx`` of one batch row (``Doc + row0 + idx``, -1 where not ``ok``); zeros
    without documents (never read)."""
    doc = tl.zeros(idx.shape, tl.int64)
    if HAS_DOCS:
        doc = tl.load(Doc + row0 + idx, mask=ok, other=-1)
    return doc


@triton.jit
def _tile_docs(Doc, row0, idx, ok, HAS_DOCS: tl.constexpr):
    """The resident tile's document ids (:func:`_doc_ids`) and their (min, max) where ``ok``: the range a looped-over
    tile must meet (:func:`_visits`)."""
    doc = _doc_ids(Doc, row0, idx, ok, HAS_DOCS)
    lo = tl.min(tl.where(ok, doc, 9223372036854775807), 0)
    hi = tl.max(tl.where(ok, doc, -9223372036854775808), 0)
    return doc, lo, hi


@triton.jit
def _visits(TileDoc, b, S, start, doc_lo, doc_hi, BLOCK: tl.constexpr, HAS_DOCS: tl.constexpr):
    """Whether a loop visits the tile of BLOCK rows at ``start`` of S: always without documents; with documents,
    whether its (min, max) id ``TileDoc[b, tile]`` (``[B, cdiv(S, BLOCK), 2]``, :func:`_tile_doc_ranges`) can meet
    ``[doc_lo, doc_hi]``, the resident tile's (:func:`_tile_docs`)."""
    visit = True
    if HAS_DOCS:
        tile_doc = TileDoc + (b * tl.cdiv(S, BLOCK) + start // BLOCK) * 2
        visit = (tl.load(tile_doc) <= doc_hi) & (tl.load(tile_doc + 1) >= doc_lo)
    return visit


@triton.jit
def _key_range(start_m, Sq, Sk, diag_lo, diag_hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[lo, hi): the key rows the tiles of a query tile's loop cover, ``lo`` a multiple of BLOCK_N.

    Query rows a of the tile ``[start_m, min(start_m + BLOCK_M, Sq))`` see key rows c with ``a - diag_hi <= c <=
    a - diag_lo``: so ``c`` in ``[start_m - diag_hi, last_row - diag_lo]`` clipped to ``[0, Sk)``, the start rounded
    down to a tile boundary. A tile the band misses entirely gives ``lo == hi``: no iteration (rounding ``lo`` down
    alone could reopen a range that is empty). Swapped (``-diag_hi``, ``-diag_lo``): a key tile's query rows.
    """
    first = tl.maximum(start_m - diag_hi, 0)
    last_row = tl.minimum(start_m + BLOCK_M, Sq) - 1
    hi = tl.minimum(last_row - diag_lo + 1, Sk)
    lo = (first // BLOCK_N) * BLOCK_N
    return lo, tl.where(first < hi, hi, lo)


@triton.jit
def _key_loop(K, V, b, h, GROUP, start_m, Sq, Sk, diag_lo, diag_hi,
              stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
              offs_n, offs_d, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Set-up of a query tile's loop over key tiles (forward, dQ): the key rows ``[n_lo, n_hi)`` it covers
    (:func:`_key_range`) and the ``[BLOCK_N, BLOCK_D]`` tiles of k[b, :, hk, :] and v at ``n_lo`` (:func:`_tile`),
    hk = h // GROUP the key/value head of query head h (GQA reads it through its strides)."""
    n_lo, n_hi = _key_range(start_m, Sq, Sk, diag_lo, diag_hi, BLOCK_M, BLOCK_N)
    hk = (h // GROUP).to(tl.int64)
    k_ptr, k_offs = _tile(K, b, hk, n_lo, stride_kb, stride_kh, stride_ks, stride_kd, offs_n, offs_d)
    v_ptr, v_offs = _tile(V, b, hk, n_lo, stride_vb, stride_vh, stride_vs, stride_vd, offs_n, offs_d)
    return n_lo, n_hi, k_ptr, k_offs, v_ptr, v_offs


@triton.jit
def _logits(q, k, rows, cols, Sk, diag_lo, diag_hi, shift, sm_scale, slope, q_doc, k_doc,
            HAS_DOCS: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Logits ``[BLOCK_M, BLOCK_N]`` in fp32: ``q k^T * scale - slope * |i - j|``, -inf where invisible.

    q ``[BLOCK_M, BLOCK_D]`` and k ``[BLOCK_N, BLOCK_D]`` tiles at local query rows ``rows [BLOCK_M]`` and key rows
    ``cols [BLOCK_N]``; global ``i - j = (rows - cols) + shift``. Visible: inside the band ``diag_lo <= rows - cols
    <= diag_hi``, key row < Sk and, with documents, equal ids (``q_doc [BLOCK_M]``, ``k_doc [BLOCK_N]``). The one
    place the visibility predicate is written.
    """
    s = dot(q, tl.trans(k)) * sm_scale
    diff = rows[:, None] - cols[None, :]  # [BLOCK_M, BLOCK_N] local a - c
    if HAS_ALIBI:
        s = s - slope * tl.abs(diff + shift).to(tl.float32)
    visible = (diff >= diag_lo) & (diff <= diag_hi) & (cols < Sk)[None, :]
    if HAS_DOCS:
        visible = visible & (q_doc[:, None] == k_doc[None, :])
    return tl.where(visible, s, float("-inf"))


@triton.jit
def _key_tile(q, k_ptrs, v_ptrs, KDoc, b, rows, cols, d_ok, Sk, diag_lo, diag_hi, shift, sm_scale, slope, q_doc,
              HAS_DOCS: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """One step of a resident query tile's loop over key tiles (forward, dQ): k and v ``[BLOCK_N, BLOCK_D]`` read at
    ``k_ptrs`` / ``v_ptrs`` (key rows ``cols``) and the logits ``s [BLOCK_M, BLOCK_N]`` (:func:`_logits`)."""
    key_ok = cols < Sk
    kd_ok = key_ok[:, None] & d_ok[None, :]
    k = tl.load(k_ptrs, mask=kd_ok, other=0.0)
    v = tl.load(v_ptrs, mask=kd_ok, other=0.0)
    k_doc = _doc_ids(KDoc, b * Sk, cols, key_ok, HAS_DOCS)
    s = _logits(q, k, rows, cols, Sk, diag_lo, diag_hi, shift, sm_scale, slope, q_doc, k_doc, HAS_DOCS, HAS_ALIBI)
    return k, v, s


@triton.jit
def _load_lse(lse_ptrs, ok):
    """lse rows ``[BLOCK_M]`` as the backward subtracts them: +inf for rows that see no key (lse = -inf) and rows
    past Sq, so ``exp2((s - lse) * log2 e)`` is exactly 0 there (s is finite or -inf; never -inf - -inf)."""
    lse = tl.load(lse_ptrs, mask=ok, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse)


# ---- Kernels -----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=_PER_BLOCK, do_not_specialize_on_alignment=_PER_BLOCK)
def _fwd_kernel(
    Q, K, V, O, LSE, QDoc, KDoc, KTileDoc, Slopes,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ob, stride_os, stride_oh, stride_od,
    H, GROUP, Sq, Sk, D, diag_lo, diag_hi, shift, sm_scale,
    HAS_DOCS: tl.constexpr, HAS_ALIBI: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program: a tile of BLOCK_M queries of one (b, h); loops over the visible key tiles, online softmax."""
    b, h, start_m = _split_pid(Sq, H, BLOCK_M)
    offs_m, offs_n, offs_d, d_ok = tile_offsets(D, BLOCK_M, BLOCK_N, BLOCK_D)
    rows = start_m + offs_m  # local query rows
    query_ok, qd_ok = tile_bounds(rows, Sq, d_ok)  # [BLOCK_M], [BLOCK_M, BLOCK_D]
    # q[b, start_m:, h, :] as a [BLOCK_M, BLOCK_D] tile, resident for the whole loop
    q_ptr, q_offs = _tile(Q, b, h, start_m, stride_qb, stride_qh, stride_qs, stride_qd, offs_m, offs_d)
    q = tl.load(q_ptr + q_offs, mask=qd_ok, other=0.0)
    slope = _slope(Slopes, h, HAS_ALIBI)
    q_doc, doc_lo, doc_hi = _tile_docs(QDoc, b * Sq, rows, query_ok, HAS_DOCS)
    n_lo, n_hi, k_ptr, k_offs, v_ptr, v_offs = _key_loop(
        K, V, b, h, GROUP, start_m, Sq, Sk, diag_lo, diag_hi, stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd, offs_n, offs_d, BLOCK_M, BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max (natural units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running row sum of exp(s - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(n_lo, n_hi, BLOCK_N):
        if _visits(KTileDoc, b, Sk, start_n, doc_lo, doc_hi, BLOCK_N, HAS_DOCS):
            k, v, s = _key_tile(q, k_ptr + k_offs, v_ptr + v_offs, KDoc, b, rows, start_n + offs_n, d_ok, Sk,
                                diag_lo, diag_hi, shift, sm_scale, slope, q_doc, HAS_DOCS, HAS_ALIBI)
            m_i, l_i, acc = online_softmax_update(s, v, m_i, l_i, acc)
        k_ptr += BLOCK_N * stride_ks
        v_ptr += BLOCK_N * stride_vs

    empty = l_i == 0.0  # no visible key: out 0, lse -inf
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    # lse = m + log l in fp32 is safe here (the Evoformer kernel keeps m and l apart): lse lies in [m, m + log Sk]
    # and visibility is never an additive bias, so |lse| is the size of the logits and its rounding theirs
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    o_ptr, o_offs = _tile(O, b, h, start_m, stride_ob, stride_oh, stride_os, stride_od, offs_m, offs_d)
    tl.store(o_ptr + o_offs, cast(o, O.dtype.element_ty), mask=qd_ok)
    tl.store(LSE + (b * H + h) * Sq + rows, lse, mask=query_ok)  # lse [B, H, Sq], contiguous


@triton.jit(do_not_specialize=_PER_BLOCK, do_not_specialize_on_alignment=_PER_BLOCK)
def _bwd_dq_kernel(
    Q, K, V, O, DO, LSE, DLSE, Delta, DQ, QDoc, KDoc, KTileDoc, Slopes,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_dob, stride_dos, stride_doh, stride_dod,
    stride_dqb, stride_dqs, stride_dqh, stride_dqd,
    H, GROUP, Sq, Sk, D, diag_lo, diag_hi, shift, sm_scale,
    HAS_DOCS: tl.constexpr, HAS_ALIBI: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program: a tile of BLOCK_M queries of one (b, h). Stores the row term ``delta = rowsum(dO * O) - dlse``
    for the dK/dV kernel, then loops over the visible key tiles: dQ = dS K * scale."""
    b, h, start_m = _split_pid(Sq, H, BLOCK_M)
    offs_m, offs_n, offs_d, d_ok = tile_offsets(D, BLOCK_M, BLOCK_N, BLOCK_D)
    rows = start_m + offs_m
    query_ok, qd_ok = tile_bounds(rows, Sq, d_ok)
    # q, O, dO [BLOCK_M, BLOCK_D] tiles of row start_m of (b, h); lse, dlse, delta rows [BLOCK_M]. Rows and columns
    # are added to the bases one at a time (with _tile's offsets, fp32 D = 128 with documents and ALiBi spills)
    q_ptr, _ = _tile(Q, b, h, start_m, stride_qb, stride_qh, stride_qs, stride_qd, offs_m, offs_d)
    o_ptr, _ = _tile(O, b, h, start_m, stride_ob, stride_oh, stride_os, stride_od, offs_m, offs_d)
    do_ptr, _ = _tile(DO, b, h, start_m, stride_dob, stride_doh, stride_dos, stride_dod, offs_m, offs_d)
    tile = offs_m[:, None]
    q = tl.load(q_ptr + tile * stride_qs + offs_d[None, :] * stride_qd, mask=qd_ok, other=0.0)
    o = tl.load(o_ptr + tile * stride_os + offs_d[None, :] * stride_od, mask=qd_ok, other=0.0)
    do = tl.load(do_ptr + tile * stride_dos + offs_d[None, :] * stride_dod, mask=qd_ok, other=0.0)
    row_ptr = (b * H + h) * Sq + rows  # rows of [B, H, Sq] (contiguous)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1) - tl.load(DLSE + row_ptr, mask=query_ok, other=0.0)
    tl.store(Delta + row_ptr, delta, mask=query_ok)
    lse = _load_lse(LSE + row_ptr, query_ok)
    slope = _slope(Slopes, h, HAS_ALIBI)
    q_doc, doc_lo, doc_hi = _tile_docs(QDoc, b * Sq, rows, query_ok, HAS_DOCS)
    n_lo, n_hi, k_ptr, k_offs, v_ptr, v_offs = _key_loop(
        K, V, b, h, GROUP, start_m, Sq, Sk, diag_lo, diag_hi, stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd, offs_n, offs_d, BLOCK_M, BLOCK_N)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(n_lo, n_hi, BLOCK_N):
        if _visits(KTileDoc, b, Sk, start_n, doc_lo, doc_hi, BLOCK_N, HAS_DOCS):
            k, v, s = _key_tile(q, k_ptr + k_offs, v_ptr + v_offs, KDoc, b, rows, start_n + offs_n, d_ok, Sk,
                                diag_lo, diag_hi, shift, sm_scale, slope, q_doc, HAS_DOCS, HAS_ALIBI)
            p = tl.math.exp2((s - lse[:, None]) * LOG2E)  # subtract, then scale (no addend in the exponent)
            dp = dot(do, tl.trans(v))  # [BLOCK_M, BLOCK_D] @ [BLOCK_D, BLOCK_N]
            ds = p * (dp - delta[:, None])  # gradient of the logits s
            dq += dot(cast(ds, k.dtype), k)  # [BLOCK_M, BLOCK_N] @ [BLOCK_N, BLOCK_D]
        k_ptr += BLOCK_N * stride_ks
        v_ptr += BLOCK_N * stride_vs

    dq_ptr, _ = _tile(DQ, b, h, start_m, stride_dqb, stride_dqh, stride_dqs, stride_dqd, offs_m, offs_d)
    tl.store(dq_ptr + tile * stride_dqs + offs_d[None, :] * stride_dqd, cast(dq * sm_scale, DQ.dtype.element_ty),
             mask=qd_ok)


@triton.jit(do_not_specialize=_PER_BLOCK, do_not_specialize_on_alignment=_PER_BLOCK)
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, Delta, DK, DV, QDoc, KDoc, QTileDoc, Slopes,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_dob, stride_dos, stride_doh, stride_dod,
    stride_dkb, stride_dks, stride_dkh, stride_dkd,
    stride_dvb, stride_dvs, stride_dvh, stride_dvd,
    H, GROUP, Sq, Sk, D, diag_lo, diag_hi, shift, sm_scale,
    HAS_DOCS: tl.constexpr, HAS_ALIBI: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program: a tile of BLOCK_N keys of one (b, kv head); loops over the GROUP query heads that read this kv
    head and, for each, over the visible query tiles, recomputing P from the lse: dK, dV summed in registers."""
    b, hk, start_n = _split_pid(Sk, H // GROUP, BLOCK_N)  # key tiles fastest, then kv head, then b
    offs_m, offs_n, offs_d, d_ok = tile_offsets(D, BLOCK_M, BLOCK_N, BLOCK_D)
    cols = start_n + offs_n  # local key rows
    key_ok, kd_ok = tile_bounds(cols, Sk, d_ok)  # [BLOCK_N], [BLOCK_N, BLOCK_D]
    k_doc, doc_lo, doc_hi = _tile_docs(KDoc, b * Sk, cols, key_ok, HAS_DOCS)
    # k[b, start_n:, hk, :] and v as [BLOCK_N, BLOCK_D] tiles, resident for the whole loop
    k_ptr, k_offs = _tile(K, b, hk, start_n, stride_kb, stride_kh, stride_ks, stride_kd, offs_n, offs_d)
    v_ptr, v_offs = _tile(V, b, hk, start_n, stride_vb, stride_vh, stride_vs, stride_vd, offs_n, offs_d)
    k = tl.load(k_ptr + k_offs, mask=kd_ok, other=0.0)
    v = tl.load(v_ptr + v_offs, mask=kd_ok, other=0.0)
    m_lo, m_hi = _key_range(start_n, Sk, Sq, -diag_hi, -diag_lo, BLOCK_N, BLOCK_M)  # query tiles meeting the band

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for g in range(0, GROUP):  # the query heads of this kv head's group (GQA), summed in registers
        h = hk * GROUP + g
        slope = _slope(Slopes, h, HAS_ALIBI)
        # [BLOCK_M, BLOCK_D] tiles of q[b, :, h, :] and dO at query tile m_lo; lse and delta rows [BLOCK_M]
        q_ptr, q_offs = _tile(Q, b, h, m_lo, stride_qb, stride_qh, stride_qs, stride_qd, offs_m, offs_d)
        do_ptr, do_offs = _tile(DO, b, h, m_lo, stride_dob, stride_doh, stride_dos, stride_dod, offs_m, offs_d)
        row = (b * H + h) * Sq + m_lo  # first row of [B, H, Sq] (contiguous)
        for start_m in range(m_lo, m_hi, BLOCK_M):
            if _visits(QTileDoc, b, Sq, start_m, doc_lo, doc_hi, BLOCK_M, HAS_DOCS):
                rows = start_m + offs_m
                query_ok, qd_ok = tile_bounds(rows, Sq, d_ok)
                q = tl.load(q_ptr + q_offs, mask=qd_ok, other=0.0)
                do = tl.load(do_ptr + do_offs, mask=qd_ok, other=0.0)
                lse = _load_lse(LSE + row + offs_m, query_ok)  # +inf past Sq: P = 0 there
                delta = tl.load(Delta + row + offs_m, mask=query_ok, other=0.0)
                q_doc = _doc_ids(QDoc, b * Sq, rows, query_ok, HAS_DOCS)
                s = _logits(q, k, rows, cols, Sk, diag_lo, diag_hi, shift, sm_scale, slope, q_doc, k_doc,
                            HAS_DOCS, HAS_ALIBI)  # [BLOCK_M, BLOCK_N]
                p = tl.math.exp2((s - lse[:, None]) * LOG2E)
                dv += dot(tl.trans(cast(p, do.dtype)), do)  # [BLOCK_N, BLOCK_M] @ [BLOCK_M, BLOCK_D]
                dp = dot(do, tl.trans(v))  # [BLOCK_M, BLOCK_D] @ [BLOCK_D, BLOCK_N]
                ds = p * (dp - delta[:, None])
                dk += dot(tl.trans(cast(ds, q.dtype)), q)  # [BLOCK_N, BLOCK_M] @ [BLOCK_M, BLOCK_D]
            q_ptr += BLOCK_M * stride_qs
            do_ptr += BLOCK_M * stride_dos
            row += BLOCK_M

    dk_ptr, dk_offs = _tile(DK, b, hk, start_n, stride_dkb, stride_dkh, stride_dks, stride_dkd, offs_n, offs_d)
    dv_ptr, dv_offs = _tile(DV, b, hk, start_n, stride_dvb, stride_dvh, stride_dvs, stride_dvd, offs_n, offs_d)
    tl.store(dk_ptr + dk_offs, cast(dk * sm_scale, DK.dtype.element_ty), mask=kd_ok)
    tl.store(dv_ptr + dv_offs, cast(dv, DV.dtype.element_ty), mask=kd_ok)


# ---- Launchers: visibility band, document tile ranges, grids and arguments ---------------------------------


@dataclass(frozen=True)
class Visibility:
    """What one call masks, as the kernels take it (see :func:`_band`)."""

    diag_lo: int  # key c visible to query a iff diag_lo <= a - c <= diag_hi (local indices) ...
    diag_hi: int
    shift: int  # ... global i - j = (a - c) + shift, i.e. q_offset - k_offset (ALiBi distances)
    q_doc: Optional[Tensor]  # [B, Sq] int64 contiguous, or None
    k_doc: Optional[Tensor]  # [B, Sk] int64 contiguous, or None
    slopes: Optional[Tensor]  # [H] fp32 contiguous: the slopes of the local heads, or None

    @property
    def empty(self) -> bool:
        """No query sees any key (the band is empty): nothing to launch."""
        return self.diag_lo > self.diag_hi


def _band(q_len: int, k_len: int, q_offset: int, k_offset: int, causal: bool, window: Optional[int]) -> tuple[int, int]:
    """(diag_lo, diag_hi): the band of local diagonals ``a - c`` causal and window leave, clamped to the block.

    Global ``i - j = (a - c) + shift`` with ``shift = q_offset - k_offset``. Causal keeps ``i - j >= 0``; a window
    keeps ``i - j <= window - 1`` and, without causal, ``i - j >= -(window - 1)``. Clamped to the block's own range
    ``[-(k_len - 1), q_len - 1]``, so both fit in int32 whatever the offsets; ``diag_lo > diag_hi``: empty block.
    """
    shift = q_offset - k_offset
    lo, hi = -(k_len - 1), q_len - 1
    if causal:
        lo = max(lo, -shift)
    if window is not None:
        hi = min(hi, window - 1 - shift)
        if not causal:
            lo = max(lo, -(window - 1) - shift)
    return lo, hi


def _tile_doc_ranges(doc: Tensor, block: int) -> Tensor:
    """Per tile of ``block`` rows, the (min, max) document id: ``[B, cdiv(S, block), 2]`` int64, contiguous.

    The last tile is padded with its last id (which does not widen its range). O(S) work, O(S / block) memory.
    """
    batch, length = doc.shape
    tiles = triton.cdiv(length, block)
    pad = tiles * block - length
    if pad:
        doc = torch.cat([doc, doc[:, -1:].expand(batch, pad)], dim=1)
    doc = doc.view(batch, tiles, block)  # [B, tiles, block]
    return torch.stack([doc.amin(dim=-1), doc.amax(dim=-1)], dim=-1).contiguous()  # [B, tiles, (min, max)]


def _meta(vis: Visibility, block_d: int, t: Tiles) -> dict:
    """Constexpr and launch keyword arguments of a kernel with tiles ``t``."""
    return dict(HAS_DOCS=vis.q_doc is not None, HAS_ALIBI=vis.slopes is not None, BLOCK_M=t.block_m,
                BLOCK_N=t.block_n, BLOCK_D=block_d, **t.launch_options())


def fwd_launch(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, vis: Visibility, scale: float):
    """(grid, positional args, constexpr/launch kwargs) of the forward kernel; shared with the AOT compile gate."""
    batch, q_len, heads, d = q.shape
    k_len, kv_heads = k.shape[1], k.shape[2]
    cfg = _config(q.dtype, d)
    t = cfg.fwd
    k_tiles = _tile_doc_ranges(vis.k_doc, t.block_n) if vis.q_doc is not None else None
    args = (q, k, v, o, lse, vis.q_doc, vis.k_doc, k_tiles, vis.slopes, *q.stride(), *k.stride(), *v.stride(),
            *o.stride(), heads, heads // kv_heads, q_len, k_len, d, vis.diag_lo, vis.diag_hi, vis.shift, scale)
    return (triton.cdiv(q_len, t.block_m) * batch * heads,), args, _meta(vis, cfg.block_d, t)


def bwd_launches(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, dlse: Tensor, delta: Tensor,
    dq: Tensor, dk: Tensor, dv: Tensor, vis: Visibility, scale: float,
) -> list:
    """[(kernel, grid, args, meta)] of the backward in launch order (dQ writes delta); shared with the AOT gate."""
    batch, q_len, heads, d = q.shape
    k_len, kv_heads = k.shape[1], k.shape[2]
    cfg = _config(q.dtype, d)
    docs = vis.q_doc is not None
    dims = (heads, heads // kv_heads, q_len, k_len, d, vis.diag_lo, vis.diag_hi, vis.shift, scale)
    k_tiles = _tile_doc_ranges(vis.k_doc, cfg.dq.block_n) if docs else None  # key tiles the dQ kernel loops over
    q_tiles = _tile_doc_ranges(vis.q_doc, cfg.dkdv.block_m) if docs else None  # query tiles of the dK/dV loop
    return [
        (_bwd_dq_kernel, (triton.cdiv(q_len, cfg.dq.block_m) * batch * heads,),
         (q, k, v, o, do, lse, dlse, delta, dq, vis.q_doc, vis.k_doc, k_tiles, vis.slopes,
          *q.stride(), *k.stride(), *v.stride(), *o.stride(), *do.stride(), *dq.stride(), *dims),
         _meta(vis, cfg.block_d, cfg.dq)),
        (_bwd_dkdv_kernel, (triton.cdiv(k_len, cfg.dkdv.block_n) * batch * kv_heads,),
         (q, k, v, do, lse, delta, dk, dv, vis.q_doc, vis.k_doc, q_tiles, vis.slopes,
          *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(), *dims),
         _meta(vis, cfg.block_d, cfg.dkdv)),
    ]


def forward(q: Tensor, k: Tensor, v: Tensor, vis: Visibility, scale: float) -> tuple[Tensor, Tensor]:
    """out ``[B, Sq, H, D]`` in q's dtype and lse ``[B, H, Sq]`` fp32 (-inf on rows that see no key)."""
    batch, q_len, heads, _ = q.shape
    if vis.empty:
        return q.new_zeros(q.shape), torch.full((batch, heads, q_len), -math.inf, dtype=torch.float32, device=q.device)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [B, Sq, H, D]
    lse = torch.empty((batch, heads, q_len), dtype=torch.float32, device=q.device)  # [B, H, Sq]
    grid, args, meta = fwd_launch(q, k, v, o, lse, vis, scale)
    _fwd_kernel[grid](*args, **meta)
    return o, lse


def backward(
    do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, vis: Visibility,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv (q's, k's and v's dtype and shape) from dO ``[B, Sq, H, D]`` and dlse ``[B, H, Sq]`` (either may
    be None: zero)."""
    if vis.empty:
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    do = torch.zeros_like(o) if do is None else do
    dlse = torch.zeros_like(lse) if dlse is None else dlse.to(torch.float32).contiguous()  # [B, H, Sq] fp32
    delta = torch.empty_like(lse)  # [B, H, Sq] fp32, written by the dQ kernel
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for kernel, grid, args, meta in bwd_launches(do, q, k, v, o, lse, dlse, delta, dq, dk, dv, vis, scale):
        kernel[grid](*args, **meta)
    return dq, dk, dv


class _TritonAttention(torch.autograd.Function):
    """Fused forward, recomputing backward; the lse output is differentiable (ring attention merges through it)."""

    @staticmethod
    def forward(ctx, q, k, v, vis: Visibility, scale: float):
        o, lse = forward(q, k, v, vis, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.vis, ctx.scale = vis, scale
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
        return o, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        if do is None and dlse is None:
            return None, None, None, None, None
        dq, dk, dv = backward(do, dlse, q, k, v, o, lse, ctx.vis, ctx.scale)
        return dq, dk, dv, None, None


# ---- Public function ---------------------------------------------------------------------------------------


def _check(q: Tensor, k: Tensor, v: Tensor, q_doc, k_doc, window, alibi_slopes, head_offset) -> None:
    # the protocol's checks (shapes, GQA, document ids, window, ALiBi slopes), shared by every local attention
    check_qkv(q, k, v, q_doc, k_doc, window=window, alibi_slopes=alibi_slopes, head_offset=head_offset)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"triton_attention: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    _config(q.dtype, q.shape[3])  # dtype and head dim within the tile table
    if not (q.device == k.device == v.device):
        raise ValueError(f"triton_attention: q, k, v on different devices: {q.device}, {k.device}, {v.device}")
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"triton_attention: needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU), got {q.device}")
    if head_offset < 0:
        raise ValueError(f"triton_attention: head_offset={head_offset} must be >= 0")


def triton_attention(q: Tensor, k: Tensor, v: Tensor, *, q_offset: int = 0, k_offset: int = 0, head_offset: int = 0,
                     q_doc: Optional[Tensor] = None, k_doc: Optional[Tensor] = None, return_lse: bool = False,
                     causal: bool = False, window: Optional[int] = None, alibi_slopes: Optional[Tensor] = None,
                     scale: Optional[float] = None):
    """Local attention (the protocol of :mod:`ds4sci.kernels.local_attention`) with the fused Triton kernels.

    q ``[B, Sq, H, D]``, k and v ``[B, Sk, Hkv, D]`` (fp16, bf16 or fp32, one dtype, CUDA; CPU only under
    ``TRITON_INTERPRET=1``; any strides) -> out ``[B, Sq, H, D]`` in q's dtype, or ``(out, lse)`` with
    ``return_lse``, lse ``[B, H, Sq]`` float32 carrying a gradient.

    Args:
        q_offset, k_offset: global index of the first query / key row (masks and ALiBi use global indices).
        head_offset: global index of local head 0 (selects the ALiBi slopes).
        q_doc, k_doc: integer document ids ``[B, Sq]`` / ``[B, Sk]``: a query sees a key only with the same id.
        causal: key j visible to query i only if ``j <= i``.
        window: ``i - j < window`` (and ``j - i < window`` without causal).
        alibi_slopes: ``[H_total]`` slopes; local head h adds ``-alibi_slopes[head_offset + h] * |i - j|``.
        scale: defaults to ``1/sqrt(D)``.

    Rows that see no key: out 0, lse -inf, zero gradients. A block no query of which sees any key (e.g. a causal
    ring block entirely in the future) launches nothing.
    """
    _check(q, k, v, q_doc, k_doc, window, alibi_slopes, head_offset)
    batch, q_len, heads, d = q.shape
    k_len = k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    diag_lo, diag_hi = _band(q_len, k_len, q_offset, k_offset, causal, window)
    if q_len == 0 or k_len == 0:
        diag_lo, diag_hi = 1, 0  # nothing to attend: empty
    if abs(q_offset - k_offset) + q_len + k_len > _INT32_MAX:  # global i - j, computed in int32 (ALiBi)
        raise ValueError(f"triton_attention: global distances beyond int32 (q_offset={q_offset}, k_offset={k_offset})")
    slopes = None
    if alibi_slopes is not None:  # [H] fp32: the local heads' slopes
        slopes = alibi_slopes.reshape(-1)[head_offset : head_offset + heads].to(q.device, torch.float32).contiguous()
    if q_doc is not None:
        q_doc = q_doc.to(q.device, torch.int64).contiguous()  # [B, Sq]
        k_doc = k_doc.to(q.device, torch.int64).contiguous()  # [B, Sk]
    vis = Visibility(diag_lo, diag_hi, q_offset - k_offset, q_doc, k_doc, slopes)
    out, lse = _TritonAttention.apply(q, k, v, vis, scale)
    return (out, lse) if return_lse else out
