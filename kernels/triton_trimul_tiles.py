"""The tile table of the triangle multiplicative update's Triton kernels (:mod:`~ds4sci.kernels.triton_trimul`):
which tiles each dtype and channel count launches with, and the channel counts the kernels take."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .triton_common import SUPPORTED_DTYPES
from .triton_common import Tiles
from .triton_common import block_d_for

#: widest c_z and c_hidden, every dtype: the row kernels take the channels a block at a time (``Tiles.block_n`` of
#: the row tiles), so their register tiles are bounded by the block, not by the channel count; the bound is the
#: LayerNorm weight partials (one ``[2, 128]`` row per persistent program) and the table's buckets.
MAX_CHANNELS = 128
#: the dtypes of z and the weights: the attention kernels' and fp64 (fp64 accumulation, everything else fp32)
DTYPES = (*SUPPORTED_DTYPES, torch.float64)


@dataclass(frozen=True)
class TrimulConfig:
    block_cz: int  # c_z padded to a power of two >= 16
    block_ch: int  # c_hidden padded likewise
    rows: Tiles  # the row kernels: block_m positions per tile, block_n channels per block (the output side)
    product: Tiles  # block_m x block_n output tiles, block_k = triton_trimul.PRODUCT_BLOCK_K
    wgrad: Tiles  # block_m x block_n weight-gradient tiles, block_k = triton_trimul.WGRAD_BLOCK_K positions per step
    in_bwd: Tiles  # the input backward's tiles; block_n: channels per block on the projections' side

    # channels per block: step_z, step_h of c_z and c_hidden in the row kernels (LN_in's and LN_out's statistics, x,
    # the output's channels, LN_out's backward); proj_h, proj_z in the projections and LN_in's backward
    step_z: int
    step_h: int
    proj_h: int
    proj_z: int


def kind(dtype: torch.dtype) -> str:
    """The tile table's dtype key: ``"half"`` (fp16, bf16: tensor cores), ``"fp32"`` or ``"fp64"`` (FMA loops)."""
    return {torch.float32: "fp32", torch.float64: "fp64"}.get(dtype, "half")


# (kind, widest channel bucket) -> (row tiles, product tiles, weight-gradient tiles, input-backward tiles), chosen
# with ``ds4sci bench kernels-aot --set trimul`` so that nothing spills on sm_80 and sm_90a. fp16/bf16 (tensor
# cores) take a whole channel row as one block on the output side (16 positions from 64 channels on) and the hidden
# channels of the projections in steps: four [16, 128] logit tiles at once spilled 120-200 B at c = 128, steps of 32
# at c = 32 spilled 56 B. fp32 and fp64 matmuls are FMA loops holding a thread's rows and columns of both operands
# over the whole contraction block in registers: blocks of 16 channels (32 spilled 36-44 B in LN_in's backward).
_FMA_ROWS = (Tiles(16, 16, 4, 1), Tiles(32, 32, 4, 1), Tiles(32, 32, 4, 1))  # fp32 from 32 channels on, and fp64
TABLE: dict[tuple[str, int], tuple[Tiles, Tiles, Tiles, Tiles]] = {
    ("half", 16): (Tiles(32, 16, 4, 1), Tiles(64, 64, 4, 2), Tiles(32, 32, 4, 1), Tiles(32, 16, 4, 1)),
    ("half", 32): (Tiles(32, 32, 4, 1), Tiles(64, 64, 4, 2), Tiles(32, 32, 4, 1), Tiles(32, 16, 4, 1)),
    ("half", 64): (Tiles(16, 64, 4, 1), Tiles(64, 64, 4, 2), Tiles(64, 64, 4, 1), Tiles(16, 32, 4, 1)),
    ("half", 128): (Tiles(16, 128, 8, 1), Tiles(64, 64, 4, 2), Tiles(64, 64, 4, 1), Tiles(16, 32, 8, 1)),
    ("fp32", 16): (Tiles(32, 16, 4, 1), Tiles(32, 32, 4, 1), Tiles(32, 32, 4, 1), Tiles(32, 16, 8, 1)),
    **{("fp32", c): (*_FMA_ROWS, Tiles(16, 16, 8, 1)) for c in (32, 64, 128)},
    **{("fp64", c): (*_FMA_ROWS, Tiles(16, 16, 4, 1)) for c in (16, 32, 64, 128)},
}


def config(dtype: torch.dtype, c_z: int, c_hidden: int) -> TrimulConfig:
    """Tiles for ``dtype`` and the channel counts (see ``TABLE``); raises TypeError on an unsupported dtype and
    ValueError on a channel count outside 1..:data:`MAX_CHANNELS`."""
    if dtype not in DTYPES:
        raise TypeError(f"trimul_triton: dtype must be one of {DTYPES}, got {dtype}")
    for name, c in (("c_z", c_z), ("c_hidden", c_hidden)):
        if not 1 <= c <= MAX_CHANNELS:
            raise ValueError(f"trimul_triton: {name} must be in 1..{MAX_CHANNELS}, got {c}")
    block_cz, block_ch = block_d_for(c_z), block_d_for(c_hidden)
    rows, product, wgrad, in_bwd = TABLE[(kind(dtype), max(block_cz, block_ch))]
    return TrimulConfig(block_cz, block_ch, rows, product, wgrad, in_bwd, step_z=min(rows.block_n, block_cz),
                        step_h=min(rows.block_n, block_ch), proj_h=min(in_bwd.block_n, block_ch),
                        proj_z=min(in_bwd.block_n, block_cz))
