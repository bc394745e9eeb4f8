"""Training configuration: typed dataclasses loaded from YAML with ``--set key=value`` overrides.

Every key is checked: an unknown key, a wrong type or an impossible value raises ``ValueError`` naming the dotted
key and the value.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import get_type_hints

import yaml

from ds4sci.data.datasets import SPLITS
from ds4sci.distributed import ParallelDims
from ds4sci.models.genslm import GenSLMConfig
from ds4sci.models.genslm.config import describe_presets


def _field(*, help: str, path: bool = False, **kw):
    """A config field; ``help`` is its one-line description (``ds4sci train --print-config`` shows it), ``path``
    marks a path resolved against the config file's folder."""
    return field(metadata={"help": help, "path": path}, **kw)


#: The E. coli K-12 genome of a ds4sci source checkout (examples/data/), found from the package's own folder: the
#: default ``data.fasta``, so ``ds4sci train`` with no config runs from any working directory. An installation
#: without the repository's examples/ has no such file (the trainer then says how to start).
BUNDLED_GENOME = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                              "examples", "data", "NC_007779.1_ecoli_K12_W3110.fasta.gz")


@dataclass
class DataConfig:
    fasta: str | list = _field(default=BUNDLED_GENOME,
                    help="FASTA file, directory or glob pattern (.fa .fna .fasta .ffn, .gz ok), or a list of them; "
                         "relative: from the config file's folder (--set: working dir); default: the bundled E. coli "
                         "genome", path=True)
    tokenizer: str = _field(default="nucleotide",
                    help='"nucleotide" (one token per base) or "codon" (GenSLM\'s 69 ids)')
    dataset: str = _field(default="windows",
                    help='"windows" (long genomes), "records" (one gene per sample) '
                         'or "packed" (document-masked genes)')
    seq_len: int = _field(default=256, help='tokens per training sequence (divisible by the sequence-parallel degree)')
    stride: int = _field(default=0, help='window stride in tokens; 0 -> seq_len (non-overlapping windows)')
    val_fraction: float = _field(default=0.05,
                    help='held-out end of a genome / fraction of records for validation, in (0, 1)')
    split: str = _field(default="auto",
                    help='"region" (hold out the end of every record), "records" (whole records, by a hash of the '
                         'id: stable when files are added), "files" (whole source files, by a hash of the file\'s '
                         'basename, not its path: stable when files are added or the corpus folder moves; files '
                         'sharing a basename share a side) or "auto" (records from 5 / val_fraction records on, '
                         'if neither side is empty; else region)')
    cache_dir: str = _field(default="",
                    help='token cache folder (shared by runs and ranks: every rank must see it); "" -> '
                         'train.out_dir/token_cache; relative: like data.fasta', path=True)
    reverse_complement: float = _field(default=0.0,
                    help='probability of reverse-complementing a sample; nucleotide tokens only')
    iupac: str = _field(default="n",
                    help='what ambiguous IUPAC bases become when reading FASTA (see ds4sci.data.fasta)')
    max_train_tokens: int = _field(default=0, help='0 -> all; > 0 keeps only the first N training tokens (quick runs)')


@dataclass
class ModelConfig:
    preset: str = _field(default="debug", help=f"model shape (parameters with the nucleotide vocabulary): "
                         f"{describe_presets()} (unused with model.init_from: its config gives the shape)")
    overrides: dict = _field(default_factory=dict,
                    help='any GenSLMConfig field, e.g. {position_embedding: learned, num_layers: 4}')
    init_from: str = _field(default="",
                    help='fine-tune: start from the weights of a ds4sci export, a Hugging Face GPT-NeoX or Llama '
                         'directory or a .pt/.ckpt/.bin checkpoint (GenSLM\'s Lightning ones too); its config replaces '
                         'model.preset, model.overrides apply on top; "" -> a fresh model; relative: like data.fasta',
                    path=True)


