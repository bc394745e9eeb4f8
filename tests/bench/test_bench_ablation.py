"""``ds4sci bench ablation``: the per-row figures from synthetic runs, the report, the options' one-line errors, and
real measurements against the planner on one process and per rank under Ulysses 2 and TP 2 (gloo; saved bytes are
exact, so they are compared exactly)."""
import pytest

from ds4sci.bench import ablation
from ds4sci.bench.report import MIB

SHAPE = {"hidden": 32, "heads": 4, "mlp_tile": 64, "loss_tile": 64}


def _run(row, L, S, device_per_layer, working, host=0):
    """A run saving ``device_per_layer`` bytes per token per layer plus 100 bytes per token outside the layers, whose
    peak adds ``working`` bytes per token and 1 MiB."""
    device = S * (L * device_per_layer + 100)
    return {"layout": "1", "row": row, "layers": L, "seq_len": S, "saved": device + host, "host": host,
            "device": device, "peak": device + working * S + MIB, "held": L, "params": 1024 * L, "grads": 512 * L}


def test_summary_reads_the_slopes_and_the_budget():
    vector = 32 * 4
    runs = [_run(row, L, S, d * vector, w * vector, host=h * L * S * vector)
            for row, d, w, h in (("baseline", 17, 17, 0), ("+ checkpointing", 1, 34, 0), ("+ host offload", 0, 20, 1))
            for L in (1, 2) for S in (256, 512, 1024)]
    report = {"command": "ds4sci bench ablation", "allocator": "Allocator: defaults.", "runs": runs,
              "config": {"seq_lens": [256, 512, 1024], "layers": [1, 2], "layouts": ["1"], **SHAPE,
                         "budget_mib": 2.0}}
    rows = {r["row"]: r for r in ablation.summarize(report)}
    assert set(rows) == {"baseline", "+ checkpointing", "+ host offload"}
    assert rows["+ host offload"]["per_layer_vectors"] == 0  # what went to the host is not on the device
    assert rows["+ host offload"]["working_vectors"] == pytest.approx(20)
    assert rows["+ host offload"]["host_bytes"] == 2 * 1024 * vector
    assert rows["baseline"]["per_layer_vectors"] == pytest.approx(17)
    assert rows["+ checkpointing"]["per_layer_vectors"] == pytest.approx(1)
    assert rows["+ checkpointing"]["working_vectors"] == pytest.approx(34)
    per_token = 2 * 17 * vector + 100 + 17 * vector  # peak = 1 MiB + S x per_token at L = 2
    assert rows["baseline"]["longest_within_budget"] == int(MIB / per_token)
    # the planner's figures for the same shape (exact per-layer terms: tests/planning/test_genslm_plan.py; 15 hidden
    # vectors, the rotary tables, the norms' statistics and the lse)
    assert rows["baseline"]["planner_per_layer_vectors"] == pytest.approx(15.375)
    assert rows["+ checkpointing"]["planner_per_layer_vectors"] == 1
    report["summary"] = list(rows.values())
    text = ablation.markdown(report)
    assert "| one process | baseline | 17.00 | 15.38 |" in text and "| one process | + checkpointing | 2 | " in text
    assert "| one process | 2 | 2 | 2.0 | " in text  # blocks held, parameter KiB at L = 2


S = 256  # tokens of every real run
WORLD2 = ["tp2", "ring2", "pp2", "dp2xzero3"]  # the 2-rank layouts, measured in one process group per row


@pytest.fixture(scope="module")
def world2():
    """``world2(row, layout)``: ``row``'s runs under ``layout`` of :data:`WORLD2` at 2 and 4 layers; each row is
    measured once, under every layout of WORLD2 in one process group, for all the tests that read it."""
    measured = {}

    def runs(row: str, layout: str) -> list[dict]:
        if row not in measured:
            measured[row] = ablation.measure(row, SHAPE, [(2, S), (4, S)], WORLD2)
        return [r for r in measured[row] if r["layout"] == layout]

    return runs


@pytest.mark.distributed
@pytest.mark.parametrize("layout, ranks", [("1", 1), ("tp2", 2)])
def test_host_offload_row_measures_what_the_planner_predicts(layout, ranks, world2):
    """A real run of the last row (full checkpointing, tiled MLP, host offload) through the trainer's
    apply_activation_checkpointing at two depths (1 and 2 layers on one process; under TP 2, 2 and 4 layers: the
    row's run under every 2-rank layout), on one process and per rank under TP 2: nothing per layer left on the
    device, each block's input (this rank's ``S / ranks`` tokens) in host memory, the planner's host bytes. Under TP
    the first block's input is the region split from the embedding, which must own its storage to be moved (a view of
    the embedding stayed on the device, half the planner's host bytes at 2 layers)."""
    row = "+ host offload"
    runs = ablation.measure(row, SHAPE, [(1, S), (2, S)], layout) if ranks == 1 else world2(row, layout)
    added = runs[1]["layers"] - runs[0]["layers"]
    assert runs[1]["device"] == runs[0]["device"] > 0
    assert runs[1]["host"] - runs[0]["host"] == added * 32 * 4 * S // ranks
    assert runs[1]["host"] == ablation.planner(row, SHAPE, runs[1]["layers"], S, layout)["host"]
    assert all(r["peak"] > 0 for r in runs)


