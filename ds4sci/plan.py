"""``ds4sci plan``: which parallel layouts train a GenSLM at a given sequence length on a given cluster, how much
memory each GPU needs, how many bytes each GPU sends, and which layout should be fastest.

Everything here is arithmetic (no tensors, no processes, no torch) on definitions shared with the code it models,
never on copies: the shapes and parameter counts come from the model's :class:`~ds4sci.models.genslm.GenSLMConfig`
(``block_parameters``, ``num_parameters``), the degrees, the sequence multiple and the rank order from
:class:`~ds4sci.distributed.dims.ParallelDims`, the per-layer communication and the table and mask bytes from
:mod:`ds4sci.costs`, closed forms that ``ds4sci bench`` measures. A layout is a :class:`Strategy`: the dims plus
the ZeRO stage, offload and checkpointing. All byte counts are per GPU, for the most loaded rank (the first
pipeline stage), with ``B`` sequences of ``S`` tokens per micro-step, ``h`` hidden, ``f`` MLP width, ``H`` heads,
``L`` layers, ``V`` vocabulary, ``kv = Hkv h / H`` key/value channels (``Hkv`` key/value heads, ``H`` for
multi-head attention, fewer for grouped-query attention), ``e`` bytes per activation element (4 fp32, 2 bf16) and a
layout ``tp x ulysses x ring x pp x dp`` (``sp = ulysses * ring``, ZeRO over ``sdp = sp * dp`` ranks).

Memory model (bytes per GPU):

- model states (ZeRO, Rajbhandari et al. 2020): ``phi = ceil(L/pp) * ((phi_layer - n) / tp + n) + t V_tp h / tp +
  phi_norm`` parameters per rank (``phi_layer``: one block's,
  :meth:`~ds4sci.models.genslm.GenSLMConfig.block_parameters`; ``phi_norm`` one norm's, ``2 h`` for LayerNorm, ``h`` for
  RMSNorm; the block's two norms and, with biases, its two row-parallel biases, ``n = 2 phi_norm + 2 h``, and the final
  norm are replicated over TP; ``t = 2`` embedding and head matrices, ``1`` when tied or with ``pp > 1`` (a pipeline's
  first stage holds the embedding, its last the head or the tied copy); the vocabulary is padded to
  ``V_tp``, a multiple of ``tp``; at ``tp = pp = 1`` this is :meth:`~ds4sci.models.genslm.GenSLMConfig.num_parameters`
  less the position table), each with ``p`` bytes of parameter, ``g`` of gradient and ``k`` of optimizer state: fp32 ``4
  + 4 + 8`` (AdamW's two moments), bf16 ``2 + 2 + 12`` (fp32 master copy and moments). Stage 0 keeps all three; stages 1
  and 2 divide the gradients the optimizer is handed and the optimizer state by ``sdp`` and keep an fp32 master copy of
  the partition even when training in fp32 (``k = 12``); stage 3 also divides the parameters (the ones it gathers
  are framework buffers, below) and needs no separate fp32 copy in fp32 (``k = 8``) (measured
  with ``ds4sci bench layouts``, DeepSpeed 0.19.8: at stage 1 DeepSpeed hands the optimizer the ``1/sdp`` gradient
  partition, as at stage 2). Offload ``optimizer`` (ZeRO-Offload, stage >= 1) takes the optimizer state off the GPU,
  ``all`` (ZeRO-Infinity, stage 3) the parameters too.
- activations saved for backward per layer per local token, counted from what GenSLM's block
  (:mod:`ds4sci.models.genslm.model`: GPT-NeoX's parallel residual or Llama's sequential one, LayerNorm or RMSNorm,
  GELU MLP or SwiGLU, multi-head or grouped-query attention) saves; the adaptation of Korthikanti et al. 2022
  ("Reducing Activation Recomputation in Large Transformer Models", ``sbh(34 + 5as/h)``) to this block, checked
  exactly against ``torch.autograd.graph.saved_tensors_hooks`` on the CPU in fp32 for both shapes (tests/test_plan.py):
  ``none``: ``(c_n h + c_a + c_f f + 2 r) e + (s + H) 4`` with

  - ``c_n = 3`` (block input, both norms' outputs), ``+ 2`` for RMSNorm (GenSLM's ``rms_norm`` keeps each norm's
    normalized input for the weight's gradient), ``+ 1`` for the sequential residual (the second norm's input);
  - ``c_a`` the attention's: the fused qkv buffer ``h + 2 kv`` (rotary rotates q and k in place in it, and q, k and
    v are views of it: ``apply_rotary_qkv_``), with grouped-query attention over several key/value heads the query
    heads' copy ``h`` (the reshape of the grouped q rows cannot be a view), the attention output ``h`` (``4 h`` for
    GPT-NeoX); under Ulysses the head-sharded q, k, v and output and the output's sequence-sharded copy replace the
    qkv buffer, ``3 h + 2 kv'`` with ``kv'`` the key/value channels Ulysses moves
    (:func:`ds4sci.costs.ulysses_kv_heads`: ``kv``, more where the degree does not divide ``Hkv``);
  - ``c_f = 2`` (the GELU MLP's up projection and activation) or ``4`` (SwiGLU's gate, its SiLU, up and their
    product); ``r`` the rotary dims (cos and sin);
  - fp32: ``s = 4`` layer-norm statistics (mean and rstd of each norm; ``2`` for RMSNorm, rstd only) and ``H`` the
    log-sum-exp.

  ``selective`` (the attention core, all of ``DistributedAttention``, recomputed): ``(c_n h + c_a + c_f f + 2 r) e +
  4 s`` with the single-device ``c_a``; under TP the column-parallel matmuls save their inputs as this rank's
  sequence regions (the norm outputs, ``h`` each per local token as on one device; Megatron-LM's choice: backward
  gathers them again) and the rotary tables cover ``tp`` local tokens (``2 r tp``); ``full``: ``h e`` (the block
  input) per layer plus one layer of ``none`` being recomputed, less the first norm's output, ``h e``, that the
  recomputation rebuilds from the block input in the qkv projection's backward instead of keeping it
  (:func:`rebuilt_norm_bytes`; GenSLM's ``Block.recompute_norm``; not under TP, whose projection keeps this rank's
  region). A rank holds ``T = B S / (sp tp)`` local tokens
  (tensor parallelism's sequence-parallel regions divide them by ``tp``) for ``ceil(L/pp) * min(pp, m)`` layers (1F1B
  keeps ``min(pp, m)`` micro-batches in flight on the first stage, ``m`` micro-steps), plus outside the layers ``8``
  (token ids; ``16`` with the learned table's position ids) ``+ 2 h e + 8`` (final norm: its input, its output (under
  TP this rank's region, which the output projection gathers again in backward) and its fp32 statistics; RMSNorm:
  ``3 h e + 4``) ``+ 8 V / tp`` (fp32 logits and their
  log-softmax; with the tiled loss see below) per token. Measured on the CPU:
  in bf16 GenSLM's ``rms_norm`` keeps an fp32 copy of its input (it normalises in fp32, as transformers' Llama does),
  and the ``chunked`` backend an fp32 attention output, which this model leaves out.
- tiled MLP (``--mlp-tile``, ``activation_checkpointing.tiled_mlp``; ALST's TiledMLP,
  :mod:`ds4sci.kernels.tiled_mlp`): the MLP saves only its input, the second norm's output already counted, so
  ``c_f f`` leaves every figure above (under TP the tiled function saves the gathered input, ``tp h`` per local token
  in place of this rank's region: ``+ (tp - 1) h``; with GPT-NeoX's parallel residual that input is a slot of one
  all-gather of both norms' outputs, whose whole buffer it keeps, and the region stays saved as a slot of the
  stacked regions the attention reads: ``+ 2 tp h``); the working set gains one tile's intermediate activations and
  their gradients, ``2 c_f (f / tp) e B min(tile, S / sp)`` (measured with ``saved_tensors_hooks``:
  tests/test_plan.py).
- tiled loss (``--loss-tile``, ``activation_checkpointing.tiled_loss``; ALST's tiled loss,
  :mod:`ds4sci.kernels.tiled_loss`): the output projection and the cross entropy save only the final norm's output
  (already counted) and the targets, so ``8 V / tp`` per token becomes ``8 tp`` (the int64 targets of the SP shard; under
  TP the tiled function also saves the gathered final norm output in place of this rank's region: ``+ (tp - 1) h e``);
  the working set gains one tile's logits and their gradient in the compute dtype and their fp32 log-softmax and its
  gradient, ``(2 e + 8) (V_tp / tp) B min(tile, S / sp)`` (saved bytes measured with ``saved_tensors_hooks``:
  tests/test_plan.py).
- host offload of checkpointed inputs (``--offload-activations``, ``activation_checkpointing.cpu``,
  :class:`~ds4sci.train.activation_offload.HostOffload`): the inputs of each checkpointed region that own their
  storage go to host memory (:func:`offloaded_layer_bytes`: ``full``: the block input, ``h e``; ``selective``: the
  query heads' copy of grouped-query attention, ``h e``, else none: q, k and v are views of the qkv buffer), leaving
  each held layer's figure less that on the device, plus two regions' inputs in backward (the one refilled for its
  recomputation and the one fetched ahead); ``host_activations`` reports the host bytes (not in the total; measured
  with ``HostOffload.offloaded_bytes``: tests/test_plan.py).
- backward working set: one layer's activation gradients, as large as what one layer saves without checkpointing,
  ``T`` times the ``none`` figure; with a ring also the key/value block in use, the one arriving and the travelling
  key/value gradients, ``6 kv' e`` per local token.
- attention workspace (one layer at a time): ``chunked``: three fp32 ``256 x 256`` blocks per local head;
  ``triton`` / ``flash`` / ``auto``: fp32 log-sum-exp and its backward's row sums, ``8 B H_loc S_q``; ``sdpa`` (the
  O(S^2) oracle): fp32 scores and probabilities plus two boolean masks, ``(8 B H_loc + 2) S_q S_k``; with
  ``H_loc = H / (tp ulysses)`` heads over ``S_q = S_k = S / ring`` tokens.
- learned position table: :func:`ds4sci.costs.position_table_bytes` (fp32 parameter, gradient and AdamW
  moments) of ``S / sp`` rows (partitioned, ds4sci's default) or ``S`` rows (replicated).
- attention mask: none for causal attention (evaluated inside the kernel); with another ``--mask`` policy,
  :func:`ds4sci.costs.mask_bytes` at the local attention length ``S / ring``.

- framework buffers, each a term (:data:`TERMS`), from the DeepSpeed config ds4sci writes
  (:func:`ds4sci.train.engine.deepspeed_config`: the stage and, at stage 3, ``reduce_scatter``; every size is DeepSpeed
  0.19.8's default, :class:`ZeroBuffers`, pinned against DeepSpeed's resolved config in tests/test_plan_buffers.py):

  - ``reduce_bucket`` (:func:`reduce_bucket_bytes`): stage 0, the engine's all-reduce flattens gradients into
    buckets of ``5e8`` elements, ``min(5e8, phi) g`` with data parallelism; stages 1 and 2, the contiguous-gradient
    buffer of ``reduce_bucket_size = 5e8`` elements in the gradient dtype (one: ``overlap_comm`` is off below stage 3;
    a pipeline at stage 1 adds one), ``5e8 g`` whatever the model's size (1 GB in bf16); stage 3, that buffer in the
    parameter dtype, allocated at start, plus the reduce-scatter's flattened copy of a full bucket, ``(5e8 + min(5e8,
    phi)) p`` (the buffer measured in a ZeRO step on the CPU);
  - ``allgather_bucket``: 0, stages 1 and 2 gather the updated partitions in place (``all_gather_into_tensor``);
  - ``gathered_params`` (:func:`zero3_gathered_params`): ZeRO-3's gathered parameters at the peak, one layer in
    backward or, at the turn from forward to backward, the output head and the last layers whose next use lies within
    ``stage3_max_reuse_distance = 1e9`` elements, plus the ``stage3_prefetch_bucket_size = 5e7`` prefetch, at most
    ``phi``, times ``p``;
  - ``persistent_params`` (:func:`persistent_params`): ZeRO-3 keeps each tensor under
    ``stage3_param_persistence_threshold = 1e5`` elements gathered (norms and biases; every tensor of a tiny model),
    times ``p``;
  - ``a2a_staging``: Ulysses' all-to-all copies the tensor it moves into a contiguous send buffer and receives into
    another (:func:`ds4sci.distributed.comm.all_to_all`), ``2 T h e`` for the queries or the attention output, the
    largest it moves (measured: tests/test_plan_buffers.py);
  - ``ring_buffers``: the ring's forward holds the received key/value block in use, the one arriving and, while the
    next is posted, the previous one (:class:`ds4sci.distributed.comm.RingShift`'s receive buffers), ``min(ring - 1, 3)
    2 T kv' e`` (measured; backward's blocks are the working set's ``6 kv' e``). It and the all-to-all staging are
    alive one after the other within a layer: the total counts the larger.

- the device, each a term overridable on the command line: ``cuda_context``, 0.267 GiB (``--cuda-context-gib``;
  287,047,680 bytes, PyTorch's measurement with lazy module loading, pytorch/pytorch pull request #86509, the default
  since CUDA 12.2); ``cublas_workspace``, 32 MiB (``CUBLAS_WORKSPACE_CONFIG=:4096:8``,
  :func:`ds4sci.train.engine.set_deterministic`'s); ``nccl_buffers``, ``communicators x --nccl-channels (16) x
  --nccl-buffsize-mib (4, NCCL_BUFFSIZE's default)`` with a communicator per group that sends and the world's
  (:func:`nccl_communicators`); ``fragmentation``, ``--fragmentation (0.3) x`` the bytes allocated and freed within a
  step (activations, working set, attention workspace, mask, the larger sequence-parallel buffer): the caching
  allocator interleaves short- and long-lived blocks, and ZeRO (Rajbhandari et al. 2020, arXiv:1910.02054, on memory
  fragmentation in its analysis of residual memory) observed out-of-memory with over 30% of the memory still free; 0
  models an allocator that does not fragment (e.g. ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, unmeasured
  here); ``reserve``, the user's own (``--reserve-gib``, default 0).

A layout fits when the total is at most ``--gpu-mem-gib``. ``--max-seq`` without ``--grad-accum`` gives a pipeline
layout ``m = pp`` micro-batches per step (:func:`filled`): 1F1B's first stage then holds ``pp`` micro-batches'
activations, and the bubble is ``(pp - 1) / (2 pp - 1)``; one micro-batch would leave the pipeline idle.

Communication model (bytes each GPU sends per optimizer step; :func:`ds4sci.costs.layer_comm_bytes` per layer, forward +
backward, times ``L / pp`` layers and ``m`` micro-steps; keys and values carry ``kv'`` channels): tensor parallelism
with sequence-parallel regions on ``N = S / sp`` tokens, ``8 (tp-1)/tp N h e`` per layer without dropout (``tp-sp``:
GPT-NeoX's parallel residual lets the attention and MLP partial sums share one reduce-scatter), Megatron-LM's ``10
(tp-1)/tp N h e`` with dropout or Llama's sequential residual (``megatron-sp``) (both with backward's re-gather of the
column-parallel matmuls' inputs, ``2 (tp-1)/tp N h e``), plus the all-reduce of the layer norms' gradients, ``2
(tp-1)/tp 4 h e`` per layer (RMSNorm: ``2 h``; the final norm's ``2 h``, RMSNorm's ``h``, likewise); left out: the
all-gather of a key/value head's projection shared by ``tp / num_kv_heads`` ranks (its weight, ``2 D h``, per layer and
micro-step); outside the layers, per micro-step, the first stage sends ``3 (tp-1)/tp N h e`` (the vocabulary-parallel
embedding's all-reduce and the all-gather in the backward of its split to sequence regions) and the last stage
``(tp-1)/tp (3 N h e + 2 (2 h e + 12 N))`` (the final layer norm's all-gather, its backward's reduce-scatter and the
output projection's re-gather, the all-reduce of its gradients and of the vocabulary-parallel cross entropy's fp32
maxima and sums); with ``pp = 1`` one rank sends both; Ulysses' all-to-alls on ``S / ring`` tokens of ``h / tp``
channels; the ring's key/value passes on ``S`` tokens of ``h / (tp ulysses)`` channels; checkpointing reruns the
forward's collectives (``full``: the tensor-parallel forward's, :func:`ds4sci.costs.tp_forward_comm_bytes`, ``3`` or ``4
(tp-1)/tp N h e`` per layer, and sequence parallel traffic x 1.5; ``selective``: sequence parallel x 1.5); pipeline: ``T
h e`` per micro-step with ``pp = 2`` (the first stage sends activations forward, the last gradients back), ``2 T h e``
with ``pp > 2`` (a middle stage sends both); data parallelism over ``sdp``: ring all-reduce ``2 (sdp-1)/sdp * phi g``
per step, stages 1 and 2 then all-gather the updated parameter partitions, ``+ (sdp-1)/sdp * phi p`` (DeepSpeed 0.19.8
all-reduces the gradients rather than reduce-scattering them), stage 3 adds the forward and backward parameter
all-gathers, ``+ 2 (sdp-1)/sdp * phi p`` (pipeline, data-parallel and tensor-parallel traffic measured with ``ds4sci
bench layouts``, DeepSpeed 0.19.8); offload: PCIe traffic ``phi (g + p) / sdp`` (``all``: plus ``2 phi p / sdp``, the
parameters fetched for forward and backward).

Cost model (stated, simple, no overlap): ``step time = compute / (1 - bubble) + sum over groups of bytes / bandwidth``.
``compute = FLOPs / (world * peak * efficiency)``, ``FLOPs = 6 N_tok phi_model + 6 B m dp L h S^2`` (causal attention
over the ``H`` query heads of ``h / H`` dims, whatever ``Hkv``) per step, ``phi_model`` the model's parameters less
the position table with a tied head counted twice (the head's matmul runs all the same), plus one forward (a third)
for ``full`` checkpointing and the attention's forward for ``selective``;
``bubble = (pp - 1) / (m + pp - 1)``. A group's bandwidth is ``--intra-gbps`` when it lies inside one node,
``--inter-gbps`` otherwise; in the rank order of :class:`~ds4sci.distributed.dims.ParallelDims` (TP < Ulysses < Ring < DP <
PP, innermost first) a group of degree ``d`` along an axis of stride ``i`` (the product of the inner degrees,
:meth:`~ds4sci.distributed.dims.ParallelDims.stride`) lies inside a node when ``i * d`` divides ``--gpus-per-node``.
Offload traffic runs at ``--pcie-gbps``. Layouts are ranked by tokens per second (``B m dp S / step time``), fastest
first.

Paper figures (DeepSpeed4Science, Song et al. 2023, arXiv:2310.04610, GenSLM section and Figure 9;
https://github.com/microsoft/DeepSpeed/blob/master/blogs/deepspeed4science/japanese/README.md, the official
translation of https://www.microsoft.com/en-us/research/blog/announcing-the-deepspeed4science-initiative-enabling-large-scale-scientific-discovery-through-sophisticated-ai-system-technologies/):
on NVIDIA DGX nodes of 8 A100-40GB GPUs, the new Megatron-DeepSpeed trains GenSLM 25B on 512K-token sequences on
64 GPUs, where Argonne's original setup reached 42K; up to 12x (25B) and 14x (33B) longer sequences than the old
Megatron-DeepSpeed and 9.8x / 9.1x longer than NVIDIA's Megatron-LM.
"""
from __future__ import annotations

