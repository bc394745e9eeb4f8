"""Pipeline parallelism for GenSLM through DeepSpeed's pipeline engine (``PipelineModule``; 1F1B schedule,
Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM").

A (tensor- and sequence-)parallelized :class:`~ds4sci.models.genslm.GenSLM` becomes a chain of pipe layers, each
taking and returning a tuple of tensors (what the engine passes between stages with p2p send/recv)::

    EmbeddingStage  (input_ids, position_ids[, doc_ids]) -> (x, position_ids[, doc_ids])    first stage
    BlockStage x L  (x, position_ids[, doc_ids])          -> (x, position_ids[, doc_ids])
    HeadStage       (x, position_ids[, doc_ids])          -> logits [B, T, V (/tp)]          last stage

With the tiled loss (``activation_checkpointing.tiled_loss``: the model's head has a ``tile``) the last stage returns
the final-normed hidden states ``[B, T, hidden]`` instead, and :class:`PipelineLoss` calls the head (this process's
``model.embed_out``, a module of the last stage, the tied copy included) with them and the targets: the tiled loss
runs on the last stage as without pipelining (ZeRO 0/1 here: nothing to gather).

With ``tie_word_embeddings`` the head's matrix is the embedding's: the embedding stage is a DeepSpeed ``TiedLayerSpec``
(key :data:`TIED_KEY`) used twice, as the first layer and, through :meth:`EmbeddingStage.logits`, as the last one
after a :class:`HeadStage` that holds only the final norm. Each end stage builds its own copy (its engine names are
``tied_modules.embed.*``); DeepSpeed broadcasts the first stage's copy to the last at start-up, sums the two copies'
gradients over the tie group (the same TP and sequence x data index on both end stages) before the data-parallel
reduction, and marks the last stage's copy ``ds_pipe_replicated`` so the gradient norm counts it once.

``doc_ids`` is left out of the tuple when the batch has none (the engine passes only tensors); positions and
document ids are integer tensors, which the engine sends forward and never expects a gradient for. Blocks are
balanced over the stages (:func:`build_pipeline_engine`).

Rank layout: :func:`pipeline_topology` is DeepSpeed's ``PipeModelDataParallelTopology`` with axes
``pipe, data, model`` = ``pp, dp x sp, tp``, which numbers ranks exactly as
:class:`~ds4sci.distributed.ParallelDims` does (TP < Ulysses < Ring < DP < PP): the engine's "data" group is our
sequence x data group (where gradients are reduced and ZeRO-1 partitions), its "model" axis our TP group.

What ds4sci relies on in DeepSpeed's engine (gradients averaged over its data group, hence
:func:`pipeline_reduction_factor` ``= dp * sp``, measured again at start-up by
:func:`check_pipeline_gradient_reduction`; ZeRO-0 clipping and the ``model_parallel`` marks; ZeRO-2/3 refused) is
pinned by ``tests/distributed/test_train_pipeline.py``.

The learned position table stays out of the engine as without pipelining
(:class:`~ds4sci.train.position_table.PositionTable`); the embedding stage looks it up, so its gradient exists on
the first stage only.
"""
from __future__ import annotations

import re
from typing import Callable
from typing import Iterator

import torch
import torch.distributed as dist
from torch import Tensor
from torch import nn

from ds4sci.distributed import ParallelDims
from ds4sci.distributed.groups import SequenceParallelGroups
from ds4sci.models.genslm import GenSLM
from ds4sci.parallel.genslm_tp import token_loss_for
from ds4sci.train.config import Config
from ds4sci.train.consolidate import gather_tensor_parallel
from ds4sci.train.engine import deepspeed_config
from ds4sci.train.engine import initialize_deepspeed
from ds4sci.train.engine import make_optimizer
from ds4sci.train.engine import printed_at_debug
from ds4sci.train.loss import scaled_shard_loss
from ds4sci.train.sanity import refuse_mismatch

