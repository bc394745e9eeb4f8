"""Sequence-parallel inference equals one process: per-record log-likelihoods (score), evaluate's loss, mean and
per-token embeddings, variant log-likelihood ratios (score-variants), under Ulysses, ring, hybrid Ulysses x ring and
Ulysses x data ranks, with learned, rotary and ALiBi positions and grouped-query attention, on records of uneven lengths
(one shorter than the layout's multiple, one longer than a window read with a stride); and
``torchrun ... score --ulysses 2``, ``mpiexec -n 2 ... score --ulysses 2`` and ``mpiexec -n 2 ... evaluate --ulysses 2``
write the single process's numbers.
"""
import contextlib
import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ds4sci.data import FastaRecord
from ds4sci.data import NucleotideTokenizer
from ds4sci.infer.embed import embed_records
from ds4sci.infer.embed import token_embeddings
from ds4sci.infer.evaluate import RecordWindows
from ds4sci.infer.evaluate import evaluate
from ds4sci.infer.evaluate import record_windows
from ds4sci.infer.parallel import ShardedForward
from ds4sci.infer.score import score_records
from ds4sci.infer.variants import Variant
from ds4sci.infer.variants import score_variants
from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm import GenSLMConfig
from ds4sci.spawn import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

BIN = Path(sys.executable).parent
SEQ_LEN, STRIDE = 16, 6
# 3 tokens (below the zigzag multiple 8 of U2 x R2), 1 (nothing to score), 13 (one window), 40 (windows at
# 0, 6, ..., 24)
SEQUENCES = {"short": "GAT", "one": "A", "mid": "ACGTTGCAAGGCT", "long": "ACGTTGCAAGGCTTACGGATCCTAGGCATTGCAACGTAGC"}


def _model(position_embedding: str, num_kv_heads: int = 0):
    """A 2-block nucleotide GenSLM with a 32-token context, the same on every process; init_std 0.2 so that a
    position or a key out of place changes every state well above the tolerance."""
    torch.manual_seed(0)
    tok = NucleotideTokenizer()
    cfg = GenSLMConfig.preset("debug", vocab_size=tok.vocab_size, max_position_embeddings=32, init_std=0.2,
                              position_embedding=position_embedding, num_kv_heads=num_kv_heads)
    return GenSLM(cfg).eval(), tok


def _records():
    return [FastaRecord(name, "", seq) for name, seq in SEQUENCES.items()]


# score-variants on the "long" record: an SNV, a deletion and an insertion (20-base windows, ALT ones too)
VARIANTS = [Variant(1, "long", 3, ".", "G", "A"), Variant(2, "long", 20, ".", "CT", "C"),
            Variant(3, "long", 38, ".", "A", "AGG")]


def _outputs(model, tok, runner, layer):
    """Every inference output for the records: score rows, evaluate's result, mean embeddings, per-token states."""
    chunks = [w for seq in SEQUENCES.values() for w in record_windows(tok.encode(seq), SEQ_LEN, STRIDE)]
    return {
        "rows": score_records(model, tok, _records(), SEQ_LEN, stride=STRIDE, batch_size=2, runner=runner),
        "evaluate": evaluate(model, tok, RecordWindows(chunks, tok), batch_size=3, runner=runner),
        "mean": embed_records(model, tok, _records(), SEQ_LEN, stride=STRIDE, batch_size=2, layer=layer,
                              runner=runner),
        "tokens": list(token_embeddings(model, tok, _records(), SEQ_LEN, stride=STRIDE, batch_size=2, layer=layer,
                                        runner=runner)),
        "variants": score_variants(model, tok, SEQUENCES, VARIANTS, 20, batch_size=2, runner=runner),
    }


def _infer(rank, world, cases):
    results = []
    for position_embedding, num_kv_heads, ulysses, ring, layer in cases:
        model, tok = _model(position_embedding, num_kv_heads)
        runner = ShardedForward.from_world(model, ulysses, ring)
        results.append(_outputs(model, tok, runner, layer))
    return results


def _one_process(case):
    """The single-process outputs of ``case``."""
    position_embedding, num_kv_heads, _, _, layer = case
    model, tok = _model(position_embedding, num_kv_heads)
    return _outputs(model, tok, None, layer)


def _check(case, got, rank, want):
    where = f"{case} rank {rank}"
    assert [(r["id"], r["tokens"]) for r in got["rows"]] == [(r["id"], r["tokens"]) for r in want["rows"]], where
    np.testing.assert_allclose([r["log_likelihood"] for r in got["rows"]],
                               [r["log_likelihood"] for r in want["rows"]], rtol=1e-5, err_msg=where)
    assert got["evaluate"]["tokens"] == want["evaluate"]["tokens"]
    assert got["evaluate"]["loss"] == pytest.approx(want["evaluate"]["loss"], rel=1e-5), where
    assert [r["window_start"] for r in got["variants"]] == [r["window_start"] for r in want["variants"]], where
    np.testing.assert_allclose([r["llr"] for r in got["variants"]], [r["llr"] for r in want["variants"]],
                               rtol=1e-5, atol=1e-5, err_msg=where)
    assert got["mean"][0] == want["mean"][0] == list(SEQUENCES)
    assert got["mean"][1].dtype == np.float32
    np.testing.assert_allclose(got["mean"][1], want["mean"][1], rtol=1e-5, atol=1e-5, err_msg=where)
    if rank != 0:  # per-token states reach rank 0 only
        assert got["tokens"] == [], where
        return
    assert [name for name, _ in got["tokens"]] == list(SEQUENCES)
    for (name, states), (_, ref) in zip(got["tokens"], want["tokens"]):
        assert states.dtype == np.float32 and states.shape == (len(SEQUENCES[name]), 64), (where, name, states.shape)
        np.testing.assert_allclose(states, ref, rtol=1e-5, atol=1e-5, err_msg=f"{where} record {name}")


