"""FASTA policy, tokenizers (GenSLM id compatibility), datasets and splits."""
import gzip
from pathlib import Path

import numpy as np
import pytest
import torch

from ds4sci.data import CodonTokenizer
from ds4sci.data import NucleotideTokenizer
from ds4sci.data import PackedDataset
from ds4sci.data import RecordDataset
from ds4sci.data import Spans
from ds4sci.data import Tokenizer
from ds4sci.data import WindowDataset
from ds4sci.data import collate
from ds4sci.data import read_fasta
from ds4sci.data import split_records
from ds4sci.data import split_region
from ds4sci.data import split_spans
from ds4sci.models.genslm import IGNORE_INDEX

DATA = Path(__file__).resolve().parents[2] / "examples" / "data"


def _write(tmp_path, text, name="x.fa", gz=False, newline="\n"):
    path = tmp_path / name
    data = text.replace("\n", newline).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_read_fasta_multi_record_lowercase(tmp_path, gz, newline):
    path = _write(tmp_path, ">r1 first one\nacgT\nNNac\n>r2\nGGGG\n", gz=gz, newline=newline)
    recs = list(read_fasta(path))
    assert [(r.id, r.description, r.sequence) for r in recs] == [
        ("r1", "r1 first one", "ACGTNNAC"),
        ("r2", "r2", "GGGG"),
    ]


def test_iupac_policies(tmp_path):
    path = _write(tmp_path, ">r\nACRYGU\n")
    assert next(read_fasta(path)).sequence == "ACNNGT"
    assert next(read_fasta(path, iupac="keep")).sequence == "ACRYGT"
    with pytest.raises(ValueError, match=r"ambiguous IUPAC code 'R' at line 2, column 3"):
        next(read_fasta(path, iupac="error"))
    with pytest.raises(ValueError, match="iupac must be"):
        next(read_fasta(path, iupac="bogus"))


def test_bad_character_names_file_record_position(tmp_path):
    path = _write(tmp_path, ">ok\nACGT\n>bad_one\nACG\nT-A\n")
    with pytest.raises(ValueError) as err:
        list(read_fasta(path))
    msg = str(err.value)
    assert str(path) in msg and "'bad_one'" in msg and "'-'" in msg and "position 5" in msg
    assert "line 5, column 2" in msg and "header line 3" in msg


def test_empty_record_skipped_and_not_fasta_rejected(tmp_path, caplog):
    path = _write(tmp_path, ">empty\n>full\nAC\n")
    assert [r.id for r in read_fasta(path)] == ["full"]
    assert "empty" in caplog.text
    with pytest.raises(ValueError, match="line 1 does not start with '>'.*not a FASTA file"):
        list(read_fasta(_write(tmp_path, "hello world\n", name="y.txt")))
    binary = tmp_path / "z.bin"
    binary.write_bytes(b">r\nAC\xff\xfe\n")
    with pytest.raises(ValueError, match="invalid nucleotide character byte 0xff at line 2, column 3"):
        list(read_fasta(binary))


def test_bundled_genome_tokenises():
    (rec,) = list(read_fasta(DATA / "NC_007779.1_ecoli_K12_W3110.fasta.gz"))
    ids = NucleotideTokenizer().encode(rec.sequence)
    assert ids.shape == (4_646_332,) and ids.dtype == np.int64
    assert set(np.unique(ids).tolist()) == {5, 6, 7, 8}


def test_codon_ids_match_genslm_table():
    rows = [line.split("\t") for line in (DATA / "genslm_codon_vocab_69.tsv").read_text().splitlines()[1:]]
    tok = CodonTokenizer()
    assert tok.vocab_size == 69
    assert {t: int(i) for t, i in rows} == tok.token_to_id


