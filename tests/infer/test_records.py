"""Many records: length-aware batching and packing equal one window at a time; records dealt by token count."""
import numpy as np
import pytest
import torch

from ds4sci.data import FastaRecord
from ds4sci.data import NucleotideTokenizer
from ds4sci.infer.batching import deal
from ds4sci.infer.batching import plan_batches
from ds4sci.infer.embed import embed_stream
from ds4sci.infer.evaluate import RecordWindows
from ds4sci.infer.evaluate import record_windows
from ds4sci.infer.parallel import ShardedForward
from ds4sci.infer.score import score_stream
from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm import GenSLMConfig

SEQ_LEN = 16
# 1 token, short records that pack together, one of exactly a window, and records longer than a window
LENGTHS = [1, 3, 5, 2, 7, 16, 40, 9, 1, 23, 4]


@pytest.fixture(scope="module")
def setup():
    """A rotary-free learned-position model with init_std 0.2, so a token seen across records moves every number."""
    torch.manual_seed(0)
    tok = NucleotideTokenizer()
    cfg = GenSLMConfig.preset("debug", vocab_size=tok.vocab_size, max_position_embeddings=32, init_std=0.2,
                              position_embedding="learned")
    rng = np.random.default_rng(0)
    records = [FastaRecord(f"r{i}", "", "".join(rng.choice(list("ACGT"), n))) for i, n in enumerate(LENGTHS)]
    return GenSLM(cfg).eval(), tok, records


def _one_at_a_time(model, tok, records, stride):
    """Per record: (summed loss, targets, owned-state sum, per-token states), each window alone in its batch."""
    runner, out = ShardedForward(model), []
    for rec in records:
        loss, count, states = 0.0, 0, []
        for w in record_windows(tok.encode(rec.sequence), SEQ_LEN, stride):
            (_, batch), = runner.batches(RecordWindows([w], tok), [0], 1)
            sums, counts = runner.losses(batch)
            loss, count = loss + sums[0], count + counts[0]
            states += runner.owned_states(batch)
        states = np.concatenate(states)
        out.append((loss, count, states.mean(0), states))
    return out


