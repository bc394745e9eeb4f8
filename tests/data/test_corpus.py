"""Corpora of many FASTA files: sources, the token cache, splits, data-parallel sampling and resume."""
import gzip
import itertools
import logging
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ds4sci.data import CodonTokenizer
from ds4sci.data import NucleotideTokenizer
from ds4sci.data import Spans
from ds4sci.data import WindowDataset
from ds4sci.data import corpus as corpus_mod
from ds4sci.data import open_corpus
from ds4sci.data import resolve_sources
from ds4sci.data.corpus import load_datasets
from ds4sci.data.datasets import auto_min_records
from ds4sci.data.datasets import choose_split
from ds4sci.data.datasets import describe_split
from ds4sci.data.datasets import record_hash
from ds4sci.data.datasets import split_records
from ds4sci.data.datasets import split_region
from ds4sci.data.datasets import split_spans
from ds4sci.data.datasets import val_mask
from ds4sci.spawn import run_workers

from fork_checks import run_in_fork  # tests/ is on sys.path (its conftest.py)

NUC = NucleotideTokenizer()


def _fa(path: Path, records, gz=False):
    text = "".join(f">{rid}\n{seq}\n" for rid, seq in records).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(text) if gz else text)
    return path


def _genes(prefix, n, length=30, seed=0):
    rng = np.random.default_rng(seed)
    return [(f"{prefix}{i}", "".join(rng.choice(list("ACGT"), length))) for i in range(n)]


