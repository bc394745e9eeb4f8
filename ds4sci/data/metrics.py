"""Task metrics from scikit-learn, one function per task kind, each returning a flat ``{name: float}`` dict (what
``metrics.json`` holds, :func:`write_metrics`).

Classification (binary, multiclass, multilabel, and token: per base): ``auroc``, ``auprc`` (average precision),
``mcc``, ``accuracy`` and ``f1_macro``, plus a per-class report ``precision/NAME``, ``recall/NAME``, ``f1/NAME``,
``support/NAME`` (and ``auroc/NAME``, ``auprc/NAME`` where there are more than two classes). Predictions are the
arg-max class (multiclass) or ``score >= 0.5`` (binary, each label of a multilabel task).

- multiclass ``auroc``/``auprc``: the macro mean of one-vs-rest scores over the classes present with both outcomes;
- multilabel: ``accuracy`` is exact-match (subset) accuracy, ``mcc`` the mean of the per-label MCCs, ``auroc`` and
  ``auprc`` macro means over the labels with both outcomes present;
- a score undefined on the data (an AUROC with one class present) is NaN, written as ``null`` in JSON.

Regression: ``pearson``, ``spearman`` and ``r2``, each the mean over targets, and per target (``pearson/NAME`` ...)
when there are several. Every result also holds ``n``, the number of records (bases for token tasks).
"""
from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Sequence

import numpy as np


def _auc(y: np.ndarray, score: np.ndarray) -> tuple[float, float]:
    """(AUROC, AUPRC) of 0/1 outcomes ``y [R]`` against ``score [R]``; NaN when only one outcome is present."""
    from sklearn.metrics import average_precision_score
    from sklearn.metrics import roc_auc_score

    if len(np.unique(y)) < 2:
        return math.nan, math.nan
    return float(roc_auc_score(y, score)), float(average_precision_score(y, score))


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return float(np.mean(finite)) if finite else math.nan


def _report(y: np.ndarray, pred: np.ndarray, classes: Sequence[str]) -> dict[str, float]:
    """Per-class precision, recall, F1 and support (labels: indices, or indicator columns for multilabel)."""
    from sklearn.metrics import precision_recall_fscore_support

    labels = list(range(len(classes)))
    precision, recall, f1, support = precision_recall_fscore_support(y, pred, labels=labels, zero_division=0)
    out = {}
    for i, name in enumerate(classes):
        out |= {f"precision/{name}": float(precision[i]), f"recall/{name}": float(recall[i]),
                f"f1/{name}": float(f1[i]), f"support/{name}": float(support[i])}
    return out


def _check(y: np.ndarray, scores: np.ndarray, shape: tuple, what: str) -> None:
    if y.shape != shape or scores.shape[: len(shape)] != shape or not len(y):
        raise ValueError(f"{what}: targets {y.shape} and scores {scores.shape} do not match (or are empty)")


def binary_metrics(y: np.ndarray, score: np.ndarray, classes: Sequence[str] = ("0", "1")) -> dict[str, float]:
    """Metrics of a binary task: ``y [R]`` 0/1 targets, ``score [R]`` the probability (or any monotone score with
    0.5 as the threshold) of class 1. Raises ValueError on mismatched or empty inputs."""
    from sklearn.metrics import accuracy_score
    from sklearn.metrics import f1_score
    from sklearn.metrics import matthews_corrcoef

    y, score = np.asarray(y), np.asarray(score, dtype=np.float64)
    _check(y, score, (len(y),), "binary")
    pred = (score >= 0.5).astype(np.int64)
    auroc, auprc = _auc(y, score)
    return {"n": float(len(y)), "auroc": auroc, "auprc": auprc, "mcc": float(matthews_corrcoef(y, pred)),
            "accuracy": float(accuracy_score(y, pred)),
            "f1_macro": float(f1_score(y, pred, labels=[0, 1], average="macro", zero_division=0)),
            **_report(y, pred, classes)}


def multiclass_metrics(y: np.ndarray, proba: np.ndarray, classes: Sequence[str]) -> dict[str, float]:
    """Metrics of a multiclass task: ``y [R]`` class indices, ``proba [R, C]`` class probabilities (or scores),
    ``classes`` the ``C`` names. Raises ValueError on mismatched or empty inputs."""
    from sklearn.metrics import accuracy_score
    from sklearn.metrics import f1_score
    from sklearn.metrics import matthews_corrcoef

    y, proba = np.asarray(y), np.asarray(proba, dtype=np.float64)
    _check(y, proba, (len(y),), "multiclass")
    if proba.ndim != 2 or proba.shape[1] != len(classes):
        raise ValueError(f"multiclass: scores {proba.shape} are not [R, {len(classes)} classes]")
    pred = proba.argmax(axis=1)
    out = {"n": float(len(y))}
    per_class = {name: _auc((y == c).astype(np.int64), proba[:, c]) for c, name in enumerate(classes)}
    out["auroc"] = _mean([a for a, _ in per_class.values()])
    out["auprc"] = _mean([p for _, p in per_class.values()])
    out |= {"mcc": float(matthews_corrcoef(y, pred)), "accuracy": float(accuracy_score(y, pred)),
            "f1_macro": float(f1_score(y, pred, labels=list(range(len(classes))), average="macro", zero_division=0))}
    for name, (auroc, auprc) in per_class.items():
        out |= {f"auroc/{name}": auroc, f"auprc/{name}": auprc}
    return out | _report(y, pred, classes)


