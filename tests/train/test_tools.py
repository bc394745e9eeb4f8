"""Consolidated export, evaluate / generate / embed on a small in-process model."""
import math

import numpy as np
import pytest
import torch

from ds4sci.data import CodonTokenizer, NucleotideTokenizer
from ds4sci.models.genslm import GenSLM, GenSLMConfig
from ds4sci.train.embed import embed_sequence
from ds4sci.train.evaluate import evaluate, windows
from ds4sci.train.export import export_consolidated
from ds4sci.train.init_from import load_model
from ds4sci.train.generate import filter_logits, sample


@pytest.fixture
def tiny(tmp_path):
    torch.manual_seed(0)
    tok = NucleotideTokenizer()
    cfg = GenSLMConfig.preset("debug", vocab_size=tok.vocab_size, max_position_embeddings=32, position_embedding="learned")
    model = GenSLM(cfg).eval()
    return model, cfg, tok


def test_export_round_trip_same_logits(tmp_path, tiny):
    model, cfg, tok = tiny
    export_consolidated(model.state_dict(), cfg, tok, tmp_path / "ex")
    again, cfg2, tok2 = load_model(tmp_path / "ex")
    ids = torch.randint(5, 9, (2, 16))
    pos = torch.arange(16).expand(2, 16)
    torch.testing.assert_close(again(ids, pos), model(ids, pos), rtol=0, atol=0)
    assert cfg2 == cfg and tok2.vocab == tok.vocab
    (tmp_path / "ex" / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json is missing"):
        load_model(tmp_path / "ex")


def test_evaluate_counts_real_tokens_only(tmp_path, tiny):
    model, cfg, tok = tiny
    fasta = tmp_path / "x.fa"
    fasta.write_text(">a\n" + "ACGT" * 10 + "\n>b\nGGCA\n")
    ds = windows(cfg, tok, str(fasta))  # 40 tokens -> 32 + 8 (padded); 4 tokens (padded)
    assert len(ds) == 3
    got = evaluate(model, tok, ds, batch_size=2)
    total, count = 0.0, 0
    for chunk in ("ACGT" * 10)[:32], ("ACGT" * 10)[32:], "GGCA":
        ids = torch.from_numpy(tok.encode(chunk))[None]
        logits = model(ids, torch.arange(ids.shape[1])[None])
        total += torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum").item()
        count += ids.shape[1] - 1
    assert got["tokens"] == count == 31 + 7 + 3
    assert got["loss"] == pytest.approx(total / count, rel=1e-5)
    assert got["bits_per_base"] == pytest.approx(total / count / math.log(2), rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)


def test_generate_reproducible_greedy_and_fasta(tmp_path, tiny):
    model, cfg, tok = tiny
    a = sample(model, tok, "ACG", 10, seed=3)
    assert a == sample(model, tok, "ACG", 10, seed=3) and a.startswith("ACG") and len(a) == 13
    assert set(a) <= set("ACGTN")
    greedy = sample(model, tok, "ACG", 10, temperature=0)
    assert sample(model, tok, "ACG", 10, top_k=1, seed=9) == greedy
    with pytest.raises(ValueError, match="exceeds the model's context"):
        sample(model, tok, "ACG", 100)
    assert sample(model, tok, "acg", 10, seed=3) == a  # soft-masked prompt is uppercased
    with pytest.raises(ValueError, match="prompt.*'Z'.*position 4"):
        sample(model, tok, "ACGZ", 3)
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0])
    assert torch.isinf(filter_logits(logits, top_k=2)[:2]).all()
    # softmax = [0.03, 0.09, 0.24, 0.64]: the top token alone reaches 0.6; 0.7 needs the top two
    assert (~torch.isinf(filter_logits(logits, top_p=0.6))).tolist() == [False, False, False, True]
    assert (~torch.isinf(filter_logits(logits, top_p=0.7))).tolist() == [False, False, True, True]
    from ds4sci.cli import main

    export_consolidated(model.state_dict(), cfg, tok, tmp_path / "ex")
    out = tmp_path / "g.fa"
    assert main(["generate", str(tmp_path / "ex"), "--num-tokens", "5", "--num-sequences", "2", "--out", str(out)]) == 0
    from ds4sci.data import read_fasta

    recs = list(read_fasta(out))
    assert [r.id for r in recs] == ["ds4sci_sample_0", "ds4sci_sample_1"] and all(len(r) == 5 for r in recs)


def test_generate_stops_at_stop_codon():
    torch.manual_seed(0)
    tok = CodonTokenizer()
    model = GenSLM(GenSLMConfig.preset("debug", max_position_embeddings=64)).eval()
    with torch.no_grad():  # make TAA overwhelmingly likely after a few tokens
        model.embed_out.weight.zero_()
        model.embed_out.weight[tok.token_to_id["TAA"]] = 1.0
        model.final_layer_norm.bias.fill_(5.0)
        model.final_layer_norm.weight.zero_()
    seq = sample(model, tok, "ATG", 20, seed=0, stop_at_stop_codon=True)
    assert seq == "ATGTAA"
    with pytest.raises(ValueError, match="codon tokenizer"):
        sample(model, NucleotideTokenizer(), "", 3, stop_at_stop_codon=True)


def test_embed_is_mean_over_tokens(tiny):
    model, cfg, tok = tiny
    seq = "ACGTTGCA" * 5  # 40 tokens: two windows of the 32-token context
    got = embed_sequence(model, tok, seq)
    ids = torch.from_numpy(tok.encode(seq))
    h1 = model(ids[None, :32], torch.arange(32)[None], return_hidden=True)[0]
    h2 = model(ids[None, 32:], torch.arange(8)[None], return_hidden=True)[0]
    np.testing.assert_allclose(got, torch.cat([h1, h2]).mean(0).detach().numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="empty"):
        embed_sequence(model, tok, "")