import argparse
import itertools
import math
from dataclasses import asdict, dataclass, replace

from ds4sci.cli_args import CommandError, nonnegative_float, positive_int
from ds4sci.costs import layer_comm_bytes, mask_bytes, position_table_bytes, tp_forward_comm_bytes, ulysses_kv_heads
from ds4sci.kernels.backends import LOCAL_CHUNK_SIZE
from ds4sci.models.genslm.config import GenSLMConfig, describe_preset, describe_presets, format_parameters
from ds4sci.distributed.dims import ParallelDims
from ds4sci.report import markdown_table, plural, write_report

GIB = 2.0**30
MIB = 2.0**20
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
STATE_BYTES = {"fp32": (4, 4, 8), "bf16": (2, 2, 12)}
"""bytes per parameter of (parameter, gradient, optimizer state) by training dtype (ZeRO paper's 2 + 2 + K)."""


@dataclass(frozen=True)
class ZeroBuffers:
    """DeepSpeed's ZeRO buffer sizes (elements) for the config ds4sci writes
    (:func:`ds4sci.train.engine.deepspeed_config` sets the stage and, at stage 3, ``reduce_scatter``; every size is
    DeepSpeed 0.19.8's default, ``deepspeed/runtime/zero/config.py``, pinned by tests/test_plan_buffers.py against
    ``DeepSpeedZeroConfig`` of that config)."""

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
                + (f" tile:{self.mlp_tile}" if self.mlp_tile else "") + (" ckpt-cpu" if self.offload_activations else "")
                + (f" loss-tile:{self.loss_tile}" if self.loss_tile else ""))


