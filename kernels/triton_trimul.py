"""The Triton path of the triangle multiplicative update (AF2 supplement Algorithms 11/12, AF3 12/13), forward,
recomputing backward and a blockwise inference.

With ``x = LN_in(z)`` and per position ``a = mask * sigmoid(x W_ag + b_ag) * (x W_ap + b_ap)`` (``b`` likewise),

    p[i, j, :] = sum_k a[i, k, :] * b[j, k, :]      (outgoing, Alg. 11)
    p[i, j, :] = sum_k a[k, i, :] * b[k, j, :]      (incoming, Alg. 12)
    out = sigmoid(x W_g + b_g) * (LN_out(p) W_o + b_o)

Forward (training), three kernels over ``R = B * N * N`` flattened positions (``z`` row-major ``[R, c_z]``):

1. ``_in_fwd_kernel`` (a tile of positions): LN_in (its mean and rstd stored, ``[R, 2]``), the four projections and
   gates and the mask, writing ``a`` and ``b`` *channel-major* ``[c, B, N, N]`` as the product's operands: for
   incoming edges transposed in (i, j), so both directions multiply ``A @ B^T``;
2. ``_product_kernel``: the triangular product as a tiled batched matmul over ``k`` (``tl.dot``), one ``[M, K] @
   [K, N]`` matrix product per (channel, batch) through strides: the forward's ``A @ B^T``, the backward's ``dP @ B``
   and ``dP^T @ A`` and the inference's blocks;
3. ``_out_fwd_kernel``: LN_out of ``p`` (read channel-major), the output projection and the output gate (``x``
   recomputed from ``z`` and the saved statistics, or with them in inference).

The row kernels (all but the product and ``_wgrad_kernel``) take the channels a block at a time
(:mod:`~ds4sci.kernels.triton_trimul_rows`): LayerNorm statistics in one pass over the blocks, each projection
accumulated over blocks of its input channels for one block of its output channels, so their register tiles are
bounded by the block (:mod:`~ds4sci.kernels.triton_trimul_tiles`), not by c_z or c_hidden.

Saved for backward: ``z``, ``p`` (channel-major, in z's dtype) and the LN_in statistics (2 numbers per position).
Backward recomputes ``a`` and ``b`` with kernel 1 from the saved statistics, then ``_out_bwd_kernel`` (the
output-gate and output-projection row gradients, LN_out's statistics), ``_ln_bwd_kernel`` for LN_out (dP, LN_out's
weight partials), ``_product_kernel`` twice (dA, dB in the accumulation dtype), ``_in_bwd_kernel`` (the projection
row gradients) and ``_ln_bwd_kernel`` for LN_in (dz from the five row gradients, LN_in's weight partials). Weight
gradients are reduced without atomics: ``_ln_bwd_kernel`` is persistent (a fixed grid of programs, each looping
over tiles and storing one partial of the LayerNorm weights), ``_wgrad_kernel`` forms ``G^T X`` over a fixed split
of the positions (one partial per split, ``X`` = LN(z) or LN(p) recomputed from the statistics), bias gradients are
column sums of the row gradients; the launcher sums the partials in a fixed order, so two backward passes are
bitwise equal. Inference (no autograd) runs the same kernels on row blocks (:func:`_inference`): beyond z and the
output it holds O(one block), never ``a``, ``b`` or ``p`` whole.

All offsets are 64-bit (``R * c_z`` exceeds 2^31 at N = 4096, c_z = 128). Dtypes: fp16, bf16, fp32 (IEEE matmuls)
and fp64, ``c_z`` and ``c_hidden`` in 1..128 (:data:`~ds4sci.kernels.triton_trimul_tiles.MAX_CHANNELS`). Everything
accumulates in fp32, fp64 inputs in fp64; in fp16/bf16 the operands of every matmul are rounded to z's dtype as
PyTorch's same-dtype path rounds them.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .trimul_blocks import default_chunk_size
from .trimul_blocks import row_blocks
from .triton_common import cast
from .triton_common import dot
from .triton_trimul_rows import add_to_block
from .triton_trimul_rows import channels
from .triton_trimul_rows import gate_and_output
from .triton_trimul_rows import ln_block_grad
from .triton_trimul_rows import ln_in_stats
from .triton_trimul_rows import load_block
from .triton_trimul_rows import op_offsets
from .triton_trimul_rows import positions
from .triton_trimul_rows import projections
from .triton_trimul_rows import row_stats
from .triton_trimul_rows import standardised
from .triton_trimul_rows import widen
from .triton_trimul_tiles import TrimulConfig
from .triton_trimul_tiles import config

#: the persistent LayerNorm backward runs at most this many programs (a few waves on an H100), so its LayerNorm
#: weight partials stay ``[ROW_PROGRAMS, 2, 128]`` whatever N is
ROW_PROGRAMS = 512
#: the weight-gradient kernel splits the positions into at most this many chunks (one partial each)
WGRAD_SPLITS = 64

#: the k step of the product and the position step of the weight-gradient kernel
PRODUCT_BLOCK_K = 32
WGRAD_BLOCK_K = 32

# ---- Kernels -----------------------------------------------------------------------------------------------


@triton.jit
def _in_fwd_kernel(
    Z, Mask, Stats, LnW, LnB, Wap, Bap, Wag, Bag, Wbp, Bbp, Wbg, Bbg, A, B,
    R, N, Cz, Ch, eps: tl.float64, stride_i, stride_j,
    HAS_BIAS: tl.constexpr, STATS_IN: tl.constexpr,
    BLOCK_R: tl.constexpr, STEP_Z: tl.constexpr, STEP_H: tl.constexpr,
):
    """One program: a tile of BLOCK_R positions. a, b = mask * sigmoid(x W_g + b_g) * (x W_p + b_p) into the
    channel-major operands ``A, B [Ch, B, N, N]`` (positions placed by ``stride_i, stride_j``), STEP_H hidden
    channels at a time."""
    r, r_ok = positions(tl.program_id(0), R, BLOCK_R)
    mean, rstd = ln_in_stats(Z, Stats, r, r_ok, Cz, eps, STATS_IN, STEP_Z)
    m = widen(tl.load(Mask + r, mask=r_ok, other=0.0))[:, None]
    pos = op_offsets(r, N, stride_i, stride_j)[:, None]  # [BLOCK_R, 1] within a channel
    for h0 in range(0, Ch, STEP_H):
        ch, ch_ok = channels(h0, Ch, STEP_H)
        ap, ag, bp, bg = projections(Z, r, r_ok, mean, rstd, LnW, LnB, Wap, Bap, Wag, Bag, Wbp, Bbp, Wbg, Bbg, ch,
                                      ch_ok, Cz, HAS_BIAS, BLOCK_R, STEP_Z, STEP_H)
        offs = ch[None, :].to(tl.int64) * R + pos  # [BLOCK_R, STEP_H]
        ok = r_ok[:, None] & ch_ok[None, :]
        tl.store(A + offs, cast(m * tl.sigmoid(ag) * ap, A.dtype.element_ty), mask=ok)
        tl.store(B + offs, cast(m * tl.sigmoid(bg) * bp, B.dtype.element_ty), mask=ok)


@triton.jit
def _product_kernel(
    X, Y, C, M, N, K,
    stride_xq, stride_xm, stride_xk, stride_yq, stride_yk, stride_yn, stride_cq, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``C[q] = X[q] @ Y[q]`` (``[M, K] @ [K, N]``) for every matrix q of three buffers read and written through the
    given strides, accumulated in fp32 (fp64 for fp64 operands). One program: a BLOCK_M x BLOCK_N tile of one q."""
    tl.static_assert(BLOCK_M % 16 == 0 and BLOCK_N % 16 == 0 and BLOCK_K % 16 == 0, "tiles: multiples of 16 (tl.dot)")
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    tile_n = pid % num_n  # column tiles fastest, then row tiles, then matrices
    tile_m = (pid // num_n) % num_m
    q = (pid // (num_n * num_m)).to(tl.int64)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # 32-bit offsets within one matrix (fewer than 2^31 elements), a 64-bit base per matrix
    x_ptrs = X + q * stride_xq + rows[:, None] * stride_xm + ks[None, :] * stride_xk  # [BLOCK_M, BLOCK_K]
    y_ptrs = Y + q * stride_yq + ks[:, None] * stride_yk + cols[None, :] * stride_yn  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float64 if X.dtype.element_ty == tl.float64 else tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + ks < K
        x = tl.load(x_ptrs, mask=(rows[:, None] < M) & k_ok[None, :], other=0.0)
        y = tl.load(y_ptrs, mask=k_ok[:, None] & (cols[None, :] < N), other=0.0)
        acc += dot(x, y)
        x_ptrs += BLOCK_K * stride_xk
        y_ptrs += BLOCK_K * stride_yk
    ok = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(C + q * stride_cq + rows[:, None] * stride_cm + cols[None, :] * stride_cn, cast(acc, C.dtype.element_ty),
             mask=ok)


@triton.jit
def _out_fwd_kernel(
    Z, Stats, P, LnInW, LnInB, Wg, Bg, LnOutW, LnOutB, Wo, Bo, Out,
    R, Cz, Ch, eps: tl.float64,
    HAS_BIAS: tl.constexpr, STATS_IN: tl.constexpr, BLOCK_R: tl.constexpr, STEP_Z: tl.constexpr,
    STEP_H: tl.constexpr,
):
    """One program: a tile of BLOCK_R positions. out = sigmoid(x W_g + b_g) * (LN_out(p) W_o + b_o), p read from the
    channel-major ``P [Ch, R]``, x recomputed from z and the LN_in statistics (read when STATS_IN, else computed and
    stored), STEP_Z output channels at a time."""
    r, r_ok = positions(tl.program_id(0), R, BLOCK_R)
    mean, rstd = ln_in_stats(Z, Stats, r, r_ok, Cz, eps, STATS_IN, STEP_Z)
    mean_o, rstd_o = row_stats(P, r, r_ok, 1, R, Ch, eps, STEP_H)
    for j0 in range(0, Cz, STEP_Z):
        cj, cj_ok = channels(j0, Cz, STEP_Z)
        gate, o = gate_and_output(Z, P, r, r_ok, mean, rstd, mean_o, rstd_o, LnInW, LnInB, Wg, Bg, LnOutW, LnOutB,
                                   Wo, Bo, cj, cj_ok, R, Cz, Ch, HAS_BIAS, BLOCK_R, STEP_Z, STEP_H)
        tl.store(Out + r[:, None] * Cz + cj[None, :], cast(gate * o, Out.dtype.element_ty),
                 mask=r_ok[:, None] & cj_ok[None, :])


@triton.jit
def _out_bwd_kernel(
    Z, Stats, P, DOut, LnInW, LnInB, Wg, Bg, LnOutW, LnOutB, Wo, Bo, Gx, Go, StatsOut,
    R, Cz, Ch, eps: tl.float64, stride_gx,
    HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, STEP_Z: tl.constexpr, STEP_H: tl.constexpr,
):
    """One program: a tile of BLOCK_R positions. The output-gate logit gradient (into ``Gx[:, 4 Ch:]``), the
    output-projection gradient (``Go [R, Cz]``), both in z's dtype, and LN_out's statistics (``StatsOut [R, 2]``),
    STEP_Z output channels at a time."""
    r, r_ok = positions(tl.program_id(0), R, BLOCK_R)
    mean = tl.load(Stats + 2 * r, mask=r_ok, other=0.0)
    rstd = tl.load(Stats + 2 * r + 1, mask=r_ok, other=0.0)
    mean_o, rstd_o = row_stats(P, r, r_ok, 1, R, Ch, eps, STEP_H)
    tl.store(StatsOut + 2 * r, mean_o, mask=r_ok)
    tl.store(StatsOut + 2 * r + 1, rstd_o, mask=r_ok)
    dtype = Z.dtype.element_ty
    for j0 in range(0, Cz, STEP_Z):
        cj, cj_ok = channels(j0, Cz, STEP_Z)
        gate, o = gate_and_output(Z, P, r, r_ok, mean, rstd, mean_o, rstd_o, LnInW, LnInB, Wg, Bg, LnOutW, LnOutB,
                                   Wo, Bo, cj, cj_ok, R, Cz, Ch, HAS_BIAS, BLOCK_R, STEP_Z, STEP_H)
        dout = load_block(DOut, r, r_ok, cj, cj_ok, Cz, 1)
        ok = r_ok[:, None] & cj_ok[None, :]
        tl.store(Gx + r[:, None] * stride_gx + 4 * Ch + cj[None, :], cast(dout * o * gate * (1.0 - gate), dtype),
                 mask=ok)  # d(gate logit)
        tl.store(Go + r[:, None] * Cz + cj[None, :], cast(dout * gate, dtype), mask=ok)  # d(projected output)


@triton.jit
def _in_bwd_kernel(
    Z, Mask, Stats, DA, DB, LnW, LnB, Wap, Bap, Wag, Bag, Wbp, Bbp, Wbg, Bbg, Gx,
    R, N, Cz, Ch, stride_i, stride_j, stride_gx,
    HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, STEP_Z: tl.constexpr, STEP_H: tl.constexpr,
):
    """One program: a tile of BLOCK_R positions. The projection and gate logit gradients of a and b (into ``Gx[:,
    :4 Ch]`` in z's dtype, order a_p, a_g, b_p, b_g) from dA, dB (channel-major, the operand layout, accumulation
    dtype) and the projections recomputed, STEP_H hidden channels at a time."""
    r, r_ok = positions(tl.program_id(0), R, BLOCK_R)
    mean = tl.load(Stats + 2 * r, mask=r_ok, other=0.0)
    rstd = tl.load(Stats + 2 * r + 1, mask=r_ok, other=0.0)
    m = widen(tl.load(Mask + r, mask=r_ok, other=0.0))[:, None]
    pos = op_offsets(r, N, stride_i, stride_j)[:, None]  # [BLOCK_R, 1] within a channel of dA, dB
    dtype = Z.dtype.element_ty
    for h0 in range(0, Ch, STEP_H):
        ch, ch_ok = channels(h0, Ch, STEP_H)
        ap, ag, bp, bg = projections(Z, r, r_ok, mean, rstd, LnW, LnB, Wap, Bap, Wag, Bag, Wbp, Bbp, Wbg, Bbg, ch,
                                      ch_ok, Cz, HAS_BIAS, BLOCK_R, STEP_Z, STEP_H)
        ok = r_ok[:, None] & ch_ok[None, :]
        op = ch[None, :].to(tl.int64) * R + pos  # [BLOCK_R, STEP_H]
        da = tl.load(DA + op, mask=ok, other=0.0) * m
        db = tl.load(DB + op, mask=ok, other=0.0) * m
        sa, sb = tl.sigmoid(ag), tl.sigmoid(bg)
        g = Gx + r[:, None] * stride_gx + ch[None, :]
        tl.store(g, cast(da * sa, dtype), mask=ok)
        tl.store(g + Ch, cast(da * ap * sa * (1.0 - sa), dtype), mask=ok)
        tl.store(g + 2 * Ch, cast(db * sb, dtype), mask=ok)
        tl.store(g + 3 * Ch, cast(db * bp * sb * (1.0 - sb), dtype), mask=ok)


@triton.jit
def _ln_bwd_kernel(
    G, Wap, Wag, Wbp, Wbg, Wlast, Src, Stats, LnW, Out, VecPart,
    R, C, K0, K4, stride_g, stride_r, stride_c,
    FIVE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, STEP_C: tl.constexpr, STEP_K0: tl.constexpr,
    STEP_K4: tl.constexpr,
):
    """A LayerNorm's backward through the linear layers after it. Per position: dy = the row gradients G times the
    weights (:func:`dx_block`) and the LayerNorm's input gradient ``rstd * (g - mean(g) - yhat * mean(g * yhat))``
    with ``g = dy * weight`` into ``Out`` (``[R, C]`` through ``stride_r, stride_c`` as the LayerNorm's input
    ``Src``, yhat recomputed from it and ``Stats [R, 2]``). Per program the partial sums of the LayerNorm's weight
    and bias gradients (``VecPart [programs, 2, BLOCK_C]``, accumulation dtype). Persistent: program k takes tiles k,
    k + programs, ... Channels STEP_C at a time: a first pass forms the row means (the first block is kept), a
    second forms each further block again. LN_in: dy from a's and b's four projections and the output gate (FIVE);
    LN_out: from the output projection."""
    NB: tl.constexpr = BLOCK_C // STEP_C
    c_first, c_first_ok = channels(0, C, STEP_C)
    w_first = widen(tl.load(LnW + c_first, mask=c_first_ok, other=0.0))
    dw = tl.zeros([NB, STEP_C], w_first.dtype)
    db = tl.zeros([NB, STEP_C], w_first.dtype)
    for tile in range(tl.program_id(0), tl.cdiv(R, BLOCK_R), tl.num_programs(0)):
        r, r_ok = positions(tile, R, BLOCK_R)
        mean = tl.load(Stats + 2 * r, mask=r_ok, other=0.0)
        rstd = tl.load(Stats + 2 * r + 1, mask=r_ok, other=0.0)
        _, _, dy_first, yhat_first, g_first = ln_block_grad(
            G, Wap, Wag, Wbp, Wbg, Wlast, Src, LnW, r, r_ok, mean, rstd, 0, C, K0, K4, stride_g, stride_r, stride_c,
            FIVE, BLOCK_R, STEP_C, STEP_K0, STEP_K4)
        sum_g = tl.sum(g_first, 1)
        sum_gy = tl.sum(g_first * yhat_first, 1)
        dw = add_to_block(dw, tl.sum(dy_first * yhat_first, 0), 0, NB)
        db = add_to_block(db, tl.sum(dy_first, 0), 0, NB)
        for c0 in range(STEP_C, C, STEP_C):
            c, c_ok, dy, yhat, g = ln_block_grad(
                G, Wap, Wag, Wbp, Wbg, Wlast, Src, LnW, r, r_ok, mean, rstd, c0, C, K0, K4, stride_g, stride_r,
                stride_c, FIVE, BLOCK_R, STEP_C, STEP_K0, STEP_K4)
            sum_g += tl.sum(g, 1)
            sum_gy += tl.sum(g * yhat, 1)
            dw = add_to_block(dw, tl.sum(dy * yhat, 0), c0 // STEP_C, NB)
            db = add_to_block(db, tl.sum(dy, 0), c0 // STEP_C, NB)
        mean_g = (sum_g / C)[:, None]
        mean_gy = (sum_gy / C)[:, None]
        dx = tl.where(c_first_ok[None, :], (g_first - mean_g - yhat_first * mean_gy) * rstd[:, None], 0.0)
        tl.store(Out + r[:, None] * stride_r + c_first[None, :].to(tl.int64) * stride_c, cast(dx, Out.dtype.element_ty),
                 mask=r_ok[:, None] & c_first_ok[None, :])
        for c0 in range(STEP_C, C, STEP_C):
            c, c_ok, dy, yhat, g = ln_block_grad(
                G, Wap, Wag, Wbp, Wbg, Wlast, Src, LnW, r, r_ok, mean, rstd, c0, C, K0, K4, stride_g, stride_r,
                stride_c, FIVE, BLOCK_R, STEP_C, STEP_K0, STEP_K4)
            dx = tl.where(c_ok[None, :], (g - mean_g - yhat * mean_gy) * rstd[:, None], 0.0)
            tl.store(Out + r[:, None] * stride_r + c[None, :].to(tl.int64) * stride_c, cast(dx, Out.dtype.element_ty),
                     mask=r_ok[:, None] & c_ok[None, :])
    blocks = tl.arange(0, NB)[:, None] * STEP_C + tl.arange(0, STEP_C)[None, :]  # [NB, STEP_C]
    part = VecPart + tl.program_id(0).to(tl.int64) * 2 * BLOCK_C
    tl.store(part + blocks, dw)
    tl.store(part + BLOCK_C + blocks, db)


@triton.jit
def _wgrad_kernel(
    G, Src, Stats, LnW, LnB, DW,
    R, M, C, rows_per_split, stride_gr, stride_sr, stride_sc,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Partial weight gradients ``DW[s, m, n] = sum_{r in split s} G[r, m] * X[r, n]`` (``[splits, M, C]``,
    accumulation dtype) with ``X = LN(Src)`` recomputed in G's dtype from the saved statistics (``Stats [R, 2]``:
    mean, rstd) exactly as the forward rounded it; G ``[R, M]`` has unit column stride, Src is read through its
    strides. One program: a BLOCK_M x BLOCK_N tile of one split, looping over its positions BLOCK_K at a time."""
    tl.static_assert(BLOCK_M % 16 == 0 and BLOCK_N % 16 == 0 and BLOCK_K % 16 == 0, "tiles: multiples of 16 (tl.dot)")
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(C, BLOCK_N)
    tile_n = pid % num_n
    tile_m = (pid // num_n) % num_m
    split = pid // (num_n * num_m)
    ms = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cs = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, c_ok = ms < M, cs < C
    w = widen(tl.load(LnW + cs, mask=c_ok, other=0.0))
    b = widen(tl.load(LnB + cs, mask=c_ok, other=0.0))
    start = split.to(tl.int64) * rows_per_split
    end = tl.minimum(start + rows_per_split, R)
    acc = tl.zeros([BLOCK_M, BLOCK_N], DW.dtype.element_ty)
    for r0 in range(start, end, BLOCK_K):
        r = r0 + tl.arange(0, BLOCK_K)
        r_ok = r < end
        g = tl.load(G + r[:, None] * stride_gr + ms[None, :], mask=r_ok[:, None] & m_ok[None, :], other=0.0)
        mean = tl.load(Stats + 2 * r, mask=r_ok, other=0.0)
        rstd = tl.load(Stats + 2 * r + 1, mask=r_ok, other=0.0)
        xhat = standardised(Src, r, r_ok, cs, c_ok, stride_sr, stride_sc, mean, rstd)  # [BLOCK_K, BLOCK_N]
        x = cast(xhat * w[None, :] + b[None, :], G.dtype.element_ty)  # rows past the split: g is 0 there
        acc += dot(tl.trans(g), x)  # [BLOCK_M, BLOCK_K] @ [BLOCK_K, BLOCK_N]
    out = DW + split.to(tl.int64) * M * C + ms[:, None] * C + cs[None, :]
    tl.store(out, acc, mask=m_ok[:, None] & c_ok[None, :])


# ---- Launchers and autograd --------------------------------------------------------------------------------

#: the fields of the weights object, in the order :class:`_TrimulFunction` takes them (AF2 Alg. 11/12 names;
#: biases are all present or all None: OpenFold3's projections have none, LayerNorms always have both)
PARAM_NAMES = ("ln_in_weight", "ln_in_bias", "a_proj_w", "a_proj_b", "a_gate_w", "a_gate_b", "b_proj_w", "b_proj_b",
               "b_gate_w", "b_gate_b", "ln_out_weight", "ln_out_bias", "out_proj_w", "out_proj_b", "out_gate_w",
               "out_gate_b")
_IN = ("ln_in_weight", "ln_in_bias", "a_proj_w", "a_proj_b", "a_gate_w", "a_gate_b", "b_proj_w", "b_proj_b",
       "b_gate_w", "b_gate_b")
_OUT = ("ln_in_weight", "ln_in_bias", "out_gate_w", "out_gate_b", "ln_out_weight", "ln_out_bias", "out_proj_w",
        "out_proj_b")


def _pointers(w: dict, names: tuple[str, ...]) -> list[Tensor]:
    """The kernels' weight arguments; an absent bias is passed as its weight (a pointer never read: HAS_BIAS off)."""
    return [w[name] if w[name] is not None else w[name.removesuffix("_b") + "_w"] for name in names]


def _op_strides(n: int, outgoing: bool) -> tuple[int, int]:
    """(stride_i, stride_j) of position (i, j) in the product's operands: A[u, k] = a[i, k] (outgoing) or a[k, i]
    (incoming), so that p = A @ B^T either way."""
    return (n, 1) if outgoing else (1, n)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The kernels' accumulation dtype for inputs of ``dtype``: fp64 for fp64, fp32 for the others."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _forward(z: Tensor, mask: Tensor, w: dict, outgoing: bool, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """out ``[R, Cz]``, p ``[Ch, R]`` (channel-major, z's dtype) and the LN_in statistics ``[R, 2]`` (accumulation
    dtype) of z ``[B, N, N, Cz]`` contiguous and mask ``[B, N, N]`` contiguous."""
    nb, n, _, cz = z.shape
    ch = w["a_proj_w"].shape[0]
    cfg = config(z.dtype, cz, ch)
    stats = torch.empty(nb * n * n, 2, dtype=_acc_dtype(z.dtype), device=z.device)
    a, b, p = (torch.empty(ch, nb, n, n, dtype=z.dtype, device=z.device) for _ in range(3))  # [Ch, B, N, N]
    _in_projections(z, mask, stats, w, a, b, outgoing, eps, cfg, stats_in=False)
    _product(a.view(-1, n, n), b.view(-1, n, n).mT, p.view(-1, n, n), cfg)
    return _out_projection(z, stats, p, w, eps, cfg, stats_in=True), p, stats


def _in_projections(z, mask, stats, w, a, b, outgoing, eps, cfg, stats_in):
    """Kernel 1: a, b ``[Ch, B, N, N]`` (and, unless ``stats_in``, the LN_in statistics) of z ``[B, N, N, Cz]``, or
    ``[Ch, B, R, N]`` of a block of rows ``[B, R, N, Cz]`` with ``outgoing`` (positions in z's order)."""
    n, cz = z.shape[-2:]
    r = z.numel() // cz
    _in_fwd_kernel[(triton.cdiv(r, cfg.rows.block_m),)](
        z, mask, stats, *_pointers(w, _IN), a, b, r, n, cz, a.shape[0], eps, *_op_strides(n, outgoing),
        HAS_BIAS=w["a_proj_b"] is not None, STATS_IN=stats_in, BLOCK_R=cfg.rows.block_m, STEP_Z=cfg.step_z,
        STEP_H=cfg.proj_h, **cfg.rows.launch_options())


def _product(x: Tensor, y: Tensor, c: Tensor, cfg: TrimulConfig) -> None:
    """Kernel 2: ``c[q] = x[q] @ y[q]`` for the matrices of ``x [Q, M, K]``, ``y [Q, K, N]``, ``c [Q, M, N]``
    (any strides: a transpose is a view)."""
    (q, m, k), nc, t = x.shape, y.shape[-1], cfg.product
    grid = (triton.cdiv(m, t.block_m) * triton.cdiv(nc, t.block_n) * q,)
    _product_kernel[grid](x, y, c, m, nc, k, *x.stride(), *y.stride(), *c.stride(), BLOCK_M=t.block_m,
                          BLOCK_N=t.block_n, BLOCK_K=PRODUCT_BLOCK_K, **t.launch_options())


def _out_projection(z: Tensor, stats: Tensor, p: Tensor, w: dict, eps: float, cfg: TrimulConfig,
                    stats_in: bool) -> Tensor:
    """Kernel 3: the update ``[R, Cz]`` of z's ``R`` positions (contiguous) from p (channel-major ``[Ch, R]``) and
    the LN_in statistics (``[R, 2]``: read if ``stats_in``, else computed and stored there)."""
    cz, ch = z.shape[-1], p.shape[0]
    r = z.numel() // cz
    out = torch.empty(r, cz, dtype=z.dtype, device=z.device)
    _out_fwd_kernel[(triton.cdiv(r, cfg.rows.block_m),)](
        z, stats, p, *_pointers(w, _OUT), out, r, cz, ch, eps, HAS_BIAS=w["a_proj_b"] is not None, STATS_IN=stats_in,
        BLOCK_R=cfg.rows.block_m, STEP_Z=cfg.step_z, STEP_H=cfg.step_h, **cfg.rows.launch_options())
    return out


def _inference(z: Tensor, mask: Tensor, w: dict, outgoing: bool, eps: float, chunk: int) -> Tensor:
    """The update ``[B, N, N, Cz]`` of z ``[B, N, N, Cz]`` (mask ``[B, N, N]``) without autograd, by blocks of
    ``chunk`` rows of the working frame (:func:`~ds4sci.kernels.trimul_blocks.row_blocks`, the chunked path's plan):
    a block's operand comes from kernel 1 on its rows (made contiguous; both operands are formed, one kept), each
    block of the product from kernel 2 on an operand block against a block of the other operand recomputed for it,
    and the block's output from kernel 3 (its LN_in statistics computed there). Live beyond z and the output: O(one
    block) (channel-major ``[Ch, B, R, N]`` blocks, product in z's dtype from fp32 accumulation)."""
    cz, ch = z.shape[-1], w["a_proj_w"].shape[0]
    cfg = config(z.dtype, cz, ch)

    def stats(z_rows: Tensor) -> Tensor:
        return torch.empty(z_rows.numel() // cz, 2, dtype=_acc_dtype(z.dtype), device=z.device)

    def operand(z_rows: Tensor, mask_rows: Tensor, which: str) -> Tensor:  # [B, R, N, Cz] -> [Ch, B, R, N]
        z_rows, mask_rows = z_rows.contiguous(), mask_rows.contiguous()
        a, b = (z.new_empty((ch, *z_rows.shape[:-1])) for _ in range(2))
        _in_projections(z_rows, mask_rows, stats(z_rows), w, a, b, True, eps, cfg, stats_in=False)
        return a if which == "a" else b

    def product(r: Tensor, f_rows: Tensor, out: Tensor) -> None:  # [Ch, B, R, N], [Ch, B, J, N] -> [Ch, B, R, J]
        _product(r.flatten(0, 1), f_rows.flatten(0, 1).mT, out.flatten(0, 1), cfg)

    def finish(z_rows: Tensor, p: Tensor) -> Tensor:  # [B, R, N, Cz], [Ch, B, R, N] -> [B, R, N, Cz]
        z_rows = z_rows.contiguous()
        return _out_projection(z_rows, stats(z_rows), p, w, eps, cfg, stats_in=False).view(z_rows.shape)

    return row_blocks(z, mask, outgoing, chunk, operand, product, finish)


def _weight_grad(g: Tensor, src: Tensor, src_strides: tuple[int, int], stats: Tensor, ln_w: Tensor, ln_b: Tensor,
                 cfg: TrimulConfig) -> Tensor:
    """``sum_r g[r, :]^T LN(src)[r, :]`` ``[M, C]`` (accumulation dtype) of g ``[R, M]`` and src (``[R, C]`` through
    its strides): :func:`_wgrad_kernel`'s per-split partials summed in split order."""
    r, m = g.shape
    c = ln_w.shape[0]
    t = cfg.wgrad
    rows = triton.cdiv(triton.cdiv(r, WGRAD_SPLITS), WGRAD_BLOCK_K) * WGRAD_BLOCK_K  # a function of the shape only
    splits = triton.cdiv(r, rows)
    part = torch.empty(splits, m, c, dtype=_acc_dtype(g.dtype), device=g.device)
    grid = (splits * triton.cdiv(m, t.block_m) * triton.cdiv(c, t.block_n),)
    _wgrad_kernel[grid](g, src, stats, ln_w, ln_b, part, r, m, c, rows, g.stride(0), *src_strides,
                        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=WGRAD_BLOCK_K, **t.launch_options())
    return part.sum(0)


def _backward(dout: Tensor, z: Tensor, mask: Tensor, p: Tensor, stats: Tensor, w: dict, outgoing: bool,
              eps: float) -> tuple[Tensor, dict]:
    """dz ``[B, N, N, Cz]`` and the weight gradients {name: tensor in the accumulation dtype} (None for absent
    biases)."""
    nb, n, _, cz = z.shape
    ch = p.shape[0]
    r = nb * n * n
    cfg = config(z.dtype, cz, ch)
    has_bias = w["a_proj_b"] is not None
    dev, acc = z.device, _acc_dtype(z.dtype)
    a, b = (torch.empty(ch, nb, n, n, dtype=z.dtype, device=dev) for _ in range(2))
    _in_projections(z, mask, stats, w, a, b, outgoing, eps, cfg, stats_in=True)  # recomputed, not saved

    rows, grid = cfg.rows, (triton.cdiv(r, cfg.rows.block_m),)
    steps = dict(BLOCK_R=rows.block_m, STEP_Z=cfg.step_z, STEP_H=cfg.step_h)
    gx = torch.empty(r, 4 * ch + cz, dtype=z.dtype, device=dev)  # d(logits) of a_p, a_g, b_p, b_g, the output gate
    go = torch.empty(r, cz, dtype=z.dtype, device=dev)  # d(output projection)
    stats_out = torch.empty(r, 2, dtype=acc, device=dev)
    _out_bwd_kernel[grid](z, stats, p, dout, *_pointers(w, _OUT), gx, go, stats_out, r, cz, ch, eps, gx.stride(0),
                          HAS_BIAS=has_bias, **steps, **rows.launch_options())
    dp = torch.empty(ch, nb, n, n, dtype=z.dtype, device=dev)
    wo = w["out_proj_w"]  # dy = go @ W_o: the one weight of LN_out's backward (FIVE off)
    ln_out = _ln_backward(go, (wo,) * 5, 0, cz, p.view(ch, r), (1, r), stats_out, w["ln_out_weight"], dp.view(ch, r),
                          cfg.block_ch, dict(STEP_C=cfg.step_h, STEP_K0=cfg.step_h, STEP_K4=cfg.step_z), cfg)

    da, db = (torch.empty(ch, nb, n, n, dtype=acc, device=dev) for _ in range(2))
    mats = [t.view(-1, n, n) for t in (dp, a, b, da, db)]
    _product(mats[0], mats[2], mats[3], cfg)  # dA = dP @ B
    _product(mats[0].mT, mats[1], mats[4], cfg)  # dB = dP^T @ A
    del a, b, dp

    t = cfg.in_bwd
    _in_bwd_kernel[(triton.cdiv(r, t.block_m),)](
        z, mask, stats, da, db, *_pointers(w, _IN), gx, r, n, cz, ch, *_op_strides(n, outgoing), gx.stride(0),
        HAS_BIAS=has_bias, BLOCK_R=t.block_m, STEP_Z=cfg.step_z, STEP_H=cfg.proj_h, **t.launch_options())
    del da, db
    dz = torch.empty(r, cz, dtype=z.dtype, device=dev)
    weights = [w[name] for name in ("a_proj_w", "a_gate_w", "b_proj_w", "b_gate_w", "out_gate_w")]
    z_rows = z.view(r, cz)
    ln_in = _ln_backward(gx, weights, ch, cz, z_rows, (cz, 1), stats, w["ln_in_weight"], dz, cfg.block_cz,
                         dict(STEP_C=cfg.step_z, STEP_K0=cfg.proj_h, STEP_K4=cfg.proj_z), cfg)

    dw_x = _weight_grad(gx, z_rows, (cz, 1), stats, w["ln_in_weight"], w["ln_in_bias"], cfg)  # [4 Ch + Cz, Cz]
    dw_o = _weight_grad(go, p.view(ch, r), (1, r), stats_out, w["ln_out_weight"], w["ln_out_bias"], cfg)  # [Cz, Ch]
    grads = {"ln_in_weight": ln_in[0, :cz], "ln_in_bias": ln_in[1, :cz], "ln_out_weight": ln_out[0, :ch],
             "ln_out_bias": ln_out[1, :ch], "out_proj_w": dw_o, "out_gate_w": dw_x[4 * ch:]}
    for i, name in enumerate(("a_proj", "a_gate", "b_proj", "b_gate")):
        grads[f"{name}_w"] = dw_x[i * ch:(i + 1) * ch]
    bias_rows = {"a_proj_b": gx[:, :ch], "a_gate_b": gx[:, ch:2 * ch], "b_proj_b": gx[:, 2 * ch:3 * ch],
                 "b_gate_b": gx[:, 3 * ch:4 * ch], "out_gate_b": gx[:, 4 * ch:], "out_proj_b": go}
    for name, rows in bias_rows.items():  # column sums (torch's reductions: the same bits every run)
        grads[name] = rows.sum(0, dtype=acc) if has_bias else None
    return dz.view(z.shape), grads


def _ln_backward(g: Tensor, weights, k0: int, k4: int, src: Tensor, src_strides: tuple[int, int], stats: Tensor,
                 ln_w: Tensor, out: Tensor, block_c: int, steps: dict, cfg: TrimulConfig) -> Tensor:
    """:func:`_ln_bwd_kernel`: a LayerNorm's input gradient into ``out`` (the layout of ``src``, ``[R, C]`` through
    ``src_strides``) from the row gradients g ``[R, 4 k0 + k4]`` of the five (``k0 > 0``) or one linear layers after
    it; returns the LayerNorm's weight and bias gradients ``[2, block_c]`` (accumulation dtype), the persistent
    programs' partials summed in program order."""
    r, c = g.shape[0], ln_w.shape[0]
    programs = min(triton.cdiv(r, cfg.rows.block_m), ROW_PROGRAMS)
    part = torch.empty(programs, 2, block_c, dtype=_acc_dtype(g.dtype), device=g.device)
    _ln_bwd_kernel[(programs,)](g, *weights, src, stats, ln_w, out, part, r, c, k0, k4, g.stride(0), *src_strides,
                                FIVE=k0 > 0, BLOCK_R=cfg.rows.block_m, BLOCK_C=block_c, **steps,
                                **cfg.rows.launch_options())
    return part.sum(0)


class _TrimulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, mask, outgoing, eps, *weights):
        w = dict(zip(PARAM_NAMES, weights))
        out, p, stats = _forward(z, mask, w, outgoing, eps)
        ctx.save_for_backward(z, mask, p, stats, *weights)
        ctx.outgoing, ctx.eps = outgoing, eps
        return out.view(z.shape)

    @staticmethod
    def backward(ctx, dout):
        z, mask, p, stats, *weights = ctx.saved_tensors
        w = dict(zip(PARAM_NAMES, weights))
        dz, grads = _backward(dout.contiguous(), z, mask, p, stats, w, ctx.outgoing, ctx.eps)
        dweights = [None if grads[name] is None or not ctx.needs_input_grad[4 + i] else grads[name].to(w[name].dtype)
                    for i, name in enumerate(PARAM_NAMES)]
        return (dz if ctx.needs_input_grad[0] else None), None, None, None, *dweights


def trimul_triton(z: Tensor, mask: Optional[Tensor], params, outgoing: bool, eps: float,
                  chunk_size: Optional[int] = None) -> Tensor:
    """The triangle multiplicative update ``[*, N, N, c_z]`` of z ``[*, N, N, c_z]`` (fp16, bf16, fp32 or fp64, on a
    CUDA device or on the CPU under ``TRITON_INTERPRET=1``), differentiable in z and every weight.

    ``mask``: ``[*, N, N]`` (broadcastable; None: all ones), not differentiated. ``params``: an object with the
    attributes :data:`PARAM_NAMES` (LayerNorm weights ``[c_z]`` / ``[c_hidden]``; projection weights ``[c_hidden,
    c_z]``, the output gate ``[c_z, c_z]``, the output projection ``[c_z, c_hidden]``, nn.Linear's layout; biases
    all None or all present), in z's dtype. ``outgoing``: Algorithm 11 (True) or 12 (False); ``eps``: both
    LayerNorms'. Without autograd (grad mode off or nothing requiring a gradient) it runs in blocks of ``chunk_size``
    rows (None: an eighth of the rows; :func:`_inference`). Raises TypeError on an unsupported dtype or a weight of
    another dtype, ValueError on a shape."""
    weights = [getattr(params, name) for name in PARAM_NAMES]
    if z.dim() < 3 or z.shape[-2] != z.shape[-3]:
        raise ValueError(f"trimul_triton: z must be [*, N, N, c_z], got {tuple(z.shape)}")
    lead, n, cz = z.shape[:-3], z.shape[-2], z.shape[-1]
    config(z.dtype, cz, params.a_proj_w.shape[0])  # the dtype and channel checks
    biases = [t is None for name, t in zip(PARAM_NAMES, weights) if name.endswith("_b")]
    if any(biases) and not all(biases):
        raise ValueError("trimul_triton: the projection biases must be all present or all None")
    for name, t in zip(PARAM_NAMES, weights):
        if t is not None and t.dtype != z.dtype:
            raise TypeError(f"trimul_triton: {name} is {t.dtype}, z is {z.dtype}")
    nb = math.prod(lead)
    z4 = z.reshape(nb, n, n, cz)  # [B, N, N, c_z]
    mask3 = (z.new_ones(()) if mask is None else mask).to(z.dtype).expand(*lead, n, n).reshape(nb, n, n)  # [B, N, N]
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (z, *weights))):
        chunk = min(default_chunk_size(z, 0, budget=None) if chunk_size is None else chunk_size, n)
        with torch.no_grad():
            return _inference(z4, mask3, dict(zip(PARAM_NAMES, weights)), bool(outgoing), float(eps), chunk).view(
                z.shape)
    out = _TrimulFunction.apply(z4.contiguous(), mask3.contiguous(), bool(outgoing), float(eps), *weights)
    return out.reshape(z.shape)