def test_the_tiled_loss_row_follows_the_baseline_and_stays_on():
    """ALST's order: every row after the baseline computes the loss over tiles, so the tiled loss is the first switch
    added and every later row keeps it; the planner's figure for that row has the loss tile's working set and no
    logits term."""
    rows = list(ablation.ROWS.items())
    assert rows[0] == ("baseline", {"mode": "none"}) and rows[1][0] == "+ tiled loss"
    assert all(switches.get("tiled_loss") for _, switches in rows[1:])
    base, tiled = (ablation.planner(row, SHAPE, 2, 512) for row in ("baseline", "+ tiled loss"))
    assert base["per_layer"] == tiled["per_layer"] and tiled["peak"] != base["peak"]


def _per_layer(runs):
    """Bytes per token of the full sequence per layer left on the device, from runs at two depths."""
    return (runs[1]["device"] - runs[0]["device"]) / ((runs[1]["layers"] - runs[0]["layers"]) * S)


@pytest.mark.distributed
def test_ulysses_2_ranks_keep_half_the_one_process_per_layer_bytes():
    """Full checkpointing under Ulysses 2, through the trainer's parallelize and apply_activation_checkpointing: each
    rank keeps its half of every block input, exactly half the one-process figure per token of the full sequence
    (the planner's, exact against saved-tensor hooks on one process: tests/planning/test_genslm_plan.py), and the
    planner's per-rank figure."""
    runs = ablation.measure("+ checkpointing", SHAPE, [(1, S), (2, S)], "ulysses2")
    assert [len(r["ranks"]) for r in runs] == [2, 2]
    assert runs[1]["ranks"][0]["device"] == runs[1]["ranks"][1]["device"]
    one = ablation.planner("+ checkpointing", SHAPE, 2, S)["per_layer"]
    assert one == 32 * 4  # one hidden vector: the block input
    assert _per_layer(runs) == one / 2 == ablation.planner("+ checkpointing", SHAPE, 2, S, "ulysses2")["per_layer"]


@pytest.mark.distributed
def test_tp_re_gather_row_saves_this_ranks_region(world2):
    """The TP re-gather row: TP 2 without checkpointing (at 2 and 4 layers, the baseline's run under every 2-rank
    layout). The column-parallel layers save this rank's sequence region of their inputs (re-gathered in backward),
    so a rank keeps half the one-process bytes per layer per token of the full sequence, plus the rotary tables of
    the gathered positions (``2 rotary_dim (tp - 1)`` fp32 values per local token); saving the gathered ``[B, S, h]``
    inputs would add one hidden vector. The planner's per-rank figure."""
    runs = world2("baseline", "tp2")
    one = ablation.planner("baseline", SHAPE, 4, S)["per_layer"]
    rotary = 2 * ablation._config(SHAPE, 4, S).rotary_dim * (2 - 1) * 4
    assert _per_layer(runs) == (one + rotary) / 2 == ablation.planner("baseline", SHAPE, 4, S, "tp2")["per_layer"]


def test_planner_per_rank_figures_are_per_token_of_the_full_sequence():
    """Under Ulysses 2 and TP 2 the planner's per-layer figure with checkpointing is half the one-process figure (the
    block input of S / 2 tokens), and the working set shrinks with the rank's share."""
    one, uly, tp = (ablation.planner("+ tiled MLP", SHAPE, 2, 512, layout) for layout in ("1", "ulysses2", "tp2"))
    assert uly["per_layer"] == tp["per_layer"] == one["per_layer"] / 2
    assert uly["working_per_token"] < one["working_per_token"] and tp["working_per_token"] < one["working_per_token"]


