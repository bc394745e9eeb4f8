"""The Triton path of the triangle multiplicative update (AF2 supplement Algorithms 11/12, AF3 12/13), forward,
recomputing backward and a blockwise inference.

With ``x = LN_in(z)`` and per position ``a = mask * sigmoid(x W_ag + b_ag) * (x W_ap + b_ap)`` (``b`` likewise),

    p[i, j, :] = sum_k a[i, k, :] * b[j, k, :]      (outgoing, Alg. 11)
    p[i, j, :] = sum_k a[k, i, :] * b[k, j, :]      (incoming, Alg. 12)
    out = sigmoid(x W_g + b_g) * (LN_out(p) W_o + b_o)

Forward (training), three kernels over ``R = B * N * N`` flattened positions (``z`` row-major ``[R, c_z]``):

1. ``_in_fwd_kernel`` (a tile of positions, whole channel rows): LN_in (its mean and rstd stored, ``[R, 2]`` fp32),
   the four projections and gates and the mask, writing ``a`` and ``b`` *channel-major* ``[c, B, N, N]`` as the
   product's operands: for incoming edges transposed in (i, j), so both directions multiply ``A @ B^T``;
2. ``_product_kernel``: the triangular product as a tiled batched matmul over ``k`` (``tl.dot``, fp32 accumulation),
   one ``[M, K] @ [K, N]`` matrix product per (channel, batch) through strides: the forward's ``A @ B^T``, the
   backward's ``dP @ B`` and ``dP^T @ A`` and the inference's blocks;
3. ``_out_fwd_kernel``: LN_out of ``p`` (read channel-major), the output projection and the output gate (``x``
   recomputed from ``z`` and the saved statistics, or with them in inference).

Saved for backward: ``z``, ``p`` (channel-major, in z's dtype) and the LN_in statistics (2 numbers per position).
Backward recomputes ``a`` and ``b`` with kernel 1 from the saved statistics, then ``_out_bwd_kernel`` (dP, the
output-gate and output-projection row gradients, LN_out's weight partials), ``_product_kernel`` twice (dA, dB, fp32)
and ``_in_bwd_kernel`` (dz, the projection row gradients, LN_in's weight partials). Weight gradients are reduced in
fp32 without atomics: the two row kernels are persistent (a fixed grid of programs, each looping over tiles and
storing one partial of the LayerNorm weights), ``_wgrad_kernel`` forms ``G^T X`` over a fixed split of the
positions (one partial per split, ``X`` = LN(z) or LN(p) recomputed from the statistics), bias gradients are
column sums of the row gradients; the launcher sums the partials in a fixed order, so two backward passes are
bitwise equal. Inference (no autograd) runs the same kernels on row blocks (:func:`_inference`): beyond z and the
output it holds O(one block), never ``a``, ``b`` or ``p`` whole.

All offsets are 64-bit (``R * c_z`` exceeds 2^31 at N = 4096, c_z = 128). Limitations: fp16 and bf16 with ``c_z``
and ``c_hidden`` in 1..128, fp32 (IEEE matmuls) in 1..32 (a channel row is held whole in registers:
:data:`~ds4sci.kernels.triton_trimul_tiles.MAX_CHANNELS`); in fp16/bf16 the operands of every matmul are rounded to
z's dtype as PyTorch's same-dtype path rounds them, everything else is fp32.
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
from .triton_trimul_tiles import TrimulConfig
from .triton_trimul_tiles import config

#: the persistent backward row kernels run at most this many programs (a few waves on an H100), so their LayerNorm
#: weight partials stay ``[ROW_PROGRAMS, 2, 128]`` fp32 whatever N is
ROW_PROGRAMS = 512
#: the weight-gradient kernel splits the positions into at most this many chunks (one fp32 partial each)
WGRAD_SPLITS = 64

#: the k step of the product and the position step of the weight-gradient kernel
PRODUCT_BLOCK_K = 32
WGRAD_BLOCK_K = 32

# ---- @triton.jit helpers -----------------------------------------------------------------------------------


@triton.jit
def _positions(tile, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Rows ``[BLOCK_R]`` (int64) of a tile of positions, rows < R, channel offsets ``[BLOCK_C]`` and channels < C."""
    tl.static_assert(BLOCK_R % 16 == 0 and BLOCK_C >= 16, "tiles must be multiples of 16 (tl.dot)")
    r = tl.cast(tile, tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_C)
    return r, r < R, c, c < C


