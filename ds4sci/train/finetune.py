"""Fine-tuning a GenSLM on labelled records: the trainer of a run whose config has a ``task:`` section
(``ds4sci train CONFIG`` with ``task.kind`` set; one command for language modelling and tasks, so run folders,
``--resume``, ``--overwrite``, launchers and cluster templates are the same).

:class:`FineTuner` is a :class:`~ds4sci.train.trainer.Trainer` with other data (labelled records,
:mod:`ds4sci.data.labels`, as :class:`~ds4sci.data.task_records.TaskRecords`), another model (the GenSLM of
``model.init_from`` with a task head, :class:`~ds4sci.models.genslm.task.GenSLMForTask`; LoRA adapters through
peft with ``task.method=lora``), another loss (:func:`~ds4sci.models.genslm.task.task_loss`) and evaluation (the
metrics of :mod:`ds4sci.data.metrics` at every evaluation; the test split's in ``metrics.json`` at the end); steps,
checkpoints, resume and logs are the trainer's.

Parallelism: data and sequence parallelism (Ulysses, ring) with ZeRO 0-3. Under sequence parallelism a record's
tokens are sharded as in pre-training; pooled heads reduce over the shards (:mod:`ds4sci.sequence.pooling`) and
each shard's loss is ``1 / sp`` of the record's, so the gradients equal one process's. The whole backbone is built on
every rank before ZeRO partitions it (fine-tuning starts from existing weights; the LM trainer's meta-device
drawing is for pre-training sizes). Learned position tables stay whole in the model. Frozen weights (LoRA's base,
the unused LM output projection) are not checkpointed: a resumed run reads them from ``model.init_from`` again.
"""
from __future__ import annotations

import json
import math

import numpy as np
import torch
import torch.distributed as dist

from ds4sci.data import Tokenizer
from ds4sci.data import collate
from ds4sci.data.task_records import IGNORE_INDEX
from ds4sci.data.task_records import TaskRecords
from ds4sci.data.task_records import unlabelled
from ds4sci.models.genslm import GenSLMForTask
from ds4sci.models.genslm import TaskSpec
from ds4sci.models.genslm import task_loss
from ds4sci.parallel.parallelize import materialize_
from ds4sci.parallel.parallelize import parallelize
from ds4sci.sequence import DistributedAttention
from ds4sci.sequence import shard_sequence
from ds4sci.sequence.pooling import ShardReduction
from ds4sci.sequence.pooling import sequence_share
from ds4sci.train.activation_checkpointing import apply_activation_checkpointing
from ds4sci.train.data_order import train_samples
from ds4sci.train.engine import build_engine
from ds4sci.train.engine import writing
from ds4sci.train.init_from import initial_model
from ds4sci.train.lora import LoraSpec
from ds4sci.train.lora import apply_lora
from ds4sci.train.trainer import Trainer


def peft_name(name: str) -> str:
    """An engine parameter name of an adapter -> peft's saved name:
    ``model.layers.0.attention.dense.lora_A.default.weight`` -> ``layers.0.attention.dense.lora_A.weight``."""
    return name.removeprefix("model.").replace(".default.", ".")


def _no_nan(value):
    """``value`` with every NaN (a metric undefined on the data) as None, JSON's null."""
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    return None if isinstance(value, float) and math.isnan(value) else value


