"""The tile table of the triangle multiplicative update's Triton kernels (:mod:`~ds4sci.kernels.triton_trimul`):
which tiles each dtype and channel count launches with, and the channel counts the kernels take."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .triton_common import SUPPORTED_DTYPES
from .triton_common import Tiles
from .triton_common import block_d_for

#: widest channel count of c_z and c_hidden (a channel row is one register tile) per kind of dtype: fp32 matmuls are
#: FMA loops (IEEE, no tensor cores) holding whole operand rows of the weight tiles in registers, and spill past 32
#: channels (ds4sci bench kernels-aot). At 64, 8-warp row tiles (16 positions) make every kernel spill-free but the
#: input backward on sm_90a (140-196 B of spill stores with 16 hidden channels a step, 20 B with 8); 16 warps
#: cannot hold 255 registers a thread. At 128 the row kernels spill 2.3-5.2 KB (sm_80, 8 warps). Going further takes
#: a loop over channel blocks inside the kernels. fp16/bf16 use the tensor cores.
MAX_CHANNELS = {False: 128, True: 32}


@dataclass(frozen=True)
class TrimulConfig:
    block_cz: int  # c_z padded to a power of two >= 16
    block_ch: int  # c_hidden padded likewise
    rows: Tiles  # the row kernels: block_m positions per tile (block_n unused)
    product: Tiles  # block_m x block_n output tiles, block_k = triton_trimul.PRODUCT_BLOCK_K
    wgrad: Tiles  # block_m x block_n weight-gradient tiles, block_k = triton_trimul.WGRAD_BLOCK_K positions per step
    in_bwd: Tiles  # the input backward: block_m positions, block_n hidden channels per step (weight tiles c_z x n)


# (fp32?, widest channel bucket) -> (row tiles, product tiles, weight-gradient tiles, input-backward tiles), chosen
# with ``ds4sci bench kernels-aot --set trimul`` so that nothing spills on sm_80 and sm_90a. A row tile holds x, four
# projection tiles and a weight tile: 16 positions from 64 channels on. The input backward (the most live tiles:
# x, its normalised form, dx and four projections) takes the hidden channels in steps: its 128 x 128 weight tiles
# spilled at c = 128, steps of 32 at c = 32 spilled 56 B (bf16) and fp32 needs 8 warps.
TABLE: dict[tuple[bool, int], tuple[Tiles, Tiles, Tiles, Tiles]] = {
    (False, 16): (Tiles(32, 16, 4, 1), Tiles(64, 64, 4, 2), Tiles(32, 32, 4, 1), Tiles(32, 16, 4, 1)),
    (False, 32): (Tiles(32, 16, 4, 1), Tiles(64, 64, 4, 2), Tiles(32, 32, 4, 1), Tiles(32, 16, 4, 1)),
    (False, 64): (Tiles(16, 16, 4, 1), Tiles(64, 64, 4, 2), Tiles(64, 64, 4, 1), Tiles(16, 32, 4, 1)),
    (False, 128): (Tiles(16, 16, 8, 1), Tiles(64, 64, 4, 2), Tiles(64, 64, 4, 1), Tiles(16, 32, 8, 1)),
    (True, 16): (Tiles(32, 16, 4, 1), Tiles(32, 32, 4, 1), Tiles(32, 32, 4, 1), Tiles(32, 16, 8, 1)),
    (True, 32): (Tiles(16, 16, 4, 1), Tiles(32, 32, 4, 1), Tiles(32, 32, 4, 1), Tiles(16, 16, 8, 1)),
}
assert all(c <= MAX_CHANNELS[fp32] for fp32, c in TABLE)


def config(dtype: torch.dtype, c_z: int, c_hidden: int) -> TrimulConfig:
    """Tiles for ``dtype`` and the channel counts (see ``TABLE``); raises TypeError on an unsupported dtype and
    ValueError on a channel count outside 1..:data:`MAX_CHANNELS` of the dtype."""
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"trimul_triton: dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
    widest = MAX_CHANNELS[dtype == torch.float32]
    for name, c in (("c_z", c_z), ("c_hidden", c_hidden)):
        if not 1 <= c <= widest:
            raise ValueError(f"trimul_triton: {name} must be in 1..{widest} in {dtype}, got {c}")
    block_cz, block_ch = block_d_for(c_z), block_d_for(c_hidden)
    return TrimulConfig(block_cz, block_ch, *TABLE[(dtype == torch.float32, max(block_cz, block_ch))])
