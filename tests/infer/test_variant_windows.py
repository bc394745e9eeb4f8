"""Variant scores that mean one thing (issue 43): a variant's windows depend on it and the model alone, equal-length
ALT windows cut as by hand, every base of a multi-base REF checked, 1,000+ variants scored in blocks equal to one at a
time, and the training length recorded in exports and read back as the default window of every reading command."""
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from ds4sci.cli import main
from ds4sci.data import FastaRecord
from ds4sci.data import NucleotideTokenizer
from ds4sci.infer import variants as variants_module
from ds4sci.infer.length import default_length
from ds4sci.infer.score import score_records
from ds4sci.infer.variants import Variant
from ds4sci.infer.variants import alt_window
from ds4sci.infer.variants import read_variants
from ds4sci.infer.variants import score_variants
from ds4sci.io.export import export_consolidated
from ds4sci.io.export import read_trained_length
from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm import GenSLMConfig

from cli_checks import refused
from test_variants import CHROM  # tests/infer is on sys.path under pytest (rootdir conftest)
from test_variants import genome_prefix

CONTEXT = 32
TRAINED = 16  # the training length recorded in the "trained" export, below the context


def other(base: str, k: int = 1) -> str:
    return "ACGT"[("ACGT".index(base) + k) % 4]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny forwards: one torch thread is several times faster than two on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The first 600 bases of the E. coli genome, a tiny nucleotide model (context 32) and two exports of it: one
    recording ``trained_length`` 16, one recording none (an export of an older ds4sci)."""
    root = tmp_path_factory.mktemp("variant_windows")
    reference = {CHROM: genome_prefix(600)}
    (root / "ref.fa").write_text(f">{CHROM}\n{reference[CHROM]}\n")
    tok = NucleotideTokenizer()
    torch.manual_seed(0)
    cfg = GenSLMConfig.preset("debug", vocab_size=tok.vocab_size, max_position_embeddings=CONTEXT,
                              position_embedding="learned", init_std=0.3)
    model = GenSLM(cfg).eval()
    trained = export_consolidated(model.state_dict(), cfg, tok, root / "trained", trained_length=TRAINED)
    legacy = export_consolidated(model.state_dict(), cfg, tok, root / "legacy")
    return {"root": root, "reference": reference, "model": model, "tok": tok, "trained": str(trained),
            "legacy": str(legacy)}


@pytest.mark.parametrize("mode", [{}, {"equal_length": False}], ids=["default", "no-equal-length"])
def test_a_variant_scores_the_same_alone_and_beside_a_long_insertion(setup, mode):
    """The same SNV, alone and in a file with a 20-base insertion: the same REF window and the same LLR (a window
    keyed on the file's longest insertion gave the SNV 12 bases beside it and 32 alone)."""
    seq = setup["reference"][CHROM]
    snv = Variant(1, CHROM, 300, ".", seq[299], other(seq[299]))
    ins = Variant(2, CHROM, 100, ".", seq[99], seq[99] + "ACGTTGCA" * 2 + "ACGT")
    args = setup["model"], setup["tok"], setup["reference"]
    alone = score_variants(*args, [snv], **mode)[0]
    beside = score_variants(*args, [snv, ins], **mode)[0]
    assert (alone["window_start"], alone["window_end"]) == (beside["window_start"], beside["window_end"]) \
        == (299 - CONTEXT // 2, 299 + CONTEXT // 2)
    assert beside["llr"] == pytest.approx(alone["llr"], rel=1e-5, abs=1e-6)


def test_equal_length_windows_are_cut_as_by_hand(setup):
    """16-base windows: each ALT window is the ALT haplotype's 16 bases centred on ALT, cut here by hand, and the
    LLR is ``ds4sci score``'s log-likelihood of that window minus the REF window's."""
    seq = setup["reference"][CHROM]
    cases = [  # (variant, REF window, ALT window), 0-based
        (Variant(1, CHROM, 100, ".", seq[99], seq[99] + "GTA"),  # insertion: 6 + 4 + 6 bases
         seq[91:107], seq[93:99] + seq[99] + "GTA" + seq[100:106]),
        (Variant(2, CHROM, 50, ".", seq[49:53], seq[49]),  # deletion of 3: 8 + 1 + 7 bases
         seq[43:59], seq[41:49] + seq[49] + seq[53:60]),
        (Variant(3, CHROM, 597, ".", seq[596:600], seq[596]),  # deletion at the record's end: shifted left
         seq[584:600], seq[581:597]),
        (Variant(4, CHROM, 2, ".", seq[1], seq[1] + "AAAAA"),  # insertion at the record's start: shifted right
         seq[0:16], seq[0:2] + "AAAAA" + seq[2:11]),
        (Variant(5, CHROM, 300, ".", seq[299], other(seq[299])),  # SNV: the REF window with the base changed
         seq[291:307], seq[291:299] + other(seq[299]) + seq[300:307]),
    ]
    variants = [v for v, _, _ in cases]
    rows = score_variants(setup["model"], setup["tok"], setup["reference"], variants, 16, batch_size=3)
    pairs = []
    for (v, ref_window, alt), row in zip(cases, rows):
        assert len(ref_window) == len(alt) == 16
        assert seq[row["window_start"] : row["window_end"]] == ref_window
        assert alt_window(seq, v, row["window_start"], row["window_end"], True) == alt
        pairs += [FastaRecord("ref", "", ref_window), FastaRecord("alt", "", alt)]
    scores = [r["log_likelihood"] for r in score_records(setup["model"], setup["tok"], pairs, CONTEXT, True)]
    assert [r["llr"] for r in rows] == pytest.approx([a - r for r, a in zip(scores[::2], scores[1::2])], abs=1e-5)


def test_a_multi_base_ref_is_checked_on_every_base(setup, tmp_path, capsys):
    """A REF whose first base matches the genome and a later one does not is a bad line, named with its file and
    line, one line and exit 2."""
    seq = setup["reference"][CHROM]
    wrong = seq[9] + other(seq[10]) + seq[11]
    (tmp_path / "v.tsv").write_text(f"chrom\tpos\tref\talt\n{CHROM}\t5\t{seq[4]}\t{other(seq[4])}\n"
                                    f"{CHROM}\t10\t{wrong}\t{seq[9]}\n")
    with pytest.raises(ValueError, match=f"line 3: REF '{wrong}' does not match the reference '{seq[9:12]}'"):
        read_variants(tmp_path / "v.tsv", setup["reference"])
    err = refused(capsys, ["score-variants", setup["trained"], "--reference", str(setup["root"] / "ref.fa"),
                           "--vcf", str(tmp_path / "v.tsv"), "--out", "-"])
    assert err.count("\n") == 1 and f"{tmp_path / 'v.tsv'}: 1 bad variant(s), nothing scored: line 3: REF" in err


def test_a_file_of_many_bad_lines_is_one_short_line(setup, tmp_path):
    """25 bad lines: the first 20 named with their line numbers, then how many more (a message per bad line of a
    100K-variant file would be a screen of its own)."""
    (tmp_path / "v.tsv").write_text("chrom\tpos\tref\talt\n" + "".join(f"chrZ\t{i}\tA\tC\n" for i in range(1, 26)))
    with pytest.raises(ValueError) as err:
        read_variants(tmp_path / "v.tsv", setup["reference"])
    message = str(err.value)
    assert message.startswith(f"{tmp_path / 'v.tsv'}: 25 bad variant(s), nothing scored: line 2: unknown chromosome")
    assert "line 21: unknown" in message and "line 22:" not in message and message.endswith("; and 5 more")


def window_log_likelihoods(model, tokenizer, windows: list[str]) -> np.ndarray:
    """The oracle: each window's log-likelihood (nats, the mean of both strands; the first token has no context and
    is not scored) from one plain forward of all the windows of both strands, stacked (windows of one length)."""
    ids = [tokenizer.encode(w) for w in windows]
    ids = torch.as_tensor(np.stack(ids + [tokenizer.reverse_complement(x) for x in ids]), dtype=torch.long)  # [2N, T]
    with torch.no_grad():
        logp = model(ids, torch.arange(ids.shape[1]).expand_as(ids)).double().log_softmax(-1)  # [2N, T, V]
    ll = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0].sum(1).numpy()  # [2N]: token t+1 given tokens <= t
    return (ll[: len(windows)] + ll[len(windows) :]) / 2


def test_a_thousand_variants_score_as_one_at_a_time(setup, monkeypatch):
    """1,056 variants (3 SNVs at each of 340 positions, 36 indels), scored in blocks of 300 with REF windows shared
    across blocks and 128 windows a forward: every LLR equals its own two windows' log-likelihoods from a plain
    forward (fp32, rtol 1e-5), and a spread of them scored one variant per call gives the same LLRs."""
    seq = setup["reference"][CHROM]
    variants = [Variant(1, CHROM, pos, ".", seq[pos - 1], other(seq[pos - 1], k))
                for pos in range(131, 471) for k in (1, 2, 3)]
    variants += [Variant(2, CHROM, pos, ".", seq[pos - 1 : pos + 2], seq[pos - 1]) for pos in range(20, 580, 32)]
    variants += [Variant(3, CHROM, pos, ".", seq[pos - 1], seq[pos - 1] + "TTG") for pos in range(30, 590, 32)]
    scored = []

    def counting(model, tokenizer, records, *args, **kwargs):
        scored.extend(r.sequence for r in records)
        return score_records(model, tokenizer, records, *args, **kwargs)

    monkeypatch.setattr(variants_module, "score_records", counting)
    model, tok = setup["model"], setup["tok"]
    rows = score_variants(model, tok, setup["reference"], variants, TRAINED, batch_size=128, block=300)
    monkeypatch.undo()
    refs = {(r["window_start"], r["window_end"]) for r in rows}
    assert len(variants) == 1056 and len(scored) == len(refs) + len(variants)  # each REF window once
    windows = []
    for v, r in zip(variants, rows):
        start, end = r["window_start"], r["window_end"]
        windows += [seq[start:end], alt_window(seq, v, start, end, True)]
    ll = window_log_likelihoods(model, tok, windows)
    np.testing.assert_allclose([r["llr"] for r in rows], ll[1::2] - ll[::2], rtol=1e-5, atol=1e-5)
    spread = list(range(0, len(variants), 97))
    alone = [score_variants(model, tok, setup["reference"], [variants[i]], TRAINED)[0]["llr"] for i in spread]
    np.testing.assert_allclose([rows[i]["llr"] for i in spread], alone, rtol=1e-5, atol=1e-5)


def test_the_trained_length_is_recorded_and_read_back(setup, tmp_path, caplog):
    """An export records ``trained_length``, export-hf carries it over, an export without it falls back to the
    context with one warning naming the fallback, and a bad value is refused naming the file."""
    assert read_trained_length(setup["trained"]) == TRAINED and read_trained_length(setup["legacy"]) is None
    cfg = setup["model"].config
    with caplog.at_level(logging.WARNING, logger="ds4sci.infer.length"):
        assert default_length(setup["trained"], cfg) == TRAINED and not caplog.records
        assert default_length(setup["legacy"], cfg) == CONTEXT
    assert len(caplog.records) == 1 and "records no trained_length" in caplog.text \
        and f"windows default to the model's context of {CONTEXT} tokens" in caplog.text
    meta = json.loads((Path(setup["trained"]) / "config.json").read_text())
    for value in (0, "16", 2 * CONTEXT):
        (tmp_path / "bad").mkdir(exist_ok=True)
        (tmp_path / "bad" / "config.json").write_text(json.dumps({**meta, "trained_length": value}))
        with pytest.raises(ValueError, match=f"{tmp_path / 'bad' / 'config.json'}: trained_length={value!r}"):
            default_length(tmp_path / "bad", cfg)

    pytest.importorskip("transformers")
    from ds4sci.io.export_hf import export_hf
    from ds4sci.io.weights import load_model

    tok = setup["tok"]
    rotary = GenSLMConfig.preset("debug", vocab_size=tok.vocab_size, max_position_embeddings=CONTEXT)
    source = export_consolidated(GenSLM(rotary).state_dict(), rotary, tok, tmp_path / "rotary", trained_length=24)
    hf = export_hf(source, tmp_path / "hf")
    assert json.loads((hf / "config.json").read_text())["model_type"] == "gpt_neox"
    assert read_trained_length(hf) == 24 and load_model(hf)[1].max_position_embeddings == CONTEXT


def test_reading_commands_default_to_the_trained_length(setup, tmp_path, capsys):
    """score, evaluate, embed and score-variants read through windows of the recorded training length (16) by
    default, not the context (32): the default's output is --seq-len 16's (or --window 16's) and differs from 32's."""
    seq = setup["reference"][CHROM]
    (tmp_path / "r.fa").write_text(f">a\n{seq[:40]}\n>b\n{seq[40:75]}\n")
    fasta = ["--fasta", str(tmp_path / "r.fa")]

    def run(argv) -> str:
        assert main(argv) == 0
        return capsys.readouterr().out

    for command in (["score", setup["trained"], *fasta, "--out", "-", "--no-progress"],
                    ["evaluate", setup["trained"], *fasta, "--json"]):
        default, short, full = (run(command + extra) for extra in ([], ["--seq-len", "16"], ["--seq-len", "32"]))
        assert default == short != full, command
    embedded = {}
    for name, extra in (("default", []), ("16", ["--seq-len", "16"]), ("32", ["--seq-len", "32"])):
        run(["embed", setup["trained"], *fasta, "--out", str(tmp_path / f"{name}.npz"), "--no-progress", *extra])
        embedded[name] = np.load(tmp_path / f"{name}.npz")["embeddings"]
    assert np.array_equal(embedded["default"], embedded["16"]) and not np.allclose(embedded["default"], embedded["32"])
    (tmp_path / "v.tsv").write_text(f"chrom\tpos\tref\talt\n{CHROM}\t300\t{seq[299]}\t{other(seq[299])}\n")
    common = ["score-variants", "--reference", str(setup["root"] / "ref.fa"), "--vcf", str(tmp_path / "v.tsv"),
              "--out", "-", "--no-progress"]
    trained = run([common[0], setup["trained"], *common[1:]]).splitlines()[1].split("\t")
    assert (int(trained[-2]), int(trained[-1])) == (299 - TRAINED // 2, 299 + TRAINED // 2)
    legacy = run([common[0], setup["legacy"], *common[1:]]).splitlines()[1].split("\t")
    assert (int(legacy[-2]), int(legacy[-1])) == (299 - CONTEXT // 2, 299 + CONTEXT // 2)