def test_codon_encode_decode_ambiguous_and_partial():
    tok = CodonTokenizer()
    ids = tok.encode("ATGgccNAATAAGC")
    assert ids.tolist() == [tok.token_to_id["ATG"], tok.token_to_id["GCC"], tok.unk_id, tok.token_to_id["TAA"]]
    assert tok.decode(ids) == "ATGGCCTAA" and tok.decode(ids, skip_special=False) == "ATGGCC[UNK]TAA"
    with pytest.raises(ValueError, match="not a multiple of 3"):
        CodonTokenizer(partial="error").encode("ATGA")


def test_nucleotide_round_trip_and_reverse_complement():
    tok = NucleotideTokenizer()
    seq = "ACGTNACCGT"
    ids = tok.encode(seq)
    assert tok.decode(ids) == seq
    assert tok.decode(tok.reverse_complement(ids)) == "ACGGTNACGT"
    assert tok.encode("AXG").tolist() == [5, tok.unk_id, 7]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([99])


@pytest.mark.parametrize("name", ["nucleotide", "codon"])
def test_tokenizer_save_load(tmp_path, name):
    tok = Tokenizer.from_name(name)
    tok.save(tmp_path / "t.json")
    again = Tokenizer.load(tmp_path / "t.json")
    assert type(again) is type(tok) and again.vocab == tok.vocab
    with pytest.raises(ValueError, match="unknown tokenizer"):
        Tokenizer.from_name("bpe")


def test_cds_file_codon_records():
    tok = CodonTokenizer(partial="error")
    recs = list(read_fasta(DATA / "NZ_CP040672.1_cds_100.fna"))
    arrays = [tok.encode(r.sequence) for r in recs]
    assert len(arrays) == 100 and sum(map(len, arrays)) == 89_094 // 3
    assert all(a[-1] in tok.stop_ids for a in arrays)


def test_window_dataset_covers_genome_with_stride_and_pads_tail():
    tok = NucleotideTokenizer()
    arr = np.arange(25) % 4 + 5
    ds = WindowDataset([arr], tok, seq_len=8, stride=6)
    starts = [ds.window(i)[1] for i in range(len(ds))]
    assert starts == [0, 6, 12, 17]  # the tail window ends exactly at the end
    s = ds[3]
    assert s["input_ids"].tolist() == arr[17:25].tolist() and (s["labels"] == s["input_ids"]).all()
    short = WindowDataset([arr[:5]], tok, seq_len=8)[0]
    assert short["input_ids"][5:].tolist() == [tok.pad_id] * 3
    assert short["labels"][5:].tolist() == [IGNORE_INDEX] * 3 and short["doc_ids"][5:].tolist() == [-1] * 3


def test_reverse_complement_augmentation_is_seeded_and_nucleotide_only():
    tok = NucleotideTokenizer()
    arr = tok.encode("ACGTTGCAAC" * 4)
    ds = WindowDataset([arr], tok, seq_len=8, reverse_complement=1.0, seed=1)
    assert tok.decode(ds[0]["input_ids"]) == "TGCAACGT" and ds[0]["labels"].tolist() == ds[0]["input_ids"].tolist()

    def windows(d):
        return [d[i]["input_ids"].tolist() for i in range(len(d))]

    half = windows(WindowDataset([arr], tok, seq_len=8, stride=2, reverse_complement=0.5, seed=3))
    assert half == windows(WindowDataset([arr], tok, seq_len=8, stride=2, reverse_complement=0.5, seed=3))
    plain = windows(WindowDataset([arr], tok, seq_len=8, stride=2))
    flipped = sum(h != p for h, p in zip(half, plain))
    assert 0 < flipped < len(plain)
    with pytest.raises(ValueError, match="reading frame"):
        WindowDataset([arr], CodonTokenizer(), seq_len=8, reverse_complement=0.5)


