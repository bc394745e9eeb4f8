"""Bad FASTA input: one message naming the file, record and line; nothing cached after a failure."""
import gzip
import logging
import os

import pytest

from ds4sci.data import CodonTokenizer
from ds4sci.data import NucleotideTokenizer
from ds4sci.data import open_corpus
from ds4sci.data import read_fasta

NUC = NucleotideTokenizer()


def _file(tmp_path, data: bytes, name="x.fa"):
    path = tmp_path / name
    path.write_bytes(data)
    return path


BAD = [
    ("fastq", b"@read1\nACGT\n+\nIIII\n", r"x.fa: looks like FASTQ \(line 1 starts with '@'\)"),
    ("genbank", b"LOCUS       NC_000913 4641652 bp DNA\nORIGIN\n", r"x.fa: looks like GenBank/EMBL \(line 1"),
    ("binary", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", r"x.fa: line 1: binary data .*not a text FASTA file"),
    ("binary NUL", b">r\nAC\x00GT\n", r"x.fa: line 2: binary data \(NUL byte\)"),
    ("bzip2", b"BZh91AY&SY\x00\x01", r"x.fa: bzip2-compressed; only plain or gzip"),
    ("empty", b"", r"x.fa: empty file: no FASTA record"),
    ("blank only", b"\n\r\n  \n", r"x.fa: empty file: no FASTA record"),
    ("sequence first", b"\nACGTACGT\n>r\nACGT\n", r"x.fa: sequence data at line 2 before any '>' header"),
    ("no id", b">r1\nACGT\n> \nACGT\n", r"x.fa: line 3: header '>' without a record id"),
    ("bad char", b">r1\nACGT\n>r2 two\nACGT\nAC.T\n", r"x.fa: record 'r2' \(header line 3\): invalid nucleotide "
     r"character '\.' at line 5, column 3 \(position 7 in the record; 1 invalid character\(s\)"),
    ("space inside", b">r1\nAC GT\n", r"invalid nucleotide character ' ' at line 2, column 3"),
    ("non-ascii", ">r1\nACGÄ\n".encode(),
     r"record 'r1' \(header line 1\): invalid nucleotide character byte 0xc3 at line 2"),
]


@pytest.mark.parametrize("data,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_files_are_named_with_the_line_and_leave_no_cache(tmp_path, data, message):
    path = _file(tmp_path, data)
    with pytest.raises(ValueError, match=message):
        list(read_fasta(path))
    with pytest.raises(ValueError, match=message):
        open_corpus([_file(tmp_path, b">ok\nACGT\n", "ok.fa"), path], NUC, cache_dir=tmp_path / "cache")
    assert os.listdir(tmp_path / "cache") == []


@pytest.mark.parametrize("cut", [0.5, 0.95])
def test_truncated_gzip_is_named(tmp_path, cut):
    data = gzip.compress(b">r1\n" + b"ACGT" * 5000 + b"\n>r2\nACGT\n")
    path = _file(tmp_path, data[: int(len(data) * cut)], "x.fa.gz")
    with pytest.raises(ValueError, match=r"x.fa.gz: truncated or corrupt gzip data after line \d+"):
        list(read_fasta(path))
    with pytest.raises(ValueError, match="truncated or corrupt gzip"):
        open_corpus(path, NUC, cache_dir=tmp_path / "cache")
    assert os.listdir(tmp_path / "cache") == []


def test_crlf_blank_lines_and_trailing_spaces_are_accepted(tmp_path):
    path = _file(tmp_path, b"\r\n>r1 desc\r\nac gt\r\n".replace(b" gt", b"gt  ") + b"\r\n\r\nNN\r\n>r2\r\n\r\nU\r\n")
    assert [(r.id, r.description, r.sequence, r.line) for r in read_fasta(path)] == [
        ("r1", "r1 desc", "ACGTNN", 2), ("r2", "r2", "T", 7)]


def test_header_without_sequence_is_skipped_and_named(tmp_path, caplog):
    path = _file(tmp_path, b">r1\nACGT\n>empty one\n\n>r3\nAC\n>last\n")
    with caplog.at_level(logging.WARNING):
        assert [r.id for r in read_fasta(path)] == ["r1", "r3"]
    assert "x.fa: record 'empty' (line 3) has no sequence; skipped" in caplog.text
    assert "x.fa: record 'last' (line 7) has no sequence; skipped" in caplog.text


def test_record_shorter_than_one_token_is_skipped_and_named(tmp_path, caplog):
    path = _file(tmp_path, b">g1\nATGAAATAA\n>tiny\nAT\n>g3\nATGTAA\n")
    with caplog.at_level(logging.WARNING):
        corpus = open_corpus(path, CodonTokenizer(), cache_dir=tmp_path / "c")
    assert corpus.meta["n_records"] == 2 and corpus.meta["skipped_short"] == 1
    assert [corpus.record_id(r) for r in range(2)] == ["g1", "g3"]
    assert "x.fa: record 'tiny' (line 3) is shorter than one codon token (2 bases); skipped" in caplog.text
    only_short = _file(tmp_path, b">a\nAT\n>b\nG\n", "short.fa")
    with pytest.raises(ValueError, match=r"short.fa: no record of at least one codon token \(2 too short\)"):
        open_corpus(only_short, CodonTokenizer(), cache_dir=tmp_path / "c2")
    assert not (tmp_path / "c2").exists() or os.listdir(tmp_path / "c2") == []


def test_cli_reports_bad_fasta_in_one_line_without_traceback(tmp_path, capsys):
    from ds4sci.cli import main

    path = _file(tmp_path, b">r1\nACGT\n>r2\nAC-T\n")
    rc = main(["train", "--set", f"data.fasta={path}", "--set", f"train.out_dir={tmp_path / 'run'}",
               "--set", "train.steps=1", "--set", "train.progress=false"])
    err = capsys.readouterr().err
    assert rc != 0 and "Traceback" not in err
    assert f"{path}: record 'r2' (header line 3): invalid nucleotide character '-' at line 4, column 3" in err
    assert os.listdir(tmp_path / "run" / "token_cache") == []
