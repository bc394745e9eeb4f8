"""Labelled data readers (ds4sci.data.labels): every input form and kind, the stable split rule, and every bad line
named with its file and line, all in one error."""
from pathlib import Path

import numpy as np
import pytest

from ds4sci.data.labels import LabelError
from ds4sci.data.labels import LabelSource
from ds4sci.data.labels import hash_split
from ds4sci.data.labels import read_labelled


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_fasta_headers_binary_with_given_splits(tmp_path):
    path = _write(tmp_path, "a.fa", ">r1 label=1 split=train\nACGT\n>r2 x label=0 split=test\nacgu\n"
                                    ">r3 label=0 split=validation\nGG\n")
    data = read_labelled(path, "binary")
    assert data.classes == ("0", "1") and data.split_rule == "given"
    assert [(e.id, e.sequence, e.target, e.split) for e in data.examples] == [
        ("r1", "ACGT", 1, "train"), ("r2", "ACGT", 0, "test"), ("r3", "GG", 0, "validation")]
    assert data.examples[1].where == f"{path}:3"
    assert data.targets("train").tolist() == [1]


def test_table_multiclass_classes_from_train(tmp_path):
    text = "id\tsequence\tlabel\tsplit\na\tACGT\tpromoter\ttrain\nb\tAC\tenhancer\ttrain\nc\tGT\tpromoter\ttest\n"
    data = read_labelled(_write(tmp_path, "t.tsv", text), "multiclass")
    assert data.classes == ("enhancer", "promoter")
    assert [e.target for e in data.examples] == [1, 0, 1]


def test_csv_multilabel_and_keyed_table(tmp_path):
    fasta = _write(tmp_path, "s.fa", ">a\nACGT\n>b\nAC\n>c\nGG\n")
    table = _write(tmp_path, "l.csv", 'id,label,split\na,"x,y",train\nb,-,train\nc,y,test\n')
    data = read_labelled(LabelSource(table, fasta=fasta), "multilabel")
    assert data.classes == ("x", "y")
    assert [e.target for e in data.examples] == [(1, 1), (0, 0), (0, 1)]
    assert data.targets("train").shape == (2, 2)
    assert data.examples[0].sequence == "ACGT"


def test_regression_several_targets_and_standardisation(tmp_path):
    text = ">a label=1,10 split=train\nAC\n>b label=3,10 split=train\nAC\n>c label=5,0 split=test\nAC\n"
    data = read_labelled(_write(tmp_path, "r.fa", text), "regression")
    assert data.classes == ("label0", "label1")
    assert data.targets("test").tolist() == [[5.0, 0.0]]
    mean, std = data.standardisation()
    assert mean.tolist() == [2.0, 10.0] and std.tolist() == [1.0, 1.0]  # constant target: std 1


def test_token_labels_from_a_column_and_from_bed(tmp_path):
    table = _write(tmp_path, "t.tsv", "id\tsequence\tlabel\na\tACGTAC\t001100\n")
    data = read_labelled(LabelSource(table, split="train"), "token")
    assert data.targets("train").tolist() == [0, 0, 1, 1, 0, 0]
    fasta = _write(tmp_path, "g.fa", ">g1\nACGTACGT\n>g2\nAC\n")
    bed = _write(tmp_path, "g.bed", "track name=x\ng1\t1\t3\n# comment\ng1 6 8 gene\n")
    data = read_labelled(LabelSource(fasta, bed=bed, split="test"), "token")
    assert [e.target.tolist() for e in data.examples] == [[0, 1, 1, 0, 0, 0, 1, 1], [0, 0]]


def test_separate_split_files(tmp_path):
    train = _write(tmp_path, "train.fa", ">a label=1\nAC\n>b label=0\nAC\n")
    test = _write(tmp_path, "test.fa", ">c label=1\nAC\n")
    data = read_labelled([LabelSource(train, split="train"), LabelSource(test, split="test")], "binary")
    assert [e.split for e in data.examples] == ["train", "train", "test"]


def test_hash_split_is_stable_when_records_are_added(tmp_path):
    ids = [f"rec{i}" for i in range(400)]
    small = read_labelled(_write(tmp_path, "s.fa", "".join(f">{i} label=1\nAC\n" for i in ids[:200])), "binary")
    big = read_labelled(_write(tmp_path, "b.fa", "".join(f">{i} label=1\nAC\n" for i in ids)), "binary")
    before = {e.id: e.split for e in small.examples}
    assert all(before[e.id] == e.split for e in big.examples if e.id in before)
    assert small.split_rule.startswith("hash_split(")
    counts = {s: sum(e.split == s for e in big.examples) for s in ("train", "validation", "test")}
    assert 20 <= counts["test"] <= 60 and 20 <= counts["validation"] <= 60, counts
    # the stated rule: the first 8 bytes of SHA-256(id) as a fraction of 2**64
    assert hash_split("rec0") == hash_split("rec0", 0.1, 0.1)
    assert hash_split("rec0", 0, 0) == "train" and hash_split("rec0", 0, 0.999999) == "test"