# ------------------------------------------------------------------------------------------------------- sources
def test_sources_files_lists_directories_globs(tmp_path):
    a = _fa(tmp_path / "d" / "a.fa", _genes("a", 2))
    b = _fa(tmp_path / "d" / "sub" / "b.fna.gz", _genes("b", 2), gz=True)
    c = _fa(tmp_path / "d" / "c.ffn", _genes("c", 1))
    (tmp_path / "d" / "notes.txt").write_text("not fasta")
    e = _fa(tmp_path / "e.fasta", _genes("e", 1))
    assert resolve_sources(str(a)) == [str(a)]
    assert resolve_sources(str(tmp_path / "d")) == [str(a), str(c), str(b)]  # sorted by path, recursive, no .txt
    assert resolve_sources(str(tmp_path / "d" / "**" / "*.gz")) == [str(b)]
    # list order kept, each file once
    assert resolve_sources([str(e), str(tmp_path / "d" / "*.f*"), str(a)]) == [str(e), str(a), str(c)]
    with pytest.raises(FileNotFoundError, match=r"pattern '.*/x\*\.fa' matches no file"):
        resolve_sources([str(a), str(tmp_path / "x*.fa")])
    with pytest.raises(FileNotFoundError, match=r"'.*/missing\.fa': no such file"):
        resolve_sources(str(tmp_path / "missing.fa"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"directory '.*/empty' holds no FASTA file"):
        resolve_sources(str(tmp_path / "empty"))


def test_config_fasta_list_is_relative_to_the_config_folder(tmp_path, monkeypatch):
    from ds4sci.train.config import load_config

    (tmp_path / "cfg").mkdir()
    path = tmp_path / "cfg" / "c.yaml"
    path.write_text("data:\n  fasta: [../g/*.fa, ../one.fa.gz]\n")
    monkeypatch.chdir(tmp_path / "cfg")  # not where the paths are meant to start... from anywhere:
    monkeypatch.chdir("/")
    cfg = load_config(path)
    assert cfg.data.fasta == [str(tmp_path / "g" / "*.fa"), str(tmp_path / "one.fa.gz")]
    assert cfg.data.cache_dir == "" and cfg.data.split == "auto"
    assert load_config(None, ["data.fasta=[a.fa, b.fa]"]).data.fasta == ["/a.fa", "/b.fa"]
    with pytest.raises(ValueError, match=r"data.fasta=\[\]: expected a path or a non-empty list"):
        load_config(None, ["data.fasta=[]"])
    with pytest.raises(ValueError, match=r"data.fasta=\[1, 2\]: expected a path"):
        load_config(None, ["data.fasta=[1, 2]"])


# ---------------------------------------------------------------------------------------------------------- cache
def _builds(monkeypatch):
    calls = []
    real = corpus_mod.build_cache
    monkeypatch.setattr(corpus_mod, "build_cache", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_cache_is_built_once_then_mapped(tmp_path, monkeypatch):
    recs = _genes("g", 5, 40)
    src = _fa(tmp_path / "a.fa", recs)
    builds = _builds(monkeypatch)
    c1 = open_corpus(src, NUC, cache_dir=tmp_path / "cache")
    c2 = open_corpus(src, NUC, cache_dir=tmp_path / "cache")
    assert builds == [1] and c1.root == c2.root
    assert isinstance(c2.tokens, np.memmap) and c2.tokens.dtype == np.uint8 and not c2.tokens.flags.writeable
    for r, (rid, seq) in enumerate(recs):
        assert np.array_equal(c2.spans[r], NUC.encode(seq)) and c2.record_id(r) == rid
    assert c2.meta["sources"][0]["path"] == str(src) and c2.meta["n_records"] == 5
    assert sorted(os.listdir(tmp_path / "cache")) == [c1.root.name]  # no temporary directory left


def test_changed_source_or_tokenization_is_never_served_from_a_stale_cache(tmp_path, monkeypatch):
    src = _fa(tmp_path / "a.fa", [("r", "ACGTACGTAC")])
    cache = tmp_path / "cache"
    builds = _builds(monkeypatch)
    first = open_corpus(src, NUC, cache_dir=cache)
    _fa(src, [("r", "TTTTACGTAC")])  # same size, same name, new content
    os.utime(src, ns=(os.stat(first.meta["sources"][0]["path"]).st_atime_ns, 0))  # even with an old mtime
    again = open_corpus(src, NUC, cache_dir=cache)
    assert builds == [1, 1] and again.root != first.root
    assert NUC.decode(again.spans[0]) == "TTTTACGTAC"
    codon = open_corpus(src, CodonTokenizer(), cache_dir=cache)
    keep = open_corpus(_fa(tmp_path / "b.fa", [("r", "ACRTAC")]), NUC, cache_dir=cache, iupac="keep")
    n = open_corpus(tmp_path / "b.fa", NUC, cache_dir=cache, iupac="n")
    assert len({first.root, again.root, codon.root, keep.root, n.root}) == 5 and len(builds) == 5
    assert NUC.decode(keep.spans[0], skip_special=False) == "AC[UNK]TAC" and NUC.decode(n.spans[0]) == "ACNTAC"


def test_a_cache_that_disagrees_with_its_metadata_is_rebuilt(tmp_path, monkeypatch, caplog):
    src = _fa(tmp_path / "a.fa", _genes("g", 3))
    builds = _builds(monkeypatch)
    root = open_corpus(src, NUC, cache_dir=tmp_path / "c").root
    with open(root / "tokens.bin", "r+b") as f:  # a cache cut short (disk full, copied half)
        f.truncate(10)
    with caplog.at_level(logging.WARNING):
        again = open_corpus(src, NUC, cache_dir=tmp_path / "c")
    assert builds == [1, 1] and "does not match its meta.json" in caplog.text and len(again.tokens) == 90


def test_a_failed_or_killed_build_leaves_no_cache(tmp_path, monkeypatch):
    good = _fa(tmp_path / "a.fa", _genes("g", 3))
    bad = _fa(tmp_path / "b.fa", [("x", "ACGT"), ("y", "AC-T")])
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="b.fa: record 'y'"):
        open_corpus([good, bad], NUC, cache_dir=cache)
    assert os.listdir(cache) == []

    def killed(*a, **k):
        raise KeyboardInterrupt  # stands for SIGINT/SIGTERM in the middle of tokenizing
    monkeypatch.setattr(NucleotideTokenizer, "encode", killed)
    with pytest.raises(KeyboardInterrupt):
        open_corpus(good, NUC, cache_dir=cache)
    assert os.listdir(cache) == []
    monkeypatch.undo()
    # a SIGKILLed builder cannot clean up: its temporary directory is never read, and the next build removes it
    dead = cache / f".{'0' * 32}.tmp.{__import__('socket').gethostname()}.999999999"
    dead.mkdir()
    key_dir = open_corpus(good, NUC, cache_dir=cache).root
    stale = cache / f".{key_dir.name}.tmp.{__import__('socket').gethostname()}.999999999"
    stale.mkdir()
    (key_dir / "meta.json").unlink()  # force a rebuild of this key
    open_corpus(good, NUC, cache_dir=cache)
    assert not stale.exists() and (key_dir / "meta.json").exists()


def test_datasets_index_the_memmap_with_bounded_memory(tmp_path):
    rng = np.random.default_rng(0)
    genome = "".join(rng.choice(list("ACGT"), 200_000))
    corpus = open_corpus(_fa(tmp_path / "g.fa", [("g", genome)]), NUC, cache_dir=tmp_path / "c")
    train, val = load_datasets(corpus, NUC, dataset="windows", seq_len=8, stride=1, val_fraction=0.1)
    assert len(train) == 180_000 - 8 + 1 and train.spans.tokens is corpus.tokens
    # the index is per document, not per window (was a list of 180k (array, start) tuples)
    assert train._ends.nbytes + train._last.nbytes + train.spans.bounds.nbytes <= 64
    assert NUC.decode(train[12345]["input_ids"]) == genome[12345:12353]
    assert NUC.decode(val[0]["input_ids"]) == genome[180_000:180_008]
    tr, va = load_datasets(corpus, NUC, dataset="records", seq_len=64, val_fraction=0.1)
    assert len(tr) == 1 and NUC.decode(tr[0]["input_ids"]) == genome[:64]
    tr, va = load_datasets(corpus, NUC, dataset="packed", seq_len=64, val_fraction=0.1)
    assert len(tr) == 180_000 // 64 + 1 and tr._heads.nbytes < 8 * 3000  # O(pieces) int64, no Python list
    assert NUC.decode(tr[1]["input_ids"]) == genome[64:128]
    assert NUC.decode(va[0]["input_ids"]) == genome[180_000:180_064]


# ---------------------------------------------------------------------------------------------------------- split
def test_single_genome_keeps_the_held_out_end(tmp_path):
    seq = "".join(np.random.default_rng(1).choice(list("ACGT"), 1000))
    corpus = open_corpus(_fa(tmp_path / "g.fa", [("g", seq)]), NUC, cache_dir=tmp_path / "c")
    train, val = corpus.split(0.05)
    old_train, old_val = split_region(NUC.encode(seq), 0.05)
    assert np.array_equal(train[0], old_train) and np.array_equal(val[0], old_val) and len(train) == len(val) == 1


def test_record_split_is_the_id_hash_and_stable_when_files_are_added(tmp_path):
    ids = [f"rec{i}" for i in range(300)]
    h = np.array([record_hash(r) for r in ids], dtype=np.uint64)
    old = [int.from_bytes(__import__("hashlib").sha256(r.encode()).digest()[:8], "big") / 2**64 < 0.2 for r in ids]
    assert val_mask(h, 0.2).tolist() == old and split_records(ids, 0.2)[1] == np.flatnonzero(old).tolist()

    a = _fa(tmp_path / "a.fa", _genes("a", 60))
    b = _fa(tmp_path / "b.fa", _genes("b", 60, seed=1))

    def val_ids(sources):
        c = open_corpus(sources, NUC, cache_dir=tmp_path / "c")
        _, val = c.split(0.2)
        starts = {int(s): r for r, s in enumerate(c.offsets[:-1])}
        return {c.record_id(starts[int(s)]) for s in val.bounds[:, 0]}

    before = val_ids([a])
    after = val_ids([b, a])  # a file added, and in front
    assert before and before == {r for r in after if r.startswith("a")} and after - before
    c = open_corpus([a, b], NUC, cache_dir=tmp_path / "c")
    train, val = c.split(0.2, "region")  # every record's end held out
    assert len(train) == len(val) == 120 and (val.lengths == 6).all() and (train.lengths == 24).all()
    with pytest.raises(ValueError, match="split policy must be one of"):
        c.split(0.2, "random")


def test_duplicate_ids_are_kept_named_and_never_straddle_the_split(tmp_path, caplog):
    genes = _genes("g", 40)
    a = _fa(tmp_path / "a.fa", genes)
    b = _fa(tmp_path / "b.fa", genes[:10] + _genes("h", 30, seed=2))  # g0..g9 again
    with caplog.at_level(logging.WARNING):
        c = open_corpus([a, b], NUC, cache_dir=tmp_path / "c")
    assert c.meta["n_records"] == 80
    assert "10 record(s) repeat an earlier record id" in caplog.text
    assert f"{a}: record 'g0' (line 1)" in caplog.text and f"{b}: record 'g0' (line 1)" in caplog.text
    mask = val_mask(c.id_hash, 0.3)
    assert mask[:10].tolist() == mask[40:50].tolist()  # each duplicate on its original's side


def _val_files(corpus, val_fraction=0.3):
    """The source files each side of a file split draws from, by basename: ``(train, val)``; checks no file
    straddles."""
    train, val = corpus.split(val_fraction, "files")
    first = {int(s): r for r, s in enumerate(corpus.offsets[:-1])}
    record_file = np.memmap(corpus.root / "record_file.bin", dtype=np.uint32, mode="r")
    names = [os.path.basename(p) for p in corpus.paths]
    sides = [{names[record_file[first[int(s)]]] for s in spans.bounds[:, 0]} for spans in (train, val)]
    assert not sides[0] & sides[1] and len(train) + len(val) == corpus.meta["n_records"]
    return sides


def _file_corpus(root: Path, n_files: int, per_file: int = 3):
    return [_fa(root / f"sub{i % 2}" / f"f{i:02d}.fa", _genes(f"f{i}_", per_file, seed=i)) for i in range(n_files)]


def test_file_split_keeps_every_record_of_a_file_on_one_side_and_is_stable_when_files_are_added(tmp_path):
    files = _file_corpus(tmp_path / "corpus", 12)
    corpus = open_corpus(tmp_path / "corpus", NUC, cache_dir=tmp_path / "c")
    train, val = _val_files(corpus)
    assert train and val and len(train | val) == 12  # every file whole on one side (checked in _val_files)
    # not the record split: sides follow files, not ids
    assert corpus.split(0.3, "files")[1].bounds.tolist() != corpus.split(0.3, "records")[1].bounds.tolist()
    _fa(tmp_path / "elsewhere" / "new.fa", _genes("n", 3, seed=99))  # outside the corpus folder: a new common root
    extra = _file_corpus(tmp_path / "corpus2", 20)[12:]
    grown = open_corpus([str(tmp_path / "elsewhere"), *map(str, extra), *map(str, files)], NUC,
                        cache_dir=tmp_path / "c")
    train2, val2 = _val_files(grown)
    assert train <= train2 and val <= val2 and len(train2 | val2) == 21  # old files kept their side


def test_file_split_is_independent_of_where_the_corpus_folder_lies(tmp_path):
    _file_corpus(tmp_path / "a" / "corpus", 12)
    sides = _val_files(open_corpus(tmp_path / "a" / "corpus", NUC, cache_dir=tmp_path / "c"))
    __import__("shutil").copytree(tmp_path / "a" / "corpus", tmp_path / "b" / "deeper" / "moved")
    for cache in ("c", "c2"):  # the same cache (reused: keyed by content) and a fresh build
        moved = open_corpus(tmp_path / "b" / "deeper" / "moved", NUC, cache_dir=tmp_path / cache)
        assert moved.paths[0].startswith(str(tmp_path / "b")) and _val_files(moved) == sides


def test_file_split_with_an_empty_side_names_the_policy_files_and_fraction(tmp_path):
    one = open_corpus(_fa(tmp_path / "one.fa", _genes("g", 50)), NUC, cache_dir=tmp_path / "c")
    assert len(one.split(0.3, "records")[1])  # 50 records would split by id, but one file cannot
    with pytest.raises(ValueError, match=r"^1 file\(s\) cannot be split by files with val_fraction=0.3: one side is "
                                         r"empty \(use more files"):
        one.split(0.3, "files")
    same = [_fa(tmp_path / f"s{i}" / "contigs.fa", _genes(f"s{i}_", 2, seed=i)) for i in range(4)]
    c = open_corpus(same, NUC, cache_dir=tmp_path / "c")
    with pytest.raises(ValueError, match=r"^4 file\(s\) \(1 distinct basename\(s\): files sharing one share a side\) "
                                         r"cannot be split by files with val_fraction=0.3"):
        c.split(0.3, "files")


def test_file_split_is_a_config_choice(tmp_path):
    from ds4sci.train.config import load_config

    assert load_config(None, ["data.split=files"]).data.split == "files"
    with pytest.raises(ValueError, match="expected auto, region, records or files"):
        load_config(None, ["data.split=file"])
    _file_corpus(tmp_path / "corpus", 12)
    corpus = open_corpus(tmp_path / "corpus", NUC, cache_dir=tmp_path / "c")
    train, val = load_datasets(corpus, NUC, dataset="records", seq_len=64, val_fraction=0.3, split="files")
    assert len(train) + len(val) == 36 and len(val) == 3 * len(_val_files(corpus)[1])


def _two_genomes(root: Path, length: int = 3000):
    """Two single-record genome files, one gzipped, as a user's glob finds them."""
    rng = np.random.default_rng(3)
    _fa(root / "g1.fasta", [("NC_1", "".join(rng.choice(list("ACGT"), length)))])
    _fa(root / "g2.fasta.gz", [("NC_2", "".join(rng.choice(list("ACGT"), length + 500)))], gz=True)
    return str(root / "*.fasta*")


def test_two_genomes_hold_out_the_end_of_each(tmp_path):
    corpus = open_corpus(_two_genomes(tmp_path / "g"), NUC, cache_dir=tmp_path / "c")
    assert corpus.meta["n_records"] == 2 and choose_split(corpus.id_hash, 0.02) == "region"
    train, val = corpus.split(0.02)  # auto
    assert len(train) == len(val) == 2 and val.lengths.tolist() == [60, 70]  # 2% of 3000 and of 3500 bases
    assert (train.bounds[:, 1] == val.bounds[:, 0]).all() and (train.lengths + val.lengths).tolist() == [3000, 3500]
    # what auto chose before: a record split of two genomes, refused as ever when asked for by name
    with pytest.raises(ValueError, match=r"^2 record\(s\) cannot be split by records with val_fraction=0.02: one "
                                         r"side is empty \(use more records"):
        corpus.split(0.02, "records")
    assert describe_split(corpus.id_hash, 0.02) == (
        "region: the last 2% of every record held out (data.split auto: 2 record(s), fewer than 250 = 5 / "
        "val_fraction for a record split)")
    assert describe_split(corpus.id_hash, 0.02, "region").endswith("held out (data.split region)")


def _hashes(n, val_fraction, sides="both"):
    """Id hashes of ``n`` records ``r0, r1, ...``, or (``sides="train"``) of the first ``n`` ids that all fall on the
    training side."""
    ids = (f"r{i}" for i in itertools.count())
    if sides == "train":
        ids = (r for r in ids if not val_mask(np.array([record_hash(r)], dtype=np.uint64), val_fraction)[0])
    return np.array([record_hash(r) for r in itertools.islice(ids, n)], dtype=np.uint64)


def test_auto_splits_records_from_five_expected_validation_records_on():
    assert [auto_min_records(f) for f in (0.02, 0.05, 0.1, 0.2, 0.3)] == [250, 100, 50, 25, 17]
    least = auto_min_records(0.1)
    at, below = _hashes(least, 0.1), _hashes(least - 1, 0.1)
    assert 0 < val_mask(at, 0.1).sum() < least and 0 < val_mask(below, 0.1).sum()  # a record split would work at both
    assert choose_split(at, 0.1) == "records" and choose_split(below, 0.1) == "region"
    assert describe_split(at, 0.1) == ("records: whole records by a hash of their id (data.split auto: 50 records, "
                                       "at least 50 = 5 / val_fraction)")
    assert choose_split(_hashes(1, 0.1), 0.1) == "region"  # one genome, as before
    # enough records, but none hashed into validation: auto holds out their ends; asked for by name, refused
    none_in_val = _hashes(least, 0.1, sides="train")
    assert choose_split(none_in_val, 0.1) == "region"
    assert "their id hashes leave validation empty" in describe_split(none_in_val, 0.1)
    spans = Spans.from_arrays([np.arange(10)] * least)
    train, val = split_spans(spans, none_in_val, 0.1)
    assert len(train) == len(val) == least and (val.lengths == 1).all()
    with pytest.raises(ValueError, match=r"^50 record\(s\) cannot be split by records with val_fraction=0.1"):
        split_spans(spans, none_in_val, 0.1, "records")
    assert [choose_split(at, 0.1, p) for p in ("region", "records", "files")] == ["region", "records", "files"]
    with pytest.raises(ValueError, match="split policy must be one of"):
        choose_split(at, 0.1, "random")


@pytest.mark.slow  # a training in a new process through the command line
def test_training_start_up_names_the_split_auto_chose(tmp_path):
    """``ds4sci train`` on a glob of two genomes: trains (was: stopped with "cannot be split by records"), and its
    start-up block says which split ``data.split: auto`` chose and why."""
    import json

    config = tmp_path / "two.yaml"
    config.write_text(json.dumps({  # JSON is YAML
        "data": {"fasta": _two_genomes(tmp_path / "genomes"), "seq_len": 32, "val_fraction": 0.02},
        "train": {"steps": 1, "micro_batch_size": 2, "log_every": 1, "eval_every": 1, "eval_batches": 1,
                  "progress": False, "out_dir": str(tmp_path / "run")}}))
    proc = run_in_fork(["train", str(config)], os.getcwd(), env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"},
                       timeout=300)  # a lone process (forked: tests/fork_checks.py)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("  split       region: the last 2% of every record held out (data.split auto: 2 record(s), fewer than "
            "250 = 5 / val_fraction for a record split)\n") in proc.stderr
    assert "validation 130 tokens" in proc.stderr


