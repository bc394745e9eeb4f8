"""``ds4sci score-variants``: LLRs of SNVs and indels on a piece of the bundled E. coli genome equal the difference of
two ``ds4sci score --reverse-complement`` runs, REF windows are shared, bad lines are all named."""
import csv
import gzip
import io
from pathlib import Path

import pytest
import torch
from Bio import bgzf

from ds4sci.cli import main
from ds4sci.data import CodonTokenizer
from ds4sci.data import FastaRecord
from ds4sci.data import NucleotideTokenizer
from ds4sci.infer import variants as variants_module
from ds4sci.infer.parallel import ShardedForward
from ds4sci.infer.score import score_records
from ds4sci.infer.variants import Variant
from ds4sci.infer.variants import default_window
from ds4sci.infer.variants import read_variants
from ds4sci.infer.variants import reference_window
from ds4sci.infer.variants import score_variants
from ds4sci.io.export import export_consolidated
from ds4sci.io.weights import load_model
from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm import GenSLMConfig

from cli_checks import refused

ECOLI = Path(__file__).resolve().parents[2] / "examples/data/NC_007779.1_ecoli_K12_W3110.fasta.gz"
CONTEXT = 32
CHROM = "NC_007779.1"
VCF_HEADER = ("##fileformat=VCFv4.2\n"
              f"##contig=<ID={CHROM},length=200>\n##contig=<ID=short,length=12>\n"
              "#CHROM\tPOS\tID\tREF\tALT\tQUAL\tFILTER\tINFO\n")


