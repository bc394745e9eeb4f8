"""Local attention: the one single-device implementation of the ds4sci local attention protocol.

Everything that attends within one device goes through here: GenSLM's attention core binds it (causal, ALiBi
slopes), and :class:`ds4sci.sequence.DistributedAttention` wraps it for Ulysses, ring and Unified sequence
parallelism. A local attention is a callable::

    local_attention(q, k, v, *, q_offset=0, k_offset=0, head_offset=0, q_doc=None, k_doc=None, return_lse=False)

- q ``[B, Sq, H, D]``, k and v ``[B, Sk, Hkv, D]`` (``Hkv`` divides ``H``: GQA/MQA, query head ``h`` uses key/value
  head ``h // (H/Hkv)``), each one contiguous block of the sequence.
- ``q_offset`` / ``k_offset``: global sequence index of the first query / key row; masks and position biases are
  evaluated on global indices (causal: query ``i`` sees key ``j`` iff ``j <= i``).
- ``head_offset``: global index of local head 0 (per-head masks, ALiBi slopes).
- ``q_doc`` / ``k_doc``: optional int ``[B, Sq]`` / ``[B, Sk]`` document ids (packed sequences): a query sees a
  key only if both carry the same id; padding carries :data:`PAD_DOC_ID`.
- returns out ``[B, Sq, H, D]``, or with ``return_lse=True`` ``(out, lse)``, lse ``[B, H, Sq]`` the natural
  log-sum-exp of the scaled (and biased) logits, in ``promote_types(dtype, float32)`` (float32, or float64 for
  float64 inputs, so that merging blocks keeps float64 exact). Rows that see no key: ``lse = -inf``, ``out = 0``.
  Ring attention backpropagates through the lse, so it carries autograd history when q, k, v do.

Options beyond the protocol (``causal``, ``window``, ``mask``, ``alibi_slopes``, ``scale``) are keyword arguments;
bind them with ``functools.partial(memory_efficient_attention, causal=True)``.

- :func:`memory_efficient_attention`: the default (GenSLM's core binds it). One entry point, no ``S x S`` tensor on
  any path: flash-attn where it can express the call, the Triton kernel
  (``ds4sci.kernels.triton_local_attention``) on CUDA otherwise, :func:`chunked_attention` elsewhere
  (:func:`select_backend` states the rule; ``backend=`` forces one of :data:`ATTENTION_BACKENDS`).
- :func:`chunked_attention`: FlashAttention-2's online softmax over (query chunk x key chunk) blocks in PyTorch,
  with a recomputing backward (also through the lse); every option, O(S * chunk) memory, any device.
- :func:`sdpa_attention`: PyTorch ``scaled_dot_product_attention``; with ``return_lse`` or ALiBi an explicit
  softmax in ``promote_types(dtype, float32)`` (the readable oracle; SDPA's fused CPU op returns a log-sum-exp
  without a gradient). Aligned pure causal attention builds no mask (SDPA's causal kernel).
- :func:`flex_attention`: FlexAttention with a block mask (causal, sliding window, documents). Its backward is
  not implemented on the CPU (PyTorch raises ``NotImplementedError``); use it for GPU training or CPU inference.
- :func:`flash_attention`: flash-attn's ``flash_attn_func`` when importable (GPU, fp16/bf16).

Threshold-based mask generation (:func:`attention_mask`): DeepSpeed4Science's GenSLM work builds attention masks
on the accelerator up to a sequence-length threshold (16K on an A100-40GB) and on the CPU above it, then moves
them. ds4sci's rule (its own; upstream Megatron-DeepSpeed has none): a boolean ``S x S`` mask may use at most
1/160 of the device's memory, ``threshold = floor(sqrt(total_device_bytes / 160))``, exactly 16,384 for 40 GiB; on
the CPU there is no threshold. Masks are written row-chunk by row-chunk into one preallocated boolean tensor, so
peak memory stays near one mask (``torch.tril(torch.ones(S, S))`` needs a float ``S x S`` and a copy: 5x that).
Only :func:`sdpa_attention` builds ``S x S`` masks; :func:`chunked_attention` builds one ``chunk x chunk`` block at a
time on the tensors' device, and only for blocks a mask term cuts through.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

logger = logging.getLogger(__name__)

__all__ = [
    "PAD_DOC_ID",
    "threshold_for_memory",
    "mask_threshold",
    "attention_mask",
    "sdpa_attention",
    "flex_attention",
    "flash_attention",
    "flash_causal_mode",
    "chunked_attention",
    "ATTENTION_BACKENDS",
    "select_backend",
    "memory_efficient_attention",
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


def _check_qkv(q: Tensor, k: Tensor, v: Tensor, q_doc: Tensor | None, k_doc: Tensor | None) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"expected q [B, Sq, H, D], k and v [B, Sk, Hkv, D]; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"query heads {q.shape[2]} are not a multiple of key/value heads {k.shape[2]}")
    _check_docs(q_doc, k_doc, q.shape[1], k.shape[1], q.shape[0])


def _check_docs(q_doc: Tensor | None, k_doc: Tensor | None, q_len: int, k_len: int, batch: int | None = None) -> None:
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
    if window is not None and window < 1:
        raise ValueError(f"window={window} must be >= 1")
    _check_docs(q_doc, k_doc, q_len, k_len)
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


def _empty_result(q: Tensor, v: Tensor, return_lse: bool):
    B, Sq, H, _ = q.shape
    out = q.new_zeros(B, Sq, H, v.shape[-1])
    if not return_lse:
        return out
    lse = torch.full((B, H, Sq), -math.inf, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
    return out, lse


def sdpa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    q_offset: int = 0,
    k_offset: int = 0,
    head_offset: int = 0,
    q_doc: Tensor | None = None,
    k_doc: Tensor | None = None,
    return_lse: bool = False,
    causal: bool = False,
    window: int | None = None,
    mask: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    scale: float | None = None,
):
    """Softmax attention ``softmax(q k^T * scale - slope * |i - j| + mask) v`` (Vaswani et al. 2017) on one block.

    q ``[B, Sq, H, D]``, k and v ``[B, Sk, Hkv, D]`` -> out ``[B, Sq, H, D]`` (and lse ``[B, H, Sq]``); see the
    module docstring for the protocol and :func:`attention_mask` for ``causal``, ``window`` and ``mask``.

    Args:
        alibi_slopes: ``[H_total]`` ALiBi slopes of every global head (Press et al. 2022, "Train Short, Test
            Long"); local head ``h`` uses ``alibi_slopes[head_offset + h]`` and the bias ``-slope * |i - j|`` on
            global indices, so sequence-parallel blocks see the same bias as one device.
        scale: defaults to ``1/sqrt(D)``.

    A block no query of which sees any key returns zeros without computing (ring attention relies on this to skip
    the blocks causal masking empties).
    """
    _check_qkv(q, k, v, q_doc, k_doc)
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if alibi_slopes is not None and alibi_slopes.numel() < head_offset + H:
        raise ValueError(f"head_offset={head_offset} + {H} local heads exceeds the {alibi_slopes.numel()} ALiBi slopes")
    if causal and k_offset > q_offset + Sq - 1:  # every key is in every query's future
        return _empty_result(q, v, return_lse)
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
            return _empty_result(q, v, return_lse)
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
    kf = k.to(ct).repeat_interleave(H // Hkv, dim=2).transpose(1, 2)  # [B, H, Sk, D]
    vf = v.to(ct).repeat_interleave(H // Hkv, dim=2).transpose(1, 2)  # [B, H, Sk, D]
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


def flex_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_offset: int = 0,
    k_offset: int = 0,
    head_offset: int = 0,
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
    return_lse: bool = False,
    causal: bool = False,
    window: int | None = None,
    scale: float | None = None,
    block_size: int = 128,
    compile: bool | None = None,
):
    """FlexAttention (PyTorch ``torch.nn.attention.flex_attention``) with a block mask on global indices.

    Same protocol and mask semantics as :func:`sdpa_attention` (``causal``, ``window``, documents), expressed as
    a ``mask_mod`` so fully masked tiles of ``block_size`` are skipped. ``compile=None`` compiles on GPUs and
    runs eagerly on the CPU (where FlexAttention has no backward: PyTorch raises ``NotImplementedError``).
    ``head_offset`` is accepted for the protocol; these masks do not depend on the head.
    """
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as _flex

    _check_qkv(q, k, v, q_doc, k_doc)
    if window is not None and window < 1:
        raise ValueError(f"window={window} must be >= 1")
    B, Sq, H, _ = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    if causal and k_offset > q_offset + Sq - 1:
        return _empty_result(q, v, return_lse)

    def mask_mod(b, h, q_idx, kv_idx):
        i, j = q_idx + q_offset, kv_idx + k_offset  # global indices
        keep = i >= 0  # all True, as a tensor
        if causal:
            keep = keep & (j <= i)
        if window is not None:
            keep = keep & (i - j < window) & (j - i < window)
        if q_doc is not None:
            keep = keep & (q_doc[b, q_idx] == k_doc[b, kv_idx])
        return keep

    needs_mask = causal or window is not None or q_doc is not None
    block_mask = (
        create_block_mask(mask_mod, B if q_doc is not None else None, None, Sq, Sk, device=q.device,
                          BLOCK_SIZE=block_size)
        if needs_mask else None
    )
    use_compile = q.is_cuda if compile is None else compile
    fn = torch.compile(_flex) if use_compile else _flex
    out, aux = fn(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # [B, H|Hkv, S, D]
        block_mask=block_mask, scale=scale, enable_gqa=Hkv != H, return_aux=AuxRequest(lse=True),
    )
    out = out.transpose(1, 2)  # [B, Sq, H, D]
    if not return_lse:
        return out
    return out, aux.lse.to(torch.promote_types(q.dtype, torch.float32))  # [B, H, Sq]


def flash_causal_mode(q_offset: int, q_len: int, k_offset: int, k_len: int) -> str:
    """How a causal block maps onto flash-attn's bottom-right-aligned ``causal`` flag.

    Returns ``"empty"`` (every key after every query), ``"full"`` (every key at or before every query),
    ``"causal"`` (flash's mask equals the global one: ``q_offset + q_len == k_offset + k_len``), or
    ``"unsupported"``.
    """
    if k_offset > q_offset + q_len - 1:
        return "empty"
    if k_offset + k_len - 1 <= q_offset:
        return "full"
    if q_offset + q_len == k_offset + k_len:
        return "causal"
    return "unsupported"


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_offset: int = 0,
    k_offset: int = 0,
    head_offset: int = 0,
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
    return_lse: bool = False,
    causal: bool = False,
    scale: float | None = None,
):
    """flash-attn 2 (Dao 2023) ``flash_attn_func`` on one block (GPU, fp16/bf16, same ``[B, S, H, D]`` layout).

    Causal blocks are mapped with :func:`flash_causal_mode`. Not supported (``NotImplementedError``): document
    ids (use flash-attn's varlen API or :func:`flex_attention`) and causal blocks whose mask is not
    bottom-right aligned. flash-attn returns its lse without a gradient, so it serves Ulysses and ring inference,
    not ring training. Untested in ds4sci's CI (no GPU); the offset mapping is tested.
    """
    try:
        from flash_attn import flash_attn_func
    except ImportError as err:
        raise ImportError("flash_attention needs the flash-attn package (pip install flash-attn)") from err
    _check_qkv(q, k, v, q_doc, k_doc)
    if q_doc is not None:
        raise NotImplementedError("flash_attention does not take document ids; use flex_attention")
    mode = flash_causal_mode(q_offset, q.shape[1], k_offset, k.shape[1]) if causal else "full"
    if mode == "empty":
        return _empty_result(q, v, return_lse)
    if mode == "unsupported":
        raise NotImplementedError(
            f"flash_attention: causal block q [{q_offset}, {q_offset + q.shape[1]}) x k [{k_offset}, "
            f"{k_offset + k.shape[1]}) is not bottom-right aligned"
        )
    result = flash_attn_func(q, k, v, softmax_scale=scale, causal=mode == "causal", return_attn_probs=return_lse)
    if not return_lse:
        return result
    out, lse = result[0], result[1]  # [B, Sq, H, D], [B, H, Sq] float32
    return out, lse.to(torch.promote_types(q.dtype, torch.float32))


# ------------------------------------------------------------------------------------------------ chunked attention
@dataclass(frozen=True)
class _Block:
    """One (query chunk x key chunk) block that some query of which may see: local row/column ranges and the
    mask terms that actually cut through it (a term that keeps every pair of the block is dropped)."""

    r0: int
    r1: int
    c0: int
    c1: int
    causal: bool
    window: bool
    docs: bool


@dataclass(frozen=True)
class _ChunkSpec:
    q_offset: int
    k_offset: int
    head_offset: int
    causal: bool
    window: int | None
    scale: float
    blocks: tuple[tuple[_Block, ...], ...]  # per query chunk, its blocks in key order


def _chunk_ranges(doc: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
    """Per batch row and chunk of ``doc [B, S]``: (min id, max id), each ``[B, n_chunks]``."""
    B, S = doc.shape
    pad = -S % chunk
    lo = F.pad(doc, (0, pad), value=torch.iinfo(doc.dtype).max).view(B, -1, chunk).amin(-1)  # [B, n]
    hi = F.pad(doc, (0, pad), value=torch.iinfo(doc.dtype).min).view(B, -1, chunk).amax(-1)  # [B, n]
    return lo, hi


def _plan_blocks(Sq: int, Sk: int, chunk: int, q_offset: int, k_offset: int, causal: bool, window: int | None,
                 q_doc: Tensor | None, k_doc: Tensor | None) -> tuple[tuple[_Block, ...], ...]:
    """The blocks of a ``Sq x Sk`` attention that are not entirely invisible, and the mask terms each needs.

    Skipped: causal blocks whose first key is after their last query; window blocks whose nearest pair is
    ``window`` or more apart; document blocks whose query and key id ranges ``[min, max]`` do not meet (any ids;
    tight for the non-decreasing ids of packed sequences, where only the chunks holding padding widen).
    """
    docs_apart = docs_same = None
    if q_doc is not None:
        qlo, qhi = _chunk_ranges(q_doc, chunk)  # [B, nq]
        klo, khi = _chunk_ranges(k_doc, chunk)  # [B, nk]
        apart = (qhi[:, :, None] < klo[:, None, :]) | (khi[:, None, :] < qlo[:, :, None])  # [B, nq, nk]
        same = (qlo == qhi)[:, :, None] & (klo == khi)[:, None, :] & (qlo[:, :, None] == klo[:, None, :])
        docs_apart, docs_same = apart.all(0).tolist(), same.all(0).tolist()  # one host transfer each
    plan = []
    for a, r0 in enumerate(range(0, Sq, chunk)):
        r1 = min(Sq, r0 + chunk)
        i0, i1 = q_offset + r0, q_offset + r1 - 1  # first and last global query of the chunk
        row = []
        for b, c0 in enumerate(range(0, Sk, chunk)):
            c1 = min(Sk, c0 + chunk)
            j0, j1 = k_offset + c0, k_offset + c1 - 1  # first and last global key
            if causal and j0 > i1:
                break  # this key chunk and every later one lie after every query
            if window is not None and max(i0 - j1, j0 - i1) >= window:
                continue  # the nearest pair is out of the band
            if docs_apart is not None and docs_apart[a][b]:
                continue
            row.append(_Block(
                r0, r1, c0, c1,
                causal=causal and j1 > i0,
                window=window is not None and max(i1 - j0, j1 - i0) >= window,
                docs=docs_same is not None and not docs_same[a][b],
            ))
        plan.append(tuple(row))
    return tuple(plan)


def _block_logits(qb: Tensor, k: Tensor, blk: _Block, spec: _ChunkSpec, q_doc, k_doc, mask, slopes, ct, H):
    """Scaled, biased and masked logits of one block, and its key block.

    qb ``[B, Hkv, G*cq, D]`` (rows ordered group-major) -> s ``[B, Hkv, G, cq, ck]`` in ``ct``, kb ``[B, Hkv, ck, D]``.
    """
    B, Hkv = qb.shape[0], qb.shape[1]
    G, cq, ck = H // Hkv, blk.r1 - blk.r0, blk.c1 - blk.c0
    kb = k[:, blk.c0 : blk.c1].to(ct).transpose(1, 2)  # [B, ck, Hkv, D] -> [B, Hkv, ck, D]
    s = (qb @ kb.transpose(-1, -2)).mul_(spec.scale).view(B, Hkv, G, cq, ck)  # [B, Hkv, G, cq, ck]
    i0, j0 = spec.q_offset + blk.r0, spec.k_offset + blk.c0  # global index of the block's first query, key
    if slopes is not None:
        qi = torch.arange(i0, i0 + cq, device=qb.device)[:, None]  # [cq, 1] global query index
        kj = torch.arange(j0, j0 + ck, device=qb.device)[None, :]  # [1, ck] global key index
        s.sub_(slopes[:, :, None, None] * (qi - kj).abs().to(ct))  # slopes [Hkv, G] -> bias [Hkv, G, cq, ck]
    visible = None
    if blk.causal or blk.window or blk.docs or mask is not None:
        visible = attention_mask(
            cq, ck, q_offset=i0, k_offset=j0, head_offset=spec.head_offset, num_heads=H,
            q_doc=q_doc[:, blk.r0 : blk.r1] if blk.docs else None,
            k_doc=k_doc[:, blk.c0 : blk.c1] if blk.docs else None,
            causal=blk.causal, window=spec.window if blk.window else None, mask=mask, device=qb.device,
            threshold=None, chunk_rows=cq,
        )  # [B|1, H|1, cq, ck], chunk-sized: built where it is used
    if visible is not None:
        if visible.shape[1] == 1:
            visible = visible.unsqueeze(2)  # [B|1, 1, 1, cq, ck]
        else:
            visible = visible.view(visible.shape[0], Hkv, G, cq, ck)  # head h = kv_head * G + g
        s.masked_fill_(~visible, -math.inf)
    return s, kb


def _group_rows(x: Tensor, Hkv: int, ct) -> Tensor:
    """``[B, c, H, D]`` -> ``[B, Hkv, G*c, D]`` in ``ct``: query head ``h = kv_head * G + g``, rows group-major."""
    B, c, H, D = x.shape
    x = x.to(ct).view(B, c, Hkv, H // Hkv, D)  # [B, c, Hkv, G, D]
    return x.permute(0, 2, 3, 1, 4).reshape(B, Hkv, -1, D)  # [B, Hkv, G*c, D]


def _ungroup_rows(x: Tensor, c: int) -> Tensor:
    """Inverse of :func:`_group_rows` (without the cast): ``[B, Hkv, G*c, D]`` -> ``[B, c, H, D]``."""
    B, Hkv, _, D = x.shape
    return x.view(B, Hkv, -1, c, D).permute(0, 3, 1, 2, 4).reshape(B, c, -1, D)


class _ChunkedAttention(torch.autograd.Function):
    """Online-softmax attention over (query chunk x key chunk) blocks with a recomputing backward.

    Forward (FlashAttention-2, Dao 2023, Algorithm 1; online softmax of Milakov & Gimelshein 2018): per query
    chunk a running max ``m``, sum ``l`` and unnormalised output; per key block ``p = exp(s - m_safe)`` with
    the max subtracted from the finished logits (``m_safe = 0`` while a row has seen no key, so never
    ``-inf - -inf``). Backward (FlashAttention-2, Algorithm 2): recompute ``P = exp(s - lse)`` block by block;
    ``dS = P * (dP - delta + dlse)`` with ``delta = rowsum(dO * O)`` and ``dlse`` the gradient of the returned lse.
    Saved: q, k, v, out (in the compute dtype, so ``delta`` carries no extra rounding), lse, document ids, mask.
    """

    @staticmethod
    def forward(ctx, q, k, v, q_doc, k_doc, mask, slopes, spec: _ChunkSpec):
        ct = torch.promote_types(q.dtype, torch.float32)
        B, Sq, H, D = q.shape
        Hkv = k.shape[2]
        G = H // Hkv
        out = torch.zeros(B, Sq, H, v.shape[-1], dtype=ct, device=q.device)  # [B, Sq, H, D]
        lse = torch.full((B, H, Sq), -math.inf, dtype=ct, device=q.device)  # [B, H, Sq]
        for blocks in spec.blocks:
            if not blocks:
                continue  # the chunk's queries see no key: out 0, lse -inf
            r0, r1 = blocks[0].r0, blocks[0].r1
            cq = r1 - r0
            qb = _group_rows(q[:, r0:r1], Hkv, ct)  # [B, Hkv, G*cq, D]
            m = torch.full((B, Hkv, G, cq), -math.inf, dtype=ct, device=q.device)  # running row max
            m_safe = torch.zeros_like(m)  # m where finite, 0 for rows that have seen no key yet
            l = torch.zeros_like(m)  # running sum of exp(s - m_safe)
            acc = torch.zeros(B, Hkv, G * cq, v.shape[-1], dtype=ct, device=q.device)  # unnormalised output
            for blk in blocks:
                s, _ = _block_logits(qb, k, blk, spec, q_doc, k_doc, mask, slopes, ct, H)  # [B, Hkv, G, cq, ck]
                m_new = torch.maximum(m, s.amax(-1))  # [B, Hkv, G, cq]
                m_new_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
                p = torch.exp(s - m_new_safe[..., None])  # masked logits -> exp(-inf) = 0
                alpha = torch.exp(m - m_new_safe)  # rescales the old sums; 0 while a row has seen no key
                l = l * alpha + p.sum(-1)
                vb = v[:, blk.c0 : blk.c1].to(ct).transpose(1, 2)  # [B, Hkv, ck, D]
                acc = acc * alpha.reshape(B, Hkv, G * cq, 1) + p.view(B, Hkv, G * cq, -1) @ vb
                m, m_safe = m_new, m_new_safe
            seen = l > 0  # l >= 1 for a row that saw a key (its max contributes exp(0))
            l_safe = torch.where(seen, l, torch.ones_like(l))
            acc = acc / l_safe.reshape(B, Hkv, G * cq, 1)  # rows that saw nothing stay 0
            out[:, r0:r1] = _ungroup_rows(acc, cq)  # [B, cq, H, D]
            lse[:, :, r0:r1] = torch.where(seen, m_safe + torch.log(l_safe), m).reshape(B, H, cq)  # -inf unseen
        ctx.spec = spec
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse, q_doc, k_doc, mask, slopes)
        return out.to(q.dtype), lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, q_doc, k_doc, mask, slopes = ctx.saved_tensors
        spec: _ChunkSpec = ctx.spec
        ct = out.dtype
        B, Sq, H, D = q.shape
        Hkv = k.shape[2]
        G = H // Hkv
        dq = torch.zeros(B, Sq, H, D, dtype=ct, device=q.device)
        dk = torch.zeros(B, Hkv, k.shape[1], D, dtype=ct, device=q.device)  # [B, Hkv, Sk, D]
        dv = torch.zeros(B, Hkv, v.shape[1], v.shape[-1], dtype=ct, device=q.device)
        if grad_out is None and grad_lse is None:
            return dq.to(q.dtype), dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype), *([None] * 5)
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out.to(ct)  # [B, Sq, H, D]
        # delta - dlse per row: dS = P * (dP - (delta - dlse))
        corr = (grad_out * out).sum(-1).transpose(1, 2)  # [B, H, Sq]
        if grad_lse is not None:
            corr = corr - torch.where(torch.isneginf(lse), torch.zeros_like(grad_lse), grad_lse.to(ct))
        lse_safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)  # unseen rows: P = exp(-inf) = 0
        for blocks in spec.blocks:
            if not blocks:
                continue
            r0, r1 = blocks[0].r0, blocks[0].r1
            cq = r1 - r0
            qb = _group_rows(q[:, r0:r1], Hkv, ct)  # [B, Hkv, G*cq, D]
            dob = _group_rows(grad_out[:, r0:r1], Hkv, ct)  # [B, Hkv, G*cq, D]
            lse_b = lse_safe[:, :, r0:r1].reshape(B, Hkv, G, cq, 1)
            corr_b = corr[:, :, r0:r1].reshape(B, Hkv, G, cq, 1)
            dqb = torch.zeros_like(qb)
            for blk in blocks:
                s, kb = _block_logits(qb, k, blk, spec, q_doc, k_doc, mask, slopes, ct, H)  # [B, Hkv, G, cq, ck]
                p = torch.exp(s - lse_b)  # [B, Hkv, G, cq, ck]
                vb = v[:, blk.c0 : blk.c1].to(ct).transpose(1, 2)  # [B, Hkv, ck, D]
                p_rows = p.view(B, Hkv, G * cq, -1)  # [B, Hkv, G*cq, ck]
                dv[:, :, blk.c0 : blk.c1] += p_rows.transpose(-1, -2) @ dob  # sums the G query heads of a kv head
                dp = (dob @ vb.transpose(-1, -2)).view_as(p)  # [B, Hkv, G, cq, ck]
                ds = (p * (dp - corr_b)).view(B, Hkv, G * cq, -1).mul_(spec.scale)  # d loss / d (q k^T)
                dqb += ds @ kb
                dk[:, :, blk.c0 : blk.c1] += ds.transpose(-1, -2) @ qb
            dq[:, r0:r1] = _ungroup_rows(dqb, cq)
        return dq.to(q.dtype), dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype), *([None] * 5)


DEFAULT_CHUNK_SIZE = 256  # rows and keys per block: B*H*256*256 fp32 logits (16 MiB at B*H = 64) per temporary


def chunked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    q_offset: int = 0,
    k_offset: int = 0,
    head_offset: int = 0,
    q_doc: Tensor | None = None,
    k_doc: Tensor | None = None,
    return_lse: bool = False,
    causal: bool = False,
    window: int | None = None,
    mask: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    scale: float | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
):
    """Memory-efficient attention in PyTorch: :func:`sdpa_attention`'s semantics without any ``Sq x Sk`` tensor.

    q ``[B, Sq, H, D]``, k and v ``[B, Sk, Hkv, D]`` -> out ``[B, Sq, H, D]`` (and lse ``[B, H, Sq]`` in
    ``promote_types(dtype, float32)``, differentiable); the module docstring gives the protocol, and the options
    ``causal``, ``window``, ``mask``, ``alibi_slopes``, ``scale`` mean what they mean for :func:`sdpa_attention`.

    The softmax is computed online over blocks of ``chunk_size`` queries x ``chunk_size`` keys (Rabe & Staats
    2021, "Self-attention does not need O(n^2) memory"; FlashAttention-2, Dao 2023, for the loop and the
    backward; online softmax, Milakov & Gimelshein 2018), all softmax arithmetic in
    ``promote_types(dtype, float32)``. Backward recomputes each block from the saved lse, so the memory beyond
    the inputs is O(S * chunk_size): the outputs, the lse, the q/k/v gradients and one block's temporaries
    ``[B, H, chunk_size, chunk_size]``. GQA runs on ``[B, Hkv, G*chunk, D]`` query blocks against each key
    block; K and V are never repeated.

    Blocks no query of which can see any key are skipped (causal: keys after every query; window: out of the
    band; documents: the chunk's id ranges do not meet), and mask terms that keep a whole block are not built.
    An explicit ``mask`` (bool ``[S, S]`` or ``[B|1, H_total|1, S, S]`` on global indices) is sliced per block.
    Rows that see no key return ``out = 0``, ``lse = -inf`` and zero gradients. When every block is skipped the
    result is zeros without autograd history, like :func:`sdpa_attention` for a block no query sees (ring
    attention skips those). ALiBi slopes get no gradient.
    """
    _check_qkv(q, k, v, q_doc, k_doc)
    if window is not None and window < 1:
        raise ValueError(f"window={window} must be >= 1")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} must be a positive int")
    B, Sq, H, D = q.shape
    Hkv = k.shape[2]
    slopes = None
    if alibi_slopes is not None:
        if alibi_slopes.numel() < head_offset + H:
            raise ValueError(
                f"head_offset={head_offset} + {H} local heads exceeds the {alibi_slopes.numel()} ALiBi slopes"
            )
        ct = torch.promote_types(q.dtype, torch.float32)
        slopes = alibi_slopes[head_offset : head_offset + H].detach().to(q.device, ct).view(Hkv, H // Hkv)
    blocks = _plan_blocks(q.shape[1], k.shape[1], chunk_size, q_offset, k_offset, causal, window, q_doc, k_doc)
    if not any(blocks):
        return _empty_result(q, v, return_lse)
    spec = _ChunkSpec(q_offset, k_offset, head_offset, causal, window,
                      1.0 / math.sqrt(D) if scale is None else scale, blocks)
    out, lse = _ChunkedAttention.apply(q, k, v, q_doc, k_doc, mask, slopes, spec)
    return (out, lse) if return_lse else out


# ------------------------------------------------------------------------------------------------ dispatch
ATTENTION_BACKENDS = ("auto", "chunked", "triton", "flash")
FLASH_MAX_HEAD_DIM = 256  # flash-attn 2 supports head dims up to 256


def _flash_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _on_cuda(q: Tensor) -> bool:
    return q.is_cuda


_WARNED_NO_TRITON = False


def _warn_no_triton(err: ImportError) -> None:
    global _WARNED_NO_TRITON
    if not _WARNED_NO_TRITON:
        logger.warning("ds4sci.kernels.triton_local_attention unavailable (%s); using chunked_attention", err)
        _WARNED_NO_TRITON = True


def _triton_attention():
    from ds4sci.kernels.triton_local_attention import triton_attention

    return triton_attention


def select_backend(q: Tensor, k: Tensor, v: Tensor, *, q_offset: int = 0, k_offset: int = 0,
                   q_doc: Tensor | None = None, return_lse: bool = False, causal: bool = False,
                   window: int | None = None, mask: Tensor | None = None, alibi_slopes: Tensor | None = None,
                   backend: str = "auto") -> str:
    """The backend :func:`memory_efficient_attention` runs: ``"flash"``, ``"triton"`` or ``"chunked"``.

    ``"auto"``: flash-attn when it is importable, q is on CUDA in fp16/bf16 with ``D <= 256``, and flash can
    express the call (no document ids, window, explicit mask or ALiBi; no gradient through the lse; a causal
    block empty, fully visible or bottom-right aligned: :func:`flash_causal_mode`); otherwise the Triton kernel
    on CUDA when it can run the call (q, k, v of one dtype among fp16/bf16/fp32, ``D <=``
    ``ds4sci.kernels.limits.TRITON_MAX_HEAD_DIM``, no explicit ``mask``: the kernel takes none); otherwise
    :func:`chunked_attention` (float64, larger heads, explicit masks, every non-CUDA device).
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {ATTENTION_BACKENDS}")
    if backend != "auto":
        return backend
    if not _on_cuda(q):
        return "chunked"
    needs_lse_grad = return_lse and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    flash_ok = (
        q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= FLASH_MAX_HEAD_DIM
        and q_doc is None and window is None and mask is None and alibi_slopes is None and not needs_lse_grad
        and (not causal or flash_causal_mode(q_offset, q.shape[1], k_offset, k.shape[1]) != "unsupported")
    )
    if flash_ok and _flash_available():
        return "flash"
    from ds4sci.kernels.limits import TRITON_MAX_HEAD_DIM  # plain constants: no Triton import

    triton_ok = (
        q.dtype in (torch.float16, torch.bfloat16, torch.float32) and q.dtype == k.dtype == v.dtype
        and q.shape[-1] <= TRITON_MAX_HEAD_DIM and mask is None
    )
    return "triton" if triton_ok else "chunked"


def memory_efficient_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    q_offset: int = 0,
    k_offset: int = 0,
    head_offset: int = 0,
    q_doc: Tensor | None = None,
    k_doc: Tensor | None = None,
    return_lse: bool = False,
    causal: bool = False,
    window: int | None = None,
    mask: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    scale: float | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    backend: str = "auto",
):
    """The default local attention: the protocol and options of :func:`sdpa_attention` without O(S^2) memory.

    q ``[B, Sq, H, D]``, k and v ``[B, Sk, Hkv, D]`` -> out ``[B, Sq, H, D]`` (and lse ``[B, H, Sq]``).
    ``backend`` is one of :data:`ATTENTION_BACKENDS` (``ValueError`` otherwise); ``"auto"`` picks with
    :func:`select_backend`:

    - ``"flash"``: :func:`flash_attention` (flash-attn 2, Dao 2023), for what it can express.
    - ``"triton"``: ``ds4sci.kernels.triton_local_attention.triton_attention`` (FlashAttention-2 in Triton), the
      CUDA default otherwise. It takes no explicit ``mask`` (``NotImplementedError`` when forced; ``"auto"``
      sends masked calls to the chunked path). If that module cannot be imported, ``"auto"`` falls back to the
      chunked path (logged once); ``backend="triton"`` raises the ``ImportError``.
    - ``"chunked"``: :func:`chunked_attention` (``chunk_size`` applies to it alone), everywhere else.

    None of them materialises an ``Sq x Sk`` tensor: the O(S^2) :func:`sdpa_attention` is never chosen here.
    """
    name = select_backend(q, k, v, q_offset=q_offset, k_offset=k_offset, q_doc=q_doc, return_lse=return_lse,
                          causal=causal, window=window, mask=mask, alibi_slopes=alibi_slopes, backend=backend)
    protocol = dict(q_offset=q_offset, k_offset=k_offset, head_offset=head_offset, q_doc=q_doc, k_doc=k_doc,
                    return_lse=return_lse)
    if name == "flash":
        unsupported = [opt for opt, val in (("window", window), ("mask", mask), ("alibi_slopes", alibi_slopes))
                       if val is not None]
        if unsupported:
            raise NotImplementedError(f"backend='flash' does not take {unsupported}; use 'chunked' or 'triton'")
        return flash_attention(q, k, v, causal=causal, scale=scale, **protocol)
    if name == "triton":
        if mask is not None:
            raise NotImplementedError("backend='triton' takes no explicit mask; use 'chunked' (or 'auto')")
        try:
            triton_attention = _triton_attention()
        except ImportError as err:
            if backend == "triton":
                raise
            _warn_no_triton(err)
        else:
            return triton_attention(q, k, v, causal=causal, window=window, alibi_slopes=alibi_slopes, scale=scale,
                                    **protocol)
    return chunked_attention(q, k, v, causal=causal, window=window, mask=mask, alibi_slopes=alibi_slopes,
                             scale=scale, chunk_size=chunk_size, **protocol)

