"""Local attention: the ds4sci local attention protocol, its adapters and its one dispatch.

Everything that attends within one device goes through here: GenSLM's attention core calls
:func:`memory_efficient_attention` (causal, ALiBi slopes, its configured backend), and
:class:`ds4sci.sequence.DistributedAttention` wraps any local attention for Ulysses, ring and Unified sequence
parallelism. A local attention is a callable::

    local_attention(q, k, v, *, q_offset=0, k_offset=0, head_offset=0, q_doc=None, k_doc=None, return_lse=False)

- q ``[B, Sq, H, D]``, k and v ``[B, Sk, Hkv, D]`` (``Hkv`` divides ``H``: GQA/MQA, query head ``h`` uses key/value
  head ``h // (H/Hkv)``), each one contiguous block of the sequence.
- ``q_offset`` / ``k_offset``: global sequence index of the first query / key row; masks and position biases are
  evaluated on global indices (causal: query ``i`` sees key ``j`` iff ``j <= i``).
- ``head_offset``: global index of local head 0 (per-head masks, ALiBi slopes).
- ``q_doc`` / ``k_doc``: optional int ``[B, Sq]`` / ``[B, Sk]`` document ids (packed sequences): a query sees a
  key only if both carry the same id; padding carries :data:`~ds4sci.kernels.local_reference.PAD_DOC_ID`.
- returns out ``[B, Sq, H, D]``, or with ``return_lse=True`` ``(out, lse)``, lse ``[B, H, Sq]`` the natural
  log-sum-exp of the scaled (and biased) logits, in ``promote_types(dtype, float32)`` (float32, or float64 for
  float64 inputs, so that merging blocks keeps float64 exact). Rows that see no key: ``lse = -inf``, ``out = 0``.
  Ring attention backpropagates through the lse, so it carries autograd history when q, k, v do.

Options beyond the protocol (``causal``, ``window``, ``mask``, ``alibi_slopes``, ``scale``) are keyword arguments;
bind them with ``functools.partial(memory_efficient_attention, causal=True)``.

The family, laid out like Evoformer attention's (reference -> chunked path -> Triton kernel -> API):

- :mod:`ds4sci.kernels.local_reference`: the protocol's checks, threshold-based masks (``attention_mask``),
  ``PAD_DOC_ID`` and :func:`~ds4sci.kernels.local_reference.sdpa_attention`, PyTorch SDPA with an explicit softmax
  where the lse or ALiBi needs one: the readable O(S^2) oracle.
- :mod:`ds4sci.kernels.local_chunked`: :func:`~ds4sci.kernels.local_chunked.chunked_attention`, FlashAttention-2's
  online softmax over (query chunk x key chunk) blocks in PyTorch, with a recomputing backward (also through the
  lse); every option, O(S * chunk) memory, any device.
- :mod:`ds4sci.kernels.triton_local_attention`: the fused Triton kernel (CUDA; the CPU under ``TRITON_INTERPRET=1``).
- this module: :func:`flex_attention` (FlexAttention with a block mask: causal, sliding window, documents; its
  backward is not implemented on the CPU, where PyTorch raises ``NotImplementedError``, so use it for GPU training
  or CPU inference), :func:`flash_attention` (flash-attn's ``flash_attn_func`` when importable: GPU, fp16/bf16),
  and :func:`memory_efficient_attention`, the default: one entry point, no ``S x S`` tensor on any path it picks
  itself beyond one of the chunked path's blocks (flash-attn where it can express the call, the Triton kernel on CUDA
  otherwise, the chunked path elsewhere, ``sdpa_attention``'s one pass off CUDA for a decode step and for a causal
  inference pass; :func:`select_backend` states the rule; ``backend=`` forces one of
  :class:`~ds4sci.kernels.backends.LocalBackend`, ``"sdpa"`` included).
"""
from __future__ import annotations

import functools
import logging

import torch
from torch import Tensor

from .backends import FLASH_MAX_HEAD_DIM
from .backends import LOCAL_CHUNK_SIZE
from .backends import TRITON_MAX_HEAD_DIM
from .backends import LocalBackend
from .backends import import_error
from .backends import parse_backend
from .local_chunked import chunked_attention
from .local_reference import check_qkv
from .local_reference import empty_result
from .local_reference import sdpa_attention

logger = logging.getLogger(__name__)

__all__ = [
    "flex_attention",
    "flash_attention",
    "flash_causal_mode",
    "select_backend",
    "memory_efficient_attention",
]


def flex_attention(q: Tensor, k: Tensor, v: Tensor, *, q_offset: int = 0, k_offset: int = 0, head_offset: int = 0,
                   q_doc: Tensor | None = None, k_doc: Tensor | None = None, return_lse: bool = False,
                   causal: bool = False, window: int | None = None, scale: float | None = None,
                   block_size: int = 128, compile: bool | None = None):
    """FlexAttention (PyTorch ``torch.nn.attention.flex_attention``) with a block mask on global indices.

    Same protocol and mask semantics as :func:`sdpa_attention` (``causal``, ``window``, documents), expressed as
    a ``mask_mod`` so fully masked tiles of ``block_size`` are skipped. ``compile=None`` compiles on GPUs and
    runs eagerly on the CPU (where FlexAttention has no backward: PyTorch raises ``NotImplementedError``).
    ``head_offset`` is accepted for the protocol; these masks do not depend on the head.
    """
    from torch.nn.attention.flex_attention import AuxRequest
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as _flex

    check_qkv(q, k, v, q_doc, k_doc, window=window)
    B, Sq, H, _ = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    if causal and k_offset > q_offset + Sq - 1:
        return empty_result(q, v, return_lse)

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