def genome_prefix(bases: int) -> str:
    with gzip.open(ECOLI, "rt") as f:
        assert f.readline().startswith(">" + CHROM)
        text = ""
        while len(text) < bases:
            text += f.readline().strip()
    return text[:bases]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A reference of two records cut from the E. coli genome (``NC_007779.1``: its first 200 bases; ``short``: the
    next 12, shorter than any window), variants on it (VCF and TSV) and nucleotide and codon exports."""
    root = tmp_path_factory.mktemp("variants")
    genome = genome_prefix(212)
    reference = {CHROM: genome[:200], "short": genome[200:212]}
    (root / "ref.fa").write_text("".join(f">{name} piece of {CHROM}\n{seq}\n" for name, seq in reference.items()))

    def at(chrom, pos, length=1):  # the reference bases at a 1-based position
        return reference[chrom][pos - 1 : pos - 1 + length]

    def other(base):
        return "ACGT"[("ACGT".index(base) + 1) % 4]

    # (chrom, pos, id, ref, alts): near both record ends, multi-allelic sites, deletions, insertions, an MNV
    sites = [
        (CHROM, 1, "first", at(CHROM, 1), [other(at(CHROM, 1)), other(other(at(CHROM, 1)))]),
        (CHROM, 3, ".", at(CHROM, 3), [other(at(CHROM, 3))]),
        (CHROM, 50, "del3", at(CHROM, 50, 4), [at(CHROM, 50)]),
        (CHROM, 100, "ins3", at(CHROM, 100), [at(CHROM, 100) + "GTA"]),
        (CHROM, 120, "sat", at(CHROM, 120), [b for b in "ACGT" if b != at(CHROM, 120)]),
        (CHROM, 150, "mnv", at(CHROM, 150, 2), [other(at(CHROM, 150)) + other(at(CHROM, 151))]),
        (CHROM, 197, "enddel", at(CHROM, 197, 4), [at(CHROM, 197)]),
        (CHROM, 200, "last", at(CHROM, 200), [other(at(CHROM, 200))]),
        ("short", 10, "s1", at("short", 10), [other(at("short", 10)), at("short", 10) + "C"]),
    ]
    vcf = VCF_HEADER + "".join(f"{c}\t{p}\t{i}\t{r}\t{','.join(a)}\t.\t.\t.\n" for c, p, i, r, a in sites)
    (root / "v.vcf").write_text(vcf)
    with bgzf.BgzfWriter(root / "v.vcf.gz", "wb") as f:  # .vcf.gz as bgzip writes it
        f.write(vcf.encode())
    with gzip.open(root / "plain.vcf.gz", "wt") as f:  # gzip, not BGZF: htslib cannot read it
        f.write(vcf)
    (root / "v.tsv").write_text("chrom\tpos\tid\tref\talt\n" + "".join(
        f"{c}\t{p}\t{i}\t{r}\t{a}\n" for c, p, i, r, alts in sites for a in alts))
    torch.manual_seed(0)
    out = {"root": root, "reference": reference, "ref": str(root / "ref.fa")}
    for name, tok in (("codon", CodonTokenizer()), ("nucleotide", NucleotideTokenizer())):
        cfg = GenSLMConfig.preset("debug", vocab_size=tok.vocab_size, max_position_embeddings=CONTEXT,
                                  position_embedding="learned", init_std=0.3)
        out[name] = str(export_consolidated(GenSLM(cfg).state_dict(), cfg, tok, root / name))
    return out


def _read_tsv(text: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(text), delimiter="\t"))


def test_llr_is_the_difference_of_two_score_runs(data, tmp_path, capsys):
    """Every variant's REF and ALT windows (``--no-equal-length``: the REF window with REF replaced by ALT), cut here
    by hand from the reference, scored by the real ``ds4sci score --reverse-complement``: ALT minus REF is the LLR
    score-variants writes."""
    out = tmp_path / "llr.tsv"
    assert main(["score-variants", data["nucleotide"], "--reference", data["ref"], "--vcf",
                 str(data["root"] / "v.vcf"), "--out", str(out), "--batch-size", "3", "--no-progress",
                 "--no-equal-length"]) == 0
    rows = _read_tsv(out.read_text())
    assert list(rows[0]) == ["chrom", "pos", "id", "ref", "alt", "llr", "ref_log_likelihood", "alt_log_likelihood",
                             "window_start", "window_end"]
    assert [r["id"] for r in rows] == ["first", "first", ".", "del3", "ins3", "sat", "sat", "sat", "mnv", "enddel",
                                       "last", "s1", "s1"]  # one row per ALT, in input order
    fasta = []
    for i, r in enumerate(rows):
        seq = data["reference"][r["chrom"]]
        pos0, ref = int(r["pos"]) - 1, r["ref"]
        # the default of an export without trained_length: the context, less the variant's own net insertion
        width = CONTEXT - max(0, len(r["alt"]) - len(ref))
        start, end = int(r["window_start"]), int(r["window_end"])
        assert seq[pos0 : pos0 + len(ref)] == ref
        if len(seq) <= width:  # a short record is its own window
            assert (start, end) == (0, len(seq))
        else:  # width bases holding the REF span, centred on it unless a record end is within reach
            assert end - start == width and 0 <= start <= pos0 and pos0 + len(ref) <= end <= len(seq)
            left, right = pos0 - start, end - pos0 - len(ref)
            assert abs(left - right) <= 1 or start == 0 or end == len(seq), r
        fasta.append(f">ref{i}\n{seq[start:end]}\n>alt{i}\n{seq[start:pos0] + r['alt'] + seq[pos0 + len(ref):end]}\n")
    assert [(int(r["window_start"]), int(r["window_end"])) for r in rows if r["id"] in ("first", "last", "enddel")] \
        == [(0, CONTEXT)] * 2 + [(200 - CONTEXT, 200)] * 2
    assert [int(r["window_end"]) - int(r["window_start"]) for r in rows if r["id"] == "ins3"] == [CONTEXT - 3]
    (tmp_path / "w.fa").write_text("".join(fasta))
    assert main(["score", data["nucleotide"], "--fasta", str(tmp_path / "w.fa"), "--reverse-complement", "--out",
                 "-", "--no-progress"]) == 0
    scores = {r["id"]: float(r["log_likelihood"]) for r in _read_tsv(capsys.readouterr().out)}
    for i, r in enumerate(rows):
        assert float(r["ref_log_likelihood"]) == pytest.approx(scores[f"ref{i}"], abs=2e-6)
        assert float(r["alt_log_likelihood"]) == pytest.approx(scores[f"alt{i}"], abs=2e-6)
        assert float(r["llr"]) == pytest.approx(scores[f"alt{i}"] - scores[f"ref{i}"], abs=3e-6)
    assert len({r["llr"] for r in rows}) == len(rows)  # the model tells the variants apart


def test_reference_windows_are_scored_once(data, monkeypatch):
    """One score_records call holds each distinct REF window once plus every ALT window, and gives the LLRs of
    scoring each variant's two windows on their own."""
    model, _, tok = load_model(data["nucleotide"])
    variants = read_variants(data["root"] / "v.vcf", data["reference"])
    calls = []

    def counting(model, tokenizer, records, *args, **kwargs):
        calls.append([r.sequence for r in records])
        return score_records(model, tokenizer, records, *args, **kwargs)

    monkeypatch.setattr(variants_module, "score_records", counting)
    rows = score_variants(model, tok, data["reference"], variants, 16, equal_length=False, batch_size=4)
    monkeypatch.undo()
    # distinct REF windows of 16 bases: pos 1 and 3 (both ALTs of 1) share [0, 16); the 3 ALTs at 120 share one;
    # 197-200 and 200 share [184, 200); the short record's two ALTs share the record
    keys = {(r["chrom"], r["window_start"], r["window_end"]) for r in rows}
    assert len(keys) == 7 and (CHROM, 0, 16) in keys and (CHROM, 184, 200) in keys and ("short", 0, 12) in keys
    assert len(calls) == 1 and len(calls[0]) == len(keys) + len(rows)
    assert len(set(calls[0][: len(keys)])) == len(keys)  # no REF window twice
    alone = []
    for v, r in zip(variants, rows):
        seq = data["reference"][v.chrom][r["window_start"] : r["window_end"]]
        offset = v.pos - 1 - r["window_start"]
        pair = [FastaRecord("ref", "", seq), FastaRecord("alt", "", seq[:offset] + v.alt + seq[offset + len(v.ref):])]
        ref_ll, alt_ll = [s["log_likelihood"] for s in score_records(model, tok, pair, CONTEXT, True)]
        alone.append(alt_ll - ref_ll)
    assert [r["llr"] for r in rows] == pytest.approx(alone, rel=1e-5, abs=1e-5)