def _run(world, cases):
    results = run_workers(_infer, world, cases, timeout=240, env={"DS_ACCELERATOR": "cpu"})
    wants = [_one_process(case) for case in cases]
    for rank, per_case in enumerate(results):
        for case, got, want in zip(cases, per_case, wants):
            _check(case, got, rank, want)


def test_two_ranks_ulysses_and_ring_equal_one_process():
    # (position embedding, kv heads, ulysses, ring, layer): Ulysses 2 with a learned table (contiguous), ring 2 with
    # rotary (zigzag) read at block 1
    _run(2, [("learned", 0, 2, 1, None), ("rotary", 0, 1, 2, 1)])


def test_four_ranks_hybrid_and_data_ranks_equal_one_process():
    # Ulysses 2 x ring 2 with ALiBi and 2 key/value heads; Ulysses 2 x 2 data ranks (records and windows dealt over
    # them, per-token states sent to rank 0) with rotary, read at block 0
    _run(4, [("alibi", 2, 2, 2, None), ("rotary", 0, 2, 1, 0)])


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """An export of the learned-position model, the records as FASTA and what one process writes for them through
    the command line (``cli.main`` in this process, what the console script calls): score's TSV and evaluate's
    JSON line."""
    from ds4sci.cli import main
    from ds4sci.io.export import export_consolidated

    root = tmp_path_factory.mktemp("commands")
    model, tok = _model("learned")
    export = export_consolidated(model.state_dict(), model.config, tok, root / "export")
    fasta = root / "x.fa"
    fasta.write_text("".join(f">{name}\n{seq}\n" for name, seq in SEQUENCES.items()))
    common = [str(export), "--fasta", str(fasta), "--seq-len", str(SEQ_LEN), "--stride", str(STRIDE)]
    assert main(["score", *common, "--out", str(root / "single.tsv")]) == 0
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert main(["evaluate", *common, "--json"]) == 0
    return {"common": common, "score": root / "single.tsv", "evaluate": printed.getvalue()}


def _numbers(command, written):
    """What a command wrote, as exact fields and floats: score's TSV rows, evaluate's JSON line."""
    if command == "score":
        rows = list(csv.DictReader(io.StringIO(written), delimiter="\t"))
        return ([(r["id"], r["length"], r["tokens"]) for r in rows],
                [float(r[key]) for r in rows for key in ("log_likelihood", "bits_per_base")])
    [line] = written.strip().splitlines()
    result = json.loads(line)
    return result["tokens"], [result[key] for key in ("loss", "perplexity", "bits_per_base")]


@pytest.mark.parametrize("launcher, command", [("torchrun", "score"), ("mpiexec", "score"), ("mpiexec", "evaluate")])
def test_a_launched_command_with_ulysses_writes_the_single_process_numbers(launcher, command, single, tmp_path):
    """Two processes under torchrun or ``mpiexec`` (MPICH, the dev extra; rank 0's host agreed over mpi4py, a port
    of its own), ``--ulysses 2``: the same records, windows and token counts as one process, and the same numbers up
    to float32 rounding (each rank sums its half of a window's token losses, then the halves are added: another
    order than one process's, 2e-8 apart when measured; a token or position out of place moves them by far more than
    the tolerance). The launch is logged once, by rank 0 (rank 1's INFO lines are not shown), as is every line."""
    from cli_checks import log_messages  # tests/ is on sys.path (its conftest.py)

    if launcher == "mpiexec" and not (BIN / "mpiexec").exists():
        pytest.skip("no mpiexec beside this interpreter (pip install mpich mpi4py: the dev extra)")
    out = tmp_path / "scores.tsv"
    argv = [sys.executable, "-m", "ds4sci.cli", command, *single["common"], "--ulysses", "2"]
    argv += ["--out", str(out)] if command == "score" else ["--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if launcher == "torchrun":
        argv[1:1] = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    else:
        argv[:0] = [str(BIN / "mpiexec"), "-n", "2"]
        env["MASTER_PORT"] = {"score": "29541", "evaluate": "29542"}[command]  # test_launchers' are 29531-29537
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    messages = log_messages(done.stderr)
    assert "reading windows on 2 processes: 1 data rank(s) of ulysses 2 x ring 1 (contiguous layout)" in messages
    assert len(messages) == len(set(messages)), messages  # nothing said twice
    name = "mpi" if launcher == "mpiexec" else "torchrun"
    launches = [m.split(", master ")[0] for m in messages if m.startswith(f"{name}: rank ")]
    assert launches == [f"{name}: rank 0 of 2, local 0 of 2, 1 node(s)"], messages
    written = out.read_text() if command == "score" else done.stdout
    want = single["score"].read_text() if command == "score" else single["evaluate"]
    (exact, numbers), (want_exact, want_numbers) = _numbers(command, written), _numbers(command, want)
    assert exact == want_exact
    np.testing.assert_allclose(numbers, want_numbers, rtol=1e-5)
    if command == "evaluate":  # the loss closer still: each rank sums its half of the token losses, then they add
        assert numbers[0] == pytest.approx(want_numbers[0], rel=1e-7)
