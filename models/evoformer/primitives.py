"""Shared pieces of the Evoformer attention layers: layer norm, initialisers, gated multi-head attention.

:class:`GatedAttention` is the one place where queries, keys, values and the output gate are projected
(parameter names ``linear_q``, ``linear_k``, ``linear_v``, ``linear_o``, ``linear_g`` as in OpenFold's
``Attention``) and where ``ds4sci.kernels.evoformer_attention`` is called. The four layers in
:mod:`ds4sci.models.evoformer.msa` and :mod:`ds4sci.models.evoformer.triangular_attention` only lay their
inputs out as ``[*, N, S, C]`` rows (MSA rows, MSA columns, pair-representation rows) and build the biases;
what they share besides (hyper-parameters, backend, input checks, the mask bias) is :class:`GatedAttentionLayer`.

The kernel computes the scaled, biased softmax attention without storing the logits, in the dtype it is given,
so the layers need no casts and no per-dtype code paths.
"""
from __future__ import annotations

import enum
import math
from typing import Optional
from typing import Union

import torch
from torch import Tensor
from torch import nn

from ds4sci.kernels import EvoformerBackend
from ds4sci.kernels import evoformer_attention
from ds4sci.kernels import parse_backend


class Convention(str, enum.Enum):
    """Which OpenFold code base the parameter layout follows (so its state dicts load with ``strict=True``).

    - ``OPENFOLD3`` (``openfold3`` on PyPI, AlphaFold3 reproduction): no bias on any attention projection
      (``linear_g`` and ``linear_o`` included); the triangle bias projection is ``linear_z``.
    - ``OPENFOLD`` (aqlaboratory/openfold, AlphaFold2 reproduction): ``linear_g`` and ``linear_o`` have a bias
      (AF2 supplement Alg. 7/8/13/14 use ``Linear`` for the gate and output); the triangle bias projection
      is ``linear``.
    """

    OPENFOLD3 = "openfold3"
    OPENFOLD = "openfold"


def resolve_convention(convention: Union[str, Convention]) -> Convention:
    try:
        return Convention(convention)
    except ValueError:
        raise ValueError(
            f"unknown convention {convention!r}; choose one of {[c.value for c in Convention]}"
        ) from None


# ----------------------------------------------------------------------------------------------------------
# Initialisers (AF2 supplement 1.11.4)
# ----------------------------------------------------------------------------------------------------------

# std of a standard normal truncated to [-2, 2]; dividing by it restores unit variance after truncation
_TRUNC_NORMAL_STD = 0.87962566103423978


def init_linear(linear: nn.Linear, kind: str) -> nn.Linear:
    """Initialise ``linear`` in place as the AF2 supplement (1.11.4) prescribes.

    ``"lecun"``: truncated normal, variance 1/fan_in (queries, keys, values); ``"relu"``: truncated normal,
    variance 2/fan_in (He et al. 2015: layers followed by a ReLU or SwiGLU); ``"normal"``: normal,
    variance 1/fan_in (bias projections); ``"gating"``: weight 0, bias 1 (the gate starts mostly open);
    ``"final"``: all zeros (the layer starts as the identity of its residual branch).
    """
    fan_in = linear.weight.shape[1]
    with torch.no_grad():
        if kind in ("lecun", "relu"):
            std = math.sqrt((2.0 if kind == "relu" else 1.0) / fan_in) / _TRUNC_NORMAL_STD
            nn.init.trunc_normal_(linear.weight, std=std, a=-2.0 * std, b=2.0 * std)
        elif kind == "normal":
            nn.init.normal_(linear.weight, std=math.sqrt(1.0 / fan_in))
        elif kind in ("gating", "final"):
            linear.weight.zero_()
        else:
            raise ValueError(f"unknown init kind {kind!r}")
        if linear.bias is not None:
            linear.bias.fill_(1.0 if kind == "gating" else 0.0)
    return linear


class LayerNorm(nn.Module):
    """Layer norm over the last dim with a learned scale ``weight`` and offset ``bias``.

    fp16/bf16 inputs are normalised in fp32 and cast back (as OpenFold does), so a half-precision run differs
    from fp32 only by the rounding of the result.
    """

    def __init__(self, c_in: int, eps: float = 1e-5):
        super().__init__()
        self.c_in = c_in
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(c_in))
        self.bias = nn.Parameter(torch.zeros(c_in))

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype in (torch.float16, torch.bfloat16):
            with torch.autocast(x.device.type, enabled=False):
                out = nn.functional.layer_norm(x.float(), (self.c_in,), self.weight.float(), self.bias.float(),
                                               self.eps)
            return out.to(x.dtype)
        return nn.functional.layer_norm(x, (self.c_in,), self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.c_in}, eps={self.eps}"