def test_token_budget_bounds_every_forward(data, tmp_path, monkeypatch):
    """``--max-tokens-per-batch``: no forward holds more tokens (rows x width) than the budget, and the LLRs are
    those of batching by rows."""
    shapes = []
    read_slots = ShardedForward.read_slots

    def spy(self, batch, *args, **kwargs):
        shapes.append(tuple(batch["input_ids"].shape))
        return read_slots(self, batch, *args, **kwargs)

    monkeypatch.setattr(ShardedForward, "read_slots", spy)
    out = {}
    for budget in (None, 40):
        shapes.clear()
        out[budget] = tmp_path / f"{budget}.tsv"
        assert main(["score-variants", data["nucleotide"], "--reference", data["ref"], "--vcf",
                     str(data["root"] / "v.vcf"), "--window", "16", "--out", str(out[budget]), "--no-progress",
                     "--batch-size", "8"] + (["--max-tokens-per-batch", str(budget)] if budget else [])) == 0
        most = max(b * t for b, t in shapes)
        assert most <= 40 if budget else most > 40, (budget, shapes)
    rows = {budget: _read_tsv(path.read_text()) for budget, path in out.items()}
    assert [float(r["llr"]) for r in rows[40]] == pytest.approx([float(r["llr"]) for r in rows[None]], abs=2e-6)