def flash_attention(q: Tensor, k: Tensor, v: Tensor, *, q_offset: int = 0, k_offset: int = 0, head_offset: int = 0,
                    q_doc: Tensor | None = None, k_doc: Tensor | None = None, return_lse: bool = False,
                    causal: bool = False, scale: float | None = None):
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
    check_qkv(q, k, v, q_doc, k_doc)
    if q_doc is not None:
        raise NotImplementedError("flash_attention does not take document ids; use flex_attention")
    mode = flash_causal_mode(q_offset, q.shape[1], k_offset, k.shape[1]) if causal else "full"
    if mode == "empty":
        return empty_result(q, v, return_lse)
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


# ------------------------------------------------------------------------------------------------ dispatch
def _flash_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _triton_kernel():
    """``triton_attention``, imported on first use: it pulls in Triton, which the other backends do not need."""
    from .triton_local_attention import triton_attention

    return triton_attention


@functools.lru_cache(maxsize=None)
def _triton_import_error() -> str:
    """Empty if the Triton kernel imports, else the import error (logged once as a warning)."""
    return import_error(_triton_kernel, logger, "ds4sci.kernels.triton_local_attention", "using chunked_attention")


def select_backend(q: Tensor, k: Tensor, v: Tensor, *, q_offset: int = 0, k_offset: int = 0,
                   q_doc: Tensor | None = None, return_lse: bool = False, causal: bool = False,
                   window: int | None = None, mask: Tensor | None = None, alibi_slopes: Tensor | None = None,
                   backend: str | LocalBackend = "auto", device_type: str | None = None,
                   inference: bool = False) -> LocalBackend:
    """The backend :func:`memory_efficient_attention` runs for this call (a :class:`LocalBackend` but ``AUTO``).

    A forced ``backend`` is returned as it is. Off CUDA, ``"auto"`` picks
    :func:`~ds4sci.kernels.local_reference.sdpa_attention` for a decode step (one query row, ``Sq == 1``: its one
    ``[B, H, 1, Sk]`` row of logits is no larger than the keys, ``[B, Sk, Hkv, D]``, and it reads all keys in one
    pass, where the chunked path's loop over key blocks costs more than the attention itself) and, for an
    ``inference`` pass (a model in eval mode says so: a checkpointed training forward also runs without gradients,
    and its recomputation must run the same kernel) that needs no gradient, for a causal block whose queries are its
    keys (``q_offset == k_offset``, ``Sq == Sk``) with no
    window, explicit mask, ALiBi or lse: PyTorch's fused causal kernel then runs it with no mask tensor, 2.5-6x
    faster on this machine's CPU than the chunked path's blocks (``[16, 256, 4, 16]``: 10 ms against 25-65 ms); with
    document ids (packed rows) only up to :data:`~ds4sci.kernels.backends.LOCAL_CHUNK_SIZE` queries, where its
    boolean ``[B, 1, S, S]`` mask is smaller than the chunked path's one block of fp32 logits. Otherwise
    :func:`~ds4sci.kernels.local_chunked.chunked_attention` (training keeps it: its recomputing backward). SDPA's
    rounding depends on the padded width of a row (not on the other rows or the threads), which is why
    :class:`~ds4sci.infer.parallel.ShardedForward` reads each window at a width fixed by its own length. On a CUDA
    device it picks
    flash-attn when it is importable, q is fp16/bf16 with ``D <= FLASH_MAX_HEAD_DIM`` (256), and flash can express
    the call (no document ids, window, explicit mask or ALiBi; no gradient through the lse; a causal block empty,
    fully visible or bottom-right aligned: :func:`flash_causal_mode`); otherwise the Triton kernel when it imports
    and can run the call (q, k, v of one dtype among fp16/bf16/fp32, ``D <= TRITON_MAX_HEAD_DIM`` (128), no
    explicit ``mask``: the kernel takes none); otherwise the chunked path (float64, larger heads, explicit masks).

    ``device_type``: the device the call runs on, ``q.device.type`` by default; the rule reads nothing else of the
    device, so a caller (a planner, a test) can ask what a CUDA call would run with tensors of any device.
    """
    requested = parse_backend(backend, LocalBackend)
    if requested is not LocalBackend.AUTO:
        return requested
    if (q.device.type if device_type is None else device_type) != "cuda":
        causal_kernel = (causal and q_offset == k_offset and q.shape[1] == k.shape[1] and window is None
                         and mask is None and alibi_slopes is None and not return_lse
                         and (q_doc is None or q.shape[1] <= LOCAL_CHUNK_SIZE))
        no_grad = not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))
        one_pass = q.shape[1] == 1 or (causal_kernel and inference and no_grad)
        return LocalBackend.SDPA if one_pass else LocalBackend.CHUNKED  # a decode step, or a causal inference pass
    needs_lse_grad = return_lse and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    flash_ok = (
        q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= FLASH_MAX_HEAD_DIM
        and q_doc is None and window is None and mask is None and alibi_slopes is None and not needs_lse_grad
        and (not causal or flash_causal_mode(q_offset, q.shape[1], k_offset, k.shape[1]) != "unsupported")
    )
    if flash_ok and _flash_available():
        return LocalBackend.FLASH
    triton_ok = (
        q.dtype in (torch.float16, torch.bfloat16, torch.float32) and q.dtype == k.dtype == v.dtype
        and q.shape[-1] <= TRITON_MAX_HEAD_DIM and mask is None
    )
    return LocalBackend.TRITON if triton_ok and not _triton_import_error() else LocalBackend.CHUNKED