def mask_bias(mask: Optional[Tensor], inf: float, dtype: torch.dtype) -> Optional[Tensor]:
    """Additive key mask ``inf * (mask - 1)``: 0 where ``mask`` is 1, ``-inf`` (a large finite number) where 0.

    ``mask [*, N, S]`` -> ``[*, N, 1, 1, S]``. The bias keeps the mask's dtype when it is floating (as OpenFold
    does); a bool/integer mask gives a bias of ``dtype``.
    """
    if mask is None:
        return None
    if not mask.is_floating_point():
        mask = mask.to(dtype)
    # DISCREPANCY: the supplement does not spell out masking; OpenFold's finite inf (1e9) is kept, so a row
    # whose keys are all masked attends uniformly instead of producing zeros.
    return (inf * (mask - 1))[..., :, None, None, :]  # [*, N, S] -> [*, N, 1, 1, S]


# ----------------------------------------------------------------------------------------------------------
# Gated multi-head attention
# ----------------------------------------------------------------------------------------------------------


class GatedAttention(nn.Module):
    """Gated multi-head self-attention of each row of ``x [*, N, S, C_in]`` over its own S positions.

    The ``Attention`` of AF2 supplement Algorithms 7, 8, 13 and 14 (lines "q, k, v = LinearNoBias(x)",
    "g = sigmoid(Linear(x))", softmax with biases, "o = g * sum_j a_ij v_j", "Linear(concat_h o)"), with
    OpenFold's parameter names, so it appears as ``mha`` in every layer's state dict. ``c_hidden`` is the
    per-head channel count and the logits are scaled by ``1/sqrt(c_hidden)`` (inside the kernel). ``q_bias``: the
    query projection has a bias (AF3 supplement Algorithm 24, "q = Linear(a)", as in OpenFold3's AttentionPairBias).
    """

    def __init__(self, c_in: int, c_hidden: int, no_heads: int,
                 convention: Union[str, Convention] = Convention.OPENFOLD3, q_bias: bool = False):
        super().__init__()
        convention = resolve_convention(convention)
        for name, value in (("c_in", c_in), ("c_hidden", c_hidden), ("no_heads", no_heads)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GatedAttention: {name} must be a positive int, got {value!r}")
        self.c_in = c_in
        self.c_hidden = c_hidden
        self.no_heads = no_heads
        c_all = c_hidden * no_heads
        out_bias = convention is Convention.OPENFOLD
        self.linear_q = init_linear(nn.Linear(c_in, c_all, bias=q_bias), "lecun")
        self.linear_k = init_linear(nn.Linear(c_in, c_all, bias=False), "lecun")
        self.linear_v = init_linear(nn.Linear(c_in, c_all, bias=False), "lecun")
        self.linear_o = init_linear(nn.Linear(c_all, c_in, bias=out_bias), "final")
        self.linear_g = init_linear(nn.Linear(c_in, c_all, bias=out_bias), "gating")

    def forward(
        self,
        x: Tensor,
        mask_bias: Optional[Tensor] = None,
        pair_bias: Optional[Tensor] = None,
        *,
        backend: Union[str, EvoformerBackend] = EvoformerBackend.AUTO,
        chunk_size: Optional[int] = None,
    ) -> Tensor:
        """
        Args:
            x: ``[*, N, S, C_in]`` (already layer-normed): N independent rows of S positions.
            mask_bias: ``[*, N | 1, 1, 1, S]`` added to every logit of key j, or None.
            pair_bias: ``[*, 1, H, S, S]`` added to logit (i, j) of head h in every row, or None.
            backend: the ``ds4sci.kernels`` backend.
            chunk_size: if set, rows are processed ``chunk_size`` at a time along N (for every leading batch
                index at once), bounding the projections' memory for very long inputs; the result is the same.

        Returns:
            ``[*, N, S, C_in]``.
        """
        n = x.shape[-3]
        if chunk_size is None or chunk_size >= n:
            return self._attend(x, mask_bias, pair_bias, backend)
        out: Optional[Tensor] = None
        for start in range(0, n, chunk_size):
            rows = slice(start, min(start + chunk_size, n))
            # a mask bias broadcast over N ([*, 1, 1, 1, S]) is shared by all chunks
            mask_rows = None if mask_bias is None else (
                mask_bias if mask_bias.shape[-4] == 1 else mask_bias[..., rows, :, :, :])
            chunk = self._attend(x[..., rows, :, :], mask_rows, pair_bias, backend)  # [*, n_chunk, S, C_in]
            if out is None:
                out = chunk.new_empty(chunk.shape[:-3] + (n,) + chunk.shape[-2:])
            out[..., rows, :, :] = chunk
        return out

    def _attend(self, x: Tensor, mask_bias: Optional[Tensor], pair_bias: Optional[Tensor], backend) -> Tensor:
        heads = (self.no_heads, self.c_hidden)
        # [*, N, S, C_in] -> [*, N, S, H * C_hidden] -> [*, N, S, H, C_hidden]: DeepSpeed4Science's layout
        q = self.linear_q(x).unflatten(-1, heads)
        k = self.linear_k(x).unflatten(-1, heads)
        v = self.linear_v(x).unflatten(-1, heads)
        unbatched = q.ndim == 4  # x [N, S, C_in]: the kernel wants at least one batch dim
        if unbatched:
            q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)  # [1, N, S, H, C_hidden]
        # [*, N, S, H, C_hidden]; softmax_j(q_i . k_j / sqrt(C_hidden) + mask_j + pair_ij) v_j per row and head
        o = evoformer_attention(q, k, v, [mask_bias, pair_bias], backend=backend)
        if unbatched:
            o = o.squeeze(0)
        g = torch.sigmoid(self.linear_g(x))  # [*, N, S, H * C_hidden]
        o = o.flatten(-2) * g  # [*, N, S, H * C_hidden]
        return self.linear_o(o)  # [*, N, S, C_in]


