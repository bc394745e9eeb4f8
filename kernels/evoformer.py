"""Evoformer attention: public API, input validation, backend dispatch and the ``torch.library`` custom op.

``evoformer_attention(q, k, v, biases)`` computes, with scale ``1/sqrt(D)``::

    o[..., n, i, h, :] = sum_j softmax_j(q[..., n, i, h, :] . k[..., n, j, h, :] / sqrt(D)
                                         + mask[..., n, 0, 0, j] + pair[..., 0, h, i, j]) * v[..., n, j, h, :]

the attention core of AlphaFold2's Evoformer (Jumper et al. 2021, supplement Algorithms 7, 8, 13 and 14) in
DeepSpeed4Science's ``DS4Sci_EvoformerAttention`` layout ``[B, N, S, H, D]``: MSA row attention (N = N_seq, S = N_res,
pair bias from z), column attention (on the transposed MSA), triangle attention starting / ending node (N = I, S =
J, on z or its transpose), all by strided views. ``biases`` holds at most two tensors, classified by shape
(:func:`_classify_biases`): a mask bias ``[*, N|1, 1, 1, S]`` and a pair bias ``[*, 1, H, S, S]``; a bias matching
both (H == S == 1) takes the role the other leaves, else its position, as DeepSpeed does.

Backends (:class:`~ds4sci.kernels.backends.EvoformerBackend`): ``"triton"`` (:mod:`~ds4sci.kernels.triton_evoformer`,
CUDA, or the CPU under ``TRITON_INTERPRET=1``; imported on first use), ``"torch"``
(:mod:`~ds4sci.kernels.evoformer_chunked`, any device), ``"reference"`` (:mod:`~ds4sci.kernels.evoformer_reference`,
plain autograd), ``"auto"`` (triton for CUDA tensors with D <= 128 when Triton imports, torch otherwise). The triton
and torch backends run through one custom op pair, ``ds4sci::evoformer_attention_fwd`` / ``_bwd``, which
``torch.compile`` sees as one opaque op. Each backend module exposes, on canonical inputs (Z the flattened batch),
``forward(q, k, v, mask, pair) -> (o, stats)`` and ``backward(do, q, k, v, o, stats, mask, pair, need_mask_grad,
need_pair_grad) -> (dq, dk, dv, dmask, dpair)``, q, k, v ``[Z, N, S, H, D]``, mask ``[Z, N, S]``, pair ``[Z, H, S,
S]``, and the softmax statistics ``stats [Z, N, H, S, 2]`` (row max and row sum, kept apart: the log-sum-exp loses
the row sum in fp32 on rows masked with -1e9). :func:`evoformer_attention_fwd` and :func:`evoformer_attention_bwd`
expose them to callers that tile the keys themselves (ring attention over a mesh of ranks); FlashAttention-2 (Dao
2023) and Rabe & Staats (2021) for the online softmax and the backward that recomputes it.
"""
from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Sequence
from types import ModuleType
from typing import Optional
from typing import Union

import torch
from torch import Tensor

from . import evoformer_chunked
from . import evoformer_reference
from .backends import EVOFORMER_MAX_HEAD_DIM
from .backends import TRITON_MAX_HEAD_DIM
from .backends import EvoformerBackend
from .backends import import_error
from .backends import parse_backend

logger = logging.getLogger(__name__)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _triton_backend() -> ModuleType:
    """The triton backend module, imported on first use: it pulls in Triton, which the other backends do not need."""
    from . import triton_evoformer

    return triton_evoformer


def _backend_module(backend: str) -> ModuleType:
    """The module behind the custom op's ``backend`` argument (an :class:`EvoformerBackend` value but ``"auto"``)."""
    if backend == EvoformerBackend.TRITON.value:
        return _triton_backend()
    if backend == EvoformerBackend.TORCH.value:
        return evoformer_chunked
    if backend == EvoformerBackend.REFERENCE.value:
        return evoformer_reference
    raise ValueError(f"evoformer_attention: the custom op needs a concrete backend, got {backend!r}")


@functools.lru_cache(maxsize=None)
def _triton_import_error() -> str:
    """Empty if the triton backend imports, else the import error (logged once as a warning). Not marked
    ``torch.compiler.assume_constant_result``: that decorator would import ``torch._dynamo`` (and Triton) with this
    module."""
    return import_error(_triton_backend, logger, "evoformer_attention: the triton backend",
                        "auto uses the torch backend")