def _sp_kv(w: Workload, strategy: Strategy) -> float:
    """``kv'``: key/value channels per local token that Ulysses moves and the ring passes on (module docstring)."""
    m = w.model
    return ulysses_kv_heads(m.num_kv_heads, strategy.dims.ulysses) * m.head_dim


def layer_activation_bytes(w: Workload, strategy: Strategy, mode: str) -> float:
    """Bytes one layer saves for backward per local token under checkpointing ``mode`` (module docstring)."""
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
    """Bytes the output projection and the loss save per local token beyond the final norm's (module docstring):
    untiled, the fp32 logits and their log-softmax, ``8 V / tp``; tiled (``strategy.loss_tile``), the int64 targets of
    the SP shard, ``8 tp``, and under TP the gathered final norm output in place of this rank's region,
    ``(tp - 1) h e``."""
    tp = strategy.dims.tp
    if not strategy.loss_tile:
        return 8 * w.model.vocab_size / tp
    return 8 * tp + (tp - 1) * w.model.hidden_size * STATE_BYTES[w.dtype][0]


def rank_params(w: Workload, strategy: Strategy) -> float:
    """``phi``: parameters on the most loaded rank before ZeRO partitioning (module docstring)."""
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
    (DeepSpeed 0.19.8's ``PartitionedParameterCoordinator``): a module's parameters are released after use unless
    they are used again within ``stage3_max_reuse_distance`` elements of parameters fetched in between
    (``__params_to_release``), and up to ``stage3_prefetch_bucket_size`` elements are fetched ahead. So in backward
    one layer is held (the recomputed forward's parameters are reused by its backward; without checkpointing this
    bounds the modules held at once), and at the turn from forward to backward the output head (its backward follows
    its forward) and the last layers ``j = 0, 1, ...`` whose next use is within the distance, ``j layer (1 + r) +
    2 head`` (the layers after it in forward, the head twice and ``r`` backward visits of each later layer: 2 under
    ``full`` checkpointing, the recomputed forward and the backward, 1 otherwise); plus the prefetch bucket; at most
    the rank's parameters. Whole layers where DeepSpeed keeps modules: measured in ZeRO-3 steps on the CPU, over by
    less than one layer (tests/test_plan_buffers.py)."""
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
    """Bytes of DeepSpeed's gradient-reduction buffers on a rank (DeepSpeed 0.19.8, the config ds4sci writes):
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


def memory(w: Workload, strategy: Strategy, cluster: Cluster | None = None) -> dict[str, float]:
    """Bytes per GPU by term (module docstring), each a key, and their total:

    - model states: params, grads, optimizer;
    - the step's tensors: activations, workspace, attention, position_table, mask;
    - framework buffers: reduce_bucket and allgather_bucket (DeepSpeed's ZeRO buffers), gathered_params and
      persistent_params (ZeRO-3's gathered parameters), a2a_staging (Ulysses) and ring_buffers (the ring's forward);
    - the device: cuda_context, cublas_workspace, nccl_buffers, fragmentation and the user's reserve (``cluster``'s
      settings; :class:`Cluster`'s defaults when None).

    ``host_activations``: the checkpointed inputs host offload keeps in host memory (not in the total)."""
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
    # Ulysses' all-to-all (ds4sci.distributed.comm._all_to_all_forward) stages the largest tensor it moves, the queries
    # or the attention output, T h e, in a contiguous send buffer and a receive buffer; the ring's forward
    # (ds4sci.sequence.attention._RingAttention) holds received key/value blocks (RingShift's receive buffers): the
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
    terms["total"] = sum(terms.values()) - min(a2a, ring_fwd)
    terms["host_activations"] = T * held * offloaded  # in host memory, not in the total
    return terms


def comm(w: Workload, strategy: Strategy) -> dict[str, float]:
    """Bytes each GPU sends per optimizer step, by group (module docstring): tp, ulysses, ring, pp, dp, pcie."""
    d = strategy.dims
    p, g, _ = STATE_BYTES[w.dtype]
    e, h, S, B, m = p, w.model.hidden_size, w.seq_len, w.micro_batch, w.grad_accum
    layers = math.ceil(w.model.num_layers / d.pp) * B * m
    sp_redo = 1.5 if strategy.checkpointing != "none" else 1.0
    out = {"tp": 0.0, "ulysses": 0.0, "ring": 0.0, "pp": 0.0, "dp": 0.0, "pcie": 0.0}
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
    return out


def step_time(w: Workload, strategy: Strategy, cluster: Cluster) -> dict[str, float]:
    """Estimated seconds per optimizer step (module docstring's cost model): compute, bubble, comm, total."""
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
    for group, sent in comm(w, strategy).items():
        if not sent:
            continue
        if group == "pcie":
            bw = cluster.pcie_gbps
        else:
            # ZeRO's sdp group spans Ulysses x Ring x DP, from the Ulysses axis outwards
            degree, stride = (d.sdp, d.stride("ulysses")) if group == "dp" else (getattr(d, group), d.stride(group))
            bw = cluster.intra_gbps if cluster.gpus_per_node % (stride * degree) == 0 else cluster.inter_gbps
        seconds += sent / (bw * 1e9)
    total = compute + seconds
    return {"compute_s": compute, "bubble": bubble, "comm_s": seconds, "total_s": total,
            "tokens_per_s": tokens / total}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def strategies(w: Workload, cluster: Cluster, fixed: dict, split_seq: bool = True) -> list[Strategy]:
    """Every strategy on all ``cluster.world`` GPUs that splits the model (and ``w.seq_len`` if ``split_seq``) evenly
    and respects ``fixed`` (``{"tp": 2, "zero_stage": 3, ...}``): degrees the model admits
    (:meth:`~ds4sci.distributed.dims.ParallelDims.check_model`: ``tp * ulysses`` divides the heads, ``tp`` the MLP width,
    ``pp <= layers``), ``tp`` dividing the GPUs of a node (a fixed ``tp`` may also span whole nodes), ZeRO 2/3 only
    without pipeline parallelism (DeepSpeed's pipeline engine), optimizer offload with ZeRO >= 1 and parameter offload with ZeRO 3. The tiled MLP
    (``fixed["mlp_tile"]``), the tiled loss (``fixed["loss_tile"]``) and host offload of checkpointed inputs
    (``fixed["offload_activations"]``, with checkpointing only) are switched on when fixed, never searched."""
    world, m = cluster.world, w.model
    out = []
    for tp, u, r, pp in itertools.product(*(fixed.get(a) and [fixed[a]] or _divisors(world)
                                            for a in ("tp", "ulysses", "ring", "pp"))):
        try:
            dims = ParallelDims.for_world(world, ulysses=u, ring=r, tp=tp, pp=pp)
            dims.check_model(num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, num_layers=m.num_layers,
                             intermediate_size=m.intermediate_size)
        except ValueError:  # these degrees do not split the GPUs or the model
            continue
        if fixed.get("dp", dims.dp) != dims.dp or (cluster.gpus_per_node % tp and "tp" not in fixed):
            continue
        if split_seq and w.seq_len % dims.sequence_multiple:
            continue
        for z, off, ck in itertools.product([fixed["zero_stage"]] if "zero_stage" in fixed else range(4),
                                            [fixed["offload"]] if "offload" in fixed else OFFLOADS,
                                            [fixed["checkpointing"]] if "checkpointing" in fixed else CHECKPOINTING):
            if (pp > 1 and z > 1) or (off == "optimizer" and z < 1) or (off == "all" and z != 3):
                continue
            if fixed.get("offload_activations") and ck == "none":
                continue
            out.append(Strategy(dims, z, off, ck, fixed.get("mlp_tile", 0), fixed.get("offload_activations", False),
                                fixed.get("loss_tile", 0)))
    return out


def budget_bytes(cluster: Cluster) -> float:
    """The GPU's memory: every term, the user's reserve included, is in :func:`memory`'s total."""
    return cluster.gpu_mem_gib * GIB


def filled(w: Workload, strategy: Strategy) -> Workload:
    """``w`` with at least ``pp`` micro-batches per step, so that 1F1B fills the pipeline (``--max-seq`` without
    ``--grad-accum``): the first stage then holds ``pp`` micro-batches' activations and the bubble is
    ``(pp - 1) / (2 pp - 1)``."""
    return replace(w, grad_accum=max(w.grad_accum, strategy.dims.pp))


def plan(w: Workload, cluster: Cluster, fixed: dict, fill_pipeline: bool = False) -> list[dict]:
    """The fitting layouts at ``w.seq_len``, fastest first: dicts of layout (with ``grad_accum``, the micro-batches
    per step: :func:`filled`'s with ``fill_pipeline``), memory terms, comm bytes, step time."""
    budget = budget_bytes(cluster)
    rows = []
    for strategy in strategies(w, cluster, fixed):
        ws = filled(w, strategy) if fill_pipeline else w
        mem = memory(ws, strategy, cluster)
        if mem["total"] <= budget:
            rows.append({"layout": {**strategy.to_dict(), "grad_accum": ws.grad_accum}, "memory": mem,
                         "comm": comm(ws, strategy), "time": step_time(ws, strategy, cluster)})
    rows.sort(key=lambda r: -r["time"]["tokens_per_s"])
    return rows


def max_seq_len(w: Workload, cluster: Cluster, fixed: dict, limit: int = 1 << 34, fill_pipeline: bool = False) -> int:
    """The longest S (up to ``limit``) at which some layout fits: per layout (with ``fill_pipeline``, at
    :func:`filled`'s micro-batches), the largest multiple of its
    :attr:`~ds4sci.distributed.dims.ParallelDims.sequence_multiple` within the budget (memory grows with S), then the
    maximum; 0 if none."""
    budget = budget_bytes(cluster)
    best = 0
    for strategy in strategies(w, cluster, fixed, split_seq=False):
        ws = filled(w, strategy) if fill_pipeline else w
        q = strategy.dims.sequence_multiple

        def fits(n: int) -> bool:
            return memory(ws.with_seq_len(n * q), strategy, cluster)["total"] <= budget

        if not fits(1):
            continue
        lo, hi = 1, 2  # multiples of q: lo fits, hi is the first tried that may not
        while hi * q <= limit and fits(hi):
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        best = max(best, min(lo * q, limit))
    return best


# ------------------------------------------------------------------------------------------------------------ command
_FIXERS = ("tp", "ulysses", "ring", "pp", "dp")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Predict per-GPU memory and communication of every parallel layout (TP, Ulysses, Ring, PP, "
                          "DP, ZeRO stage, offload, activation checkpointing) of a GenSLM at a sequence length on a "
                          "cluster, and list those that fit, fastest first.")
    parser.epilog = ("Cost model: step time = FLOPs / (GPUs x peak x efficiency) / (1 - pipeline bubble) + sum of "
                     "bytes sent per group / that group's bandwidth (intra-node when the group lies inside a node in "
                     "the rank order TP < Ulysses < Ring < DP < PP, inter-node otherwise; offload over PCIe), no "
                     "overlap; FLOPs = 6 x tokens x params + 6 B L h S^2 (causal attention) + recomputation; bubble = "
                     "(pp-1)/(m+pp-1). Memory and byte formulas: the docstring of ds4sci.plan.")
    model = parser.add_argument_group("model (--preset, or a training config's model and data.seq_len)")
    model.add_argument("--preset", help=f"GenSLM shape: {describe_presets()}")
    model.add_argument("--config", help="training config YAML; its model.* and data.seq_len are used (the layout "
                       "keys are searched, fix them with the options below)")
    model.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key as in ds4sci train, e.g. --set model.overrides.num_layers=84")
    model.add_argument("--seq-len", type=positive_int, help="tokens per sequence (default: the config's data.seq_len)")
    model.add_argument("--micro-batch", type=positive_int, default=1, help="sequences per micro-step (default: 1)")
    model.add_argument("--grad-accum", type=positive_int,
                       help="micro-steps per optimizer step, m of the pipeline bubble (default: 1; with --max-seq, "
                       "pipeline layouts take m = pp, which fills 1F1B's pipeline)")
    model.add_argument("--dtype", choices=tuple(STATE_BYTES), default="bf16", help="training dtype (default: bf16)")
    model.add_argument("--position-table", choices=("partitioned", "replicated"), default="partitioned",
                       help="learned position table: S/sp rows per rank (ds4sci) or S (default: partitioned)")
    model.add_argument("--mask", choices=MASKS, default="none",
                       help="attention mask policy; none: causal masking inside the kernel (default: none)")
    cluster = parser.add_argument_group("cluster (defaults: NVIDIA DGX A100)")
    cluster.add_argument("--gpus-per-node", type=positive_int, default=8, help="(default: 8)")
    cluster.add_argument("--nodes", type=positive_int, default=1, help="(default: 1)")
    cluster.add_argument("--gpu-mem-gib", type=nonnegative_float, default=40.0, help="GiB per GPU (default: 40)")
    cluster.add_argument("--reserve-gib", type=nonnegative_float, default=0.0,
                         help="GiB per GPU the user keeps free beyond every modelled term (default: 0)")
    cluster.add_argument("--peak-tflops", type=nonnegative_float, default=312.0, help="per GPU (default: 312)")
    cluster.add_argument("--efficiency", type=nonnegative_float, default=0.4,
                         help="fraction of peak the matmuls reach (default: 0.4)")
    cluster.add_argument("--intra-gbps", type=nonnegative_float, default=150.0,
                         help="GB/s per GPU inside a node (default: 150)")
    cluster.add_argument("--inter-gbps", type=nonnegative_float, default=25.0,
                         help="GB/s per GPU between nodes (default: 25)")
    cluster.add_argument("--pcie-gbps", type=nonnegative_float, default=25.0,
                         help="GB/s per GPU to host memory, for offload (default: 25)")
    device = parser.add_argument_group("device memory outside the model (each a term of the total)")
    device.add_argument("--cuda-context-gib", type=nonnegative_float, default=CUDA_CONTEXT_BYTES / GIB,
                        help="GiB the CUDA context takes per GPU (default: 0.267, PyTorch's measurement with lazy "
                        "module loading, pull request #86509)")
    device.add_argument("--nccl-buffsize-mib", type=nonnegative_float, default=4.0,
                        help="NCCL_BUFFSIZE in MiB: buffer per channel of each communicator (default: 4, NCCL's)")
    device.add_argument("--nccl-channels", type=positive_int, default=16,
                        help="NCCL channels per communicator (default: 16; NCCL picks 2-32 by topology)")
    device.add_argument("--fragmentation", type=nonnegative_float, default=0.3,
                        help="allocator fragmentation, as a fraction of the bytes allocated and freed within a step "
                        "(activations, working set, attention workspace, masks, sequence-parallel buffers) (default: "
                        "0.3: ZeRO found out-of-memory with over 30%% of memory still free; 0 for an allocator "
                        "that does not fragment, e.g. expandable segments)")
    fixed = parser.add_argument_group("fixed choices (searched when left out)")
    for name in _FIXERS:
        fixed.add_argument(f"--{name}", type=positive_int, help=f"{name} degree")
    fixed.add_argument("--zero-stage", type=int, choices=range(4), help="ZeRO stage")
    fixed.add_argument("--offload", choices=OFFLOADS, help="none, optimizer (ZeRO-Offload) or all (ZeRO-Infinity)")
    fixed.add_argument("--checkpointing", choices=CHECKPOINTING, help="activation checkpointing mode")
    fixed.add_argument("--mlp-tile", type=positive_int,
                       help="tiled MLP (activation_checkpointing.tiled_mlp) with tiles of this many tokens")
    fixed.add_argument("--loss-tile", type=positive_int,
                       help="tiled loss (activation_checkpointing.tiled_loss) with tiles of this many tokens")
    fixed.add_argument("--offload-activations", action="store_true", default=None,
                       help="checkpointed inputs in host memory (activation_checkpointing.cpu; needs checkpointing)")
    parser.add_argument("--max-seq", action="store_true", help="find the longest sequence some layout fits")
    parser.add_argument("--top", type=positive_int, default=10, help="layouts to list (default: 10)")
    parser.add_argument("--out", help="also write plan.json and plan.md to this folder")


def _workload(args: argparse.Namespace) -> tuple[Workload, dict]:
    from ds4sci.data.tokenizers import CodonTokenizer, NucleotideTokenizer
    from ds4sci.train.config import load_config

    if args.preset and args.config:
        raise CommandError(f"--preset={args.preset} and --config={args.config}: give one (or set model.preset)")
    overrides = ([f"model.preset={args.preset}"] if args.preset else []) + list(args.overrides)
    cfg = load_config(args.config, overrides)
    vocab = (CodonTokenizer() if cfg.data.tokenizer == "codon" else NucleotideTokenizer()).vocab_size
    model = GenSLMConfig.preset(cfg.model.preset, **{"vocab_size": vocab, **cfg.model.overrides})
    seq_len = args.seq_len or cfg.data.seq_len
    w = Workload(model, seq_len, micro_batch=args.micro_batch, grad_accum=args.grad_accum or 1, dtype=args.dtype,
                 position_table=args.position_table, mask=args.mask)
    return w, {"preset": cfg.model.preset, "overrides": cfg.model.overrides, "parameters": w.model_params}


def _check_fixed(w: Workload, cluster: Cluster, fixed: dict) -> None:
    """One line naming the fixed value no layout can honour."""
    given = {a: fixed[a] for a in _FIXERS if a in fixed}
    product = math.prod(given.values())
    if cluster.world % product:
        raise CommandError(f"{' x '.join(f'--{a}={v}' for a, v in given.items())} = {product} does not divide the "
                           f"{cluster.world} GPUs (--nodes={cluster.nodes} x --gpus-per-node={cluster.gpus_per_node})")
    tp, u = fixed.get("tp", 1), fixed.get("ulysses", 1)
    m = w.model
    if m.num_heads % (tp * u):
        raise CommandError(f"--tp={tp} x --ulysses={u} = {tp * u} must divide the model's "
                           f"{plural(m.num_heads, 'head')}")
    if m.num_kv_heads % tp and tp % m.num_kv_heads:
        raise CommandError(f"--tp={tp} and the model's {plural(m.num_kv_heads, 'key/value head')}: one must divide "
                           f"the other")
    if (cluster.gpus_per_node % tp and tp % cluster.gpus_per_node) or m.intermediate_size % tp:
        raise CommandError(f"--tp={tp} must divide the MLP width {m.intermediate_size} and either divide "
                           f"--gpus-per-node={cluster.gpus_per_node} or span whole nodes (a multiple of it)")
    if fixed.get("pp", 1) > m.num_layers:
        raise CommandError(f"--pp={fixed['pp']}: the model has only {plural(m.num_layers, 'layer')}")
    z = fixed.get("zero_stage")
    if z is not None and z > 1 and fixed.get("pp", 1) > 1:
        raise CommandError(f"--zero-stage={z}: DeepSpeed's pipeline engine (--pp={fixed['pp']}) supports stage 0 or 1")
    off = fixed.get("offload")
    if z is not None and ((off == "optimizer" and z < 1) or (off == "all" and z != 3)):
        raise CommandError(f"--offload={off} needs --zero-stage {'>= 1' if off == 'optimizer' else '3'}, got {z}")
    if fixed.get("offload_activations") and fixed.get("checkpointing") == "none":
        raise CommandError("--offload-activations moves checkpointed inputs to host memory: it needs --checkpointing "
                           "full or selective, got none")
    if cluster.gpu_mem_gib <= cluster.reserve_gib + cluster.cuda_context_gib:
        raise CommandError(f"--gpu-mem-gib={cluster.gpu_mem_gib:g} must exceed --reserve-gib={cluster.reserve_gib:g} "
                           f"plus --cuda-context-gib={cluster.cuda_context_gib:g}")


def _leanest(w: Workload, cluster: Cluster, fixed: dict) -> str:
    leanest = min(strategies(w, cluster, fixed), key=lambda s: memory(w, s, cluster)["total"])
    return (f"the leanest layout, {leanest.name()}, needs {memory(w, leanest, cluster)['total'] / GIB:.1f} GiB per "
            "GPU")


def _shortest_multiple(w: Workload, cluster: Cluster, fixed: dict) -> int:
    """The shortest sequence some strategy splits evenly."""
    return min(s.dims.sequence_multiple for s in strategies(w, cluster, fixed, split_seq=False))


TERMS = {  # memory()'s terms in the order the breakdown lists them, each with what it stands for
    "params": "parameters (ZeRO-3: this rank's partition)",
    "grads": "gradients (ZeRO >= 1: the partition the optimizer is handed)",
    "optimizer": "optimizer state (AdamW's moments, fp32 master copy)",
    "activations": "activations saved for backward, held micro-batches, logits",
    "workspace": "backward's working set (one layer's activation gradients, ring blocks, MLP tile)",
    "attention": "attention kernel workspace",
    "position_table": "learned position table with its gradient and AdamW state",
    "mask": "attention mask",
    "reduce_bucket": "DeepSpeed's gradient-reduction buffers (reduce_bucket_size, contiguous gradients)",
    "allgather_bucket": "DeepSpeed's parameter all-gather (in place)",
    "gathered_params": "ZeRO-3 parameters gathered at the peak (reuse distance, prefetch bucket)",
    "persistent_params": "ZeRO-3 parameters kept gathered (under the persistence threshold)",
    "a2a_staging": "Ulysses all-to-all send and receive buffers (the larger of this and ring_buffers counts)",
    "ring_buffers": "the ring's received and arriving key/value blocks in forward",
    "cuda_context": "CUDA context (--cuda-context-gib)",
    "cublas_workspace": "cuBLAS workspace (CUBLAS_WORKSPACE_CONFIG=:4096:8)",
    "nccl_buffers": "NCCL buffers: communicators x --nccl-channels x --nccl-buffsize-mib",
    "fragmentation": "allocator fragmentation: --fragmentation x the step's short-lived bytes",
    "reserve": "the user's reserve (--reserve-gib)",
}
BUFFERS = ("reduce_bucket", "allgather_bucket", "gathered_params", "persistent_params", "a2a_staging", "ring_buffers")
DEVICE = ("cuda_context", "cublas_workspace", "nccl_buffers", "fragmentation", "reserve")


def markdown_rows(rows: list[dict]) -> tuple[list[str], list[list]]:
    """Header and rows of the layout table (GiB per GPU, GiB sent per GPU per step, seconds per step); ``buffers``:
    the framework's buffers as the total counts them, ``device``: the CUDA context, cuBLAS, NCCL, fragmentation and
    the reserve (:data:`TERMS`)."""
    header = ["#", "tp", "ulysses", "ring", "pp", "dp", "m", "zero", "offload", "ckpt", "params", "grads", "optim",
              "activ", "bwd ws", "attn", "pos table", "mask", "buffers", "device", "total GiB", "sent GiB/step",
              "step s", "tokens/s", "rel. time"]
    best = rows[0]["time"]["tokens_per_s"] if rows else 1.0
    out = []
    for i, r in enumerate(rows, 1):
        lay, mem = r["layout"], r["memory"]
        buffers = sum(mem[k] for k in BUFFERS) - min(mem["a2a_staging"], mem["ring_buffers"])
        out.append([i, lay["tp"], lay["ulysses"], lay["ring"], lay["pp"], lay["dp"], lay["grad_accum"],
                    lay["zero_stage"], lay["offload"], lay["checkpointing"]]
                   + [f"{mem[k] / GIB:.2f}" for k in ("params", "grads", "optimizer", "activations", "workspace",
                                                      "attention", "position_table", "mask")]
                   + [f"{buffers / GIB:.2f}", f"{sum(mem[k] for k in DEVICE) / GIB:.2f}", f"{mem['total'] / GIB:.2f}"]
                   + [f"{sum(r['comm'].values()) / GIB:.2f}", f"{r['time']['total_s']:.3g}",
                      f"{r['time']['tokens_per_s']:.4g}", f"{best / r['time']['tokens_per_s']:.2f}"])
    return header, out


def breakdown_rows(row: dict) -> tuple[list[str], list[list]]:
    """Header and rows of one layout's memory by term (:data:`TERMS`), GiB per GPU."""
    return ["term", "GiB", "what it is"], [[k, f"{row['memory'][k] / GIB:.3f}", TERMS[k]] for k in TERMS]


def run(args: argparse.Namespace) -> int:
    w, model_info = _workload(args)
    cluster = Cluster(args.gpus_per_node, args.nodes, args.gpu_mem_gib, args.reserve_gib, args.peak_tflops,
                      args.efficiency, args.intra_gbps, args.inter_gbps, args.pcie_gbps, args.cuda_context_gib,
                      args.nccl_buffsize_mib, args.nccl_channels, args.fragmentation)
    fixed = {a: getattr(args, a) for a in (*_FIXERS, "zero_stage", "offload", "checkpointing", "mlp_tile",
                                           "loss_tile", "offload_activations") if getattr(args, a) is not None}
    _check_fixed(w, cluster, fixed)
    result = {"model": model_info, "cluster": asdict(cluster), "fixed": fixed}
    fill = args.max_seq and args.grad_accum is None  # pipelines run m = pp micro-batches (filled)
    if args.max_seq:
        S = max_seq_len(w, cluster, fixed, fill_pipeline=fill)
        if S == 0:
            raise CommandError(f"no layout fits even the shortest sequence in --gpu-mem-gib={cluster.gpu_mem_gib:g}: "
                               f"{_leanest(w.with_seq_len(_shortest_multiple(w, cluster, fixed)), cluster, fixed)}")
        w = w.with_seq_len(S)
        result["max_seq_len"] = S
    if not strategies(w, cluster, fixed):
        q = _shortest_multiple(w, cluster, fixed)
        raise CommandError(f"--seq-len={w.seq_len}: no layout of {cluster.world} GPUs splits it evenly (a multiple of "
                           f"sp x tp, twice that with a ring, is needed; {q} at least)")
    rows = plan(w, cluster, fixed, fill_pipeline=fill)
    if not rows:
        raise CommandError(f"no layout fits --seq-len={w.seq_len} in --gpu-mem-gib={cluster.gpu_mem_gib:g} "
                           f"(--reserve-gib={cluster.reserve_gib:g}): {_leanest(w, cluster, fixed)}")
    result.update(workload=w.to_dict(), fitting=len(rows), layouts=rows[: args.top])
    preset, overrides = model_info["preset"], model_info["overrides"]
    model = (f"GenSLM's {preset} preset with overrides {overrides}: {format_parameters(w.model.num_parameters())} "
             "parameters" if overrides else describe_preset(preset, w.model))
    title = (f"# plan: {model}; S = {w.seq_len}, {cluster.nodes} x {cluster.gpus_per_node} GPUs of "
             f"{cluster.gpu_mem_gib:g} GiB, {w.dtype}")
    lines = [title, ""]
    if args.max_seq:
        lines += [f"Longest sequence that fits: {w.seq_len} tokens.", ""]
    if fill and any(r["layout"]["pp"] > 1 for r in rows):
        lines += ["Pipeline layouts run m = pp micro-batches per step (1F1B's first stage holds pp; --grad-accum "
                  "fixes m).", ""]
    listed = ("" if len(rows) == 1 else f"; the {args.top} fastest" if args.top < len(rows) else ", fastest first")
    lines += [f"{plural(len(rows), 'layout fits', 'layouts fit')}{listed} (GiB per GPU; rel. time: time per token "
              "over the fastest's):", ""]
    lines += markdown_table(*markdown_rows(rows[: args.top]))
    lines += ["", "Memory of layout #1 by term (GiB per GPU; the total counts the larger of a2a_staging and "
              "ring_buffers):", ""]
    lines += markdown_table(*breakdown_rows(rows[0]))
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        path = write_report(args.out, "plan", result, text)
        print(f"plan: wrote {path} and {path.with_suffix('.md')}")
    return 0
