"""``ds4sci score``: per-record log-likelihoods through evaluate's windows."""
import csv
import io
import json
import math

import numpy as np
import pytest
import torch
from Bio.Seq import Seq

from ds4sci.cli import main
from ds4sci.data import CodonTokenizer
from ds4sci.data import NucleotideTokenizer
from ds4sci.data import read_fasta
from ds4sci.infer.evaluate import record_windows
from ds4sci.infer.score import score_records
from ds4sci.io.export import export_consolidated
from ds4sci.io.weights import load_model
from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm import GenSLMConfig

CONTEXT = 32
# 70 bases -> windows of 16: 16 16 16 16 6; 9 -> one window; 1 base -> nothing to score; lowercase, N as in training
FASTA = ">long variant 1\n" + "ACGTTGCAAGGCTTAC" * 4 + "ACGTTG\n>short\nacgTNacgt\n>one\nA\n"


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("score")
    torch.manual_seed(0)
    out = {"fasta": str(root / "x.fa")}
    (root / "x.fa").write_text(FASTA)
    for name, tok in (("codon", CodonTokenizer()), ("nucleotide", NucleotideTokenizer())):
        cfg = GenSLMConfig.preset("debug", vocab_size=tok.vocab_size, max_position_embeddings=CONTEXT,
                                  position_embedding="learned")
        out[name] = str(export_consolidated(GenSLM(cfg).state_dict(), cfg, tok, root / name))
    return out


def _read_tsv(text: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(text), delimiter="\t"))


