"""One GenSLM layout priced per GPU: memory by term, bytes sent by group, step time (``ds4sci plan``'s model).

Arithmetic only (no torch) on definitions shared with the code it models, never on copies: shapes and parameter
counts from :class:`~ds4sci.models.genslm.GenSLMConfig`, degrees, sequence multiple and rank order from
:class:`~ds4sci.distributed.dims.ParallelDims`, per-layer communication and table and mask bytes from
:mod:`ds4sci.planning.costs`. Inputs are a :class:`Workload` (model and work per step), a :class:`Strategy` (the
dims plus ZeRO stage, offload and checkpointing) and a :class:`Cluster`; results are :class:`Memory`,
:class:`Comm` and :class:`StepTime`. Byte counts are per GPU, for the most loaded rank (the first pipeline stage),
with ``B`` sequences of ``S`` tokens per micro-step, ``h`` hidden, ``f`` MLP width, ``H`` heads, ``L`` layers,
``V`` vocabulary, ``e`` bytes per activation element and a layout ``tp x ulysses x ring x pp x dp``
(``sp = ulysses * ring``, ZeRO over ``sdp = sp * dp`` ranks); a rank holds ``T = B S / (sp tp)`` local tokens.

Sources: ZeRO (Rajbhandari et al. 2020), activation counts adapted from Korthikanti et al. 2022, ALST's tiled MLP
and loss, DeepSpeed4Science (Song et al. 2023). Each function states its formula; the derivations and what each
term was measured against are in ``docs/explanation/planner.md``.
"""
from __future__ import annotations

import math
from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import replace

from ds4sci.distributed.dims import ParallelDims
from ds4sci.distributed.nodes import inside_node
from ds4sci.kernels.backends import LOCAL_CHUNK_SIZE
from ds4sci.models.genslm.config import GenSLMConfig
from ds4sci.planning.common import GIB
from ds4sci.planning.common import MIB
from ds4sci.planning.common import STATE_BYTES
from ds4sci.planning.costs import layer_comm_bytes
from ds4sci.planning.costs import mask_bytes
from ds4sci.planning.costs import position_table_bytes
from ds4sci.planning.costs import tp_forward_comm_bytes
from ds4sci.planning.costs import ulysses_kv_heads

CUDA_CONTEXT_BYTES = 287_047_680
"""GPU memory of a process that has initialised CUDA, with lazy module loading (CUDA_MODULE_LOADING=LAZY, PyTorch's
default since 1.13, CUDA's since 12.2): measured by PyTorch's pull request #86509 (666,632,192 bytes loading
eagerly)."""
CUBLAS_WORKSPACE_BYTES = 8 * 4096 * 1024
"""cuBLAS workspace, ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (eight 4096 KiB chunks): what
:func:`ds4sci.train.engine.set_deterministic` sets, and PyTorch's default size on Hopper."""
OFFLOADS = ("none", "optimizer", "all")
CHECKPOINTING = ("none", "selective", "full")
MASKS = ("none", "fp32-additive", "bool-device", "bool-cpu-then-device")


@dataclass(frozen=True)
class ZeroBuffers:
    """DeepSpeed's ZeRO buffer sizes (elements) for the config ds4sci writes
    (:func:`ds4sci.train.engine.deepspeed_config` sets the stage and, at stage 3, ``reduce_scatter``; every size is
    DeepSpeed's default, which tests/planning/test_genslm_buffers.py pins against ``DeepSpeedZeroConfig``)."""

    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    prefetch_bucket_size: int = 50_000_000  # stage3_prefetch_bucket_size
    param_persistence_threshold: int = 100_000  # stage3_param_persistence_threshold
    max_live_parameters: int = 1_000_000_000  # stage3_max_live_parameters
    max_reuse_distance: int = 1_000_000_000  # stage3_max_reuse_distance
    contiguous_gradients: bool = True
    allreduce_bucket_size: int = 500_000_000  # the engine's stage-0 all-reduce buckets (MEMORY_OPT_ALLREDUCE_SIZE)

    @staticmethod
    def overlap_comm(stage: int) -> bool:
        """DeepSpeed's default: on at stage 3 only (``overlap_comm_valid``)."""
        return stage == 3


ZERO = ZeroBuffers()


