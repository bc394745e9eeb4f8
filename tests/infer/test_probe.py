"""The linear probe (ds4sci.infer.probe, ``ds4sci probe``): a planted signal is found (AUROC >= 0.95) and shuffled
labels are not (near 0.5); regression and multilabel probes; per-base features; user mistakes are one error."""
import json

import numpy as np
import pytest

from ds4sci.cli import main
from ds4sci.data import read_labelled
from ds4sci.data.labels import KINDS
from ds4sci.data.labels import SPLITS
from ds4sci.infer.embed import token_embeddings
from ds4sci.infer.probe import fit_probe
from ds4sci.infer.probe import probe_features

from motif_checks import motif_table  # tests/ is on sys.path (its conftest.py)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One BLAS and torch thread: the probe's small fits and forwards only slow down when threads contend for the
    2 cores the suite shares (a fit took 20 s with two OpenBLAS threads on a loaded machine, 2 s with one)."""
    import sklearn.linear_model  # noqa: F401  (loads the BLAS libraries threadpool_limits acts on)
    import torch
    from threadpoolctl import threadpool_limits

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with threadpool_limits(1):
        yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A randomly initialised debug nucleotide GenSLM, exported (frozen features need no training to carry G's)."""
    import torch

    from ds4sci.data import NucleotideTokenizer
    from ds4sci.io.export import export_consolidated
    from ds4sci.models.genslm import GenSLM
    from ds4sci.models.genslm import GenSLMConfig

    torch.manual_seed(0)
    tok = NucleotideTokenizer()
    cfg = GenSLMConfig.preset("debug", vocab_size=tok.vocab_size, max_position_embeddings=64)
    return export_consolidated(GenSLM(cfg).eval().state_dict(), cfg, tok, tmp_path_factory.mktemp("probe") / "export")


def test_probe_finds_a_planted_motif_and_not_shuffled_labels(export, tmp_path, capsys):
    for shuffle in (False, True):
        data = motif_table(tmp_path / f"motif{shuffle}.tsv", shuffle=shuffle)
        out = tmp_path / f"out{shuffle}"
        assert main(["probe", str(export), "--data", str(data), "--out", str(out), "--no-progress",
                     "--device", "cpu", "--folds", "3"]) == 0
        metrics = json.loads((out / "metrics.json").read_text())
        assert list(metrics) == ["test"] and metrics["test"]["n"] == 100
        auroc = metrics["test"]["auroc"]
        if shuffle:
            assert abs(auroc - 0.5) < 0.15, auroc  # 100 test records: the AUROC of chance has sd ~0.06
        else:
            assert auroc >= 0.95, auroc
        settings = json.loads((out / "probe.json").read_text())
        assert settings["fitted_on"] == 100 and settings["split_rule"] == "given" and settings["pool"] == "mean"
        table = capsys.readouterr().out
        assert "auroc" in table and "test" in table.splitlines()[0]


def test_last_pool_and_per_base_features_are_the_embedding_states(export):
    from ds4sci.io.weights import load_model

    model, _, tok = load_model(export, "cpu")
    data = read_labelled(_write_token_table(export.parent / "tok.tsv"), "token")
    records = data.split("train")
    states = [s for _, s in token_embeddings(model, tok, records)]
    per_base = probe_features(model, tok, records, "token")
    np.testing.assert_array_equal(per_base, np.concatenate(states))
    last = probe_features(model, tok, records, "binary", pool="last")
    np.testing.assert_array_equal(last, np.stack([s[-1] for s in states]))
    with pytest.raises(ValueError, match="pool must be one of mean, last"):
        probe_features(model, tok, records, "binary", pool="max")


def _write_token_table(path):
    path.write_text("id\tsequence\tlabel\tsplit\na\tACGTAC\t001100\ttrain\nb\tGGCA\t1100\ttrain\n")
    return path


def test_regression_and_multilabel_probes_on_planted_features():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(300, 8))  # [R, features]

    def table(kind, labels, tmp):
        lines = "".join(f">r{i} label={v} split={'train' if i < 200 else 'test'}\nAC\n" for i, v in enumerate(labels))
        tmp.write_text(lines)
        return read_labelled(tmp, kind)

    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        y = 3 * x[:, 0] - x[:, 1] + 0.1 * rng.normal(size=300) + 50  # a linear signal, far from 0
        data = table("regression", [f"{v:.6f}" for v in y], Path(tmp) / "r.fa")
        features = {"train": x[:200], "test": x[200:]}
        result = fit_probe(data, features)
        assert result.metrics["test"]["r2"] > 0.95 and len(result.regularisation) == 1
        shuffled = table("regression", [f"{v:.6f}" for v in rng.permutation(y)], Path(tmp) / "s.fa")
        assert fit_probe(shuffled, features).metrics["test"]["r2"] < 0.1
        names = [",".join(n for n, on in (("a", x[i, 2] > 0), ("b", x[i, 3] > 0)) if on) or "-" for i in range(300)]
        data = table("multilabel", names, Path(tmp) / "m.fa")
        result = fit_probe(data, features)
        assert result.metrics["test"]["auroc/a"] > 0.95 and result.metrics["test"]["auroc/b"] > 0.95
        assert len(result.regularisation) == 2
        with pytest.raises(ValueError, match="test: 5 feature rows for 100 targets"):
            fit_probe(data, {"train": x[:200], "test": x[:5]})


def test_the_command_knows_the_readers_kinds_and_splits():
    from ds4sci.commands import probe

    assert probe.KINDS == KINDS and probe.SPLITS == SPLITS


@pytest.mark.parametrize("argv, message", [
    (["--data", "{bad}"], r"bad line\(s\) in the labelled data:\n  .*bad.tsv:3: record 'b': missing label\n"
                          r"  .*bad.tsv:4: record 'c': unknown class '7'"),
    (["--data", "{good}", "--bed", "x.bed"], "--bed labels bases: use it with --kind token"),
    (["--data", "{good}", "--layer", "9"], r"--layer 9: the model has blocks 0..2"),
    (["--data", "{good}", "--data", "test={good}"], r"good.tsv:2: duplicate id 'r0' \(first at .*good.tsv:2\)"),
])
def test_user_mistakes_are_one_error(export, tmp_path, capsys, argv, message):
    bad = tmp_path / "bad.tsv"
    bad.write_text("id\tsequence\tlabel\na\tACGT\t1\nb\tACGT\t\nc\tAC\t7\n")
    good = motif_table(tmp_path / "good.tsv", n=20)
    argv = [a.format(bad=bad, good=good) for a in argv]
    assert main(["probe", str(export), *argv, "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ds4sci probe: error: ") and err.count("error:") == 1
    assert __import__("re").search(message, err), err
