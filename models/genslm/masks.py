"""Threshold-based attention-mask generation.

DeepSpeed4Science's GenSLM work builds attention masks on the accelerator for sequences up to a length threshold
(16K on an A100-40GB) and on the CPU above it, then transfers the mask. ds4sci's rule (its own; upstream
Megatron-DeepSpeed has none): a boolean ``S x S`` mask may use at most 1/160 of the device's memory, so

    threshold = floor(sqrt(total_device_bytes / 160))

which is exactly 16,384 for 40 GiB. On the CPU the "accelerator" is the CPU itself, so there is no threshold.
Masks are written into one preallocated boolean tensor row-chunk by row-chunk, so peak memory stays near one mask
(``torch.tril(torch.ones(S, S))`` needs a float S x S and then a copy: 5x a boolean mask).
Pure causal attention needs no mask at all (the kernel's causal flag): :func:`make_attention_mask` returns None.
"""
from __future__ import annotations

import logging
import math

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

MASK_MEMORY_FRACTION = 160  # the mask may use 1/160 of device memory: 16K on a 40 GiB A100


def threshold_for_memory(total_bytes: int) -> int:
    """The rule: the longest S whose boolean S x S mask fits in 1/160 of ``total_bytes``."""
    return math.isqrt(total_bytes // MASK_MEMORY_FRACTION)


def mask_threshold(device: torch.device | str) -> int | None:
    """Longest key length whose mask is built on ``device`` (None: no limit, e.g. on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        return threshold_for_memory(torch.cuda.get_device_properties(device).total_memory)
    return None


def make_attention_mask(
    q_len: int,
    k_len: int,
    *,
    q_offset: int = 0,
    k_offset: int = 0,
    causal: bool = True,
    q_doc: Tensor | None = None,
    k_doc: Tensor | None = None,
    device: torch.device | str = "cpu",
    threshold: int | None | str = "auto",
    chunk_rows: int = 1024,
) -> Tensor | None:
    """Boolean attention mask ``[B or 1, 1, q_len, k_len]`` (True = may attend) on global indices.

    Query ``q_offset + i`` sees key ``k_offset + j`` iff ``j + k_offset <= i + q_offset`` (when ``causal``) and
    ``q_doc[b, i] == k_doc[b, j]`` (when document ids ``[B, q_len]``/``[B, k_len]`` are given).
    Returns None when no mask is needed (aligned pure causal attention, or no constraint at all).

    The mask is built on ``device`` when ``k_len <= threshold`` and on the CPU (then moved) above it;
    ``threshold="auto"`` uses :func:`mask_threshold`, ``None`` means no limit.
    """
    if (q_doc is None) != (k_doc is None):
        raise ValueError("q_doc and k_doc must be given together")
    if q_doc is not None and (q_doc.shape[-1] != q_len or k_doc.shape[-1] != k_len or q_doc.ndim != 2 or k_doc.ndim != 2):
        raise ValueError(f"doc ids must be [B, {q_len}] and [B, {k_len}], got {tuple(q_doc.shape)} and {tuple(k_doc.shape)}")
    if q_doc is None and (not causal or (q_offset == k_offset and q_len == k_len)):
        return None
    device = torch.device(device)
    if threshold == "auto":
        threshold = mask_threshold(device)
    build_on = device if threshold is None or k_len <= threshold else torch.device("cpu")
    if build_on != device:
        logger.debug("building a %dx%d mask on the CPU (threshold %s)", q_len, k_len, threshold)
    batch = 1 if q_doc is None else q_doc.shape[0]
    mask = torch.empty(batch, 1, q_len, k_len, dtype=torch.bool, device=build_on)
    k_pos = torch.arange(k_offset, k_offset + k_len, device=build_on)
    if q_doc is not None:
        q_doc, k_doc = q_doc.to(build_on), k_doc.to(build_on)
    for r0 in range(0, q_len, chunk_rows):
        r1 = min(q_len, r0 + chunk_rows)
        out = mask[:, 0, r0:r1]  # [B, rows, k_len]
        if causal:
            q_pos = torch.arange(q_offset + r0, q_offset + r1, device=build_on)
            torch.le(k_pos[None, :], q_pos[:, None], out=out[0])
            out[1:] = out[0]
        else:
            out.fill_(True)
        if q_doc is not None:
            out &= q_doc[:, r0:r1, None] == k_doc[:, None, :]
    return mask.to(device)
