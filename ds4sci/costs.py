"""Closed forms of the bytes a rank sends or holds, shared by the planner and the benchmarks that check them.

Arithmetic only (no torch): :mod:`ds4sci.plan` composes these into its per-GPU memory and communication model;
``ds4sci bench comm-volume`` and ``ds4sci bench memory-breakdown`` measure the real bytes and set them beside these.

Communication of one GenSLM layer, forward + backward, per rank, in elements of ``N`` tokens of ``h`` query (and
output) channels and ``kv`` key (and value) channels, ``kv = h`` for multi-head attention and ``Hkv' d`` for
grouped-query attention (Ainslie et al. 2023) with ``Hkv' = lcm(Hkv, U)`` (:func:`ulysses_kv_heads`) key/value heads of
``d`` dims (:func:`layer_comm_bytes` multiplies by the element size):

- ``ulysses`` (Jacobs et al. 2023): ``4 (P-1)/P * N (h + kv) / P`` (all-to-alls of q, k, v and the output each way,
  each keeping ``1/P`` of a ``N/P`` token shard); ``8 (P-1)/P * N h / P`` for multi-head attention, constant when ``N``
  grows with ``P``, the paper's claim.
- ``ring`` (ds4sci's ring attention, Liu et al. 2023): ``[2(R-1) + 2(R-1) + 2R] * N kv / R``: keys and values travel
  ``R-1`` hops forward and again backward, their gradients ``R`` hops back to their owner; it grows with ``N``.
- ``hybrid`` (USP, Fang & Zhao 2024): Ulysses ``U = P/2`` x ring 2, the Ulysses term on ``N`` tokens plus the ring's
  on blocks of ``N/2`` tokens of ``kv/U`` channels.
- ``megatron-sp`` (Korthikanti et al. 2022): per layer, forward two all-gathers (the normalised inputs of the
  column-parallel matmuls) and two reduce-scatters (the row-parallel partial sums) of ``N x h``; backward their
  duals, two reduce-scatters and two all-gathers, and the two all-gathers again that rebuild the matmuls' inputs
  for the weight gradients (only this rank's sequence region is saved, as in Megatron-LM), ``10 (P-1)/P * N h``
  (ds4sci's tensor-parallel layers with dropout, or with Llama's sequential residual: the attention and MLP partial
  sums are reduce-scattered separately, as in Megatron-LM); ``4 (P-1)/P * N h`` of it in the forward.
- ``tp-sp`` (the same layers without dropout, ds4sci's training default): GPT-NeoX's parallel residual lets the
  attention and MLP partial sums share one reduce-scatter (and its backward all-gather), ``8 (P-1)/P * N h``, ``3
  (P-1)/P * N h`` of it in the forward.

Full activation checkpointing reruns each layer's forward, and with it the forward's collectives, before its
backward: :func:`tp_forward_comm_bytes` is what that adds under tensor parallelism (the recomputed forward saves the
region again and the backward re-gathers it as without checkpointing).

The TP layers' small all-reduce, the LayerNorm weight and bias gradients summed over TP (``4 h`` elements per
layer, ``2 (P-1)/P`` of them sent), is left out of both TP forms (the planner adds it).

Memory (Song et al. 2023, "DeepSpeed4Science Initiative", GenSLM section, singles both out at long sequences):

- learned position table (fp32): parameter + gradient + AdamW's two moments, ``16 * rows * hidden`` bytes
  (``rows = S``, or ``S/P`` with ds4sci's sequence-partitioned table);
- attention mask of one packed-document window of ``S`` tokens per policy: ``fp32-additive`` ``4 S^2`` (a dense
  additive mask), ``bool-device`` ``S^2`` built on the device, ``bool-cpu-then-device`` ``S^2`` on the host plus
  ``S^2`` on the device, ``none (in-kernel)`` the ``[S]`` int64 document ids only (``8 S``).
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