def test_packed_dataset_documents_positions_labels():
    tok = NucleotideTokenizer()
    docs = [np.full(3, 5), np.full(4, 6), np.full(6, 7), np.full(10, 8)]
    ds = PackedDataset(docs, tok, seq_len=8)
    assert len(ds) == 4  # [3+4], [6], [8 of 10], [2 of 10]
    w = ds[0]
    assert w["doc_ids"].tolist() == [0, 0, 0, 1, 1, 1, 1, -1]
    assert w["position_ids"][:7].tolist() == [0, 1, 2, 0, 1, 2, 3]
    assert w["labels"].tolist() == [5, 5, 5, IGNORE_INDEX, 6, 6, 6, IGNORE_INDEX]
    assert ds[3]["input_ids"][:2].tolist() == [8, 8] and ds[3]["labels"][2:].eq(IGNORE_INDEX).all()


def test_record_dataset_truncates_and_pads():
    tok = CodonTokenizer()
    ds = RecordDataset([np.arange(5, 15), np.arange(5, 8)], tok, seq_len=6)
    assert ds[0]["input_ids"].tolist() == list(range(5, 11))
    assert ds[1]["labels"].tolist() == [5, 6, 7] + [IGNORE_INDEX] * 3
    batch = collate([ds[0], ds[1]])
    assert batch["input_ids"].shape == (2, 6) and batch["input_ids"].dtype == torch.int64


# (length, val_fraction, tokens held out by hand): the nearest whole count to val_fraction x length, at least one
SHORT_REGIONS = [
    (1, 0.1, 1),   # 0.1 -> 0 -> at least one: the whole record is held out
    (2, 0.1, 1),   # 0.2 -> 0 -> 1, one token left to train
    (3, 0.2, 1),   # 0.6 -> 1
    (9, 0.02, 1),  # 0.18 -> 0 -> 1
    (19, 0.1, 2),  # 1.9 -> 2
    (40, 0.1, 4),
]


@pytest.mark.parametrize("length, val_fraction, held", SHORT_REGIONS)
def test_split_region_holds_out_at_least_one_token_of_a_short_record(length, val_fraction, held):
    """``split_region`` holds out the last ``val_fraction`` of a record, and at least one token even when
    ``val_fraction x length < 1`` (documented in ``_region_cut``): exact counts by hand, the val side is the end."""
    train, val = split_region(np.arange(length), val_fraction)
    assert (len(train), len(val)) == (length - held, held)
    assert val.tolist() == list(range(length - held, length)) and train.tolist() == list(range(length - held))


def test_region_split_of_spans_holds_out_one_token_of_every_short_record():
    """``split_spans(..., "region")`` applies the same rule to every document at once: each short record gives at
    least one token to validation; the one-token record goes to validation whole and has no train span."""
    lengths = [length for length, _, _ in SHORT_REGIONS]
    spans = Spans.from_arrays([np.full(n, i) for i, n in enumerate(lengths)])
    train, val = split_spans(spans, np.zeros(len(lengths), dtype=np.uint64), 0.1, "region")
    held = [1, 1, 1, 1, 2, 4]  # at 0.1: 0.1 0.2 0.3 0.9 1.9 4.0 of a token -> 1 1 1 1 2 4
    assert val.lengths.tolist() == held
    assert train.lengths.tolist() == [n - h for n, h in zip(lengths, held) if n > h]  # record 0 only in val
    assert val.bounds[:, 1].tolist() == spans.bounds[:, 1].tolist()  # each record's END is held out
    assert train.bounds[:, 0].tolist() == spans.bounds[1:, 0].tolist()


def test_splits_are_disjoint_and_deterministic():
    arr = np.arange(1000)
    train, val = split_region(arr, 0.1)
    assert len(val) == 100 and train[-1] + 1 == val[0] and len(train) + len(val) == 1000
    ids = [f"rec{i}" for i in range(200)]
    a = split_records(ids, 0.2)
    assert a == split_records(list(ids), 0.2) and not set(a[0]) & set(a[1])
    assert 20 < len(a[1]) < 60
    with pytest.raises(ValueError, match="val_fraction"):
        split_region(arr, 1.5)
