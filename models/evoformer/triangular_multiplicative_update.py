"""Triangle multiplicative updates of the pair representation (AF2 supplement Algorithms 11 and 12, AF3 12 and 13).

With ``x = LN_in(z)``, ``a = mask * sigmoid(Linear_a_g(x)) * Linear_a_p(x)`` and ``b`` likewise (``[*, I, J, c]``):

- outgoing edges (Alg. 11): ``p_ij = sum_k a_ik * b_jk``;
- incoming edges (Alg. 12): ``p_ij = sum_k a_ki * b_kj``;

and the update is ``sigmoid(Linear_g(x)) * Linear_z(LN_out(p))``. AlphaFold-Multimer's fused form
(``fuse_projection_weights``) projects ``a`` and ``b`` with one ``linear_ab_p``/``linear_ab_g`` of width ``2c``
(``a`` its first half). Parameter names as OpenFold's (``layer_norm_in``, ``layer_norm_out``, ``linear_a_p``,
``linear_a_g``, ``linear_b_p``, ``linear_b_g`` or ``linear_ab_p``, ``linear_ab_g``, ``linear_g``, ``linear_z``);
OpenFold3's projections have no bias, OpenFold's have one (:class:`~ds4sci.models.evoformer.primitives.Convention`).

``forward`` runs :func:`ds4sci.kernels.triangle_multiplicative_update` with the module's ``backend`` (a
:class:`~ds4sci.kernels.TriMulBackend`: ``"auto"``/``"chunked"``, ``"torch"``; changeable later through the
attribute). The context-parallel forms (:mod:`ds4sci.parallel.evoformer`) run the same math in the kernels' steps
(:func:`~ds4sci.kernels.trimul.triangle_operand`, :func:`~ds4sci.kernels.trimul.channel_product`,
:func:`~ds4sci.kernels.trimul.triangle_finish`) on shards and mesh tiles, with the module's weights.
"""
from __future__ import annotations

from typing import Optional
from typing import Union

from torch import Tensor
from torch import nn

from ds4sci.kernels import TriMulBackend
from ds4sci.kernels import TriMulParams
from ds4sci.kernels import parse_backend
from ds4sci.kernels import triangle_multiplicative_update
from ds4sci.models.evoformer.primitives import Convention
from ds4sci.models.evoformer.primitives import LayerNorm
from ds4sci.models.evoformer.primitives import check_broadcasts
from ds4sci.models.evoformer.primitives import check_channels
from ds4sci.models.evoformer.primitives import init_linear
from ds4sci.models.evoformer.primitives import resolve_convention


class TriangleMultiplicativeUpdate(nn.Module):
    """``forward(z [*, N_res, N_res, C_z], mask [*, N_res, N_res] | None, chunk_size=None) -> [*, N_res, N_res, C_z]``
    (the update of z; ``chunk_size``: rows per block of the chunked backend, None its default). ``outgoing``:
    Algorithm 11 (True) or 12 (False); ``fuse_projection_weights``: AlphaFold-Multimer's fused projections;
    ``backend``: :class:`~ds4sci.kernels.TriMulBackend`."""

    def __init__(self, c_z: int, c_hidden: int, outgoing: bool = True, fuse_projection_weights: bool = False, *,
                 convention: Union[str, Convention] = Convention.OPENFOLD3,
                 backend: Union[str, TriMulBackend] = TriMulBackend.AUTO):
        super().__init__()
        self.backend = parse_backend(backend, TriMulBackend)
        convention = resolve_convention(convention)
        for name, value in (("c_z", c_z), ("c_hidden", c_hidden)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{type(self).__name__}: {name} must be a positive int, got {value!r}")
        self.c_z, self.c_hidden, self.outgoing, self.fused = c_z, c_hidden, outgoing, fuse_projection_weights
        bias = convention is Convention.OPENFOLD

        def linear(c_in, c_out, kind):
            return init_linear(nn.Linear(c_in, c_out, bias=bias), kind)

        self.linear_g = linear(c_z, c_z, "gating")
        self.linear_z = linear(c_hidden, c_z, "final")
        self.layer_norm_in = LayerNorm(c_z)
        self.layer_norm_out = LayerNorm(c_hidden)
        if fuse_projection_weights:
            self.linear_ab_p = linear(c_z, 2 * c_hidden, "lecun")
            self.linear_ab_g = linear(c_z, 2 * c_hidden, "gating")
        else:
            self.linear_a_p = linear(c_z, c_hidden, "lecun")
            self.linear_a_g = linear(c_z, c_hidden, "gating")
            self.linear_b_p = linear(c_z, c_hidden, "lecun")
            self.linear_b_g = linear(c_z, c_hidden, "gating")

    def forward(self, z: Tensor, mask: Optional[Tensor] = None, chunk_size: Optional[int] = None) -> Tensor:
        layer = type(self).__name__
        check_channels(layer, "z", z, self.c_z, "N_res, N_res")
        if mask is not None:
            check_broadcasts(layer, "mask", mask, z.shape[:-1], "N_res, N_res")
        return triangle_multiplicative_update(z, mask, TriMulParams.from_module(self), outgoing=self.outgoing,
                                              eps=self.layer_norm_in.eps, backend=self.backend,
                                              chunk_size=chunk_size)


class TriangleMultiplicationOutgoing(TriangleMultiplicativeUpdate):
    """Triangle update using outgoing edges (AF2 Algorithm 11); OpenFold's constructor ``(c_z, c_hidden)``."""

    def __init__(self, c_z: int, c_hidden: int, fuse_projection_weights: bool = False, *,
                 convention: Union[str, Convention] = Convention.OPENFOLD3,
                 backend: Union[str, TriMulBackend] = TriMulBackend.AUTO):
        super().__init__(c_z, c_hidden, True, fuse_projection_weights, convention=convention, backend=backend)


class TriangleMultiplicationIncoming(TriangleMultiplicativeUpdate):
    """Triangle update using incoming edges (AF2 Algorithm 12); OpenFold's constructor ``(c_z, c_hidden)``."""

    def __init__(self, c_z: int, c_hidden: int, fuse_projection_weights: bool = False, *,
                 convention: Union[str, Convention] = Convention.OPENFOLD3,
                 backend: Union[str, TriMulBackend] = TriMulBackend.AUTO):
        super().__init__(c_z, c_hidden, False, fuse_projection_weights, convention=convention, backend=backend)
