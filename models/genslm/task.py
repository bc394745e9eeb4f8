"""Task heads on a GenSLM: sequence classification (binary, multi-class, multi-label), regression on standardised
targets, and token classification (one label per token: per base with nucleotide tokens, per codon with codon
tokens), for fine-tuning a genome LM on labelled records.

:class:`GenSLMForTask` holds the language model as ``model`` and the head as ``head`` (transformers' naming for
``LlamaForSequenceClassification``'s ``model`` / ``score``), reading the final normalised hidden states; the LM's
own output projection is not used. A sequence head first pools the record's real (non-padding) tokens into one vector:
``mean`` over them, the ``last`` one (what transformers' ``*ForSequenceClassification`` do), or a learned
``attention`` pool (a softmax over the tokens of a learned score, Ilse et al. 2018, "Attention-based deep multiple
instance learning"), then a bias-free linear ``score``.

Pooling is written as sums and maxima over the sequence, taken through :attr:`TaskHead.reduction`: on one device
(:class:`LocalReduction`) they are plain; under sequence parallelism the trainer sets a reduction over the sequence
group from outside (``ds4sci.sequence.pooling.ShardReduction``), so the pooled vector of a record split across ranks
equals one process's exactly (the softmax's maximum is only a shift, so it needs no gradient). Module code stays for
one device: the model imports no ``torch.distributed``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch import nn

from ds4sci.models.genslm.model import IGNORE_INDEX
from ds4sci.models.genslm.model import GenSLM

TASK_KINDS = ("binary", "multiclass", "multilabel", "regression", "token")
POOLINGS = ("mean", "last", "attention")


@dataclass(frozen=True)
class TaskSpec:
    """What a head predicts.

    ``kind``: ``binary`` (two classes, softmax over two logits, as transformers' ``num_labels=2``), ``multiclass``
    (``num_labels`` classes, softmax), ``multilabel`` (``num_labels`` independent yes/no labels, sigmoid),
    ``regression`` (``num_labels`` real targets, trained standardised: ``(y - target_mean) / target_std``, the
    training split's), ``token`` (``num_labels`` classes per token, softmax). ``pooling``: ``mean``, ``last`` or
    ``attention`` (sequence kinds only). ``labels``: the class names, in logit order (empty: their indices).
    """

    kind: str
    num_labels: int = 2
    pooling: str = "mean"
    labels: tuple[str, ...] = ()
    target_mean: tuple[float, ...] = ()
    target_std: tuple[float, ...] = ()

    def __post_init__(self):
        if self.kind not in TASK_KINDS:
            raise ValueError(f"task.kind={self.kind!r}: expected one of {', '.join(TASK_KINDS)}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"task.pooling={self.pooling!r}: expected one of {', '.join(POOLINGS)}")
        if self.kind == "binary" and self.num_labels != 2:
            raise ValueError(f"task.num_labels={self.num_labels}: a binary task has 2 (two logits, as transformers)")
        least = 2 if self.kind in ("multiclass", "token") else 1
        if self.num_labels < least:
            raise ValueError(f"task.num_labels={self.num_labels}: a {self.kind} task needs at least {least}")
        if self.labels and len(self.labels) != self.num_labels:
            raise ValueError(f"task.labels has {len(self.labels)} names for num_labels={self.num_labels}")
        if self.kind == "regression" and self.target_std:
            if len(self.target_mean) != self.num_labels or len(self.target_std) != self.num_labels:
                raise ValueError(f"target_mean / target_std need {self.num_labels} values each")
            if not all(s > 0 and math.isfinite(s) for s in self.target_std):
                raise ValueError(f"target_std={list(self.target_std)}: every target needs a positive spread")

    @property
    def per_token(self) -> bool:
        return self.kind == "token"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TaskSpec:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ValueError(f"unknown task field(s) {unknown}; expected {sorted(fields)}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})

    def standardize(self, y: Tensor) -> Tensor:
        """Regression targets ``[..., num_labels]`` -> standardised (identity before the statistics are set)."""
        if not self.target_std:
            return y
        return (y - y.new_tensor(self.target_mean)) / y.new_tensor(self.target_std)

    def predictions(self, logits: Tensor) -> Tensor:
        """Head outputs -> what a user reads, in fp32: class probabilities (softmax; multi-label: each label's sigmoid)
        or regression values in the targets' own units. ``[B, L]`` (or ``[B, T, L]``) in and out."""
        logits = logits.float()
        if self.kind == "multilabel":
            return torch.sigmoid(logits)
        if self.kind == "regression":
            if not self.target_std:
                return logits
            return logits * logits.new_tensor(self.target_std) + logits.new_tensor(self.target_mean)
        return torch.softmax(logits, dim=-1)


class LocalReduction:
    """Sums and maxima over the sequence dimension's shards: on one device there is one shard, so both are the
    identity. ``sum`` must be differentiable; ``max`` need not be (it only shifts a softmax)."""

    def sum(self, x: Tensor) -> Tensor:
        return x

    def max(self, x: Tensor) -> Tensor:
        return x


class TaskHead(nn.Module):
    """``forward(hidden [B, T, hidden], mask [B, T] bool (real tokens), position_ids [B, T])`` -> logits ``[B,
    num_labels]`` (sequence kinds) or ``[B, T, num_labels]`` (``token``), in ``hidden``'s dtype.

    Parameters: ``score`` (``Linear(hidden, num_labels)``, bias-free for sequence kinds as in transformers'
    ``*ForSequenceClassification``, with a bias for ``token`` as in its ``*ForTokenClassification``) and, for the
    attention pool, ``pool`` (``Linear(hidden, 1)``: each token's score). :attr:`reduction` (see the module docstring)
    is set from outside under sequence parallelism.

    Raises:
        ValueError: a record without a real token.
    """

    def __init__(self, hidden_size: int, spec: TaskSpec, init_std: float = 0.02,
                 device: torch.device | str | None = None):
        super().__init__()
        self.spec = spec
        self.pool = nn.Linear(hidden_size, 1, device=device) if spec.pooling == "attention" and not spec.per_token \
            else None
        self.score = nn.Linear(hidden_size, spec.num_labels, bias=spec.per_token, device=device)
        with torch.no_grad():
            for linear in (self.pool, self.score):
                if linear is not None:
                    linear.weight.normal_(0.0, init_std)
                    if linear.bias is not None:
                        linear.bias.zero_()
        self.reduction = LocalReduction()

    def forward(self, hidden: Tensor, mask: Tensor, position_ids: Tensor) -> Tensor:
        if self.spec.per_token:
            return self.score(hidden)  # [B, T, L]
        return self.score(self.pooled(hidden, mask, position_ids))  # [B, L]

    def pooled(self, hidden: Tensor, mask: Tensor, position_ids: Tensor) -> Tensor:
        """The record vectors ``[B, hidden]``, reduced over every shard of each record."""
        red = self.reduction
        m = mask.to(hidden.dtype).unsqueeze(-1)  # [B, T, 1]
        count = red.sum(m.sum(1))  # [B, 1]: real tokens of each record, all shards
        if bool((count == 0).any()):
            raise ValueError("a record has no real token to pool (an empty sequence?)")
        if self.spec.pooling == "mean":
            return red.sum((hidden * m).sum(1)) / count  # [B, hidden]
        if self.spec.pooling == "last":
            local = torch.where(mask, position_ids, -1).amax(1)  # [B]: this shard's last real position, or -1
            last = red.max(local)  # [B]: the record's last real position
            pick = (mask & (position_ids == last.unsqueeze(1))).to(hidden.dtype).unsqueeze(-1)  # [B, T, 1]
            return red.sum((hidden * pick).sum(1))  # [B, hidden]: only the shard holding it contributes
        wide = torch.promote_types(hidden.dtype, torch.float32)  # the softmax in fp32 at least
        scores = self.pool(hidden).squeeze(-1).to(wide).masked_fill(~mask, -math.inf)  # [B, T]
        top = red.max(scores.detach().amax(1))  # [B]: the softmax's shift, the same on every shard
        weights = torch.exp(scores - top.unsqueeze(1))  # [B, T], 0 at padding
        total = red.sum(weights.sum(1, keepdim=True))  # [B, 1]
        summed = red.sum((weights.unsqueeze(-1) * hidden.to(wide)).sum(1))  # [B, hidden]
        return (summed / total).to(hidden.dtype)


class GenSLMForTask(nn.Module):
    """A GenSLM (``model``) with a task head (``head``): ``forward(input_ids [B, T], position_ids [B, T], mask [B, T]
    bool, **model_kwargs)`` -> logits ``[B, L]`` or ``[B, T, L]`` (see :class:`TaskHead`). ``model_kwargs`` go to
    :meth:`GenSLM.forward` (``position_embeds`` under sequence parallelism). The LM's output projection
    (``model.embed_out``) is frozen and unused, unless tied to the input embedding."""

    def __init__(self, model: GenSLM, spec: TaskSpec, device: torch.device | str | None = None):
        super().__init__()
        self.model = model
        self.head = TaskHead(model.config.hidden_size, spec, model.config.init_std, device=device)
        if not model.config.tie_word_embeddings:
            model.embed_out.weight.requires_grad_(False)

    @property
    def spec(self) -> TaskSpec:
        return self.head.spec

    def forward(self, input_ids: Tensor, position_ids: Tensor, mask: Tensor, **model_kwargs) -> Tensor:
        hidden = self.model(input_ids, position_ids, return_hidden=True, **model_kwargs)  # [B, T, hidden]
        return self.head(hidden, mask, position_ids)


def task_loss(logits: Tensor, labels: Tensor, spec: TaskSpec) -> tuple[Tensor, Tensor]:
    """``(summed loss, count)`` in fp32 of a batch's head outputs against its labels: the loss summed over the
    labelled records (tokens for ``token``), and how many there are, so that a global mean is ``sum / count`` over
    every shard and rank.

    ``labels``: class ids ``[B]`` (binary, multi-class; -100: no label), ``[B, T]`` (token; -100: none), or floats
    ``[B, L]`` (multi-label 0/1, regression in the targets' units; NaN rows: no label). A record's multi-label or
    regression loss is the mean over its ``L`` labels (binary cross entropy, squared error of standardised targets).
    """
    logits = logits.float()
    if spec.kind in ("binary", "multiclass", "token"):
        flat = labels.reshape(-1)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), flat, ignore_index=IGNORE_INDEX,
                               reduction="sum")
        return loss, (flat != IGNORE_INDEX).sum().float()
    real = ~torch.isnan(labels).any(-1)  # [B]
    y = torch.where(real.unsqueeze(-1), labels.float(), torch.zeros_like(labels, dtype=torch.float32))
    if spec.kind == "multilabel":
        per = F.binary_cross_entropy_with_logits(logits, y, reduction="none")  # [B, L]
    else:
        per = (logits - spec.standardize(y)).pow(2)  # [B, L]
    return (per.mean(-1) * real).sum(), real.sum().float()