@dataclass(frozen=True)
class Cluster:
    """GPUs and links. Defaults: NVIDIA DGX A100 (8 GPUs, NVLink within a node, 8 x 200 Gb/s HDR InfiniBand)."""

    gpus_per_node: int = 8
    nodes: int = 1
    gpu_mem_gib: float = 40.0
    reserve_gib: float = 0.0  # the user's own reserve, on top of every modelled term
    peak_tflops: float = 312.0  # A100 dense bf16
    efficiency: float = 0.4
    intra_gbps: float = 150.0  # GB/s per GPU within a node
    inter_gbps: float = 25.0  # GB/s per GPU across nodes (one 200 Gb/s NIC per GPU)
    pcie_gbps: float = 25.0  # GB/s per GPU to host memory
    cuda_context_gib: float = CUDA_CONTEXT_BYTES / GIB
    nccl_buffsize_mib: float = 4.0  # NCCL_BUFFSIZE's default, 4 MiB (NCCL's environment-variable documentation)
    nccl_channels: int = 16  # channels per communicator: NCCL picks 2-32 by topology; NCCL_MAX_NCHANNELS caps it
    fragmentation: float = 0.3  # of the step's short-lived bytes (ZeRO's "over 30% of memory still available")

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass(frozen=True)
class Workload:
    """What is trained: the model (its shapes, positions, attention backend and dropout, all read from its config)
    and the per-step work (``micro_batch`` sequences of ``seq_len`` tokens per micro-step, ``grad_accum`` micro-steps
    per optimizer step)."""

    model: GenSLMConfig
    seq_len: int
    micro_batch: int = 1
    grad_accum: int = 1
    dtype: str = "bf16"
    position_table: str = "partitioned"
    mask: str = "none"

    def with_seq_len(self, seq_len: int) -> Workload:
        return replace(self, seq_len=seq_len)

    @property
    def learned_table(self) -> bool:
        return self.model.position_embedding == "learned"

    @property
    def model_params(self) -> int:
        """Parameters outside the position table: embedding, blocks, final layer norm, output head."""
        return self.model.num_parameters() - self.model.position_table_parameters()

    def to_dict(self) -> dict:
        """The shape and the work as ``plan.json`` records them."""
        m = self.model
        return {"hidden": m.hidden_size, "layers": m.num_layers, "heads": m.num_heads, "kv_heads": m.num_kv_heads,
                "intermediate": m.intermediate_size, "mlp": m.mlp, "norm": m.norm, "bias": m.bias,
                "parallel_residual": m.parallel_residual, "tied": m.tie_word_embeddings, "vocab": m.vocab_size,
                "rotary_dim": m.rotary_dim, "learned_table": self.learned_table, "backend": m.attention_backend,
                "seq_len": self.seq_len,
                "micro_batch": self.micro_batch, "grad_accum": self.grad_accum, "dtype": self.dtype,
                "position_table": self.position_table, "mask": self.mask, "dropout": m.dropout}


@dataclass(frozen=True)
class Strategy:
    """How a workload is spread over the GPUs and what it keeps in GPU memory: the parallel degrees
    (:class:`~ds4sci.distributed.dims.ParallelDims`, with the trainer's default sequence layout, zigzag with a ring),
    the ZeRO stage, offload and activation checkpointing."""

    dims: ParallelDims = ParallelDims(dp=1)
    zero_stage: int = 0
    offload: str = "none"
    checkpointing: str = "none"
    mlp_tile: int = 0  # activation_checkpointing.tiled_mlp's mlp_tile (tokens); 0: untiled
    offload_activations: bool = False  # activation_checkpointing.cpu: checkpointed inputs in host memory
    loss_tile: int = 0  # activation_checkpointing.tiled_loss's loss_tile (tokens); 0: untiled

    def __post_init__(self):
        if self.offload_activations and self.checkpointing == "none":
            raise ValueError("offload_activations moves checkpointed inputs: it needs checkpointing full or selective")
        if self.mlp_tile < 0:
            raise ValueError(f"mlp_tile={self.mlp_tile}: must be >= 1 (tokens per tile), or 0 for an untiled MLP")
        if self.loss_tile < 0:
            raise ValueError(f"loss_tile={self.loss_tile}: must be >= 1 (tokens per tile), or 0 for an untiled loss")

    def to_dict(self) -> dict:
        """Degrees and memory switches as ``plan.json`` records them (one flat row)."""
        d = self.dims
        return {"tp": d.tp, "ulysses": d.ulysses, "ring": d.ring, "pp": d.pp, "dp": d.dp,
                "zero_stage": self.zero_stage, "offload": self.offload, "checkpointing": self.checkpointing,
                "mlp_tile": self.mlp_tile, "offload_activations": self.offload_activations, "loss_tile": self.loss_tile}

    def name(self) -> str:
        d = self.dims
        return (f"tp{d.tp} u{d.ulysses} r{d.ring} pp{d.pp} dp{d.dp} z{self.zero_stage} "
                f"off:{self.offload} ckpt:{self.checkpointing}"
                + (f" tile:{self.mlp_tile}" if self.mlp_tile else "")
                + (" ckpt-cpu" if self.offload_activations else "")
                + (f" loss-tile:{self.loss_tile}" if self.loss_tile else ""))


