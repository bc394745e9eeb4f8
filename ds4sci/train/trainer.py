"""Training GenSLM with DeepSpeed (ZeRO 0-3), Ulysses / ring / Unified sequence parallelism and tensor parallelism.

Sequence parallelism is applied from outside the model (:func:`~ds4sci.parallel.parallelize.parallelize`): every
block's attention core is wrapped in ``ds4sci.sequence.DistributedAttention`` and tokens, targets, positions (and
document ids) are sharded together with the same :class:`~ds4sci.distributed.ParallelDims`. Tensor parallelism
(``parallel.tp``, applied by the same call) leaves the batch sharding unchanged: the TP ranks of a sequence shard read
the same tokens, the loss is the vocabulary-parallel cross entropy (:func:`~ds4sci.parallel.genslm_tp.token_loss_for`),
sums are taken over the sequence x data group only, and :meth:`Trainer.full_state_dict` gathers the single-device
model. Targets are shifted on the full window BEFORE sharding, so the label of a shard's last token (which lives on
the next shard) is never lost.

Loss normalisation (:mod:`ds4sci.train.loss`): the loss is the mean over every real (non ``IGNORE_INDEX``) target of the
global batch (all data-parallel ranks, all sequence shards, all accumulation micro-batches), with the scale that
undoes DeepSpeed's per-stage gradient reduction; the equivalence tests prove it per ZeRO stage against
single-process training.

Memory switches: ZeRO-Offload / ZeRO-Infinity (``zero.offload_*``) go into the DeepSpeed config
(:mod:`ds4sci.train.engine`); activation checkpointing, the tiled MLP and the tiled loss
(``activation_checkpointing.*``) are applied to the model after sequence parallelism
(:mod:`ds4sci.train.activation_checkpointing`); with the tiled loss the model's head returns the loss sum (the
targets go into the engine's forward). None changes the loss scale.

The sequence-partitioned learned position table is kept OUT of the DeepSpeed engine and owned by
:class:`ds4sci.train.position_table.PositionTable` (why: see there).
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import json
import logging
import math
import threading
import time
from collections.abc import Callable
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ds4sci.data import collate
from ds4sci.distributed.groups import build_groups
from ds4sci.distributed.nodes import describe_nodes
from ds4sci.models.genslm import IGNORE_INDEX
from ds4sci.models.genslm import shift_labels
from ds4sci.parallel.genslm_tp import token_loss_for
from ds4sci.parallel.parallelize import materialize_
from ds4sci.parallel.parallelize import parallelize
from ds4sci.parallel.tensor_parallel import tensor_parallel_plan
from ds4sci.progress import progress_bar
from ds4sci.sequence import DistributedAttention
from ds4sci.sequence import shard_sequence
from ds4sci.train.activation_checkpointing import apply_activation_checkpointing
from ds4sci.train.checkpoint import load_checkpoint
from ds4sci.train.config import Config
from ds4sci.train.consolidate import gather_tensor_parallel
from ds4sci.train.data_order import train_samples
from ds4sci.train.engine import build_engine
from ds4sci.train.engine import collective_error
from ds4sci.train.engine import init_distributed
from ds4sci.train.engine import one_line_errors
from ds4sci.train.engine import set_deterministic
from ds4sci.train.engine import writing
from ds4sci.train.init_from import initial_model
from ds4sci.train.launch import check_launch
from ds4sci.train.launch import current_launch
from ds4sci.train.launch import fit_global_batch
from ds4sci.train.launch import load_data
from ds4sci.train.loss import global_target_count
from ds4sci.train.loss import grad_reduction_factor
from ds4sci.train.loss import scaled_shard_loss
from ds4sci.train.pipeline import build_pipeline_engine
from ds4sci.train.pipeline import pipeline_eval_sum
from ds4sci.train.pipeline import pipeline_reduction_factor
from ds4sci.train.pipeline import pipeline_state_items
from ds4sci.train.pipeline import pipeline_train_batch
from ds4sci.train.plot import plot_metrics
from ds4sci.train.position_table import PositionTable
from ds4sci.train.run_dir import keep_metrics_until
from ds4sci.train.run_dir import open_run_dir

logger = logging.getLogger(__name__)


def _ignored(sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``sample`` with every target ignored: fills a last, partial evaluation micro-batch."""
    return {**sample, "labels": torch.full_like(sample["labels"], IGNORE_INDEX)}