# ----------------------------------------------------------------------------------------------------------
# Validation and bias classification
# ----------------------------------------------------------------------------------------------------------


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"evoformer_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
    if q.ndim < 5:
        raise ValueError(
            f"evoformer_attention: q must have shape [*, N, S, H, D] (rank >= 5), got rank {q.ndim} "
            f"shape {tuple(q.shape)}"
        )
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"evoformer_attention: q, k, v must have the same shape [*, N, S, H, D], got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"evoformer_attention: q must be float16, bfloat16, float32 or float64, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"evoformer_attention: q, k, v must have the same dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}"
        )
    if k.device != q.device or v.device != q.device:
        raise ValueError(
            f"evoformer_attention: q, k, v must be on the same device, got q {q.device}, k {k.device}, "
            f"v {v.device}"
        )
    if q.numel() == 0:
        raise ValueError(f"evoformer_attention: q must not be empty, got shape {tuple(q.shape)}")
    d = q.shape[-1]
    if not 1 <= d <= EVOFORMER_MAX_HEAD_DIM:
        raise ValueError(f"evoformer_attention: head dim D must be in 1..{EVOFORMER_MAX_HEAD_DIM}, got D={d}")


def _batch_broadcasts(lead: Sequence[int], batch: Sequence[int]) -> bool:
    """True if ``lead`` (a bias's leading dims) broadcasts to ``batch``, aligned from the right."""
    if len(lead) > len(batch):
        return False
    tail = batch[len(batch) - len(lead):]
    return all(a == 1 or a == b for a, b in zip(lead, tail))


def _is_mask(shape: Sequence[int], q_shape: Sequence[int]) -> bool:
    n, s = q_shape[-4], q_shape[-3]
    return (
        4 <= len(shape) <= len(q_shape)
        and shape[-4] in (1, n)
        and tuple(shape[-3:]) == (1, 1, s)
        and _batch_broadcasts(shape[:-4], q_shape[:-4])
    )


def _is_pair(shape: Sequence[int], q_shape: Sequence[int]) -> bool:
    s, h = q_shape[-3], q_shape[-2]
    return (
        4 <= len(shape) <= len(q_shape)
        and tuple(shape[-4:]) == (1, h, s, s)
        and _batch_broadcasts(shape[:-4], q_shape[:-4])
    )


def _check_bias(name: str, bias: Tensor, q: Tensor) -> None:
    if not isinstance(bias, Tensor):
        raise TypeError(f"evoformer_attention: {name} must be a torch.Tensor or None, got {type(bias).__name__}")
    if bias.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"evoformer_attention: {name} must have a floating dtype, got {bias.dtype}")
    if bias.device != q.device:
        raise ValueError(f"evoformer_attention: {name} is on {bias.device} but q is on {q.device}")


def _classify_biases(
    biases: Optional[Sequence[Optional[Tensor]]], q: Tensor
) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """Split ``biases`` into (mask, pair) by shape; see the module docstring for the rule."""
    if biases is None:
        return None, None
    if isinstance(biases, Tensor) or not isinstance(biases, (list, tuple)):
        raise TypeError(
            f"evoformer_attention: biases must be a list or tuple of at most two tensors (or None), "
            f"got {type(biases).__name__}"
        )
    if len(biases) > 2:
        raise ValueError(f"evoformer_attention: at most two biases (mask, pair) are supported, got {len(biases)}")
    n, s, h = q.shape[-4], q.shape[-3], q.shape[-2]
    roles: list[tuple[int, Tensor, set[str]]] = []
    for pos, bias in enumerate(biases):
        if bias is None:
            continue
        _check_bias(f"biases[{pos}]", bias, q)
        kinds = {kind for kind, ok in (("mask", _is_mask(bias.shape, q.shape)), ("pair", _is_pair(bias.shape, q.shape)))
                 if ok}
        if not kinds:
            raise ValueError(
                f"evoformer_attention: biases[{pos}] has shape {tuple(bias.shape)}, which is neither a mask bias "
                f"broadcastable as [*, N, 1, 1, S] = [*, {n}, 1, 1, {s}] nor a pair bias [*, 1, H, S, S] = "
                f"[*, 1, {h}, {s}, {s}] (q has shape {tuple(q.shape)})"
            )
        roles.append((pos, bias, kinds))
    if len(roles) == 2:
        (p0, b0, k0), (p1, b1, k1) = roles
        if len(k0) == 1 and len(k1) == 2:
            k1 = {"pair"} if k0 == {"mask"} else {"mask"}
        elif len(k1) == 1 and len(k0) == 2:
            k0 = {"pair"} if k1 == {"mask"} else {"mask"}
        elif len(k0) == 2 and len(k1) == 2:
            k0, k1 = {"mask"}, {"pair"}
        if k0 == k1:
            kind = next(iter(k0))
            raise ValueError(
                f"evoformer_attention: biases[{p0}] {tuple(b0.shape)} and biases[{p1}] {tuple(b1.shape)} are both "
                f"{kind} biases; give one mask bias [*, N, 1, 1, S] and one pair bias [*, 1, H, S, S]"
            )
        roles = [(p0, b0, k0), (p1, b1, k1)]
    mask = pair = None
    for pos, bias, kinds in roles:
        kind = next(iter(kinds)) if len(kinds) == 1 else ("mask" if pos == 0 else "pair")
        if kind == "mask":
            mask = bias
        else:
            pair = bias
    return mask, pair


