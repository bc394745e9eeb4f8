"""``ds4sci bench ablation``: the per-row figures from synthetic runs, the report, and one real measurement against
the planner."""
import pytest

from ds4sci.bench import ablation
from ds4sci.bench.report import MIB

SHAPE = {"hidden": 32, "heads": 4, "mlp_tile": 64, "loss_tile": 64}


def _run(row, L, S, device_per_layer, working, host=0):
    """A run saving ``device_per_layer`` bytes per token per layer plus 100 bytes per token outside the layers, whose
    peak adds ``working`` bytes per token and 1 MiB."""
    device = S * (L * device_per_layer + 100)
    return {"row": row, "layers": L, "seq_len": S, "saved": device + host, "host": host, "device": device,
            "peak": device + working * S + MIB}


def test_summary_reads_the_slopes_and_the_budget():
    vector = 32 * 4
    runs = [_run(row, L, S, d * vector, w * vector, host=h * L * S * vector)
            for row, d, w, h in (("baseline", 17, 17, 0), ("+ checkpointing", 1, 34, 0), ("+ host offload", 0, 20, 1))
            for L in (1, 2) for S in (256, 512, 1024)]
    report = {"command": "ds4sci bench ablation", "allocator": "Allocator: defaults.", "runs": runs,
              "config": {"seq_lens": [256, 512, 1024], "layers": [1, 2], **SHAPE, "budget_mib": 2.0}}
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
    # the planner's figures for the same shape (exact per-layer terms: tests/test_plan.py; 15 hidden vectors, the
    # rotary tables, the norms' statistics and the lse)
    assert rows["baseline"]["planner_per_layer_vectors"] == pytest.approx(15.375)
    assert rows["+ checkpointing"]["planner_per_layer_vectors"] == 1
    report["summary"] = list(rows.values())
    text = ablation.markdown(report)
    assert "| baseline | 17.00 | 15.38 |" in text and "| + checkpointing | 2 | " in text


@pytest.mark.distributed
def test_host_offload_row_measures_what_the_planner_predicts():
    """A real run of the last row (full checkpointing, tiled MLP, host offload) through the trainer's
    apply_activation_checkpointing at 1 and 2 layers: nothing per layer left on the device, one hidden vector per
    token per layer in host memory, the planner's host bytes."""
    S = 256
    runs = [ablation.measure("+ host offload", SHAPE, L, S) for L in (1, 2)]
    assert runs[1]["device"] == runs[0]["device"] > 0
    assert runs[1]["host"] - runs[0]["host"] == 32 * 4 * S
    assert runs[1]["host"] == ablation.planner("+ host offload", SHAPE, 2, S)["host"]
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