@pytest.mark.parametrize("stride, configs", [(None, [(48, True)]), (6, [(40, True), (64, False)])])
def test_packed_and_bucketed_equal_one_window_at_a_time(setup, stride, configs):
    model, tok, records = setup
    expected = _one_at_a_time(model, tok, records, stride)
    for max_tokens, pack in configs:
        options = dict(stride=stride, max_tokens=max_tokens, pack=pack)
        scores = dict(score_stream(model, tok, records, SEQ_LEN, **options))
        means = {r: v for r, _, v in embed_stream(model, tok, records, SEQ_LEN, **options)}
        states = {r: v for r, _, v in embed_stream(model, tok, records, SEQ_LEN, per_token=True, **options)}
        assert sorted(scores) == sorted(means) == sorted(states) == list(range(len(records)))
        for r, (loss, count, mean, per_token) in enumerate(expected):
            assert scores[r]["id"] == records[r].id and scores[r]["tokens"] == count
            assert scores[r]["log_likelihood"] == pytest.approx(-loss, rel=1e-5, abs=1e-5), (r, max_tokens, pack)
            np.testing.assert_allclose(means[r], mean, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(states[r], per_token, rtol=1e-4, atol=1e-5)


def test_reverse_complement_streams_the_mean_of_both_strands(setup):
    model, tok, records = setup
    both = dict(score_stream(model, tok, records, SEQ_LEN, True, max_tokens=64))
    plus = dict(score_stream(model, tok, records, SEQ_LEN, max_tokens=64))
    minus = dict(score_stream(model, tok, [FastaRecord(r.id, "", tok.decode(tok.reverse_complement(
        tok.encode(r.sequence)))) for r in records], SEQ_LEN, max_tokens=64))
    for r in range(len(records)):
        assert both[r]["log_likelihood"] == pytest.approx(
            (plus[r]["log_likelihood"] + minus[r]["log_likelihood"]) / 2, rel=1e-5, abs=1e-6)


def test_plan_covers_every_window_once_within_the_budget():
    rng = np.random.default_rng(1)
    owner = np.repeat(np.arange(50), rng.integers(1, 4, 50))
    lengths = np.where(np.r_[owner[1:] != owner[:-1], True], rng.integers(1, 17, len(owner)), 16)
    padded = {}
    for pack in (True, False):
        for together in (True, False):
            plan = plan_batches(lengths, owner, 64, 16, pack, together)
            rows = [row for batch in plan for row in batch]
            assert sorted(w for row in rows for w in row) == list(range(len(owner)))
            padded[pack, together] = sum(len(batch) * max(lengths[row].sum() for row in batch) for batch in plan)
            assert all(len(batch) * max(lengths[row].sum() for row in batch) <= 64 for batch in plan)
            assert all(lengths[row].sum() <= 16 for row in rows)
            assert any(len(row) > 1 for row in rows) == pack
            flat = [w for row in rows for w in row]  # a record's windows in order
            for r in range(50):
                mine = [w for w in flat if owner[w] == r]
                assert mine == sorted(mine)
        # the short last windows of long records batched by length (or packed) pad less than beside full windows
        assert padded[pack, False] < padded[pack, True]
    assert plan_batches([40], [0], 8, 16) == [[[0]]]  # a row over the budget goes alone


def test_deal_balances_tokens_longest_first():
    sizes = [10, 1, 7, 3, 3, 8, 2, 2]
    part = deal(sizes, 3)
    loads = np.bincount(part, weights=sizes, minlength=3)
    assert loads.tolist() == [12, 12, 12]
    assert deal(sizes, 1).tolist() == [0] * 8
    with pytest.raises(ValueError, match="parts"):
        deal(sizes, 0)


def test_progress_logs_records_tokens_and_eta_when_redirected(caplog):
    from ds4sci.progress import record_progress

    with caplog.at_level("INFO", logger="ds4sci.progress"):
        with record_progress(True, "score", 4, interval_s=0) as show:  # stderr is not a terminal under pytest
            show(1, 100)
            show(1, 50)
        with record_progress(False, "score", 4, interval_s=0) as show:
            show(1, 100)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and lines[0].startswith("score: 1/4 records, 100 tokens, ")
    assert lines[1].startswith("score: 2/4 records, 150 tokens, ") and "records/s, ETA 0:" in lines[1]


def test_batches_read_on_threads_give_the_same_numbers_in_the_same_order(setup):
    """On the CPU several batches are read at once (``ShardedForward.map_batches``), each operator on one thread:
    scores, mean and per-token embeddings come out bitwise equal to the batches read one after the other on one
    thread, in the same order. (Against several intra-op threads they can differ in the last bits: MKL's GEMM of a
    few rows rounds differently on two threads than on one.)"""
    model, tok, records = setup
    options = dict(max_tokens=24, pack=True)  # many small batches, packed and not
    threads = torch.get_num_threads()
    for stride in (None, 6):
        runs = {}
        for workers in (1, 3):
            runner = ShardedForward(model, workers=workers)
            torch.set_num_threads(1)
            try:
                runs[workers] = (
                    list(score_stream(model, tok, records, SEQ_LEN, stride=stride, runner=runner, **options)),
                    list(embed_stream(model, tok, records, SEQ_LEN, stride=stride, runner=runner, **options)),
                    list(embed_stream(model, tok, records, SEQ_LEN, stride=stride, per_token=True, runner=runner,
                                      **options)))
            finally:
                torch.set_num_threads(threads)
        (scores, means, states), (scores3, means3, states3) = runs[1], runs[3]
        assert scores == scores3
        for (i, name, v), (i3, name3, v3) in zip(means + states, means3 + states3, strict=True):
            assert (i, name) == (i3, name3)
            np.testing.assert_array_equal(v, v3)


@pytest.fixture
def three_threads():
    """torch's intra-op threads set to 3 for the test (a number no default gives here), restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    yield 3
    torch.set_num_threads(threads)


def test_map_batches_runs_workers_at_once_in_order_on_one_thread_each(three_threads):
    import threading
    import time

    model = GenSLM(GenSLMConfig.preset("debug", vocab_size=8, max_position_embeddings=8))
    threads = three_threads
    meet = threading.Barrier(2, timeout=10)  # two reads must be in flight together to pass
    inside, ahead, started, taken = [], [], [], []

    def read(i):
        started.append(i)
        ahead.append(len(started) - len(taken))
        inside.append(torch.get_num_threads())
        if i < 2:
            meet.wait()
        time.sleep(0.01 * (i % 3 == 0))  # later batches finish first
        return i * i

    runner = ShardedForward(model, workers=2)
    for i, value in runner.map_batches(read, range(9), 9):
        assert value == i * i
        taken.append(i)
    assert taken == list(range(9)) and inside == [1] * 9 and max(ahead) <= 3  # at most workers + 1 ahead
    assert torch.get_num_threads() == threads

    def broken(i):
        if i == 4:
            raise RuntimeError("batch 4")
        return i

    with pytest.raises(RuntimeError, match="batch 4"):
        list(runner.map_batches(broken, range(9), 9))
    assert torch.get_num_threads() == threads
    first = runner.map_batches(lambda i: i, range(9), 9)
    assert next(first) == (0, 0)
    first.close()  # a caller that stops early
    assert torch.get_num_threads() == threads
    # a job of fewer batches than workers: one after the other, each on every thread; the batches left to a
    # resumed job are read as the whole job's were
    few = ShardedForward(model, workers=3).map_batches(lambda i: torch.get_num_threads(), range(2), 2)
    assert list(few) == [(0, threads), (1, threads)]
    left = ShardedForward(model, workers=3).map_batches(lambda i: torch.get_num_threads(), range(2), 5)
    assert list(left) == [(0, 1), (1, 1)]


def test_batch_workers_follow_the_threads_on_the_cpu_and_are_one_across_sequence_ranks(three_threads):
    from types import SimpleNamespace

    from ds4sci.distributed.dims import ParallelDims

    model = GenSLM(GenSLMConfig.preset("debug", vocab_size=8, max_position_embeddings=8))
    assert ShardedForward(model).batch_workers() == three_threads
    assert ShardedForward(model, workers=2).batch_workers() == 2
    assert ShardedForward(model, SimpleNamespace(dims=ParallelDims(dp=1, ulysses=2))).batch_workers() == 1
    assert ShardedForward(model, SimpleNamespace(dims=ParallelDims(dp=2))).batch_workers() == three_threads
    with pytest.raises(ValueError, match="workers must be >= 1, got 0"):
        ShardedForward(model, workers=0)


def test_a_resumed_job_reads_its_batches_as_the_whole_job_did(setup):
    """``read_items`` tells ``map_batches`` the whole plan's batches, those of skipped records included: the batches
    left to a resumed job are read the same way (on threads or not) as in the uninterrupted run."""
    model, tok, records = setup
    runner, planned = ShardedForward(model, workers=3), []
    map_batches = runner.map_batches
    runner.map_batches = lambda read, batches, count: (planned.append(count), map_batches(read, batches, count))[1]
    whole = dict(score_stream(model, tok, records, SEQ_LEN, max_tokens=24, runner=runner))
    left = dict(score_stream(model, tok, records, SEQ_LEN, max_tokens=24, runner=runner,
                             skip=range(1, len(records))))
    assert planned[0] == planned[1] >= 3 and list(left) == [0] and left[0] == whole[0]


def test_a_windows_numbers_do_not_depend_on_the_rows_beside_it():
    """Off CUDA, inference runs PyTorch's fused causal attention, whose rounding follows a row's padded width: each
    window is read at its own length rounded up to WIDTH_STEP (at most the window), so every record's score and
    embeddings are bitwise the same alone as in batches of longer and shorter rows, on threads or not."""
    from ds4sci.infer.parallel import WIDTH_STEP
    from ds4sci.infer.parallel import width_groups

    torch.manual_seed(0)
    tok = NucleotideTokenizer()
    seq_len = 160
    cfg = GenSLMConfig.preset("debug", vocab_size=tok.vocab_size, max_position_embeddings=seq_len, init_std=0.2)
    model = GenSLM(cfg).eval()
    rng = np.random.default_rng(2)
    records = [FastaRecord(f"r{i}", "", "".join(rng.choice(list("ACGT"), n)))
               for i, n in enumerate([9, 70, 130, 160, 200, 3, 64, 65, 400])]
    for workers in (1, 2):
        runner = ShardedForward(model, workers=workers)
        together = dict(score_stream(model, tok, records, seq_len, max_tokens=4 * seq_len, runner=runner))
        states = {i: v for i, _, v in embed_stream(model, tok, records, seq_len, max_tokens=4 * seq_len,
                                                   per_token=True, runner=runner)}
        for i, rec in enumerate(records):
            alone, = dict(score_stream(model, tok, [rec], seq_len, runner=runner, max_tokens=seq_len)).values()
            assert alone == together[i], rec.id
            (_, _, state), = embed_stream(model, tok, [rec], seq_len, per_token=True, runner=runner)
            np.testing.assert_array_equal(state, states[i])
    slots = torch.tensor([[0] * 9 + [-1] * 151, [1] * 70 + [-1] * 90, [2] * 160])
    batch = {"slots": slots, "input_ids": torch.ones_like(slots)}
    groups = list(width_groups(batch, row_len=seq_len))
    def step(n):
        return -(-n // WIDTH_STEP) * WIDTH_STEP

    assert [g["slots"].shape for g in groups] == [(1, step(9)), (1, step(70)), (1, seq_len)]
    assert [int(g["slots"].max()) for g in groups] == [0, 1, 2] and int(groups[0]["slots"][0, 9]) == -1
    full = torch.zeros(1, 150, dtype=torch.long)  # a full window of a length off the step keeps its length
    assert [g["slots"].shape for g in width_groups({"slots": full}, row_len=150)] == [(1, 150)]
    assert [g["slots"].shape for g in width_groups({"slots": full})] == [(1, step(150))] and step(150) > 150
    wide = list(width_groups({"slots": slots[:1, :9], "input_ids": slots[:1, :9]}))  # padded up to the step
    assert wide[0]["slots"].shape == (1, step(9)) and step(9) > 9 and wide[0]["slots"][0, 9:].eq(-1).all()


def test_full_windows_are_read_at_the_window_length(setup):
    """Rounding a window's width up to WIDTH_STEP stops at the window length: a window of 12 tokens is not padded
    to 16 (bucketed and packed)."""
    model, tok, records = setup
    widths = []
    hook = model.register_forward_pre_hook(lambda module, args: widths.append(args[0].shape[1]))
    try:
        for pack in (False, True):
            list(score_stream(model, tok, records, 12, max_tokens=48, pack=pack))
    finally:
        hook.remove()
    assert widths and max(widths) == 12