def _choose_backend(backend: Union[str, EvoformerBackend], q: Tensor) -> EvoformerBackend:
    """Parse ``backend``, pick triton or torch for ``"auto"``, and check that q suits the triton backend."""
    chosen = parse_backend(backend, EvoformerBackend)
    if chosen is EvoformerBackend.AUTO:
        use_triton = (
            q.is_cuda
            and q.dtype != torch.float64
            and q.shape[-1] <= TRITON_MAX_HEAD_DIM
            and not _triton_import_error()
        )
        chosen = EvoformerBackend.TRITON if use_triton else EvoformerBackend.TORCH
    elif chosen is EvoformerBackend.TRITON:
        if q.dtype == torch.float64:
            raise TypeError(
                "evoformer_attention: the triton backend supports float16, bfloat16 and float32, not float64"
            )
        if q.shape[-1] > TRITON_MAX_HEAD_DIM:
            raise ValueError(
                f"evoformer_attention: the triton backend supports head dims up to {TRITON_MAX_HEAD_DIM}, "
                f"got D={q.shape[-1]}; use backend='torch'"
            )
        if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"evoformer_attention: the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU), "
                f"got tensors on {q.device}"
            )
        error = _triton_import_error()
        if error:
            raise RuntimeError(f"evoformer_attention: the triton backend is unavailable: {error}")
    return chosen


# ----------------------------------------------------------------------------------------------------------
# Canonical views
# ----------------------------------------------------------------------------------------------------------


def _pad_rank(bias: Optional[Tensor], ndim: int) -> Optional[Tensor]:
    """Prepend size-1 dims so the bias has q's rank (a view)."""
    if bias is None or bias.ndim == ndim:
        return bias
    return bias.reshape((1,) * (ndim - bias.ndim) + tuple(bias.shape))


def _canonical(
    q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], pair: Optional[Tensor]
) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """User layout -> backend layout.

    q, k, v ``[*batch, N, S, H, D]`` -> ``[Z, N, S, H, D]``; mask ``[*b, N|1, 1, 1, S]`` (rank of q) ->
    ``[Z, N, S]``; pair ``[*b, 1, H, S, S]`` -> ``[Z, H, S, S]``. Broadcast dims keep stride 0 (``expand``);
    only a bias broadcast over some but not all extra leading dims is copied by the final reshape.
    """
    *batch, n, s, h, d = q.shape
    z = math.prod(batch)
    qc, kc, vc = (t.reshape(z, n, s, h, d) for t in (q, k, v))  # [*batch, N, S, H, D] -> [Z, N, S, H, D]
    mc = None if mask is None else mask[..., 0, 0, :].expand(*batch, n, s).reshape(z, n, s)  # -> [Z, N, S]
    pc = None if pair is None else pair[..., 0, :, :, :].expand(*batch, h, s, s).reshape(z, h, s, s)  # -> [Z, H, S, S]
    return qc, kc, vc, mc, pc


# ----------------------------------------------------------------------------------------------------------
# Custom op (triton and torch backends)
# ----------------------------------------------------------------------------------------------------------


