"""Record jobs written in rank shards: a job SIGKILLed at random points and resumed writes the uninterrupted file
byte for byte, never a record twice; Parquet embeddings read back to the arrays; resume refuses another input."""
import os
import random
import signal
import time
from argparse import Namespace
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from ds4sci.cli import main
from ds4sci.cli_args import CommandError
from ds4sci.commands.inference import write_records
from ds4sci.data import NucleotideTokenizer
from ds4sci.data import read_fasta
from ds4sci.infer import shards
from ds4sci.infer.embed import embed_records
from ds4sci.infer.embed import token_embeddings
from ds4sci.infer.shards import ShardWriter
from ds4sci.infer.shards import merge
from ds4sci.infer.shards import parts_folder
from ds4sci.infer.shards import start_job
from ds4sci.io.export import export_consolidated
from ds4sci.io.weights import load_model
from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm import GenSLMConfig

from fork_checks import start_in_fork  # tests/ is on sys.path (its conftest.py)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """An export of a 1-block model with a 32-token context and 60 records of 1..40 bases, and what an
    uninterrupted ``score`` writes for them."""
    root = tmp_path_factory.mktemp("shards")
    torch.manual_seed(0)
    tok = NucleotideTokenizer()
    cfg = GenSLMConfig.preset("debug", vocab_size=tok.vocab_size, max_position_embeddings=32, num_layers=1,
                              position_embedding="learned")
    export = export_consolidated(GenSLM(cfg).state_dict(), cfg, tok, root / "export")
    rng = np.random.default_rng(0)
    fasta = root / "x.fa"
    fasta.write_text("".join(f">r{i}\n{''.join(rng.choice(list('ACGT'), rng.integers(1, 41)))}\n" for i in range(60)))
    common = [str(export), "--fasta", str(fasta), "--seq-len", "16", "--stride", "12", "--max-tokens-per-batch", "48",
              "--pack", "--no-progress"]
    assert main(["score", *common, "--out", str(root / "whole.tsv")]) == 0
    return {"common": common, "whole": (root / "whole.tsv").read_bytes(), "export": export, "fasta": fasta}


def _chunks(out):
    return sorted(p for p in parts_folder(out).glob("part-*") if not p.name.endswith(".tmp"))


def _slowed_main(argv: list[str]) -> int:
    """``ds4sci ARGV`` with each chunk's flush 20 ms longer, so that the whole job (30 chunks) outlasts the kill's
    random moment on an idle machine as on a busy one (in its own forked process: the patch stays there)."""
    flush = ShardWriter.flush
    ShardWriter.flush = lambda self: (time.sleep(0.02), flush(self))[1]
    return main(argv)


def test_killed_and_resumed_writes_the_uninterrupted_file(job, tmp_path, capsys):
    out = tmp_path / "scores.tsv"
    argv = ["score", *job["common"], "--out", str(out), "--flush-every", "2", "--resume"]
    rng, written = random.Random(0), []
    for _ in range(3):  # each time killed after a random number of chunks and a random moment more
        target = rng.randint(1, 3) + (len(_chunks(out)) if parts_folder(out).exists() else 0)
        proc = start_in_fork(argv, os.getcwd(), main=_slowed_main, env={"OMP_NUM_THREADS": "1"})
        while proc.exitcode is None and not (parts_folder(out).exists() and len(_chunks(out)) >= target):
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.1))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        indices = [int(line.split("\t")[0]) for c in _chunks(out) for line in c.read_text().splitlines()]
        assert len(indices) == len(set(indices))  # no record written twice
        assert indices and set(written) <= set(indices)  # what a chunk held stays written
        written = indices
    assert not out.exists() and len(written) < 60  # killed before the end
    other = [{"12": "8"}.get(arg, arg) for arg in job["common"]]  # another stride
    assert main(["score", *other, "--out", str(out), "--resume"]) == 2  # another job's shards are not taken
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "written for another input or other options" in err and str(parts_folder(out)) in err
    assert "(stride 12 there, 8 here)" in err
    assert main(["score", *job["common"], "--out", str(out), "--resume"]) == 0
    assert out.read_bytes() == job["whole"]
    assert main(["score", *job["common"], "--out", str(out), "--resume"]) == 0  # complete: nothing read again
    assert out.read_bytes() == job["whole"]


@pytest.mark.parametrize("per_token", [False, True])
def test_parquet_embeddings_read_back(job, tmp_path, per_token):
    out = tmp_path / "e.parquet"
    flags = ["--per-token"] if per_token else []
    assert main(["embed", *job["common"], "--out", str(out), "--layer", "1", "--flush-every", "20", *flags]) == 0
    model, _, tok = load_model(job["export"])
    records = list(read_fasta(job["fasta"]))
    frame = pd.read_parquet(out, columns=["id", "layer"])  # a column alone
    assert frame["id"].tolist() == [r.id for r in records] and set(frame["layer"]) == {"1"}
    first = next(pq.ParquetFile(out).iter_batches(batch_size=3)).to_pydict()  # three rows alone
    assert first["id"] == ["r0", "r1", "r2"]
    table = pd.read_parquet(out)
    if per_token:
        want = dict(token_embeddings(model, tok, records, 16, stride=12, layer=1))
        for name, states in zip(table["id"], table["embedding"]):
            np.testing.assert_allclose(np.stack(states), want[name], rtol=1e-4, atol=1e-5)
    else:
        _, want = embed_records(model, tok, records, 16, stride=12, layer=1)
        np.testing.assert_allclose(np.stack(table["embedding"]), want, rtol=1e-4, atol=1e-5)


def test_resume_needs_a_file_it_can_resume(job, capsys):
    assert main(["score", *job["common"], "--out", "-", "--resume"]) == 2
    assert "--resume needs an --out file" in capsys.readouterr().err
    assert main(["embed", *job["common"], "--out", "x.npz", "--resume"]) == 2
    assert "--resume needs a .parquet --out (got 'x.npz')" in capsys.readouterr().err


def test_resume_on_another_number_of_processes_is_refused(job, tmp_path):
    """The process layout is part of the job: a job resumed on other data ranks is refused, naming both counts."""
    def runner(dp):
        return SimpleNamespace(is_writer=True, writes_shards=True, data_rank=0, barrier=lambda: None,
                               dims=SimpleNamespace(dp=dp, ulysses=1, ring=1))

    args = Namespace(out=str(tmp_path / "x.tsv"), fasta=job["fasta"], resume=False, flush_every=2, no_progress=True)
    assert write_records(args, runner(2), {"command": "score"}, lambda skip, shown: iter(()), "tsv", "score", 0,
                         "id") == 0
    args.resume = True
    with pytest.raises(CommandError, match=r"\(data_ranks 2 there, 4 here\)"):
        write_records(args, runner(4), {"command": "score"}, lambda skip, shown: iter(()), "tsv", "score", 0, "id")


@pytest.mark.parametrize("kind", ["tsv", "parquet"])
def test_merge_streams_sorted_chunks_in_passes(tmp_path, monkeypatch, kind):
    """Two ranks' chunks (records in completion order) merged two at a time, in passes: the rows in input order."""
    out = tmp_path / f"x.{kind}"
    start_job(out, {}, False, True)
    rng = np.random.default_rng(0)
    order = rng.permutation(23)
    rows = {int(i): (f"r{i}\t{i * 0.5}" if kind == "tsv" else (f"r{i}", "final", rng.normal(size=(int(i) % 3 + 1, 4))))
            for i in order}
    for rank in (0, 1):
        writer = ShardWriter(out, rank, kind, flush_every=3)
        for i in order[rank::2]:
            writer.add(int(i), rows[int(i)])
        writer.close()
    monkeypatch.setattr(shards, "FAN_IN", 2)
    assert merge(out, "id\tvalue") == 23
    assert not list(parts_folder(out).glob("*-*"))  # chunks and the passes' files removed
    if kind == "tsv":
        assert out.read_text() == "id\tvalue\n" + "".join(rows[i] + "\n" for i in range(23))
        return
    table = pq.read_table(out)
    assert table.column_names == ["id", "layer", "embedding"] and table.column("id").to_pylist() == \
        [f"r{i}" for i in range(23)]
    for i, got in enumerate(table.column("embedding").to_pylist()):
        np.testing.assert_array_equal(np.array(got, dtype=np.float32), rows[i][2].astype(np.float32))