def memory_efficient_attention(q: Tensor, k: Tensor, v: Tensor, *, q_offset: int = 0, k_offset: int = 0,
                               head_offset: int = 0, q_doc: Tensor | None = None, k_doc: Tensor | None = None,
                               return_lse: bool = False, causal: bool = False, window: int | None = None,
                               mask: Tensor | None = None, alibi_slopes: Tensor | None = None,
                               scale: float | None = None, chunk_size: int = LOCAL_CHUNK_SIZE,
                               backend: str | LocalBackend = "auto", inference: bool = False):
    """The default local attention: the protocol and options of ``sdpa_attention``, without O(S^2) memory unless
    ``backend="sdpa"`` asks for that oracle. ``inference``: the caller's model is in eval mode (read by
    :func:`select_backend`).

    q ``[B, Sq, H, D]``, k and v ``[B, Sk, Hkv, D]`` -> out ``[B, Sq, H, D]`` (and lse ``[B, H, Sq]``).
    ``backend`` is a :class:`~ds4sci.kernels.backends.LocalBackend` or its value (``ValueError`` otherwise);
    ``"auto"`` picks with :func:`select_backend`:

    - ``"flash"``: :func:`flash_attention` (flash-attn 2, Dao 2023), for what it can express.
    - ``"triton"``: ``ds4sci.kernels.triton_local_attention.triton_attention`` (FlashAttention-2 in Triton), the
      CUDA default otherwise. It takes no explicit ``mask`` (``NotImplementedError`` when forced; ``"auto"``
      sends masked calls to the chunked path). If that module cannot be imported, ``"auto"`` falls back to the
      chunked path (logged once); ``backend="triton"`` raises the ``ImportError``.
    - ``"chunked"``: :func:`~ds4sci.kernels.local_chunked.chunked_attention` (``chunk_size`` applies to it alone),
      everywhere else.
    - ``"sdpa"``: :func:`~ds4sci.kernels.local_reference.sdpa_attention`, the readable O(S^2) oracle: for a call of
      more than one query row only when asked for by name (GenSLM's ``attention_backend="sdpa"``, for checking the
      others); off CUDA, ``"auto"`` runs it for a decode step (``Sq == 1``) and for an ``inference`` causal pass
      without gradients whose queries are its keys (:func:`select_backend`).

    None of the backends ``"auto"`` picks materialises an ``Sq x Sk`` tensor with ``Sq > 1`` larger than one of the
    chunked path's blocks.
    """
    name = select_backend(q, k, v, q_offset=q_offset, k_offset=k_offset, q_doc=q_doc, return_lse=return_lse,
                          causal=causal, window=window, mask=mask, alibi_slopes=alibi_slopes, backend=backend,
                          inference=inference)
    protocol = dict(q_offset=q_offset, k_offset=k_offset, head_offset=head_offset, q_doc=q_doc, k_doc=k_doc,
                    return_lse=return_lse)
    if name is LocalBackend.SDPA:
        return sdpa_attention(q, k, v, causal=causal, window=window, mask=mask, alibi_slopes=alibi_slopes, scale=scale,
                              **protocol)
    if name is LocalBackend.FLASH:
        unsupported = [opt for opt, val in (("window", window), ("mask", mask), ("alibi_slopes", alibi_slopes))
                       if val is not None]
        if unsupported:
            raise NotImplementedError(f"backend='flash' does not take {unsupported}; use 'chunked' or 'triton'")
        return flash_attention(q, k, v, causal=causal, scale=scale, **protocol)
    if name is LocalBackend.TRITON:
        if mask is not None:
            raise NotImplementedError("backend='triton' takes no explicit mask; use 'chunked' (or 'auto')")
        return _triton_kernel()(q, k, v, causal=causal, window=window, alibi_slopes=alibi_slopes, scale=scale,
                                **protocol)
    return chunked_attention(q, k, v, causal=causal, window=window, mask=mask, alibi_slopes=alibi_slopes,
                             scale=scale, chunk_size=chunk_size, **protocol)