def test_vcf_gz_and_tsv_give_the_same_output(data, tmp_path):
    outputs = []
    for name in ("v.vcf", "v.vcf.gz", "v.tsv"):
        out = tmp_path / f"{name}.out"
        assert main(["score-variants", data["nucleotide"], "--reference", data["ref"], "--vcf",
                     str(data["root"] / name), "--window", "20", "--out", str(out), "--no-progress"]) == 0
        outputs.append(out.read_text())
    assert outputs[0] == outputs[1] == outputs[2] and outputs[0].count("\n") == 14


def test_default_window_leaves_room_for_the_variants_own_net_insertion():
    """The default REF window is the variant's own: the trained length (else the context), narrowed by ITS net
    insertion only. An MNV or a deletion with a long ALT inserts nothing and keeps the whole window (keyed on the ALT's
    length instead, they would be narrowed, or refused where the context is that short)."""
    snv, ins = Variant(3, CHROM, 5, ".", "A", "G"), Variant(4, CHROM, 9, ".", "A", "ACGTA")
    mnv, deletion = Variant(5, CHROM, 20, ".", "ACGT", "TGCA"), Variant(6, CHROM, 30, ".", "ACGTA", "ACGT")
    assert default_window(32, snv) == 32 and default_window(32, ins) == 28
    assert default_window(32, snv, 24) == 24 and default_window(32, ins, 30) == 28  # the trained length, if it fits
    assert default_window(4, mnv) == 4 and default_window(4, deletion) == 4 and default_window(32, deletion) == 32
    with pytest.raises(ValueError, match="line 4: an insertion of 4 bases leaves no room for a window in the "
                                         "model's context of 4 tokens"):
        default_window(4, ins)


def test_window_geometry():
    assert reference_window(50, 1, 200, 10) == (45, 55)  # an SNV: 5 bases before it, 4 after
    assert reference_window(49, 4, 200, 10) == (46, 56)  # a 4-base REF: 3 bases before, 3 after
    assert reference_window(1, 1, 200, 10) == (0, 10)  # shifted at the record's start
    assert reference_window(199, 1, 200, 10) == (190, 200)  # and at its end
    assert reference_window(5, 2, 8, 10) == (0, 8)  # a record shorter than the window