@torch.library.custom_op("ds4sci::evoformer_attention_fwd", mutates_args=())
def _attention_fwd(
    q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], pair: Optional[Tensor], backend: str
) -> tuple[Tensor, Tensor]:
    """o ``[*batch, N, S, H, D]`` and the softmax statistics ``[Z, N, H, S, 2]`` (row max, row sum; see the
    backend contract); biases already padded to q's rank."""
    qc, kc, vc, mc, pc = _canonical(q, k, v, mask, pair)
    o, lse = _backend_module(backend).forward(qc, kc, vc, mc, pc)
    return o.reshape(q.shape).contiguous(), lse.contiguous()


@_attention_fwd.register_fake
def _(q, k, v, mask, pair, backend):
    *batch, n, s, h, _ = q.shape
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(
        (math.prod(batch), n, h, s, 2), dtype=lse_dtype
    )


@torch.library.custom_op("ds4sci::evoformer_attention_bwd", mutates_args=())
def _attention_bwd(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    mask: Optional[Tensor],
    pair: Optional[Tensor],
    need_mask_grad: bool,
    need_pair_grad: bool,
    backend: str,
) -> list[Tensor]:
    """``[dq, dk, dv]`` followed by dmask (if need_mask_grad) and dpair (if need_pair_grad).

    Bias gradients come back in the bias's own (padded) shape and dtype, reduced over its broadcast dims in fp32.
    """
    *batch, n, s, h, d = q.shape
    z = math.prod(batch)
    qc, kc, vc, mc, pc = _canonical(q, k, v, mask, pair)
    doc = do.reshape(z, n, s, h, d).contiguous()  # [*batch, N, S, H, D] -> [Z, N, S, H, D]
    oc = o.reshape(z, n, s, h, d)
    dq, dk, dv, dmask, dpair = _backend_module(backend).backward(
        doc, qc, kc, vc, oc, lse, mc, pc, need_mask_grad, need_pair_grad
    )
    grads = [g.reshape(q.shape).contiguous() for g in (dq, dk, dv)]
    if need_mask_grad:
        # [Z, N, S] -> [*batch, N, 1, 1, S] -> summed over the mask's broadcast dims, in fp32, then cast
        full = dmask.reshape(*batch, n, 1, 1, s)
        grads.append(full.sum_to_size(mask.shape).to(mask.dtype).contiguous())
    if need_pair_grad:
        # [Z, H, S, S] -> [*batch, 1, H, S, S] -> summed over the pair bias's broadcast dims, in fp32, then cast
        full = dpair.reshape(*batch, 1, h, s, s)
        grads.append(full.sum_to_size(pair.shape).to(pair.dtype).contiguous())
    return grads


@_attention_bwd.register_fake
def _(do, q, k, v, o, lse, mask, pair, need_mask_grad, need_pair_grad, backend):
    grads = [torch.empty_like(q, memory_format=torch.contiguous_format) for _ in range(3)]
    if need_mask_grad:
        grads.append(torch.empty_like(mask, memory_format=torch.contiguous_format))
    if need_pair_grad:
        grads.append(torch.empty_like(pair, memory_format=torch.contiguous_format))
    return grads


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, mask, pair, backend = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, mask, pair)
    ctx.backend = backend
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do: Tensor, dlse: Optional[Tensor]):
    del dlse  # lse is not differentiable
    q, k, v, o, lse, mask, pair = ctx.saved_tensors
    need_mask_grad = mask is not None and ctx.needs_input_grad[3]
    need_pair_grad = pair is not None and ctx.needs_input_grad[4]
    grads = _attention_bwd(do, q, k, v, o, lse, mask, pair, need_mask_grad, need_pair_grad, ctx.backend)
    dq, dk, dv, *rest = grads
    dmask = rest.pop(0) if need_mask_grad else None
    dpair = rest.pop(0) if need_pair_grad else None
    return dq, dk, dv, dmask, dpair, None


_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------------------


def _attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], pair: Optional[Tensor],
    backend: Union[str, EvoformerBackend],
) -> Tensor:
    """Shared tail of the public functions: biases already classified (and checked by the caller)."""
    chosen = _choose_backend(backend, q)
    mask, pair = _pad_rank(mask, q.ndim), _pad_rank(pair, q.ndim)
    if chosen is EvoformerBackend.REFERENCE:
        # The oracle stays plain autograd (bias gradients reduced by autograd in the bias dtype).
        qc, kc, vc, mc, pc = _canonical(q, k, v, mask, pair)
        o, _ = evoformer_reference.forward(qc, kc, vc, mc, pc)
        return o.reshape(q.shape)
    o, _ = _attention_fwd(q, k, v, mask, pair, chosen.value)
    return o


