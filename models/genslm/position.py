"""Position encodings: a learned absolute table that can hold only a rank's rows, rotary (RoPE) and ALiBi.

Positions are always an input (global position ids), never ``arange`` inside a forward, so a sequence-parallel
trainer can shard tokens, labels and positions together.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
from torch import Tensor
from torch import nn


class LearnedPositionEmbedding(nn.Module):
    """Learned absolute position table ``[max_positions, hidden]``, optionally restricted to some rows.

    Sequence-partitioned form (Megatron-DeepSpeed's sequence-parallel position embedding, generalised to any
    set of rows so the zigzag layout works): after :meth:`shard_` the module stores only the rows of the
    global positions a rank holds (parameter, gradient and optimizer state all 1/P) and looks positions up by
    their GLOBAL id. The full table is drawn first and then sliced, so a sharded module equals the matching
    rows of the unsharded one for the same seed and consumes the RNG identically.

    The sharded parameter carries ``ds4sci_sequence_sharded = True``: its rows differ per sequence-parallel
    rank, so a trainer must neither broadcast it across SP ranks nor reduce its gradient over them.
    """

    def __init__(self, max_positions: int, hidden_size: int, init_std: float = 0.02,
                 device: torch.device | str | None = None):
        super().__init__()
        self.max_positions = max_positions
        self.weight = nn.Parameter(torch.empty(max_positions, hidden_size, device=device))
        nn.init.normal_(self.weight, std=init_std)
        self.register_buffer("rows", torch.arange(max_positions), persistent=False)
        self.register_buffer("_slot", torch.arange(max_positions), persistent=False)  # global position -> row or -1

    @property
    def sharded(self) -> bool:
        return self.weight.shape[0] != self.max_positions

    @torch.no_grad()
    def shard_(self, rows: Tensor) -> "LearnedPositionEmbedding":
        """Keep only the rows of global positions ``rows [R]`` (unique, in [0, max_positions))."""
        rows = torch.as_tensor(rows, dtype=torch.long).to(self._slot.device).reshape(-1)  # buffers stay real on meta
        if rows.numel() == 0 or rows.min() < 0 or rows.max() >= self.max_positions:
            raise ValueError(f"rows must be non-empty and within [0, {self.max_positions}), got {rows.tolist()[:8]}...")
        if torch.unique(rows).numel() != rows.numel():
            raise ValueError("rows must be unique")
        src = self._slot[rows]  # where each requested row lives now
        if bool((src < 0).any()):
            raise ValueError("cannot re-shard to rows this shard does not hold; load the full table first")
        slot = torch.full((self.max_positions,), -1, dtype=torch.long, device=rows.device)
        slot[rows] = torch.arange(rows.numel(), device=rows.device)
        kept = self.weight.new_empty(rows.numel(), self.weight.shape[1]) if self.weight.is_meta else self.weight[src]
        self.weight = nn.Parameter(kept.clone())
        self.weight.ds4sci_sequence_sharded = True
        self.rows, self._slot = rows, slot
        return self

    @torch.no_grad()
    def load_full_table_(self, table: Tensor) -> None:
        """Copy this module's rows out of a full table ``[max_positions, hidden]``."""
        if table.shape != (self.max_positions, self.weight.shape[1]):
            raise ValueError(f"full table must be {(self.max_positions, self.weight.shape[1])}, "
                             f"got {tuple(table.shape)}")
        self.weight.copy_(table.to(self.weight)[self.rows])

    @staticmethod
    def assemble_full_table(shards: list[tuple[Tensor, Tensor]], max_positions: int) -> Tensor:
        """Full table ``[max_positions, hidden]`` from ``(rows [R], weight [R, hidden])`` of every shard.

        Raises if the shards do not cover every position exactly once.
        """
        hidden = shards[0][1].shape[1]
        table = torch.empty(max_positions, hidden, dtype=shards[0][1].dtype)
        seen = torch.zeros(max_positions, dtype=torch.long)
        for rows, weight in shards:
            rows = rows.cpu()
            table[rows] = weight.detach().cpu()
            seen[rows] += 1
        if not bool((seen == 1).all()):
            missing = torch.nonzero(seen != 1).reshape(-1)[:8].tolist()
            raise ValueError(f"shards do not cover every position exactly once (e.g. positions {missing})")
        return table

    def forward(self, position_ids: Tensor) -> Tensor:
        """``position_ids [B, T]`` (global) -> ``[B, T, hidden]``."""
        if position_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"position_ids must be an integer tensor, got {position_ids.dtype}")
        if position_ids.numel() and (position_ids.min() < 0 or position_ids.max() >= self.max_positions):
            raise ValueError(
                f"position ids must be in [0, {self.max_positions}), got range "
                f"[{int(position_ids.min())}, {int(position_ids.max())}]"
            )
        slot = self._slot[position_ids]
        if self.sharded and bool((slot < 0).any()):
            missing = torch.unique(position_ids[slot < 0])[:8].tolist()
            raise ValueError(f"positions {missing} are not held by this sequence shard "
                             f"(it holds {self.rows.numel()} rows)")
        return self.weight[slot]


