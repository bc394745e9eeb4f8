"""Whole Evoformer and Pairformer blocks on ds4sci's attention kernels.

- :class:`PairStack`: the pair half of a block: triangle multiplication outgoing and incoming (AF2 Alg. 11, 12),
  triangle attention around the starting and the ending node (Alg. 13, 14), the pair transition (Alg. 15).
- :class:`EvoformerBlock`: AlphaFold2's Evoformer block (supplement Algorithm 6): MSA row attention with pair bias,
  MSA column attention, MSA transition, outer product mean, then the pair stack.
- :class:`AttentionPairBias` and :class:`PairformerBlock`: AlphaFold3's Pairformer block (supplement Algorithm 17):
  the pair stack, then attention over the single representation biased by the pair (Algorithm 24, no conditioning)
  and a SwiGLU transition.

Constructor arguments, parameter names and the order of operations are OpenFold's (``EvoformerBlock``, ``PairBlock``
as ``pair_stack``) and OpenFold3's (``PairFormerBlock``), so their state dicts load with ``strict=True``
(:class:`~ds4sci.models.evoformer.primitives.Convention`; the Pairformer exists in OpenFold3 only). Every attention
runs on :func:`ds4sci.kernels.evoformer_attention` with the ``backend`` given (changeable later through the
``backend`` attribute). The transitions' outputs are multiplied by the masks (OpenFold's default ``_mask_trans``).
"""
from __future__ import annotations

from typing import Optional
from typing import Union

from torch import Tensor
from torch import nn

from ds4sci.kernels import EvoformerBackend
from ds4sci.kernels import parse_backend
from ds4sci.models.evoformer.msa import MSAColumnAttention
from ds4sci.models.evoformer.msa import MSARowAttentionWithPairBias
from ds4sci.models.evoformer.outer_product_mean import OuterProductMean
from ds4sci.models.evoformer.primitives import Convention
from ds4sci.models.evoformer.primitives import GatedAttention
from ds4sci.models.evoformer.primitives import GatedAttentionLayer
from ds4sci.models.evoformer.primitives import LayerNorm
from ds4sci.models.evoformer.primitives import check_broadcasts
from ds4sci.models.evoformer.primitives import check_channels
from ds4sci.models.evoformer.primitives import init_linear
from ds4sci.models.evoformer.primitives import mask_bias
from ds4sci.models.evoformer.primitives import resolve_convention
from ds4sci.models.evoformer.transition import SharedDropout
from ds4sci.models.evoformer.transition import Transition
from ds4sci.models.evoformer.triangular_attention import TriangleAttentionEndingNode
from ds4sci.models.evoformer.triangular_attention import TriangleAttentionStartingNode
from ds4sci.models.evoformer.triangular_multiplicative_update import TriangleMultiplicationIncoming
from ds4sci.models.evoformer.triangular_multiplicative_update import TriangleMultiplicationOutgoing


class _Block(nn.Module):
    """A module holding Evoformer attention layers; its ``backend`` is theirs: read from the first, set on all."""

    def _attention_layers(self) -> list[nn.Module]:
        return [m for m in self.modules() if isinstance(m, (GatedAttentionLayer, AttentionPairBias))]

    @property
    def backend(self) -> EvoformerBackend:
        return self._attention_layers()[0].backend

    @backend.setter
    def backend(self, value: Union[str, EvoformerBackend]) -> None:
        value = parse_backend(value, EvoformerBackend)
        for layer in self._attention_layers():
            layer.backend = value


class PairStack(_Block):
    """The pair updates of an Evoformer or Pairformer block (AF2 Algorithm 6 lines 6-10, AF3 Algorithm 17 lines
    2-6): ``forward(z [*, N_res, N_res, C_z], pair_mask [*, N_res, N_res], chunk_size=None) -> z``.

    Parameter names as OpenFold's ``PairBlock``: ``tri_mul_out``, ``tri_mul_in``, ``tri_att_start``,
    ``tri_att_end``, ``pair_transition``. Row-shared dropout after the multiplications and the starting-node
    attention, column-shared after the ending-node attention (AF2 supplement 1.11.6).

    # DISCREPANCY: OpenFold3 gives the ending-node attention the transposed triangle bias (``b_ik`` where AF2's
    Algorithm 14 and OpenFold use ``b_ki``); the OpenFold3 convention follows OpenFold3 so that its weights give its
    outputs.
    """

    def __init__(self, c_z: int, c_hidden_mul: int, c_hidden_pair_att: int, no_heads_pair: int, transition_n: int,
                 pair_dropout: float, fuse_projection_weights: bool = False, inf: float = 1e9, *,
                 transition_type: str = "relu", backend: Union[str, EvoformerBackend] = EvoformerBackend.AUTO,
                 convention: Union[str, Convention] = Convention.OPENFOLD3):
        super().__init__()
        convention = resolve_convention(convention)
        self.transpose_end_bias = convention is Convention.OPENFOLD3
        self.tri_mul_out = TriangleMultiplicationOutgoing(c_z, c_hidden_mul, fuse_projection_weights,
                                                          convention=convention)
        self.tri_mul_in = TriangleMultiplicationIncoming(c_z, c_hidden_mul, fuse_projection_weights,
                                                         convention=convention)
        self.tri_att_start = TriangleAttentionStartingNode(c_z, c_hidden_pair_att, no_heads_pair, inf,
                                                           backend=backend, convention=convention)
        self.tri_att_end = TriangleAttentionEndingNode(c_z, c_hidden_pair_att, no_heads_pair, inf, backend=backend,
                                                       convention=convention)
        self.pair_transition = Transition(c_z, transition_n, transition_type, convention=convention)
        self.dropout_row = SharedDropout(pair_dropout, dim=-3)
        self.dropout_col = SharedDropout(pair_dropout, dim=-2)

    def forward(self, z: Tensor, pair_mask: Optional[Tensor] = None, chunk_size: Optional[int] = None) -> Tensor:
        z = z + self.dropout_row(self.tri_mul_out(z, pair_mask))
        z = z + self.dropout_row(self.tri_mul_in(z, pair_mask))
        z = z + self.dropout_row(self.tri_att_start(z, pair_mask, chunk_size))
        z = z + self.dropout_col(self.tri_att_end(z, pair_mask, chunk_size, transpose_bias=self.transpose_end_bias))
        return z + self.pair_transition(z, pair_mask, chunk_size)


