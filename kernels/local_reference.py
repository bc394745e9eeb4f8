"""Local attention, the reference half: the protocol's checks, threshold-based masks and the ``sdpa_attention`` oracle.

The local attention protocol is stated in :mod:`ds4sci.kernels.local_attention`. This module holds what every local
attention shares and the readable path the others are tested against:

- :func:`check_qkv`: the protocol's checks (shapes, GQA, document ids) and the options' (``window``, ALiBi slopes),
  called by every local attention of ``ds4sci.kernels`` (SDPA, FlexAttention, flash-attn, the chunked path and the
  Triton kernel), so one input is rejected alike everywhere.
- :func:`attention_mask`, :data:`PAD_DOC_ID`, :func:`mask_threshold`: visibility on global indices.
- :func:`sdpa_attention`: PyTorch ``scaled_dot_product_attention``; with ``return_lse`` or ALiBi an explicit softmax in
  ``promote_types(dtype, float32)`` (the readable oracle; SDPA's fused CPU op returns a log-sum-exp without a
  gradient). Aligned pure causal attention builds no mask (SDPA's causal kernel).

Threshold-based mask generation (:func:`attention_mask`): DeepSpeed4Science's GenSLM work builds attention masks
on the accelerator up to a sequence-length threshold (16K on an A100-40GB) and on the CPU above it, then moves
them. ds4sci's rule (its own; upstream Megatron-DeepSpeed has none): a boolean ``S x S`` mask may use at most
1/160 of the device's memory, ``threshold = floor(sqrt(total_device_bytes / 160))``, exactly 16,384 for 40 GiB; on
the CPU there is no threshold. Masks are written row-chunk by row-chunk into one preallocated boolean tensor, so
peak memory stays near one mask (``torch.tril(torch.ones(S, S))`` needs a float ``S x S`` and a copy: 5x that).
Only :func:`sdpa_attention` builds ``S x S`` masks; ``chunked_attention`` (:mod:`ds4sci.kernels.local_chunked`)
builds one ``chunk x chunk`` block at a time on the tensors' device, and only for blocks a mask term cuts through.
"""
from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import Tensor

logger = logging.getLogger(__name__)

__all__ = [
    "PAD_DOC_ID",
    "check_qkv",
    "check_docs",
    "threshold_for_memory",
    "mask_threshold",
    "attention_mask",
    "empty_result",
    "sdpa_attention",
]

PAD_DOC_ID = -1
"""Document id of padding positions: real document ids are >= 0, so no real query sees a padding key."""

MASK_MEMORY_FRACTION = 160  # a mask may use 1/160 of device memory: 16K on a 40 GiB A100


def threshold_for_memory(total_bytes: int) -> int:
    """The rule: the longest S whose boolean S x S mask fits in 1/160 of ``total_bytes``."""
    return math.isqrt(total_bytes // MASK_MEMORY_FRACTION)


def mask_threshold(device: torch.device | str) -> int | None:
    """Longest key length whose mask is built on ``device`` (None: no limit, e.g. on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        return threshold_for_memory(torch.cuda.get_device_properties(device).total_memory)
    return None


def check_qkv(
    q: Tensor, k: Tensor, v: Tensor, q_doc: Tensor | None, k_doc: Tensor | None, *, window: int | None = None,
    alibi_slopes: Tensor | None = None, head_offset: int = 0,
) -> None:
    """The protocol's checks: q ``[B, Sq, H, D]``, k and v ``[B, Sk, Hkv, D]`` with ``Hkv`` dividing ``H``, document
    ids (:func:`check_docs`), ``window >= 1`` and, with ALiBi, a slope for each local head
    ``head_offset .. head_offset + H - 1``."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"expected q [B, Sq, H, D], k and v [B, Sk, Hkv, D]; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"query heads {q.shape[2]} are not a multiple of key/value heads {k.shape[2]}")
    check_docs(q_doc, k_doc, q.shape[1], k.shape[1], q.shape[0])
    _check_window(window)
    if alibi_slopes is not None and alibi_slopes.numel() < head_offset + q.shape[2]:
        raise ValueError(
            f"head_offset={head_offset} + {q.shape[2]} local heads exceeds the {alibi_slopes.numel()} ALiBi slopes"
        )


def check_docs(q_doc: Tensor | None, k_doc: Tensor | None, q_len: int, k_len: int, batch: int | None = None) -> None:
    """Both or neither of the document ids, integer ``[B, q_len]`` / ``[B, k_len]``."""
    if (q_doc is None) != (k_doc is None):
        raise ValueError("pass both q_doc and k_doc, or neither")
    if q_doc is None:
        return
    batch = q_doc.shape[0] if batch is None else batch
    if tuple(q_doc.shape) != (batch, q_len) or tuple(k_doc.shape) != (batch, k_len):
        raise ValueError(
            f"q_doc {tuple(q_doc.shape)} / k_doc {tuple(k_doc.shape)} must be [B, Sq] = {(batch, q_len)} / "
            f"[B, Sk] = {(batch, k_len)}"
        )
    if q_doc.is_floating_point() or k_doc.is_floating_point():
        raise TypeError(f"document ids must be integers, got q_doc {q_doc.dtype} / k_doc {k_doc.dtype}")