def test_cache_build_shows_a_progress_bar_only_when_asked_on_a_terminal(tmp_path, capfd, monkeypatch):
    src = _fa(tmp_path / "a.fa", _genes("g", 5, 40))
    open_corpus(src, NUC, cache_dir=tmp_path / "quiet", progress=False)
    assert capfd.readouterr().err == ""
    open_corpus(src, NUC, cache_dir=tmp_path / "redirected", progress=True)  # stderr is no terminal: no bar frames
    assert capfd.readouterr().err == ""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    open_corpus(src, NUC, cache_dir=tmp_path / "loud", progress=True)
    err = capfd.readouterr().err
    assert "tokenizing 1 FASTA file(s)" in err and "100%" in err
    open_corpus(src, NUC, cache_dir=tmp_path / "loud", progress=True)  # reused: nothing to tokenize, no bar
    assert capfd.readouterr().err == ""


# --------------------------------------------------------------------------------------------- data-parallel ranks
def _micro_batches(ds, dp, micro, indices, seed=7):
    """Run the trainer's own sampler (Trainer._micro_batch) for each data-parallel rank, without a Trainer."""
    from ds4sci.distributed import ParallelDims
    from ds4sci.train.trainer import Trainer

    out = []
    for rank in range(dp):
        fake = SimpleNamespace(
            cfg=SimpleNamespace(train=SimpleNamespace(micro_batch_size=micro, grad_accum=1, seed=seed),
                                data=SimpleNamespace(dataset="windows")),
            dims=ParallelDims(dp=dp), groups=SimpleNamespace(dp_rank=rank, sp_rank=0), device="cpu")
        out.append([Trainer._micro_batch(fake, ds, i, shuffle=True)["input_ids"] for i in indices])
    return out