__all__ = ["pipeline_topology", "pipeline_reduction_factor", "pipeline_layers", "genslm_name", "PipelineLoss",
           "build_pipeline_engine", "TIED_KEY", "measure_pipeline_division", "check_pipeline_gradient_reduction",
           "pipeline_train_batch", "pipeline_eval_sum", "pipeline_state_items"]


def pipeline_topology(dims: ParallelDims):
    """DeepSpeed's process topology for ``dims``: axes ``pipe, data, model`` of sizes ``pp, dp * sp, tp``.

    Row-major over those axes, a rank is ``(pp_rank * dp * sp + sdp_rank) * tp + tp_rank``, which is
    :meth:`ParallelDims.rank_of` since ``sdp_rank = (dp_rank * ring + ring_rank) * ulysses + ulysses_rank``.
    """
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    return PipeModelDataParallelTopology(num_pp=dims.pp, num_mp=dims.tp, num_dp=dims.dp * dims.sp)


def pipeline_reduction_factor(dims: ParallelDims) -> float:
    """``K`` of :mod:`ds4sci.train.loss` for the pipeline engine (ZeRO 0 or 1): it averages gradients over its data
    group, the ``dp * sp`` sequence x data ranks (measured per parameter against one process)."""
    return float(dims.dp * dims.sp)


def _unpack(inputs: tuple[Tensor, ...]) -> tuple[Tensor, Tensor, Tensor | None]:
    x, position_ids, *doc = inputs
    return x, position_ids, doc[0] if doc else None


TIED_KEY = "embed"  # the TiedLayerSpec key of a tied embedding and head