def _check_window(window: int | None) -> None:
    if window is not None and window < 1:
        raise ValueError(f"window={window} must be >= 1")


def attention_mask(
    q_len: int,
    k_len: int,
    *,
    q_offset: int = 0,
    k_offset: int = 0,
    head_offset: int = 0,
    num_heads: int = 1,
    q_doc: Tensor | None = None,
    k_doc: Tensor | None = None,
    causal: bool = False,
    window: int | None = None,
    mask: Tensor | None = None,
    device: torch.device | str = "cpu",
    threshold: int | None | str = "auto",
    chunk_rows: int = 1024,
) -> Tensor | None:
    """Boolean visibility (True = attend) of a block, evaluated on global indices; ``None`` if all visible.

    Query ``i = q_offset + a`` sees key ``j = k_offset + b`` iff all of: ``j <= i`` (causal); ``i - j < window``
    (and ``j - i < window`` without causal: a symmetric band); same document id; ``mask[..., i, j]``.

    Args:
        q_doc, k_doc: document ids ``[B, q_len]`` / ``[B, k_len]``.
        mask: explicit global mask ``[S, S]`` or ``[B|1, H_total|1, S, S]`` on global indices; the block and
            heads ``head_offset .. head_offset+num_heads-1`` are sliced from it.
        device: where the mask is used. It is built there when ``k_len <= threshold`` and on the CPU (then moved)
            above it; ``threshold="auto"`` uses :func:`mask_threshold`, ``None`` means no limit.
        chunk_rows: query rows written per step (bounds the temporaries to ``chunk_rows x k_len``).
    Returns:
        ``[B|1, H|1, q_len, k_len]`` bool on ``device``, or ``None``.
    """
    _check_window(window)
    check_docs(q_doc, k_doc, q_len, k_len)
    block = None
    if mask is not None:
        if mask.dtype != torch.bool or mask.dim() not in (2, 4):
            raise ValueError(f"mask must be bool [S, S] or [B|1, H|1, S, S]; got {mask.dtype} {tuple(mask.shape)}")
        if mask.shape[-2] < q_offset + q_len or mask.shape[-1] < k_offset + k_len:
            raise ValueError(
                f"mask {tuple(mask.shape)} does not cover queries [{q_offset}, {q_offset + q_len}) and keys "
                f"[{k_offset}, {k_offset + k_len})"
            )
        block = mask[..., q_offset : q_offset + q_len, k_offset : k_offset + k_len]
        if block.dim() == 2:
            block = block[None, None]  # [1, 1, Sq, Sk]
        elif block.shape[1] != 1:
            if block.shape[1] < head_offset + num_heads:
                raise ValueError(f"mask {tuple(mask.shape)} has no heads [{head_offset}, {head_offset + num_heads})")
            block = block[:, head_offset : head_offset + num_heads]  # [B|1, H, Sq, Sk]
    if not causal and window is None and q_doc is None and block is None:
        return None
    device = torch.device(device)
    threshold = mask_threshold(device) if threshold == "auto" else threshold
    build_on = device if threshold is None or k_len <= threshold else torch.device("cpu")
    if build_on != device:
        logger.debug("building a %dx%d mask on the CPU (threshold %s), then moving it to %s", q_len, k_len,
                     threshold, device)
    batch = max(q_doc.shape[0] if q_doc is not None else 1, block.shape[0] if block is not None else 1)
    heads = block.shape[1] if block is not None else 1
    out = torch.empty(batch, heads, q_len, k_len, dtype=torch.bool, device=build_on)
    kj = torch.arange(k_offset, k_offset + k_len, device=build_on)[None, :]  # [1, Sk] global key index
    if q_doc is not None:
        q_doc, k_doc = q_doc.to(build_on), k_doc.to(build_on)
    for r0 in range(0, q_len, chunk_rows):
        r1 = min(q_len, r0 + chunk_rows)
        rows = out[:, :, r0:r1]  # [B|1, H|1, rows, Sk]
        rows.fill_(True)
        qi = torch.arange(q_offset + r0, q_offset + r1, device=build_on)[:, None]  # [rows, 1] global query index
        if causal:
            rows &= kj <= qi
        if window is not None:
            rows &= (qi - kj < window) & (kj - qi < window)
        if q_doc is not None:
            rows &= (q_doc[:, r0:r1, None] == k_doc[:, None, :])[:, None]  # [B, 1, rows, Sk]
        if block is not None:
            rows &= block[:, :, r0:r1].to(build_on)
    return out.to(device)


