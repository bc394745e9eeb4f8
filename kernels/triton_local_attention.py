"""Fused local attention in Triton for GenSLM: the ds4sci local attention protocol, forward and recomputing backward.

:func:`triton_attention` is a local attention in the sense of :mod:`ds4sci.kernels.local_attention` (its module
docstring defines the protocol; :func:`~ds4sci.kernels.local_reference.sdpa_attention` is the readable oracle the
tests compare against): one contiguous block of queries against one contiguous block of keys, masks and position
biases evaluated on *global* indices, so Ulysses, ring and Unified sequence parallelism can call it per block.

Shapes (named dims): q ``[B, Sq, H, D]``, k and v ``[B, Sk, Hkv, D]`` (B batch, Sq/Sk local query/key rows, H query
heads, Hkv key/value heads dividing H, D head dim), out ``[B, Sq, H, D]`` in q's dtype, lse ``[B, H, Sq]`` float32
(natural log-sum-exp of the scaled, biased logits). Query head ``h`` reads key/value head ``h // (H / Hkv)`` through
its strides: GQA/MQA never repeats K and V in memory. Document ids ``q_doc [B, Sq]`` / ``k_doc [B, Sk]``.

Algorithm. FlashAttention-2 (Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work
Partitioning", Algorithms 1 and 2), the tiled online-softmax form of Rabe & Staats 2021 ("Self-attention does not
need O(n^2) memory") with the online normaliser of Milakov & Gimelshein 2018. For one (b, h) and a tile of BLOCK_M
queries the forward kernel loops over the key tiles the masks leave, and in registers forms

    s[a, c] = q[a] . k[c] * scale - slope[h] * |i - j|        (fp32; i = q_offset + a, j = k_offset + c)

(ALiBi, Press et al. 2022, "Train Short, Test Long: Attention with Linear Biases", on global indices), sets s to
-inf where key j is invisible to query i, and updates a running row max m, row sum l and output accumulator in
fp32. The logits never reach memory; O (q's dtype) and lse = m + log l (fp32) are stored.

Visibility (the protocol's): causal ``j <= i``; window ``i - j < window`` and, without causal, ``j - i < window``;
documents ``q_doc[i] == k_doc[j]``. Causal and window are one *band* of diagonals ``diag_lo <= a - c <= diag_hi``
in local indices (:func:`_band`), a runtime pair of integers rather than a compile-time flag: every
dense, causal, windowed or ring block (queries and keys at any offsets) runs the same compiled code.

Block skipping. Each program loops only over the tiles that can meet the band: the loop bounds follow from
``diag_lo``/``diag_hi`` and the tile's rows, so causal attention skips key tiles entirely after the query tile,
a window skips tiles out of the band, and a ring block entirely in the future of the queries launches nothing. With
documents, the launcher reduces the ids of every tile the kernels loop over to a range ``[min, max]`` (torch,
O(S / BLOCK) per call: :func:`_tile_doc_ranges`); a program skips a tile whose range cannot meet its own tile's range
(computed in the kernel from the ids it loads). Ranges are valid for any order of ids: packed sequences (sorted
ids) skip every tile outside the query tile's documents, interleaved ids simply skip less.

Softmax arithmetic: the forward kernel's per-tile step is :func:`ds4sci.kernels.triton_common.online_softmax_update`,
shared with the Evoformer kernel. Every exponent is ``exp2((s - m) * log2 e)``: the max is subtracted in the unscaled
domain, then one scaling, so no fused multiply-add of a separately scaled max feeds ``exp2`` (the GPU compiler
contracts ``s*log2e - m*log2e`` into ``fma(s, log2e, -round(m*log2e))``, whose rounding error becomes the exponent
when |m| is large; ``ds4sci bench kernels-aot --set local`` checks the PTX). Before the first visible key of a row the
max is -inf and 0 is subtracted instead (``-inf - -inf`` would be NaN).

Why storing only ``lse = m + log l`` is safe here (the Evoformer kernel stores m and l apart): its fp32 rounding is
half an ulp of |lse|, and lse lies within ``[m, m + log Sk]``, where m is the row's largest logit. Every logit of a
row is computed in fp32 to within its own half ulp, so the lse adds at most the rounding error the logits near the
max already carry. The Evoformer case (a finite ``-1e9`` mask, whose float32 spacing of 64 swallows ``log l``
entirely) cannot occur: visibility is never an additive bias, a row is either fully invisible (lse = -inf) or has
finite logits of size ``|q.k| * scale + slope * |i - j|``, the magnitude every fp32 implementation computes.

Backward (FlashAttention-2, Algorithm 2) recomputes ``P = exp2((s - lse) * log2 e)`` tile by tile in two kernels,
launched in this order:

1. ``_bwd_dq_kernel``: one program per (query tile, b, h), looping over key tiles: dQ. It first computes the row
   term ``delta = rowsum(dO * O) - dlse`` (fp32) and stores it for the next kernel. The lse gradient (ring attention
   backpropagates through the lse when it merges blocks) folds in here: ``dL/ds = P * (dP - rowsum(dO * O) + dlse)``.
2. ``_bwd_dkdv_kernel``: one program per (key tile, b, kv head), looping over the H / Hkv query heads of its group
   and, for each, over query tiles: dK and dV of a kv head are summed in registers over the group, so GQA needs no
   atomics and no repeated K/V.

No kernel uses atomics: two backward passes are bitwise equal. Rows that see no key give out = 0, lse = -inf and,
in the backward, P = 0 (lse is read as +inf there), so every gradient is finite and those rows contribute zero.

Compiled variants. Two constexpr flags change what a kernel loads: ``HAS_DOCS`` (document ids and tile ranges) and
``HAS_ALIBI`` (one slope per head); the band, the offsets, the GQA group size and the scale are runtime values, and
the integers that change from ring block to ring block (``diag_lo``, ``diag_hi``, ``shift``) are marked
``do_not_specialize`` so that every block of a sequence reuses one compiled kernel. Tiles come from :data:`_TABLE` by
(fp32?, BLOCK_D), one set per kernel (forward, dQ, dK/dV), ``BLOCK_D`` being the head dim rounded up to a power of
two, at least 16 (``tl.dot``'s minimum; columns past D are masked). So each table entry has 3 kernels x 4 flag
combinations. The launchers (:func:`fwd_launch`, :func:`bwd_launches`) are shared with the compile gate
``ds4sci bench kernels-aot``: ``--set local`` compiles every table entry (bf16, fp32) and kernel with the flags all
off and all on for sm_80 and sm_90a (96 compilations; tests/kernels/test_triton_local_attention_aot.py), ``--set
local-full`` every dtype and flag combination (288): within shared memory, without spills, and no exponent taken
from a fused multiply-add. Every narrowing cast goes through :func:`ds4sci.kernels.triton_common.cast`, so bf16
rounds to nearest even under the interpreter as on the GPU.

Limitations:
- It has only run under Triton's CPU interpreter (``TRITON_INTERPRET=1``) here; on a GPU it has been compiled ahead
  of time (PTX and cubin for sm_80 and sm_90, no launch), never run or timed. Tiles were chosen for spill-free
  compilation, not tuned for speed.
- fp16, bf16 and fp32 (fp32 matmuls are IEEE, never TF32); head dims 1..128. float64 is not supported (use
  :func:`~ds4sci.kernels.local_reference.sdpa_attention`).
- Every visited tile applies the full visibility predicate (band, key bound, documents): there is no separate
  unmasked path for tiles wholly inside the band.
- Document skipping is per tile and a runtime branch inside the tile loop: a program whose tiles are mostly skipped
  still walks over them, and the branch keeps Triton from software-pipelining that loop (the document variants
  request no multi-buffered shared memory: e.g. 8 KB instead of 18 KB for the bf16 D = 64 dQ kernel).
- Global distances ``|i - j|`` must fit in int32; ALiBi distances are exact in fp32 up to 2^24. Within one
  (b, h) slice tile offsets are 32-bit (``BLOCK * stride`` must fit in int32); per-program bases are 64-bit.
- No gradient for the ALiBi slopes (they are fixed in ALiBi) or the document ids.
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
from .triton_common import (BLOCK_D_BUCKETS, LOG2E, SUPPORTED_DTYPES, Tiles, cast, dot, online_softmax_update,
                            table_entry)

__all__ = ["triton_attention", "SUPPORTED_DTYPES", "BLOCK_D_BUCKETS"]

_INT32_MAX = 2**31 - 1
# Integer arguments that change from block to block of one sequence (ring attention steps, offsets) are neither
# specialised on == 1 nor on divisibility by 16: Triton would otherwise compile a kernel per class of each of them.
_PER_BLOCK = ("diag_lo", "diag_hi", "shift")


# ----------------------------------------------------------------------------------------------------------
# Tile configuration
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelConfig:
    block_d: int  # head dim padded to a power of two >= 16
    fwd: Tiles
    dq: Tiles  # the dQ kernel: q, dO resident, loops over key tiles
    dkdv: Tiles  # the dK/dV kernel: k, v resident, loops over query tiles


# (fp32?, BLOCK_D) -> (forward, dQ, dK/dV tiles), every entry compiled by ``ds4sci bench kernels-aot --set local`` for
# sm_80 and sm_90 within shared memory and without spills (flags all off and all on; ``--set local-full``: every flag
# combination).
# - fp16/bf16 run tl.dot on tensor cores. The backward keeps four fp32 [BLOCK_M, BLOCK_N] tiles live (s, p, dp, ds)
#   besides its resident tiles, hence fewer query rows than the forward from D = 32 on. At D = 64 the dK/dV kernel
#   with 64 resident keys spilled on sm_80 (1 KB with documents: their branch in the tile loop stops software
#   pipelining), so both backward kernels take 32 x 32 tiles there.
# - fp32 is IEEE (no TF32): Triton lowers it to FMA loops in which a thread holds whole K-rows of an operand, so
#   registers grow with BLOCK * D: small tiles, one pipeline stage (the loop is FMA-bound). At D = 128 the dQ kernel
#   holds two loop-invariant operand rows (q and dO, 128 floats each): with one stage and 4 or 8 warps it spilled,
#   with two stages it does not; the dK/dV kernel spilled with two stages and 4 warps, not with one stage and 8 warps.
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


# ----------------------------------------------------------------------------------------------------------
# @triton.jit helpers
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _logits(q, k, rows, cols, Sk, diag_lo, diag_hi, shift, sm_scale, slope, q_doc, k_doc,
            HAS_DOCS: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Logits ``[BLOCK_M, BLOCK_N]`` in fp32: ``q k^T * scale - slope * |i - j|``, -inf where invisible.

    q ``[BLOCK_M, BLOCK_D]`` and k ``[BLOCK_N, BLOCK_D]`` tiles at local query rows ``rows [BLOCK_M]`` and key rows
    ``cols [BLOCK_N]``; global ``i - j = (rows - cols) + shift``. Visible: inside the band ``diag_lo <= rows - cols
    <= diag_hi``, key row < Sk and, with documents, equal ids (``q_doc [BLOCK_M]``, ``k_doc [BLOCK_N]``).
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
def _doc_range(doc, ok):
    """(min, max) of the ids ``doc`` where ``ok`` (a tile's own documents)."""
    lo = tl.min(tl.where(ok, doc, 9223372036854775807), 0)
    hi = tl.max(tl.where(ok, doc, -9223372036854775808), 0)
    return lo, hi


@triton.jit
def _key_range(start_m, Sq, Sk, diag_lo, diag_hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[lo, hi): the key rows the tiles of a query tile's loop cover, ``lo`` a multiple of BLOCK_N.

    Query rows a of the tile ``[start_m, min(start_m + BLOCK_M, Sq))`` see key rows c with ``a - diag_hi <= c <=
    a - diag_lo``: so ``c`` in ``[start_m - diag_hi, last_row - diag_lo]`` clipped to ``[0, Sk)``, the start rounded
    down to a tile boundary. A tile the band misses entirely gives ``lo == hi``: no iteration (rounding ``lo`` down
    alone could reopen a range that is empty).
    """
    first = tl.maximum(start_m - diag_hi, 0)
    last_row = tl.minimum(start_m + BLOCK_M, Sq) - 1
    hi = tl.minimum(last_row - diag_lo + 1, Sk)
    lo = (first // BLOCK_N) * BLOCK_N
    return lo, tl.where(first < hi, hi, lo)


@triton.jit
def _query_program(pid, Sq, H, GROUP, BLOCK_M: tl.constexpr):
    """(b, h, hk, start_m) of a program over query tiles (query tiles fastest, then h, then b): batch row b and
    key/value head hk (int64) of query head h, first query row start_m of its tile."""
    num_m = tl.cdiv(Sq, BLOCK_M)
    tile_m = pid % num_m
    bh = pid // num_m
    h = bh % H
    b = (bh // H).to(tl.int64)
    hk = (h // GROUP).to(tl.int64)  # key/value head of this query head
    return b, h, hk, tile_m * BLOCK_M


@triton.jit
def _tile_meets(TileDoc, b, num_tiles, tile, doc_lo, doc_hi):
    """Whether tile ``tile`` of batch row b, whose (min, max) document id is ``TileDoc[b, tile]`` (``[B, num_tiles,
    2]``, from :func:`_tile_doc_ranges`), can hold an id in ``[doc_lo, doc_hi]``: a False tile is skipped."""
    tile_doc = TileDoc + (b * num_tiles + tile) * 2
    return (tl.load(tile_doc) <= doc_hi) & (tl.load(tile_doc + 1) >= doc_lo)


@triton.jit
def _load_lse(lse_ptrs, ok):
    """lse rows ``[BLOCK_M]`` as the backward subtracts them: +inf for rows that see no key (lse = -inf) and rows
    past Sq, so ``exp2((s - lse) * log2 e)`` is exactly 0 there (s is finite or -inf; never -inf - -inf)."""
    lse = tl.load(lse_ptrs, mask=ok, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse)


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------


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
    tl.static_assert(BLOCK_M % 16 == 0 and BLOCK_N % 16 == 0, "tiles must be multiples of 16 (tl.dot)")
    tl.static_assert(BLOCK_D >= 16, "BLOCK_D must be at least 16 (tl.dot)")
    b, h, hk, start_m = _query_program(tl.program_id(0), Sq, H, GROUP, BLOCK_M)
    rows = start_m + tl.arange(0, BLOCK_M)  # local query rows
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    query_ok = rows < Sq
    qd_ok = query_ok[:, None] & d_ok[None, :]  # [BLOCK_M, BLOCK_D]

    # q[b, start_m:, h, :] as a [BLOCK_M, BLOCK_D] tile, resident for the whole loop
    q_base = b * stride_qb + h.to(tl.int64) * stride_qh + start_m.to(tl.int64) * stride_qs
    q_tile = tl.arange(0, BLOCK_M)[:, None] * stride_qs + offs_d[None, :] * stride_qd
    q = tl.load(Q + q_base + q_tile, mask=qd_ok, other=0.0)
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Slopes + h).to(tl.float32)
    q_doc = tl.zeros([BLOCK_M], tl.int64)
    k_doc = tl.zeros([BLOCK_N], tl.int64)
    if HAS_DOCS:
        q_doc = tl.load(QDoc + b * Sq + rows, mask=query_ok, other=-1)
        q_doc_lo, q_doc_hi = _doc_range(q_doc, query_ok)

    n_lo, n_hi = _key_range(start_m, Sq, Sk, diag_lo, diag_hi, BLOCK_M, BLOCK_N)
    # [BLOCK_N, BLOCK_D] tiles of k[b, :, hk, :] and v at key tile n_lo: a scalar pointer advanced by BLOCK_N rows
    # per step plus loop-invariant 32-bit offsets (a tensor of 64-bit pointers would cost twice the registers)
    k_ptr = K + (b * stride_kb + hk * stride_kh + n_lo.to(tl.int64) * stride_ks)
    v_ptr = V + (b * stride_vb + hk * stride_vh + n_lo.to(tl.int64) * stride_vs)
    k_offs = offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd
    v_offs = offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max (natural units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running row sum of exp(s - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(n_lo, n_hi, BLOCK_N):
        visit = True
        if HAS_DOCS:  # skip a key tile whose document range cannot meet this query tile's
            visit = _tile_meets(KTileDoc, b, tl.cdiv(Sk, BLOCK_N), start_n // BLOCK_N, q_doc_lo, q_doc_hi)
        if visit:
            cols = start_n + offs_n
            kd_ok = (cols < Sk)[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + k_offs, mask=kd_ok, other=0.0)
            v = tl.load(v_ptr + v_offs, mask=kd_ok, other=0.0)
            if HAS_DOCS:
                k_doc = tl.load(KDoc + b * Sk + cols, mask=cols < Sk, other=-1)
            s = _logits(q, k, rows, cols, Sk, diag_lo, diag_hi, shift, sm_scale, slope, q_doc, k_doc,
                        HAS_DOCS, HAS_ALIBI)  # [BLOCK_M, BLOCK_N]
            m_i, l_i, acc = online_softmax_update(s, v, m_i, l_i, acc)
        k_ptr += BLOCK_N * stride_ks
        v_ptr += BLOCK_N * stride_vs

    empty = l_i == 0.0  # no visible key: out 0, lse -inf
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    o_base = b * stride_ob + h.to(tl.int64) * stride_oh + start_m.to(tl.int64) * stride_os
    o_tile = tl.arange(0, BLOCK_M)[:, None] * stride_os + offs_d[None, :] * stride_od
    tl.store(O + o_base + o_tile, cast(o, O.dtype.element_ty), mask=qd_ok)
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
    tl.static_assert(BLOCK_M % 16 == 0 and BLOCK_N % 16 == 0, "tiles must be multiples of 16 (tl.dot)")
    tl.static_assert(BLOCK_D >= 16, "BLOCK_D must be at least 16 (tl.dot)")
    b, h, hk, start_m = _query_program(tl.program_id(0), Sq, H, GROUP, BLOCK_M)
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    query_ok = rows < Sq
    qd_ok = query_ok[:, None] & d_ok[None, :]
    tile = tl.arange(0, BLOCK_M)[:, None]

    # q, O, dO [BLOCK_M, BLOCK_D] tiles of row start_m of (b, h); lse, dlse, delta rows [BLOCK_M]
    q_base = b * stride_qb + h.to(tl.int64) * stride_qh + start_m.to(tl.int64) * stride_qs
    o_base = b * stride_ob + h.to(tl.int64) * stride_oh + start_m.to(tl.int64) * stride_os
    do_base = b * stride_dob + h.to(tl.int64) * stride_doh + start_m.to(tl.int64) * stride_dos
    q = tl.load(Q + q_base + tile * stride_qs + offs_d[None, :] * stride_qd, mask=qd_ok, other=0.0)
    o = tl.load(O + o_base + tile * stride_os + offs_d[None, :] * stride_od, mask=qd_ok, other=0.0)
    do = tl.load(DO + do_base + tile * stride_dos + offs_d[None, :] * stride_dod, mask=qd_ok, other=0.0)
    row_ptr = (b * H + h) * Sq + rows  # rows of [B, H, Sq] (contiguous)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1) - tl.load(DLSE + row_ptr, mask=query_ok, other=0.0)
    tl.store(Delta + row_ptr, delta, mask=query_ok)
    lse = _load_lse(LSE + row_ptr, query_ok)
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Slopes + h).to(tl.float32)
    q_doc = tl.zeros([BLOCK_M], tl.int64)
    k_doc = tl.zeros([BLOCK_N], tl.int64)
    if HAS_DOCS:
        q_doc = tl.load(QDoc + b * Sq + rows, mask=query_ok, other=-1)
        q_doc_lo, q_doc_hi = _doc_range(q_doc, query_ok)

    n_lo, n_hi = _key_range(start_m, Sq, Sk, diag_lo, diag_hi, BLOCK_M, BLOCK_N)
    k_ptr = K + (b * stride_kb + hk * stride_kh + n_lo.to(tl.int64) * stride_ks)
    v_ptr = V + (b * stride_vb + hk * stride_vh + n_lo.to(tl.int64) * stride_vs)
    k_offs = offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd
    v_offs = offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(n_lo, n_hi, BLOCK_N):
        visit = True
        if HAS_DOCS:
            visit = _tile_meets(KTileDoc, b, tl.cdiv(Sk, BLOCK_N), start_n // BLOCK_N, q_doc_lo, q_doc_hi)
        if visit:
            cols = start_n + offs_n
            kd_ok = (cols < Sk)[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + k_offs, mask=kd_ok, other=0.0)
            v = tl.load(v_ptr + v_offs, mask=kd_ok, other=0.0)
            if HAS_DOCS:
                k_doc = tl.load(KDoc + b * Sk + cols, mask=cols < Sk, other=-1)
            s = _logits(q, k, rows, cols, Sk, diag_lo, diag_hi, shift, sm_scale, slope, q_doc, k_doc,
                        HAS_DOCS, HAS_ALIBI)
            p = tl.math.exp2((s - lse[:, None]) * LOG2E)  # subtract, then scale (no addend in the exponent)
            dp = dot(do, tl.trans(v))  # [BLOCK_M, BLOCK_D] @ [BLOCK_D, BLOCK_N]
            ds = p * (dp - delta[:, None])  # gradient of the logits s
            dq += dot(cast(ds, k.dtype), k)  # [BLOCK_M, BLOCK_N] @ [BLOCK_N, BLOCK_D]
        k_ptr += BLOCK_N * stride_ks
        v_ptr += BLOCK_N * stride_vs

    dq_base = b * stride_dqb + h.to(tl.int64) * stride_dqh + start_m.to(tl.int64) * stride_dqs
    dq_ptrs = DQ + dq_base + tile * stride_dqs + offs_d[None, :] * stride_dqd
    tl.store(dq_ptrs, cast(dq * sm_scale, DQ.dtype.element_ty), mask=qd_ok)


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
    tl.static_assert(BLOCK_M % 16 == 0 and BLOCK_N % 16 == 0, "tiles must be multiples of 16 (tl.dot)")
    tl.static_assert(BLOCK_D >= 16, "BLOCK_D must be at least 16 (tl.dot)")
    pid = tl.program_id(0)
    num_n = tl.cdiv(Sk, BLOCK_N)
    tile_n = pid % num_n  # key tiles fastest, then kv head, then b
    bhk = pid // num_n
    Hkv = H // GROUP
    hk = bhk % Hkv
    b = (bhk // Hkv).to(tl.int64)
    start_n = tile_n * BLOCK_N
    cols = start_n + tl.arange(0, BLOCK_N)  # local key rows
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    key_ok = cols < Sk
    kd_ok = key_ok[:, None] & d_ok[None, :]  # [BLOCK_N, BLOCK_D]
    tile = tl.arange(0, BLOCK_N)[:, None]

    # k[b, start_n:, hk, :] and v as [BLOCK_N, BLOCK_D] tiles, resident for the whole loop
    k_base = b * stride_kb + hk.to(tl.int64) * stride_kh + start_n.to(tl.int64) * stride_ks
    v_base = b * stride_vb + hk.to(tl.int64) * stride_vh + start_n.to(tl.int64) * stride_vs
    k = tl.load(K + k_base + tile * stride_ks + offs_d[None, :] * stride_kd, mask=kd_ok, other=0.0)
    v = tl.load(V + v_base + tile * stride_vs + offs_d[None, :] * stride_vd, mask=kd_ok, other=0.0)
    q_doc = tl.zeros([BLOCK_M], tl.int64)
    k_doc = tl.zeros([BLOCK_N], tl.int64)
    if HAS_DOCS:
        k_doc = tl.load(KDoc + b * Sk + cols, mask=key_ok, other=-1)
        k_doc_lo, k_doc_hi = _doc_range(k_doc, key_ok)

    # Query tiles that can meet the band (the mirror image of _key_range: a - c in [diag_lo, diag_hi])
    m_lo, m_hi = _key_range(start_n, Sk, Sq, -diag_hi, -diag_lo, BLOCK_N, BLOCK_M)
    q_tile = offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd  # 32-bit offsets of a [BLOCK_M, BLOCK_D] tile
    do_tile = offs_m[:, None] * stride_dos + offs_d[None, :] * stride_dod

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for g in range(0, GROUP):  # the query heads of this kv head's group (GQA), summed in registers
        h = hk * GROUP + g
        slope = 0.0
        if HAS_ALIBI:
            slope = tl.load(Slopes + h).to(tl.float32)
        # [BLOCK_M, BLOCK_D] tiles of q[b, :, h, :] and dO at query tile m_lo; lse and delta rows [BLOCK_M]
        q_ptr = Q + (b * stride_qb + h.to(tl.int64) * stride_qh + m_lo.to(tl.int64) * stride_qs)
        do_ptr = DO + (b * stride_dob + h.to(tl.int64) * stride_doh + m_lo.to(tl.int64) * stride_dos)
        row = (b * H + h) * Sq + m_lo  # first row of [B, H, Sq] (contiguous)
        for start_m in range(m_lo, m_hi, BLOCK_M):
            visit = True
            if HAS_DOCS:  # skip a query tile whose document range cannot meet this key tile's
                visit = _tile_meets(QTileDoc, b, tl.cdiv(Sq, BLOCK_M), start_m // BLOCK_M, k_doc_lo, k_doc_hi)
            if visit:
                rows = start_m + offs_m
                query_ok = rows < Sq
                qd_ok = query_ok[:, None] & d_ok[None, :]
                q = tl.load(q_ptr + q_tile, mask=qd_ok, other=0.0)
                do = tl.load(do_ptr + do_tile, mask=qd_ok, other=0.0)
                lse = _load_lse(LSE + row + offs_m, query_ok)  # +inf past Sq: P = 0 there
                delta = tl.load(Delta + row + offs_m, mask=query_ok, other=0.0)
                if HAS_DOCS:
                    q_doc = tl.load(QDoc + b * Sq + rows, mask=query_ok, other=-1)
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

    dk_base = b * stride_dkb + hk.to(tl.int64) * stride_dkh + start_n.to(tl.int64) * stride_dks
    dv_base = b * stride_dvb + hk.to(tl.int64) * stride_dvh + start_n.to(tl.int64) * stride_dvs
    dk_ptrs = DK + dk_base + tile * stride_dks + offs_d[None, :] * stride_dkd
    dv_ptrs = DV + dv_base + tile * stride_dvs + offs_d[None, :] * stride_dvd
    tl.store(dk_ptrs, cast(dk * sm_scale, DK.dtype.element_ty), mask=kd_ok)
    tl.store(dv_ptrs, cast(dv, DV.dtype.element_ty), mask=kd_ok)


# ----------------------------------------------------------------------------------------------------------
# Launchers: visibility band, document tile ranges, grids and arguments
# ----------------------------------------------------------------------------------------------------------


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


def _flag_args(vis: Visibility) -> dict:
    return dict(HAS_DOCS=vis.q_doc is not None, HAS_ALIBI=vis.slopes is not None)


def fwd_launch(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, vis: Visibility, scale: float):
    """(grid, positional args, constexpr/launch kwargs) of the forward kernel; shared with the AOT compile gate."""
    batch, q_len, heads, d = q.shape
    k_len, kv_heads = k.shape[1], k.shape[2]
    cfg = _config(q.dtype, d)
    t = cfg.fwd
    k_tiles = _tile_doc_ranges(vis.k_doc, t.block_n) if vis.q_doc is not None else None
    args = (
        q, k, v, o, lse, vis.q_doc, vis.k_doc, k_tiles, vis.slopes,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        heads, heads // kv_heads, q_len, k_len, d, vis.diag_lo, vis.diag_hi, vis.shift, scale,
    )
    meta = dict(**_flag_args(vis), BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_D=cfg.block_d, **t.launch_options())
    return (triton.cdiv(q_len, t.block_m) * batch * heads,), args, meta


def bwd_launches(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, dlse: Tensor, delta: Tensor,
    dq: Tensor, dk: Tensor, dv: Tensor, vis: Visibility, scale: float,
) -> list:
    """[(kernel, grid, args, meta)] of the backward in launch order (dQ first: it writes delta); shared with the AOT
    compile gate."""
    batch, q_len, heads, d = q.shape
    k_len, kv_heads = k.shape[1], k.shape[2]
    cfg = _config(q.dtype, d)
    docs = vis.q_doc is not None
    dims = (heads, heads // kv_heads, q_len, k_len, d, vis.diag_lo, vis.diag_hi, vis.shift, scale)

    def meta(t: Tiles) -> dict:
        return dict(**_flag_args(vis), BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_D=cfg.block_d, **t.launch_options())

    k_tiles = _tile_doc_ranges(vis.k_doc, cfg.dq.block_n) if docs else None  # key tiles the dQ kernel loops over
    q_tiles = _tile_doc_ranges(vis.q_doc, cfg.dkdv.block_m) if docs else None  # query tiles of the dK/dV loop
    return [
        (_bwd_dq_kernel, (triton.cdiv(q_len, cfg.dq.block_m) * batch * heads,),
         (q, k, v, o, do, lse, dlse, delta, dq, vis.q_doc, vis.k_doc, k_tiles, vis.slopes,
          *q.stride(), *k.stride(), *v.stride(), *o.stride(), *do.stride(), *dq.stride(), *dims), meta(cfg.dq)),
        (_bwd_dkdv_kernel, (triton.cdiv(k_len, cfg.dkdv.block_n) * batch * kv_heads,),
         (q, k, v, do, lse, delta, dk, dv, vis.q_doc, vis.k_doc, q_tiles, vis.slopes,
          *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(), *dims), meta(cfg.dkdv)),
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


# ----------------------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------------------


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
