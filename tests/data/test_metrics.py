"""Task metrics (ds4sci.data.metrics) against values computed by hand (the arithmetic is in the comments)."""
import json
import math

import numpy as np
import pytest

from ds4sci.data.metrics import binary_metrics
from ds4sci.data.metrics import format_metrics
from ds4sci.data.metrics import multiclass_metrics
from ds4sci.data.metrics import multilabel_metrics
from ds4sci.data.metrics import regression_metrics
from ds4sci.data.metrics import task_metrics
from ds4sci.data.metrics import token_metrics
from ds4sci.data.metrics import write_metrics


def test_binary():
    y, score = np.array([0, 0, 1, 1]), np.array([0.1, 0.4, 0.35, 0.8])
    m = binary_metrics(y, score, ("neg", "pos"))
    assert m["auroc"] == pytest.approx(3 / 4)  # positive above negative in 3 of the 4 pairs
    assert m["auprc"] == pytest.approx(0.5 * 1 + 0.5 * 2 / 3)  # precision 1/1 and 2/3 at the two positives
    # predictions 0 0 0 1: TP 1, TN 2, FP 0, FN 1
    assert m["accuracy"] == pytest.approx(3 / 4)
    assert m["mcc"] == pytest.approx((1 * 2 - 0 * 1) / math.sqrt(1 * 2 * 2 * 3))
    assert m["f1_macro"] == pytest.approx((2 / 3 + 0.8) / 2)  # F1 pos: P 1, R 1/2; neg: P 2/3, R 1
    assert m["recall/pos"] == pytest.approx(0.5) and m["precision/neg"] == pytest.approx(2 / 3)
    assert m["support/pos"] == 2 and m["n"] == 4


def test_multiclass():
    y = np.array([0, 1, 2, 2])
    proba = np.array([[.7, .2, .1], [.2, .5, .3], [.1, .3, .6], [.3, .4, .3]])  # arg-max 0 1 2 1
    m = multiclass_metrics(y, proba, ["a", "b", "c"])
    assert m["accuracy"] == pytest.approx(3 / 4)
    # one-vs-rest: a and b rank their positive first (1.0); c: 0.6 beats 0.1, 0.3; 0.3 beats 0.1, ties 0.3
    assert m["auroc/c"] == pytest.approx(3.5 / 4)
    assert m["auroc"] == pytest.approx((1 + 1 + 3.5 / 4) / 3)
    # MCC = (c*s - sum p_k t_k) / sqrt((s^2 - sum p_k^2)(s^2 - sum t_k^2)); c 3, s 4, t (1,1,2), p (1,2,1)
    assert m["mcc"] == pytest.approx((3 * 4 - 5) / math.sqrt((16 - 6) * (16 - 6)))
    assert m["f1_macro"] == pytest.approx((1 + 2 / 3 + 2 / 3) / 3)


def test_multilabel():
    y = np.array([[1, 0], [0, 1], [1, 1]])
    proba = np.array([[.9, .2], [.4, .6], [.6, .3]])  # predictions 10 01 10
    m = multilabel_metrics(y, proba, ["x", "y"])
    assert m["accuracy"] == pytest.approx(2 / 3)  # exact match
    assert m["auroc"] == pytest.approx(1.0)
    assert m["mcc"] == pytest.approx((1 + 0.5) / 2)  # x exact; y: TP 1, TN 1, FN 1 -> 1/sqrt(1*2*1*2)
    assert m["f1_macro"] == pytest.approx((1 + 2 / 3) / 2)


def test_regression():
    y, pred = np.array([1., 2., 3., 4.]), np.array([2., 2., 4., 5.])
    m = regression_metrics(y, pred)
    assert m["pearson"] == pytest.approx(5.5 / math.sqrt(5 * 6.75))  # sum dy*dp / sqrt(sum dy^2 sum dp^2)
    assert m["spearman"] == pytest.approx(4.5 / math.sqrt(5 * 4.5))  # ranks 1 2 3 4 vs 1.5 1.5 3 4
    assert m["r2"] == pytest.approx(1 - 3 / 5)  # residuals 1 0 1 1; total sum of squares 5
    two = regression_metrics(np.stack([y, y], 1), np.stack([pred, y], 1), ["a", "b"])
    assert two["r2/b"] == pytest.approx(1.0) and two["r2"] == pytest.approx((0.4 + 1) / 2)


def test_undefined_scores_are_nan_and_null_in_json(tmp_path):
    m = task_metrics("binary", np.array([1, 1]), np.array([0.2, 0.9]), ("0", "1"))
    assert math.isnan(m["auroc"]) and m["accuracy"] == 0.5
    assert math.isnan(regression_metrics(np.ones(3), np.arange(3.0))["pearson"])
    write_metrics(tmp_path / "m.json", {"test": m})
    assert json.loads((tmp_path / "m.json").read_text())["test"]["auroc"] is None
    assert "auroc" in format_metrics(m) and "support/1" not in format_metrics(m)


def test_token_and_dispatch():
    y = np.array([0, 1, 1, 0, 2])
    assert token_metrics(y[:4], np.array([.1, .9, .8, .2]))["auroc"] == 1.0
    proba = np.eye(3)[y] * 0.8 + 0.2 / 3
    assert token_metrics(y, proba, ["n", "c", "x"])["accuracy"] == 1.0
    with pytest.raises(ValueError, match="kind must be one of"):
        task_metrics("ordinal", y, y, ())
    with pytest.raises(ValueError, match="do not match"):
        binary_metrics(y, y[:3])
