"""Property-based tests (hypothesis) of the FASTA reader, tokenizers and token cache against simple oracles, on
generated files: random case, line widths, IUPAC codes, U, blank lines, CRLF, gzip."""
import gzip
import io
import tempfile
from pathlib import Path

import numpy as np
from Bio import SeqIO
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from ds4sci.data import CodonTokenizer
from ds4sci.data import NucleotideTokenizer
from ds4sci.data import open_corpus
from ds4sci.data import read_fasta

BASES = "ACGTNUacgtnu"
IUPAC = "RYSWKMBDHVryswkmbdhv"
CODONS = CodonTokenizer().token_to_id


def oracle_sequence(raw: str, iupac: str) -> str:
    """The documented policy, one character at a time."""
    out = []
    for ch in raw.upper():
        ch = "T" if ch == "U" else ch
        out.append("N" if iupac == "n" and ch in IUPAC.upper() else ch)
    return "".join(out)


def oracle_nucleotide(seq: str) -> list[int]:
    table = {b: 5 + i for i, b in enumerate("ACGTN")}
    return [table.get(ch.upper(), 0) for ch in seq]


def oracle_codon(seq: str) -> list[int]:
    seq = seq.upper()
    return [CODONS.get(seq[i : i + 3], 0) for i in range(0, len(seq) - len(seq) % 3, 3)]


records = st.lists(
    st.tuples(st.text("abcXYZ019_.|-", min_size=1, max_size=8),  # ids: no whitespace
              st.text(" abc", max_size=6),  # description after the id
              st.text(BASES + IUPAC, min_size=0, max_size=120)),
    min_size=1, max_size=6)
layout = st.fixed_dictionaries({
    "width": st.integers(1, 80),  # line width of the sequence (some files unwrapped: width >= length)
    "newline": st.sampled_from(["\n", "\r\n"]),
    "blank": st.lists(st.booleans(), min_size=8, max_size=8),  # blank lines before headers / sequence lines
    "final_newline": st.booleans(),
    "gz": st.booleans(),
})


def write(path: Path, recs, lay) -> None:
    nl, lines = lay["newline"], []
    for i, (rid, desc, seq) in enumerate(recs):
        if lay["blank"][i % 8]:
            lines.append("")
        lines.append(f">{rid} {desc}".rstrip())
        for j in range(0, len(seq), lay["width"]):
            if lay["blank"][(i + j) % 8] and j:
                lines.append("")
            lines.append(seq[j : j + lay["width"]])
    data = (nl.join(lines) + (nl if lay["final_newline"] else "")).encode()
    path.write_bytes(gzip.compress(data) if lay["gz"] else data)


@settings(max_examples=80, deadline=None)
@given(recs=records, lay=layout, iupac=st.sampled_from(["n", "keep"]))
def test_reader_matches_the_oracle_and_biopython(recs, lay, iupac):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "g.fa"
        write(path, recs, lay)
        got = [(r.id, r.description, r.sequence) for r in read_fasta(path, iupac=iupac)]
        want = [(rid, f"{rid} {desc}".rstrip(), oracle_sequence(seq, iupac)) for rid, desc, seq in recs if seq]
        assert got == want
        opener = gzip.open if lay["gz"] else open
        with opener(path, "rt") as handle:  # Biopython agrees on ids and (uppercased) sequences of valid files
            text = io.StringIO(handle.read().lstrip())  # (it refuses blank lines before the first header)
            bio = [(r.id, oracle_sequence(str(r.seq), iupac)) for r in SeqIO.parse(text, "fasta") if len(r.seq)]
        assert bio == [(g[0], g[2]) for g in got]


@settings(max_examples=200, deadline=None)
@given(seq=st.text(BASES + IUPAC + "X*", max_size=60))
def test_tokenizers_match_the_oracle(seq):
    assert NucleotideTokenizer().encode(seq).tolist() == oracle_nucleotide(seq)
    assert NucleotideTokenizer().encode(seq.encode()).tolist() == oracle_nucleotide(seq)
    assert CodonTokenizer().encode(seq).tolist() == oracle_codon(seq)


@settings(max_examples=30, deadline=None)
@given(recs=records, lay=layout, kind=st.sampled_from(["nucleotide", "codon"]))
def test_token_cache_holds_the_oracle_tokens(recs, lay, kind):
    tok = NucleotideTokenizer() if kind == "nucleotide" else CodonTokenizer()
    oracle = oracle_nucleotide if kind == "nucleotide" else oracle_codon
    want = [(rid, oracle(oracle_sequence(seq, "n"))) for rid, _, seq in recs]
    want = [(rid, ids) for rid, ids in want if ids]  # empty and shorter-than-one-token records are skipped
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "g.fa"
        write(path, recs, lay)
        if not want:
            try:
                open_corpus(path, tok, cache_dir=Path(tmp) / "c")
            except ValueError as err:
                assert "no record of at least one" in str(err) or "empty file" not in str(err)
                return
            raise AssertionError("a corpus without any token was accepted")
        corpus = open_corpus(path, tok, cache_dir=Path(tmp) / "c")
        got = [(corpus.record_id(r), np.asarray(corpus.spans[r]).tolist()) for r in range(len(corpus.spans))]
        assert got == want
