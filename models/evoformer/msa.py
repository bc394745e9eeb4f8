"""MSA attention layers: row-wise gated self-attention with pair bias and column-wise gated self-attention.

AlphaFold2 supplement (Jumper et al. 2021), Algorithms 7 and 8, with OpenFold's constructor arguments and
parameter names (``layer_norm_m``, ``layer_norm_z``, ``linear_z``, ``mha.linear_{q,k,v,o,g}``; the column layer
wraps its attention in ``_msa_att``), so an OpenFold or OpenFold3 state dict of the same module loads with
``strict=True`` (see :class:`~ds4sci.models.evoformer.primitives.Convention`).
"""
from __future__ import annotations

from typing import Optional
from typing import Union

from torch import Tensor
from torch import nn

from ds4sci.kernels import EvoformerBackend
from ds4sci.kernels import parse_backend
from ds4sci.models.evoformer.primitives import Convention
from ds4sci.models.evoformer.primitives import GatedAttention
from ds4sci.models.evoformer.primitives import GatedAttentionLayer
from ds4sci.models.evoformer.primitives import LayerNorm
from ds4sci.models.evoformer.primitives import check_broadcasts
from ds4sci.models.evoformer.primitives import check_channels
from ds4sci.models.evoformer.primitives import init_linear


class MSAAttention(GatedAttentionLayer):
    """Gated self-attention along the residues of every MSA row, optionally biased by the pair representation.

    The shared body of :class:`MSARowAttentionWithPairBias` (``pair_bias=True``) and :class:`MSAColumnAttention`
    (``pair_bias=False``, applied to the transposed MSA).
    """

    def __init__(
        self,
        c_in: int,
        c_hidden: int,
        no_heads: int,
        pair_bias: bool = False,
        c_z: Optional[int] = None,
        inf: float = 1e9,
        *,
        backend: Union[str, EvoformerBackend] = EvoformerBackend.AUTO,
        convention: Union[str, Convention] = Convention.OPENFOLD3,
    ):
        if pair_bias and (not isinstance(c_z, int) or c_z < 1):
            raise ValueError(f"MSAAttention: c_z must be a positive int when pair_bias=True, got {c_z!r}")
        super().__init__(c_in, c_hidden, no_heads, inf, backend)
        self.pair_bias = pair_bias
        self.c_z = c_z
        self.layer_norm_m = LayerNorm(c_in)
        if pair_bias:
            self.layer_norm_z = LayerNorm(c_z)
            self.linear_z = init_linear(nn.Linear(c_z, no_heads, bias=False), "normal")
        else:
            self.layer_norm_z = None
            self.linear_z = None
        self.mha = GatedAttention(c_in, c_hidden, no_heads, convention)

    def forward(
        self,
        m: Tensor,
        z: Optional[Tensor] = None,
        mask: Optional[Tensor] = None,
        chunk_size: Optional[int] = None,
        *,
        layer: str = "MSAAttention",
        bias: Optional[Tensor] = None,
    ) -> Tensor:
        """
        Args:
            m: ``[*, N_seq, N_res, C_m]`` MSA representation (rows attend along N_res).
            z: ``[*, N_res, N_res, C_z]`` pair representation; with ``pair_bias``, it or ``bias`` is required.
            bias: instead of z, its pair bias ``[*, N_res, N_res, H]`` (:meth:`pair_bias_of`), computed by a caller
                that holds z in pieces (context parallelism: :mod:`ds4sci.parallel.evoformer`).
            mask: ``[*, N_seq, N_res]`` MSA mask (1 keep, 0 pad) or None.
            chunk_size: rows (along N_seq) per chunk for inference on very long inputs, or None.

        Returns:
            ``[*, N_seq, N_res, C_m]`` update (to be added to ``m`` by the caller).
        """
        self._check_rows(layer, "m", m, mask, chunk_size, "N_seq, N_res")
        pair = None
        n_res = m.shape[-2]
        if self.pair_bias and bias is not None:
            if z is not None:
                raise ValueError(f"{layer}: pass the pair representation z or its bias, not both")
            check_broadcasts(layer, "bias", bias, m.shape[:-3] + (n_res, n_res, self.no_heads), "N_res, N_res, H",
                             exact=3)
            pair = bias.movedim(-1, -3).unsqueeze(-4)  # [*, 1, H, N_res, N_res] (a view)
        elif self.pair_bias:
            if z is None:
                raise ValueError(f"{layer}: the pair representation z [*, N_res, N_res, C_z] is required")
            check_channels(layer, "z", z, self.c_z, "N_res, N_res")
            check_broadcasts(layer, "z", z, m.shape[:-3] + (n_res, n_res, self.c_z), "N_res, N_res, C_z", exact=3)
            pair = self.pair_bias_of(z).movedim(-1, -3).unsqueeze(-4)  # [*, 1, H, N_res, N_res] (a view)
        elif z is not None or bias is not None:
            raise ValueError(f"{layer}: got a pair representation z but this layer has no pair bias")

        m = self.layer_norm_m(m)  # [*, N_seq, N_res, C_m]   (Alg. 7/8 line 1)
        # lines 2-7: q, k, v, gate, softmax_j(q_si . k_sj / sqrt(c) + b_ij) v_sj, output projection; the mask
        # bias is [*, N_seq, 1, 1, N_res]
        return self._attend_rows(m, mask, pair, chunk_size)  # [*, N_seq, N_res, C_m]

    def pair_bias_of(self, z: Tensor) -> Tensor:
        """``b_ij^h = LinearNoBias(LayerNorm(z_ij))`` ``[*, I, J, H]`` (Alg. 7 line 3) of any slab of z (pointwise)."""
        return self.linear_z(self.layer_norm_z(z))