def _stats_backend(backend: Union[str, EvoformerBackend], q: Tensor) -> str:
    """The custom op's backend for :func:`evoformer_attention_fwd` / ``_bwd``: the reference runs as torch (its
    backward recomputes the softmax from q and k alone, so it cannot honour statistics merged over key tiles)."""
    chosen = _choose_backend(backend, q)
    return (EvoformerBackend.TORCH if chosen is EvoformerBackend.REFERENCE else chosen).value


def _check_roles(who: str, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], pair: Optional[Tensor]) -> None:
    """q, k, v as :func:`evoformer_attention` checks them; ``mask`` and ``pair`` of their role's form at q's rank."""
    _check_qkv(q, k, v)
    for name, bias, fits, form in (("mask", mask, _is_mask, "[*, N|1, 1, 1, S]"), ("pair", pair, _is_pair,
                                                                                   "[*, 1, H, S, S]")):
        if bias is None:
            continue
        _check_bias(name, bias, q)
        if bias.ndim != q.ndim or not fits(bias.shape, q.shape):
            raise ValueError(f"{who}: {name} must be {form} of q's rank, got {tuple(bias.shape)} "
                             f"(q {tuple(q.shape)})")


def evoformer_attention_fwd(
    q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None, pair: Optional[Tensor] = None, *,
    backend: Union[str, EvoformerBackend] = "auto",
) -> tuple[Tensor, Tensor]:
    """The kernel's forward with its softmax statistics, for callers that split the keys into tiles and merge the
    partial results themselves (ring attention, Liu et al. 2023; the statistics are FlashAttention-2's, Dao 2023,
    and Rabe & Staats 2021's running max and sum).

    Args:
        q, k, v: ``[*, N, S, H, D]`` as for :func:`evoformer_attention`.
        mask: mask bias ``[*, N|1, 1, 1, S]`` of q's rank, or None.
        pair: pair bias ``[*, 1, H, S, S]`` of q's rank, or None.
        backend: as for :func:`evoformer_attention`; ``"reference"`` runs the torch backend (its backward, not the
            oracle's, uses the statistics it is given).

    Returns:
        ``o [*, N, S, H, D]`` in q's dtype and ``stats [Z, N, H, S, 2]`` (Z the leading dims flattened; fp32, fp64
        for fp64 inputs): per query row the max ``m`` of the biased logits and the sum ``l = sum_j exp(s_j - m)``,
        kept apart rather than as the log-sum-exp ``m + log l``, which fp32 rounds away when ``|m|`` is huge (rows
        masked with OpenFold's -1e9); ``(+inf, +inf)`` on rows whose keys are all -inf. Not differentiable: the
        gradients come from :func:`evoformer_attention_bwd`.
    """
    _check_roles("evoformer_attention_fwd", q, k, v, mask, pair)
    with torch.no_grad():
        return _attention_fwd(q, k, v, mask, pair, _stats_backend(backend, q))


def evoformer_attention_bwd(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, stats: Tensor, mask: Optional[Tensor] = None,
    pair: Optional[Tensor] = None, *, need_mask_grad: bool = False, need_pair_grad: bool = False,
    backend: Union[str, EvoformerBackend] = "auto",
) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """The kernel's backward against an output ``o`` and its statistics ``stats`` (:func:`evoformer_attention_fwd`'s
    layouts): recomputes ``P = exp(s - m) / l`` and ``D = rowsum(do * o)`` (FlashAttention-2), so with the
    statistics and output of a softmax over more keys than ``k`` holds (merged over tiles), it returns this tile's
    exact share of the gradients. Returns ``(dq, dk, dv, dmask, dpair)``: dq, dk, dv ``[*, N, S, H, D]`` in q's
    dtype; dmask (mask's shape) and dpair (pair's shape, summed over N) in their bias's dtype, each None unless
    requested."""
    _check_roles("evoformer_attention_bwd", q, k, v, mask, pair)
    *batch, n, s, h, _ = q.shape
    if do.shape != q.shape or o.shape != q.shape or stats.shape != (math.prod(batch), n, h, s, 2):
        raise ValueError(f"evoformer_attention_bwd: do and o must be q's shape {tuple(q.shape)} and stats "
                         f"[Z, N, H, S, 2], got do {tuple(do.shape)}, o {tuple(o.shape)}, stats {tuple(stats.shape)}")
    need_mask_grad, need_pair_grad = need_mask_grad and mask is not None, need_pair_grad and pair is not None
    with torch.no_grad():
        dq, dk, dv, *rest = _attention_bwd(do.contiguous(), q, k, v, o, stats, mask, pair, need_mask_grad,
                                           need_pair_grad, _stats_backend(backend, q))
    dmask = rest.pop(0) if need_mask_grad else None
    return dq, dk, dv, dmask, rest.pop(0) if need_pair_grad else None