class EvoformerBlock(_Block):
    """AlphaFold2's Evoformer block (supplement Algorithm 6), OpenFold's ``EvoformerBlock``.

    ``forward(m [*, N_seq, N_res, C_m], z [*, N_res, N_res, C_z], msa_mask [*, N_seq, N_res],
    pair_mask [*, N_res, N_res], chunk_size=None) -> (m, z)``:

    1. ``m += RowDropout(MSARowAttentionWithPairBias(m, z))``; ``m += MSAColumnAttention(m)`` (unless
       ``no_column_attention``); ``m += Transition(m)``;
    2. ``z += OuterProductMean(m)`` (before step 1 with ``opm_first``, AlphaFold-Multimer's order);
    3. ``z = PairStack(z)``.

    Arguments as OpenFold's (``eps`` is kept for its signature and, as there, unused: the outer product mean divides
    by its count plus 1e-3); ``transition_type`` (``relu``, AF2; ``swiglu``, OpenFold3's AF3-style option),
    ``backend`` and ``convention`` are keywords. ``chunk_size`` bounds the attention, transition and outer-product
    activations at inference; the result is the same.
    """

    def __init__(self, c_m: int, c_z: int, c_hidden_msa_att: int, c_hidden_opm: int, c_hidden_mul: int,
                 c_hidden_pair_att: int, no_heads_msa: int, no_heads_pair: int, transition_n: int, msa_dropout: float,
                 pair_dropout: float, no_column_attention: bool = False, opm_first: bool = False,
                 fuse_projection_weights: bool = False, inf: float = 1e9, eps: float = 1e-8, *,
                 transition_type: str = "relu", backend: Union[str, EvoformerBackend] = EvoformerBackend.AUTO,
                 convention: Union[str, Convention] = Convention.OPENFOLD3):
        super().__init__()
        self.c_m, self.c_z = c_m, c_z
        self.no_column_attention, self.opm_first, self.eps = no_column_attention, opm_first, eps
        self.msa_att_row = MSARowAttentionWithPairBias(c_m, c_z, c_hidden_msa_att, no_heads_msa, inf, backend=backend,
                                                       convention=convention)
        self.msa_dropout_layer = SharedDropout(msa_dropout, dim=-3)
        self.msa_transition = Transition(c_m, transition_n, transition_type, convention=convention)
        self.outer_product_mean = OuterProductMean(c_m, c_z, c_hidden_opm, convention=convention)
        self.pair_stack = PairStack(c_z, c_hidden_mul, c_hidden_pair_att, no_heads_pair, transition_n, pair_dropout,
                                    fuse_projection_weights, inf, transition_type=transition_type, backend=backend,
                                    convention=convention)
        if not no_column_attention:
            self.msa_att_col = MSAColumnAttention(c_m, c_hidden_msa_att, no_heads_msa, inf, backend=backend,
                                                  convention=convention)

    def forward(self, m: Tensor, z: Tensor, msa_mask: Optional[Tensor] = None, pair_mask: Optional[Tensor] = None,
                chunk_size: Optional[int] = None) -> tuple[Tensor, Tensor]:
        if self.opm_first:
            z = z + self.outer_product_mean(m, msa_mask, chunk_size)
        m = m + self.msa_dropout_layer(self.msa_att_row(m, z, msa_mask, chunk_size))
        if not self.no_column_attention:
            m = m + self.msa_att_col(m, msa_mask, chunk_size)
        m = m + self.msa_transition(m, msa_mask, chunk_size)
        if not self.opm_first:
            z = z + self.outer_product_mean(m, msa_mask, chunk_size)
        return m, self.pair_stack(z, pair_mask, chunk_size)


