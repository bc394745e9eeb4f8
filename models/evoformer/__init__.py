"""ds4sci.models.evoformer: Evoformer attention layers and whole Evoformer / Pairformer blocks (OpenFold-compatible).

The four attention layers of AlphaFold2's Evoformer (supplement Algorithms 7, 8, 13, 14), running on
``ds4sci.kernels.evoformer_attention`` (the logits are never stored; backend chosen with one
:class:`~ds4sci.kernels.EvoformerBackend`), with OpenFold's constructor arguments and parameter names so that an
OpenFold3 (default) or OpenFold state dict of the same module loads with ``load_state_dict(strict=True)``::

    from ds4sci.models.evoformer import MSARowAttentionWithPairBias
    layer = MSARowAttentionWithPairBias(c_m=256, c_z=128, c_hidden=32, no_heads=8)
    layer.load_state_dict(openfold3_layer.state_dict(), strict=True)
    m = m + layer(m, z, mask=msa_mask)                  # [*, N_seq, N_res, C_m]
    m = m + layer(m, z, mask=msa_mask, chunk_size=64)   # inference on very deep MSAs
"""
from ds4sci.models.evoformer.blocks import AttentionPairBias
from ds4sci.models.evoformer.blocks import EvoformerBlock
from ds4sci.models.evoformer.blocks import PairformerBlock
from ds4sci.models.evoformer.blocks import PairStack
from ds4sci.models.evoformer.msa import MSAAttention
from ds4sci.models.evoformer.msa import MSAColumnAttention
from ds4sci.models.evoformer.msa import MSARowAttentionWithPairBias
from ds4sci.models.evoformer.outer_product_mean import OuterProductMean
from ds4sci.models.evoformer.primitives import Convention
from ds4sci.models.evoformer.primitives import GatedAttention
from ds4sci.models.evoformer.primitives import LayerNorm
from ds4sci.models.evoformer.transition import SharedDropout
from ds4sci.models.evoformer.transition import Transition
from ds4sci.models.evoformer.triangular_attention import TriangleAttention
from ds4sci.models.evoformer.triangular_attention import TriangleAttentionEndingNode
from ds4sci.models.evoformer.triangular_attention import TriangleAttentionStartingNode
from ds4sci.models.evoformer.triangular_multiplicative_update import TriangleMultiplicationIncoming
from ds4sci.models.evoformer.triangular_multiplicative_update import TriangleMultiplicationOutgoing
from ds4sci.models.evoformer.triangular_multiplicative_update import TriangleMultiplicativeUpdate

__all__ = [
    "AttentionPairBias",
    "Convention",
    "EvoformerBlock",
    "GatedAttention",
    "LayerNorm",
    "MSAAttention",
    "MSAColumnAttention",
    "MSARowAttentionWithPairBias",
    "OuterProductMean",
    "PairStack",
    "PairformerBlock",
    "SharedDropout",
    "Transition",
    "TriangleAttention",
    "TriangleAttentionEndingNode",
    "TriangleAttentionStartingNode",
    "TriangleMultiplicationIncoming",
    "TriangleMultiplicationOutgoing",
    "TriangleMultiplicativeUpdate",
]
