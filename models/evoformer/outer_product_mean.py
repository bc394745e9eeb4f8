"""Outer product mean: the MSA's update of the pair representation (AF2 supplement Algorithm 10, AF3 Algorithm 9).

``a = Linear_1(LN(m)) * mask``, ``b = Linear_2(LN(m)) * mask`` (``[*, N_seq, N_res, c]``);
``z_ij = Linear_out(flatten_ce(sum_s a_sic b_sje)) / (sum_s mask_si mask_sj + eps)``: as in OpenFold and AlphaFold's
code, the output projection (bias included) is applied to the sum and the result divided by the number of sequences
present at both residues. Parameter names ``layer_norm``, ``linear_1``, ``linear_2``, ``linear_out``; OpenFold3 has
no bias on ``linear_1``/``linear_2``, OpenFold has one (:class:`~ds4sci.models.evoformer.primitives.Convention`).
"""
from __future__ import annotations

from typing import Optional
from typing import Union

import torch
from torch import Tensor
from torch import nn

from ds4sci.models.evoformer.primitives import Convention
from ds4sci.models.evoformer.primitives import LayerNorm
from ds4sci.models.evoformer.primitives import check_broadcasts
from ds4sci.models.evoformer.primitives import check_channels
from ds4sci.models.evoformer.primitives import check_chunk_size
from ds4sci.models.evoformer.primitives import init_linear
from ds4sci.models.evoformer.primitives import resolve_convention


class OuterProductMean(nn.Module):
    """``forward(m [*, N_seq, N_res, C_m], mask [*, N_seq, N_res] | None, chunk_size=None) -> [*, N_res, N_res, C_z]``
    (the update of z). ``chunk_size``: residues i per chunk (the ``[*, chunk, N_res, c*c]`` outer products bounded at
    inference; the same result)."""

    def __init__(self, c_m: int, c_z: int, c_hidden: int, eps: float = 1e-3, *,
                 convention: Union[str, Convention] = Convention.OPENFOLD3):
        super().__init__()
        convention = resolve_convention(convention)
        for name, value in (("c_m", c_m), ("c_z", c_z), ("c_hidden", c_hidden)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"OuterProductMean: {name} must be a positive int, got {value!r}")
        self.c_m, self.c_z, self.c_hidden, self.eps = c_m, c_z, c_hidden, eps
        bias = convention is Convention.OPENFOLD
        self.layer_norm = LayerNorm(c_m)
        self.linear_1 = init_linear(nn.Linear(c_m, c_hidden, bias=bias), "lecun")
        self.linear_2 = init_linear(nn.Linear(c_m, c_hidden, bias=bias), "lecun")
        self.linear_out = init_linear(nn.Linear(c_hidden * c_hidden, c_z), "final")

    def forward(self, m: Tensor, mask: Optional[Tensor] = None, chunk_size: Optional[int] = None) -> Tensor:
        layer = type(self).__name__
        check_channels(layer, "m", m, self.c_m, "N_seq, N_res")
        check_chunk_size(layer, chunk_size)
        if mask is None:
            mask = m.new_ones(m.shape[:-1])
        check_broadcasts(layer, "mask", mask, m.shape[:-1], "N_seq, N_res")
        a, b, mask = self.project(m, mask)
        return self.outer(a, b, mask, mask, chunk_size)

    def project(self, m: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``a = Linear_1(LN(m)) * mask``, ``b = Linear_2(LN(m)) * mask`` ``[*, N_seq, N_res', c]`` and the mask as
        ``[*, N_seq, N_res']`` in m's dtype, for any residues of m (pointwise along N_res)."""
        mask = mask.to(m.dtype).expand(m.shape[:-1])
        ln = self.layer_norm(m)
        return self.linear_1(ln) * mask.unsqueeze(-1), self.linear_2(ln) * mask.unsqueeze(-1), mask

    def outer(self, a: Tensor, b: Tensor, mask_a: Tensor, mask_b: Tensor, chunk_size: Optional[int] = None) -> Tensor:
        """The update ``[*, I, J, C_z]`` of residues ``i`` of ``a`` (``[*, N_seq, I, c]``, mask ``[*, N_seq, I]``)
        against residues ``j`` of ``b``: ``Linear_out(flatten(sum_s a_si b_sj)) / (sum_s mask_si mask_sj + eps)``,
        ``chunk_size`` residues i at a time."""
        count = torch.einsum("...si,...sj->...ij", mask_a, mask_b).unsqueeze(-1) + self.eps  # [*, I, J, 1]
        n = a.shape[-2]
        step = n if chunk_size is None else chunk_size
        pieces = []
        for start in range(0, n, step):
            outer = torch.einsum("...sic,...sje->...ijce", a[..., start : start + step, :], b)  # [*, i, J, c, c]
            pieces.append(self.linear_out(outer.flatten(-2)))  # [*, i, J, C_z]
        return torch.cat(pieces, dim=-3) / count
