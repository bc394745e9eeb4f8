"""A linear probe (``ds4sci probe``): a regularised linear model fitted on a frozen model's embeddings, the cheap
baseline a fine-tune is compared with.

Features come from :mod:`ds4sci.infer.embed` (not recomputed here): a record's ``mean`` state over its tokens
(:func:`~ds4sci.infer.embed.embed_records`) or its ``last`` token's state, of the final norm or block ``layer``; for a
per-base (``token``) task every token's state, which needs one token per base (a nucleotide model).

Estimators (scikit-learn), each after standardising the features over the train split:

- classification (binary, multiclass, token): ``LogisticRegressionCV``, the inverse regularisation ``C`` chosen
  from ``10^-3 .. 10^3`` by stratified ``folds``-fold cross-validation on the train split (log loss), an L2 penalty;
- multilabel: one such model per label;
- regression: ``RidgeCV``, ``alpha`` from ``10^-3 .. 10^5`` by efficient leave-one-out cross-validation, on targets
  standardised with the train split's statistics (:meth:`~ds4sci.data.labels.LabelledData.standardisation`);
  predictions are mapped back before the metrics.

Fitted on the train split only; the validation and test splits are scored with :func:`ds4sci.data.metrics.task_metrics`.
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ds4sci.data.labels import LabelledData
from ds4sci.data.metrics import task_metrics
from ds4sci.infer.embed import embed_records
from ds4sci.infer.embed import token_embeddings

POOLS = ("mean", "last")
C_GRID = np.logspace(-3, 3, 7)
MAX_ITER = 500  # lbfgs on separable data runs to the limit at the largest C; its score there has converged
ALPHA_GRID = np.logspace(-3, 5, 9)


def probe_features(model, tokenizer, records: Sequence, kind: str, *, pool: str = "mean", layer: int | None = None,
                   seq_len: int | None = None, stride: int | None = None, batch_size: int = 8, progress: bool = False,
                   runner=None) -> np.ndarray | None:
    """The probe's features of ``records`` (objects with ``id`` and ``sequence``): ``[R, hidden]`` float32 (the
    ``pool`` of each record's states), or for ``kind == "token"`` ``[bases, hidden]`` (every base's state, records
    in order). Window arguments as :func:`~ds4sci.infer.embed.embed_records`. Across ranks (``runner``), only the
    writing rank gets the features; the others get None (every rank must call this).

    Raises:
        ValueError: an unknown ``pool``; a token task on a model whose tokens are not single bases (naming the record).
    """
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {', '.join(POOLS)}, got {pool!r}")
    options = dict(stride=stride, batch_size=batch_size, progress=progress, layer=layer, runner=runner)
    if kind != "token" and pool == "mean":
        _, vectors = embed_records(model, tokenizer, records, seq_len, **options)
        return vectors if runner is None or runner.is_writer else None
    lengths = {rec.id: len(rec.sequence) for rec in records}
    rows = []
    for name, states in token_embeddings(model, tokenizer, records, seq_len, **options):  # [tokens, hidden]
        if kind == "token" and len(states) != lengths[name]:
            raise ValueError(f"record {name!r}: {len(states)} token(s) for {lengths[name]} base(s): a per-base probe "
                             f"needs a model with one token per base (nucleotide tokens)")
        rows.append(states if kind == "token" else states[-1:])
    return np.concatenate(rows) if rows else None


@dataclass(frozen=True)
class ProbeResult:
    """``metrics``: split (``validation``, ``test``, those with records) -> flat metrics; ``regularisation``: the
    chosen ``C`` of each logistic model (one per label for multilabel) or ridge's ``alpha``; ``train``: records
    (bases, for a token task) the probe was fitted on."""

    metrics: dict[str, dict[str, float]]
    regularisation: list[float]
    train: int


def _folds(y: np.ndarray, folds: int, what: str) -> int:
    """Cross-validation folds the train split allows: at most the smallest class count, and at least 2."""
    counts = np.bincount(y)
    smallest = int(counts[counts > 0].min()) if len(counts) else 0
    if len(np.unique(y)) < 2 or smallest < 2:
        raise ValueError(f"{what}: the train split needs at least 2 records of each of at least two classes "
                         f"(class counts {counts.tolist()}) to fit and cross-validate a probe")
    return min(folds, smallest)


def _logistic(x: np.ndarray, y: np.ndarray, folds: int, seed: int, what: str):
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegressionCV
    from sklearn.model_selection import StratifiedKFold
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    cv = StratifiedKFold(_folds(y, folds, what), shuffle=True, random_state=seed)
    with warnings.catch_warnings():  # lbfgs stops at MAX_ITER on separable data at the largest C: expected
        warnings.simplefilter("ignore", ConvergenceWarning)
        fitted = make_pipeline(StandardScaler(), LogisticRegressionCV(
            Cs=C_GRID, l1_ratios=(0.0,), cv=cv, scoring="neg_log_loss", max_iter=MAX_ITER,
            use_legacy_attributes=False)).fit(x, y)
    return fitted, float(np.ravel(fitted[-1].C_)[0])


def _class_scores(fitted, x: np.ndarray, n_classes: int) -> np.ndarray:
    """``[R]`` probability of class 1 (two classes) or ``[R, C]`` over all classes, classes absent from training
    given probability 0."""
    proba = fitted.predict_proba(x)
    full = np.zeros((len(x), n_classes))
    full[:, fitted.classes_] = proba
    return full[:, 1] if n_classes == 2 else full


def fit_probe(data: LabelledData, features: Mapping[str, np.ndarray], *, folds: int = 5,
              seed: int = 0) -> ProbeResult:
    """Fit the probe on ``features["train"]`` against ``data``'s train targets and score the other splits.

    Args:
        features: split -> ``[R, hidden]`` (``[bases, hidden]`` for a token task), rows in the order of
            ``data.split(split)``; a split absent or without records is not scored.
        folds: cross-validation folds (fewer when the rarest train class has fewer records).

    Raises:
        ValueError: no train or no test record, rows that do not match the records, or a train split a model
            cannot be cross-validated on (a class, or a label's outcome, with fewer than 2 records).
    """
    scored = [s for s in ("validation", "test") if len(data.split(s))]
    if "test" not in scored or not len(data.split("train")):
        raise ValueError(f"a probe needs train and test records (split rule: {data.split_rule}; records per split: "
                         + ", ".join(f"{s} {len(data.split(s))}" for s in ("train", "validation", "test")) + ")")
    for split in ["train", *scored]:
        if len(features[split]) != len(data.targets(split)):
            raise ValueError(f"{split}: {len(features[split])} feature rows for {len(data.targets(split))} targets")
    x, y = np.asarray(features["train"], dtype=np.float64), data.targets("train")
    if data.kind == "regression":
        from sklearn.linear_model import RidgeCV
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

        mean, std = data.standardisation()  # [T] each
        fitted = make_pipeline(StandardScaler(), RidgeCV(alphas=ALPHA_GRID)).fit(x, (y - mean) / std)
        scores = {s: fitted.predict(features[s]).reshape(-1, len(mean)) * std + mean for s in scored}  # [R, T]
        chosen = [float(fitted[-1].alpha_)]
    elif data.kind == "multilabel":
        models = [_logistic(x, y[:, c], folds, seed, f"label {name!r}") for c, name in enumerate(data.classes)]
        scores = {s: np.stack([_class_scores(m, features[s], 2) for m, _ in models], 1) for s in scored}  # [R, C]
        chosen = [c for _, c in models]
    else:
        fitted, c = _logistic(x, y, folds, seed, data.kind)
        scores = {s: _class_scores(fitted, features[s], len(data.classes)) for s in scored}
        chosen = [c]
    metrics = {s: task_metrics(data.kind, data.targets(s), scores[s], data.classes) for s in scored}
    return ProbeResult(metrics, chosen, len(y))