def test_score_cli_token_weighted_mean_is_evaluate_loss(exports, tmp_path, capsys):
    tsv = tmp_path / "scores.tsv"
    common = ["--fasta", exports["fasta"], "--seq-len", "16", "--batch-size", "3"]
    assert main(["score", exports["nucleotide"], *common, "--out", str(tsv)]) == 0
    assert main(["evaluate", exports["nucleotide"], *common, "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    text = tsv.read_text()
    assert text.splitlines()[0] == "id\tlength\ttokens\tlog_likelihood\tbits_per_base"
    rows = _read_tsv(text)
    assert [(r["id"], int(r["length"]), int(r["tokens"])) for r in rows] == [
        ("long", 70, 15 * 4 + 5), ("short", 9, 8), ("one", 1, 0)]
    assert sum(int(r["tokens"]) for r in rows) == result["tokens"]
    nats = -sum(float(r["log_likelihood"]) for r in rows)
    assert nats / result["tokens"] == pytest.approx(result["loss"], rel=1e-6)
    for r in rows[:2]:
        bits = -float(r["log_likelihood"]) / int(r["tokens"]) / math.log(2)
        assert float(r["bits_per_base"]) == pytest.approx(bits, rel=1e-5)
    assert rows[2]["log_likelihood"] == "0.000000" and rows[2]["bits_per_base"] == "nan"


def _by_hand(model, tok, sequence: str, seq_len: int) -> float:
    """Total log-likelihood of ``sequence``: every window of ``seq_len`` tokens scored on its own."""
    ids = torch.from_numpy(tok.encode(sequence))
    total = 0.0
    for s in range(0, len(ids), seq_len):
        w = ids[s : s + seq_len][None]
        logits = model(w, torch.arange(w.shape[1])[None])
        total -= torch.nn.functional.cross_entropy(logits[0, :-1], w[0, 1:], reduction="sum").item()
    return total


def test_score_records_by_hand_and_reverse_complement(exports):
    model, _, tok = load_model(exports["nucleotide"])
    records = list(read_fasta(exports["fasta"]))
    rows = score_records(model, tok, records, 16, batch_size=2)
    with torch.no_grad():
        forward = [_by_hand(model, tok, r.sequence, 16) for r in records]
        backward = [_by_hand(model, tok, str(Seq(r.sequence).reverse_complement()), 16) for r in records]
    assert [r["log_likelihood"] for r in rows] == pytest.approx(forward, rel=1e-5)
    both = score_records(model, tok, records, 16, reverse_complement=True, batch_size=5)
    assert [r["log_likelihood"] for r in both] == pytest.approx([(f + b) / 2 for f, b in zip(forward, backward)],
                                                                rel=1e-5)
    assert [r["tokens"] for r in both] == [r["tokens"] for r in rows]
    # the strands score differently, by far more than the 1e-5 tolerance above: a score that ignored one strand fails
    assert abs(forward[0] - backward[0]) / 2 > 10 * 1e-5 * abs(forward[0]), (forward[0], backward[0])


def test_score_stdout_and_one_line_errors(exports, capsys):
    assert main(["score", exports["codon"], "--fasta", exports["fasta"], "--out", "-", "--no-progress"]) == 0
    rows = _read_tsv(capsys.readouterr().out)
    assert [(r["id"], r["tokens"]) for r in rows] == [("long", str(23 - 1)), ("short", "2"), ("one", "0")]
    assert main(["score", exports["codon"], "--fasta", exports["fasta"], "--out", "-", "--reverse-complement"]) == 2
    err = capsys.readouterr()
    assert err.out == "" and err.err.count("error:") == 1 and "nucleotide model" in err.err and "codon" in err.err
    assert main(["score", exports["nucleotide"], "--fasta", exports["fasta"], "--out", "-", "--seq-len", "33"]) == 2
    assert "--seq-len 33 exceeds the model's context of 32" in capsys.readouterr().err


def _strided_by_hand(model, tok, sequence: str, seq_len: int, stride: int) -> tuple[float, int]:
    """(total log-likelihood, tokens scored) by Hugging Face's strided-perplexity loop, written out: a window of
    ``seq_len`` tokens every ``stride`` tokens scores the tokens after the previous window's end (never its first)."""
    ids = torch.from_numpy(tok.encode(sequence))
    total, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + seq_len, len(ids))
        w = ids[begin:end]
        logp = torch.log_softmax(model(w[None], torch.arange(len(w))[None])[0, :-1], -1)  # [T-1, V]
        picked = logp[torch.arange(len(w) - 1), w[1:]]  # log p(w[j+1] | w[:j+1])
        first = max(prev_end - begin, 1)  # the window's first scored token
        total += picked[first - 1 :].sum().item()
        count += len(w) - first
        prev_end = end
        if end == len(ids):
            break
    return total, count


def test_strided_windows_score_each_token_once_with_the_context_the_stride_leaves(exports):
    model, _, tok = load_model(exports["nucleotide"])
    records = list(read_fasta(exports["fasta"]))  # 70 tokens, 9 (one window), 1
    default = score_records(model, tok, records, 16)
    for stride in (1, 5, 15, 16):
        rows = score_records(model, tok, records, 16, stride=stride, batch_size=4)
        with torch.no_grad():
            expected = [_strided_by_hand(model, tok, r.sequence, 16, stride) for r in records]
        assert [r["log_likelihood"] for r in rows] == pytest.approx([e[0] for e in expected], rel=1e-5), stride
        assert [r["tokens"] for r in rows] == [e[1] for e in expected], stride
        if stride < 16:  # overlapping windows score every token but the record's first
            assert [r["tokens"] for r in rows] == [69, 8, 0]
        assert rows[1] == default[1]  # a record within one window: the same with any stride
    assert score_records(model, tok, records, 16, stride=16) == default
    for ids_len, stride in ((70, 5), (70, 16), (16, 3), (17, 3)):
        windows = record_windows(np.arange(ids_len), 16, stride)
        owned = np.concatenate([w.ids[w.owned :] for w in windows])
        assert owned.tolist() == list(range(ids_len))  # every token owned once, in order
        assert all(len(w.ids) <= 16 and w.owned >= min(16 - stride, len(w.ids)) for w in windows[1:])
    with pytest.raises(ValueError, match="stride=17 must be between 1 and the window length seq_len=16"):
        score_records(model, tok, records, 16, stride=17)


def test_score_and_evaluate_cli_take_a_stride(exports, capsys):
    common = ["--fasta", exports["fasta"], "--seq-len", "16", "--stride", "5"]
    assert main(["score", exports["nucleotide"], *common, "--out", "-", "--no-progress"]) == 0
    rows = _read_tsv(capsys.readouterr().out)
    assert [int(r["tokens"]) for r in rows] == [69, 8, 0]
    assert main(["evaluate", exports["nucleotide"], *common, "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["tokens"] == 77
    assert -sum(float(r["log_likelihood"]) for r in rows) / 77 == pytest.approx(result["loss"], rel=1e-6)
    for command in ("score", "evaluate", "embed"):
        out = ["--out", "-"] if command != "evaluate" else []
        assert main([command, exports["nucleotide"], "--fasta", exports["fasta"], *out, "--seq-len", "16",
                     "--stride", "17"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--stride 17 exceeds the window of 16 tokens (--seq-len)" in err, err
    assert main(["score", exports["nucleotide"], "--fasta", exports["fasta"], "--out", "-", "--stride", "33"]) == 2
    assert "--stride 33 exceeds the window of 32 tokens (the model context)" in capsys.readouterr().err


def test_score_codon_bits_per_base_divides_by_three_bases_per_token(exports):
    """A codon token carries 3 bases: ``bits_per_base`` is the hand-computed nats per token / ln 2 / 3, per record.

    The log-likelihood is recomputed from the model's own logits (``_by_hand``), the token counts by hand (every
    window of 16 tokens scores all but its first token), so a ``bits_per_base`` left in bits per *token* (3x too
    large) or divided by the nucleotide count fails.
    """
    model, _, tok = load_model(exports["codon"])
    assert tok.kind == "codon" and tok.bases_per_token == 3
    # 70 bases -> 23 codons -> windows of 16 and 7 -> 15 + 6 targets; 9 bases -> 3 codons -> 2 targets
    records = [r for r in read_fasta(exports["fasta"]) if r.id in ("long", "short")]
    rows = score_records(model, tok, records, 16, batch_size=2)
    with torch.no_grad():
        by_hand = [_by_hand(model, tok, r.sequence, 16) for r in records]
    assert [(r["id"], r["tokens"]) for r in rows] == [("long", 15 + 6), ("short", 2)]
    assert [r["log_likelihood"] for r in rows] == pytest.approx(by_hand, rel=1e-5)
    expected = [-ll / tokens / math.log(2) / 3 for ll, tokens in zip(by_hand, (21, 2))]
    assert [r["bits_per_base"] for r in rows] == pytest.approx(expected, rel=1e-5)
