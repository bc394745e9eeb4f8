"""Records dealt over data ranks by token count, each rank writing its own shards: the merged ``score`` TSV and
``embed`` Parquet of 2 and 4 processes equal one process's (ids, order and token counts exactly, numbers up to float32
rounding: ranks batch other records together)."""
import numpy as np
import pandas as pd
import pytest
import torch

from ds4sci.cli import main
from ds4sci.data import NucleotideTokenizer
from ds4sci.io.export import export_consolidated
from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm import GenSLMConfig
from ds4sci.spawn import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _commands(root, out):
    common = [str(root / "export"), "--fasta", str(root / "x.fa"), "--seq-len", "16", "--stride", "12",
              "--max-tokens-per-batch", "48", "--pack", "--no-progress", "--flush-every", "3"]
    return [["score", *common, "--out", str(out / "s.tsv")], ["embed", *common, "--out", str(out / "e.parquet")]]


def _launched(rank, world, root):
    for argv in _commands(root, root / f"world{world}"):
        assert main(argv) == 0, (rank, argv)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inference_shards")
    torch.manual_seed(0)
    tok = NucleotideTokenizer()
    cfg = GenSLMConfig.preset("debug", vocab_size=tok.vocab_size, max_position_embeddings=32, num_layers=1,
                              init_std=0.2, position_embedding="learned")
    export_consolidated(GenSLM(cfg).state_dict(), cfg, tok, root / "export")
    rng = np.random.default_rng(0)
    (root / "x.fa").write_text("".join(f">r{i}\n{''.join(rng.choice(list('ACGT'), rng.integers(1, 41)))}\n"
                                       for i in range(30)))
    for world in (1, 2, 4):
        (root / f"world{world}").mkdir()
    for argv in _commands(root, root / "world1"):
        assert main(argv) == 0
    for world in (2, 4):
        run_workers(_launched, world, root, timeout=300, env={"DS_ACCELERATOR": "cpu"})
    return root


@pytest.mark.parametrize("world", [2, 4])
def test_rank_shards_merge_into_the_single_process_files(runs, world):
    def rows(path):
        return [line.split("\t") for line in path.read_text().splitlines()]

    want, got = rows(runs / "world1" / "s.tsv"), rows(runs / f"world{world}" / "s.tsv")
    assert [r[:3] for r in got] == [r[:3] for r in want] and len(want) == 31  # header, ids, lengths, tokens
    np.testing.assert_allclose(np.array([r[3:] for r in got[1:]], dtype=float),
                               np.array([r[3:] for r in want[1:]], dtype=float), rtol=1e-5, atol=2e-6)
    want, got = pd.read_parquet(runs / "world1" / "e.parquet"), pd.read_parquet(runs / f"world{world}" / "e.parquet")
    assert got["id"].tolist() == want["id"].tolist() == [f"r{i}" for i in range(30)]
    np.testing.assert_allclose(np.stack(got["embedding"]), np.stack(want["embedding"]), rtol=1e-4, atol=1e-5)
    assert not list((runs / f"world{world}" / "s.tsv.parts").glob("part-*"))  # chunks removed once merged
