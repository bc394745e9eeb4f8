"""``ds4sci bench layouts``: per-rank model states, activations and bytes sent of real Trainer steps.

One ``--quick`` run (world 2: dp2 at ZeRO 1, tp2 at ZeRO 0) is checked for its files and fields and against
properties that must hold whatever the planner says: ZeRO-1 partitions AdamW's two fp32 moments (and DeepSpeed's
fp32 master copy) over the two data ranks, i.e. 1/2 of ZeRO-0's ``8 x parameters``, TP2 holds half of every split
parameter, data parallelism all-reduces exactly the gradients (plus the trainer's loss sums), and the
saved-for-backward peak of the dp2 step is the planner's activation term to within 1 %.
"""

import pytest

from ds4sci.bench import layout_memory

from bench_checks import quick_report  # tests/bench/ is on sys.path
from cli_checks import refused  # tests/ is on sys.path (its conftest.py)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    return out, quick_report(out, "layouts")


@pytest.mark.distributed
def test_quick_writes_the_three_files(quick):
    out, report = quick
    assert [(r["layout"], r["zero"]) for r in report["runs"]] == [("dp2", 1), ("tp2", 0)]
    for r in report["runs"]:
        assert set(r["measured"]) == set(r["predicted"]) == set(layout_memory.MEMORY_TERMS)
        assert set(r["predicted_sent"]) == set(layout_memory.COMM_TERMS)
        assert set(r["measured_sent"]) == {*layout_memory.COMM_TERMS, "other"}
        assert len(r["ranks"]) == 2 and all(v > 0 for v in r["measured"].values())
    text = (out / "layouts.md").read_text()
    assert "| dp2 | 1 |" in text and "| tp2 | 0 |" in text and "ds4sci bench layouts --quick" in text
    assert (out / "layouts.png").stat().st_size > 0


@pytest.mark.distributed
def test_zero1_partitions_the_adam_moments_and_tp2_halves_the_split_parameters(quick):
    _, report = quick
    z1, tp2 = report["runs"]
    for rank in z1["ranks"]:  # fp32: params = 4 bytes x parameters, held whole; ZeRO-0's moments = 2 x params
        assert rank["moments"] == pytest.approx(2 * rank["params"] / 2, rel=1e-3)  # DeepSpeed pads partitions a little
        assert rank["master"] == pytest.approx(rank["params"] / 2, rel=1e-3)  # the fp32 partition DeepSpeed copies
        assert rank["grads"] == pytest.approx(rank["params"] / 2, rel=1e-3)  # what the optimizer is handed
    from ds4sci.data import NucleotideTokenizer
    from ds4sci.models.genslm import GenSLM
    from ds4sci.models.genslm import GenSLMConfig

    c = report["config"]
    full = GenSLM(GenSLMConfig.preset("debug", vocab_size=NucleotideTokenizer().vocab_size, hidden_size=c["hidden"],
                                      num_heads=c["heads"], num_layers=c["layers"],
                                      max_position_embeddings=c["seq_len"]))
    sizes = {n: p.numel() * 4 for n, p in full.named_parameters()}
    for rank in tp2["ranks"]:
        split = rank["tp_split"]
        assert any(".query_key_value." in n for n in split) and any("embed_out" in n for n in split)
        assert all(2 * b == sizes[n] for n, b in split.items()), split


@pytest.mark.distributed
def test_dp_all_reduces_the_gradients_and_activations_match_the_planner(quick):
    _, report = quick
    z1 = report["runs"][0]
    for rank in z1["ranks"]:
        reduced = rank["sent"]["sdp"]["all_reduce"]
        # a ring all-reduce of every gradient (P = 2: the gradient bytes once) plus the trainer's fp64 loss sums
        assert 0 <= reduced - rank["params"] <= 64, (reduced, rank["params"])
        assert rank["sent"]["sdp"]["all_gather"] == rank["params"] / 2  # the updated halves, to the other rank
    assert z1["measured"]["activations"] == pytest.approx(z1["predicted"]["activations"], rel=0.01)


@pytest.mark.distributed
def test_planner_predicts_the_quick_layouts_model_states_and_bytes_sent(quick):
    """ds4sci.planning against DeepSpeed 0.19.8's real steps: ZeRO-1 hands the optimizer 1/2 of the gradients, keeps an
    fp32 master copy beside the moments and all-reduces then all-gathers; TP2 without dropout sends 8 (P-1)/P N h e
    per layer (backward's re-gather of the column-parallel inputs included) plus the embedding's, the final layer
    norm's and the loss's collectives. Activations under TP within 1% (the region the embedding is split to owns
    its storage: a view of the embedding's ``[1, T, h]`` output kept ``(tp - 1) h e`` per local token more alive)."""
    _, report = quick
    for r in report["runs"]:
        for term in ("params", "grads", "optimizer"):
            assert r["measured"][term] == pytest.approx(r["predicted"][term], rel=0.01), (r["layout"], term)
        for term in layout_memory.COMM_TERMS:
            assert r["measured_sent"][term] == pytest.approx(r["predicted_sent"][term], rel=0.01), (r["layout"], term)
    tp2 = report["runs"][1]
    assert tp2["measured"]["activations"] == pytest.approx(tp2["predicted"]["activations"], rel=0.01)


@pytest.mark.parametrize("text, world, message", [
    ("tp2xfoo2", 4, "expected degrees like tp2xulysses2"),
    ("tp2xtp2", 4, "each once"),
    ("tp3", 4, "multiply to 3, not --world=4"),
])
def test_parse_layout_names_the_bad_layout(text, world, message):
    with pytest.raises(ValueError, match=message):
        layout_memory.parse_layout(text, world)


def test_parse_layout_fills_data_parallelism():
    assert layout_memory.parse_layout("tp2xpp2", 8) == {"tp": 2, "ulysses": 1, "ring": 1, "pp": 2, "dp": 2}
    assert layout_memory.parse_layout("dp4", 4)["dp"] == 4


@pytest.mark.parametrize("argv, message", [
    (["--layouts", "ulysses8", "--world", "8", "--heads", "4"], "tp x ulysses = 8 must divide --heads=4"),
    (["--layouts", "dp3xtp2"], "multiply to 6, not --world=4"),
    (["--zero-stages", "0,4"], "'0,4': expected ZeRO stages 0-3"),
])
def test_bad_option_one_line(argv, message, capsys):
    assert message in refused(capsys, ["bench", "layouts", *argv, "--out", "/nonexistent/never"])


def test_zero_stages_parse():
    assert layout_memory._stages("3,0,1,0") == (0, 1, 3)