def test_every_bad_line_is_named(data, tmp_path, capsys):
    ref = data["reference"][CHROM]
    bad = VCF_HEADER + "".join([
        f"{CHROM}\t5\t.\t{ref[4]}\t{'ACGT'[('ACGT'.index(ref[4]) + 1) % 4]}\t.\t.\t.\n",  # line 5: good
        "chrX\t5\t.\tA\tG\t.\t.\t.\n",  # 6
        f"{CHROM}\t10\t.\t{'C' if ref[9] != 'C' else 'G'}\tA\t.\t.\t.\n",  # 7: REF mismatch
        f"{CHROM}\t12\t.\t{ref[11]}\t<DEL>\t.\t.\t.\n",  # 8
        f"{CHROM}\t13\t.\t{ref[12]}\tN[{CHROM}:40[\t.\t.\t.\n",  # 9
        f"{CHROM}\t14\t.\t{ref[13]}\t*\t.\t.\t.\n",  # 10
        f"{CHROM}\t15\t.\t{ref[14]}\tAXG\t.\t.\t.\n",  # 11
        f"{CHROM}\t200\t.\t{ref[199]}A\tA\t.\t.\t.\n",  # 12: past the end
        f"{CHROM}\t20\t.\t{ref[19]}\t{ref[19] + 'A' * 60}\t.\t.\t.\n",  # 13: too long
        f"{CHROM}\t21\t.\t{ref[20]}\t{ref[20]}\t.\t.\t.\n",  # 14: ALT = REF
        f"{CHROM}\t22\t.\t{ref[21]}\t.\t.\t.\t.\n",  # 15: no ALT
    ])
    (tmp_path / "bad.vcf").write_text(bad)
    err = refused(capsys, ["score-variants", data["nucleotide"], "--reference", data["ref"], "--vcf",
                           str(tmp_path / "bad.vcf"), "--out", str(tmp_path / "o.tsv")])
    assert err.count("\n") == 1 and err.startswith("ds4sci score-variants: error: ") and "10 bad variant(s)" in err
    expected = {6: f"unknown chromosome 'chrX' (the reference has {CHROM}, short)",
                7: f"REF '{'C' if ref[9] != 'C' else 'G'}' does not match the reference '{ref[9]}' at {CHROM}:10",
                8: "symbolic ALT allele '<DEL>'", 9: "breakend ALT allele", 10: "ALT '*'", 11: "ALT 'AXG' holds 'X'",
                12: f"POS 200 with REF of 2 base(s) runs past the end of {CHROM} (200 bases)",
                13: "ALT of 61 bases: at most 50", 14: f"ALT '{ref[20]}' equals REF: not a variant",
                15: "no ALT allele ('.')"}
    for line, message in expected.items():
        assert f"line {line}: {message}" in err, (line, err)
    assert "line 5:" not in err and not (tmp_path / "o.tsv").exists()

    (tmp_path / "bad.tsv").write_text(f"chrom\tpos\tref\talt\n{CHROM}\tx\tA\tG\n{CHROM}\t3\n\nchrY\t4\tA\tC\n")
    err = refused(capsys, ["score-variants", data["nucleotide"], "--reference", data["ref"], "--vcf",
                           str(tmp_path / "bad.tsv"), "--out", "-"])
    assert "line 2: pos 'x' is not a positive integer" in err and "line 3: 2 column(s), the header has 4" in err
    assert "line 5: unknown chromosome 'chrY'" in err

    (tmp_path / "broken.vcf").write_text(VCF_HEADER + f"{CHROM}\tten\t.\tA\tG\t.\t.\t.\n\n{CHROM}\t3\t.\tA\n")
    err = refused(capsys, ["score-variants", data["nucleotide"], "--reference", data["ref"], "--vcf",
                           str(tmp_path / "broken.vcf"), "--out", "-"])
    assert "line 5: POS 'ten' is not a positive integer" in err and "line 6: blank line" in err
    assert "line 7: 4 tab-separated column(s)" in err


def test_refusals_are_one_line(data, tmp_path, capsys):
    common = ["--reference", data["ref"], "--vcf", str(data["root"] / "v.vcf"), "--out", "-"]
    err = refused(capsys, ["score-variants", data["codon"], *common])
    assert err.count("\n") == 1 and "needs a nucleotide model; this one reads codon tokens" in err
    (tmp_path / "noref.tsv").write_text(f"chrom\tpos\talt\n{CHROM}\t3\tA\n")
    err = refused(capsys, ["score-variants", data["nucleotide"], *common[:2], "--vcf", str(tmp_path / "noref.tsv"),
                           "--out", "-"])
    assert "noref.tsv: line 1: the header names no ref column" in err
    plain = str(data["root"] / "plain.vcf.gz")
    err = refused(capsys, ["score-variants", data["nucleotide"], *common[:2], "--vcf", plain, "--out", "-"])
    assert f"{plain}: gzip-compressed but not BGZF, which htslib reads: recompress it with bgzip" in err
    err = refused(capsys, ["score-variants", data["nucleotide"], *common, "--window", "33"])
    assert "--window 33 bases exceeds the model's context of 32 tokens" in err
    err = refused(capsys, ["score-variants", data["nucleotide"], *common, "--window", "31", "--no-equal-length"])
    assert f"{data['root'] / 'v.vcf'}: line 8: the ALT window of 34 bases (--window 31 with 3 inserted) exceeds the " \
           "model's context of 32 tokens; use --window 29 or less" in err
