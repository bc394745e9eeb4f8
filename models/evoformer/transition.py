"""Transitions (the position-wise MLPs of the Evoformer and Pairformer) and the dropout they share rows or columns of.

- :class:`Transition`: AlphaFold2's ReLU transition (supplement Algorithms 9 and 15: ``Linear(relu(Linear(LN(x))))``
  with a hidden width of ``n * c_in``) or AlphaFold3's SwiGLU transition (AF3 supplement Algorithm 11:
  ``Linear(swish(Linear_a(LN(x))) * Linear_b(LN(x)))``), the output multiplied by the mask as OpenFold does.
- :class:`SharedDropout`: AF2 supplement 1.11.6, dropout whose mask is shared along the rows (``DropoutRowwise``) or
  the columns (``DropoutColumnwise``) of a ``[*, I, J, C]`` tensor.

Parameter names follow OpenFold3 (``layer_norm``, ``transition_mlp.layers.0.0``, ``transition_mlp.linear_out``;
SwiGLU: ``swiglu.linear_a``, ``swiglu.linear_b``, ``linear_out``) or OpenFold (``layer_norm``, ``linear_1``,
``linear_2``), chosen by :class:`~ds4sci.models.evoformer.primitives.Convention`.
"""
from __future__ import annotations

from typing import Optional
from typing import Union

import torch
from torch import Tensor
from torch import nn

from ds4sci.models.evoformer.primitives import Convention
from ds4sci.models.evoformer.primitives import LayerNorm
from ds4sci.models.evoformer.primitives import check_channels
from ds4sci.models.evoformer.primitives import check_chunk_size
from ds4sci.models.evoformer.primitives import init_linear
from ds4sci.models.evoformer.primitives import resolve_convention

TRANSITION_TYPES = ("relu", "swiglu")


class _ReLUMLP(nn.Module):
    """OpenFold3's ``ReLUTransitionLayer`` parameter layout: ``layers.0.0`` (the hidden linear) and ``linear_out``."""

    def __init__(self, c_in: int, c_hidden: int):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(init_linear(nn.Linear(c_in, c_hidden), "relu"), nn.ReLU())])
        self.linear_out = init_linear(nn.Linear(c_hidden, c_in), "final")

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_out(self.layers[0](x))


class _SwiGLU(nn.Module):
    """``swish(linear_a(x)) * linear_b(x)`` (Shazeer 2020), no biases."""

    def __init__(self, c_in: int, c_hidden: int):
        super().__init__()
        self.linear_a = init_linear(nn.Linear(c_in, c_hidden, bias=False), "relu")
        self.linear_b = init_linear(nn.Linear(c_in, c_hidden, bias=False), "relu")

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.silu(self.linear_a(x)) * self.linear_b(x)


class Transition(nn.Module):
    """The position-wise transition of ``x [*, I, J, C_in]`` (or ``[*, N, C_in]``): AF2 Algorithms 9/15 (``relu``)
    or AF3 Algorithm 11 (``swiglu``), hidden width ``n * c_in``.

    ``forward(x, mask=None, chunk_size=None)`` returns the update ``[*, ..., C_in]`` (to be added by the caller),
    multiplied by ``mask [*, ...]`` (1 keep, 0 pad) when given; ``chunk_size`` computes it ``chunk_size`` slices of
    dim -3 at a time (the same result, a smaller hidden activation at inference).
    """

    def __init__(self, c_in: int, n: int, transition_type: str = "relu", *,
                 convention: Union[str, Convention] = Convention.OPENFOLD3):
        super().__init__()
        convention = resolve_convention(convention)
        if transition_type not in TRANSITION_TYPES:
            raise ValueError(f"Transition: transition_type must be one of {TRANSITION_TYPES}, got {transition_type!r}")
        for name, value in (("c_in", c_in), ("n", n)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Transition: {name} must be a positive int, got {value!r}")
        if transition_type == "swiglu" and convention is Convention.OPENFOLD:
            raise ValueError("Transition: OpenFold (AlphaFold2) has no SwiGLU transition; use convention='openfold3'")
        self.c_in, self.n, self.transition_type = c_in, n, transition_type
        self.layer_norm = LayerNorm(c_in)
        c_hidden = n * c_in
        if transition_type == "swiglu":
            self.swiglu = _SwiGLU(c_in, c_hidden)
            self.linear_out = init_linear(nn.Linear(c_hidden, c_in, bias=False), "final")
        elif convention is Convention.OPENFOLD3:
            self.transition_mlp = _ReLUMLP(c_in, c_hidden)
        else:
            self.linear_1 = init_linear(nn.Linear(c_in, c_hidden), "relu")
            self.linear_2 = init_linear(nn.Linear(c_hidden, c_in), "final")

    def forward(self, x: Tensor, mask: Optional[Tensor] = None, chunk_size: Optional[int] = None) -> Tensor:
        check_channels(type(self).__name__, "x", x, self.c_in, "...", min_ndim=2)
        check_chunk_size(type(self).__name__, chunk_size)
        mask = None if mask is None else mask.unsqueeze(-1)  # [*, ..., 1]
        if chunk_size is None or x.ndim < 3 or chunk_size >= x.shape[-3]:
            return self._update(x, mask)
        pieces = []
        for start in range(0, x.shape[-3], chunk_size):
            rows = slice(start, start + chunk_size)
            piece_mask = None if mask is None else mask.expand(*x.shape[:-1], 1)[..., rows, :, :]
            pieces.append(self._update(x[..., rows, :, :], piece_mask))
        return torch.cat(pieces, dim=-3)

    def _update(self, x: Tensor, mask: Optional[Tensor]) -> Tensor:
        x = self.layer_norm(x)
        if self.transition_type == "swiglu":
            out = self.linear_out(self.swiglu(x))
        elif hasattr(self, "transition_mlp"):  # OpenFold3's layout
            out = self.transition_mlp(x)
        else:  # OpenFold's
            out = self.linear_2(torch.relu(self.linear_1(x)))
        return out if mask is None else out * mask


class SharedDropout(nn.Module):
    """Dropout of ``x [*, I, J, C]`` with one mask per row (``dim=-3``: the same for every i, OpenFold's
    ``DropoutRowwise``) or per column (``dim=-2``: ``DropoutColumnwise``); AF2 supplement 1.11.6. The identity in
    eval mode. No parameters."""

    def __init__(self, p: float, dim: int):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"SharedDropout: p must be in [0, 1), got {p!r}")
        if dim not in (-3, -2):
            raise ValueError(f"SharedDropout: dim must be -3 (rows) or -2 (columns), got {dim!r}")
        self.p, self.dim = p, dim

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        shape = list(x.shape)
        shape[self.dim] = 1
        return x * nn.functional.dropout(x.new_ones(shape), self.p, training=True)

    def extra_repr(self) -> str:
        return f"p={self.p}, shared along dim {self.dim}"