class GatedAttentionLayer(nn.Module):
    """What :class:`~ds4sci.models.evoformer.msa.MSAAttention` and
    :class:`~ds4sci.models.evoformer.triangular_attention.TriangleAttention` share: OpenFold's hyper-parameter
    attributes, the ``backend`` (a ``ds4sci.kernels.EvoformerBackend``, changeable later), the checks of the input
    and its mask, and the call of the layer's :class:`GatedAttention` with the mask bias.

    A subclass registers its layer norms and bias projection and then its ``mha`` (in that order: the parameters
    are created, and drawn from the RNG, in the order OpenFold's modules create them).
    """

    mha: GatedAttention

    def __init__(self, c_in: int, c_hidden: int, no_heads: int, inf: float, backend: Union[str, EvoformerBackend]):
        super().__init__()
        self.c_in = c_in
        self.c_hidden = c_hidden
        self.no_heads = no_heads
        self.inf = inf
        self.backend = parse_backend(backend, EvoformerBackend)

    def _check_rows(
        self, layer: str, name: str, x: Tensor, mask: Optional[Tensor], chunk_size: Optional[int], dims: str
    ) -> None:
        """``x`` must be ``[*, <dims>, C_in]``, ``mask`` None or broadcastable to ``[*, <dims>]``, ``chunk_size`` None
        or a positive int; errors name ``layer``."""
        check_channels(layer, name, x, self.c_in, dims)
        check_chunk_size(layer, chunk_size)
        if mask is not None:
            check_broadcasts(layer, "mask", mask, x.shape[:-1], dims)

    def _attend_rows(
        self, x: Tensor, mask: Optional[Tensor], pair: Optional[Tensor], chunk_size: Optional[int]
    ) -> Tensor:
        """``mha`` over the rows of ``x [*, N, S, C_in]`` (already layer-normed) with the key mask ``[*, N, S]`` as an
        additive bias and the pair bias ``[*, 1, H, S, S]``; returns ``[*, N, S, C_in]``."""
        bias = mask_bias(mask, self.inf, x.dtype)  # [*, N, 1, 1, S]
        return self.mha(x, bias, pair, backend=self.backend, chunk_size=chunk_size)


# ----------------------------------------------------------------------------------------------------------
# Input validation
# ----------------------------------------------------------------------------------------------------------


def check_channels(layer: str, name: str, t: Tensor, c: int, dims: str, min_ndim: int = 3) -> None:
    """``t`` must be ``[*, <dims>, c]`` with at least ``min_ndim`` dims."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{layer}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim < min_ndim or t.shape[-1] != c:
        raise ValueError(f"{layer}: {name} must have shape [*, {dims}, {c}], got {tuple(t.shape)}")
    if not t.is_floating_point():
        raise TypeError(f"{layer}: {name} must be floating point, got {t.dtype}")


def check_broadcasts(layer: str, name: str, t: Tensor, target: torch.Size, dims: str, exact: int = 2) -> None:
    """``t`` must broadcast to ``target`` without changing it, its last ``exact`` dims equal to the target's."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{layer}: {name} must be a torch.Tensor or None, got {type(t).__name__}")
    ok = t.ndim >= exact and t.shape[-exact:] == target[-exact:]
    if ok:
        try:
            ok = torch.broadcast_shapes(t.shape, target) == target
        except RuntimeError:
            ok = False
    if not ok:
        raise ValueError(
            f"{layer}: {name} must have shape [*, {dims}] broadcastable to {tuple(target)}, got {tuple(t.shape)}"
        )


def check_chunk_size(layer: str, chunk_size: Optional[int]) -> None:
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1):
        raise ValueError(f"{layer}: chunk_size must be a positive int or None, got {chunk_size!r}")