class EmbeddingStage(nn.Module):
    """``(input_ids [B, T], position_ids [B, T][, doc_ids [B, T]])``
    -> ``(x [B, T(/tp), hidden], position_ids[, doc_ids])``:
    GenSLM's token embedding, the learned position table when there is one, and the embedding dropout (under TP,
    the split into the sequence-parallel region). Submodule names are GenSLM's (``embed_in``, ``embed_pos``; with a
    tied head also ``embed_out``, whose weight is ``embed_in``'s: :meth:`logits`)."""

    def __init__(self, model: GenSLM, position_table: Callable[[Tensor], Tensor] | None):
        super().__init__()
        self.embed_in = model.embed_in
        self.embed_pos = model.embed_pos  # the table when it was not popped (then ``position_table`` is None)
        self.emb_dropout = model.emb_dropout
        self.position_table = position_table  # kept out of the engine: not a module (PositionTable)
        self.embed_out = model.embed_out if model.config.tie_word_embeddings else None

    def logits(self, x: Tensor) -> Tensor:
        """The tied output layer: final-normed ``x [B, T, hidden]`` -> logits ``[B, T, V (/tp)]`` (with a tiled loss,
        ``x`` itself: :class:`PipelineLoss` calls the head)."""
        return x if self.embed_out.tile else self.embed_out(x)

    def forward(self, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        input_ids, position_ids, *doc = inputs
        x = self.embed_in(input_ids)  # [B, T, hidden]
        for table in (self.embed_pos, self.position_table):
            if table is not None:
                x = x + table(position_ids).to(x.dtype)
        return (self.emb_dropout(x), position_ids, *doc)


class BlockStage(nn.Module):
    """One GenSLM block on the tuple; ``checkpoint_fn`` is the model's activation-checkpointing hook (or None)."""

    def __init__(self, block: nn.Module, checkpoint_fn: Callable | None):
        super().__init__()
        self.block = block
        self.checkpoint_fn = checkpoint_fn

    def forward(self, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        x, position_ids, doc_ids = _unpack(inputs)  # x [B, T, hidden]
        if self.checkpoint_fn is not None and self.training:
            x = self.checkpoint_fn(self.block, x, position_ids, doc_ids)
        else:
            x = self.block(x, position_ids, doc_ids)
        return (x, *inputs[1:])


class HeadStage(nn.Module):
    """``(x [B, T(/tp), hidden], ...) -> logits [B, T, V (/tp)]``: GenSLM's final norm and output layer; with a tied
    head or a tiled loss, the final norm alone (``-> [B, T, hidden]``; the tied :class:`EmbeddingStage` follows, or
    :class:`PipelineLoss` calls the head)."""

    def __init__(self, model: GenSLM):
        super().__init__()
        self.final_layer_norm = model.final_layer_norm
        self.embed_out = None if model.config.tie_word_embeddings else model.embed_out

    def forward(self, inputs: tuple[Tensor, ...]) -> Tensor:
        x = self.final_layer_norm(inputs[0])
        return x if self.embed_out is None or self.embed_out.tile else self.embed_out(x)


def pipeline_layers(model: GenSLM, position_table: Callable[[Tensor], Tensor] | None = None) -> list:
    """``[EmbeddingStage, BlockStage x num_layers, HeadStage]`` sharing ``model``'s modules (no copies); with
    ``tie_word_embeddings`` the embedding stage is a ``TiedLayerSpec`` (:data:`TIED_KEY`, tied weight
    ``embed_in.weight``), used again after the head as the output layer (:meth:`EmbeddingStage.logits`)."""
    blocks = [BlockStage(block, model.checkpoint_fn) for block in model.layers]
    if not model.config.tie_word_embeddings:
        return [EmbeddingStage(model, position_table), *blocks, HeadStage(model)]
    from deepspeed.runtime.pipe import TiedLayerSpec

    def tied(**kw):
        return TiedLayerSpec(TIED_KEY, EmbeddingStage, model, position_table,
                             tied_weight_attr=["embed_in.weight"], **kw)

    return [tied(), *blocks, HeadStage(model), tied(forward_fn=EmbeddingStage.logits)]


_PIPE_NAME = re.compile(r"(\d+)\.(.*)")
_TIED_PREFIX = f"tied_modules.{TIED_KEY}."


def genslm_name(pipe_name: str, num_layers: int) -> str:
    """The GenSLM state-dict name of a ``PipelineModule`` parameter name: layer ``0`` is the embedding stage,
    ``1..num_layers`` the blocks (``i.block.*`` -> ``layers.{i-1}.*``), ``num_layers + 1`` the head; a tied embedding
    stage's ``tied_modules.embed.*`` are the embedding's (and the tied head's) own names."""
    if pipe_name.startswith(_TIED_PREFIX):
        return pipe_name[len(_TIED_PREFIX):]
    match = _PIPE_NAME.fullmatch(pipe_name)
    if match is None:
        raise ValueError(f"{pipe_name!r} is not a pipeline layer's parameter name")
    index, rest = int(match[1]), match[2]
    if 1 <= index <= num_layers:
        if not rest.startswith("block."):
            raise ValueError(f"{pipe_name!r}: a block stage's names start with 'block.'")
        return f"layers.{index - 1}.{rest[len('block.'):]}"
    if index in (0, num_layers + 1):
        return rest
    raise ValueError(f"{pipe_name!r}: layer index {index} is outside [0, {num_layers + 1}]")


class PipelineLoss:
    """The last stage's ``loss_fn(logits, targets)``: the shard's token-loss sum, scaled like the trainer's loss
    (:func:`~ds4sci.train.loss.scaled_shard_loss`) while ``count`` is set (training), unscaled while it is None
    (evaluation). ``total`` accumulates the unscaled sums (float64) for logging. With ``head`` (the model's output
    head, when its loss is tiled) the stage output is the final hidden states and the sum is ``head(x, targets)``."""

    def __init__(self, groups: SequenceParallelGroups, head: nn.Module | None = None):
        self.token_loss = token_loss_for(groups)
        self.head = head
        self.count: Tensor | None = None
        self.factor = 1.0
        self.total = torch.zeros((), dtype=torch.float64)

    def start(self, count: Tensor | None, factor: float = 1.0) -> None:
        """Begin a batch: ``count`` real targets in the global batch (None: evaluate), loss ``factor``."""
        self.count, self.factor = count, factor
        self.total = torch.zeros((), dtype=torch.float64, device=count.device if count is not None else "cpu")

    def __call__(self, outputs: Tensor, targets: Tensor) -> Tensor:
        local = self.token_loss(outputs, targets, "sum") if self.head is None else self.head(outputs, targets)
        self.total = self.total.to(local.device) + local.detach().double()
        return local if self.count is None else scaled_shard_loss(local, self.count, self.factor)


def build_pipeline_engine(model: GenSLM, position_table, cfg: Config, groups: SequenceParallelGroups,
                          device: torch.device, materialize: Callable[[nn.Module], object] | None = None):
    """``deepspeed.initialize`` on a ``PipelineModule`` of the (parallelized) ``model``; returns the engine.

    Every rank passes the whole model (built with the same seed, or on the meta device); each stage keeps its
    layers. Blocks are balanced over ``groups.dims.pp`` stages (``partition_method="type:BlockStage"``), the embedding
    on the first, the head on the last. ``materialize(stage)``: called on the stage's own module as soon as it holds
    its layers, before anything touches their parameters (draws a meta model's pieces for this stage only; see
    :func:`ds4sci.parallel.parallelize.materialize_`). ``position_table``: the learned table kept out of the engine
    (or None).
    ``engine.module.loss_fn`` is the :class:`PipelineLoss`. First, the engine's gradient reduction is checked on a
    probe pipeline (:func:`check_pipeline_gradient_reduction`).

    A tied embedding and head (``tie_word_embeddings``) is DeepSpeed's tied layer (module docstring).
    """
    from deepspeed.runtime.pipe import PipelineModule

    class StagePipeline(PipelineModule):
        def _build(self):  # DeepSpeed registers this stage's layers here, then moves the module to its device
            super()._build()
            if materialize is not None:
                materialize(self)

    dims = groups.dims
    check_pipeline_gradient_reduction(cfg, groups, device)  # before the model's engine: fails fast
    with printed_at_debug():  # DeepSpeed prints the seeds, topology and stage layers
        pipe = StagePipeline(pipeline_layers(model, position_table), topology=pipeline_topology(dims),
                             loss_fn=PipelineLoss(groups, model.embed_out if model.embed_out.tile else None),
                             partition_method="type:BlockStage")
    pipe.to(device)
    if groups.tp_rank == 0:
        for p in pipe.parameters():
            # ZeRO-0 clipping counts a parameter once in its global norm only when every TP-rank-0 process marks it
            # model_parallel; unlike ZeRO-1's, it does not skip the last stage's copy of a tied embedding
            # (ds_pipe_replicated): that copy stays unmarked
            p.model_parallel = not p.ds_pipe_replicated
    return _initialize(pipe, cfg, dims)


def _initialize(pipe, cfg: Config, dims: ParallelDims):
    """``deepspeed.initialize`` of the ``PipelineModule`` ``pipe`` with ``cfg``'s DeepSpeed config and optimizer."""
    ds_config = deepspeed_config(cfg, dims.sp)
    ds_config.pop("sequence_parallel_size")  # the engine sees the sequence ranks as data ranks (topology)
    # stage outputs are already sequence-sharded over TP: DeepSpeed's own partitioning of them stays off
    ds_config["pipeline"] = {"pipe_partitioned": False, "grad_partitioned": False}
    optimizer, scheduler = make_optimizer([p for p in pipe.parameters() if p.requires_grad], cfg)
    engine, _, _, _ = initialize_deepspeed(model=pipe, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config,
                                           dist_init_required=False)
    return engine


class _ProbeStage(nn.Module):
    """``x -> x * w`` with one weight ``w = 1``: in a chain of these, every stage's gradient is the first stage's
    input ``c`` (the loss is the last output's sum)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x: Tensor) -> Tensor:
        return x.to(self.weight.dtype) * self.weight


def _probe_loss(outputs: Tensor, labels: Tensor) -> Tensor:
    return outputs.sum()


def measure_pipeline_division(cfg: Config, groups: SequenceParallelGroups, device: torch.device) -> Tensor:
    """What the pipeline engine divides the summed gradient of its data group (the ``dp * sp`` sequence x data
    ranks) by, as seen on this rank's stage, times the accumulation steps (float64 scalar): the pipeline's
    :func:`ds4sci.train.sanity.measure_division`.

    A probe ``PipelineModule`` of one :class:`_ProbeStage` per stage, with the model's topology and DeepSpeed config
    (ZeRO stage, offload, bf16, accumulation steps), runs ``engine.train_batch`` (1F1B, the engine's own gradient
    reduction): rank ``r`` of the data group (``W`` ranks) feeds ``c_r = r + 1`` (exact in bf16) to each of the
    ``grad_accum`` micro-batches; the reduced gradient ``G`` is read (``safe_get_full_grad``) where the optimizer
    would step, which is skipped, and the probe engine is destroyed. Returns ``grad_accum * sum(c) / G``:
    ``pipeline_reduction_factor * grad_accum`` when DeepSpeed behaves as the loss scale assumes."""
    from deepspeed.runtime.pipe import PipelineModule
    from deepspeed.utils import safe_get_full_grad

    dims, accum = groups.dims, cfg.train.grad_accum
    with printed_at_debug():  # DeepSpeed prints the seeds, topology and stage layers
        pipe = PipelineModule([_ProbeStage() for _ in range(dims.pp)], topology=pipeline_topology(dims),
                              loss_fn=_probe_loss, partition_method="uniform")
    engine = _initialize(pipe.to(device), cfg, dims)
    (weight,) = engine.module.parameters()  # this stage's
    reduced = []

    def read_instead_of_step(lr_kwargs=None):  # PipelineEngine._exec_optimizer_step calls it after the reduction
        grad = safe_get_full_grad(weight)  # ZeRO-1: collective over the stage's data group
        reduced.append(float(grad.float().sum()) if grad is not None else 0.0)
        engine.global_steps += 1  # as the step would (at 0, train_batch prints its "steps: 0" line)

    engine._take_model_step = read_instead_of_step
    W, r = dist.get_world_size(groups.sdp), dist.get_rank(groups.sdp)
    c = torch.tensor([float(r + 1)], device=device)
    engine.train_batch(iter([(c, c)] * accum))
    engine.destroy()
    total = accum * W * (W + 1) / 2
    return torch.tensor(total / reduced[0] if reduced and reduced[0] else float("inf"), dtype=torch.float64)


def check_pipeline_gradient_reduction(cfg: Config, groups: SequenceParallelGroups, device: torch.device) -> None:
    """Refuse to train when the pipeline engine's measured gradient reduction
    (:func:`measure_pipeline_division`) is not :func:`pipeline_reduction_factor` x ``train.grad_accum`` (a
    collective over the whole world; skipped when the sequence x data group is one rank).

    Raises:
        RuntimeError: naming DeepSpeed's version, the ZeRO stage, the degrees, and the measured vs expected factor.
    """
    if dist.get_world_size(groups.sdp) == 1:
        return  # nothing is reduced (the engine's division by the accumulation steps is tested)
    d, accum = groups.dims, cfg.train.grad_accum
    refuse_mismatch(measure_pipeline_division(cfg, groups, device), pipeline_reduction_factor(d) * accum, device,
                    settings=f"pipeline engine, parallel.pp={d.pp}, zero.stage={cfg.zero.stage}, dp={d.dp}, "
                             f"sp={d.sp}, train.grad_accum={accum}",
                    factor="pipeline_reduction_factor x grad_accum",
                    fix="ds4sci.train.pipeline.pipeline_reduction_factor")


def pipe_batches(batches: list[dict[str, Tensor]]):
    """The engine's data iterator over the trainer's micro-batches: ``((input_ids, position_ids[, doc_ids]),
    targets)`` each."""
    return iter([((b["input_ids"], b["position_ids"], *([b["doc_ids"]] if "doc_ids" in b else [])), b["targets"])
                 for b in batches])


def _from_last_stage(x: Tensor, groups: SequenceParallelGroups) -> Tensor:
    """The last stage's ``x`` summed over its sequence x data group, on every rank (float64)."""
    x = x.detach().to(torch.float64).clone()
    dist.all_reduce(x, group=groups.sdp)
    if groups.coords.pp != groups.dims.pp - 1:
        x.zero_()
    dist.all_reduce(x, group=groups.pp)
    return x


def pipeline_train_batch(engine, groups: SequenceParallelGroups, batches: list[dict[str, Tensor]], count: Tensor,
                         factor: float) -> Tensor:
    """One optimizer step over the micro-batches ``batches`` (1F1B); each shard's loss sum is back-propagated as
    ``sum / count * factor``. Returns the global batch's loss sum (float64 scalar, every rank)."""
    loss = engine.module.loss_fn
    loss.start(count, factor)
    engine.train_batch(pipe_batches(batches))
    return _from_last_stage(loss.total.to(count.device), groups)


def pipeline_eval_sum(engine, groups: SequenceParallelGroups, batches: list[dict[str, Tensor]]) -> Tensor:
    """The loss sum over every real target of ``batches`` (all sequence x data ranks; float64, every rank)."""
    loss = engine.module.loss_fn
    loss.start(None)
    engine.eval_batch(pipe_batches(batches), num_micro_batches=len(batches), reduce_output=None, bcast_loss=False)
    return _from_last_stage(loss.total.to(batches[0]["targets"].device), groups)


def pipeline_state_items(engine, groups: SequenceParallelGroups, tp_plan: dict, num_layers: int,
                         extra: dict[str, Tensor], dst: int | None = None) -> Iterator[tuple[str, Tensor]]:
    """The single-device GenSLM state (fp32, CPU) of every stage, as ``(name, tensor)`` pairs (collective: every rank
    consumes it to the end).

    Each stage renames its parameters (:func:`genslm_name`) and gathers TP pieces (``tp_plan``: GenSLM names, from
    :func:`~ds4sci.parallel.tensor_parallel.tensor_parallel_plan` of the model), one tensor at a time; ``extra`` (the
    assembled position table) comes with the first stage. ``dst=None``: the stages' dicts are all-gathered and every
    rank gets every tensor. ``dst`` (the first stage's sender: its TP rank 0 and sequence x data rank 0): stage by
    stage, each stage's sender sends its tensors to ``dst`` one at a time, and only ``dst`` yields them, so it holds
    one tensor at a time.
    """
    def local():
        for name, value in engine.module.state_dict().items():  # one full tensor at a time on the device
            if name.startswith(_TIED_PREFIX) and groups.coords.pp > 0:
                continue  # the last stage's copy of the tied embedding: the first stage's is the one
            key = genslm_name(name, num_layers)
            yield key, gather_tensor_parallel({key: value.detach()}, groups, tp_plan)[key].float().cpu().clone()
        if groups.coords.pp == 0:
            yield from extra.items()

    sender = groups.coords.tp == 0 and groups.sdp_rank == 0  # one per stage
    if dst is None:
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, dict(local()) if sender else {})
        yield from ((k, v) for part in parts for k, v in part.items())
        return
    stages: list = [None] * dist.get_world_size()
    dist.all_gather_object(stages, (groups.coords.pp, sender))
    senders = {stage: rank for rank, (stage, is_sender) in enumerate(stages) if is_sender}
    if senders[0] != dst:
        raise ValueError(f"pipeline_state_items: dst={dst} must be the first stage's sender, rank {senders[0]}")
    me = dist.get_rank()
    for stage in range(groups.dims.pp):
        if me == dst and stage > 0:  # receive the stage's tensors until its end marker
            while True:
                item = [None]
                dist.recv_object_list(item, src=senders[stage])
                if item[0] is None:
                    break
                yield item[0]
        elif groups.coords.pp == stage:
            for key, tensor in local():  # every rank of the stage takes part in the TP gathers
                if me == dst:
                    yield key, tensor
                elif sender:
                    dist.send_object_list([(key, tensor)], dst=dst)
            if sender and me != dst:
                dist.send_object_list([None], dst=dst)