@dataclass
class ParallelConfig:
    ulysses: int = _field(default=1,
                          help='Ulysses (all-to-all) sequence-parallel degree; tp x ulysses must divide the heads')
    ring: int = _field(default=1, help='ring-attention sequence-parallel degree')
    tp: int = _field(default=1,
                     help='tensor-parallel degree (Megatron-LM with sequence-parallel regions): splits heads, '
                          'MLP width and vocabulary; tp x ulysses must divide the heads, tp the MLP width')
    pp: int = _field(default=1, help="pipeline-parallel degree (DeepSpeed's pipeline engine, 1F1B; ZeRO stage 0 or 1)")
    dp: int = _field(default=0,
                    help='data-parallel degree; 0 -> what the world size leaves (world / (tp x ulysses x ring x pp)), '
                         '> 0 -> must be exactly that')
    layout: str = _field(default="auto",
                    help='"contiguous", "zigzag" or "auto" (zigzag when ring > 1: balances causal work)')
    allow_cross_node: bool = _field(default=False,
                    help='let tensor- and Ulysses-parallel groups span nodes (a warning instead of a refusal at '
                         'launch; their per-layer collectives then cross the network)')

    def _degrees(self) -> str:
        return (f"parallel.tp={self.tp!r}, parallel.ulysses={self.ulysses!r}, parallel.ring={self.ring!r}, "
                f"parallel.pp={self.pp!r}, parallel.dp={self.dp!r}, parallel.layout={self.layout!r}")

    def dims(self, world_size: int | None = None) -> ParallelDims:
        """The validated :class:`ParallelDims` of ``world_size`` processes (``None``: before launch, with
        ``dp`` as configured, 1 when it is 0). Errors name the ``parallel.*`` keys."""
        try:
            if isinstance(self.dp, bool) or not isinstance(self.dp, int) or self.dp < 0:
                raise ValueError(f"dp must be an integer >= 0 (0: what the world size leaves), got {self.dp!r}")
            degrees = dict(ulysses=self.ulysses, ring=self.ring, layout=self.layout, tp=self.tp, pp=self.pp)
            if world_size is None:
                return ParallelDims(dp=self.dp or 1, **degrees)
            dims = ParallelDims.for_world(world_size, **degrees)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{self._degrees()}: {err}") from None
        if self.dp and dims.dp != self.dp:
            raise ValueError(f"parallel.dp={self.dp}: the world size {world_size} with tp={self.tp} x ulysses="
                             f"{self.ulysses} x ring={self.ring} x pp={self.pp} leaves dp={dims.dp}; launch "
                             f"{self.dp * self.tp * self.ulysses * self.ring * self.pp} processes or set parallel.dp=0")
        return dims


OFFLOAD_DEVICES = ("none", "cpu", "nvme")
"""Where ZeRO-Offload / ZeRO-Infinity put optimizer state or parameters (DeepSpeed's ``OffloadDeviceEnum``)."""


@dataclass
class ZeroConfig:
    stage: int = _field(default=0, help='DeepSpeed ZeRO stage: 0, 1, 2 or 3 (over the sequence x data group)')
    offload_optimizer: str = _field(default="none",
                    help='ZeRO-Offload of optimizer state and step: "none", "cpu" or "nvme" (needs stage >= 1)')
    offload_param: str = _field(default="none",
                    help='ZeRO-Infinity parameter offload: "none", "cpu" or "nvme" (needs stage 3)')
    nvme_path: str = _field(default="", help='folder on an NVMe drive for "nvme" offload (DeepSpeed\'s async I/O op); '
                    'relative: like data.fasta; "" -> unset', path=True)
    pin_memory: bool = _field(default=True,
                    help='offload to page-locked CPU memory (fast GPU<->CPU copies; no effect without a GPU)')


ACTIVATION_CHECKPOINTING_MODES = ("none", "full", "selective")