def test_data_parallel_ranks_read_disjoint_windows_and_resume_continues_the_order(tmp_path):
    n = 48  # windows of 4 tokens over a memory-mapped array whose values are their positions: window i starts with 4i
    mm = np.memmap(tmp_path / "t.bin", dtype=np.int64, mode="w+", shape=(4 * n,))
    mm[:] = np.arange(4 * n)
    ds = WindowDataset(Spans(np.memmap(tmp_path / "t.bin", dtype=np.int64, mode="r"), [[0, 96], [96, 4 * n]]), NUC, 4)
    assert len(ds) == n
    per_epoch = n // (2 * 3)  # global micro-batches per epoch: dp=2 ranks x 3 samples
    ranks = _micro_batches(ds, dp=2, micro=3, indices=range(per_epoch))
    taken = [[int(w[0]) // 4 for b in r for w in b] for r in ranks]
    assert len(set(taken[0])) == len(taken[0]) == n // 2 and not set(taken[0]) & set(taken[1])  # disjoint, whole epoch
    # resume: the micro-batch at index k depends on k only, so a fresh sampler restarted at step 5 continues exactly
    straight = _micro_batches(ds, dp=2, micro=3, indices=range(12))
    resumed = _micro_batches(ds, dp=2, micro=3, indices=range(5, 12))
    for r in range(2):
        assert all((a == b).all() for a, b in zip(straight[r][5:], resumed[r], strict=True))
    assert not all((a == b).all() for a, b in zip(straight[0][:4], straight[0][8:12]))  # the next epoch is reshuffled


# ---------------------------------------------------------------------------------------------------- distributed
def _ranks_open(rank, world, cases):
    from ds4sci.data import corpus as cm

    results = []
    real = cm.iter_raw_records
    for fasta, cache in cases:
        reads = []
        cm.iter_raw_records = lambda *a, **k: reads.append(rank) or real(*a, **k)
        try:
            c = cm.open_corpus(fasta, NucleotideTokenizer(), cache_dir=cache)
            result = (str(c.root), int(c.meta["n_tokens"]))
        except (OSError, ValueError) as err:
            result = (type(err).__name__, str(err))
        results.append((result, len(reads)))
    return results


@pytest.mark.distributed
def test_rank_zero_builds_other_ranks_map_and_errors_reach_every_rank(tmp_path):
    good = _fa(tmp_path / "a.fa", _genes("g", 4))
    bad = _fa(tmp_path / "b.fa", [("x", "AC*T")])
    ranks = run_workers(_ranks_open, 2, [(str(good), str(tmp_path / "c")), (str(bad), str(tmp_path / "c2"))],
                        timeout=120)
    (ok0, bad0), (ok1, bad1) = ranks
    assert ok0[0] == ok1[0] and ok0[0][1] == 120
    assert ok0[1] == 1 and ok1[1] == 0  # only rank 0 read FASTA
    assert [bad0[0][0], bad1[0][0]] == ["ValueError", "ValueError"]  # rank 0's error on every rank, no hang
    assert "record 'x'" in bad1[0][1] and bad1[1] == 0