@pytest.mark.distributed
def test_ring_pipeline_and_zero3_rows_measure_what_the_planner_predicts(world2):
    """The baseline row under ring 2 (zigzag), PP 2 and ZeRO-3 over 2 data ranks, in one process group, each through
    the trainer's own path (parallelize; build_pipeline_engine and pipeline_train_batch; build_engine at ZeRO-3), at 2
    and 4 layers. Ring 2: each rank saves exactly half the one-process bytes per layer per token of the full sequence
    (the one-process figure is the planner's, exact against saved-tensor hooks: tests/planning/test_genslm_plan.py).
    PP 2: each stage holds L / 2 blocks and saves per block what one process does. ZeRO-3: a data rank saves per layer
    what one process does, holds its parameter partitions beside the (all persistent, tiny) gathered tensors and is
    handed half the gradients. Every figure equals the planner's per-rank one exactly."""
    row = "baseline"
    layouts = ["ring2", "pp2", "dp2xzero3"]
    by = {layout: world2(row, layout) for layout in layouts}
    one = ablation.planner(row, SHAPE, 4, S)
    assert one["per_layer"] % 2 == 0

    def per_layer(layout):
        small, large = by[layout]
        return (large["device"] - small["device"]) / ((large["held"] - small["held"]) * S)

    assert per_layer("ring2") == one["per_layer"] / 2 == ablation.planner(row, SHAPE, 4, S, "ring2")["per_layer"]
    assert [[r["held"] for r in run["ranks"]] for run in by["pp2"]] == [[1, 1], [2, 2]]  # L / 2 per stage
    assert per_layer("pp2") == per_layer("dp2xzero3") == one["per_layer"]
    for layout in layouts:
        small, large = by[layout]
        predicted = ablation.planner(row, SHAPE, 4, S, layout)
        assert per_layer(layout) == predicted["per_layer"], layout
        assert (large["held"], large["params"], large["grads"]) == (
            predicted["held"], predicted["params"], predicted["grads"]), layout
    assert by["dp2xzero3"][1]["grads"] * 2 == by["ring2"][1]["grads"]  # ring 2 keeps whole gradients


@pytest.mark.distributed
def test_host_offload_row_under_ring_pipeline_and_zero3(world2):
    """The last row (full checkpointing, tiled MLP, host offload) under ring 2, PP 2 and ZeRO-3, one process group:
    nothing per layer left on the device, and the planner's host bytes on every rank (ring 2: this rank's S / 2
    tokens of each block input; PP 2: its stage's L / 2 blocks; ZeRO-3: every block of its own sequence)."""
    vector = 32 * 4
    for layout, blocks, tokens in (("ring2", 4, S // 2), ("pp2", 2, S), ("dp2xzero3", 4, S)):
        small, large = world2("+ host offload", layout)
        assert large["device"] == small["device"] > 0, layout  # the same outside the layers, nothing per layer
        assert [r["host"] for r in large["ranks"]] == [blocks * tokens * vector] * 2, layout
        assert large["host"] == ablation.planner("+ host offload", SHAPE, 4, S, layout)["host"], layout


def test_planner_under_pipeline_and_zero3():
    """The planner's per-rank figures the ring, PP 2 and ZeRO-3 rows are held against: a stage holds L / 2 blocks
    (one micro-batch in flight), each as on one process; ZeRO-3 over 2 data ranks keeps the per-layer bytes and halves
    the gradients; ring 2 halves the per-layer bytes."""
    one, ring, pp, zero = (ablation.planner("+ tiled MLP", SHAPE, 4, 512, layout)
                           for layout in ("1", "ring2", "pp2", "dp2xzero3"))
    assert (one["held"], pp["held"], zero["held"]) == (4, 2, 4)
    assert pp["per_layer"] == zero["per_layer"] == one["per_layer"] == 2 * ring["per_layer"]
    assert zero["grads"] == one["grads"] / 2


@pytest.mark.parametrize("argv, message", [
    (["--quick", "--layouts", "1,zero3"], "'zero3': give the ranks ZeRO-3 partitions over, e.g. dp2xzero3"),
    (["--quick", "--layouts", "pp2xzero3"], "'pp2xzero3': DeepSpeed's pipeline engine runs ZeRO stage 0 or 1"),
    (["--quick", "--layouts", "pp2"], "pp=2 pipeline stages need at least 2 layers, the model has 1"),
    (["--quick", "--layouts", "tp2xfoo"], "expected degrees like tp2xulysses2"),
    (["--quick", "--rows", "baseline,tiled"], "--rows tiled: not a row"),
    (["--quick", "--layouts", "ulysses8"], "ulysses"),
    (["--layouts", "tp2xulysses2", "--seq-lens", "1K,2050", "--layers", "1,2"], "--seq-lens 2050: layout"),
])
def test_bad_option_one_line(argv, message, capsys):
    from cli_checks import refused  # tests/ is on sys.path (its conftest.py)

    assert message in refused(capsys, ["bench", "ablation", *argv, "--out", "/nonexistent/never"])


def test_each_run_is_announced_before_it_is_measured(monkeypatch, caplog, tmp_path):
    """``ds4sci bench ablation`` runs for minutes: in a log (no terminal, so no bar) each run gets a line naming it
    before its measurement starts."""
    import logging

    from ds4sci.cli import main

    class Started(Exception):
        pass

    def measure(row, shape, runs, layout):
        raise Started(row, runs, layout)

    monkeypatch.setattr(ablation, "measure", measure)
    caplog.set_level(logging.INFO, logger="ds4sci.bench.ablation")
    with pytest.raises(Started):
        main(["--log-level", "DEBUG", "bench", "ablation", "--quick", "--out", str(tmp_path)])
    lines = [r.getMessage() for r in caplog.records if r.name == "ds4sci.bench.ablation"]
    assert len(lines) == 1 and lines[0].startswith("ablation: run 1 of "), lines
    assert "baseline" in lines[0] and "layers, S = " in lines[0], lines[0]