@dataclass
class ActivationCheckpointingConfig:
    mode: str = _field(default="none",
                    help='"none", "full" (every GenSLM block recomputed in backward) or "selective" (only the '
                         'attention core; Korthikanti et al. 2022)')
    cpu: bool = _field(default=False,
                    help="keep the checkpointed inputs in host memory until backward: copied on a side stream, "
                    "fetched back one block ahead (ALST's activation offload; ds4sci.train.activation_offload)")
    tiled_mlp: bool = _field(default=False,
                    help="compute each block's MLP over tiles of mlp_tile tokens and recompute them tile by tile in "
                         "backward, so no [B, S/sp, intermediate] activation is kept (ALST's TiledMLP); with or "
                         "without mode=full/selective")
    # 1024 tokens: each tile's GEMMs keep 1024 rows per sequence (large matrix products, few launches), while the
    # live intermediate is 1024 x intermediate_size per sequence, 1/32 of the untiled one at 32K tokens per rank
    mlp_tile: int = _field(default=1024, help="tokens per tile of tiled_mlp, >= 1 (the last tile may be shorter)")
    tiled_loss: bool = _field(default=False,
                    help="compute the output projection and the cross entropy over tiles of loss_tile tokens and "
                         "recompute them tile by tile in backward, so no [B, S/sp, vocab] logits are kept (ALST's "
                         "tiled loss)")
    # 1024 tokens: at a 128K vocabulary one tile's bf16 logits, their fp32 log-softmax and its gradient are ~1.3 GiB
    # per sequence, 1/32 of the untiled ones at 32K tokens per rank; a 69-word codon vocabulary needs no smaller tile
    loss_tile: int = _field(default=1024, help="tokens per tile of tiled_loss, >= 1 (the last tile may be shorter)")


@dataclass
class OptimConfig:
    lr: float = _field(default=1e-3, help='peak AdamW learning rate (after warmup)')
    min_lr: float = _field(default=1e-4, help='learning rate at the end of the cosine decay, in [0, lr]')
    warmup_steps: int = _field(default=10, help='linear warmup steps')
    weight_decay: float = _field(default=0.01, help='AdamW weight decay')
    betas: tuple = _field(default=(0.9, 0.95), help='AdamW betas, two numbers in [0, 1)')
    eps: float = _field(default=1e-8, help='AdamW epsilon, > 0')
    grad_clip: float = _field(default=1.0, help='gradient-norm clip; 0 disables')


@dataclass
class TrainConfig:
    out_dir: str = _field(default="runs/train",
                    help='run folder (metrics, checkpoints, export); relative: like data.fasta', path=True)
    steps: int = _field(default=100, help='optimizer steps')
    micro_batch_size: int = _field(default=4, help='sequences per data-parallel rank per micro-step')
    grad_accum: int = _field(default=1, help='micro-steps accumulated per optimizer step')
    global_batch_size: int = _field(default=0, help='sequences per optimizer step; 0 -> micro_batch_size x dp x '
                    'grad_accum. Set, it gives grad_accum at each start (global_batch_size / (micro_batch_size '
                    'x dp)), so one command line keeps the batch when a restart has fewer processes (a lost '
                    'node under torchrun --nnodes MIN:MAX)')
    dtype: str = _field(default="fp32", help='"fp32" or "bf16"')
    seed: int = _field(default=1234, help='random seed (model init, data order)')
    log_every: int = _field(default=10,
                    help='log training metrics every N steps (metrics.jsonl, TensorBoard, a log line without a bar)')
    eval_every: int = _field(default=50, help='validate every N steps; 0 -> only at the end')
    eval_batches: int = _field(default=8, help='validation batches per evaluation, each of the global batch\'s '
                    'size (micro_batch_size x dp x grad_accum sequences)')
    save_every: int = _field(default=0, help='checkpoint every N steps; 0 -> only at the end')
    progress: bool = _field(default=True, help='a progress bar (training, token-cache build) when stderr is a '
                    'terminal; otherwise, or when false, one log line every log_every steps (step, loss, lr, '
                    'tokens/s, time left)')
    timeout_s: float = _field(default=1800.0,
                    help='seconds a collective (all-reduce, all-to-all, barrier) waits for the other ranks before the '
                         'run stops with an error: a rank that died or hangs cannot stall the others for longer')
    nonfinite: str = _field(default="stop",
                    help='a step whose loss is NaN or infinite: "stop" (error naming the step) or "skip" (no '
                         'parameter or optimizer-state update; the step counter and learning-rate schedule advance)')
    deterministic: bool = _field(default=False,
                    help='bitwise-reproducible runs on the same machine: torch.use_deterministic_algorithms (errors '
                         'on an op without a deterministic version), cuDNN autotuning off, CUBLAS_WORKSPACE_CONFIG')