class AttentionPairBias(nn.Module):
    """Gated self-attention over the single representation biased by the pair representation (AF3 supplement
    Algorithm 24 without conditioning, OpenFold3's trunk ``AttentionPairBias``).

    ``forward(s [*, N, C_s], z [*, N, N, C_z], mask [*, N] | None) -> [*, N, C_s]`` (the update):
    ``o_i = g_i * sum_j softmax_j(q_i . k_j / sqrt(c) + b_ij + mask_j) v_j`` with ``q = Linear(LN(s))`` (with
    bias), ``k, v, g`` without, and ``b_ij = LinearNoBias(LN(z_ij))``; the single row is one row of the kernel's
    ``[*, N=1, S, H, D]`` layout, the pair bias broadcast inside the kernel.
    """

    def __init__(self, c_s: int, c_z: int, c_hidden: int, no_heads: int, inf: float = 1e9, *,
                 backend: Union[str, EvoformerBackend] = EvoformerBackend.AUTO):
        super().__init__()
        self.c_s, self.c_z, self.inf = c_s, c_z, inf
        self.backend = parse_backend(backend, EvoformerBackend)
        self.layer_norm_a = LayerNorm(c_s)
        self.layer_norm_z = LayerNorm(c_z)
        self.linear_z = init_linear(nn.Linear(c_z, no_heads, bias=False), "normal")
        self.mha = GatedAttention(c_s, c_hidden, no_heads, Convention.OPENFOLD3, q_bias=True)

    def forward(self, s: Tensor, z: Optional[Tensor], mask: Optional[Tensor] = None, *,
                bias: Optional[Tensor] = None) -> Tensor:
        """``bias``: instead of z (pass None), its bias ``[*, N, N, H]`` (:meth:`pair_bias_of`)."""
        layer = type(self).__name__
        check_channels(layer, "s", s, self.c_s, "N", min_ndim=2)
        n = s.shape[-2]
        if (z is None) == (bias is None):
            raise ValueError(f"{layer}: pass exactly one of z and bias")
        if z is not None:
            check_channels(layer, "z", z, self.c_z, "N, N")
            check_broadcasts(layer, "z", z, s.shape[:-2] + (n, n, self.c_z), "N, N, C_z", exact=3)
            bias = self.pair_bias_of(z)
        if mask is not None:
            check_broadcasts(layer, "mask", mask, s.shape[:-1], "N", exact=1)
        pair = bias.movedim(-1, -3).unsqueeze(-4)  # [*, N, N, H] -> [*, 1, H, N, N]
        key_bias = mask_bias(None if mask is None else mask.unsqueeze(-2), self.inf, s.dtype)  # [*, 1, 1, 1, N]
        x = self.layer_norm_a(s).unsqueeze(-3)  # [*, 1, N, C_s]: one row of N positions
        return self.mha(x, key_bias, pair, backend=self.backend).squeeze(-3)

    def pair_bias_of(self, z: Tensor) -> Tensor:
        """``b_ij^h = LinearNoBias(LayerNorm(z_ij))`` ``[*, I, J, H]`` (Alg. 24 line 6) of any slab of z (pointwise)."""
        return self.linear_z(self.layer_norm_z(z))


class PairformerBlock(_Block):
    """AlphaFold3's Pairformer block (supplement Algorithm 17), OpenFold3's ``PairFormerBlock``.

    ``forward(s [*, N, C_s], z [*, N, N, C_z], single_mask [*, N], pair_mask [*, N, N], chunk_size=None) -> (s, z)``:
    ``z = PairStack(z)``; ``s += AttentionPairBias(s, z)``; ``s += SwiGLU Transition(s)``. OpenFold3's arguments
    and parameter names (``pair_stack``, ``attn_pair_bias``, ``single_transition``).
    """

    def __init__(self, c_s: int, c_z: int, c_hidden_pair_bias: int, no_heads_pair_bias: int, c_hidden_mul: int,
                 c_hidden_pair_att: int, no_heads_pair: int, transition_type: str = "swiglu", transition_n: int = 4,
                 pair_dropout: float = 0.25, fuse_projection_weights: bool = False, inf: float = 1e9, *,
                 backend: Union[str, EvoformerBackend] = EvoformerBackend.AUTO):
        super().__init__()
        self.pair_stack = PairStack(c_z, c_hidden_mul, c_hidden_pair_att, no_heads_pair, transition_n, pair_dropout,
                                    fuse_projection_weights, inf, transition_type=transition_type, backend=backend)
        self.attn_pair_bias = AttentionPairBias(c_s, c_z, c_hidden_pair_bias, no_heads_pair_bias, inf, backend=backend)
        self.single_transition = Transition(c_s, transition_n, "swiglu")

    def forward(self, s: Tensor, z: Tensor, single_mask: Optional[Tensor] = None, pair_mask: Optional[Tensor] = None,
                chunk_size: Optional[int] = None) -> tuple[Tensor, Tensor]:
        z = self.pair_stack(z, pair_mask, chunk_size)
        s = s + self.attn_pair_bias(s, z, single_mask)
        s = s + self.single_transition(s, single_mask, chunk_size)
        return s, z
