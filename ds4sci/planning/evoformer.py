"""Memory per GPU of an Evoformer (AlphaFold2) or Pairformer (AlphaFold3) trunk (``ds4sci plan-evoformer``'s model).

A crop of ``N_res`` residues on one GPU, by axial (1-D) context parallelism over P GPUs or on a p x p mesh (2-D),
in training (per-block checkpointing) or inference. Arithmetic only (no torch): every term counts the tensors
ds4sci's code keeps (:mod:`ds4sci.models.evoformer`, :mod:`ds4sci.kernels.evoformer`, the Evoformer context
parallelism), never a fitted factor. Bytes per rank, with ``e`` bytes per element, ``N`` residues and ``S`` MSA
sequences padded to multiples of the shard count, ``L`` blocks of an :class:`EvoformerShape`. The terms
(:class:`EvoformerMemory`): parameters on every rank; the representations ``z [N, N, C_z]`` and ``m [S, N, C_m]``
(the Pairformer's ``s [N, C_s]``), ``1/P`` or ``1/p^2`` of each; per-block checkpoints; what one block saves for
backward; the 1-D all-gathers that do not shrink with P (FastFold's); the working set; the 1-D exit gathers; a
reserve.

Anchors: FastFold (Cheng et al. 2022, arXiv:2203.00854), Fold-CP (Lin et al. 2026, arXiv:2603.14806). The
derivation of each term and what it was measured against are in ``docs/explanation/planner.md``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from dataclasses import replace

from ds4sci.kernels.backends import TRIMUL_CHUNK_BYTES
from ds4sci.planning.common import DTYPE_BYTES
from ds4sci.planning.common import GIB
from ds4sci.planning.common import STATE_BYTES

MODES = ("training", "inference")
BACKENDS = ("kernel", "reference")
LAYOUTS = ("1", "1d", "2d")
#: the torch backend's bound on one fp32 logits block, scratch inside the kernel op (the Triton kernel keeps none):
#: ds4sci.kernels.evoformer_chunked.LOGITS_CHUNK_BYTES, which imports torch (a test checks they are equal)
TORCH_LOGITS_BLOCK = 4 * 2**20


@dataclass(frozen=True)
class EvoformerShape:
    """The constructor numbers of one block (``kind`` ``evoformer``: :class:`~ds4sci.models.evoformer.EvoformerBlock`,
    OpenFold's convention, biases on gates and projections; ``pairformer``:
    :class:`~ds4sci.models.evoformer.PairformerBlock`, OpenFold3's) and the number of blocks. For a Pairformer
    ``c_m`` is ``c_s`` and the MSA attention fields are its single attention's (``c_hidden_pair_bias``,
    ``no_heads_pair_bias``)."""

    kind: str
    blocks: int
    c_m: int
    c_z: int
    c_hidden_msa_att: int
    no_heads_msa: int
    c_hidden_opm: int
    c_hidden_mul: int
    c_hidden_pair_att: int
    no_heads_pair: int
    transition_n: int
    transition_type: str

    @property
    def evoformer(self) -> bool:
        return self.kind == "evoformer"

    def block_parameters(self) -> int:
        """Parameters of one block (the module's own ``sum(p.numel())``; tests/planning/test_evoformer_plan.py)."""
        openfold = self.evoformer  # OpenFold's convention: biased gate, output and projections

        def ln(c):
            return 2 * c

        def attention(c_in, c, h, q_bias=False):  # q, k, v, output and gate projections
            hc = h * c
            return 3 * c_in * hc + (hc if q_bias else 0) + 2 * c_in * hc + ((c_in + hc) if openfold else 0)

        def transition(c, kind):
            nc = self.transition_n * c
            return ln(c) + (3 * c * nc if kind == "swiglu" else 2 * c * nc + nc + c)

        def tri_mul():
            cz, c, b = self.c_z, self.c_hidden_mul, openfold
            return ln(cz) + ln(c) + cz * cz + c * cz + 4 * cz * c + (cz + cz + 4 * c if b else 0)

        def tri_att():
            return ln(self.c_z) + self.c_z * self.no_heads_pair + attention(self.c_z, self.c_hidden_pair_att,
                                                                           self.no_heads_pair)

        pair = 2 * tri_mul() + 2 * tri_att() + transition(self.c_z, self.transition_type)
        cm, h = self.c_m, self.no_heads_msa
        if not self.evoformer:  # AttentionPairBias (q with bias, OpenFold3: no gate/output bias) and SwiGLU
            single = ln(cm) + ln(self.c_z) + self.c_z * h + 3 * cm * h * self.c_hidden_msa_att \
                + h * self.c_hidden_msa_att + 2 * cm * h * self.c_hidden_msa_att
            return pair + single + transition(cm, "swiglu")
        c = self.c_hidden_opm
        row = ln(cm) + ln(self.c_z) + self.c_z * h + attention(cm, self.c_hidden_msa_att, h)
        col = ln(cm) + attention(cm, self.c_hidden_msa_att, h)
        opm = ln(cm) + 2 * (cm * c + c) + c * c * self.c_z + self.c_z
        return pair + row + col + transition(cm, self.transition_type) + opm


#: AlphaFold2's Evoformer, OpenFold's ``config.model.evoformer_stack`` (aqlaboratory/openfold openfold/config.py:
#: c_m 256, c_z 128, c_hidden_msa_att 32, c_hidden_opm 32, c_hidden_mul 128, c_hidden_pair_att 32, no_heads_msa 8,
#: no_heads_pair 4, no_blocks 48, transition_n 4); AlphaFold3's Pairformer, OpenFold3 0.5's
#: ``model.pairformer`` (openfold3/projects/of3_all_atom/config/model_config.py: c_s 384, c_z 128,
#: c_hidden_pair_bias 24, no_heads_pair_bias 16, c_hidden_mul 128, c_hidden_pair_att 32, no_heads_pair 4, no_blocks
#: 48, SwiGLU, transition_n 4).
PRESETS = {
    "af2": EvoformerShape("evoformer", 48, 256, 128, 32, 8, 32, 128, 32, 4, 4, "relu"),
    "af3": EvoformerShape("pairformer", 48, 384, 128, 24, 16, 32, 128, 32, 4, 4, "swiglu"),
}
#: the MSA depth of each preset when --n-seq is not given: OpenFold's inference ``max_msa_clusters`` (512; the
#: extra MSA stack and its 1024-5120 sequences are not modelled); the Pairformer has none
DEFAULT_N_SEQ = {"af2": 512, "af3": 0}


@dataclass(frozen=True)
class Workload:
    """What runs and where: the trunk shape, ``n_res`` residues, ``n_seq`` MSA sequences (Evoformer), ``dtype``,
    ``mode`` (training with per-block checkpointing, or inference), ``chunk_size`` (inference chunking, None: off),
    ``backend`` (``kernel``: ds4sci's Evoformer kernel, softmax statistics only; ``reference``: the plain S^2 path),
    ``layout`` (``1`` GPU, ``1d`` axial over ``gpus``, ``2d`` a mesh of ``gpus = p^2``), GPU memory and reserve."""

    shape: EvoformerShape
    n_res: int
    n_seq: int = 0
    dtype: str = "bf16"
    mode: str = "inference"
    chunk_size: int | None = None
    backend: str = "kernel"
    layout: str = "1"
    gpus: int = 1
    gpu_mem_gib: float = 80.0
    reserve_gib: float = 1.0

    def __post_init__(self):
        if self.layout == "1" and self.gpus != 1:
            raise ValueError(f"layout 1 runs on one GPU, got gpus={self.gpus}: use layout 1d or 2d")
        if self.layout == "2d" and math.isqrt(self.gpus) ** 2 != self.gpus:
            raise ValueError(f"a 2-D mesh is p x p GPUs: gpus={self.gpus} is not a square")

    def with_n_res(self, n_res: int) -> Workload:
        return replace(self, n_res=n_res)

    @property
    def side(self) -> int:
        """The shard count along one axis: 1, P (1-D) or p (2-D); N and S are padded to its multiples."""
        return {"1": 1, "1d": self.gpus, "2d": math.isqrt(self.gpus)}[self.layout]

    @property
    def shards(self) -> int:
        """Pieces z and m are cut into, one per rank: 1, P, p^2 (the GPUs)."""
        return self.gpus


class _Grid:
    """Element counts of one rank: the padded sides ``n`` and ``s``, the ``pairs`` of z and ``msa`` positions of m it
    holds, the whole padded ``N^2`` and ``S N`` (``pairs_all``, ``msa_all``), the ``tokens`` of s (replicated), and
    whether the layout gathers (1-D)."""

    def __init__(self, w: Workload):
        q = w.side
        self.n = -(-w.n_res // q) * q
        self.s = -(-w.n_seq // q) * q if w.shape.evoformer else 0
        self.pairs_all, self.msa_all = self.n * self.n, self.s * self.n
        self.pairs, self.msa = self.pairs_all / w.shards, self.msa_all / w.shards
        self.tokens = w.n_res
        self.gathered = w.layout == "1d"


def _ln_saved(c: int, e: int) -> float:
    """Bytes a LayerNorm saves per position beside its output: its input (an fp32 copy when e < 4) and fp32 mean and
    rstd."""
    return (4 if e < 4 else e) * c + 8


def _ln_const(c: int, e: int) -> float:
    """Bytes per LayerNorm call independent of the positions: its weight and bias cast to fp32 when e < 4."""
    return 8 * c if e < 4 else 0


def block_saved_bytes(w: Workload) -> dict[str, float]:
    """Bytes one block saves for backward on one rank, by sub-module, and the masks; the 1-D gathered tensors are in
    :func:`gathered_bytes`, not here. Per position of a sub-module's input: each LayerNorm its input (fp32 in bf16)
    and fp32 statistics and its output; each gated attention q, k, v, o, g, ``o * g`` (``6 H c``), the kernel's fp32
    softmax statistics (``8 H`` bytes; the reference backend its ``2 H S`` exponentials and probabilities) and the
    mask bias; transitions, the outer product mean and triangle multiplications their intermediates
    (docs/explanation/planner.md)."""
    sh, g, e = w.shape, _Grid(w), DTYPE_BYTES[w.dtype]
    ref = w.backend == "reference"
    mesh_extra = 1 if w.layout == "2d" else 0  # the rotating key/value input's tile beside the query tile
    # 2-D, beyond it, the mean over ranks of one more copy of the input tile, measured per rank on a 2 x 2 mesh
    # (tests/planning): on the mesh row where the key/value skew moves the tile ((p-1)/p of the ranks), on the
    # column (a transposed input) where it does not (1/p)
    ring_copy = {"row": (w.side - 1) / w.side, "col": 1 / w.side, None: 0} if w.layout == "2d" else {}

    def attention(positions, c_in, c, h, keys, ring=None):
        """LN (input, stats, output), q, k, v, o, g, o*g, softmax statistics, mask bias; the reference saves the
        probabilities and exponentials instead of the statistics; ``ring``: the mesh ring of the keys (2-D; None for the
        Pairformer's single attention, whose tiles do not move)."""
        core = 8 * h if not ref else 2 * h * keys * e
        return positions * (_ln_saved(c_in, e) + (1 + mesh_extra + ring_copy.get(ring, 0)) * c_in * e + 6 * h * c * e
                            + core + e) + _ln_const(c_in, e)

    def transition(positions, c, kind):
        hidden = (4 if kind == "swiglu" else 1) * sh.transition_n * c
        return positions * (_ln_saved(c, e) + (c + hidden) * e) + _ln_const(c, e)

    keys_pair = g.n if w.layout != "2d" else g.n // w.side
    cz, hp, cp = sh.c_z, sh.no_heads_pair, sh.c_hidden_pair_att
    # the triangle updates (ds4sci.kernels.trimul: the chunked path on one device, its recomputing steps on shards
    # and tiles) save z and the product p; the mask is the block's. On shards and tiles the product also saves this
    # rank's operand (1-D: the other is gathered, in gathered_bytes; 2-D: the other tile too, below)
    tri_mul = g.pairs * (cz + sh.c_hidden_mul) * e
    if w.layout != "1":
        tri_mul += g.pairs * sh.c_hidden_mul * e
    # the 1-D code computes the triangle bias through a second call of the layer norm (its own stats and output)
    twice = (_ln_saved(cz, e) - (0 if e < 4 else cz * e) + cz * e) if g.gathered else 0
    tri_att = {ring: attention(g.pairs, cz, cp, hp, keys_pair, ring) + g.pairs * twice for ring in ("row", "col")}
    out = {"tri_mul_out": tri_mul, "tri_mul_in": tri_mul, "tri_att_start": tri_att["row"],
           "tri_att_end": tri_att["col"],
           "pair_transition": transition(g.pairs, cz, sh.transition_type)}
    h, c = sh.no_heads_msa, sh.c_hidden_msa_att
    pair_masks = g.pairs_all if w.layout != "2d" else 2 * g.pairs_all / w.side  # 2-D: the row and column strips
    bias_ln = _ln_saved(cz, e) + cz * e  # LN(z) and its output, the bias projection's input
    if sh.evoformer:
        keys_row = g.n if w.layout != "2d" else g.n // w.side
        keys_col = g.s if w.layout != "2d" else g.s // w.side
        out["msa_att_row"] = attention(g.msa, sh.c_m, c, h, keys_row, "row") + g.pairs * bias_ln + _ln_const(cz, e)
        out["msa_att_col"] = attention(g.msa, sh.c_m, c, h, keys_col, "col")
        out["msa_transition"] = transition(g.msa, sh.c_m, sh.transition_type)
        co = sh.c_hidden_opm
        out["outer_product_mean"] = (g.msa * (_ln_saved(sh.c_m, e) + sh.c_m * e + co * e) + g.pairs * (co * co + 1) * e
                                     + _ln_const(sh.c_m, e))
        if not g.gathered:  # on one device (and tiles on a mesh) b is the rank's own; in 1-D it is gathered
            out["outer_product_mean"] += g.msa * co * e
        masks = (pair_masks + g.msa_all) * e
    else:
        out["attn_pair_bias"] = attention(g.tokens, sh.c_m, c, h, g.tokens) + g.pairs * bias_ln + _ln_const(cz, e)
        out["single_transition"] = transition(g.tokens, sh.c_m, "swiglu")
        masks = (pair_masks + g.tokens) * e
    if w.layout == "2d":  # the other triangle operand is a tile too (the first is in the term above)
        out["tri_mul_out"] += g.pairs * sh.c_hidden_mul * e
        out["tri_mul_in"] += g.pairs * sh.c_hidden_mul * e
    if not g.gathered:  # the biases are the rank's own (a tile on a mesh)
        out["tri_att_start"] += g.pairs * hp * e
        out["tri_att_end"] += g.pairs * hp * e
        out["msa_att_row" if sh.evoformer else "attn_pair_bias"] += g.pairs * h * e
    out["masks"] = masks
    return out


def gathered_bytes(w: Workload) -> dict[str, float]:
    """1-D only (empty otherwise): the all-gathered tensors of one block that do not shrink with P, by name, whole
    size: the MSA pair bias ``N^2 H_msa``, the outer product's ``b`` ``S N c_opm``, the triangle multiplications'
    ``a`` and ``b`` ``2 N^2 c_mul`` and the triangle biases ``2 N^2 H_pair`` (Evoformer; the Pairformer has its single
    attention's bias in place of the MSA's and no outer product)."""
    if w.layout != "1d":
        return {}
    sh, g, e = w.shape, _Grid(w), DTYPE_BYTES[w.dtype]
    out = {"tri_mul_out.b": g.pairs_all * sh.c_hidden_mul * e, "tri_mul_in.a": g.pairs_all * sh.c_hidden_mul * e,
           "tri_att_start.bias": g.pairs_all * sh.no_heads_pair * e,
           "tri_att_end.bias": g.pairs_all * sh.no_heads_pair * e}
    if sh.evoformer:
        out["msa_att_row.bias"] = g.pairs_all * sh.no_heads_msa * e
        out["outer_product_mean.b"] = g.msa_all * sh.c_hidden_opm * e
    else:
        out["attn_pair_bias.bias"] = g.pairs_all * sh.no_heads_msa * e
    return out


def exit_bytes(w: Workload) -> float:
    """1-D only (0 otherwise): the bytes of the stack's exit all-gathers on every rank: z whole,
    ``e N^2 C_z``, beside the copy of the rank's own columns it sends, ``e N^2 C_z / P``, and the Evoformer's m whole,
    ``e S N C_m``."""
    if w.layout != "1d":
        return 0.0
    sh, g, e = w.shape, _Grid(w), DTYPE_BYTES[w.dtype]
    return e * ((g.pairs_all + g.pairs) * sh.c_z + (g.msa_all * sh.c_m if sh.evoformer else 0))


def _chunks(rows: int, chunk: int | None) -> tuple[int, int, int]:
    """(rows per full chunk, rows of the last chunk, chunks) of ``rows`` walked ``chunk`` at a time."""
    if chunk is None or chunk >= rows:
        return rows, rows, 1
    k = -(-rows // chunk)
    return chunk, rows - (k - 1) * chunk, k


def _ln_peak(c: int, e: int) -> float:
    """Live bytes per position while a LayerNorm runs, its output included: fp32, the output and fp32 mean and rstd;
    bf16, the fp32 copy of the input, the fp32 output (and statistics), then the output cast back."""
    return (e * c if e == 4 else 8 * c) + 8


def _tri_mul_live(n: int, cz: int, c: int, e: int) -> float:
    """Inference, one device: the chunked triangle update's peak (:mod:`ds4sci.kernels.trimul`): the output (``N^2
    C_z e``) beside one block of R rows (the kernel's default, :data:`~ds4sci.kernels.backends.TRIMUL_CHUNK_BYTES`,
    at most ``N/8``); the other operand is recomputed a block at a time, never whole. Per position of the block: the
    row block's operand and product (``2 c``) beside a block of the other operand being built (x, the gate, the
    projection and two products: ``C_z + 4 c``) or beside its LN_in (``_ln_peak``); then x, p, the projection of
    LN(p), the gate's sigmoid and the product (``4 C_z + c``), or x and p beside LN_out's, or p beside LN_in's. The
    residual add is the caller's."""
    rows = max(1, min(TRIMUL_CHUNK_BYTES // (n * max(cz, c) * e), -(-n // 8)))
    block = rows * n
    return n * n * cz * e + max(block * e * (cz + 6 * c), block * e * (4 * cz + c),
                                block * (2 * c * e + _ln_peak(cz, e)) + _ln_const(cz, e),
                                block * (e * (cz + c) + _ln_peak(c, e)) + _ln_const(c, e),
                                block * (c * e + _ln_peak(cz, e)) + _ln_const(cz, e))


def _tri_mul_steps_live(g: _Grid, cz: int, cmul: int, e: int) -> float:
    """Inference, context-parallel forms: the update's steps (:mod:`ds4sci.kernels.trimul`) on this rank's shard or
    tile, modelled from the code (not measured): an operand built (x, the gate, the projection, the gate's sigmoid
    and the masked products: ``C_z + 4 c``) beside the one built before (``c``); 1-D, this rank's operand and the
    product beside the gathered operand, whole; 2-D, the Cannon sum: both operand tiles, their skewed copies, the
    next tiles in flight, the running sum, the step's product and the new sum (``9 c``); then the output step: p, x,
    the projection of LN(p), the gate and its sigmoid, the product (``4 C_z + c``), or p and x beside LN_out's."""
    mul = g.pairs * max(e * (cz + 5 * cmul), e * (4 * cz + cmul),
                        e * (cz + cmul) + _ln_peak(cmul, e) + _ln_const(cmul, e) / g.pairs,
                        e * cmul + _ln_peak(cz, e) + _ln_const(cz, e) / g.pairs)
    if g.gathered:  # this rank's operand and the product beside the gathered operand, whole
        return max(mul, 2 * g.pairs * cmul * e + g.pairs_all * cmul * e)
    return max(mul, 9 * g.pairs * cmul * e)


def block_live_bytes(w: Workload) -> dict[str, float]:
    """Inference: the peak of live bytes beyond the block's inputs while each sub-module runs (what the block keeps
    alive around it included), by sub-module; ``inside_ops`` the modelled scratch inside single ops (module
    docstring)."""
    sh, g, e = w.shape, _Grid(w), DTYPE_BYTES[w.dtype]
    ref = w.backend == "reference"
    chunk = w.chunk_size if w.layout != "2d" else None  # the mesh's attentions and products are tiles already

    def attention(positions, rows, c_in, c, h, keys, held):
        """``held``: bytes alive beside it (the layer-normed input, biases). q, k, v, the kernel's output and
        statistics, the gate, ``o * g`` (the kernel's output then dropped), the output projection; chunked, the
        output buffer and one chunk's."""
        r, last, k = _chunks(rows, chunk)
        per_row = positions / rows
        hc = h * c * e
        if ref:  # logits, with the mask, with the pair bias; then exp(s - max), exp, probabilities
            core = 3 * h * keys * e
        else:
            core = 8 * h
        inner = max(4 * hc + core, 6 * hc, 5 * hc + c_in * e) if not ref else max(3 * hc + core, 6 * hc,
                                                                                   5 * hc + c_in * e)
        if k == 1:
            return held + positions * inner
        # the output buffer exists from the second chunk on, beside the previous chunk's output, still bound
        full, previous = positions * c_in * e, r * per_row * c_in * e
        peaks = [r * per_row * inner, full + previous + last * per_row * inner]
        if k > 2:
            peaks.append(full + previous + r * per_row * inner)
        return held + max(peaks)

    def transition(positions, rows, c, kind):
        hidden = sh.transition_n * c
        inner = (c + 3 * hidden) if kind == "swiglu" else (c + 2 * hidden)
        r, last, k = _chunks(rows, chunk)
        per_row = positions / rows
        ln = _ln_peak(c, e) + _ln_const(c, e) / positions
        if k == 1:
            return positions * max(inner * e, ln)
        done = (k - 1) * r
        return per_row * max(done * c * e + last * inner * e, (done - r) * c * e + r * inner * e if k > 1 else 0,
                             2 * rows * c * e)

    cz, cm, hp = sh.c_z, sh.c_m, sh.no_heads_pair
    cmul = sh.c_hidden_mul
    rows_pair = g.n if w.layout == "1" else g.n // w.side
    steps = []  # (name, peak of the sub-module, output bytes, context alive around it)
    if w.layout == "1":
        mul = _tri_mul_live(g.n, cz, cmul, e)
    else:
        mul = _tri_mul_steps_live(g, cz, cmul, e)
    att_held = g.pairs * (cz + hp + 1) * e  # LN(z), its triangle bias, the mask bias
    if g.gathered:
        att_held += g.pairs_all * hp * e
    keys = g.n if w.layout != "2d" else g.n // w.side
    tri = max(attention(g.pairs, rows_pair, cz, sh.c_hidden_pair_att, hp, keys, att_held),
              g.pairs * _ln_peak(cz, e) + _ln_const(cz, e))
    z_out = g.pairs * cz * e
    pair_steps = [("tri_mul_out", mul), ("tri_mul_in", mul), ("tri_att_start", tri), ("tri_att_end", tri),
                  ("pair_transition", transition(g.pairs, rows_pair, cz, sh.transition_type))]
    if sh.evoformer:
        h, c, co = sh.no_heads_msa, sh.c_hidden_msa_att, sh.c_hidden_opm
        m_out = g.msa * cm * e
        rows_row = g.s if w.layout == "1" else g.s // w.side
        rows_col = g.n if w.layout == "1" else g.n // w.side
        keys_row = g.n if w.layout != "2d" else g.n // w.side
        keys_col = g.s if w.layout != "2d" else g.s // w.side
        bias = g.pairs_all * h * e if g.gathered else g.pairs * h * e
        row = max(g.pairs * _ln_peak(cz, e) + _ln_const(cz, e), g.pairs * (cz + h) * e,
                  bias + g.msa * _ln_peak(cm, e) + _ln_const(cm, e),
                  attention(g.msa, rows_row, cm, c, h, keys_row, bias + g.msa * (cm + 1) * e))
        col = max(g.msa * _ln_peak(cm, e) + _ln_const(cm, e),
                  attention(g.msa, rows_col, cm, c, h, keys_col, g.msa * (cm + 1) * e))
        # outer product mean: a, b and the count; per chunk of rows i: the einsum's copy of a's rows and its output,
        # the previous chunk's output still bound, the flattened copy, the projection; then the concatenation and
        # the division by the count
        r, last, k = _chunks(rows_col, chunk)
        per_row = g.pairs / rows_col
        ab = g.msa * 2 * co * e + (g.msa_all * co * e if g.gathered else 0) + g.pairs * e
        chunk_outer = per_row * co * co * e
        peaks = [g.msa * (cm + 3 * co) * e, g.msa * _ln_peak(cm, e) + _ln_const(cm, e),
                 ab + last * chunk_outer + 3 * g.pairs * cz * e]
        for j in sorted({0, 1, k - 2, k - 1} & set(range(k))):
            rj = last if j == k - 1 else r
            done = j * r * per_row * cz * e
            peaks.append(ab + done + (r * chunk_outer if j else 0) + rj * (g.msa / rows_col) * co * e
                         + rj * chunk_outer)  # the einsum: a's rows copied, the previous chunk's output bound
            peaks.append(ab + done + rj * (2 * chunk_outer + per_row * cz * e))  # the flattened copy, projection
        opm = max(peaks)
        steps += [("msa_att_row", row, m_out, 0), ("msa_att_col", col, m_out, m_out),
                  ("msa_transition", transition(g.msa, rows_row, cm, sh.transition_type), m_out, m_out),
                  ("outer_product_mean", opm, z_out, m_out)]
        # the block keeps its MSA output and the pair input of its pair stack alive while the stack runs
        steps += [(name, peak, z_out, m_out + z_out + (z_out if i else 0)) for i, (name, peak) in
                  enumerate(pair_steps)]
    else:
        steps += [(name, peak, z_out, z_out if i else 0) for i, (name, peak) in enumerate(pair_steps)]
        h, c = sh.no_heads_msa, sh.c_hidden_msa_att
        s_out = g.tokens * cm * e
        bias = g.pairs_all * h * e if g.gathered else g.pairs * h * e  # 2-D: the rank's own bias tile
        apb = max(g.pairs * _ln_peak(cz, e) + _ln_const(cz, e) + (bias if g.gathered else 0),
                  bias + g.tokens * _ln_peak(cm, e) + _ln_const(cm, e),
                  attention(g.tokens, 1, cm, c, h, g.tokens, bias + g.tokens * (cm + 1) * e))
        steps += [("attn_pair_bias", apb, s_out, z_out),
                  ("single_transition", transition(g.tokens, 1, cm, "swiglu"), s_out, z_out + s_out)]
    out = {name: context + max(peak, 2 * out_bytes) for name, peak, out_bytes, context in steps}
    # layer_norm makes a transposed input contiguous inside the op: the column attention's MSA, the ending node's z
    inside = g.pairs * cz * e
    if sh.evoformer:
        inside = max(inside, g.msa * cm * (4 if e < 4 else e))
    if not ref:
        inside = max(inside, TORCH_LOGITS_BLOCK)
    out["inside_ops"] = inside
    return out


@dataclass(frozen=True)
class EvoformerMemory:
    """Bytes per rank by term, in the order the command lists them, and their total."""

    parameters: float  # on every rank: e per parameter (inference), 16 bytes with gradient and AdamW (training)
    representations: float  # z, m (or s) held between blocks, this rank's share
    checkpoints: float  # training: each block's checkpointed input
    block_saved: float  # training: what the recomputed block saves for backward
    gathers: float  # training, 1-D: the all-gathered tensors that do not shrink with P
    working: float  # training: gradients of the block's outputs and inputs and the largest sub-module; inference:
    # the peak of live tensors of one block
    exit: float  # 1-D: the stack's exit all-gathers beyond the working set
    reserve: float
    total: float


def memory(w: Workload) -> EvoformerMemory:
    """Bytes per rank by term: parameters ``phi (p + g + k)`` (training) or ``phi e``; representations ``e (N^2 C_z
    + S N C_m) / shards``; ``L`` checkpoints of them in training; :func:`block_saved_bytes` and
    :func:`gathered_bytes` in training; the working set, ``2 (z + m)`` plus the largest sub-module's saved bytes
    (training) or :func:`block_live_bytes`'s largest peak plus the scratch inside ops (inference);
    :func:`exit_bytes` beyond the working set; the reserve."""
    sh, g, e = w.shape, _Grid(w), DTYPE_BYTES[w.dtype]
    phi = sh.block_parameters() * sh.blocks
    training = w.mode == "training"
    params = phi * (sum(STATE_BYTES[w.dtype]) if training else e)
    held = g.pairs * sh.c_z * e + (g.msa * sh.c_m * e if sh.evoformer else g.tokens * sh.c_m * e)
    terms = {"parameters": params, "representations": held, "checkpoints": sh.blocks * held if training else 0.0}
    gathers = gathered_bytes(w)
    if training:
        saved = block_saved_bytes(w)
        terms["block_saved"] = sum(saved.values())
        terms["gathers"] = sum(gathers.values())
        terms["working"] = 2 * held + max(v for k, v in saved.items() if k != "masks")
    else:
        live = block_live_bytes(w)
        terms["block_saved"] = 0.0
        terms["gathers"] = 0.0  # inside the sub-modules' live peaks (one gathered tensor at a time)
        terms["working"] = max(v for k, v in live.items() if k != "inside_ops") + live["inside_ops"]
    terms["exit"] = max(0.0, exit_bytes(w) - terms["working"])
    terms["reserve"] = w.reserve_gib * GIB
    return EvoformerMemory(**terms, total=sum(terms.values()))


def max_crop(w: Workload, limit: int = 1 << 20) -> int:
    """The longest ``n_res`` (up to ``limit``) whose total fits in ``gpu_mem_gib`` (memory grows with n_res), by
    doubling then bisection; 0 if not even one residue fits."""
    budget = w.gpu_mem_gib * GIB

    def fits(n):
        return memory(w.with_n_res(n)).total <= budget

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