def _bounded_collectives(where: Callable[[Trainer], str]):
    """``Trainer`` method decorator: a collective that failed because another rank died or hangs becomes the
    one-line error of :func:`ds4sci.train.engine.collective_error`, naming the phase ``where(trainer)`` (taken
    when it fails)."""

    def decorate(method):
        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            def convert(err):  # read when it fails: __init__ sets cfg
                return collective_error(err, where(self), self.cfg.train.timeout_s)

            with one_line_errors(RuntimeError, convert):
                return method(self, *args, **kwargs)

        return wrapper

    return decorate


def _on_rank_0(action: Callable[[], object], device: torch.device) -> None:
    """``action()`` on rank 0, its error (``ValueError`` / ``OSError``, one line) raised on every rank at once
    (collective: every rank calls it): a check or a write that only rank 0 does would otherwise leave the other
    ranks waiting for it in their next collective until ``train.timeout_s``."""
    box: list = [None]  # (error class name, message)
    if dist.get_rank() == 0:
        try:
            action()
        except (ValueError, OSError) as err:
            box[0] = ("ValueError" if isinstance(err, ValueError) else "OSError", str(err))
    dist.broadcast_object_list(box, src=0, device=device)
    if box[0] is not None:
        kind, message = box[0]
        raise (ValueError if kind == "ValueError" else OSError)(message)


def _tensorboard_excepthook(previous, args) -> None:
    """``threading.excepthook`` while training: TensorBoard's writer thread that dies of an ``OSError`` (a full
    disk) prints no traceback; the main thread's next TensorBoard call raises that error, reported in one line."""
    if not (type(args.thread).__module__.startswith("tensorboard.") and isinstance(args.exc_value, OSError)):
        previous(args)


@contextlib.contextmanager
def _quiet_tensorboard_thread():
    """Inside, :func:`_tensorboard_excepthook` is ``threading.excepthook``."""
    previous = threading.excepthook
    threading.excepthook = functools.partial(_tensorboard_excepthook, previous)
    try:
        yield
    finally:
        threading.excepthook = previous


@contextlib.contextmanager
def _no_update(optimizers: list[torch.optim.Optimizer]):
    """Inside, ``step()`` of each of ``optimizers`` does nothing (an instance attribute shadows the method), so a
    DeepSpeed step at the accumulation boundary zeroes the gradients and advances the counters and the schedule
    while the parameters and the AdamW state (moments, step count) stay as they were: every ZeRO stage, offload
    included, updates through the client optimizer's ``step()``."""
    for optimizer in optimizers:
        optimizer.step = lambda closure=None: None
    try:
        yield
    finally:
        for optimizer in optimizers:
            del optimizer.step


@dataclass
class StepResult:
    step: int
    loss: float
    tokens: int
    lr: float


