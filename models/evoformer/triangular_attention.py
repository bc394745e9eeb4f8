"""Triangle attention around the starting node and around the ending node.

AlphaFold2 supplement (Jumper et al. 2021), Algorithms 13 and 14 (AlphaFold3's Algorithms 14 and 15), with
OpenFold's constructor arguments and parameter names (``layer_norm``, ``linear_z`` in OpenFold3 or ``linear`` in
OpenFold, ``mha.linear_{q,k,v,o,g}``), so a state dict of the same OpenFold module loads with ``strict=True``.
The ending-node layer is the starting-node layer applied to the transposed pair representation.
"""
from __future__ import annotations

from typing import Optional
from typing import Union

from torch import Tensor
from torch import nn

from ds4sci.kernels import EvoformerBackend
from ds4sci.models.evoformer.primitives import Convention
from ds4sci.models.evoformer.primitives import GatedAttention
from ds4sci.models.evoformer.primitives import GatedAttentionLayer
from ds4sci.models.evoformer.primitives import LayerNorm
from ds4sci.models.evoformer.primitives import init_linear
from ds4sci.models.evoformer.primitives import resolve_convention


class TriangleAttention(GatedAttentionLayer):
    """Gated triangle self-attention of the pair representation ``z [*, N_res, N_res, C_z]``.

    Constructor arguments as OpenFold's: ``c_in`` pair channels, ``c_hidden`` channels per head, ``no_heads``,
    ``starting`` (around the starting node, Alg. 13, or the ending node, Alg. 14), ``inf`` the mask constant;
    plus ``backend`` (a ``ds4sci.kernels.EvoformerBackend``, changeable later through the ``backend`` attribute) and
    ``convention`` (whose parameter layout to follow).
    """

    def __init__(
        self,
        c_in: int,
        c_hidden: int,
        no_heads: int,
        starting: bool = True,
        inf: float = 1e9,
        *,
        backend: Union[str, EvoformerBackend] = EvoformerBackend.AUTO,
        convention: Union[str, Convention] = Convention.OPENFOLD3,
    ):
        convention = resolve_convention(convention)
        super().__init__(c_in, c_hidden, no_heads, inf, backend)
        self.starting = starting
        self.layer_norm = LayerNorm(c_in)
        # the triangle-bias projection is "linear_z" in OpenFold3 and "linear" in OpenFold
        self._bias_name = "linear" if convention is Convention.OPENFOLD else "linear_z"
        self.add_module(self._bias_name, init_linear(nn.Linear(c_in, no_heads, bias=False), "normal"))
        self.mha = GatedAttention(c_in, c_hidden, no_heads, convention)

    def forward(
        self,
        x: Tensor,
        mask: Optional[Tensor] = None,
        chunk_size: Optional[int] = None,
        *,
        transpose_bias: bool = False,
        bias: Optional[Tensor] = None,
    ) -> Tensor:
        """Algorithm 13 (``starting``) or 14, per head:

        - starting node: ``o_ij = g_ij * sum_k softmax_k(q_ij . k_ik / sqrt(c) + b_jk) v_ik``;
        - ending node:   ``o_ij = g_ij * sum_k softmax_k(q_ij . k_kj / sqrt(c) + b_ki) v_kj``;

        with ``b_jk = LinearNoBias(LayerNorm(z_jk))`` and mask bias ``inf * (mask - 1)`` on the keys.

        Args:
            x: ``[*, I, J, C_z]`` pair representation (I == J).
            mask: ``[*, I, J]`` pair mask (1 keep, 0 pad) or None.
            chunk_size: rows per chunk (along I for the starting node, J for the ending node) for inference
                on very long inputs, or None.
            transpose_bias: use the transposed triangle bias (``b_kj`` for the starting node, ``b_ik`` for the
                ending node). # DISCREPANCY: not in the AF2 supplement; OpenFold3's ``TriangleAttention`` has
                the option and its PairBlock calls the ending-node attention with it (on a pre-transposed z).
            bias: the whole pair representation's triangle bias ``[*, N, N, H]`` (:meth:`triangle_bias` of z, in z's
                orientation), computed by the caller; then ``x`` may be any rows (starting node) or columns (ending
                node) of z, ``[*, I', N, C_z]`` or ``[*, N, J', C_z]``, and ``mask`` the same slab of the pair mask
                (context parallelism: :mod:`ds4sci.parallel.evoformer`).

        Returns:
            ``[*, I, J, C_z]`` update (to be added to ``x`` by the caller).
        """
        layer = type(self).__name__
        self._check_rows(layer, "x", x, mask, chunk_size, "I, J")
        n = x.shape[-2] if self.starting else x.shape[-3]  # the attended axis: the whole of z's side
        if bias is None and x.shape[-3] != x.shape[-2]:
            raise ValueError(
                f"{layer}: the pair representation must be square [*, N_res, N_res, C_z], got {tuple(x.shape)}"
            )
        if bias is not None and (bias.ndim < 3 or bias.shape[-3:] != (n, n, self.no_heads)):
            raise ValueError(f"{layer}: bias must have shape [*, {n}, {n}, {self.no_heads}] (the whole pair "
                             f"representation's), got {tuple(bias.shape)}")
        if not self.starting:
            # Algorithm 14 = Algorithm 13 on z^T: rows become columns (strided views, no copies)
            x = x.transpose(-2, -3)  # [*, J, I, C_z]
            mask = None if mask is None else mask.transpose(-1, -2)  # [*, J, I]
            bias = None if bias is None else bias.transpose(-2, -3)
        # Shapes below are named for the starting node; for the ending node I and J are swapped.
        x = self.layer_norm(x)  # [*, I, J, C_z]   (line 1)
        pair = getattr(self, self._bias_name)(x) if bias is None else bias  # [*, I, J, H]   b_jk (line 3)
        # [*, J, K, H] -> [*, H, J, K] (or [*, H, K, J] transposed) -> [*, 1, H, J, K]
        pair = (pair.movedim(-1, -3) if not transpose_bias else pair.movedim(-1, -3).transpose(-1, -2)).unsqueeze(-4)
        # Kernel layout: N = I rows, S = J positions, mask bias [*, I, 1, 1, J]; lines 2, 4-6: q, k, v, gate,
        # softmax over k, output
        out = self._attend_rows(x, mask, pair, chunk_size)  # [*, I, J, C_z]
        if not self.starting:
            out = out.transpose(-2, -3)
        return out

    def triangle_bias(self, z: Tensor) -> Tensor:
        """``b = LinearNoBias(LayerNorm(z))`` ``[*, I, J, H]`` (Alg. 13/14 line 3) of any slab of z (it is pointwise),
        in z's orientation: the ``bias`` a caller holding only part of z gathers and passes to :meth:`forward`."""
        return getattr(self, self._bias_name)(self.layer_norm(z))


class _TriangleAttentionAroundNode(TriangleAttention):
    """OpenFold's constructor of the two named classes: :class:`TriangleAttention` with ``starting`` fixed by the
    subclass (``inf`` stays the fourth positional argument)."""

    STARTING: bool

    def __init__(
        self,
        c_in: int,
        c_hidden: int,
        no_heads: int,
        inf: float = 1e9,
        *,
        backend: Union[str, EvoformerBackend] = EvoformerBackend.AUTO,
        convention: Union[str, Convention] = Convention.OPENFOLD3,
    ):
        super().__init__(
            c_in, c_hidden, no_heads, starting=self.STARTING, inf=inf, backend=backend, convention=convention
        )


class TriangleAttentionStartingNode(_TriangleAttentionAroundNode):
    """Triangle gated self-attention around the starting node (AF2 supplement Algorithm 13)."""

    STARTING = True


class TriangleAttentionEndingNode(_TriangleAttentionAroundNode):
    """Triangle gated self-attention around the ending node (AF2 supplement Algorithm 14)."""

    STARTING = False