def evoformer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    biases: Optional[Sequence[Optional[Tensor]]],
    *,
    backend: Union[str, EvoformerBackend] = "auto",
) -> Tensor:
    """Evoformer attention with a key-wise mask bias and a pair bias (AlphaFold2 supplement Alg. 7/8/13/14).

    Args:
        q: ``[*, N, S, H, D]`` (DeepSpeed4Science's layout; any number of leading batch dims, flattened
            internally), same shape, dtype (fp16, bf16, fp32; fp64 on the torch and reference backends) and
            device; arbitrary strides. The logits are scaled by ``1/sqrt(D)``, D in 1..256 (``EVOFORMER_MAX_HEAD_DIM``;
            1..128 on the triton backend).
        k: the keys, as ``q``.
        v: the values, as ``q``.
        biases: a list/tuple of at most two tensors (``None`` entries and ``None`` itself allowed): a mask bias
            broadcastable as ``[*, N, 1, 1, S]`` and a pair bias ``[*, 1, H, S, S]`` (leading dims may be 1 to
            broadcast). Roles are assigned by shape; see the module docstring for the ambiguous case. Any
            floating dtype; both may require grad (their gradients come back in their own dtype).
        backend: ``"auto"``, ``"triton"``, ``"torch"`` or ``"reference"`` (a :class:`EvoformerBackend` or its value).

    Returns:
        ``[*, N, S, H, D]`` in q's dtype. Query rows whose keys are all ``-inf`` give zeros.

    Raises:
        TypeError: non-tensor inputs, non-floating or mismatched q/k/v dtypes.
        ValueError: wrong rank, mismatched shapes or devices, biases of neither form, more than two biases,
            D outside 1..256, an unknown backend, the triton backend on a CPU tensor without
            ``TRITON_INTERPRET=1``.
    """
    _check_qkv(q, k, v)
    mask, pair = _classify_biases(biases, q)
    return _attention(q, k, v, mask, pair, backend)


def DS4Sci_EvoformerAttention(Q: Tensor, K: Tensor, V: Tensor, biases: list) -> Tensor:  # noqa: N802 (DeepSpeed's name)
    """Drop-in for ``deepspeed.ops.deepspeed4science.DS4Sci_EvoformerAttention`` (same call convention).

    Q, K, V ``[B, N, S, H, D]``; ``biases`` a list of at most two entries, taken by position: ``biases[0]`` a
    mask bias of shape exactly ``[B, N, 1, 1, S]`` and ``biases[1]`` a pair bias ``[B, 1, H, S, S]``, either may
    be None. As in DeepSpeed, the caller's list is padded with None to two entries (it is mutated) and a bad
    bias shape raises ``AssertionError("bias1 shape is incorrect")`` / ``("bias2 shape is incorrect")``.
    Unlike DeepSpeed, fp32 and S <= 16 are accepted. Runs on the ``"auto"`` backend.
    """
    if len(biases) > 2:
        raise AssertionError(f"at most two biases are supported, got {len(biases)}")
    while len(biases) < 2:
        biases.append(None)
    _check_qkv(Q, K, V)
    if Q.ndim != 5:
        raise ValueError(f"DS4Sci_EvoformerAttention: Q must be [B, N, S, H, D] (rank 5), got shape {tuple(Q.shape)}")
    b, n, s, h, _ = Q.shape
    mask, pair = biases
    if mask is not None:
        _check_bias("biases[0]", mask, Q)
        if tuple(mask.shape) != (b, n, 1, 1, s):
            raise AssertionError("bias1 shape is incorrect")
    if pair is not None:
        _check_bias("biases[1]", pair, Q)
        if tuple(pair.shape) != (b, 1, h, s, s):
            raise AssertionError("bias2 shape is incorrect")
    return _attention(Q, K, V, mask, pair, EvoformerBackend.AUTO)