@dataclass
class TaskConfig:
    kind: str = _field(default="", help='"" (language modelling: the default) or a fine-tuning task on labelled '
                       'records: "binary", "multiclass", "multilabel", "regression" or "token" (a class per token)')
    data: str | list = _field(default="", help='labelled records: FASTA with ">id label=..." headers, or a TSV/CSV '
                              'of id, sequence, label (optionally split); a list for several; relative: like '
                              'data.fasta', path=True)
    fasta: str = _field(default="", help='FASTA of the sequences when task.data is a label table keyed by id',
                        path=True)
    bed: str = _field(default="", help='BED intervals labelling the bases of task.data (kind token: 1 inside)',
                      path=True)
    classes: list = _field(default_factory=list, help='class names in logit order; [] -> sorted from the '
                           'train split (binary: 0, 1)')
    validation: float = _field(default=0.1, help='fraction of records for validation when no record names its split '
                               '(a hash of the id)')
    test: float = _field(default=0.1, help='fraction of records held out for the test split (metrics.json)')
    pooling: str = _field(default="mean", help='a sequence head\'s pooling: "mean" over real tokens, "last" token '
                          '(what transformers\' classifiers do: exportable) or "attention" (a learned pool)')
    method: str = _field(default="lora", help='"lora" (peft adapters + head trainable) or "full" (every weight)')
    lora_r: int = _field(default=8, help='LoRA rank')
    lora_alpha: float = _field(default=16.0, help='LoRA scale: the update is lora_alpha / lora_r x B A')
    lora_dropout: float = _field(default=0.0, help='dropout on the LoRA input')
    lora_targets: list = _field(default_factory=lambda: ["attention"], help='modules LoRA adapts: names '
                                '(query_key_value, dense, dense_h_to_4h, dense_h_to_4h_gate, dense_4h_to_h) or '
                                'groups attention, mlp')


