"""Rotary position embedding (RoPE: Su et al. 2021, RoFormer; GPT-NeoX's and Llama's half-split layout) applied in
place to a fused query/key/value projection, so that attention saves views of that one buffer instead of rotated
copies of q and k (a recomputed block's working set, issue #28). The rotation tables come from
:func:`ds4sci.models.genslm.position.rotary_cos_sin`; the out-of-place rotation of the same values is the reference.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["apply_rotary_qkv_"]


class _RotaryQKV(torch.autograd.Function):
    """``forward(ctx, qkv [..., Hkv * (g + 2) * D], cos, sin, g, D) -> qkv`` rotated IN PLACE: in GenSLM's fused
    layout (per key/value group ``[q of its g query heads | k | v]``, each head ``D`` rows) the first ``rotary_dim``
    dims of the ``g + 1`` query and key heads of every group are rotated (RoFormer, Su et al. 2021), the value heads
    and the unrotated dims untouched.

    The rotation's backward needs only ``cos`` and ``sin`` (it is the transposed rotation, ``dy * cos + cat(dy2 *
    sin, -(dy1 * sin))``: the gradient autograd forms for the out-of-place ``x * cos + cat(-x2, x1) * sin``, term for
    term, so bitwise the same), so the projection's output, which nothing saves, is overwritten instead of copied:
    the attention core then saves views of this one buffer, not rotated copies of q and k. Backward un-rotates the
    incoming gradient in place: it is the one the q, k, v split's backward concatenated for this buffer, used nowhere
    else."""

    @staticmethod
    def forward(ctx, qkv: Tensor, cos: Tensor, sin: Tensor, g: int, D: int) -> Tensor:
        ctx.mark_dirty(qkv)
        ctx.save_for_backward(cos, sin)
        ctx.g, ctx.D = g, D
        _rotate_(_rotated_part(qkv, g, D, cos.shape[-1]), cos, sin)
        return qkv

    @staticmethod
    def backward(ctx, grad: Tensor):
        cos, sin = ctx.saved_tensors
        grad = grad.contiguous()
        part = _rotated_part(grad, ctx.g, ctx.D, cos.shape[-1])  # [..., Hkv, g + 1, r]
        g1, g2 = (part * sin.unsqueeze(-2)).chunk(2, dim=-1)
        part.copy_(part * cos.unsqueeze(-2) + torch.cat((g2, -g1), dim=-1))
        return grad, None, None, None, None


def _rotate_(part: Tensor, cos: Tensor, sin: Tensor) -> None:
    """RoPE's rotation of ``part [..., Hkv, g + 1, r]`` (half-split pairs ``(i, i + r/2)``) by the angles of ``cos,
    sin [..., 1, r]``, written back into ``part``: ``x * cos + cat(-x2, x1) * sin``, as ``(x1 c1 - x2 s1, x2 c2 +
    x1 s2)`` with ``c1, c2`` (``s1, s2``) the tables' halves (the same products and sums, so bitwise the same values).
    Computed on a copy with the tokens innermost: ``part`` is ``r`` strided floats per head (4 in a GPT-NeoX model of
    head dim 16 and rotary_pct 0.25), over which each elementwise op runs several times slower than over rows of
    tokens, and the copy out and back costs less than one of them."""
    r, h = part.shape[-1], part.shape[-1] // 2
    tokens = part.view(-1, *part.shape[-3:]).permute(3, 1, 2, 0)  # [r, Hkv, g + 1, N] view, N the tokens
    x1, x2 = tokens.contiguous().split(h)  # [h, Hkv, g + 1, N] each
    c1, c2 = cos.reshape(-1, r).t().contiguous()[:, None, None].split(h)  # [h, 1, 1, N] each
    s1, s2 = sin.reshape(-1, r).t().contiguous()[:, None, None].split(h)
    tokens.copy_(torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2)))


def _rotated_part(qkv: Tensor, g: int, D: int, r: int) -> Tensor:
    """The view ``[..., Hkv, g + 1, r]`` of a contiguous ``qkv [..., Hkv * (g + 2) * D]`` that :class:`_RotaryQKV`
    rotates: the first ``r`` dims of each group's query and key heads."""
    *lead, N = qkv.shape
    return qkv.view(*lead, N // ((g + 2) * D), g + 2, D)[..., : g + 1, :r]


def apply_rotary_qkv_(qkv: Tensor, cos: Tensor, sin: Tensor, g: int, D: int) -> Tensor:
    """Rotate the query and key heads of a fused projection ``qkv [..., Hkv * (g + 2) * D]`` (``g`` query heads per
    key/value group, head dim ``D``; leading dims the tokens, e.g. ``[B, T]`` or ``[B*T]``) in place by ``cos, sin
    [..., 1, rotary_dim]`` with the same leading dims (:func:`ds4sci.models.genslm.position.rotary_cos_sin`) and
    return it (:class:`_RotaryQKV`): the first ``rotary_dim`` dims of each head rotate, the rest pass through.

    Pass the projection's own output, not a view of it (a linear layer on ``[B*T, hidden]``, not ``[B, T, hidden]``):
    autograd records an in-place op on a view as a copy of the base's whole gradient in backward.

    Raises:
        ValueError: naming the shape or layout that does not fit (qkv not a contiguous ``[..., Hkv * (g + 2) * D]``,
            tables not ``[..., 1, r]`` with qkv's leading dims and an even ``r <= D``).
    """
    if qkv.ndim < 2 or not qkv.is_contiguous() or qkv.shape[-1] % ((g + 2) * D):
        raise ValueError(f"apply_rotary_qkv_: qkv must be a contiguous [..., Hkv * (g + 2) * D] tensor with g={g}, "
                         f"D={D}; got shape {tuple(qkv.shape)}, contiguous={qkv.is_contiguous()}")
    lead = tuple(qkv.shape[:-1])
    r = cos.shape[-1]
    if cos.shape != sin.shape or tuple(cos.shape[:-1]) != (*lead, 1) or r % 2 or r > D:
        raise ValueError(f"apply_rotary_qkv_: cos and sin must be [{', '.join(map(str, lead))}, 1, r] with an even "
                         f"r <= D={D}; got {tuple(cos.shape)} and {tuple(sin.shape)}")
    return _RotaryQKV.apply(qkv, cos, sin, g, D)