class Trainer:
    """Builds groups, data, model, DeepSpeed engine; runs ``train()``.

    Launch with ``torchrun --nproc-per-node N -m ds4sci.cli train CONFIG`` (N = dp x tp x ulysses x ring x pp) or in
    one process.
    """

    @_bounded_collectives(lambda self: f"start-up ({self.cfg.train.out_dir})")
    def __init__(self, cfg: Config, *, resume: str | None = None, overwrite: bool = False):
        """``resume``: None (a new run), ``""`` (continue the run in ``train.out_dir``), ``"auto"`` (continue it if it
        has a checkpoint, else start) or a checkpoint folder;
        ``overwrite``: replace the run in ``train.out_dir`` (:mod:`ds4sci.train.run_dir` has the rules)."""
        self.cfg = cfg
        self.dims = check_launch(cfg, current_launch())
        self.cfg = cfg = fit_global_batch(cfg, self.dims)  # train.global_batch_size: the accumulation at this dp
        if cfg.train.deterministic:
            set_deterministic()
        self.launch = init_distributed(cfg.train.timeout_s)
        self.rank = dist.get_rank()
        self.groups = build_groups(self.dims, timeout=datetime.timedelta(seconds=cfg.train.timeout_s))
        local = self.launch.local_rank
        self.device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
        if self.device.type == "cuda":  # the device of NCCL's object collectives at start-up (run folder, token cache)
            torch.cuda.set_device(self.device)
        self.out = Path(cfg.train.out_dir)
        # locked (rank 0, held to the end of train()) before anything there is read or written
        resume_from, self.run_lock = open_run_dir(cfg, resume, overwrite, self.device, self.launch)

        self.tokenizer, self.train_ds, self.val_ds, self.split = self._load_data()
        self._build_model()
        self.step = 0
        _on_rank_0(self._write_config, self.device)
        self.resumed_from = load_checkpoint(self, resume_from) if resume_from is not None else None
        if self.resumed_from is not None and self.step >= cfg.train.steps:
            raise ValueError(f"--resume: {self.resumed_from} is at step {self.step}, train.steps={cfg.train.steps}: "
                             f"nothing left to train (raise train.steps)")

    def _load_data(self) -> tuple:
        """``(tokenizer, training set, validation set, a line naming the split)`` (every rank)."""
        return load_data(self.cfg, self.launch)

    def _build_model(self) -> None:
        """The model, its parallelization and the DeepSpeed engine (``self.engine``), with what the trainer keeps of
        them (config, parameter count, TP plan, loss, position table)."""
        cfg = self.cfg
        # built on the meta device: each rank draws (or, with model.init_from, copies from the memory-mapped source)
        # only its own pieces (its TP shards, its table rows, its pipeline stage), so no rank holds the whole model
        model = initial_model(cfg, self.tokenizer, device="meta")
        self.model_config = model.config
        self.num_parameters = sum(p.numel() for p in model.parameters())
        table = parallelize(model, self.groups)
        if table is not None:  # the position table stays out of the engine
            materialize_(model, table, self.groups, keep=table)
        # the engine draws the rest as it builds: the model (block by block under ZeRO-3), or this pipeline stage
        materialize = functools.partial(materialize_, model, None, self.groups)
        self.tp_plan = tensor_parallel_plan(model)  # the TP-split parameters: gathered for the export
        self.loss_fn = token_loss_for(self.groups)  # vocabulary-parallel cross entropy when tp > 1
        # DistributedAttention all-gathers the shard shapes (a host sync) per layer per forward to catch uneven shards;
        # every batch of the trainer has one shape, so the first forward checks them and the others skip the check
        self._unchecked_shapes = [m for m in model.modules() if isinstance(m, DistributedAttention)]
        apply_activation_checkpointing(model, self.cfg.activation_checkpointing, self.device)
        self.pos_table = PositionTable(table, self.groups, cfg, self.device) if table is not None else None
        if self.dims.pp > 1:  # DeepSpeed's pipeline engine; the first stage looks the position table up
            self.engine = build_pipeline_engine(model, self.pos_table, cfg, self.groups, self.device, materialize)
        else:
            self.engine = build_engine(model, cfg, self.groups, self.device, materialize)
        model.init_source = None  # every piece is drawn or copied now: release the fine-tuning source

    def _write_config(self) -> None:
        """Rank 0 at start-up: the run folder and its ``config.yaml``."""
        with writing("start-up", self.out / "config.yaml"):
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "config.yaml").write_text(self.cfg.to_yaml())

    # ----------------------------------------------------------------------------------------------------- data
    def _micro_batch(self, dataset, index: int, shuffle: bool) -> dict[str, torch.Tensor]:
        """Global micro-batch ``index``: this data-parallel rank's samples, this sequence rank's shard.

        Training (``shuffle``) reads the samples :func:`~ds4sci.train.data_order.train_samples` assigns: full global
        batches from a seeded permutation per epoch (the remainder of an epoch is dropped). Evaluation reads the
        dataset in order and fills the last micro-batch with samples whose targets are all ignored, so every
        validation sample counts once and nothing else does.
        """
        t = self.cfg.train
        per_micro = t.micro_batch_size * self.dims.dp
        n = len(dataset)
        if shuffle:
            if n < per_micro * t.grad_accum:
                raise ValueError(f"the training set has {n} samples, fewer than one global batch of "
                                 f"{per_micro * t.grad_accum} (train.micro_batch_size={t.micro_batch_size} x "
                                 f"{self.dims.dp} data ranks x train.grad_accum={t.grad_accum})")
            epoch, positions = train_samples(t.seed, n, index, t.micro_batch_size, self.dims.dp, t.grad_accum,
                                              self.groups.dp_rank)
            if hasattr(dataset, "set_epoch"):
                dataset.set_epoch(epoch)
            samples = [dataset[int(i)] for i in positions]
        else:
            first = index * per_micro + self.groups.dp_rank * t.micro_batch_size
            samples = [dataset[i] if i < n else _ignored(dataset[0]) for i in range(first, first + t.micro_batch_size)]
        batch = collate(samples)
        batch["targets"] = shift_labels(batch.pop("labels"))  # shift on the full window, before sharding
        if self.cfg.data.dataset == "windows":
            batch.pop("doc_ids")  # one document per window: causal attention needs no mask
        d = self.dims
        return {k: shard_sequence(v, 1, self.groups.sp_rank, d.sp, d.layout).to(self.device) for k, v in batch.items()}

    def _shapes_checked(self) -> None:
        """After the first forward: every trainer batch has the same shape, so DistributedAttention stops checking
        shard shapes (an all-gather and a host sync per layer)."""
        for attention in self._unchecked_shapes:
            attention.check_shapes = False
        self._unchecked_shapes = []

    def _forward_sum(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        pos_embeds = self.pos_table(batch["position_ids"]) if self.pos_table is not None else None
        tgt = batch["targets"]
        inputs = (batch["input_ids"], batch["position_ids"], batch.get("doc_ids"))
        if self.cfg.activation_checkpointing.tiled_loss:  # the head computes the loss sum itself, tile by tile
            local_sum = self.engine(*inputs, position_embeds=pos_embeds, targets=tgt)
        else:
            local_sum = self.loss_fn(self.engine(*inputs, position_embeds=pos_embeds), tgt, "sum")
        self._shapes_checked()
        return local_sum, (tgt != IGNORE_INDEX).sum()

    def _all_sum(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the sequence x data group: every token of the global batch once (the TP ranks of a
        sequence shard hold the same tokens and the same loss)."""
        x = x.detach().to(torch.float64).clone()
        dist.all_reduce(x, group=self.groups.sdp)
        return x

    # ---------------------------------------------------------------------------------------------------- train
    @_bounded_collectives(lambda self: f"step {self.step + 1}")
    def train_step(self) -> StepResult:
        t = self.cfg.train
        batches = [self._micro_batch(self.train_ds, self.step * t.grad_accum + a, shuffle=True)
                   for a in range(t.grad_accum)]
        count = global_target_count([b["targets"] for b in batches], self.groups.sdp)
        # engine.backward divides by the accumulation steps: multiply them back in
        pipe = self.dims.pp > 1
        reduction = (pipeline_reduction_factor(self.dims) if pipe
                     else grad_reduction_factor(self.cfg.zero.stage, self.dims.dp, self.dims.sp))
        factor = reduction * t.grad_accum
        lr = self.engine.get_lr()[0]  # the rate this step uses
        if pipe:
            total = pipeline_train_batch(self.engine, self.groups, batches, count, factor)
            self._shapes_checked()
        else:
            loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
            for i, b in enumerate(batches):
                local_sum, _ = self._forward_sum(b)
                self.engine.backward(scaled_shard_loss(local_sum, count, factor))
                loss_sum += local_sum.detach().double()
                if i < len(batches) - 1:
                    self.engine.step()  # a micro-step: the update waits for the accumulation boundary
            total = self._all_sum(loss_sum)
        loss = (total / count).item()  # the same global value on every rank: they all decide alike below
        finite = math.isfinite(loss)
        if not finite:
            self._nonfinite(loss, applied=pipe)
        if not pipe:
            skipped = self.engine.skipped_steps
            with _no_update([] if finite else [self.engine.basic_optimizer]):
                self.engine.step()
            if self.engine.skipped_steps > skipped:  # DeepSpeed's own check (ZeRO 1-3, bf16) skipped it, schedule too:
                self.engine.lr_scheduler.step()      # keep the schedule with the step counter, as at stage 0
        if self.pos_table is not None:
            with _no_update([] if finite else [self.pos_table.optimizer]):
                self.pos_table.step(reduction)
        self.step += 1
        return StepResult(self.step, loss, self.step_tokens(batches, count), lr)

    def step_tokens(self, batches: list[dict], count: torch.Tensor) -> int:
        """The tokens a step trained on, over every rank (``tokens`` in metrics.jsonl, the log's tokens/s): the
        language-modelling targets, ``count``."""
        return int(count.item())

    def _nonfinite(self, loss: float, applied: bool) -> None:
        """A NaN / infinite step loss under ``train.nonfinite``: ``stop`` raises, ``skip`` logs (the update is
        then skipped by the caller)."""
        step = self.step + 1
        if self.cfg.train.nonfinite == "stop":
            state = ("this step's update was applied (parallel.pp > 1 steps before the loss is known)" if applied else
                     "no update was applied")
            raise ValueError(f"step {step}: the loss is {loss} (train.nonfinite=stop; {state}; "
                             f"train.nonfinite=skip skips such steps)")
        if self.rank == 0:
            logger.warning("step %d: the loss is %s: no update (train.nonfinite=skip)", step, loss)

    @_bounded_collectives(lambda self: f"evaluation at step {self.step} ({self.out})")
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean loss over real tokens of the first ``eval_batches`` validation batches of the global batch's size
        (``grad_accum`` micro-batches each: the same samples however the global batch is split); bits per base."""
        t = self.cfg.train
        per_micro = t.micro_batch_size * self.dims.dp
        n_batches = min(t.eval_batches * t.grad_accum, math.ceil(len(self.val_ds) / per_micro))
        batches = [self._micro_batch(self.val_ds, i, shuffle=False) for i in range(n_batches)]
        count = global_target_count([b["targets"] for b in batches], self.groups.sdp)
        if count == 0:
            raise ValueError("the validation set has no real target token (data.val_fraction too small?)")
        if self.dims.pp > 1:
            total = pipeline_eval_sum(self.engine, self.groups, batches)
        else:
            total = torch.zeros((), dtype=torch.float64, device=self.device)
            self.engine.eval()
            for b in batches:
                total += self._forward_sum(b)[0].double()
            self.engine.train()
            total = self._all_sum(total)
        loss = (total / count).item()
        return {"val_loss": loss, "val_perplexity": math.exp(loss),
                "val_bits_per_base": loss / math.log(2) / self.tokenizer.bases_per_token}

    def describe_validation(self, record: dict) -> str:
        """The log line's words for an evaluation's ``record``."""
        return (f"validation loss {record['val_loss']:.4f} nats/token, {record['val_bits_per_base']:.4f} "
                f"bits/base")

    def train(self) -> list[dict]:
        """Run to ``train.steps``; log, evaluate, checkpoint and export. Returns the metric records.

        A failed write (a full disk) stops the run with one line naming the phase, the file and the reason: rank 0's
        outputs are opened before the first step, their errors shared with every rank (:func:`_on_rank_0`); a
        later failed write of rank 0's stops rank 0, whose exit stops the others (the launcher, or their next
        collective); the checkpoint's: :func:`~ds4sci.train.checkpoint.save_checkpoint`."""
        with _quiet_tensorboard_thread():
            return self._train()

    def _train(self) -> list[dict]:
        from tqdm.contrib.logging import logging_redirect_tqdm

        from ds4sci.train.checkpoint import save_checkpoint

        t = self.cfg.train
        records: list[dict] = []
        metrics_path, tensorboard = self.out / "metrics.jsonl", self.out / "tensorboard"
        writer = bar = metrics = None

        def open_outputs() -> None:
            from torch.utils.tensorboard import SummaryWriter

            nonlocal writer, bar, metrics
            logger.info("%s", self.summary())
            with writing("start-up", metrics_path):
                keep_metrics_until(metrics_path, self.step)  # a resumed run continues the curve
                metrics = open(metrics_path, "a", encoding="utf-8")
            with writing("start-up", tensorboard):
                # purge_step: TensorBoard hides what a stopped run logged after the checkpoint this run resumes from
                writer = SummaryWriter(str(tensorboard), purge_step=self.step + 1 if self.step else None)
            bar = progress_bar(t.progress, total=t.steps, initial=self.step, desc="train", unit="step")

        _on_rank_0(open_outputs, self.device)
        start, tokens_seen, first_step = time.perf_counter(), 0, self.step

        def log(record: dict) -> None:
            records.append(record)
            if self.rank == 0:
                with writing(f"step {record['step']}", metrics_path):
                    metrics.write(json.dumps(record) + "\n")
                    metrics.flush()
                with writing(f"step {record['step']}", tensorboard):
                    for key, value in record.items():
                        if key != "step":
                            writer.add_scalar(key, value, record["step"])
                if "val_loss" in record:  # every validation, as it happens
                    logger.info("step %d/%d: %s", record["step"], t.steps, self.describe_validation(record))
                elif bar.disable:  # no progress bar (off, or stderr is no terminal): a line per logged step
                    elapsed = time.perf_counter() - start
                    left = elapsed / (record["step"] - first_step) * (t.steps - record["step"])
                    logger.info("step %d/%d: loss %.4f, lr %.3g, %s tokens/s, %s left", record["step"], t.steps,
                                record["loss"], record["lr"], f"{tokens_seen / elapsed:,.0f}",
                                _duration(left))

        with logging_redirect_tqdm():  # log lines above the progress bar, not through it
            while self.step < t.steps:
                r = self.train_step()
                tokens_seen += r.tokens
                if r.step % t.log_every == 0 or r.step == t.steps:
                    log({"step": r.step, "loss": r.loss, "tokens": r.tokens, "lr": r.lr})
                if (t.eval_every and r.step % t.eval_every == 0) or r.step == t.steps:
                    log({"step": r.step, **self.evaluate()})
                if t.save_every and r.step % t.save_every == 0 and r.step != t.steps:
                    save_checkpoint(self)
                if bar is not None:
                    rate = tokens_seen / (time.perf_counter() - start)
                    bar.set_postfix(loss=f"{r.loss:.3f}", tok_s=f"{rate:,.0f}")
                    bar.update(1)
        save_checkpoint(self)
        self.export()
        if self.rank == 0:
            bar.close()
            with writing("end of training", tensorboard):
                writer.close()
            with writing("end of training", metrics_path):
                metrics.close()
            with writing("end of training", self.out / "loss.png"):
                plot_metrics(metrics_path, self.out / "loss.png")
            if self.run_lock is not None:
                self.run_lock.release()
        return records

    def summary(self) -> str:
        """The start-up block ``train()`` logs: run folder, model, data, layout, precision, batch."""
        c, d, t, z, dims = self.model_config, self.cfg.data, self.cfg.train, self.cfg.zero, self.dims
        offload = [f"{k} offloaded to {v}" for k, v in (("optimizer", z.offload_optimizer), ("parameters",
                   z.offload_param)) if v != "none"]
        per_step = t.micro_batch_size * dims.dp * t.grad_accum
        resumed = f" (resumed from {self.resumed_from} at step {self.step})" if self.resumed_from else ""
        rows = [
            ("run folder", f"{self.out}{resumed}"),
            ("model", f"GenSLM {self.cfg.model.preset}: {self.num_parameters:,} parameters, {c.num_layers} layers, "
                      f"hidden {c.hidden_size}, {c.num_heads} heads, {c.position_embedding} position embedding, "
                      f"context {c.max_position_embeddings}"),
            ("data", f"{d.tokenizer} tokens, {d.dataset} of {d.seq_len}: train {_split_tokens(self.train_ds):,} tokens "
                     f"({len(self.train_ds):,} samples), validation {_split_tokens(self.val_ds):,} tokens "
                     f"({len(self.val_ds):,} samples)"),
            ("split", self.split),
            ("layout", f"dp {dims.dp} x tp {dims.tp} x ulysses {dims.ulysses} x ring {dims.ring} x pp {dims.pp} "
                       f"({dims.layout.value} sequence layout), {dist.get_world_size()} process(es) on "
                       f"{self.device.type}: {self.launch.nodes} node(s) x {self.launch.local_world_size} per node "
                       f"({self.launch.launcher})"),
            ("nodes", describe_nodes(dims, self.launch.local_world_size)),
            ("precision", ", ".join([f"{t.dtype}, ZeRO stage {z.stage}", *offload])),
            ("batch", f"{t.micro_batch_size} x {dims.dp} data ranks x {t.grad_accum} accumulation = {per_step} "
                      f"sequences ({per_step * d.seq_len:,} tokens) per step; steps {self.step + 1}..{t.steps}"),
        ]
        return "\n".join(["ds4sci train"] + [f"  {name:<11} {text}" for name, text in rows])

    # ------------------------------------------------------------------------------------------------ state
    def full_state_items(self, dst: int | None = None) -> Iterator[tuple[str, torch.Tensor | None]]:
        """The single-device GenSLM state, one ``(name, tensor)`` at a time, on the CPU in fp32: ZeRO-3 parameters
        gathered one at a time, tensor-parallel pieces gathered (vocabulary padding removed), the position table
        assembled; the same names and shapes whatever the layout. On every rank, or (``dst``) only there: the other
        ranks get ``None`` tensors, or under pp > 1 nothing. Collective per tensor: every rank must consume it to the
        end (:func:`ds4sci.train.pipeline.pipeline_state_items` under pp > 1: stage by stage, point to point)."""
        import deepspeed

        keep = dst is None or self.rank == dst
        if self.dims.pp > 1:  # the first stage's sender (dst) sends the table with its parameters
            table = self.pos_table.gather(dst=dst) if self.pos_table is not None else None
            table = {"embed_pos.weight": table.float()} if table is not None else {}
            for k, v in pipeline_state_items(self.engine, self.groups, self.tp_plan, self.model_config.num_layers,
                                             table, dst=dst):
                yield k, v
            return
        zero3 = self.cfg.zero.stage == 3
        for k, v in self.engine.module.state_dict(keep_vars=True).items():
            with deepspeed.zero.GatheredParameters([v], enabled=zero3):  # this parameter whole, on the device
                full = gather_tensor_parallel({k: v.detach()}, self.groups, self.tp_plan)[k]
                value = full.float().cpu().clone() if keep else None
            yield k, value
        if self.pos_table is not None:
            table = self.pos_table.gather(dst=dst)
            yield "embed_pos.weight", table.float() if table is not None else None

    def full_state_dict(self, dst: int | None = None) -> dict[str, torch.Tensor]:
        """:meth:`full_state_items` as a dict (collective); ``{}`` on ranks other than ``dst``."""
        return {k: v for k, v in self.full_state_items(dst) if v is not None}

    @_bounded_collectives(lambda self: f"export ({self.out / 'export'})")
    def export(self) -> Path:
        """Write the consolidated export to ``train.out_dir/export`` (collective): rank 0 receives the tensors one
        at a time and writes each safetensors shard as it fills (:class:`ds4sci.io.export.ExportWriter`)."""
        from ds4sci.io.export import ExportWriter

        folder = self.out / "export"
        with writing("export", folder):
            writer = (ExportWriter(folder, self.model_config, self.tokenizer, trained_length=self.cfg.data.seq_len)
                      if self.rank == 0 else None)
        for name, tensor in self.full_state_items(dst=0):
            if writer is not None:
                with writing("export", folder):
                    writer.add(name, tensor)
        with writing("export", folder):
            return writer.close() if writer is not None else folder


def _duration(seconds: float) -> str:
    """``seconds`` as the log line's time left: ``42s``, ``3m05s`` or ``2h07m``."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _split_tokens(dataset) -> int:
    """Tokens of the split a dataset reads (its documents' lengths: overlapping windows count each token once)."""
    spans = getattr(dataset, "spans", None)  # WindowDataset, RecordDataset
    return int(spans.lengths.sum() if spans is not None else dataset._len.sum())  # PackedDataset: its pieces