@dataclass
class Config:
    data: DataConfig = _field(default_factory=DataConfig, help='training data and tokenization')
    model: ModelConfig = _field(default_factory=ModelConfig, help='GenSLM model shape')
    parallel: ParallelConfig = _field(default_factory=ParallelConfig,
                    help='parallel degrees (data parallelism takes the remaining processes unless dp is set)')
    zero: ZeroConfig = _field(default_factory=ZeroConfig,
                    help='DeepSpeed ZeRO stage and ZeRO-Offload / ZeRO-Infinity (optimizer state, parameters)')
    activation_checkpointing: ActivationCheckpointingConfig = _field(
                    default_factory=ActivationCheckpointingConfig,
                    help="recompute activations in backward (deepspeed.checkpointing), optionally kept on the CPU")
    optim: OptimConfig = _field(default_factory=OptimConfig, help='AdamW with linear warmup and cosine decay')
    train: TrainConfig = _field(default_factory=TrainConfig,
                    help='run length, batch, precision, logging and checkpoints')
    task: TaskConfig = _field(default_factory=TaskConfig,
                    help='fine-tuning on labelled records (ds4sci.train.finetune); off with kind ""')

    def genslm_config(self, vocab_size: int, pad_token_id: int, base: GenSLMConfig | None = None) -> GenSLMConfig:
        """The run's model: ``base`` (the config of ``model.init_from``'s weights) or else ``model.preset``, with the
        vocabulary and ``model.overrides`` on top, checked against ``data`` and ``parallel``."""
        names = [f.name for f in dataclasses.fields(GenSLMConfig)]
        for key in self.model.overrides:
            if key not in names:
                raise ValueError(f"unknown model.overrides key {key!r}{_suggest(key, names)}; GenSLMConfig fields: "
                                 f"{names}")
        over = {"vocab_size": vocab_size, "pad_token_id": pad_token_id, **self.model.overrides}
        if base is not None:
            over = {**base.to_dict(), **over}
        elif over.get("position_embedding") == "learned":
            # A learned table is as long as the context it is trained on; under sequence parallelism each rank holds
            # the rows of the window positions its tokens have, so the two must agree.
            over.setdefault("max_position_embeddings", self.data.seq_len)
        cfg = GenSLMConfig.from_dict(over) if base is not None else GenSLMConfig.preset(self.model.preset, **over)
        if cfg.max_position_embeddings < self.data.seq_len:
            raise ValueError(f"data.seq_len={self.data.seq_len} exceeds model max_position_embeddings="
                             f"{cfg.max_position_embeddings}")
        if (cfg.position_embedding == "learned" and self.parallel.dims().sp > 1
                and cfg.max_position_embeddings != self.data.seq_len):
            raise ValueError(f"model.overrides.max_position_embeddings={cfg.max_position_embeddings}: a sequence-"
                             f"partitioned learned table must have data.seq_len={self.data.seq_len} rows")
        if cfg.position_embedding == "learned" and self.parallel.dims().sp > 1 and self.data.dataset == "packed":
            raise ValueError(f"data.dataset={self.data.dataset!r}: a sequence-partitioned learned position table needs "
                             f"positions equal to window indices; use windows/records or rotary/alibi positions with "
                             f"packing")
        return cfg

    def validate(self) -> "Config":
        def check(ok: bool, key: str, value: Any, why: str):
            if not ok:
                raise ValueError(f"{key}={value!r}: {why}")

        d, p, t, o = self.data, self.parallel, self.train, self.optim
        check(d.tokenizer in ("nucleotide", "codon"), "data.tokenizer", d.tokenizer, "expected nucleotide or codon")
        check(d.dataset in ("windows", "records", "packed"), "data.dataset", d.dataset,
              "expected windows, records or packed")
        check(d.split in SPLITS, "data.split", d.split, f"expected {', '.join(SPLITS[:-1])} or {SPLITS[-1]}")
        check(d.seq_len >= 2, "data.seq_len", d.seq_len, "must be >= 2")
        check(0 <= d.stride <= d.seq_len, "data.stride", d.stride, f"must be in [0, seq_len={d.seq_len}]")
        check(0 < d.val_fraction < 1, "data.val_fraction", d.val_fraction, "must be in (0, 1)")
        check(0 <= d.reverse_complement <= 1, "data.reverse_complement", d.reverse_complement, "must be in [0, 1]")
        check(d.reverse_complement == 0 or d.tokenizer == "nucleotide", "data.reverse_complement",
              d.reverse_complement, "reverse complement breaks the reading frame of codon tokens")
        dims = p.dims()
        self._validate_zero_and_checkpointing(check)
        check(t.steps >= 1, "train.steps", t.steps, "must be >= 1")
        check(t.micro_batch_size >= 1, "train.micro_batch_size", t.micro_batch_size, "must be >= 1")
        check(t.grad_accum >= 1, "train.grad_accum", t.grad_accum, "must be >= 1")
        check(t.global_batch_size >= 0, "train.global_batch_size", t.global_batch_size,
              "must be >= 0 (0: micro_batch_size x dp x grad_accum)")
        check(t.dtype in ("fp32", "bf16"), "train.dtype", t.dtype, "expected fp32 or bf16")
        check(t.log_every >= 1, "train.log_every", t.log_every, "must be >= 1")
        check(o.lr > 0, "optim.lr", o.lr, "must be > 0")
        check(0 <= o.min_lr <= o.lr, "optim.min_lr", o.min_lr, f"must be in [0, lr={o.lr}]")
        check(o.grad_clip >= 0, "optim.grad_clip", o.grad_clip, "must be >= 0")
        check(t.eval_every >= 0, "train.eval_every", t.eval_every, "must be >= 0 (0: only at the end)")
        check(t.eval_batches >= 1, "train.eval_batches", t.eval_batches, "must be >= 1")
        check(t.save_every >= 0, "train.save_every", t.save_every, "must be >= 0 (0: only at the end)")
        check(t.timeout_s > 0, "train.timeout_s", t.timeout_s, "must be > 0 seconds")
        check(t.nonfinite in ("stop", "skip"), "train.nonfinite", t.nonfinite, "expected stop or skip")
        check(t.nonfinite == "stop" or p.pp == 1, "train.nonfinite", t.nonfinite,
              f"skip needs parallel.pp=1 (DeepSpeed's pipeline engine steps inside train_batch, before the loss is "
              f"known; got parallel.pp={p.pp})")
        check(d.max_train_tokens >= 0, "data.max_train_tokens", d.max_train_tokens, "must be >= 0 (0: all)")
        check(o.warmup_steps >= 0, "optim.warmup_steps", o.warmup_steps, "must be >= 0")
        check(o.weight_decay >= 0, "optim.weight_decay", o.weight_decay, "must be >= 0")
        check(o.eps > 0, "optim.eps", o.eps, "must be > 0")
        check(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "optim.betas", o.betas,
              "expected two numbers in [0, 1)")
        check(d.seq_len % dims.sequence_multiple == 0, "data.seq_len", d.seq_len,
              f"must be divisible by {dims.sequence_multiple} (tp={p.tp} x ulysses={p.ulysses} x ring={p.ring}, "
              f"layout {dims.layout.value})")
        if self.model.init_from:  # its config gives the model: checked when the trainer reads it (genslm_config)
            check(os.path.exists(self.model.init_from), "model.init_from", self.model.init_from,
                  "no such file or directory")
        else:
            self._validate_model(dims)
        if self.task.kind:
            self._validate_task(check)
        return self

    def _validate_task(self, check) -> None:
        """The ``task`` section of a fine-tuning run (``task.kind`` set)."""
        k, p = self.task, self.parallel
        kinds = ("binary", "multiclass", "multilabel", "regression", "token")
        check(k.kind in kinds, "task.kind", k.kind, f"expected {', '.join(kinds)} (or \"\": language modelling)")
        check(bool(k.data), "task.data", k.data, "a fine-tuning run needs labelled records")
        check(k.pooling in ("mean", "last", "attention"), "task.pooling", k.pooling, "expected mean, last or attention")
        check(k.method in ("lora", "full"), "task.method", k.method, "expected lora or full")
        check(k.lora_r >= 1, "task.lora_r", k.lora_r, "must be >= 1")
        check(0 <= k.lora_dropout < 1, "task.lora_dropout", k.lora_dropout, "must be in [0, 1)")
        check(p.tp == 1 and p.pp == 1, "parallel", f"tp={p.tp}, pp={p.pp}",
              "fine-tuning runs with data and sequence parallelism (ulysses, ring) only: set tp=1, pp=1")

    def _validate_model(self, dims) -> None:
        """``model.preset`` and ``model.overrides`` make a model this run can split."""
        p = self.parallel
        try:
            model = self.genslm_config(69, 3)  # preset and overrides valid (vocabulary filled in at run time)
        except (TypeError, ValueError) as err:
            raise ValueError(f"model (preset={self.model.preset!r}, overrides={self.model.overrides}): {err}") from None
        try:
            dims.check_model(num_heads=model.num_heads, num_kv_heads=model.num_kv_heads, num_layers=model.num_layers,
                             intermediate_size=model.intermediate_size)
        except ValueError as err:
            raise ValueError(f"parallel.tp={p.tp!r}, parallel.ulysses={p.ulysses!r}, "
                             f"parallel.pp={p.pp!r}: {err}") from None

    def _validate_zero_and_checkpointing(self, check) -> None:
        """The ``zero.*`` and ``activation_checkpointing.*`` rules DeepSpeed imposes, so a combination it cannot run
        fails here, not at step 1."""
        z, ac, p = self.zero, self.activation_checkpointing, self.parallel
        check(z.stage in (0, 1, 2, 3), "zero.stage", z.stage, "expected 0, 1, 2 or 3")
        for key in ("offload_optimizer", "offload_param"):
            check(getattr(z, key) in OFFLOAD_DEVICES, f"zero.{key}", getattr(z, key), "expected none, cpu or nvme")
        check(z.offload_optimizer == "none" or z.stage >= 1, "zero.offload_optimizer", z.offload_optimizer,
              f"offloading the optimizer needs ZeRO: zero.stage >= 1 (got zero.stage={z.stage})")
        check(z.offload_param == "none" or z.stage == 3, "zero.offload_param", z.offload_param,
              f"offloading parameters needs zero.stage=3, which partitions them (got zero.stage={z.stage})")
        check(z.offload_optimizer != "nvme" or z.stage == 3, "zero.offload_optimizer", z.offload_optimizer,
              f"NVMe optimizer offload needs zero.stage=3 (ZeRO-Infinity); at zero.stage={z.stage} DeepSpeed would "
              f"silently keep the state in CPU memory: use zero.offload_optimizer=cpu")
        nvme = [f"zero.{k}" for k in ("offload_optimizer", "offload_param") if getattr(z, k) == "nvme"]
        check(not nvme or bool(z.nvme_path), "zero.nvme_path", z.nvme_path,
              f"{' and '.join(nvme)}=nvme: NVMe offload needs zero.nvme_path, a folder on the NVMe drive")
        check(nvme or not z.nvme_path, "zero.nvme_path", z.nvme_path,
              "is set but nothing is offloaded to nvme (zero.offload_optimizer / zero.offload_param)")
        # DeepSpeed's pipeline engine asserts "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism".
        check(p.pp == 1 or z.stage <= 1, "zero.stage", z.stage,
              f"DeepSpeed's pipeline engine (parallel.pp={p.pp}) supports ZeRO stage 0 or 1 only")
        check(ac.mode in ACTIVATION_CHECKPOINTING_MODES, "activation_checkpointing.mode", ac.mode,
              "expected none, full or selective")
        check(not ac.cpu or ac.mode != "none", "activation_checkpointing.cpu", ac.cpu,
              "keeps checkpoints on the CPU, but activation_checkpointing.mode=none checkpoints nothing")
        check(ac.mlp_tile >= 1, "activation_checkpointing.mlp_tile", ac.mlp_tile,
              "must be >= 1 token (the tile of activation_checkpointing.tiled_mlp)")
        check(ac.loss_tile >= 1, "activation_checkpointing.loss_tile", ac.loss_tile,
              "must be >= 1 token (the tile of activation_checkpointing.tiled_loss)")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self, comments: bool = True) -> str:
        """The resolved config as YAML (what ``ds4sci train --print-config`` prints and the trainer writes to
        ``out_dir/config.yaml``; loads back equal). ``comments``: each key's description as a YAML comment."""
        data = self.to_dict()
        data["optim"]["betas"] = list(data["optim"]["betas"])
        if not comments:
            return yaml.safe_dump(data, sort_keys=False)
        lines = []
        for section in dataclasses.fields(self):
            lines.append(f"{section.name}:  # {section.metadata['help']}")
            for f in dataclasses.fields(getattr(self, section.name)):
                value = data[section.name][f.name]
                text = yaml.safe_dump({f.name: value}, default_flow_style=False, sort_keys=False, width=1 << 30)
                text = text.rstrip("\n")
                if "\n" in text:  # a nested mapping or list: one line in flow style (JSON is YAML)
                    text = f"{f.name}: {json.dumps(value)}"
                lines.append(f"  {text}  # {f.metadata['help']}")
        return "\n".join(lines) + "\n"