class FineTuner(Trainer):
    """The trainer of a ``task:`` run (see the module docstring). ``test_ds``: the test split."""

    # ------------------------------------------------------------------------------------------------- set-up
    def _load_data(self) -> tuple:
        from ds4sci.data.labels import LabelSource
        from ds4sci.data.labels import read_labelled

        k, seq_len = self.cfg.task, self.cfg.data.seq_len
        tokenizer = Tokenizer.from_name(self.cfg.data.tokenizer)
        paths = [k.data] if isinstance(k.data, str) else k.data
        sources = [LabelSource(path, fasta=k.fasta or None, bed=k.bed or None) for path in paths]
        data = read_labelled(sources, k.kind, classes=k.classes or None, validation=k.validation, test=k.test)
        stats = data.standardisation() if k.kind == "regression" else ((), ())
        self.spec = TaskSpec(k.kind, num_labels=len(data.classes), pooling=k.pooling, labels=tuple(data.classes),
                             target_mean=tuple(float(v) for v in stats[0]),
                             target_std=tuple(float(v) for v in stats[1]))
        self.lora = (LoraSpec(k.lora_r, k.lora_alpha, k.lora_dropout, tuple(k.lora_targets)) if k.method == "lora"
                     else None)

        def split(name: str) -> TaskRecords:
            return TaskRecords([(r.id, r.sequence, r.target) for r in data.split(name)], tokenizer, seq_len, k.kind)

        self.test_ds = split("test")
        train, val = split("train"), split("validation")
        if not len(val):
            raise ValueError(f"task.data: the validation split is empty ({data.split_rule}); raise task.validation or "
                             f"name a validation split")
        return tokenizer, train, val, f"{data.split_rule}: {len(train)} train, {len(val)} validation, " \
                                      f"{len(self.test_ds)} test records"

    def _build_model(self) -> None:
        cfg = self.cfg
        backbone = initial_model(cfg, self.tokenizer, device="meta")
        self.model_config = backbone.config
        parallelize(backbone, self.groups, keep_position_table=True)
        materialize_(backbone, None, self.groups)  # the whole backbone, from model.init_from (or drawn)
        backbone.init_source = None
        self._unchecked_shapes = [m for m in backbone.modules() if isinstance(m, DistributedAttention)]
        if self.lora is not None:
            apply_lora(backbone, self.lora)
        model = GenSLMForTask(backbone, self.spec)
        model.head.reduction = ShardReduction(self.groups.sp)
        apply_activation_checkpointing(backbone, cfg.activation_checkpointing, self.device)
        self.num_parameters = sum(p.numel() for p in model.parameters())
        self.trainable_parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.tp_plan, self.loss_fn, self.pos_table = {}, None, None
        self.engine = build_engine(model, cfg, self.groups, self.device)

    # ---------------------------------------------------------------------------------------------------- data
    def _micro_batch(self, dataset, index: int, shuffle: bool) -> dict[str, torch.Tensor]:
        """Global micro-batch ``index`` (the records :meth:`Trainer._micro_batch` would pick), this sequence rank's
        shard of the tokens. ``targets`` counts what the loss averages over: the labelled tokens of a token task, or
        one per labelled record on sequence shard 0 (so the records are counted once)."""
        t, d, g = self.cfg.train, self.dims, self.groups
        n = len(dataset)
        if shuffle:
            if n < t.micro_batch_size * d.dp * t.grad_accum:
                raise ValueError(f"the training split has {n} records, fewer than one global batch of "
                                 f"{t.micro_batch_size * d.dp * t.grad_accum}")
            _, positions = train_samples(t.seed, n, index, t.micro_batch_size, d.dp, t.grad_accum, g.dp_rank)
            samples = [dataset[int(i)] for i in positions]
        else:
            first = index * t.micro_batch_size * d.dp + g.dp_rank * t.micro_batch_size
            samples = [dataset[i] if i < n else unlabelled(dataset[0])
                       for i in range(first, first + t.micro_batch_size)]
        batch = collate(samples)
        B, T = batch["input_ids"].shape  # records, tokens
        batch["position_ids"] = torch.arange(T).expand(B, T).contiguous()
        per_token = self.spec.per_token
        sharded = ["input_ids", "mask", "position_ids"] + (["labels"] if per_token else [])
        out = {k: shard_sequence(batch[k], 1, g.sp_rank, d.sp, d.layout).to(self.device) for k in sharded}
        if per_token:
            out["targets"] = out["labels"]
        else:
            labels = batch["labels"]
            real = ~torch.isnan(labels).any(-1) if labels.is_floating_point() else labels != IGNORE_INDEX
            counted = real & (g.sp_rank == 0)
            out["labels"] = labels.to(self.device)
            out["targets"] = torch.where(counted, 0, IGNORE_INDEX).to(self.device)
        return out

    def _logits_and_sum(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.engine(batch["input_ids"], batch["position_ids"], batch["mask"])
        self._shapes_checked()
        local_sum, _ = task_loss(logits, batch["labels"], self.spec)
        if not self.spec.per_token:  # every shard computes the record's loss: each counts 1 / sp of it
            local_sum = local_sum * sequence_share(self.groups.sp)
        return logits, local_sum

    def _forward_sum(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        _, local_sum = self._logits_and_sum(batch)
        return local_sum, (batch["targets"] != IGNORE_INDEX).sum()

    def step_tokens(self, batches: list[dict], count: torch.Tensor) -> int:
        """The real (unpadded) input tokens of a step over every rank, each once: a pooled head's ``count`` is
        records (collective)."""
        return int(self._all_sum(sum(b["mask"].sum() for b in batches)).item())

    # ------------------------------------------------------------------------------------------------ evaluate
    @torch.no_grad()
    def evaluate(self, dataset=None, prefix: str = "val") -> dict[str, float]:
        """Loss and metrics (:func:`ds4sci.data.metrics.task_metrics`) over ``dataset`` (the validation split:
        its first ``eval_batches`` global batches; any other: all of it), keys prefixed ``{prefix}_``
        (collective)."""
        from ds4sci.data.metrics import task_metrics

        t = self.cfg.train
        whole = dataset is not None
        dataset = self.val_ds if dataset is None else dataset
        per_micro = t.micro_batch_size * self.dims.dp
        n_batches = math.ceil(len(dataset) / per_micro)
        if not whole:
            n_batches = min(t.eval_batches * t.grad_accum, n_batches)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        count = torch.zeros((), dtype=torch.float64, device=self.device)
        ys, scores = [], []
        self.engine.eval()
        for i in range(n_batches):
            b = self._micro_batch(dataset, i, shuffle=False)
            logits, local_sum = self._logits_and_sum(b)
            total += local_sum.double()
            count += (b["targets"] != IGNORE_INDEX).sum()
            keep = b["targets"] != IGNORE_INDEX  # labelled records (shard 0) or tokens
            ys.append(b["labels"][keep].cpu().numpy())
            scores.append(self.spec.predictions(logits)[keep].cpu().numpy())
        self.engine.train()
        total, count = self._all_sum(total), self._all_sum(count)
        every = [None] * dist.get_world_size(self.groups.sdp)
        dist.all_gather_object(every, (np.concatenate(ys), np.concatenate(scores)), group=self.groups.sdp)
        y = np.concatenate([e[0] for e in every])
        score = np.concatenate([e[1] for e in every])
        if self.spec.kind == "binary" or (self.spec.per_token and self.spec.num_labels == 2):
            score = score[:, 1]  # the probability of class 1
        metrics = task_metrics(self.spec.kind, y, score, self.spec.labels)
        return {f"{prefix}_loss": (total / count).item(), **{f"{prefix}_{k}": v for k, v in metrics.items()}}

    def describe_validation(self, record: dict) -> str:
        main = [k for k in ("val_auroc", "val_pearson") if k in record]
        return f"validation loss {record['val_loss']:.4f}" + "".join(f", {k[4:]} {record[k]:.4f}" for k in main)

    # ------------------------------------------------------------------------------------------------ the end
    def train(self) -> list[dict]:
        """Train (:meth:`Trainer.train`), then evaluate the test split and write ``metrics.json``: the last
        validation's and the test split's metrics, the trainable and total parameter counts."""
        records = super().train()
        test = self.evaluate(self.test_ds, "test") if len(self.test_ds) else {}
        last = next((r for r in reversed(records) if "val_loss" in r), {})
        if self.rank == 0:
            summary = {"task": self.spec.to_dict(), "method": self.cfg.task.method, "step": self.step,
                       "trainable_parameters": self.trainable_parameters, "parameters": self.num_parameters,
                       "validation": {k[4:]: v for k, v in last.items() if k.startswith("val_")},
                       "test": {k[5:]: v for k, v in test.items()}}
            with writing("end of training", self.out / "metrics.json"):
                (self.out / "metrics.json").write_text(json.dumps(_no_nan(summary), indent=1, allow_nan=False))
        return records

    def export(self):
        """Write the task model to ``train.out_dir/export`` (:mod:`ds4sci.io.task_model`; collective)."""
        from ds4sci.io.export import ExportWriter
        from ds4sci.io.task_model import write_task_files

        folder = self.out / "export"
        full = self.lora is None
        with writing("export", folder):
            writer = ExportWriter(folder, self.model_config, self.tokenizer) if self.rank == 0 and full else None
        head, adapter = {}, {}
        for name, tensor in self.full_state_items(dst=0):
            if tensor is None:
                continue
            if name.startswith("head."):
                head[name.removeprefix("head.")] = tensor
            elif ".lora_" in name:
                adapter[peft_name(name)] = tensor
            elif writer is not None:
                with writing("export", folder):
                    writer.add(name.removeprefix("model."), tensor)
        if self.rank == 0:
            with writing("export", folder):
                if writer is not None:
                    writer.close()
                write_task_files(folder, self.spec, head, self.lora, self.cfg.model.init_from or None,
                                 adapter if not full else None)
        return folder

    def summary(self) -> str:
        k, t, dims = self.cfg.task, self.cfg.train, self.dims
        method = (f"LoRA r={k.lora_r} alpha={k.lora_alpha} on {', '.join(k.lora_targets)}" if self.lora else
                  "full fine-tuning")
        rows = [("run folder", str(self.out)),
                ("model", f"{self.cfg.model.init_from or 'a fresh ' + self.cfg.model.preset} + {k.kind} head "
                          f"({self.spec.num_labels} outputs, {k.pooling} pooling)"),
                ("method", f"{method}: {self.trainable_parameters:,} of {self.num_parameters:,} parameters trained"),
                ("data", self.split),
                ("layout", f"dp {dims.dp} x ulysses {dims.ulysses} x ring {dims.ring}, ZeRO stage "
                           f"{self.cfg.zero.stage}, {t.dtype}"),
                ("batch", f"{t.micro_batch_size} x {dims.dp} x {t.grad_accum} records per step; steps "
                          f"{self.step + 1}..{t.steps}")]
        return "\n".join(["ds4sci train (fine-tuning)"] + [f"  {name:<11} {text}" for name, text in rows])