def test_every_bad_line_is_named_all_at_once(tmp_path):
    fasta = _write(tmp_path, "h.fa",
                   ">a label=1\nAC\n>b\nAC\n>a label=0\nAC\n>c label=2\nAC\n>d label=1 split=dev\nA\n")
    table = _write(tmp_path, "t.tsv", "id\tsequence\tlabel\ne\tACGT\t001\nf\tAC\t01\ng\tAC.\t00\nh\tAC\n")
    genome = _write(tmp_path, "g.fa", ">g1\nACGT\n")
    bed = _write(tmp_path, "g.bed", "g1\t2\t9\nzz\t0\t1\ng1\tx\t2\n")
    keyed_fasta = _write(tmp_path, "k.fa", ">k1\nAC\n>k2\nAC\n")
    keyed = _write(tmp_path, "k.tsv", "id\tlabel\nk1\t1\nk9\t0\n")
    with pytest.raises(LabelError) as caught:
        read_labelled([fasta, LabelSource(table), LabelSource(genome, bed=bed),
                       LabelSource(keyed, fasta=keyed_fasta)], "token")
    text = str(caught.value)
    assert text.splitlines()[0].startswith(f"{len(caught.value.problems)} bad line(s)")
    # token kind: the header labels are per-base strings, so "1" on a 2-base record is a length mismatch
    expected = [
        (f"{fasta}:3", "missing label"),
        (f"{fasta}:5", "duplicate id 'a'"),
        (f"{fasta}:9", "unknown split 'dev'"),
        (f"{table}:2", "length mismatch: 3 per-base label(s) for 4 base(s)"),
        (f"{table}:4", "invalid nucleotide character '.'"),
        (f"{table}:5", "2 field(s), the header has 3"),
        (f"{bed}:1", "interval 2-9 outside record 'g1'"),
        (f"{bed}:2", "record 'zz' is not in"),
        (f"{bed}:3", "is not an integer"),
        (f"{keyed}:3", "id 'k9' is not a record of"),
        (f"{keyed_fasta}:3", "record 'k2': missing label"),
    ]
    for where, what in expected:
        assert any(p.startswith(where + ":") and what in p for p in caught.value.problems), (where, what, text)


def test_unknown_classes_and_bad_numbers(tmp_path):
    fasta = _write(tmp_path, "c.fa", ">a label=x split=train\nAC\n>b label=y split=test\nAC\n")
    with pytest.raises(LabelError, match=rf"{fasta}:3: record 'b': unknown class 'y' \(classes: x\)"):
        read_labelled(fasta, "multiclass")
    with pytest.raises(LabelError, match=rf"{fasta}:1: record 'a': unknown class 'x' \(classes: 0, 1\)"):
        read_labelled(fasta, "binary")
    with pytest.raises(LabelError) as caught:
        read_labelled(fasta, "regression")
    assert len(caught.value.problems) == 2 and "is not a number" in caught.value.problems[1]
    mixed = _write(tmp_path, "m.fa", ">a label=1,2 split=train\nAC\n>b label=1\nAC\n")
    with pytest.raises(LabelError) as caught:
        read_labelled(mixed, "regression")
    assert [p.split(": ", 1)[0] for p in caught.value.problems] == [f"{mixed}:3", f"{mixed}:3"]
    assert "no split" in caught.value.problems[1] and "1 target(s), the first record has 2" in caught.value.problems[0]


def test_bad_arguments_are_value_errors(tmp_path):
    fasta = _write(tmp_path, "a.fa", ">a label=1\nAC\n")
    with pytest.raises(ValueError, match="kind must be one of"):
        read_labelled(fasta, "ordinal")
    with pytest.raises(ValueError, match="kind must be 'token'"):
        read_labelled(LabelSource(fasta, bed=fasta), "binary")
    with pytest.raises(ValueError, match="two of them for binary"):
        read_labelled(fasta, "binary", classes=["a", "b", "c"])
    assert np.array_equal(read_labelled(fasta, "binary", classes=["0", "1"]).targets(
        read_labelled(fasta, "binary").examples[0].split), [1])


def test_bundled_coding_task_matches_the_genome_and_holds_out_a_region():
    from ds4sci.data import read_fasta

    root = Path(__file__).resolve().parents[2] / "examples" / "data"
    genome = next(read_fasta(root / "NC_007779.1_ecoli_K12_W3110.fasta.gz")).sequence
    windows = read_labelled(root / "ecoli_coding_windows.tsv", "binary")
    bases = read_labelled(root / "ecoli_coding_bases.tsv", "token")
    assert windows.split_rule == bases.split_rule == "given"
    for data, size in ((windows, 256), (bases, 512)):
        for e in data.examples:
            start, end = map(int, e.id.split(":")[1].split("-"))
            assert end - start == size and genome[start:end] == e.sequence
            assert (start >= 3_950_000) == (e.split == "test") and (e.split != "validation" or start >= 3_500_000)
    for split, count in (("train", 500), ("validation", 120), ("test", 200)):
        assert len(windows.split(split)) == count and windows.targets(split).mean() == 0.5
    assert 0.5 < bases.targets("test").mean() < 0.95  # both classes in the per-base test split