def _sp_kv(w: Workload, strategy: Strategy) -> float:
    """``kv'``: key/value channels per local token that Ulysses moves and the ring passes on, ``lcm(Hkv, U) D``."""
    m = w.model
    return ulysses_kv_heads(m.num_kv_heads, strategy.dims.ulysses) * m.head_dim


def layer_activation_bytes(w: Workload, strategy: Strategy, mode: str) -> float:
    """Bytes one layer saves for backward per local token under checkpointing ``mode``: ``full``, the block input
    ``h e``; ``none``, ``(c_n h + c_a + c_f f + 2 r) e + (s + H) 4``; ``selective``, the same with the single-device
    ``c_a`` and without the log-sum-exp (``c_n`` norms, ``c_a`` attention, ``c_f`` MLP, ``r`` rotary dims, ``s``
    fp32 norm statistics: docs/explanation/planner.md)."""
    d, m = strategy.dims, w.model
    e = STATE_BYTES[w.dtype][0]
    h, f, r = m.hidden_size, m.intermediate_size, m.rotary_dim
    if mode == "full":
        return h * e
    kv = m.num_kv_heads * m.head_dim
    rms = m.norm == "rmsnorm"
    # block input, each norm's output (RMSNorm also its normalized input), the second norm's input when sequential
    norms = h + 2 * (2 if rms else 1) * h + (0 if m.parallel_residual else h)
    mlp = (4 if m.mlp == "swiglu" else 2) * f
    stats = 2 * (1 if rms else 2) * 4  # fp32 per norm: rstd (and the mean for LayerNorm)
    # under TP the column-parallel matmuls save this rank's sequence regions of their inputs (the norm outputs counted
    # above), gathering them again in backward; rotary cos/sin cover the S/sp positions of the attention region
    rotary = 2 * r * d.tp
    if strategy.mlp_tile:  # the tiled MLP saves only its input: the second norm's output (counted above) on one
        # device; under TP the gathered input in place of this rank's region; with the parallel residual the whole
        # all-gather buffer it is a slot of (both norms' outputs stacked: tensor_parallel's RegionGather), the
        # region staying saved in the attention's slot of the stacked regions
        mlp = (2 * d.tp * h if m.parallel_residual else (d.tp - 1) * h) if d.tp > 1 else 0
    # one device: the fused qkv buffer (q, k and v are views of it, rotated in place), the query heads' copy of
    # grouped-query attention, the attention output
    attention = h + 2 * kv + (h if _query_copied(m, d.tp) else 0) + h
    if mode == "selective":
        return (norms + attention + mlp + rotary) * e + stats
    if d.ulysses > 1:  # head-sharded q, k, v, the core's output and its sequence-sharded copy
        attention = 3 * h + 2 * _sp_kv(w, strategy)
    return (norms + attention + mlp + rotary) * e + stats + m.num_heads * 4


def rebuilt_norm_bytes(w: Workload, strategy: Strategy) -> float:
    """Bytes per local token that the layer being recomputed under ``full`` checkpointing does not keep: the first
    norm's output, ``h e``, rebuilt from the block input when the qkv projection's backward needs it
    (:func:`ds4sci.kernels.recompute.recompute_saved`, set by full checkpointing on every GenSLM ``Block``); 0 under
    other modes and under TP (a ``TensorParallelBlock``'s projection keeps this rank's region and gathers it again)."""
    if strategy.checkpointing != "full" or strategy.dims.tp > 1:
        return 0.0
    return w.model.hidden_size * STATE_BYTES[w.dtype][0]


def offloaded_layer_bytes(w: Workload, strategy: Strategy) -> float:
    """Bytes per layer per local token that host offload (``activation_checkpointing.cpu``,
    :class:`~ds4sci.train.activation_offload.HostOffload`) moves off the device: the checkpointed region's inputs
    that own their storage. ``full``: the block input, ``h e``; ``selective``: the attention core's q when grouped-query
    attention copied it, ``h e`` (k and v, and q otherwise, are views of the fused qkv buffer, rotated in place, and
    stay); 0 without offload."""
    if not strategy.offload_activations:
        return 0.0
    m, e = w.model, STATE_BYTES[w.dtype][0]
    if strategy.checkpointing == "full" or _query_copied(m, strategy.dims.tp):
        return m.hidden_size * e
    return 0.0