def multilabel_metrics(y: np.ndarray, proba: np.ndarray, classes: Sequence[str]) -> dict[str, float]:
    """Metrics of a multilabel task: ``y [R, C]`` 0/1 indicators, ``proba [R, C]`` per-label probabilities.
    Raises ValueError on mismatched or empty inputs."""
    from sklearn.metrics import accuracy_score
    from sklearn.metrics import f1_score
    from sklearn.metrics import matthews_corrcoef

    y, proba = np.asarray(y), np.asarray(proba, dtype=np.float64)
    _check(y, proba, (len(y), len(classes)), "multilabel")
    pred = (proba >= 0.5).astype(np.int64)
    per_label = {name: _auc(y[:, c], proba[:, c]) for c, name in enumerate(classes)}
    out = {"n": float(len(y)), "auroc": _mean([a for a, _ in per_label.values()]),
           "auprc": _mean([p for _, p in per_label.values()]),
           "mcc": float(np.mean([matthews_corrcoef(y[:, c], pred[:, c]) for c in range(len(classes))])),
           "accuracy": float(accuracy_score(y, pred)),
           "f1_macro": float(f1_score(y, pred, average="macro", zero_division=0))}
    for name, (auroc, auprc) in per_label.items():
        out |= {f"auroc/{name}": auroc, f"auprc/{name}": auprc}
    return out | _report(y, pred, classes)


def _correlation(a: np.ndarray, b: np.ndarray) -> float:
    if a.std() == 0 or b.std() == 0:
        return math.nan
    return float(np.corrcoef(a, b)[0, 1])


def regression_metrics(y: np.ndarray, pred: np.ndarray, names: Sequence[str] | None = None) -> dict[str, float]:
    """Metrics of a regression: ``y [R]`` or ``[R, T]`` targets, ``pred`` of the same shape, ``names`` the ``T``
    target names (default ``label`` or ``label0 ...``). Pearson and Spearman are NaN for a constant column.
    Raises ValueError on mismatched or empty inputs."""
    from scipy.stats import rankdata
    from sklearn.metrics import r2_score

    y, pred = np.asarray(y, dtype=np.float64), np.asarray(pred, dtype=np.float64)
    if y.shape != pred.shape or not len(y):
        raise ValueError(f"regression: targets {y.shape} and predictions {pred.shape} do not match (or are empty)")
    y, pred = y.reshape(len(y), -1), pred.reshape(len(pred), -1)  # [R, T]
    names = list(names) if names is not None else (["label"] if y.shape[1] == 1 else
                                                  [f"label{t}" for t in range(y.shape[1])])
    scores = {}
    for t, name in enumerate(names):
        with warnings.catch_warnings():  # R^2 of a constant target: sklearn warns and returns NaN
            warnings.simplefilter("ignore")
            r2 = float(r2_score(y[:, t], pred[:, t])) if len(y) > 1 else math.nan
        scores[name] = {"pearson": _correlation(y[:, t], pred[:, t]),
                        "spearman": _correlation(rankdata(y[:, t]), rankdata(pred[:, t])), "r2": r2}
    out = {"n": float(len(y))}
    for key in ("pearson", "spearman", "r2"):
        out[key] = _mean([s[key] for s in scores.values()])
    if len(names) > 1:
        out |= {f"{key}/{name}": value for name, s in scores.items() for key, value in s.items()}
    return out


def token_metrics(y: np.ndarray, scores: np.ndarray, classes: Sequence[str] = ("0", "1")) -> dict[str, float]:
    """Metrics of a per-base task over all bases: ``y [N]`` class indices, ``scores [N]`` (two classes: the
    probability of class 1) or ``[N, C]`` class probabilities; computed as :func:`binary_metrics` or
    :func:`multiclass_metrics`."""
    scores = np.asarray(scores)
    if scores.ndim == 1:
        return binary_metrics(y, scores, classes)
    return multiclass_metrics(y, scores, classes)


def task_metrics(kind: str, y: np.ndarray, scores: np.ndarray, classes: Sequence[str]) -> dict[str, float]:
    """The metrics of ``kind`` (:data:`ds4sci.data.labels.KINDS`): ``y`` and ``scores`` as the function of that kind
    takes them (binary: ``scores [R]`` the probability of class 1); for regression ``classes`` names the targets.
    Raises ValueError on an unknown kind."""
    functions = {"binary": binary_metrics, "multiclass": multiclass_metrics, "multilabel": multilabel_metrics,
                 "regression": regression_metrics, "token": token_metrics}
    if kind not in functions:
        raise ValueError(f"kind must be one of {', '.join(functions)}, got {kind!r}")
    return functions[kind](y, scores, classes)


def write_metrics(path: str | os.PathLike, metrics: dict) -> None:
    """Write ``metrics`` (a flat dict, or one nested level such as ``{"test": {...}}``) as JSON, NaN as ``null``."""
    def clean(value):
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        return None if isinstance(value, float) and math.isnan(value) else value

    with open(path, "w") as handle:
        json.dump(clean(metrics), handle, indent=2)
        handle.write("\n")


def format_metrics(metrics: dict[str, float], keys: Sequence[str] | None = None) -> str:
    """A short two-column table of ``keys`` (default: those without a ``/``, the summary) for a terminal."""
    keys = [k for k in metrics if "/" not in k] if keys is None else list(keys)
    width = max(map(len, keys), default=0)
    return "\n".join(f"{k:<{width}}  {metrics[k]:.4f}" if k != "n" else f"{k:<{width}}  {int(metrics[k])}"
                     for k in keys)