def known_keys() -> list[str]:
    """Every dotted config key (``data.fasta``, ..., ``train.progress``)."""
    hints = get_type_hints(Config)
    return [f"{s.name}.{f.name}" for s in dataclasses.fields(Config) for f in dataclasses.fields(hints[s.name])]


def _suggest(key: str, candidates: list[str]) -> str:
    """`` (did you mean 'x'?)`` for the nearest of ``candidates`` to ``key``, or ``""``."""
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    if not close:  # a section left out or misplaced: match the last part against the leaf names
        leaf = key.rsplit(".", 1)[-1]
        close = [c for c in candidates if c.rsplit(".", 1)[-1] in
                 difflib.get_close_matches(leaf, [c.rsplit(".", 1)[-1] for c in candidates], n=1, cutoff=0.8)][:1]
    return f" (did you mean {close[0]!r}?)" if close else ""


def _coerce(value: Any, typ: Any, key: str) -> Any:
    origin = getattr(typ, "__origin__", None)
    if typ is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        if isinstance(value, bool):
            return value
    elif typ is int:
        if isinstance(value, bool):
            raise ValueError(f"{key}={value!r}: expected an integer")
        try:
            return int(value) if float(value) == int(float(value)) else _fail(key, value, "an integer")
        except (TypeError, ValueError):
            _fail(key, value, "an integer")
    elif typ is float:
        if isinstance(value, bool):  # float(True) would be 1.0
            _fail(key, value, "a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            _fail(key, value, "a number")
    elif typ is str:
        return str(value)
    elif typ == (str | list):  # data.fasta: one path or pattern, or a non-empty list of them
        if isinstance(value, str):
            return value
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
            return list(value)
        _fail(key, value, "a path or a non-empty list of paths")
    elif typ is tuple or origin is tuple:
        if isinstance(value, str):
            value = _parse_yaml(value, key)
        if isinstance(value, (list, tuple)):
            return tuple(float(v) for v in value)
    elif typ is list:  # task.classes, task.lora_targets: names
        if isinstance(value, str):
            value = _parse_yaml(value, key)
        if isinstance(value, (list, tuple)) and all(isinstance(v, (str, int)) for v in value):
            return [str(v) for v in value]
    elif typ is dict or origin is dict:
        if isinstance(value, str):
            value = _parse_yaml(value, key)
        if isinstance(value, dict):
            return value
    _fail(key, value, getattr(typ, "__name__", str(typ)))


def _fail(key: str, value: Any, what: str):
    raise ValueError(f"{key}={value!r}: expected {what}")


def _parse_yaml(text, where: str) -> Any:
    """``yaml.safe_load`` of a config file's stream or a ``--set`` value; a syntax error becomes one ValueError naming
    ``where`` (the file or the key) and yaml's line and column."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"{where}: not valid YAML{at}: {problem}") from None


def _apply(obj: Any, data: dict, prefix: str, base_dir: str | None = None) -> None:
    """Set ``data``'s keys on ``obj``; a path-valued key's relative value is joined to ``base_dir`` when given."""
    hints = get_type_hints(type(obj))
    fields = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            everything = known_keys() + [f.name for f in dataclasses.fields(Config)]
            raise ValueError(f"unknown config key {dotted!r}{_suggest(dotted, everything)}; known: "
                             f"{sorted(prefix + n for n in fields)}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ValueError(f"{dotted} must be a mapping, got {value!r}")
            _apply(current, value, dotted + ".", base_dir)
        else:
            value = _coerce(value, hints[key], dotted)
            if fields[key].metadata.get("path") and base_dir is not None and value:  # "": unset, not "here"
                value = _resolve(value, base_dir)
            setattr(obj, key, value)


def _resolve(path: str, base_dir: str) -> str:
    """``path`` as an absolute, normalized path (a relative one is taken from ``base_dir``; ``~`` expanded); a list
    of paths (``data.fasta``), each."""
    if isinstance(path, list):
        return [_resolve(p, base_dir) for p in path]
    if not path:  # "": an unset optional path (data.cache_dir) stays unset
        return path
    path = os.path.expanduser(path)
    return os.path.normpath(os.path.join(os.path.abspath(base_dir), path))


def _resolve_all(cfg: Config, base_dir: str) -> None:
    for section in dataclasses.fields(cfg):
        part = getattr(cfg, section.name)
        for f in dataclasses.fields(part):
            if f.metadata.get("path") and getattr(part, f.name):  # "": an unset optional path stays unset
                setattr(part, f.name, _resolve(getattr(part, f.name), base_dir))


def load_config(path: str | os.PathLike | None = None, overrides: list[str] = ()) -> Config:
    """Config from a YAML file (or defaults) plus ``key=value`` overrides with dotted keys
    (``train.steps=10``, ``model.overrides.position_embedding=learned``).

    Path-valued keys (``data.fasta``, ``train.out_dir``) come back absolute: a relative path in the YAML file is
    taken from that file's folder; one given in ``overrides`` or left at its default, from the working directory."""
    cfg = Config()
    if path is not None:
        with open(path, encoding="utf-8") as f:
            data = _parse_yaml(f, str(path)) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
        _apply(cfg, data, "", base_dir=os.path.dirname(os.path.abspath(path)))
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set expects key=value, got {item!r}")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) >= 3 and parts[0] == "model" and parts[1] == "overrides":
            cfg.model.overrides[".".join(parts[2:])] = _parse_yaml(raw, f"--set {key.strip()}")
            continue
        nested: dict = {}
        node = nested
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = _parse_yaml(raw, f"--set {key.strip()}") if raw.strip() else raw
        _apply(cfg, nested, "")
    _resolve_all(cfg, os.getcwd())
    return cfg.validate()