@triton.jit
def _op_offsets(r, N, stride_i, stride_j):
    """Offsets ``[BLOCK_R]`` within a channel of the product's operand layout ``[c, B, N, N]`` of positions r = (b, i,
    j): ``b * N^2 + i * stride_i + j * stride_j`` ((N, 1) for outgoing edges, (1, N) for incoming)."""
    nn = N.to(tl.int64) * N
    ij = r % nn
    return (r - ij) + (ij // N) * stride_i + (ij % N) * stride_j


@triton.jit
def _layer_norm_in(Z, Stats, LnW, LnB, r, r_ok, cz, cz_ok, Cz, eps, STATS_IN: tl.constexpr):
    """x = LN_in(z) of rows r: (xhat fp32, x in z's dtype, rstd) ``[BLOCK_R, BLOCK_CZ]``, ``[BLOCK_R]``; the statistics
    are read from ``Stats [R, 2]`` (mean, rstd) when STATS_IN, else computed and stored there."""
    rc_ok = r_ok[:, None] & cz_ok[None, :]
    zt = tl.load(Z + r[:, None] * Cz + cz[None, :], mask=rc_ok, other=0.0).to(tl.float32)
    if STATS_IN:
        mean = tl.load(Stats + 2 * r, mask=r_ok, other=0.0)
        rstd = tl.load(Stats + 2 * r + 1, mask=r_ok, other=0.0)
    else:
        mean, rstd = _row_stats(zt, cz_ok, Cz, eps)
        tl.store(Stats + 2 * r, mean, mask=r_ok)
        tl.store(Stats + 2 * r + 1, rstd, mask=r_ok)
    xhat = tl.where(cz_ok[None, :], (zt - mean[:, None]) * rstd[:, None], 0.0)
    w = tl.load(LnW + cz, mask=cz_ok, other=0.0).to(tl.float32)
    b = tl.load(LnB + cz, mask=cz_ok, other=0.0).to(tl.float32)
    return xhat, cast(xhat * w[None, :] + b[None, :], Z.dtype.element_ty), rstd


@triton.jit
def _row_stats(v, c_ok, C, eps):
    """LayerNorm mean and rstd ``[BLOCK_R]`` (fp32, biased variance as torch) of rows ``v [BLOCK_R, BLOCK_C]`` whose
    columns past C are masked out by ``c_ok``."""
    mean = tl.sum(v, 1) / C
    centred = tl.where(c_ok[None, :], v - mean[:, None], 0.0)
    return mean, 1.0 / tl.sqrt(tl.sum(centred * centred, 1) / C + eps)


@triton.jit
def _linear(x, W, Bias, cin, cin_ok, cout, cout_ok, Cin, HAS_BIAS: tl.constexpr):
    """``x @ W^T (+ bias)`` in fp32 ``[BLOCK_R, BLOCK_COUT]``: x ``[BLOCK_R, BLOCK_CIN]`` in W's dtype, W
    ``[Cout, Cin]`` (nn.Linear's layout) read transposed."""
    wt = tl.load(W + cout[None, :] * Cin + cin[:, None], mask=cin_ok[:, None] & cout_ok[None, :], other=0.0)
    y = dot(x, wt)  # [BLOCK_R, BLOCK_CIN] @ [BLOCK_CIN, BLOCK_COUT]
    if HAS_BIAS:
        y += tl.load(Bias + cout, mask=cout_ok, other=0.0).to(tl.float32)[None, :]
    return y


@triton.jit
def _linear_t(dy, W, cin, cin_ok, cout, cout_ok, Cin):
    """``dy @ W`` in fp32 ``[BLOCK_R, BLOCK_CIN]`` (a linear layer's input gradient): dy ``[BLOCK_R, BLOCK_COUT]``
    in W's dtype, W ``[Cout, Cin]``."""
    w = tl.load(W + cout[:, None] * Cin + cin[None, :], mask=cout_ok[:, None] & cin_ok[None, :], other=0.0)
    return dot(dy, w)  # [BLOCK_R, BLOCK_COUT] @ [BLOCK_COUT, BLOCK_CIN]


@triton.jit
def _layer_norm_bwd(dy, yhat, rstd, LnW, c, c_ok, C):
    """LayerNorm input gradient ``[BLOCK_R, BLOCK_C]`` fp32 from the output gradient dy and the normalised yhat (zero
    past C): ``rstd * (g - mean(g) - yhat * mean(g * yhat))`` with ``g = dy * weight``."""
    w = tl.load(LnW + c, mask=c_ok, other=0.0).to(tl.float32)
    g = dy * w[None, :]
    mean_g = tl.sum(g, 1) / C
    mean_gy = tl.sum(g * yhat, 1) / C
    return tl.where(c_ok[None, :], (g - mean_g[:, None] - yhat * mean_gy[:, None]) * rstd[:, None], 0.0)


@triton.jit
def _layer_norm_out(P, LnW, LnB, r, r_ok, ch, ch_ok, R, Ch, eps, dtype: tl.constexpr):
    """y = LN_out(p) of rows r of the channel-major ``P [Ch, R]``: (yhat fp32, y in ``dtype``, mean, rstd)."""
    pt = tl.load(P + ch[None, :].to(tl.int64) * R + r[:, None], mask=r_ok[:, None] & ch_ok[None, :],
                 other=0.0).to(tl.float32)  # [BLOCK_R, BLOCK_CH]
    mean, rstd = _row_stats(pt, ch_ok, Ch, eps)
    yhat = tl.where(ch_ok[None, :], (pt - mean[:, None]) * rstd[:, None], 0.0)
    w = tl.load(LnW + ch, mask=ch_ok, other=0.0).to(tl.float32)
    b = tl.load(LnB + ch, mask=ch_ok, other=0.0).to(tl.float32)
    return yhat, cast(yhat * w[None, :] + b[None, :], dtype), mean, rstd


# ---- Kernels -----------------------------------------------------------------------------------------------


@triton.jit
def _in_fwd_kernel(
    Z, Mask, Stats, LnW, LnB, Wap, Bap, Wag, Bag, Wbp, Bbp, Wbg, Bbg, A, B,
    R, N, Cz, Ch, eps, stride_i, stride_j,
    HAS_BIAS: tl.constexpr, STATS_IN: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_CZ: tl.constexpr, BLOCK_CH: tl.constexpr,
):
    """One program: a tile of BLOCK_R positions. a, b = mask * sigmoid(x W_g + b_g) * (x W_p + b_p) into the
    channel-major operands ``A, B [Ch, B, N, N]`` (positions placed by ``stride_i, stride_j``)."""
    r, r_ok, cz, cz_ok = _positions(tl.program_id(0), R, Cz, BLOCK_R, BLOCK_CZ)
    ch = tl.arange(0, BLOCK_CH)
    ch_ok = ch < Ch
    _, x, _ = _layer_norm_in(Z, Stats, LnW, LnB, r, r_ok, cz, cz_ok, Cz, eps, STATS_IN)  # x [BLOCK_R, BLOCK_CZ]
    m = tl.load(Mask + r, mask=r_ok, other=0.0).to(tl.float32)[:, None]
    a = m * tl.sigmoid(_linear(x, Wag, Bag, cz, cz_ok, ch, ch_ok, Cz, HAS_BIAS)) * _linear(
        x, Wap, Bap, cz, cz_ok, ch, ch_ok, Cz, HAS_BIAS)
    b = m * tl.sigmoid(_linear(x, Wbg, Bbg, cz, cz_ok, ch, ch_ok, Cz, HAS_BIAS)) * _linear(
        x, Wbp, Bbp, cz, cz_ok, ch, ch_ok, Cz, HAS_BIAS)
    offs = ch[None, :].to(tl.int64) * R + _op_offsets(r, N, stride_i, stride_j)[:, None]  # [BLOCK_R, BLOCK_CH]
    ok = r_ok[:, None] & ch_ok[None, :]
    tl.store(A + offs, cast(a, A.dtype.element_ty), mask=ok)
    tl.store(B + offs, cast(b, B.dtype.element_ty), mask=ok)


@triton.jit
def _product_kernel(
    X, Y, C, M, N, K,
    stride_xq, stride_xm, stride_xk, stride_yq, stride_yk, stride_yn, stride_cq, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``C[q] = X[q] @ Y[q]`` (``[M, K] @ [K, N]``) for every matrix q of three buffers read and written through the
    given strides, fp32 accumulation. One program: a BLOCK_M x BLOCK_N tile of one q."""
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
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
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
    R, Cz, Ch, eps,
    HAS_BIAS: tl.constexpr, STATS_IN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_CZ: tl.constexpr,
    BLOCK_CH: tl.constexpr,
):
    """One program: a tile of BLOCK_R positions. out = sigmoid(x W_g + b_g) * (LN_out(p) W_o + b_o), p read from the
    channel-major ``P [Ch, R]``, x recomputed from z and the LN_in statistics (read when STATS_IN, else computed and
    stored)."""
    r, r_ok, cz, cz_ok = _positions(tl.program_id(0), R, Cz, BLOCK_R, BLOCK_CZ)
    ch = tl.arange(0, BLOCK_CH)
    ch_ok = ch < Ch
    _, x, _ = _layer_norm_in(Z, Stats, LnInW, LnInB, r, r_ok, cz, cz_ok, Cz, eps, STATS_IN)
    gate = tl.sigmoid(_linear(x, Wg, Bg, cz, cz_ok, cz, cz_ok, Cz, HAS_BIAS))  # [BLOCK_R, BLOCK_CZ]
    _, y, _, _ = _layer_norm_out(P, LnOutW, LnOutB, r, r_ok, ch, ch_ok, R, Ch, eps, Z.dtype.element_ty)
    o = _linear(y, Wo, Bo, ch, ch_ok, cz, cz_ok, Ch, HAS_BIAS)  # [BLOCK_R, BLOCK_CZ]
    tl.store(Out + r[:, None] * Cz + cz[None, :], cast(gate * o, Out.dtype.element_ty),
             mask=r_ok[:, None] & cz_ok[None, :])


@triton.jit
def _out_bwd_kernel(
    Z, Stats, P, DOut, LnInW, LnInB, Wg, Bg, LnOutW, LnOutB, Wo, Bo,
    DP, DXg, Gx, Go, StatsOut, VecPart,
    R, Cz, Ch, eps, stride_gx,
    HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_CZ: tl.constexpr, BLOCK_CH: tl.constexpr,
):
    """Persistent: program k takes tiles k, k + programs, ... Per position: the output-gate logit gradient (into
    ``Gx[:, 4 Ch:]``), the output-projection gradient (``Go [R, Cz]``), dp (channel-major ``DP [Ch, R]``), the gate's
    part of dx (``DXg [R, Cz]`` fp32) and LN_out's statistics (``StatsOut [R, 2]``); per program the partial sums of
    LN_out's weight and bias gradients (``VecPart [programs, 2, BLOCK_CH]`` fp32)."""
    cz = tl.arange(0, BLOCK_CZ)
    cz_ok = cz < Cz
    ch = tl.arange(0, BLOCK_CH)
    ch_ok = ch < Ch
    dw = tl.zeros([BLOCK_CH], tl.float32)
    db = tl.zeros([BLOCK_CH], tl.float32)
    dtype = Z.dtype.element_ty
    for tile in range(tl.program_id(0), tl.cdiv(R, BLOCK_R), tl.num_programs(0)):
        r, r_ok, _, _ = _positions(tile, R, Cz, BLOCK_R, BLOCK_CZ)
        rz_ok = r_ok[:, None] & cz_ok[None, :]
        rh_ok = r_ok[:, None] & ch_ok[None, :]
        _, x, _ = _layer_norm_in(Z, Stats, LnInW, LnInB, r, r_ok, cz, cz_ok, Cz, eps, True)
        gate = tl.sigmoid(_linear(x, Wg, Bg, cz, cz_ok, cz, cz_ok, Cz, HAS_BIAS))
        yhat, y, mean, rstd = _layer_norm_out(P, LnOutW, LnOutB, r, r_ok, ch, ch_ok, R, Ch, eps, dtype)
        o = _linear(y, Wo, Bo, ch, ch_ok, cz, cz_ok, Ch, HAS_BIAS)
        dout = tl.load(DOut + r[:, None] * Cz + cz[None, :], mask=rz_ok, other=0.0).to(tl.float32)
        dgl = cast(dout * o * gate * (1.0 - gate), dtype)  # d(gate logit) [BLOCK_R, BLOCK_CZ]
        do = cast(dout * gate, dtype)  # d(projected output)
        tl.store(Gx + r[:, None] * stride_gx + 4 * Ch + cz[None, :], dgl, mask=rz_ok)
        tl.store(Go + r[:, None] * Cz + cz[None, :], do, mask=rz_ok)
        tl.store(DXg + r[:, None] * Cz + cz[None, :], _linear_t(dgl, Wg, cz, cz_ok, cz, cz_ok, Cz), mask=rz_ok)
        dy = _linear_t(do, Wo, ch, ch_ok, cz, cz_ok, Ch)  # [BLOCK_R, BLOCK_CH]
        dw += tl.sum(dy * yhat, 0)
        db += tl.sum(dy, 0)
        dp = _layer_norm_bwd(dy, yhat, rstd, LnOutW, ch, ch_ok, Ch)
        tl.store(DP + ch[None, :].to(tl.int64) * R + r[:, None], cast(dp, DP.dtype.element_ty), mask=rh_ok)
        tl.store(StatsOut + 2 * r, mean, mask=r_ok)
        tl.store(StatsOut + 2 * r + 1, rstd, mask=r_ok)
    part = VecPart + tl.program_id(0).to(tl.int64) * 2 * BLOCK_CH
    tl.store(part + ch, dw)
    tl.store(part + BLOCK_CH + ch, db)


@triton.jit
def _edge_grad(x, m, D, Wp, Bp, Wg, Bg, g_row, ok, cz, cz_ok, ch, ch_ok, Cz, HAS_BIAS: tl.constexpr):
    """One edge projection's backward on a chunk ``ch`` of hidden channels: from ``D = dA`` or ``dB`` (fp32 pointers
    ``[BLOCK_R, BLOCK_H]``) and ``e = m * sigmoid(x W_g + b_g) * (x W_p + b_p)`` recomputed, stores the gradients of
    the projection and the gate logit at ``g_row`` and ``g_row + Ch`` (``g_row`` offset by the projection's place in
    Gx) and returns their part of dx ``[BLOCK_R, BLOCK_CZ]`` fp32."""
    d_m = tl.load(D, mask=ok, other=0.0) * m
    sig = tl.sigmoid(_linear(x, Wg, Bg, cz, cz_ok, ch, ch_ok, Cz, HAS_BIAS))
    dproj = cast(d_m * sig, x.dtype)
    dgate = cast(d_m * _linear(x, Wp, Bp, cz, cz_ok, ch, ch_ok, Cz, HAS_BIAS) * sig * (1.0 - sig), x.dtype)
    tl.store(g_row[0], dproj, mask=ok)
    tl.store(g_row[1], dgate, mask=ok)
    return _linear_t(dproj, Wp, cz, cz_ok, ch, ch_ok, Cz) + _linear_t(dgate, Wg, cz, cz_ok, ch, ch_ok, Cz)


@triton.jit
def _in_bwd_kernel(
    Z, Mask, Stats, DA, DB, DXg, LnW, LnB, Wap, Bap, Wag, Bag, Wbp, Bbp, Wbg, Bbg,
    DZ, Gx, VecPart,
    R, N, Cz, Ch, eps, stride_i, stride_j, stride_gx,
    HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_CZ: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Persistent like :func:`_out_bwd_kernel`. Per position: the projection and gate logit gradients of a and b
    (into ``Gx[:, :4 Ch]``, order a_p, a_g, b_p, b_g) from dA, dB (channel-major fp32, the operand layout) and dz
    (``DZ [R, Cz]``) from them and the output gate's ``DXg``; per program the partial sums of LN_in's weight and
    bias gradients (``VecPart [programs, 2, BLOCK_CZ]`` fp32). The hidden channels are taken BLOCK_H at a time, so
    the weight tiles in registers are ``[BLOCK_CZ, BLOCK_H]``."""
    cz = tl.arange(0, BLOCK_CZ)
    cz_ok = cz < Cz
    dw = tl.zeros([BLOCK_CZ], tl.float32)
    db = tl.zeros([BLOCK_CZ], tl.float32)
    for tile in range(tl.program_id(0), tl.cdiv(R, BLOCK_R), tl.num_programs(0)):
        r, r_ok, _, _ = _positions(tile, R, Cz, BLOCK_R, BLOCK_CZ)
        rz_ok = r_ok[:, None] & cz_ok[None, :]
        xhat, x, rstd = _layer_norm_in(Z, Stats, LnW, LnB, r, r_ok, cz, cz_ok, Cz, eps, True)
        m = tl.load(Mask + r, mask=r_ok, other=0.0).to(tl.float32)[:, None]
        pos = _op_offsets(r, N, stride_i, stride_j)  # [BLOCK_R] within a channel of dA, dB
        dx = tl.load(DXg + r[:, None] * Cz + cz[None, :], mask=rz_ok, other=0.0)  # the output gate's part
        for h0 in range(0, Ch, BLOCK_H):
            ch = h0 + tl.arange(0, BLOCK_H)
            ch_ok = ch < Ch
            ok = r_ok[:, None] & ch_ok[None, :]
            op = ch[None, :].to(tl.int64) * R + pos[:, None]  # [BLOCK_R, BLOCK_H]
            g_row = Gx + r[:, None] * stride_gx + ch[None, :]
            dx += _edge_grad(x, m, DA + op, Wap, Bap, Wag, Bag, (g_row, g_row + Ch), ok, cz, cz_ok, ch, ch_ok, Cz,
                             HAS_BIAS)
            dx += _edge_grad(x, m, DB + op, Wbp, Bbp, Wbg, Bbg, (g_row + 2 * Ch, g_row + 3 * Ch), ok, cz, cz_ok, ch,
                             ch_ok, Cz, HAS_BIAS)
        dw += tl.sum(dx * xhat, 0)
        db += tl.sum(dx, 0)
        dz = _layer_norm_bwd(dx, xhat, rstd, LnW, cz, cz_ok, Cz)
        tl.store(DZ + r[:, None] * Cz + cz[None, :], cast(dz, DZ.dtype.element_ty), mask=rz_ok)
    part = VecPart + tl.program_id(0).to(tl.int64) * 2 * BLOCK_CZ
    tl.store(part + cz, dw)
    tl.store(part + BLOCK_CZ + cz, db)


@triton.jit
def _wgrad_kernel(
    G, Src, Stats, LnW, LnB, DW,
    R, M, C, rows_per_split, stride_gr, stride_sr, stride_sc,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Partial weight gradients ``DW[s, m, n] = sum_{r in split s} G[r, m] * X[r, n]`` (fp32 ``[splits, M, C]``) with
    ``X = LN(Src)`` recomputed in G's dtype from the saved statistics (``Stats [R, 2]``: mean, rstd) exactly as the
    forward rounded it; G ``[R, M]`` has unit column stride, Src is read through its strides. One program: a
    BLOCK_M x BLOCK_N tile of one split, looping over its positions BLOCK_K at a time."""
    tl.static_assert(BLOCK_M % 16 == 0 and BLOCK_N % 16 == 0 and BLOCK_K % 16 == 0, "tiles: multiples of 16 (tl.dot)")
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(C, BLOCK_N)
    tile_n = pid % num_n
    tile_m = (pid // num_n) % num_m
    split = pid // (num_n * num_m)
    ms = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cs = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, c_ok = ms < M, cs < C
    w = tl.load(LnW + cs, mask=c_ok, other=0.0).to(tl.float32)
    b = tl.load(LnB + cs, mask=c_ok, other=0.0).to(tl.float32)
    start = split.to(tl.int64) * rows_per_split
    end = tl.minimum(start + rows_per_split, R)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for r0 in range(start, end, BLOCK_K):
        r = r0 + tl.arange(0, BLOCK_K)
        r_ok = r < end
        g = tl.load(G + r[:, None] * stride_gr + ms[None, :], mask=r_ok[:, None] & m_ok[None, :], other=0.0)
        s = tl.load(Src + r[:, None] * stride_sr + cs[None, :].to(tl.int64) * stride_sc,
                    mask=r_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_N]
        mean = tl.load(Stats + 2 * r, mask=r_ok, other=0.0)
        rstd = tl.load(Stats + 2 * r + 1, mask=r_ok, other=0.0)
        xhat = tl.where(c_ok[None, :], (s - mean[:, None]) * rstd[:, None], 0.0)
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


def _forward(z: Tensor, mask: Tensor, w: dict, outgoing: bool, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """out ``[R, Cz]``, p ``[Ch, R]`` (channel-major, z's dtype) and the LN_in statistics ``[R, 2]`` fp32 of z
    ``[B, N, N, Cz]`` contiguous and mask ``[B, N, N]`` contiguous."""
    nb, n, _, cz = z.shape
    ch = w["a_proj_w"].shape[0]
    cfg = config(z.dtype, cz, ch)
    stats = torch.empty(nb * n * n, 2, dtype=torch.float32, device=z.device)
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
        HAS_BIAS=w["a_proj_b"] is not None, STATS_IN=stats_in, BLOCK_R=cfg.rows.block_m, BLOCK_CZ=cfg.block_cz,
        BLOCK_CH=cfg.block_ch, **cfg.rows.launch_options())


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
        BLOCK_R=cfg.rows.block_m, BLOCK_CZ=cfg.block_cz, BLOCK_CH=cfg.block_ch, **cfg.rows.launch_options())
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
        return torch.empty(z_rows.numel() // cz, 2, dtype=torch.float32, device=z.device)

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
    """``sum_r g[r, :]^T LN(src)[r, :]`` fp32 ``[M, C]`` of g ``[R, M]`` and src (``[R, C]`` through its strides):
    :func:`_wgrad_kernel`'s per-split partials summed in split order."""
    r, m = g.shape
    c = ln_w.shape[0]
    t = cfg.wgrad
    rows = triton.cdiv(triton.cdiv(r, WGRAD_SPLITS), WGRAD_BLOCK_K) * WGRAD_BLOCK_K  # a function of the shape only
    splits = triton.cdiv(r, rows)
    part = torch.empty(splits, m, c, dtype=torch.float32, device=g.device)
    grid = (splits * triton.cdiv(m, t.block_m) * triton.cdiv(c, t.block_n),)
    _wgrad_kernel[grid](g, src, stats, ln_w, ln_b, part, r, m, c, rows, g.stride(0), *src_strides,
                        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=WGRAD_BLOCK_K, **t.launch_options())
    return part.sum(0)


def _backward(dout: Tensor, z: Tensor, mask: Tensor, p: Tensor, stats: Tensor, w: dict, outgoing: bool,
              eps: float) -> tuple[Tensor, dict]:
    """dz ``[B, N, N, Cz]`` and the weight gradients {name: fp32 tensor} (None for absent biases)."""
    nb, n, _, cz = z.shape
    ch = p.shape[0]
    r = nb * n * n
    cfg = config(z.dtype, cz, ch)
    has_bias = w["a_proj_b"] is not None
    dev = z.device
    a, b = (torch.empty(ch, nb, n, n, dtype=z.dtype, device=dev) for _ in range(2))
    _in_projections(z, mask, stats, w, a, b, outgoing, eps, cfg, stats_in=True)  # recomputed, not saved

    blocks = dict(BLOCK_R=cfg.rows.block_m, BLOCK_CZ=cfg.block_cz, BLOCK_CH=cfg.block_ch)
    programs = min(triton.cdiv(r, cfg.rows.block_m), ROW_PROGRAMS)
    gx = torch.empty(r, 4 * ch + cz, dtype=z.dtype, device=dev)  # d(logits) of a_p, a_g, b_p, b_g, the output gate
    go = torch.empty(r, cz, dtype=z.dtype, device=dev)  # d(output projection)
    dp = torch.empty(ch, nb, n, n, dtype=z.dtype, device=dev)
    dx_gate = torch.empty(r, cz, dtype=torch.float32, device=dev)
    stats_out = torch.empty(r, 2, dtype=torch.float32, device=dev)
    ln_out_part = torch.empty(programs, 2, cfg.block_ch, dtype=torch.float32, device=dev)
    _out_bwd_kernel[(programs,)](
        z, stats, p, dout, *_pointers(w, _OUT), dp, dx_gate, gx, go, stats_out, ln_out_part, r, cz, ch, eps,
        gx.stride(0), HAS_BIAS=has_bias, **blocks, **cfg.rows.launch_options())

    da, db = (torch.empty(ch, nb, n, n, dtype=torch.float32, device=dev) for _ in range(2))
    mats = [t.view(-1, n, n) for t in (dp, a, b, da, db)]
    _product(mats[0], mats[2], mats[3], cfg)  # dA = dP @ B
    _product(mats[0].mT, mats[1], mats[4], cfg)  # dB = dP^T @ A
    del a, b, dp

    dz = torch.empty(r, cz, dtype=z.dtype, device=dev)
    t = cfg.in_bwd
    programs = min(triton.cdiv(r, t.block_m), ROW_PROGRAMS)
    ln_in_part = torch.empty(programs, 2, cfg.block_cz, dtype=torch.float32, device=dev)
    _in_bwd_kernel[(programs,)](
        z, mask, stats, da, db, dx_gate, *_pointers(w, _IN), dz, gx, ln_in_part, r, n, cz, ch, eps,
        *_op_strides(n, outgoing), gx.stride(0), HAS_BIAS=has_bias, BLOCK_R=t.block_m, BLOCK_CZ=cfg.block_cz,
        BLOCK_H=t.block_n, **t.launch_options())

    z_rows = z.view(r, cz)
    dw_x = _weight_grad(gx, z_rows, (cz, 1), stats, w["ln_in_weight"], w["ln_in_bias"], cfg)  # [4 Ch + Cz, Cz]
    dw_o = _weight_grad(go, p.view(ch, r), (1, r), stats_out, w["ln_out_weight"], w["ln_out_bias"], cfg)  # [Cz, Ch]
    ln_in, ln_out = ln_in_part.sum(0), ln_out_part.sum(0)  # [2, BLOCK_C]: weight, bias
    grads = {"ln_in_weight": ln_in[0, :cz], "ln_in_bias": ln_in[1, :cz], "ln_out_weight": ln_out[0, :ch],
             "ln_out_bias": ln_out[1, :ch], "out_proj_w": dw_o, "out_gate_w": dw_x[4 * ch:]}
    for i, name in enumerate(("a_proj", "a_gate", "b_proj", "b_gate")):
        grads[f"{name}_w"] = dw_x[i * ch:(i + 1) * ch]
    bias_rows = {"a_proj_b": gx[:, :ch], "a_gate_b": gx[:, ch:2 * ch], "b_proj_b": gx[:, 2 * ch:3 * ch],
                 "b_gate_b": gx[:, 3 * ch:4 * ch], "out_gate_b": gx[:, 4 * ch:], "out_proj_b": go}
    for name, rows in bias_rows.items():  # column sums in fp32 (torch's reductions: the same bits every run)
        grads[name] = rows.sum(0, dtype=torch.float32) if has_bias else None
    return dz.view(z.shape), grads


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
    """The triangle multiplicative update ``[*, N, N, c_z]`` of z ``[*, N, N, c_z]`` (fp16, bf16 or fp32, on a CUDA
    device or on the CPU under ``TRITON_INTERPRET=1``), differentiable in z and every weight.

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
