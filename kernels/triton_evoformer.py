"""The "triton" backend: fused Evoformer attention in Triton, forward and recomputing backward.

Algorithm. FlashAttention-2 (Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work
Partitioning", Algorithms 1 and 2), itself the tiled, online-softmax form of Rabe & Staats 2021 ("Self-attention
does not need O(n^2) memory"), with the two Evoformer biases fused in. For one (z, n, h) and a tile of queries the
forward kernel loops over key tiles and, in registers,

    s = (q k^T / sqrt(D) + mask[z, n, j]) + pair[z, h, i, j]     (fp32; the order every backend uses)

then updates a running row maximum m, row sum l and output accumulator in fp32 (the online softmax of Milakov &
Gimelshein 2018, "Online normalizer calculation for softmax"). The logits never reach memory; the mask-bias row
``[Z, N, S]`` and the pair-bias tile ``[Z, H, S, S]`` are read through their strides (stride 0 on broadcast dims is
never materialised; one pair tile serves every n). Only O (input dtype) and the softmax statistics
``stats [Z, N, H, S, 2]`` (fp32: the row max m and the row sum l, kept apart) are stored.

Softmax arithmetic (exact whatever the GPU compiler fuses; the forward's per-tile step is
:func:`ds4sci.kernels.triton_common.online_softmax_update`, shared with the local kernel). Every exponent is
``exp2((s - m) * log2 e)``: the max is subtracted in the unscaled domain, then one scaling. The compiler contracts
``a*c - b`` into a fused multiply-add with one rounding, so the textbook ``exp2(s*log2e - m*log2e)`` becomes
``exp2(fma(s, log2e, -round(m*log2e)))`` on a GPU, whose exponent for a row at m ~ -1e9 (OpenFold's finite mask) is
the rounding error of ``m*log2e``, up to 64: l and the accumulator grow by ~2^18 per key tile and overflow (the
interpreter, rounding each operation, never shows it). ``s - m`` is exact for ``s == m`` and no large operand
reaches ``exp2``. Before the first finite logit of a row the max is -inf and 0 is subtracted instead
(``-inf - -inf`` would be NaN); with a mask of ``finfo(float32).min`` the logits stay finite (no ``s * log2e``
overflow to -inf). The max and the sum are stored apart because the log-sum-exp ``m + log l`` in fp32 loses
``log l`` when |m| is huge (1e9: spacing 64): a fully masked row with a finite mask (uniform attention over the row,
the logits all rounding to the mask value) would be recomputed as ``P = 1`` instead of ``1/S``. The backward forms
``P = exp2((s - m) * log2 e) * (1 / l)`` (no addend inside the exponent either).

Backward recomputes ``P`` from (m, l) tile by tile (FlashAttention-2, Algorithm 2) in four kernels:

1. ``_bwd_preprocess_kernel``: ``delta = rowsum(dO * O)`` in fp32.
2. ``_bwd_dkdv_kernel``: one program per key tile, looping over query tiles: dK, dV and, when asked, the
   mask-bias gradient of this head ``sum_i dS`` (per-head partials ``[Z, N, H, S]`` summed over H afterwards).
3. ``_bwd_dq_kernel``: one program per query tile, looping over key tiles: dQ.
4. ``_bwd_dpair_kernel`` (only when the pair bias needs a gradient): one program per (z, h, chunk of N, query tile,
   key tile), looping over the chunk's n and summing ``dS`` in fp32 registers, written once; the chunks' partial
   sums are then added over the chunk dimension. N is split (:func:`dpair_chunk`) only as far as needed to fill a
   GPU: at extra-MSA shapes (N = 5120, S = 384, H = 8) the unsplit grid is 288 programs, each 5120 steps long, under
   one wave on an H100. OpenFold3's Triton kernel loops over all of N per program; DeepSpeed4Science's kernel
   uses fp32 atomics instead.

No kernel uses atomics, so two backward passes are bitwise equal (dpair and dmask included).

Masking conventions (shared with ``ds4sci.kernels.evoformer_reference``): a query row whose keys are all ``-inf`` gives zeros
and stats ``(+inf, +inf)``, so the backward's recomputed P is exactly 0 there and every gradient stays finite.
Finite masks (OpenFold's ``-1e9``, down to ``finfo(float32).min``) are plain additive biases.

Tiles. ``BLOCK_D`` is the head dim rounded up to a power of two (at least 16, ``tl.dot``'s minimum); the columns
past D are masked. There is no ``EVEN_D`` constexpr for the aligned case: compiled for sm_80 with D = BLOCK_D = 64,
the masked and unmasked kernels issue the same 128-bit loads and stores (Triton specialises D on divisibility by 16,
so the column mask is known constant over each vector) and differ by at most 2 registers, so the flag would only
double the variants to compile. Query/key tiles, warps and pipeline stages come from :func:`_config` by dtype and
``BLOCK_D``; every configuration it can return is compiled ahead of time for sm_80 and sm_90 by
``ds4sci bench kernels-aot`` (shared memory, registers, spills), which the tests check. The tile choice does not
query the GPU, so the same path runs under ``TRITON_INTERPRET=1``.

Limitations:
- fp16, bf16 and fp32 inputs (fp32 matmuls are IEEE, never TF32); head dims 1..128 (``TRITON_MAX_HEAD_DIM`` in
  :mod:`ds4sci.kernels.backends`).
- The backward does more matmuls than a plain FlashAttention-2 backward: dQ is computed by its own kernel (no
  atomics) and the pair-bias gradient by a fifth kernel that recomputes ``QK^T`` and ``dO V^T`` once more.
- Within one (z, n, h) slice, tile offsets are 32-bit: ``BLOCK * stride`` must fit in int32; per-program base
  offsets are 64-bit.
- One flattened 1-D grid per kernel (tiles fastest), so ``Z * N * H`` has no 65535 grid-axis limit.

Validation. :func:`forward` and :func:`backward` trust the backend contract of :mod:`ds4sci.kernels.evoformer`
(canonical shapes, one dtype and device), which its public functions validate once per call; this module checks
only the domain of its tile table (dtype and head dim, in :func:`_config`), which every launch goes through.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .triton_common import (BLOCK_D_BUCKETS, LOG2E, Tiles, cast, dot, online_softmax_update, table_entry,
                            tile_bounds, tile_offsets)

# ----------------------------------------------------------------------------------------------------------
# Tile configuration
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelConfig:
    block_d: int  # head dim padded to a power of two >= 16
    fwd: Tiles
    bwd: Tiles  # shared by the preprocess, dK/dV, dQ and dpair kernels


# (fp32?, BLOCK_D) -> (forward tiles, backward tiles), chosen with ``ds4sci bench kernels-aot`` so that every kernel
# variant compiles for sm_80 and sm_90 within their shared memory (163 KB / 227 KB) and without spills (ptxas -v),
# both in the representative launch and in the launches OpenFold and OpenFold3 make (``--set callers``).
# - fp16/bf16 run tl.dot on tensor cores. The backward keeps more fp32 [BLOCK_M, BLOCK_N] tiles live (S, P, dP, dS)
#   plus dK/dV accumulators, so it takes 32 query rows from D = 32 on, and 8 warps at D = 128 (as the forward),
#   with one pipeline stage there (two spilled 20-32 bytes in the pair-bias gradient kernel on sm_90a).
# - BLOCK_D = 32 covers OpenFold's c = 32 heads and D = 24, whose q/k/v rows and permuted pair bias (key stride H)
#   cannot be loaded as vectors: one scalar load and address per element. There the forward takes 8 warps and the
#   backward 32 x 32 tiles; with 4 warps / 32 x 64 tiles ptxas spilled up to 260 bytes in those launches.
#   Tile pointers are a scalar base advanced per step plus loop-invariant 32-bit offsets, not 64-bit pointer
#   tiles: that alone took the spilling caller kernels from 24 to 16, the worst from 260 to 48 bytes.
# - fp32 is IEEE (no TF32), which Triton lowers to FMA loops holding whole operand rows in registers: registers grow
#   with BLOCK * D, hence small tiles, and one pipeline stage (the loop is FMA-bound; with two stages ptxas spilled,
#   kilobytes in the backward, a few bytes in the forward with a pair bias).
_TABLE: dict[tuple[bool, int], tuple[Tiles, Tiles]] = {
    (False, 16): (Tiles(64, 64, 4, 2), Tiles(64, 64, 4, 2)),
    (False, 32): (Tiles(64, 64, 8, 2), Tiles(32, 32, 4, 2)),
    (False, 64): (Tiles(64, 64, 4, 2), Tiles(32, 64, 4, 2)),
    (False, 128): (Tiles(64, 64, 8, 2), Tiles(32, 64, 8, 1)),
    (True, 16): (Tiles(64, 64, 4, 1), Tiles(32, 32, 4, 1)),
    (True, 32): (Tiles(32, 32, 4, 1), Tiles(32, 32, 4, 1)),
    (True, 64): (Tiles(32, 32, 4, 1), Tiles(16, 16, 4, 1)),
    (True, 128): (Tiles(16, 16, 4, 1), Tiles(16, 16, 4, 1)),
}
assert {d for _, d in _TABLE} == set(BLOCK_D_BUCKETS)  # one entry per head-dim bucket


def _config(dtype: torch.dtype, head_dim: int) -> KernelConfig:
    """Tiles, warps and stages for ``dtype`` and ``head_dim`` (see ``_TABLE``); the only tile heuristic."""
    block_d, (fwd, bwd) = table_entry(_TABLE, dtype, head_dim, "triton_evoformer")
    return KernelConfig(block_d=block_d, fwd=fwd, bwd=bwd)


# ----------------------------------------------------------------------------------------------------------
# @triton.jit helpers
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _split_pid(pid, S, N, H, BLOCK: tl.constexpr):
    """Flattened program id -> (start, z, n, h, znh), tiles of BLOCK rows of S fastest: the first row ``start`` of the
    program's tile, (z, n, h) as int64 and znh = (z * N + n) * H + h."""
    num_tiles = tl.cdiv(S, BLOCK)
    tile = pid % num_tiles
    znh = pid // num_tiles
    h = znh % H
    n = (znh // H) % N
    z = znh // (H * N)
    return tile * BLOCK, z.to(tl.int64), n.to(tl.int64), h.to(tl.int64), znh.to(tl.int64)


@triton.jit
def _tile(X, z, n, h, start, stride_z, stride_n, stride_s, stride_h, stride_d, offs, offs_d):
    """Rows ``start + offs`` of x[z, n, :, h, :] (x ``[Z, N, S, H, D]``, columns ``offs_d``) as a scalar base pointer
    (64-bit offset) and loop-invariant 32-bit offsets ``[len(offs), BLOCK_D]``; a loop over tiles advances the base."""
    base = X + (z * stride_z + n * stride_n + h * stride_h + tl.cast(start, tl.int64) * stride_s)
    return base, offs[:, None] * stride_s + offs_d[None, :] * stride_d


@triton.jit
def _bias_offsets(z, n, h, start_m, start_n, rows, cols, stride_mz, stride_mn, stride_ms,
                  stride_pz, stride_ph, stride_pi, stride_pj):
    """Where the biases of query rows ``start_m + rows`` and key rows ``start_n + cols`` of (z, n, h) are: the mask
    row mask[z, n, start_n + cols] and the pair tile pair[z, h, start_m + rows, start_n + cols], each as a scalar
    64-bit base and loop-invariant 32-bit offsets (``[BLOCK_N]``, ``[BLOCK_M, BLOCK_N]``). An absent bias has zero
    strides (:func:`_bias_strides`), so its offsets are zeros, never read."""
    start_m, start_n = tl.cast(start_m, tl.int64), tl.cast(start_n, tl.int64)
    m_base = z * stride_mz + n * stride_mn + start_n * stride_ms
    p_base = z * stride_pz + h * stride_ph + start_m * stride_pi + start_n * stride_pj
    return m_base, cols * stride_ms, p_base, rows[:, None] * stride_pi + cols[None, :] * stride_pj


@triton.jit
def _mask_row(Mask, base, offs, key_ok, HAS_MASK: tl.constexpr):
    """The mask row ``[BLOCK_N]`` at ``Mask + base + offs`` as fp32 (0 on keys >= S; zeros without a mask)."""
    mask_row = tl.zeros(offs.shape, tl.float32)
    if HAS_MASK:
        mask_row = tl.load(Mask + base + offs, mask=key_ok, other=0.0).to(tl.float32)
    return mask_row


@triton.jit
def _pair_tile(Pair, base, offs, query_ok, key_ok, HAS_PAIR: tl.constexpr):
    """The pair tile ``[BLOCK_M, BLOCK_N]`` at ``Pair + base + offs`` as fp32 (0 outside S x S; zeros without a pair
    bias)."""
    pair_tile = tl.zeros(offs.shape, tl.float32)
    if HAS_PAIR:
        pair_tile = tl.load(Pair + base + offs, mask=query_ok[:, None] & key_ok[None, :], other=0.0).to(tl.float32)
    return pair_tile


@triton.jit
def _scores(q, k, sm_scale, mask_row, pair_tile, key_ok, HAS_MASK: tl.constexpr, HAS_PAIR: tl.constexpr):
    """Biased logits ``[BLOCK_M, BLOCK_N]`` in fp32: ``(q k^T * scale + mask) + pair``, -inf on keys >= S.

    q ``[BLOCK_M, BLOCK_D]``, k ``[BLOCK_N, BLOCK_D]``, mask_row ``[BLOCK_N]`` and pair_tile ``[BLOCK_M, BLOCK_N]``
    already loaded as fp32 (ignored when the matching flag is off).
    """
    s = dot(q, tl.trans(k)) * sm_scale
    if HAS_MASK:
        s = s + mask_row[None, :]
    if HAS_PAIR:
        s = s + pair_tile
    return tl.where(key_ok[None, :], s, float("-inf"))


@triton.jit
def _key_tile(q, k_ptrs, v_ptrs, Mask, m_base, m_offs, Pair, p_base, p_offs, query_ok, key_ok, d_ok, sm_scale,
              HAS_MASK: tl.constexpr, HAS_PAIR: tl.constexpr):
    """One step of a resident query tile's loop over key tiles (forward and dQ): k and v ``[BLOCK_N, BLOCK_D]`` read
    at ``k_ptrs`` / ``v_ptrs``, and the biased logits ``s [BLOCK_M, BLOCK_N]`` with the biases at these offsets."""
    kd_ok = key_ok[:, None] & d_ok[None, :]
    k = tl.load(k_ptrs, mask=kd_ok, other=0.0)
    v = tl.load(v_ptrs, mask=kd_ok, other=0.0)
    mask_row = _mask_row(Mask, m_base, m_offs, key_ok, HAS_MASK)
    pair_tile = _pair_tile(Pair, p_base, p_offs, query_ok, key_ok, HAS_PAIR)
    return k, v, _scores(q, k, sm_scale, mask_row, pair_tile, key_ok, HAS_MASK, HAS_PAIR)


@triton.jit
def _load_stats(stats_ptrs, ok):
    """Row max m and ``1 / l`` ``[BLOCK_M]`` from stats rows ``(m, l)`` (fp32); rows past S get m = +inf (P = 0)."""
    row_max = tl.load(stats_ptrs, mask=ok, other=float("inf"))
    inv_sum = 1.0 / tl.load(stats_ptrs + 1, mask=ok, other=1.0)  # l = +inf (fully -inf row): 0
    return row_max, inv_sum


@triton.jit
def _probs(s, row_max, inv_sum):
    """P = exp(s - m) / l as ``exp2((s - m) * log2 e) * (1 / l)``: the max is subtracted before any scaling and the
    exponent has no addend, so no fused multiply-add of the (possibly huge) max feeds ``exp2``. m = l = +inf (fully
    -inf row) gives exact zeros."""
    return tl.math.exp2((s - row_max[:, None]) * LOG2E) * inv_sum[:, None]


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _fwd_kernel(
    Q, K, V, Mask, Pair, O, Stats,
    stride_qz, stride_qn, stride_qs, stride_qh, stride_qd,
    stride_kz, stride_kn, stride_ks, stride_kh, stride_kd,
    stride_vz, stride_vn, stride_vs, stride_vh, stride_vd,
    stride_oz, stride_on, stride_os, stride_oh, stride_od,
    stride_mz, stride_mn, stride_ms,
    stride_pz, stride_ph, stride_pi, stride_pj,
    N, H, S, D, sm_scale,
    HAS_MASK: tl.constexpr, HAS_PAIR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program: a tile of BLOCK_M queries of one (z, n, h); loops over key tiles with an online softmax."""
    start_m, z, n, h, znh = _split_pid(tl.program_id(0), S, N, H, BLOCK_M)
    rows, cols, offs_d, d_ok = tile_offsets(D, BLOCK_M, BLOCK_N, BLOCK_D)
    query_ok, qd_ok = tile_bounds(start_m + rows, S, d_ok)  # [BLOCK_M], [BLOCK_M, BLOCK_D]

    # q[z, n, start_m:, h, :] as a [BLOCK_M, BLOCK_D] tile, resident for the whole loop
    q_ptr, q_offs = _tile(Q, z, n, h, start_m, stride_qz, stride_qn, stride_qs, stride_qh, stride_qd, rows, offs_d)
    q = tl.load(q_ptr + q_offs, mask=qd_ok, other=0.0)
    # At key tile 0, advanced by BLOCK_N keys per step: [BLOCK_N, BLOCK_D] tiles of k[z, n, :, h, :] and v, the
    # [BLOCK_N] row of mask[z, n, :] and the [BLOCK_M, BLOCK_N] tile of pair[z, h, start_m:, :] (the same for every n)
    k_ptr, k_offs = _tile(K, z, n, h, 0, stride_kz, stride_kn, stride_ks, stride_kh, stride_kd, cols, offs_d)
    v_ptr, v_offs = _tile(V, z, n, h, 0, stride_vz, stride_vn, stride_vs, stride_vh, stride_vd, cols, offs_d)
    m_base, m_offs, p_base, p_offs = _bias_offsets(z, n, h, start_m, 0, rows, cols, stride_mz, stride_mn, stride_ms,
                                                   stride_pz, stride_ph, stride_pi, stride_pj)

    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max (natural units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running row sum of exp(s - m_i)
    for start_n in range(0, S, BLOCK_N):
        k, v, s = _key_tile(q, k_ptr + k_offs, v_ptr + v_offs, Mask, m_base, m_offs, Pair, p_base, p_offs, query_ok,
                            start_n + cols < S, d_ok, sm_scale, HAS_MASK, HAS_PAIR)  # s [BLOCK_M, BLOCK_N]
        m_i, l_i, acc = online_softmax_update(s, v, m_i, l_i, acc)
        k_ptr += BLOCK_N * stride_ks
        v_ptr += BLOCK_N * stride_vs
        m_base += BLOCK_N * stride_ms
        p_base += BLOCK_N * stride_pj

    empty = l_i == 0.0  # every key -inf: output zeros, stats (+inf, +inf)
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    row_max = tl.where(empty, float("inf"), m_i)
    row_sum = tl.where(empty, float("inf"), l_i)  # kept apart from m: m + log l would round log l away
    o_ptr, o_offs = _tile(O, z, n, h, start_m, stride_oz, stride_on, stride_os, stride_oh, stride_od, rows, offs_d)
    tl.store(o_ptr + o_offs, cast(o, O.dtype.element_ty), mask=qd_ok)
    stats_ptrs = Stats + (znh * S + start_m + rows) * 2  # stats [Z, N, H, S, 2], contiguous
    tl.store(stats_ptrs, row_max, mask=query_ok)
    tl.store(stats_ptrs + 1, row_sum, mask=query_ok)


@triton.jit
def _bwd_preprocess_kernel(
    O, DO, Delta,
    stride_oz, stride_on, stride_os, stride_oh, stride_od,
    stride_doz, stride_don, stride_dos, stride_doh, stride_dod,
    N, H, S, D,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """delta[z, n, h, i] = sum_d dO * O in fp32 (the softmax-backward row term of FlashAttention-2)."""
    start_m, z, n, h, znh = _split_pid(tl.program_id(0), S, N, H, BLOCK_M)
    rows = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    query_ok, qd_ok = tile_bounds(start_m + rows, S, d_ok)
    o_ptr, o_offs = _tile(O, z, n, h, start_m, stride_oz, stride_on, stride_os, stride_oh, stride_od, rows, offs_d)
    do_ptr, do_offs = _tile(DO, z, n, h, start_m, stride_doz, stride_don, stride_dos, stride_doh, stride_dod, rows,
                            offs_d)
    o = tl.load(o_ptr + o_offs, mask=qd_ok, other=0.0)
    do = tl.load(do_ptr + do_offs, mask=qd_ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # [BLOCK_M]
    tl.store(Delta + znh * S + start_m + rows, delta, mask=query_ok)


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, Mask, Pair, DO, Stats, Delta, DK, DV, DMaskPart,
    stride_qz, stride_qn, stride_qs, stride_qh, stride_qd,
    stride_kz, stride_kn, stride_ks, stride_kh, stride_kd,
    stride_vz, stride_vn, stride_vs, stride_vh, stride_vd,
    stride_doz, stride_don, stride_dos, stride_doh, stride_dod,
    stride_dkz, stride_dkn, stride_dks, stride_dkh, stride_dkd,
    stride_dvz, stride_dvn, stride_dvs, stride_dvh, stride_dvd,
    stride_mz, stride_mn, stride_ms,
    stride_pz, stride_ph, stride_pi, stride_pj,
    N, H, S, D, sm_scale,
    HAS_MASK: tl.constexpr, HAS_PAIR: tl.constexpr, MASK_GRAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program: a tile of BLOCK_N keys of one (z, n, h); loops over query tiles, recomputing P from the stats.

    Writes dK, dV and, with MASK_GRAD, this head's share of the mask-bias gradient ``sum_i dS[i, j]`` into
    ``DMaskPart [Z, N, H, S]`` (summed over H by the launcher: no atomics, deterministic).
    """
    tl.static_assert(HAS_MASK or not MASK_GRAD, "MASK_GRAD needs HAS_MASK")
    start_n, z, n, h, znh = _split_pid(tl.program_id(0), S, N, H, BLOCK_N)
    rows, cols, offs_d, d_ok = tile_offsets(D, BLOCK_M, BLOCK_N, BLOCK_D)
    key_ok, kd_ok = tile_bounds(start_n + cols, S, d_ok)  # [BLOCK_N], [BLOCK_N, BLOCK_D]

    # k[z, n, start_n:, h, :] and v as [BLOCK_N, BLOCK_D] tiles, resident for the whole loop
    k_ptr, k_offs = _tile(K, z, n, h, start_n, stride_kz, stride_kn, stride_ks, stride_kh, stride_kd, cols, offs_d)
    v_ptr, v_offs = _tile(V, z, n, h, start_n, stride_vz, stride_vn, stride_vs, stride_vh, stride_vd, cols, offs_d)
    k = tl.load(k_ptr + k_offs, mask=kd_ok, other=0.0)
    v = tl.load(v_ptr + v_offs, mask=kd_ok, other=0.0)
    # The [BLOCK_N] row of mask[z, n, start_n:], fixed for this program, and the [BLOCK_M, BLOCK_N] tile of
    # pair[z, h, :, start_n:] at query tile 0, advanced by BLOCK_M rows per step
    m_base, m_offs, p_base, p_offs = _bias_offsets(z, n, h, 0, start_n, rows, cols, stride_mz, stride_mn, stride_ms,
                                                   stride_pz, stride_ph, stride_pi, stride_pj)
    mask_row = _mask_row(Mask, m_base, m_offs, key_ok, HAS_MASK)
    # [BLOCK_M, BLOCK_D] tiles of q[z, n, :, h, :] and dO at query tile 0; stats and delta rows [BLOCK_M]
    q_ptr, q_offs = _tile(Q, z, n, h, 0, stride_qz, stride_qn, stride_qs, stride_qh, stride_qd, rows, offs_d)
    do_ptr, do_offs = _tile(DO, z, n, h, 0, stride_doz, stride_don, stride_dos, stride_doh, stride_dod, rows, offs_d)
    stats_ptr = Stats + znh * S * 2
    delta_ptr = Delta + znh * S

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dmask = tl.zeros([BLOCK_N], tl.float32)
    for start_m in range(0, S, BLOCK_M):
        query_ok, qd_ok = tile_bounds(start_m + rows, S, d_ok)
        q = tl.load(q_ptr + q_offs, mask=qd_ok, other=0.0)
        do = tl.load(do_ptr + do_offs, mask=qd_ok, other=0.0)
        row_max, inv_sum = _load_stats(stats_ptr + rows * 2, query_ok)  # m = +inf: P = 0 on rows past S
        delta = tl.load(delta_ptr + rows, mask=query_ok, other=0.0)
        pair_tile = _pair_tile(Pair, p_base, p_offs, query_ok, key_ok, HAS_PAIR)
        s = _scores(q, k, sm_scale, mask_row, pair_tile, key_ok, HAS_MASK, HAS_PAIR)  # [BLOCK_M, BLOCK_N]
        p = _probs(s, row_max, inv_sum)  # exact 0 on fully -inf rows
        dv += dot(tl.trans(cast(p, do.dtype)), do)  # [BLOCK_N, BLOCK_M] @ [BLOCK_M, BLOCK_D]
        dp = dot(do, tl.trans(v))  # [BLOCK_M, BLOCK_D] @ [BLOCK_D, BLOCK_N]
        ds = p * (dp - delta[:, None])  # gradient of the logits s
        dk += dot(tl.trans(cast(ds, q.dtype)), q)  # [BLOCK_N, BLOCK_M] @ [BLOCK_M, BLOCK_D]
        if MASK_GRAD:
            dmask += tl.sum(ds, 0)
        q_ptr += BLOCK_M * stride_qs
        do_ptr += BLOCK_M * stride_dos
        stats_ptr += 2 * BLOCK_M
        delta_ptr += BLOCK_M
        p_base += BLOCK_M * stride_pi

    dk_ptr, dk_offs = _tile(DK, z, n, h, start_n, stride_dkz, stride_dkn, stride_dks, stride_dkh, stride_dkd, cols,
                            offs_d)
    dv_ptr, dv_offs = _tile(DV, z, n, h, start_n, stride_dvz, stride_dvn, stride_dvs, stride_dvh, stride_dvd, cols,
                            offs_d)
    tl.store(dk_ptr + dk_offs, cast(dk * sm_scale, DK.dtype.element_ty), mask=kd_ok)
    tl.store(dv_ptr + dv_offs, cast(dv, DV.dtype.element_ty), mask=kd_ok)
    if MASK_GRAD:
        tl.store(DMaskPart + znh * S + start_n + cols, dmask, mask=key_ok)  # [Z, N, H, S], contiguous


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, Mask, Pair, DO, Stats, Delta, DQ,
    stride_qz, stride_qn, stride_qs, stride_qh, stride_qd,
    stride_kz, stride_kn, stride_ks, stride_kh, stride_kd,
    stride_vz, stride_vn, stride_vs, stride_vh, stride_vd,
    stride_doz, stride_don, stride_dos, stride_doh, stride_dod,
    stride_dqz, stride_dqn, stride_dqs, stride_dqh, stride_dqd,
    stride_mz, stride_mn, stride_ms,
    stride_pz, stride_ph, stride_pi, stride_pj,
    N, H, S, D, sm_scale,
    HAS_MASK: tl.constexpr, HAS_PAIR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program: a tile of BLOCK_M queries of one (z, n, h); loops over key tiles: dQ = dS K / sqrt(D)."""
    start_m, z, n, h, znh = _split_pid(tl.program_id(0), S, N, H, BLOCK_M)
    rows, cols, offs_d, d_ok = tile_offsets(D, BLOCK_M, BLOCK_N, BLOCK_D)
    query_ok, qd_ok = tile_bounds(start_m + rows, S, d_ok)  # [BLOCK_M], [BLOCK_M, BLOCK_D]

    # q[z, n, start_m:, h, :] and dO as [BLOCK_M, BLOCK_D] tiles; stats and delta rows [BLOCK_M]
    q_ptr, q_offs = _tile(Q, z, n, h, start_m, stride_qz, stride_qn, stride_qs, stride_qh, stride_qd, rows, offs_d)
    do_ptr, do_offs = _tile(DO, z, n, h, start_m, stride_doz, stride_don, stride_dos, stride_doh, stride_dod, rows,
                            offs_d)
    q = tl.load(q_ptr + q_offs, mask=qd_ok, other=0.0)
    do = tl.load(do_ptr + do_offs, mask=qd_ok, other=0.0)
    row_max, inv_sum = _load_stats(Stats + (znh * S + start_m + rows) * 2, query_ok)
    delta = tl.load(Delta + znh * S + start_m + rows, mask=query_ok, other=0.0)
    # At key tile 0, advanced by BLOCK_N keys per step: k, v, mask and pair tiles as in the forward kernel
    k_ptr, k_offs = _tile(K, z, n, h, 0, stride_kz, stride_kn, stride_ks, stride_kh, stride_kd, cols, offs_d)
    v_ptr, v_offs = _tile(V, z, n, h, 0, stride_vz, stride_vn, stride_vs, stride_vh, stride_vd, cols, offs_d)
    m_base, m_offs, p_base, p_offs = _bias_offsets(z, n, h, start_m, 0, rows, cols, stride_mz, stride_mn, stride_ms,
                                                   stride_pz, stride_ph, stride_pi, stride_pj)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, S, BLOCK_N):
        k, v, s = _key_tile(q, k_ptr + k_offs, v_ptr + v_offs, Mask, m_base, m_offs, Pair, p_base, p_offs, query_ok,
                            start_n + cols < S, d_ok, sm_scale, HAS_MASK, HAS_PAIR)  # s [BLOCK_M, BLOCK_N]
        p = _probs(s, row_max, inv_sum)
        dp = dot(do, tl.trans(v))  # [BLOCK_M, BLOCK_D] @ [BLOCK_D, BLOCK_N]
        ds = p * (dp - delta[:, None])
        dq += dot(cast(ds, k.dtype), k)  # [BLOCK_M, BLOCK_N] @ [BLOCK_N, BLOCK_D]
        k_ptr += BLOCK_N * stride_ks
        v_ptr += BLOCK_N * stride_vs
        m_base += BLOCK_N * stride_ms
        p_base += BLOCK_N * stride_pj

    dq_ptr, dq_offs = _tile(DQ, z, n, h, start_m, stride_dqz, stride_dqn, stride_dqs, stride_dqh, stride_dqd, rows,
                            offs_d)
    tl.store(dq_ptr + dq_offs, cast(dq * sm_scale, DQ.dtype.element_ty), mask=qd_ok)


@triton.jit
def _bwd_dpair_kernel(
    Q, K, V, Mask, Pair, DO, Stats, Delta, DPair,
    stride_qz, stride_qn, stride_qs, stride_qh, stride_qd,
    stride_kz, stride_kn, stride_ks, stride_kh, stride_kd,
    stride_vz, stride_vn, stride_vs, stride_vh, stride_vd,
    stride_doz, stride_don, stride_dos, stride_doh, stride_dod,
    stride_mz, stride_mn, stride_ms,
    stride_pz, stride_ph, stride_pi, stride_pj,
    N, H, S, D, sm_scale, n_chunk,
    HAS_MASK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Partial pair-bias gradients ``DPair[z, h, c, i, j] = sum_{n in chunk c} dS[z, n, h, i, j]``.

    One program per (z, h, chunk c of ``n_chunk`` consecutive n, query tile, key tile), looping over its n with the
    sum in fp32 registers and a single store (no atomics; the launcher sums the chunks in a fixed order)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(S, BLOCK_M)
    num_n = tl.cdiv(S, BLOCK_N)
    num_c = tl.cdiv(N, n_chunk)
    tile_n = pid % num_n  # key tiles fastest, then query tiles, then chunks, then (z, h)
    tile_m = (pid // num_n) % num_m
    zhc = pid // (num_n * num_m)  # (z * H + h) * num_c + c
    c = zhc % num_c
    h = ((zhc // num_c) % H).to(tl.int64)
    z = (zhc // (num_c * H)).to(tl.int64)
    n_start = c * n_chunk
    steps = tl.minimum(n_chunk, N - n_start)
    n_start = n_start.to(tl.int64)
    zhc = zhc.to(tl.int64)
    start_m = (tile_m * BLOCK_M).to(tl.int64)
    start_n = (tile_n * BLOCK_N).to(tl.int64)
    rows, cols, offs_d, d_ok = tile_offsets(D, BLOCK_M, BLOCK_N, BLOCK_D)
    query_ok, qd_ok = tile_bounds(start_m + rows, S, d_ok)  # [BLOCK_M], [BLOCK_M, BLOCK_D]
    key_ok, kd_ok = tile_bounds(start_n + cols, S, d_ok)  # [BLOCK_N], [BLOCK_N, BLOCK_D]

    # The [BLOCK_M, BLOCK_N] tile of pair[z, h, start_m:, start_n:], the same for every n: loaded once; the [BLOCK_N]
    # row of mask[z, n, start_n:] at n = n_start, advanced by one n per step
    m_base, m_offs, p_base, p_offs = _bias_offsets(z, n_start, h, start_m, start_n, rows, cols, stride_mz, stride_mn,
                                                   stride_ms, stride_pz, stride_ph, stride_pi, stride_pj)
    pair_tile = _pair_tile(Pair, p_base, p_offs, query_ok, key_ok, True)
    # Tiles of q, dO [BLOCK_M, BLOCK_D] and k, v [BLOCK_N, BLOCK_D] at n = n_start, advanced by one n per step:
    # scalar base pointers plus loop-invariant 32-bit offsets
    q_ptr, q_offs = _tile(Q, z, n_start, h, start_m, stride_qz, stride_qn, stride_qs, stride_qh, stride_qd, rows,
                          offs_d)
    do_ptr, do_offs = _tile(DO, z, n_start, h, start_m, stride_doz, stride_don, stride_dos, stride_doh, stride_dod,
                            rows, offs_d)
    k_ptr, k_offs = _tile(K, z, n_start, h, start_n, stride_kz, stride_kn, stride_ks, stride_kh, stride_kd, cols,
                          offs_d)
    v_ptr, v_offs = _tile(V, z, n_start, h, start_n, stride_vz, stride_vn, stride_vs, stride_vh, stride_vd, cols,
                          offs_d)
    # delta [Z, N, H, S] and stats [Z, N, H, S, 2] (contiguous): rows of (z, n, h) start at ((z * N + n) * H + h) * S
    row0 = ((z * N + n_start) * H + h) * S + start_m
    stats_ptr = Stats + row0 * 2
    delta_ptr = Delta + row0

    dpair = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, steps):
        q = tl.load(q_ptr + q_offs, mask=qd_ok, other=0.0)
        do = tl.load(do_ptr + do_offs, mask=qd_ok, other=0.0)
        k = tl.load(k_ptr + k_offs, mask=kd_ok, other=0.0)
        v = tl.load(v_ptr + v_offs, mask=kd_ok, other=0.0)
        row_max, inv_sum = _load_stats(stats_ptr + rows * 2, query_ok)
        delta = tl.load(delta_ptr + rows, mask=query_ok, other=0.0)
        mask_row = _mask_row(Mask, m_base, m_offs, key_ok, HAS_MASK)
        s = _scores(q, k, sm_scale, mask_row, pair_tile, key_ok, HAS_MASK, True)  # [BLOCK_M, BLOCK_N]
        p = _probs(s, row_max, inv_sum)
        dp = dot(do, tl.trans(v))
        dpair += p * (dp - delta[:, None])  # dS of this n
        q_ptr += stride_qn
        do_ptr += stride_don
        k_ptr += stride_kn
        v_ptr += stride_vn
        stats_ptr += 2 * H * S
        delta_ptr += H * S
        m_base += stride_mn

    # DPair [Z, H, C, S, S] fp32, contiguous
    out_base = zhc * S * S + start_m * S + start_n
    tl.store(DPair + out_base + rows[:, None] * S + cols[None, :], dpair, mask=query_ok[:, None] & key_ok[None, :])


# ----------------------------------------------------------------------------------------------------------
# Launchers: tile configuration, grids and arguments
# ----------------------------------------------------------------------------------------------------------


def _bias_strides(mask: Optional[Tensor], pair: Optional[Tensor]) -> tuple[int, ...]:
    """Mask strides (z, n, s) then pair strides (z, h, i, j); zeros for an absent bias."""
    return (*(mask.stride() if mask is not None else (0, 0, 0)), *(pair.stride() if pair is not None else (0, 0, 0, 0)))


#: The pair-bias gradient kernel splits N into chunks until its grid has about this many programs: about 4 waves of
#: 2 programs per SM on an H100 (132 SMs). Extra-MSA attention (Z = 1, H = 8, S = 384, tiles 64 x 64) has 288
#: (z, h, tile) programs, under one wave, each looping over N = 5120 rows; 4 chunks of 1280 give 1152 programs.
DPAIR_TARGET_PROGRAMS = 1024
#: ... but a chunk keeps at least this many n, so that loading the pair tile and storing the partial sum stay small
#: next to the chunk's work.
DPAIR_MIN_CHUNK = 16


def dpair_chunk(z: int, n: int, h: int, s: int, tiles: Tiles) -> int:
    """Rows of N per pair-bias gradient program (a function of the shape only: same split, same bits, every run).

    The chunks' fp32 partial sums ``[Z, H, C, S, S]`` (C = ceil(N / chunk)) are an extra buffer only when C > 1,
    which happens only when the unsplit grid ``Z * H * (S / BLOCK_M) * (S / BLOCK_N)`` is below
    :data:`DPAIR_TARGET_PROGRAMS`; then C <= ceil(target / grid), so the buffer holds fewer than
    ``2 * DPAIR_TARGET_PROGRAMS`` tiles of ``BLOCK_M x BLOCK_N`` fp32: at most 32 MiB (64 x 64 tiles), 18 MiB at
    extra-MSA shapes.
    """
    programs = z * h * triton.cdiv(s, tiles.block_m) * triton.cdiv(s, tiles.block_n)
    chunks = max(1, min(triton.cdiv(DPAIR_TARGET_PROGRAMS, programs), n // DPAIR_MIN_CHUNK))
    return triton.cdiv(n, chunks)


def fwd_launch(
    q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], pair: Optional[Tensor], o: Tensor, stats: Tensor
):
    """(grid, positional args, constexpr/launch kwargs) of the forward kernel; shared with the AOT compile gate."""
    z, n, s, h, d = q.shape
    cfg = _config(q.dtype, d)
    t = cfg.fwd
    args = (
        q, k, v, mask, pair, o, stats,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(), *_bias_strides(mask, pair),
        n, h, s, d, 1.0 / math.sqrt(d),
    )
    meta = dict(
        HAS_MASK=mask is not None, HAS_PAIR=pair is not None,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_D=cfg.block_d, **t.launch_options(),
    )
    return (triton.cdiv(s, t.block_m) * z * n * h,), args, meta


def bwd_launches(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, stats: Tensor, mask: Optional[Tensor], pair: Optional[Tensor],
    delta: Tensor, dq: Tensor, dk: Tensor, dv: Tensor, dmask_part: Optional[Tensor], dpair_part: Optional[Tensor],
) -> list:
    """[(kernel, grid, args, meta)] of the backward in launch order; shared with the AOT compile gate.

    ``dpair_part``: the pair-bias gradient kernel's output, fp32 ``[Z, H, C, S, S]`` with ``C`` chunks of
    :func:`dpair_chunk` rows of N (None: no pair-bias gradient)."""
    z, n, s, h, d = q.shape
    cfg = _config(q.dtype, d)
    t = cfg.bwd
    scale = 1.0 / math.sqrt(d)
    dims = (n, h, s, d)
    common = dict(BLOCK_D=cfg.block_d, **t.launch_options())
    tiles = dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n)
    bias_flags = dict(HAS_MASK=mask is not None, HAS_PAIR=pair is not None)
    bias_strides = _bias_strides(mask, pair)
    qkvdo_strides = (*q.stride(), *k.stride(), *v.stride(), *do.stride())
    num_m, num_n = triton.cdiv(s, t.block_m), triton.cdiv(s, t.block_n)
    launches = [
        (_bwd_preprocess_kernel, (num_m * z * n * h,), (o, do, delta, *o.stride(), *do.stride(), *dims),
         dict(BLOCK_M=t.block_m, **common)),
        (_bwd_dkdv_kernel, (num_n * z * n * h,),
         (q, k, v, mask, pair, do, stats, delta, dk, dv, dmask_part, *qkvdo_strides, *dk.stride(), *dv.stride(),
          *bias_strides, *dims, scale),
         dict(**bias_flags, MASK_GRAD=dmask_part is not None, **tiles, **common)),
        (_bwd_dq_kernel, (num_m * z * n * h,),
         (q, k, v, mask, pair, do, stats, delta, dq, *qkvdo_strides, *dq.stride(), *bias_strides, *dims, scale),
         dict(**bias_flags, **tiles, **common)),
    ]
    if dpair_part is not None:
        n_chunk = dpair_chunk(z, n, h, s, t)
        chunks = triton.cdiv(n, n_chunk)
        assert dpair_part.shape == (z, h, chunks, s, s) and dpair_part.is_contiguous(), dpair_part.shape
        launches.append(
            (_bwd_dpair_kernel, (num_m * num_n * chunks * z * h,),
             (q, k, v, mask, pair, do, stats, delta, dpair_part, *qkvdo_strides, *bias_strides, *dims, scale, n_chunk),
             dict(HAS_MASK=mask is not None, **tiles, **common))
        )
    return launches


# ----------------------------------------------------------------------------------------------------------
# Backend contract (see ds4sci.kernels.evoformer)
# ----------------------------------------------------------------------------------------------------------


def forward(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], pair: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """Backend contract ``forward``: o ``[Z, N, S, H, D]`` in q's dtype and stats ``[Z, N, H, S, 2]`` fp32 (row max
    m of the biased logits and row sum ``l = sum_j exp(s_j - m)``; ``(+inf, +inf)`` on fully ``-inf`` rows).

    q, k, v may be arbitrary strided views; mask ``[Z, N, S]`` and pair ``[Z, H, S, S]`` (any floating dtype,
    stride 0 on broadcast dims) are read in place. Inputs are not re-validated (see the module docstring).
    """
    z, n, s, h, _ = q.shape
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [Z, N, S, H, D]
    stats = torch.empty((z, n, h, s, 2), dtype=torch.float32, device=q.device)  # [Z, N, H, S, (max, sum)]
    grid, args, meta = fwd_launch(q, k, v, mask, pair, o, stats)
    _fwd_kernel[grid](*args, **meta)
    return o, stats


def backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, stats: Tensor, mask: Optional[Tensor],
             pair: Optional[Tensor], need_mask_grad: bool,
             need_pair_grad: bool) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """The backend contract's ``backward`` (:mod:`ds4sci.kernels.evoformer`) with the module docstring's four kernels;
    a bias gradient is also None when its bias is. stats is :func:`forward`'s (not re-validated)."""
    z, n, s, h, _ = q.shape
    stats = stats.contiguous()  # the kernels index stats [Z, N, H, S, 2] and delta [Z, N, H, S] as contiguous
    need_mask_grad = need_mask_grad and mask is not None
    need_pair_grad = need_pair_grad and pair is not None
    delta = torch.empty((z, n, h, s), dtype=torch.float32, device=q.device)  # [Z, N, H, S] fp32
    dq, dk, dv = (torch.empty(q.shape, dtype=q.dtype, device=q.device) for _ in range(3))  # [Z, N, S, H, D]
    dmask_part = torch.empty((z, n, h, s), dtype=torch.float32, device=q.device) if need_mask_grad else None
    dpair_part = None
    if need_pair_grad:  # [Z, H, C, S, S] fp32: one partial sum per chunk of N
        chunks = triton.cdiv(n, dpair_chunk(z, n, h, s, _config(q.dtype, q.shape[-1]).bwd))
        dpair_part = torch.empty((z, h, chunks, s, s), dtype=torch.float32, device=q.device)
    launches = bwd_launches(do, q, k, v, o, stats, mask, pair, delta, dq, dk, dv, dmask_part, dpair_part)
    for kernel, grid, args, meta in launches:
        kernel[grid](*args, **meta)
    # Per-head mask partials [Z, N, H, S] -> [Z, N, S] and per-chunk pair partials [Z, H, C, S, S] -> [Z, H, S, S]:
    # reductions over a fixed dimension with no atomics, the same bits on every run
    dmask = dmask_part.sum(dim=2) if need_mask_grad else None
    dpair = (dpair_part.sum(dim=2) if dpair_part.shape[2] > 1 else dpair_part[:, :, 0]) if need_pair_grad else None
    return dq, dk, dv, dmask, dpair
