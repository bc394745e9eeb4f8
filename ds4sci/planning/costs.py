"""Closed forms of the bytes a rank sends or holds, shared by the planner and the benchmarks that check them.

Arithmetic only (no torch): :mod:`ds4sci.planning.genslm` composes these into its per-GPU memory and communication
model; ``ds4sci bench comm-volume`` and ``ds4sci bench memory-breakdown`` measure the real bytes and set them beside
these. Per layer, forward + backward, per rank, on ``N`` tokens of ``h`` query channels and ``kv`` key/value
channels (``Hkv' d`` with ``Hkv' = lcm(Hkv, U)`` for grouped-query attention, Ainslie et al. 2023):

- ``ulysses`` (Jacobs et al. 2023): ``4 (P-1)/P * N (h + kv) / P``;
- ``ring`` (Liu et al. 2023): ``(6 R - 4) * N kv / R``;
- ``hybrid`` (USP, Fang & Zhao 2024): Ulysses ``P/2`` x ring 2;
- ``megatron-sp`` (Korthikanti et al. 2022): ``10 (P-1)/P * N h``, 4 of it in the forward;
- ``tp-sp`` (GPT-NeoX's parallel residual shares one reduce-scatter): ``8 (P-1)/P * N h``, 3 of it in the forward.

Memory (Song et al. 2023, DeepSpeed4Science, GenSLM section): the learned position table and the attention mask.
The derivations are in ``docs/explanation/planner.md``.
"""
from __future__ import annotations

import math

__all__ = ["COMM_SCHEMES", "MASK_POLICIES", "layer_comm_bytes", "tp_forward_comm_bytes", "ulysses_kv_heads",
           "position_table_bytes", "mask_bytes"]

COMM_SCHEMES = ("ulysses", "ring", "hybrid", "megatron-sp", "tp-sp")
# tensor-parallel schemes: (forward, backward) collectives of N x h per layer, each sending (P-1)/P of it
_TP_COLLECTIVES = {"megatron-sp": (4, 6), "tp-sp": (3, 5)}
MASK_POLICIES = ("fp32-additive", "bool-device", "bool-cpu-then-device", "none (in-kernel)")


def ulysses_kv_heads(kv_heads: int, ulysses: int) -> int:
    """Key/value heads Ulysses attention of degree ``ulysses`` moves and holds: ``kv_heads``, or where the degree
    does not divide them each replicated ``U / gcd(Hkv, U)`` times first, ``lcm(Hkv, U)`` in all
    (:class:`ds4sci.sequence.DistributedAttention`'s rule, so every rank keeps the key/value heads its query heads
    read)."""
    return math.lcm(kv_heads, ulysses)


def layer_comm_bytes(scheme: str, P: int, N: float, h: float, elem: int, kv: float | None = None) -> float:
    """Bytes one rank sends per layer (forward + backward) under ``scheme`` at degree ``P`` on ``N`` tokens of ``h``
    query channels and ``kv`` key/value channels (default ``h``: multi-head attention), ``elem`` bytes per element
    (the module docstring's forms; the tensor-parallel ones move ``N x h`` activations and ignore ``kv``)."""
    kv = h if kv is None else kv
    if scheme == "ulysses":
        return 4 * (P - 1) / P * N * (h + kv) / P * elem
    if scheme == "ring":
        return (6 * P - 4) * N * kv / P * elem
    if scheme == "hybrid":
        U, R = P // 2, 2
        ring_part = (6 * R - 4) * N * kv / P * elem  # blocks of N/R tokens on kv/U channels
        return 4 * (U - 1) / U * N * (h + kv) / P * elem + ring_part
    if scheme in _TP_COLLECTIVES:
        return sum(_TP_COLLECTIVES[scheme]) * (P - 1) / P * N * h * elem
    raise ValueError(f"unknown scheme {scheme!r}; expected one of {COMM_SCHEMES}")


def tp_forward_comm_bytes(scheme: str, P: int, N: float, h: float, elem: int) -> float:
    """The forward's share of :func:`layer_comm_bytes` for a tensor-parallel ``scheme`` (``megatron-sp``, ``tp-sp``):
    what full activation checkpointing's recomputation sends again per layer."""
    if scheme not in _TP_COLLECTIVES:
        raise ValueError(f"{scheme!r} is not a tensor-parallel scheme; expected one of {tuple(_TP_COLLECTIVES)}")
    return _TP_COLLECTIVES[scheme][0] * (P - 1) / P * N * h * elem


def position_table_bytes(rows: int, hidden: int) -> int:
    """fp32 parameter + gradient + AdamW exp_avg + exp_avg_sq of a ``[rows, hidden]`` table."""
    return 16 * rows * hidden


def mask_bytes(policy: str, seq_len: int) -> dict[str, int]:
    """``{"device": bytes, "host": bytes}`` of one document mask of ``seq_len`` tokens under ``policy``."""
    S = seq_len
    return {"fp32-additive": {"device": 4 * S * S, "host": 0},
            "bool-device": {"device": S * S, "host": 0},
            "bool-cpu-then-device": {"device": S * S, "host": S * S},
            "none (in-kernel)": {"device": 8 * S, "host": 0}}[policy]