class RotaryScaling(NamedTuple):
    """Llama-3.1's rotary frequency scaling (Grattafiori et al. 2024, "The Llama 3 Herd of Models"; transformers'
    rope_type ``"llama3"``): GenSLMConfig's ``rotary_scaling_factor``, ``rotary_low_freq_factor``,
    ``rotary_high_freq_factor`` and ``rotary_original_max_positions``."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_positions: int

    def apply(self, inv_freq: Tensor) -> Tensor:
        """``inv_freq [r/2]`` scaled: frequencies whose wavelength ``2 pi / f`` exceeds ``original / low`` are
        divided by ``factor``, those under ``original / high`` kept, those between interpolated with weight
        ``s = (original / wavelength - low) / (high - low)`` on the unscaled one."""
        wavelength = 2 * math.pi / inv_freq
        long = wavelength > self.original_max_positions / self.low_freq_factor
        short = wavelength < self.original_max_positions / self.high_freq_factor
        s = (self.original_max_positions / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        between = (1 - s) * inv_freq / self.factor + s * inv_freq
        return torch.where(long, inv_freq / self.factor, torch.where(short, inv_freq, between))


@functools.lru_cache(maxsize=64)
def _inv_freq(rotary_dim: int, base: float, scaling: RotaryScaling | None, device: torch.device) -> Tensor:
    """The rotary frequencies ``base^(-2i / rotary_dim)`` ``[rotary_dim/2]`` fp32, optionally Llama-3-scaled; computed
    once per (dims, base, scaling, device) and shared (never written): a decode step would otherwise rebuild them in
    every layer."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, device=device, dtype=torch.float32) / rotary_dim))
    return inv_freq if scaling is None else scaling.apply(inv_freq)


def rotary_cos_sin(position_ids: Tensor, rotary_dim: int, base: float, dtype: torch.dtype,
                   scaling: RotaryScaling | None = None) -> tuple[Tensor, Tensor]:
    """GPT-NeoX / Llama rotary tables for global ``position_ids [B, T]``: cos, sin ``[B, T, 1, rotary_dim]``
    (Su et al. 2021, RoFormer; half-split layout), frequencies optionally Llama-3-scaled (``scaling``)."""
    inv_freq = _inv_freq(rotary_dim, float(base), scaling, position_ids.device)  # [rotary_dim/2]
    freqs = position_ids.to(torch.float32)[..., None] * inv_freq  # [B, T, rotary_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # [B, T, 1, rotary_dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def alibi_slopes(num_heads: int) -> Tensor:
    """ALiBi head slopes ``[H]`` (Press et al. 2022, "Train Short, Test Long"): a geometric sequence
    2^(-8/n), 2^(-16/n), ... for the nearest power of two n <= H, the odd-indexed slopes of 2n filling the rest."""

    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    n = 2 ** math.floor(math.log2(num_heads))
    slopes = geometric(n)
    if n < num_heads:
        slopes += geometric(2 * n)[0::2][: num_heads - n]
    return torch.tensor(slopes, dtype=torch.float32)
