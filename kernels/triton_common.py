"""Triton code shared by ds4sci's two fused attention kernels (:mod:`ds4sci.kernels.triton_evoformer`,
:mod:`ds4sci.kernels.triton_local_attention`), written once:

- launch parameters: :class:`Tiles`, the ``BLOCK_D`` buckets, :func:`block_d_for` and :func:`table_entry`, the one
  lookup (and domain check) of the kernels' tile tables;
- dtype handling the CPU interpreter needs: kernels call :func:`cast` for every fp32 -> fp16/bf16 cast and :func:`dot`
  for every matmul, so that a kernel run under ``TRITON_INTERPRET=1`` rounds like the compiled kernel on a GPU (up to
  the order of fp32 additions, which the GPU's MMA and fused multiply-adds change anyway). On the GPU path the
  interpreter branches are compiled out;
- :func:`online_softmax_update`, the forward kernels' per-key-tile step, whose operation order keeps the exponent
  exact whatever the GPU compiler fuses.
- :func:`tile_offsets` and :func:`tile_bounds`, the offsets and bounds masks every kernel's tiles start from (the
  ``tl.dot`` tile checks included).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .backends import TRITON_MAX_HEAD_DIM

#: q, k, v dtypes both kernels take (fp32 matmuls are IEEE, never TF32).
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: ``BLOCK_D`` buckets: every head dim 1..TRITON_MAX_HEAD_DIM rounds up to one of these (:func:`block_d_for`); each
#: kernel's tile table has one entry per bucket.
BLOCK_D_BUCKETS = (16, 32, 64, 128)
assert BLOCK_D_BUCKETS[-1] == TRITON_MAX_HEAD_DIM


def block_d_for(head_dim: int) -> int:
    """``BLOCK_D`` for a head dim: the next power of two, at least 16 (``tl.dot`` needs K >= 16)."""
    return max(16, triton.next_power_of_2(head_dim))


def table_entry(table: dict, dtype: torch.dtype, head_dim: int, kernel: str) -> tuple[int, tuple]:
    """``(BLOCK_D, table[(dtype is fp32, BLOCK_D)])`` for a kernel's tile table keyed by (fp32?, BLOCK_D), after
    checking the table's domain: ``dtype`` in :data:`SUPPORTED_DTYPES`, ``head_dim`` in 1..TRITON_MAX_HEAD_DIM
    (``kernel`` names the caller in the error)."""
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{kernel}: dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
    if not 1 <= head_dim <= TRITON_MAX_HEAD_DIM:
        raise ValueError(f"{kernel}: head dim must be in 1..{TRITON_MAX_HEAD_DIM}, got D={head_dim}")
    block_d = block_d_for(head_dim)
    return block_d, table[(dtype == torch.float32, block_d)]


@dataclass(frozen=True)
class Tiles:
    """Launch parameters of one kernel family."""

    block_m: int  # query rows per tile
    block_n: int  # key rows per tile
    num_warps: int
    num_stages: int  # software-pipelining depth of the tile loop (GPU only; the interpreter ignores it)
    # Register budget per thread handed to ptxas (None: ptxas's own heuristic). Left to itself, ptxas capped some
    # flag variants at an occupancy step (64, 72, 96 or 128 registers) and spilled 4-200 bytes; with the whole budget
    # none spills (ds4sci bench kernels-aot). The cost is occupancy where a kernel does use ~255 registers: 2 blocks
    # of 4 warps, or 1 block of 8 warps, per SM.
    maxnreg: Optional[int] = 255

    def launch_options(self) -> dict:
        options = dict(num_warps=self.num_warps, num_stages=self.num_stages)
        if self.maxnreg is not None:
            options["maxnreg"] = self.maxnreg
        return options


LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) = exp2(x * log2 e)
# Two bf16 operations the Triton interpreter (TRITON_INTERPRET=1) computes unlike a GPU, worked around here so that
# the interpreter's bf16 results are the GPU's up to summation order:
# - ``tl.dot`` on bf16 multiplies the raw uint16 bit patterns (triton-lang/triton#11584, "not supported yet"): bf16
#   operands are widened to fp32 first (exact: a product of two bf16 values is exact in fp32, and the GPU's bf16
#   MMA accumulates in fp32 too);
# - fp32 -> bf16 casts truncate, where the GPU rounds to nearest even (``cvt.rn.bf16.f32``), ``fp_downcast_rounding``
#   included: :func:`cast` rounds the fp32 value to nearest even first, after which truncation is exact.
# Read at import, when ``@triton.jit`` itself reads the variable; on the GPU path both branches are compiled out.
INTERPRETED = tl.constexpr(bool(triton.knobs.runtime.interpret))


@triton.jit
def cast(x, dtype: tl.constexpr):
    """``x.to(dtype)`` for fp32 ``x``, rounding to nearest even into bf16 under the interpreter as on the GPU.

    Rounds the bit pattern: adds ``0x7FFF`` plus the lowest kept bit and keeps the upper 16 bits (ties go to the even
    neighbour; a carry moves into the exponent, so values past the bf16 maximum become inf, and subnormals round
    like normal numbers, as on the GPU). Inputs here are never NaN (probabilities, their gradients and fp32
    accumulators of finite values)."""
    if INTERPRETED:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
            return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def dot(a, b):
    # fp32 operands: IEEE fp32 products (no TF32). fp16/bf16 operands: the flag has no effect; fp32 accumulation.
    if INTERPRETED:
        if a.dtype == tl.bfloat16:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def tile_offsets(D, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """The aranges of a tiling into BLOCK_M queries x BLOCK_N keys x BLOCK_D head-dim columns, the tiles checked for
    ``tl.dot``: query offsets ``[BLOCK_M]``, key offsets ``[BLOCK_N]``, column offsets ``[BLOCK_D]`` and columns < D."""
    tl.static_assert(BLOCK_M % 16 == 0 and BLOCK_N % 16 == 0, "tiles must be multiples of 16 (tl.dot)")
    tl.static_assert(BLOCK_D >= 16, "BLOCK_D must be at least 16 (tl.dot)")
    offs_d = tl.arange(0, BLOCK_D)
    return tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), offs_d, offs_d < D


@triton.jit
def tile_bounds(rows, S, d_ok):
    """Masks of a tile of rows ``rows [BLOCK]`` (indices into S) and head-dim columns ``d_ok [BLOCK_D]``: rows < S
    ``[BLOCK]`` and both ``[BLOCK, BLOCK_D]``."""
    ok = rows < S
    return ok, ok[:, None] & d_ok[None, :]


@triton.jit
def online_softmax_update(s, v, m_i, l_i, acc):
    """One key tile of the online softmax (Milakov & Gimelshein 2018; FlashAttention-2, Dao 2023, Algorithm 1).

    s ``[BLOCK_M, BLOCK_N]`` fp32 logits of the tile (-inf where a key is masked or invisible) and v
    ``[BLOCK_N, BLOCK_D]`` its values; m_i ``[BLOCK_M]`` the running row max (natural units, -inf before a row's first
    finite logit), l_i ``[BLOCK_M]`` the running row sum of ``exp(s - m_i)``, acc ``[BLOCK_M, BLOCK_D]`` the fp32
    unnormalised output. Returns the updated ``(m_i, l_i, acc)``.

    Every exponent is ``exp2((x - m) * log2 e)``: the max is subtracted in the unscaled domain, then one scaling. The
    GPU compiler contracts ``a*c - b`` into one fused multiply-add, so the textbook ``exp2(s*log2e - m*log2e)`` would
    become ``exp2(fma(s, log2e, -round(m*log2e)))``, whose exponent for a row at m ~ -1e9 (OpenFold's finite mask) is
    the rounding error of ``m*log2e``, up to 64 (the interpreter, rounding each operation, never shows it); ``s - m``
    is exact for ``s == m`` and no large operand reaches ``exp2``. A row whose keys so far are all -inf subtracts 0
    instead of its max, so ``exp2`` gives exact zeros (never ``-inf - -inf`` = NaN) and its sum stays 0.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2((m_i - m_sub) * LOG2E)  # rescales the old sum and accumulator
    p = tl.math.exp2((s - m_sub[:, None]) * LOG2E)  # [BLOCK_M, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(cast(p, v.dtype), v)  # [BLOCK_M, BLOCK_N] @ [BLOCK_N, BLOCK_D]
    return m_new, l_i, acc