def empty_result(q: Tensor, v: Tensor, return_lse: bool):
    """The result of a block no query of which sees any key: out 0 ``[B, Sq, H, D]`` (and lse -inf ``[B, H, Sq]``)."""
    B, Sq, H, _ = q.shape
    out = q.new_zeros(B, Sq, H, v.shape[-1])
    if not return_lse:
        return out
    lse = torch.full((B, H, Sq), -math.inf, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
    return out, lse


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, *, q_offset: int = 0, k_offset: int = 0, head_offset: int = 0,
                   q_doc: Tensor | None = None, k_doc: Tensor | None = None, return_lse: bool = False,
                   causal: bool = False, window: int | None = None, mask: Tensor | None = None,
                   alibi_slopes: Tensor | None = None, scale: float | None = None):
    """Softmax attention ``softmax(q k^T * scale - slope * |i - j| + mask) v`` (Vaswani et al. 2017) on one block.

    q ``[B, Sq, H, D]``, k and v ``[B, Sk, Hkv, D]`` -> out ``[B, Sq, H, D]`` (and lse ``[B, H, Sq]``); see
    :mod:`ds4sci.kernels.local_attention` for the protocol and :func:`attention_mask` for ``causal``, ``window`` and
    ``mask``.

    Args:
        alibi_slopes: ``[H_total]`` ALiBi slopes of every global head (Press et al. 2022, "Train Short, Test
            Long"); local head ``h`` uses ``alibi_slopes[head_offset + h]`` and the bias ``-slope * |i - j|`` on
            global indices, so sequence-parallel blocks see the same bias as one device.
        scale: defaults to ``1/sqrt(D)``.

    A block no query of which sees any key returns zeros without computing (ring attention relies on this to skip
    the blocks causal masking empties).
    """
    check_qkv(q, k, v, q_doc, k_doc, window=window, alibi_slopes=alibi_slopes, head_offset=head_offset)
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if causal and k_offset > q_offset + Sq - 1:  # every key is in every query's future
        return empty_result(q, v, return_lse)
    if causal and k_offset + Sk - 1 <= q_offset:  # every key at or before every query (a decode step): no mask
        causal = False
    explicit = return_lse or alibi_slopes is not None
    # Aligned pure causal attention without the lse: SDPA's causal kernel, no mask tensor at all.
    causal_kernel = (causal and not explicit and window is None and q_doc is None and mask is None
                     and q_offset == k_offset and Sq == Sk)
    visible = row_any = None
    if not causal_kernel:
        visible = attention_mask(
            Sq, Sk, q_offset=q_offset, k_offset=k_offset, head_offset=head_offset, num_heads=H, q_doc=q_doc,
            k_doc=k_doc, causal=causal, window=window, mask=mask, device=q.device,
        )
    if visible is not None:
        if not visible.any():
            return empty_result(q, v, return_lse)
        row_any = visible.any(dim=-1, keepdim=True)  # [B|1, H|1, Sq, 1]
        # Rows that see no key attend to everything (finite, NaN-free gradients), then are zeroed.
        visible = visible | ~row_any

    if not explicit:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # [B, H|Hkv, S, D]
            attn_mask=visible, is_causal=causal_kernel, scale=scale, enable_gqa=Hkv != H,
        )  # [B, H, Sq, D]
        if row_any is not None:
            out = out.masked_fill(~row_any, 0.0)
        return out.transpose(1, 2)  # [B, Sq, H, D]

    ct = torch.promote_types(q.dtype, torch.float32)
    qf = q.to(ct).transpose(1, 2)  # [B, H, Sq, D]
    kf = k.to(ct).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)  # [B, H, Sk, D], each head's rows contiguous
    vf = v.to(ct).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)  # [B, H, Sk, D]
    logits = (qf @ kf.transpose(-1, -2)) * scale  # [B, H, Sq, Sk]
    if alibi_slopes is not None:
        qi = torch.arange(q_offset, q_offset + Sq, device=q.device)[:, None]  # [Sq, 1] global query index
        kj = torch.arange(k_offset, k_offset + Sk, device=q.device)[None, :]  # [1, Sk] global key index
        slopes = alibi_slopes[head_offset : head_offset + H].to(device=q.device, dtype=ct)  # [H]
        logits = logits - slopes[:, None, None] * (qi - kj).abs().to(ct)  # [B, H, Sq, Sk]
    if visible is not None:
        logits = logits.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(logits, dim=-1)  # [B, H, Sq]
    out = torch.exp(logits - lse.unsqueeze(-1)) @ vf  # [B, H, Sq, D]
    if row_any is not None:
        out = out.masked_fill(~row_any, 0.0)
        lse = lse.masked_fill(~row_any.squeeze(-1), -math.inf)
    out = out.transpose(1, 2).to(q.dtype)  # [B, Sq, H, D]
    return (out, lse) if return_lse else out
