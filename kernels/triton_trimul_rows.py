"""The ``@triton.jit`` helpers of the triangle multiplicative update's row kernels (:mod:`.triton_trimul`): a tile of
positions, its channels taken a block at a time.

A row kernel never holds a whole channel row: every LayerNorm, projection and gradient is a loop over channel blocks
of ``STEP`` channels (a power of two >= 16), so its register tiles are ``[BLOCK_R, STEP]`` and ``[STEP, STEP]``
whatever c_z and c_hidden are. LayerNorm statistics are one pass over the blocks (each block's mean and centred sum of
squares, merged as Chan, Golub & LeVeque 1979 merge two samples' moments); the normalised values are formed again per
block where they are used. The accumulation dtype is fp32 for fp16/bf16/fp32 inputs and fp64 for fp64 inputs
(:func:`widen`); fp16/bf16 matmul operands are rounded to the input dtype as PyTorch's same-dtype path rounds them.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_common import cast
from .triton_common import dot


@triton.jit
def widen(x):
    """``x`` in the accumulation dtype: fp64 stays fp64, any other dtype becomes fp32 (exact: widening)."""
    if x.dtype == tl.float64:
        return x
    else:
        return x.to(tl.float32)


@triton.jit
def positions(tile, R, BLOCK_R: tl.constexpr):
    """Rows ``[BLOCK_R]`` (int64) of a tile of positions and rows < R."""
    tl.static_assert(BLOCK_R % 16 == 0, "tiles must be multiples of 16 (tl.dot)")
    r = tl.cast(tile, tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    return r, r < R


@triton.jit
def channels(c0, C, STEP: tl.constexpr):
    """The channel block ``c0 .. c0 + STEP`` ``[STEP]`` and channels < C."""
    tl.static_assert(STEP >= 16, "channel blocks must be at least 16 (tl.dot)")
    c = c0 + tl.arange(0, STEP)
    return c, c < C


@triton.jit
def load_block(Src, r, r_ok, c, c_ok, stride_r, stride_c):
    """The block ``Src[r, c]`` ``[BLOCK_R, STEP]`` (element ``r * stride_r + c * stride_c``, 64-bit) in the
    accumulation dtype, 0 outside the rows and channels."""
    return widen(tl.load(Src + r[:, None] * stride_r + c[None, :].to(tl.int64) * stride_c,
                         mask=r_ok[:, None] & c_ok[None, :], other=0.0))


@triton.jit
def row_stats(Src, r, r_ok, stride_r, stride_c, C, eps, STEP: tl.constexpr):
    """LayerNorm mean and rstd ``[BLOCK_R]`` (biased variance as torch) of rows r of Src over its C channels, STEP at a
    time: the first block's mean and centred sum of squares, then each further block's merged in (the blocks before
    it are full: ``c0`` channels)."""
    c, c_ok = channels(0, C, STEP)
    v = load_block(Src, r, r_ok, c, c_ok, stride_r, stride_c)
    mean = tl.sum(v, 1) / tl.minimum(C, STEP)
    centred = tl.where(c_ok[None, :], v - mean[:, None], 0.0)
    m2 = tl.sum(centred * centred, 1)
    for c0 in range(STEP, C, STEP):
        c, c_ok = channels(c0, C, STEP)
        v = load_block(Src, r, r_ok, c, c_ok, stride_r, stride_c)
        count = tl.minimum(C - c0, STEP)
        block_mean = tl.sum(v, 1) / count
        centred = tl.where(c_ok[None, :], v - block_mean[:, None], 0.0)
        delta = block_mean - mean
        mean += delta * count / (c0 + count)
        m2 += tl.sum(centred * centred, 1) + delta * delta * c0 * count / (c0 + count)
    return mean, 1.0 / tl.sqrt((m2 / C + eps).to(m2.dtype))  # eps arrives as fp64 (exact for fp64 rows)


@triton.jit
def standardised(Src, r, r_ok, c, c_ok, stride_r, stride_c, mean, rstd):
    """``(Src - mean) * rstd`` of rows r on channels c ``[BLOCK_R, STEP]`` in the accumulation dtype, 0 past C."""
    v = load_block(Src, r, r_ok, c, c_ok, stride_r, stride_c)
    return tl.where(c_ok[None, :], (v - mean[:, None]) * rstd[:, None], 0.0)


@triton.jit
def normalised(Src, r, r_ok, c0, stride_r, stride_c, C, mean, rstd, LnW, LnB, dtype: tl.constexpr,
               STEP: tl.constexpr):
    """Channels ``c0 .. c0 + STEP`` of LN(Src) of rows r ``[BLOCK_R, STEP]`` in ``dtype`` (0 past C)."""
    c, c_ok = channels(c0, C, STEP)
    xhat = standardised(Src, r, r_ok, c, c_ok, stride_r, stride_c, mean, rstd)
    w = widen(tl.load(LnW + c, mask=c_ok, other=0.0))
    b = widen(tl.load(LnB + c, mask=c_ok, other=0.0))
    return cast(xhat * w[None, :] + b[None, :], dtype)


@triton.jit
def linear(x, W, cin, cin_ok, cout, cout_ok, Cin):
    """``x @ W[cout, cin]^T`` ``[BLOCK_R, COUT]`` in the accumulation dtype: x ``[BLOCK_R, CIN]`` in W's dtype, W
    ``[Cout, Cin]`` (nn.Linear's layout) read transposed."""
    wt = tl.load(W + cout[None, :] * Cin + cin[:, None], mask=cin_ok[:, None] & cout_ok[None, :], other=0.0)
    return dot(x, wt)  # [BLOCK_R, CIN] @ [CIN, COUT]


@triton.jit
def linear_t(dy, W, cin, cin_ok, cout, cout_ok, Cin):
    """``dy @ W[cout, cin]`` ``[BLOCK_R, CIN]`` in the accumulation dtype (a linear layer's input gradient): dy
    ``[BLOCK_R, COUT]`` in W's dtype, W ``[Cout, Cin]``."""
    w = tl.load(W + cout[:, None] * Cin + cin[None, :], mask=cout_ok[:, None] & cin_ok[None, :], other=0.0)
    return dot(dy, w)  # [BLOCK_R, COUT] @ [COUT, CIN]


@triton.jit
def bias(y, Bias, c, c_ok, HAS_BIAS: tl.constexpr):
    """``y + Bias[c]`` (``y`` unchanged without biases)."""
    if HAS_BIAS:
        y += widen(tl.load(Bias + c, mask=c_ok, other=0.0))[None, :]
    return y


@triton.jit
def add_to_block(part, values, block, NB: tl.constexpr):
    """``part [NB, STEP]`` (per-channel sums of NB channel blocks) with ``values [STEP]`` added to row ``block``."""
    return part + tl.where((tl.arange(0, NB) == block)[:, None], values[None, :], 0.0)


# ---- The parts of the row kernels -------------------------------------------------------------------------


@triton.jit
def op_offsets(r, N, stride_i, stride_j):
    """Offsets ``[BLOCK_R]`` within a channel of the product's operand layout ``[c, B, N, N]`` of positions r = (b, i,
    j): ``b * N^2 + i * stride_i + j * stride_j`` ((N, 1) for outgoing edges, (1, N) for incoming)."""
    nn = N.to(tl.int64) * N
    ij = r % nn
    return (r - ij) + (ij // N) * stride_i + (ij % N) * stride_j


@triton.jit
def ln_in_stats(Z, Stats, r, r_ok, Cz, eps, STATS_IN: tl.constexpr, STEP_Z: tl.constexpr):
    """LN_in's mean and rstd ``[BLOCK_R]`` of rows r: read from ``Stats [R, 2]`` when STATS_IN, else computed over
    z's channel blocks and stored there."""
    if STATS_IN:
        mean = tl.load(Stats + 2 * r, mask=r_ok, other=0.0)
        rstd = tl.load(Stats + 2 * r + 1, mask=r_ok, other=0.0)
    else:
        mean, rstd = row_stats(Z, r, r_ok, Cz, 1, Cz, eps, STEP_Z)
        tl.store(Stats + 2 * r, mean, mask=r_ok)
        tl.store(Stats + 2 * r + 1, rstd, mask=r_ok)
    return mean, rstd


@triton.jit
def projections(Z, r, r_ok, mean, rstd, LnW, LnB, Wap, Bap, Wag, Bag, Wbp, Bbp, Wbg, Bbg, ch, ch_ok, Cz,
                 HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, STEP_Z: tl.constexpr, STEP_H: tl.constexpr):
    """The logits ``x W^T + b`` of a's and b's projections and gates on the hidden channels ch ``[BLOCK_R, STEP_H]``
    (accumulation dtype), x = LN_in(z) formed a block of c_z at a time."""
    ap = tl.zeros([BLOCK_R, STEP_H], mean.dtype)
    ag = tl.zeros([BLOCK_R, STEP_H], mean.dtype)
    bp = tl.zeros([BLOCK_R, STEP_H], mean.dtype)
    bg = tl.zeros([BLOCK_R, STEP_H], mean.dtype)
    for k0 in range(0, Cz, STEP_Z):
        ck, ck_ok = channels(k0, Cz, STEP_Z)
        x = normalised(Z, r, r_ok, k0, Cz, 1, Cz, mean, rstd, LnW, LnB, Z.dtype.element_ty, STEP_Z)
        ap += linear(x, Wap, ck, ck_ok, ch, ch_ok, Cz)
        ag += linear(x, Wag, ck, ck_ok, ch, ch_ok, Cz)
        bp += linear(x, Wbp, ck, ck_ok, ch, ch_ok, Cz)
        bg += linear(x, Wbg, ck, ck_ok, ch, ch_ok, Cz)
    return (bias(ap, Bap, ch, ch_ok, HAS_BIAS), bias(ag, Bag, ch, ch_ok, HAS_BIAS), bias(bp, Bbp, ch, ch_ok, HAS_BIAS),
            bias(bg, Bbg, ch, ch_ok, HAS_BIAS))


@triton.jit
def gate_and_output(Z, P, r, r_ok, mean, rstd, mean_o, rstd_o, LnInW, LnInB, Wg, Bg, LnOutW, LnOutB, Wo, Bo, cj,
                     cj_ok, R, Cz, Ch, HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, STEP_Z: tl.constexpr,
                     STEP_H: tl.constexpr):
    """The output gate ``sigmoid(x W_g^T + b_g)`` and the projected ``LN_out(p) W_o^T + b_o`` on the output channels
    cj ``[BLOCK_R, STEP_Z]`` (accumulation dtype), x and LN_out(p) (p channel-major ``[Ch, R]``) formed a block at a
    time from their statistics."""
    g = tl.zeros([BLOCK_R, STEP_Z], mean.dtype)
    o = tl.zeros([BLOCK_R, STEP_Z], mean.dtype)
    for k0 in range(0, Cz, STEP_Z):
        ck, ck_ok = channels(k0, Cz, STEP_Z)
        x = normalised(Z, r, r_ok, k0, Cz, 1, Cz, mean, rstd, LnInW, LnInB, Z.dtype.element_ty, STEP_Z)
        g += linear(x, Wg, ck, ck_ok, cj, cj_ok, Cz)
    for k0 in range(0, Ch, STEP_H):
        ck, ck_ok = channels(k0, Ch, STEP_H)
        y = normalised(P, r, r_ok, k0, 1, R, Ch, mean_o, rstd_o, LnOutW, LnOutB, Z.dtype.element_ty, STEP_H)
        o += linear(y, Wo, ck, ck_ok, cj, cj_ok, Ch)
    return tl.sigmoid(bias(g, Bg, cj, cj_ok, HAS_BIAS)), bias(o, Bo, cj, cj_ok, HAS_BIAS)


@triton.jit
def dx_block(G, r, r_ok, Wap, Wag, Wbp, Wbg, Wlast, ci, ci_ok, C, K0, K4, stride_g, FIVE: tl.constexpr,
             BLOCK_R: tl.constexpr, STEP_C: tl.constexpr, STEP_K0: tl.constexpr, STEP_K4: tl.constexpr):
    """Channels ci of ``G[:, :4 K0] @ [Wap; Wag; Wbp; Wbg] + G[:, 4 K0:4 K0 + K4] @ Wlast`` ``[BLOCK_R, STEP_C]``
    (the first four only when FIVE; K0 is 0 otherwise), the contraction a block at a time: G ``[R, *]`` in the
    weights' dtype, Wap..Wbg ``[K0, C]``, Wlast ``[K4, C]``."""
    acc = tl.zeros([BLOCK_R, STEP_C], tl.float64 if G.dtype.element_ty == tl.float64 else tl.float32)
    if FIVE:
        for h0 in range(0, K0, STEP_K0):
            ch, ch_ok = channels(h0, K0, STEP_K0)
            ok = r_ok[:, None] & ch_ok[None, :]
            g = G + r[:, None] * stride_g + ch[None, :]
            acc += linear_t(tl.load(g, mask=ok, other=0.0), Wap, ci, ci_ok, ch, ch_ok, C)
            acc += linear_t(tl.load(g + K0, mask=ok, other=0.0), Wag, ci, ci_ok, ch, ch_ok, C)
            acc += linear_t(tl.load(g + 2 * K0, mask=ok, other=0.0), Wbp, ci, ci_ok, ch, ch_ok, C)
            acc += linear_t(tl.load(g + 3 * K0, mask=ok, other=0.0), Wbg, ci, ci_ok, ch, ch_ok, C)
    for k0 in range(0, K4, STEP_K4):
        ck, ck_ok = channels(k0, K4, STEP_K4)
        g = tl.load(G + r[:, None] * stride_g + 4 * K0 + ck[None, :], mask=r_ok[:, None] & ck_ok[None, :], other=0.0)
        acc += linear_t(g, Wlast, ci, ci_ok, ck, ck_ok, C)
    return acc


@triton.jit
def ln_block_grad(G, Wap, Wag, Wbp, Wbg, Wlast, Src, LnW, r, r_ok, mean, rstd, c0, C, K0, K4, stride_g, stride_r,
                  stride_c, FIVE: tl.constexpr, BLOCK_R: tl.constexpr, STEP_C: tl.constexpr, STEP_K0: tl.constexpr,
                  STEP_K4: tl.constexpr):
    """A LayerNorm backward's terms on channels c0.. (STEP_C of them) of rows r: the channels (c, c_ok), dy (the row
    gradients through the weights after it, :func:`dx_block`), yhat (its standardised input) and ``g = dy * weight``,
    ``[BLOCK_R, STEP_C]`` each in the accumulation dtype."""
    c, c_ok = channels(c0, C, STEP_C)
    dy = dx_block(G, r, r_ok, Wap, Wag, Wbp, Wbg, Wlast, c, c_ok, C, K0, K4, stride_g, FIVE, BLOCK_R, STEP_C, STEP_K0,
                  STEP_K4)
    yhat = standardised(Src, r, r_ok, c, c_ok, stride_r, stride_c, mean, rstd)
    return c, c_ok, dy, yhat, dy * widen(tl.load(LnW + c, mask=c_ok, other=0.0))[None, :]