def _query_copied(m: GenSLMConfig, tp: int) -> bool:
    """GenSLM's attention copies the query heads out of the fused qkv buffer (``[B, T, Hkv, g D] -> [B, T, H, D]`` is
    no view) when a rank holds several key/value heads (``Hkv / tp``) each serving several query heads."""
    return m.num_kv_heads < m.num_heads and m.num_kv_heads // tp > 1


def _param_tensors(w: Workload, strategy: Strategy) -> tuple[list[float], list[float]]:
    """Elements of each parameter tensor on a rank: one block's (norms, fused q/k/v, attention output, MLP matrices,
    their biases; the matrices split over TP, the norms and the row-parallel biases whole) and those outside the
    blocks (final norm, embedding and head over the vocabulary padded to a multiple of ``tp``; a tied pair is one
    matrix; a pipeline's end stages hold one each, the embedding on the first and the head, or the tied copy, with
    the final norm on the last, which counts: measured per stage with ``ds4sci bench ablation --layouts pp2``)."""
    d, m = strategy.dims, w.model
    h, f, tp = m.hidden_size, m.intermediate_size, d.tp
    qkv = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
    mlp_in = 2 if m.mlp == "swiglu" else 1
    norm = [h] * (m.norm_parameters() // h)  # weight (and bias)
    layer = 2 * norm + [qkv * h / tp, h * h / tp, *[f * h / tp] * mlp_in, f * h / tp]
    if m.bias:
        layer += [qkv / tp, h, *[f / tp] * mlp_in, h]
    vocab = math.ceil(m.vocab_size / tp) * tp * h / tp
    return layer, norm + [vocab] * (1 if m.tie_word_embeddings or d.pp > 1 else 2)


def loss_saved_bytes(w: Workload, strategy: Strategy) -> float:
    """Bytes the output projection and the loss save per local token beyond the final norm's: untiled, the fp32 logits
    and their log-softmax, ``8 V / tp``; tiled (``strategy.loss_tile``), the int64 targets of the SP shard, ``8 tp``,
    and under TP the gathered final norm output in place of this rank's region, ``(tp - 1) h e``."""
    tp = strategy.dims.tp
    if not strategy.loss_tile:
        return 8 * w.model.vocab_size / tp
    return 8 * tp + (tp - 1) * w.model.hidden_size * STATE_BYTES[w.dtype][0]


def rank_params(w: Workload, strategy: Strategy) -> float:
    """``phi``: parameters on the most loaded rank before ZeRO partitioning, ``ceil(L/pp) phi_layer' +
    phi_outside'`` with the matrices split over TP and the vocabulary padded to a multiple of ``tp``."""
    layer, outside = _param_tensors(w, strategy)
    return math.ceil(w.model.num_layers / strategy.dims.pp) * sum(layer) + sum(outside)


def persistent_params(w: Workload, strategy: Strategy, zero: ZeroBuffers = ZERO) -> float:
    """Parameters per rank that ZeRO-3 keeps gathered between uses (``ds_persist``): each tensor of fewer than
    ``stage3_param_persistence_threshold`` elements (DeepSpeed's ``persistence_threshold``; in practice the norms'
    weights and biases and the projections' biases, this rank's share under TP; every tensor of a tiny model)."""
    layer, outside = _param_tensors(w, strategy)

    def small(sizes: list[float]) -> float:
        return sum(n for n in sizes if n < zero.param_persistence_threshold)

    return math.ceil(w.model.num_layers / strategy.dims.pp) * small(layer) + small(outside)


def zero3_gathered_params(w: Workload, strategy: Strategy, zero: ZeroBuffers = ZERO) -> float:
    """Parameters per rank ZeRO-3 holds gathered at its peak, besides the persistent ones
    (DeepSpeed's ``PartitionedParameterCoordinator``): a module's parameters are released after use unless
    they are used again within ``stage3_max_reuse_distance`` elements of parameters fetched in between
    (``__params_to_release``), and up to ``stage3_prefetch_bucket_size`` elements are fetched ahead. So in backward
    one layer is held (the recomputed forward's parameters are reused by its backward; without checkpointing this
    bounds the modules held at once), and at the turn from forward to backward the output head (its backward follows
    its forward) and the last layers ``j = 0, 1, ...`` whose next use is within the distance, ``j layer (1 + r) +
    2 head`` (the layers after it in forward, the head twice and ``r`` backward visits of each later layer: 2 under
    ``full`` checkpointing, the recomputed forward and the backward, 1 otherwise); plus the prefetch bucket; at most
    the rank's parameters. Whole layers where DeepSpeed keeps modules: measured in ZeRO-3 steps on the CPU, over by
    less than one layer (tests/planning/test_genslm_plan_buffers.py)."""
    layer_tensors, outside = _param_tensors(w, strategy)

    def big(sizes: list[float]) -> float:
        return sum(n for n in sizes if n >= zero.param_persistence_threshold)

    layers = math.ceil(w.model.num_layers / strategy.dims.pp)
    layer, head = big(layer_tensors), big(outside[-1:])
    visits = 2 if strategy.checkpointing == "full" else 1
    kept, j = head, 0
    while j < layers and j * layer * (1 + visits) + 2 * head < zero.max_reuse_distance:
        kept += layer
        j += 1
    prefetch = min(zero.prefetch_bucket_size, zero.max_live_parameters)
    return min(max(layer, kept) + prefetch, layers * layer + big(outside))


def reduce_bucket_bytes(w: Workload, strategy: Strategy) -> float:
    """Bytes of DeepSpeed's gradient-reduction buffers on a rank (the config ds4sci writes):
    stage 0: the engine's all-reduce flattens the gradients into buckets of ``allreduce_bucket_size`` elements
    (``buffered_allreduce_fallback``; with data parallelism only), ``min(bucket, phi) g``; stages 1 and 2: the
    contiguous-gradient buffer of ``reduce_bucket_size`` elements in the gradient dtype (``setup_buckets``; a second
    with ``overlap_comm``, off below stage 3; the pipeline's ``reduce_gradients(pipeline_parallel=True)`` adds one at
    stage 1); stage 3: the contiguous buffer in the parameter dtype, allocated at start (``ipg_buckets``), plus the
    reduce-scatter's flattened copy of a full bucket (``reduce_scatter_coalesced``'s ``torch.cat``),
    ``min(bucket, phi) p``."""
    d, zero = strategy.dims, strategy.zero_stage
    p, g, _ = STATE_BYTES[w.dtype]
    phi = rank_params(w, strategy)
    if zero == 0:
        return min(ZERO.allreduce_bucket_size, phi) * g if d.sdp > 1 else 0.0
    if zero in (1, 2):
        buffers = 1 + ZERO.overlap_comm(zero) + (zero == 1 and d.pp > 1)
        return buffers * ZERO.reduce_bucket_size * g
    return ZERO.reduce_bucket_size * p + min(ZERO.reduce_bucket_size, phi) * p


def nccl_communicators(w: Workload, strategy: Strategy) -> int:
    """NCCL communicators a rank creates (each allocates its buffers on first use): one per group that sends
    (:func:`comm`'s tp, ulysses, ring, pp and the ZeRO group over ``sdp``) and the world group (barriers)."""
    d = strategy.dims
    groups = sum(n > 1 for n in (d.tp, d.ulysses, d.ring, d.pp, d.sdp))
    return groups + (d.world_size > 1)


@dataclass(frozen=True)
class Memory:
    """Bytes per GPU by term, in the order the breakdown lists them, and their ``total`` (the larger of
    ``a2a_staging`` and ``ring_buffers`` counts: they are alive one after the other within a layer);
    ``host_activations``, the checkpointed inputs host offload keeps in host memory, is not in the total."""

    params: float  # ZeRO-3: this rank's partition
    grads: float  # ZeRO >= 1: the partition the optimizer is handed
    optimizer: float  # AdamW's moments and fp32 master copy
    activations: float  # saved for backward: held micro-batches' layers, ids, final norm, logits
    workspace: float  # backward's working set: one layer's activation gradients, ring blocks, tiles
    attention: float  # the attention kernel's workspace
    position_table: float  # learned position table with its gradient and AdamW state
    mask: float  # attention mask
    reduce_bucket: float  # DeepSpeed's gradient-reduction buffers
    allgather_bucket: float  # DeepSpeed's parameter all-gather (in place: 0)
    gathered_params: float  # ZeRO-3's parameters gathered at the peak
    persistent_params: float  # ZeRO-3's parameters kept gathered
    a2a_staging: float  # Ulysses all-to-all send and receive buffers
    ring_buffers: float  # the ring's received and arriving key/value blocks in forward
    cuda_context: float
    cublas_workspace: float
    nccl_buffers: float
    fragmentation: float  # the allocator's, a fraction of the step's short-lived bytes
    reserve: float  # the user's own
    total: float
    host_activations: float

    @property
    def buffers(self) -> float:
        """The framework's buffers as the total counts them (the larger of the all-to-all and ring buffers)."""
        return (self.reduce_bucket + self.allgather_bucket + self.gathered_params + self.persistent_params
                + self.a2a_staging + self.ring_buffers - min(self.a2a_staging, self.ring_buffers))

    @property
    def device(self) -> float:
        """The device's own: CUDA context, cuBLAS workspace, NCCL buffers, fragmentation and the user's reserve."""
        return self.cuda_context + self.cublas_workspace + self.nccl_buffers + self.fragmentation + self.reserve


def memory(w: Workload, strategy: Strategy, cluster: Cluster | None = None) -> Memory:
    """Bytes per GPU by term (``cluster``'s device settings; :class:`Cluster`'s defaults when None). Model states
    (ZeRO): ``phi (p + g + k)`` with ``g`` and ``k`` divided by ``sdp`` from stage 1 (``k = 12``, DeepSpeed's fp32
    master copy) and ``p`` at stage 3; activations ``T (held layers x per-layer bytes + outside the layers)``, held
    layers ``ceil(L/pp) min(pp, m)`` (1F1B); working set ``T`` x one layer's ``none`` bytes; fragmentation a
    fraction of the step's short-lived bytes (docs/explanation/planner.md)."""
    cluster = cluster or Cluster()
    d, zero = strategy.dims, strategy.zero_stage
    h = w.model.hidden_size
    p, g, k = STATE_BYTES[w.dtype]
    e = p
    phi = rank_params(w, strategy)
    N = d.sdp
    if zero in (1, 2):
        k = 12  # DeepSpeed's fp32 master copy of the partition and AdamW's two moments, also when training in fp32
    params = 0.0 if strategy.offload == "all" else phi * p / (N if zero == 3 else 1)
    grads = phi * g / (N if zero >= 1 else 1)
    optimizer = 0.0 if strategy.offload != "none" else phi * k / (N if zero >= 1 else 1)
    S, B = w.seq_len, w.micro_batch
    T = B * S / (d.sp * d.tp)  # local tokens
    held = math.ceil(w.model.num_layers / d.pp) * min(d.pp, w.grad_accum)
    offloaded = offloaded_layer_bytes(w, strategy)
    per_token = held * (layer_activation_bytes(w, strategy, strategy.checkpointing) - offloaded)
    if strategy.checkpointing == "full":  # the layer being recomputed
        per_token += layer_activation_bytes(w, strategy, "none") - rebuilt_norm_bytes(w, strategy)
    # host offload refills a region's inputs before its recomputation and fetches the previous region's: two on the
    # device at once in backward
    per_token += 2 * offloaded
    rms = w.model.norm == "rmsnorm"
    final_norm = ((2 if rms else 1) + 1) * h * e + (4 if rms else 8)  # input (normalized), output, fp32 statistics
    ids = 16 if w.learned_table else 8  # int64 token ids (and the position ids the learned table looks up)
    per_token += ids + final_norm + loss_saved_bytes(w, strategy)
    activations = T * per_token
    # backward's working set: one layer's activation gradients, the size of what that layer saves without
    # checkpointing; the ring adds the key/value block in use, the one arriving and the travelling key/value gradients
    kv = _sp_kv(w, strategy)
    ring = 6 * kv * e if d.ring > 1 else 0
    workspace = T * (layer_activation_bytes(w, strategy, "none") + ring)
    if strategy.mlp_tile:  # one tile's intermediate activations and their gradients (this rank's f / tp columns)
        f = w.model.intermediate_size / d.tp
        workspace += 2 * (4 if w.model.mlp == "swiglu" else 2) * f * e * B * min(strategy.mlp_tile, S / d.sp)
    if strategy.loss_tile:  # one tile's logits and their gradient, their fp32 log-softmax and its gradient
        workspace += (2 * e + 8) * math.ceil(w.model.vocab_size / d.tp) * B * min(strategy.loss_tile, S / d.sp)
    heads_local = w.model.num_heads / (d.tp * d.ulysses)
    s_attn = S / d.ring
    backend = w.model.attention_backend
    if backend == "sdpa":
        attention = (8 * B * heads_local + 2) * s_attn * s_attn
    elif backend == "chunked":
        attention = 3 * 4 * B * heads_local * LOCAL_CHUNK_SIZE * LOCAL_CHUNK_SIZE
    else:
        attention = 8 * B * heads_local * s_attn
    table = 0.0
    if w.learned_table:
        table = position_table_bytes(S // d.sp if w.position_table == "partitioned" else S, h)
    mask = 0.0 if w.mask == "none" else B * mask_bytes(w.mask, S // d.ring)["device"]
    # Ulysses' all-to-all (ds4sci.sequence.comm._all_to_all_forward) stages the largest tensor it moves, the queries
    # or the attention output, T h e, in a contiguous send buffer and a receive buffer; the ring's forward
    # (ds4sci.sequence.ring.RingAttention) holds received key/value blocks (RingShift's receive buffers): the
    # one in use, the one arriving and, while the next shift is posted, the one before (the previous shift's send
    # buffer), min(ring - 1, 3) blocks of k and v, 2 kv' e per local token each; they are alive one after the other
    # within a layer, so the total counts the larger
    a2a = 2 * T * h * e if d.ulysses > 1 else 0.0
    ring_fwd = min(d.ring - 1, 3) * 2 * T * kv * e
    terms = {"params": params, "grads": grads, "optimizer": optimizer, "activations": activations,
             "workspace": workspace, "attention": attention, "position_table": table, "mask": mask,
             "reduce_bucket": reduce_bucket_bytes(w, strategy),
             "allgather_bucket": 0.0,  # stages 1-2 gather the updated partitions in place (all_gather_into_tensor)
             "gathered_params": zero3_gathered_params(w, strategy) * p if zero == 3 else 0.0,
             "persistent_params": persistent_params(w, strategy) * p if zero == 3 else 0.0,
             "a2a_staging": a2a, "ring_buffers": ring_fwd}
    short_lived = activations + workspace + attention + mask + max(a2a, ring_fwd)
    terms.update(cuda_context=cluster.cuda_context_gib * GIB, cublas_workspace=float(CUBLAS_WORKSPACE_BYTES),
                 nccl_buffers=nccl_communicators(w, strategy) * cluster.nccl_channels * cluster.nccl_buffsize_mib * MIB,
                 fragmentation=cluster.fragmentation * short_lived, reserve=cluster.reserve_gib * GIB)
    total = sum(terms.values()) - min(a2a, ring_fwd)
    return Memory(**terms, total=total, host_activations=T * held * offloaded)


@dataclass(frozen=True)
class Comm:
    """Bytes each GPU sends per optimizer step, by group (``pcie``: offload traffic to host memory)."""

    tp: float = 0.0
    ulysses: float = 0.0
    ring: float = 0.0
    pp: float = 0.0
    dp: float = 0.0
    pcie: float = 0.0

    @property
    def total(self) -> float:
        return self.tp + self.ulysses + self.ring + self.pp + self.dp + self.pcie


def comm(w: Workload, strategy: Strategy) -> Comm:
    """Bytes each GPU sends per optimizer step, by group, for ``L / pp`` layers and ``B m`` sequences:
    tensor parallelism (:func:`~ds4sci.planning.costs.layer_comm_bytes` on ``N = S / sp`` tokens, plus the norms'
    gradient all-reduce and the embedding's and head's collectives); Ulysses on ``S / ring`` tokens of ``h / tp``
    channels and the ring on ``S`` tokens of ``h / (tp ulysses)`` (x 1.5 under checkpointing); pipeline
    ``T h e`` per micro-step (``2 T h e`` with ``pp > 2``, a middle stage sends both ways), ``T = B S / (sp tp)``;
    ZeRO over ``sdp``: ``2 (sdp-1)/sdp phi g`` plus ``(sdp-1)/sdp phi p`` per parameter all-gather (1 at stages 1
    and 2, 2 at stage 3); offload: ``phi (g + p) / sdp`` over PCIe (``all``: ``+ 2 phi p / sdp``)."""
    d = strategy.dims
    p, g, _ = STATE_BYTES[w.dtype]
    e, h, S, B, m = p, w.model.hidden_size, w.seq_len, w.micro_batch, w.grad_accum
    layers = math.ceil(w.model.num_layers / d.pp) * B * m
    sp_redo = 1.5 if strategy.checkpointing != "none" else 1.0
    out = {}
    if d.tp > 1:
        P, N = d.tp, S / d.sp
        # one reduce-scatter per branch with dropout or with Llama's sequential residual, one shared otherwise
        scheme = "megatron-sp" if w.model.dropout > 0 or not w.model.parallel_residual else "tp-sp"
        norm = 2 * h if w.model.norm == "layernorm" else h  # one norm's parameters, their gradients summed over TP
        per_layer = layer_comm_bytes(scheme, P, N, h, e) + 2 * (P - 1) / P * 2 * norm * e
        if strategy.checkpointing == "full":  # the recomputed forward's collectives
            per_layer += tp_forward_comm_bytes(scheme, P, N, h, e)
        first = 3 * (P - 1) / P * N * h * e
        last = (P - 1) / P * (3 * N * h * e + 2 * (norm * e + 12 * N))
        out["tp"] = layers * per_layer + B * m * (first + last if d.pp == 1 else max(first, last))
    if d.ulysses > 1:
        out["ulysses"] = sp_redo * layers * layer_comm_bytes("ulysses", d.ulysses, S / d.ring, h / d.tp, e,
                                                             kv=_sp_kv(w, strategy) / d.tp)
    if d.ring > 1:
        out["ring"] = sp_redo * layers * layer_comm_bytes("ring", d.ring, S, h / (d.tp * d.ulysses), e,
                                                          kv=_sp_kv(w, strategy) / (d.tp * d.ulysses))
    if d.pp > 1:
        out["pp"] = (2 if d.pp > 2 else 1) * B * m * S / (d.sp * d.tp) * h * e
    phi = rank_params(w, strategy)
    N = d.sdp
    if N > 1:
        gathers = {0: 0, 1: 1, 2: 1, 3: 2}[strategy.zero_stage]  # parameter all-gathers per step
        out["dp"] = 2 * (N - 1) / N * phi * g + gathers * (N - 1) / N * phi * p
    if strategy.offload != "none":
        out["pcie"] = phi * (g + p) / N + (2 * phi * p / N if strategy.offload == "all" else 0.0)
    return Comm(**out)


@dataclass(frozen=True)
class StepTime:
    """Estimated seconds per optimizer step: compute (bubble included), the pipeline bubble's fraction,
    communication, their total, and the tokens per second it gives."""

    compute_s: float
    bubble: float
    comm_s: float
    total_s: float
    tokens_per_s: float


def step_time(w: Workload, strategy: Strategy, cluster: Cluster) -> StepTime:
    """Seconds per optimizer step, no overlap: ``compute / (1 - bubble) + sum over groups of bytes / bandwidth``,
    ``compute = FLOPs / (world peak efficiency)``, ``FLOPs = 6 N_tok phi_model + 6 B m dp L h S^2`` (causal
    attention) plus a forward for ``full`` checkpointing or the attention's for ``selective``, ``bubble = (pp - 1)
    / (m + pp - 1)``; a group runs at intra-node bandwidth when its ranks share a node
    (:func:`~ds4sci.distributed.nodes.inside_node`, the trainer's mapping), else inter-node; offload runs at PCIe
    bandwidth."""
    d = strategy.dims
    S, B, m = w.seq_len, w.micro_batch, w.grad_accum
    tokens = B * S * m * d.dp
    attn = 6 * B * m * d.dp * w.model.num_layers * w.model.hidden_size * S * S  # causal: half of 12 L h S^2 a sequence
    params = w.model_params + (w.model.vocab_size * w.model.hidden_size if w.model.tie_word_embeddings else 0)
    flops = 6 * tokens * params + attn
    if strategy.checkpointing == "full":
        flops += (6 * tokens * params + attn) / 3
    elif strategy.checkpointing == "selective":
        flops += attn / 3
    bubble = (d.pp - 1) / (m + d.pp - 1)
    compute = flops / (cluster.world * cluster.peak_tflops * 1e12 * cluster.efficiency) / (1 - bubble)
    seconds = 0.0
    for group, sent in asdict(comm(w, strategy)).items():
        if not sent:
            continue
        if group == "pcie":
            bw = cluster.pcie_gbps
        else:
            kind = "sdp" if group == "dp" else group  # ZeRO's group spans Ulysses x Ring x DP
            bw = cluster.intra_gbps if inside_node(d, kind, cluster.gpus_per_node) else cluster.inter_gbps
        seconds += sent / (bw * 1e9)
    total = compute + seconds
    return StepTime(compute, bubble, seconds, total, tokens / total)