class MSARowAttentionWithPairBias(MSAAttention):
    """MSA row-wise gated self-attention with pair bias (AF2 supplement Algorithm 7).

    Constructor arguments as OpenFold's: ``c_m`` MSA channels, ``c_z`` pair channels, ``c_hidden`` channels per
    head, ``no_heads``, ``inf`` the mask constant; plus ``backend`` (a ``ds4sci.kernels.EvoformerBackend``, changeable
    later through the ``backend`` attribute) and ``convention`` (whose parameter layout to follow).
    """

    def __init__(
        self,
        c_m: int,
        c_z: int,
        c_hidden: int,
        no_heads: int,
        inf: float = 1e9,
        *,
        backend: Union[str, EvoformerBackend] = EvoformerBackend.AUTO,
        convention: Union[str, Convention] = Convention.OPENFOLD3,
    ):
        super().__init__(
            c_m, c_hidden, no_heads, pair_bias=True, c_z=c_z, inf=inf, backend=backend, convention=convention
        )

    def forward(
        self, m: Tensor, z: Optional[Tensor], mask: Optional[Tensor] = None, chunk_size: Optional[int] = None, *,
        bias: Optional[Tensor] = None,
    ) -> Tensor:
        """Algorithm 7: ``o_si = g_si * sum_j softmax_j(q_si . k_sj / sqrt(c) + b_ij) v_sj`` per head.

        Args:
            m: ``[*, N_seq, N_res, C_m]`` MSA representation.
            z: ``[*, N_res, N_res, C_z]`` pair representation (leading dims broadcast against m's).
            mask: ``[*, N_seq, N_res]`` MSA mask or None.
            chunk_size: MSA rows per chunk (inference on very long inputs), or None.
            bias: instead of z (pass None), its bias ``[*, N_res, N_res, H]`` (:meth:`pair_bias_of`).

        Returns:
            ``[*, N_seq, N_res, C_m]`` update.
        """
        # Kernel layout: N = N_seq rows, S = N_res positions; mask bias [*, N_seq, 1, 1, N_res],
        # pair bias [*, 1, H, N_res, N_res] broadcast over the rows inside the kernel.
        return super().forward(m, z, mask, chunk_size, layer=type(self).__name__, bias=bias)


class MSAColumnAttention(nn.Module):
    """MSA column-wise gated self-attention (AF2 supplement Algorithm 8).

    Row attention without pair bias on the transposed MSA; the attention lives in ``_msa_att`` as in OpenFold.
    """

    def __init__(
        self,
        c_m: int,
        c_hidden: int,
        no_heads: int,
        inf: float = 1e9,
        *,
        backend: Union[str, EvoformerBackend] = EvoformerBackend.AUTO,
        convention: Union[str, Convention] = Convention.OPENFOLD3,
    ):
        super().__init__()
        self.c_m = c_m
        self.c_hidden = c_hidden
        self.no_heads = no_heads
        self.inf = inf
        self._msa_att = MSAAttention(
            c_m, c_hidden, no_heads, pair_bias=False, inf=inf, backend=backend, convention=convention
        )

    @property
    def backend(self) -> EvoformerBackend:
        return self._msa_att.backend

    @backend.setter
    def backend(self, value: Union[str, EvoformerBackend]) -> None:
        self._msa_att.backend = parse_backend(value, EvoformerBackend)

    def forward(self, m: Tensor, mask: Optional[Tensor] = None, chunk_size: Optional[int] = None) -> Tensor:
        """Algorithm 8: ``o_si = g_si * sum_t softmax_t(q_si . k_ti / sqrt(c)) v_ti`` per head.

        Args:
            m: ``[*, N_seq, N_res, C_m]`` MSA representation.
            mask: ``[*, N_seq, N_res]`` MSA mask or None.
            chunk_size: MSA columns per chunk (inference on very long inputs), or None.

        Returns:
            ``[*, N_seq, N_res, C_m]`` update.
        """
        layer = type(self).__name__
        check_channels(layer, "m", m, self.c_m, "N_seq, N_res")
        if mask is not None:
            check_broadcasts(layer, "mask", mask, m.shape[:-1], "N_seq, N_res")
            mask = mask.transpose(-1, -2)  # [*, N_res, N_seq]
        # Kernel layout: N = N_res columns, S = N_seq positions (a strided view, no copy).
        m = m.transpose(-2, -3)  # [*, N_res, N_seq, C_m]
        m = self._msa_att(m, None, mask, chunk_size, layer=layer)  # [*, N_res, N_seq, C_m]
        return m.transpose(-2, -3)  # [*, N_seq, N_res, C_m]
