"""Triangle attention around the starting node and around the ending node.

AlphaFold2 supplement (Jumper et al. 2021), Algorithms 13 and 14 (AlphaFold3's Algorithms 14 and 15), with
OpenFold's constructor arguments and parameter names (``layer_norm``, ``linear_z`` in OpenFold3 or ``linear`` in
OpenFold, ``mha.linear_{q,k,v,o,g}``), so a state dict of the same OpenFold module loads with ``strict=True``.
The ending-node layer is the starting-node layer applied to the transposed pair representation.
"""
from __future__ import annotations

from typing import Optional, Union

from torch import Tensor, nn

from ds4sci.kernels import EvoformerBackend, parse_backend
from ds4sci.models.evoformer.primitives import (
    Convention,
    GatedAttention,
    LayerNorm,
    check_broadcasts,
    check_channels,
    check_chunk_size,
    init_linear,
    mask_bias,
    resolve_convention,
)


class TriangleAttention(nn.Module):
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
        super().__init__()
        convention = resolve_convention(convention)
        self.c_in = c_in
        self.c_hidden = c_hidden
        self.no_heads = no_heads
        self.starting = starting
        self.inf = inf
        self.backend = parse_backend(backend, EvoformerBackend)
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

        Returns:
            ``[*, I, J, C_z]`` update (to be added to ``x`` by the caller).
        """
        layer = type(self).__name__
        check_channels(layer, "x", x, self.c_in, "I, J")
        check_chunk_size(layer, chunk_size)
        if x.shape[-3] != x.shape[-2]:
            raise ValueError(
                f"{layer}: the pair representation must be square [*, N_res, N_res, C_z], got {tuple(x.shape)}"
            )
        if mask is not None:
            check_broadcasts(layer, "mask", mask, x.shape[:-1], "I, J")
        if not self.starting:
            # Algorithm 14 = Algorithm 13 on z^T: rows become columns (strided views, no copies)
            x = x.transpose(-2, -3)  # [*, J, I, C_z]
            mask = None if mask is None else mask.transpose(-1, -2)  # [*, J, I]
        # Shapes below are named for the starting node; for the ending node I and J are swapped.
        x = self.layer_norm(x)  # [*, I, J, C_z]   (line 1)
        pair = getattr(self, self._bias_name)(x)  # [*, I, J, H]   b_jk (line 3)
        # [*, J, K, H] -> [*, H, J, K] (or [*, H, K, J] transposed) -> [*, 1, H, J, K]
        pair = (pair.movedim(-1, -3) if not transpose_bias else pair.movedim(-1, -3).transpose(-1, -2)).unsqueeze(-4)
        bias = mask_bias(mask, self.inf, x.dtype)  # [*, I, 1, 1, J]
        # Kernel layout: N = I rows, S = J positions; lines 2, 4-6: q, k, v, gate, softmax over k, output
        out = self.mha(x, bias, pair, backend=self.backend, chunk_size=chunk_size)  # [*, I, J, C_z]
        if not self.starting:
            out = out.transpose(-2, -3)
        return out


class TriangleAttentionStartingNode(TriangleAttention):
    """Triangle gated self-attention around the starting node (AF2 supplement Algorithm 13)."""

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
        super().__init__(c_in, c_hidden, no_heads, starting=True, inf=inf, backend=backend, convention=convention)


class TriangleAttentionEndingNode(TriangleAttention):
    """Triangle gated self-attention around the ending node (AF2 supplement Algorithm 14)."""

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
        super().__init__(c_in, c_hidden, no_heads, starting=False, inf=inf, backend=backend, convention=convention)
