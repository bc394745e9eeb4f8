"""The "triton" backend: fused Evoformer attention in Triton, forward and recomputing backward.

Algorithm: FlashAttention-2 (Dao 2023, Algorithms 1 and 2), the tiled online softmax of Rabe & Staats 2021
("Self-attention does not need O(n^2) memory") and Milakov & Gimelshein 2018, with the two Evoformer biases fused.
For one (z, n, h) and a tile of queries the forward kernel loops over key tiles and forms in registers

    s = (q k^T / sqrt(D) + mask[z, n, j]) + pair[z, h, i, j]     (fp32; the order every backend uses)

The mask row ``[Z, N, S]`` and pair tile ``[Z, H, S, S]`` are read through their strides (broadcast dims never
materialised; one pair tile serves every n). Stored: O and ``stats [Z, N, H, S, 2]`` fp32, the row max m and row sum
l kept apart, because ``m + log l`` in fp32 loses ``log l`` when |m| is huge (OpenFold's ``-1e9`` mask: spacing 64)
and a fully masked row would be recomputed as P = 1 instead of 1/S. The exponent arithmetic (no fused multiply-add
of a scaled max reaches ``exp2``) is :func:`ds4sci.kernels.triton_common.online_softmax_update`'s; the backward forms
``P = exp2((s - m) * log2 e) * (1 / l)`` (:func:`_probs`). Per-program set-up (program ids, tile and bias pointers,
the key loop) is in the jit helpers shared by the kernels.

Backward (FlashAttention-2, Algorithm 2): ``_bwd_preprocess_kernel`` (``delta = rowsum(dO * O)``), ``_bwd_dkdv_kernel``
(per key tile: dK, dV and per-head mask-bias partials ``sum_i dS`` summed over H afterwards), ``_bwd_dq_kernel`` (per
query tile) and, for a pair-bias gradient, ``_bwd_dpair_kernel`` (per (z, h, chunk of N, tile pair), summing dS over
the chunk in registers; :func:`dpair_chunk` splits N only as far as needed to fill a GPU). No atomics: two backward
passes are bitwise equal. A row whose keys are all ``-inf`` gives zeros and stats ``(+inf, +inf)``, so P = 0 there.

Tiles: ``BLOCK_D`` is the head dim rounded up to a power of two >= 16 (columns past D masked); :func:`_config` gives
tiles, warps and stages, each entry compiled for sm_80 and sm_90 by ``ds4sci bench kernels-aot``. Limitations: fp16,
bf16, fp32 (IEEE), head dims 1..128; ``BLOCK * stride`` fits in int32 within a slice; the dQ and dpair kernels
recompute ``QK^T`` and ``dO V^T``. :func:`forward` and :func:`backward` trust :mod:`ds4sci.kernels.evoformer`'s
validation; this module checks only its tile table's domain.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .triton_common import BLOCK_D_BUCKETS
from .triton_common import LOG2E
from .triton_common import Tiles
from .triton_common import cast
from .triton_common import dot
from .triton_common import online_softmax_update
from .triton_common import table_entry
from .triton_common import tile_bounds
from .triton_common import tile_offsets

# ---- Tile configuration ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelConfig:
    block_d: int  # head dim padded to a power of two >= 16
    fwd: Tiles
    bwd: Tiles  # the preprocess, dK/dV (k, v resident, loops over query tiles) and dpair kernels
    dq: Tiles  # the dQ kernel: q, dO resident, loops over key tiles


# (fp32?, BLOCK_D) -> (forward, backward, dQ tiles), every kernel variant spill-free and within shared memory for
# sm_80 and sm_90 in the representative launch and OpenFold's/OpenFold3's (``ds4sci bench kernels-aot``).
# - fp16/bf16 (tensor cores): 32 query rows in the backward at D = 64 and 128; 8 warps, one stage at D = 128.
# - BLOCK_D = 32 (OpenFold's D = 24, c = 32): 64 resident rows stepping 32 at a time in every kernel, chosen on an
#   H200 (docs/performance/kernels.md): the forward 3x faster than 64 x 64 tiles of 8 warps; larger tiles were
#   faster still but spill on sm_80 in OpenFold's unaligned launches (D = 24, permuted rows).
# - fp32 is IEEE (no TF32), FMA loops holding whole operand rows in registers: small tiles, one pipeline stage.
_TABLE: dict[tuple[bool, int], tuple[Tiles, Tiles, Tiles]] = {
    (False, 16): (Tiles(64, 64, 4, 2), Tiles(64, 64, 4, 2), Tiles(64, 64, 4, 2)),
    (False, 32): (Tiles(64, 32, 4, 2), Tiles(32, 64, 4, 2), Tiles(64, 32, 4, 2)),
    (False, 64): (Tiles(64, 64, 4, 2), Tiles(32, 64, 4, 2), Tiles(32, 64, 4, 2)),
    (False, 128): (Tiles(64, 64, 8, 2), Tiles(32, 64, 8, 1), Tiles(32, 64, 8, 1)),
    (True, 16): (Tiles(64, 64, 4, 1), Tiles(32, 32, 4, 1), Tiles(32, 32, 4, 1)),
    (True, 32): (Tiles(32, 32, 4, 1), Tiles(32, 32, 4, 1), Tiles(32, 32, 4, 1)),
    (True, 64): (Tiles(32, 32, 4, 1), Tiles(16, 16, 4, 1), Tiles(16, 16, 4, 1)),
    (True, 128): (Tiles(16, 16, 4, 1), Tiles(16, 16, 4, 1), Tiles(16, 16, 4, 1)),
}
assert {d for _, d in _TABLE} == set(BLOCK_D_BUCKETS)  # one entry per head-dim bucket


def _config(dtype: torch.dtype, head_dim: int) -> KernelConfig:
    """Tiles, warps and stages for ``dtype`` and ``head_dim`` (see ``_TABLE``); the only tile heuristic."""
    block_d, tiles = table_entry(_TABLE, dtype, head_dim, "triton_evoformer")
    return KernelConfig(block_d, *tiles)


# ---- @triton.jit helpers -----------------------------------------------------------------------------------


@triton.jit
def _program(S, N, H, D, BLOCK: tl.constexpr, BLOCK_LOOP: tl.constexpr, BLOCK_D: tl.constexpr):
    """Set-up of a program over a resident tile of BLOCK rows of S (queries; keys in dK/dV) of one (z, n, h).

    The 1-D grid has tiles fastest (no 65535 grid-axis limit on Z * N * H). Returns the tile's first row ``start``,
    (z, n, h) as int64, znh = (z * N + n) * H + h, the resident and looped-over (BLOCK_LOOP) row offsets, the column
    offsets and columns < D (:func:`~ds4sci.kernels.triton_common.tile_offsets`), and the resident rows' masks
    ``[BLOCK]``, ``[BLOCK, BLOCK_D]``."""
    pid = tl.program_id(0)
    num_tiles = tl.cdiv(S, BLOCK)
    start = (pid % num_tiles) * BLOCK
    znh = pid // num_tiles
    h = znh % H
    n = (znh // H) % N
    z = znh // (H * N)
    offs, loop_offs, offs_d, d_ok = tile_offsets(D, BLOCK, BLOCK_LOOP, BLOCK_D)
    ok, xd_ok = tile_bounds(start + offs, S, d_ok)
    return (start, z.to(tl.int64), n.to(tl.int64), h.to(tl.int64), znh.to(tl.int64), offs, loop_offs, offs_d, d_ok,
            ok, xd_ok)


@triton.jit
def _tile(X, z, n, h, start, stride_z, stride_n, stride_s, stride_h, stride_d, offs, offs_d):
    """Rows ``start + offs`` of x[z, n, :, h, :] (x ``[Z, N, S, H, D]``, columns ``offs_d``) as a scalar base pointer
    (64-bit offset) and loop-invariant 32-bit offsets ``[len(offs), BLOCK_D]``; a loop over tiles advances the base."""
    base = X + (z * stride_z + n * stride_n + h * stride_h + tl.cast(start, tl.int64) * stride_s)
    return base, offs[:, None] * stride_s + offs_d[None, :] * stride_d


@triton.jit
def _bias_offsets(z, n, h, start_m, start_n, rows, cols, stride_mz, stride_mn, stride_ms,
                  stride_pz, stride_ph, stride_pi, stride_pj):
    """The mask row mask[z, n, start_n + cols] and pair tile pair[z, h, start_m + rows, start_n + cols], each as a
    64-bit base and loop-invariant 32-bit offsets (``[BLOCK_N]``, ``[BLOCK_M, BLOCK_N]``); an absent bias has zero
    strides (:func:`_bias_strides`): offsets zero, never read."""
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
    """The pair tile ``[BLOCK_M, BLOCK_N]`` at ``Pair + base + offs`` as fp32 (0 outside S x S; zeros without one)."""
    pair_tile = tl.zeros(offs.shape, tl.float32)
    if HAS_PAIR:
        pair_tile = tl.load(Pair + base + offs, mask=query_ok[:, None] & key_ok[None, :], other=0.0).to(tl.float32)
    return pair_tile


@triton.jit
def _scores(q, k, sm_scale, mask_row, pair_tile, key_ok, HAS_MASK: tl.constexpr, HAS_PAIR: tl.constexpr):
    """Biased logits ``[BLOCK_M, BLOCK_N]`` in fp32: ``(q k^T * scale + mask) + pair``, -inf on keys >= S; mask_row
    ``[BLOCK_N]`` and pair_tile ``[BLOCK_M, BLOCK_N]`` loaded as fp32 (ignored when the matching flag is off)."""
    s = dot(q, tl.trans(k)) * sm_scale
    if HAS_MASK:
        s = s + mask_row[None, :]
    if HAS_PAIR:
        s = s + pair_tile
    return tl.where(key_ok[None, :], s, float("-inf"))


@triton.jit
def _key_loop(K, V, z, n, h, start_m, rows, cols, offs_d,
              stride_kz, stride_kn, stride_ks, stride_kh, stride_kd,
              stride_vz, stride_vn, stride_vs, stride_vh, stride_vd,
              stride_mz, stride_mn, stride_ms, stride_pz, stride_ph, stride_pi, stride_pj):
    """Set-up of a resident query tile's loop over key tiles (forward, dQ), at key tile 0 (advanced by
    :func:`_next_key_tile`): ``[BLOCK_N, BLOCK_D]`` tiles of k[z, n, :, h, :] and v (:func:`_tile`), the ``[BLOCK_N]``
    row of mask[z, n, :] and the ``[BLOCK_M, BLOCK_N]`` tile of pair[z, h, start_m:, :] (:func:`_bias_offsets`)."""
    k_ptr, k_offs = _tile(K, z, n, h, 0, stride_kz, stride_kn, stride_ks, stride_kh, stride_kd, cols, offs_d)
    v_ptr, v_offs = _tile(V, z, n, h, 0, stride_vz, stride_vn, stride_vs, stride_vh, stride_vd, cols, offs_d)
    m_base, m_offs, p_base, p_offs = _bias_offsets(z, n, h, start_m, 0, rows, cols, stride_mz, stride_mn, stride_ms,
                                                   stride_pz, stride_ph, stride_pi, stride_pj)
    return k_ptr, k_offs, v_ptr, v_offs, m_base, m_offs, p_base, p_offs


@triton.jit
def _next_key_tile(k_ptr, v_ptr, m_base, p_base, stride_ks, stride_vs, stride_ms, stride_pj, BLOCK_N: tl.constexpr):
    """The bases of :func:`_key_loop` advanced by BLOCK_N keys."""
    return (k_ptr + BLOCK_N * stride_ks, v_ptr + BLOCK_N * stride_vs, m_base + BLOCK_N * stride_ms,
            p_base + BLOCK_N * stride_pj)


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
    """P = exp(s - m) / l as ``exp2((s - m) * log2 e) * (1 / l)``: no fused multiply-add of the (possibly huge) max
    feeds ``exp2``; m = l = +inf (fully -inf row) gives exact zeros."""
    return tl.math.exp2((s - row_max[:, None]) * LOG2E) * inv_sum[:, None]


# ---- Kernels -----------------------------------------------------------------------------------------------


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
    start_m, z, n, h, znh, rows, cols, offs_d, d_ok, query_ok, qd_ok = _program(S, N, H, D, BLOCK_M, BLOCK_N, BLOCK_D)
    # q[z, n, start_m:, h, :] as a [BLOCK_M, BLOCK_D] tile, resident for the whole loop
    q_ptr, q_offs = _tile(Q, z, n, h, start_m, stride_qz, stride_qn, stride_qs, stride_qh, stride_qd, rows, offs_d)
    q = tl.load(q_ptr + q_offs, mask=qd_ok, other=0.0)
    k_ptr, k_offs, v_ptr, v_offs, m_base, m_offs, p_base, p_offs = _key_loop(
        K, V, z, n, h, start_m, rows, cols, offs_d, stride_kz, stride_kn, stride_ks, stride_kh, stride_kd, stride_vz,
        stride_vn, stride_vs, stride_vh, stride_vd, stride_mz, stride_mn, stride_ms, stride_pz, stride_ph, stride_pi,
        stride_pj)

    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max (natural units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running row sum of exp(s - m_i)
    for start_n in range(0, S, BLOCK_N):
        k, v, s = _key_tile(q, k_ptr + k_offs, v_ptr + v_offs, Mask, m_base, m_offs, Pair, p_base, p_offs, query_ok,
                            start_n + cols < S, d_ok, sm_scale, HAS_MASK, HAS_PAIR)  # s [BLOCK_M, BLOCK_N]
        m_i, l_i, acc = online_softmax_update(s, v, m_i, l_i, acc)
        k_ptr, v_ptr, m_base, p_base = _next_key_tile(k_ptr, v_ptr, m_base, p_base, stride_ks, stride_vs, stride_ms,
                                                      stride_pj, BLOCK_N)

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
    start_m, z, n, h, znh, rows, _, offs_d, d_ok, query_ok, qd_ok = _program(S, N, H, D, BLOCK_M, BLOCK_M, BLOCK_D)
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
    start_n, z, n, h, znh, cols, rows, offs_d, d_ok, key_ok, kd_ok = _program(S, N, H, D, BLOCK_N, BLOCK_M, BLOCK_D)
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
    start_m, z, n, h, znh, rows, cols, offs_d, d_ok, query_ok, qd_ok = _program(S, N, H, D, BLOCK_M, BLOCK_N, BLOCK_D)
    # q[z, n, start_m:, h, :] and dO as [BLOCK_M, BLOCK_D] tiles; stats and delta rows [BLOCK_M]
    q_ptr, q_offs = _tile(Q, z, n, h, start_m, stride_qz, stride_qn, stride_qs, stride_qh, stride_qd, rows, offs_d)
    do_ptr, do_offs = _tile(DO, z, n, h, start_m, stride_doz, stride_don, stride_dos, stride_doh, stride_dod, rows,
                            offs_d)
    q = tl.load(q_ptr + q_offs, mask=qd_ok, other=0.0)
    do = tl.load(do_ptr + do_offs, mask=qd_ok, other=0.0)
    row_max, inv_sum = _load_stats(Stats + (znh * S + start_m + rows) * 2, query_ok)
    delta = tl.load(Delta + znh * S + start_m + rows, mask=query_ok, other=0.0)
    k_ptr, k_offs, v_ptr, v_offs, m_base, m_offs, p_base, p_offs = _key_loop(
        K, V, z, n, h, start_m, rows, cols, offs_d, stride_kz, stride_kn, stride_ks, stride_kh, stride_kd, stride_vz,
        stride_vn, stride_vs, stride_vh, stride_vd, stride_mz, stride_mn, stride_ms, stride_pz, stride_ph, stride_pi,
        stride_pj)

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, S, BLOCK_N):
        k, v, s = _key_tile(q, k_ptr + k_offs, v_ptr + v_offs, Mask, m_base, m_offs, Pair, p_base, p_offs, query_ok,
                            start_n + cols < S, d_ok, sm_scale, HAS_MASK, HAS_PAIR)  # s [BLOCK_M, BLOCK_N]
        p = _probs(s, row_max, inv_sum)
        dp = dot(do, tl.trans(v))  # [BLOCK_M, BLOCK_D] @ [BLOCK_D, BLOCK_N]
        ds = p * (dp - delta[:, None])
        dq += dot(cast(ds, k.dtype), k)  # [BLOCK_M, BLOCK_N] @ [BLOCK_N, BLOCK_D]
        k_ptr, v_ptr, m_base, p_base = _next_key_tile(k_ptr, v_ptr, m_base, p_base, stride_ks, stride_vs, stride_ms,
                                                      stride_pj, BLOCK_N)

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
    n0 = c * n_chunk
    steps = tl.minimum(n_chunk, N - n0)
    n0 = n0.to(tl.int64)
    zhc = zhc.to(tl.int64)
    start_m = (tile_m * BLOCK_M).to(tl.int64)
    start_n = (tile_n * BLOCK_N).to(tl.int64)
    rows, cols, offs_d, d_ok = tile_offsets(D, BLOCK_M, BLOCK_N, BLOCK_D)
    query_ok, qd_ok = tile_bounds(start_m + rows, S, d_ok)  # [BLOCK_M], [BLOCK_M, BLOCK_D]
    key_ok, kd_ok = tile_bounds(start_n + cols, S, d_ok)  # [BLOCK_N], [BLOCK_N, BLOCK_D]

    # The [BLOCK_M, BLOCK_N] tile of pair[z, h, start_m:, start_n:], the same for every n: loaded once; the [BLOCK_N]
    # row of mask[z, n, start_n:] at n = n0, advanced by one n per step
    m_base, m_offs, p_base, p_offs = _bias_offsets(z, n0, h, start_m, start_n, rows, cols, stride_mz, stride_mn,
                                                   stride_ms, stride_pz, stride_ph, stride_pi, stride_pj)
    pair_tile = _pair_tile(Pair, p_base, p_offs, query_ok, key_ok, True)
    # Tiles of q, dO [BLOCK_M, BLOCK_D] and k, v [BLOCK_N, BLOCK_D] at n = n0, advanced by one n per step
    q_ptr, q_offs = _tile(Q, z, n0, h, start_m, stride_qz, stride_qn, stride_qs, stride_qh, stride_qd, rows, offs_d)
    do_ptr, do_offs = _tile(DO, z, n0, h, start_m, stride_doz, stride_don, stride_dos, stride_doh, stride_dod,
                            rows, offs_d)
    k_ptr, k_offs = _tile(K, z, n0, h, start_n, stride_kz, stride_kn, stride_ks, stride_kh, stride_kd, cols, offs_d)
    v_ptr, v_offs = _tile(V, z, n0, h, start_n, stride_vz, stride_vn, stride_vs, stride_vh, stride_vd, cols, offs_d)
    # delta [Z, N, H, S] and stats [Z, N, H, S, 2] (contiguous): rows of (z, n, h) start at ((z * N + n) * H + h) * S
    row0 = ((z * N + n0) * H + h) * S + start_m
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


# ---- Launchers: tile configuration, grids and arguments ----------------------------------------------------


def _bias_strides(mask: Optional[Tensor], pair: Optional[Tensor]) -> tuple[int, ...]:
    """Mask strides (z, n, s) then pair strides (z, h, i, j); zeros for an absent bias."""
    return (*(mask.stride() if mask is not None else (0, 0, 0)),
            *(pair.stride() if pair is not None else (0, 0, 0, 0)))


#: The pair-bias gradient kernel splits N into chunks until its grid has about this many programs (about 4 waves of
#: 2 programs per SM on an H100): extra-MSA attention (Z = 1, H = 8, S = 384, N = 5120) has 288 unsplit programs.
DPAIR_TARGET_PROGRAMS = 1024
#: ... but a chunk keeps at least this many n (the pair tile's load and the partial sum's store stay small next to it)
DPAIR_MIN_CHUNK = 16


def dpair_chunk(z: int, n: int, h: int, s: int, tiles: Tiles) -> int:
    """Rows of N per pair-bias gradient program (a function of the shape only: same split, same bits, every run).

    The chunks' fp32 partial sums ``[Z, H, C, S, S]`` (C = ceil(N / chunk)) are split only while the unsplit grid is
    below :data:`DPAIR_TARGET_PROGRAMS`, so they hold fewer than ``2 * DPAIR_TARGET_PROGRAMS`` tiles: at most 32 MiB.
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
    meta = dict(HAS_MASK=mask is not None, HAS_PAIR=pair is not None, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
                BLOCK_D=cfg.block_d, **t.launch_options())
    return (triton.cdiv(s, t.block_m) * z * n * h,), args, meta


