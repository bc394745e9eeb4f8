"""generate: reproducible sampling, greedy decoding, top-k / top-p filters, stop codons, and the command's FASTA."""
import pytest
import torch

from ds4sci.data import CodonTokenizer, NucleotideTokenizer
from ds4sci.infer.generate import filter_logits, sample
from ds4sci.io.export import export_consolidated
from ds4sci.models.genslm import GenSLM, GenSLMConfig


def test_generate_reproducible_greedy_and_fasta(tmp_path, tiny):
    model, cfg, tok = tiny
    a = sample(model, tok, "ACG", 10, seed=3)
    assert a == sample(model, tok, "ACG", 10, seed=3) and a.startswith("ACG") and len(a) == 13
    assert set(a) <= set("ACGTN")
    greedy = sample(model, tok, "ACG", 10, temperature=0)
    assert sample(model, tok, "ACG", 10, top_k=1, seed=9) == greedy
    with pytest.raises(ValueError, match=r"exceeds the model's context of 32 tokens: .* ask for at most 29 "
                                         r"\(--num-tokens\), or shorten the prompt"):
        sample(model, tok, "ACG", 100)
    with pytest.raises(ValueError, match="context of 32 tokens: .*; shorten the prompt$"):
        sample(model, tok, "ACGT" * 8, 1)
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
