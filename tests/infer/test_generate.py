"""generate: reproducible sampling, greedy decoding (cached, equal to the uncached loop), top-k / top-p filters,
batched sequences equal to each decoded alone, stop codons per sequence, and the command's FASTA."""
import pytest
import torch

from ds4sci.data import CodonTokenizer
from ds4sci.data import NucleotideTokenizer
from ds4sci.infer.generate import filter_logits
from ds4sci.infer.generate import sample
from ds4sci.io.export import export_consolidated
from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm import GenSLMConfig


def test_generate_reproducible_greedy_and_fasta(tmp_path, tiny):
    model, cfg, tok = tiny
    a = sample(model, tok, "ACG", 10, seed=3)[0]
    assert [a] == sample(model, tok, "ACG", 10, seed=3) and a.startswith("ACG") and len(a) == 13
    assert set(a) <= set("ACGTN")
    greedy = sample(model, tok, "ACG", 10, temperature=0)
    assert sample(model, tok, "ACG", 10, top_k=1, seed=9) == greedy
    with pytest.raises(ValueError, match=r"exceeds the model's context of 32 tokens: .* ask for at most 29 "
                                         r"\(--num-tokens\), or shorten the prompt"):
        sample(model, tok, "ACG", 100)
    with pytest.raises(ValueError, match="context of 32 tokens: .*; shorten the prompt$"):
        sample(model, tok, "ACGT" * 8, 1)
    assert sample(model, tok, "acg", 10, seed=3) == [a]  # soft-masked prompt is uppercased
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
    assert sample(model, tok, "ATG", 20, seed=0, stop_at_stop_codon=True) == ["ATGTAA"]
    with pytest.raises(ValueError, match="codon tokenizer"):
        sample(model, NucleotideTokenizer(), "", 3, stop_at_stop_codon=True)


def _uncached_greedy(model, tok, ids: list[int], num_tokens: int) -> list[int]:
    """The oracle: recompute the whole prefix for every token (generate's loop before the cache)."""
    for _ in range(num_tokens):
        logits = model(torch.tensor([ids]), torch.arange(len(ids))[None])[0, -1]  # [V]
        logits[sorted(tok.special_ids)] = float("-inf")
        ids = ids + [int(logits.argmax())]
    return ids


@pytest.mark.parametrize("pe,kv_heads", [("learned", 4), ("rotary", 2), ("alibi", 1)])
def test_cached_greedy_equals_uncached_loop(pe, kv_heads):
    torch.manual_seed(0)
    tok = NucleotideTokenizer()
    # weights large enough (init_std 0.3) and rotary on every dim, so that a wrong position changes the greedy tokens
    model = GenSLM(GenSLMConfig.preset("debug", vocab_size=tok.vocab_size, max_position_embeddings=32,
                                       position_embedding=pe, num_kv_heads=kv_heads, rotary_pct=1.0,
                                       init_std=0.3)).eval()
    with torch.no_grad():
        want = _uncached_greedy(model, tok, tok.encode("ACGTA").tolist(), 20)
    assert sample(model, tok, "ACGTA", 20, temperature=0, num_sequences=2) == ["ACGTA" + tok.decode(want[5:])] * 2


def test_batched_sequences_equal_each_decoded_alone(tiny):
    model, _, tok = tiny
    batch = sample(model, tok, "ACG", 20, num_sequences=3, seed=5, top_k=3, top_p=0.9)
    assert batch == [sample(model, tok, "ACG", 20, seed=5 + i, top_k=3, top_p=0.9)[0] for i in range(3)]
    assert len(set(batch)) == 3  # each its own randomness


def test_each_sequence_of_a_batch_stops_at_its_own_stop_codon():
    torch.manual_seed(0)
    tok = CodonTokenizer()
    model = GenSLM(GenSLMConfig.preset("debug", max_position_embeddings=64)).eval()
    with torch.no_grad():  # TAA and AAA equally likely, nothing else
        model.embed_out.weight.zero_()
        model.embed_out.weight[[tok.token_to_id["TAA"], tok.token_to_id["AAA"]]] = 1.0
        model.final_layer_norm.bias.fill_(5.0)
        model.final_layer_norm.weight.zero_()
    batch = sample(model, tok, "ATG", 6, num_sequences=5, seed=1, stop_at_stop_codon=True)
    assert batch == [sample(model, tok, "ATG", 6, seed=1 + i, stop_at_stop_codon=True)[0] for i in range(5)]
    for seq in batch:  # whole codons, AAA until the first TAA, which ends it (or 6 codons)
        codons = [seq[i:i + 3] for i in range(3, len(seq), 3)]
        assert codons in (["AAA"] * 6, ["AAA"] * (len(codons) - 1) + ["TAA"])
    assert len({len(seq) for seq in batch}) >= 3  # stopped at different steps while the others went on