def bwd_launches(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, stats: Tensor, mask: Optional[Tensor],
                 pair: Optional[Tensor], delta: Tensor, dq: Tensor, dk: Tensor, dv: Tensor,
                 dmask_part: Optional[Tensor], dpair_part: Optional[Tensor]) -> list:
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
        (_bwd_dq_kernel, (triton.cdiv(s, cfg.dq.block_m) * z * n * h,),
         (q, k, v, mask, pair, do, stats, delta, dq, *qkvdo_strides, *dq.stride(), *bias_strides, *dims, scale),
         dict(**bias_flags, BLOCK_M=cfg.dq.block_m, BLOCK_N=cfg.dq.block_n, BLOCK_D=cfg.block_d,
              **cfg.dq.launch_options())),
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


# ---- Backend contract (see ds4sci.kernels.evoformer) -------------------------------------------------------


def forward(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], pair: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """Backend contract ``forward``: o ``[Z, N, S, H, D]`` in q's dtype and stats ``[Z, N, H, S, 2]`` fp32 (row max
    m of the biased logits and row sum ``l = sum_j exp(s_j - m)``; ``(+inf, +inf)`` on fully ``-inf`` rows). q, k, v
    may be any strided views; mask ``[Z, N, S]`` and pair ``[Z, H, S, S]`` (any floating dtype, stride 0 on broadcast
    dims) are read in place, not re-validated (see the module docstring)."""
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
