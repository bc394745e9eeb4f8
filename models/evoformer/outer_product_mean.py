"""Outer product mean: the MSA's update of the pair representation (AF2 supplement Algorithm 10, AF3 Algorithm 9).

``a = Linear_1(LN(m)) * mask``, ``b = Linear_2(LN(m)) * mask`` (``[*, N_seq, N_res, c]``);
``z_ij = Linear_out(flatten_ce(sum_s a_sic b_sje)) / (sum_s mask_si mask_sj + eps)``: as in OpenFold and AlphaFold's
code, the output projection (bias included) is applied to the sum and the result divided by the number of sequences
present at both residues. Parameter names ``layer_norm``, ``linear_1``, ``linear_2``, ``linear_out``; OpenFold3 has
no bias on ``linear_1``/``linear_2``, OpenFold has one (:class:`~ds4sci.models.evoformer.primitives.Convention`).
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor, nn

from ds4sci.models.evoformer.primitives import Convention, LayerNorm, check_broadcasts, check_channels, \
    check_chunk_size, init_linear, resolve_convention


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
        mask = mask.to(m.dtype).expand(m.shape[:-1]).unsqueeze(-1)  # [*, N_seq, N_res, 1]
        ln = self.layer_norm(m)
        a = self.linear_1(ln) * mask  # [*, N_seq, N_res, c]
        b = self.linear_2(ln) * mask
        count = torch.einsum("...si,...sj->...ij", mask[..., 0], mask[..., 0]).unsqueeze(-1) + self.eps  # [*, I, J, 1]
        n_res = m.shape[-2]
        step = n_res if chunk_size is None else chunk_size
        pieces = []
        for start in range(0, n_res, step):
            a_rows = a[..., start : start + step, :]  # [*, N_seq, chunk, c]
            outer = torch.einsum("...sic,...sje->...ijce", a_rows, b)  # [*, chunk, N_res, c, c]
            pieces.append(self.linear_out(outer.flatten(-2)))  # [*, chunk, N_res, C_z]
        return torch.cat(pieces, dim=-3) / count
