"""Storage across nodes (:mod:`ds4sci.distributed.storage`), nodes simulated on one host: each "node" works in its own
folder, so a relative path names another folder on each node, as a node-local path does on a cluster.

- 4 gloo ranks as 2 nodes x 2 (``run_workers``): a shared token cache is built once (rank 0), a node-local one once
  per node (by its first process; the other reads it), one rank 0 cannot write into is taken as shared (read-only,
  built beforehand), and a run folder that node 1 does not see is refused naming
  node 1; no marker is left behind.
- ``ds4sci train`` as 2 processes with torchrun's variables set by hand (one per node, each in its own working
  directory; forked by :func:`fork_checks.launch`, no launcher): with a shared ``train.out_dir`` and a relative
  ``data.cache_dir`` it trains, building the cache twice; with a relative ``train.out_dir`` it stops at start-up
  with one line naming node 1 and its host.
"""
import functools
import os
import socket
from pathlib import Path

import pytest

from ds4sci.distributed.storage import MARKER_PREFIX
from ds4sci.spawn import open_store
from ds4sci.spawn import run_workers

from fork_checks import launch
from fork_checks import ranks_env
from fork_checks import run_script

ROOT = Path(__file__).resolve().parents[2]
CDS = str(ROOT / "examples" / "data" / "NZ_CP040672.1_cds_100.fna")
ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def _markers(root: Path) -> list[str]:
    return [str(p) for p in root.rglob(f"{MARKER_PREFIX}*")]


def _refusal(folder) -> str:
    """The refusal of a ``train.out_dir`` (rank 0's ``folder``) that node 1 does not see."""
    return (f"train.out_dir {folder} is not the folder rank 0 sees on node 1 (host {socket.gethostname()}): every "
            f"node must see the same train.out_dir (a shared file system, by a path that names the same folder on "
            f"every node; not a node-local path such as $TMPDIR, nor a relative path from different working "
            f"directories)")


def _two_nodes_of_two(rank, world, root):
    """Rank ``rank`` of 2 nodes x 2 processes, working in ``root/node<n>``: the builds it made (cache folders), the
    caches it mapped (shared, then node-local ``cache``), the nodes that see ``cache``, and the refusal of ``run``."""
    from ds4sci.data import Tokenizer
    from ds4sci.data import corpus
    from ds4sci.distributed import storage
    from ds4sci.distributed.launch import Launch
    from ds4sci.distributed.storage import check_same_folder
    from ds4sci.distributed.storage import nodes_seeing

    launch = Launch("torchrun", rank, world, rank % 2, 2, 2, "127.0.0.1", 0)
    os.chdir(Path(root) / f"node{rank // 2}")
    builds, build = [], corpus.build_cache

    def counted(files, sources, tokenizer, iupac, cache_dir, key, **kwargs):
        builds.append(str(Path(cache_dir).resolve()))
        return build(files, sources, tokenizer, iupac, cache_dir, key, **kwargs)

    corpus.build_cache = counted
    tok = Tokenizer.from_name("codon")
    shared = corpus.open_corpus(CDS, tok, cache_dir=Path(root) / "shared", launch=launch)
    local = corpus.open_corpus(CDS, tok, cache_dir="cache", launch=launch)
    views = [(v.node, v.sees) for v in nodes_seeing("cache", launch)]
    if rank == 0:  # rank 0 cannot write its marker into the shared cache (as in a read-only one built beforehand)
        storage.secrets.token_hex = lambda nbytes: "blocked"
        (Path(root) / "shared" / f"{MARKER_PREFIX}blocked").mkdir()
    read_only = corpus.open_corpus(CDS, tok, cache_dir=Path(root) / "shared", launch=launch)  # mapped, not rebuilt
    if rank == 0:
        (Path(root) / "shared" / f"{MARKER_PREFIX}blocked").rmdir()
    check_same_folder(Path(root) / "out", "train.out_dir", launch)  # one folder on every node: no error
    try:
        check_same_folder("run", "train.out_dir", launch)
        refusal = None
    except ValueError as err:
        refusal = str(err)
    assert read_only.root == shared.root
    return builds, str(shared.root.parent), str(local.root.parent.resolve()), local.meta["n_tokens"], views, refusal


@pytest.mark.distributed
@pytest.mark.slow
def test_a_node_local_cache_is_built_once_per_node_and_a_shared_one_once(tmp_path):
    for node in (0, 1):
        (tmp_path / f"node{node}").mkdir()
    results = run_workers(_two_nodes_of_two, 4, str(tmp_path), env=ENV, timeout=240)
    builds = sorted(b for r in results for b in r[0])
    node_cache = [str(tmp_path / f"node{n}" / "cache") for n in (0, 1)]
    assert builds == sorted([str(tmp_path / "shared"), *node_cache]), builds  # shared once, node-local once per node
    assert results[0][0] == [str(tmp_path / "shared"), node_cache[0]]  # rank 0 builds for node 0 and the shared
    assert results[2][0] == [node_cache[1]] and results[1][0] == results[3][0] == []
    for rank, (_, shared, local, tokens, views, refusal) in enumerate(results):
        assert shared == str(tmp_path / "shared") and local == node_cache[rank // 2], (rank, shared, local)
        assert tokens == results[0][3] and views == [(0, True), (1, False)]
        assert refusal == _refusal("run"), refusal
    assert _markers(tmp_path) == []


#: ``python -c COUNTED ds4sci-argv...`` (as :func:`fork_checks.launch` runs it): ``ds4sci`` with each token cache
#: build appended to $BUILD_LOG.
COUNTED = """
import os, sys
from pathlib import Path
from ds4sci.data import corpus
from ds4sci.cli import main
build = corpus.build_cache
def counted(files, sources, tokenizer, iupac, cache_dir, key, **kwargs):
    with open(os.environ["BUILD_LOG"], "a") as log:
        log.write(f"{os.environ['RANK']} {Path(cache_dir).resolve()}\\n")
    return build(files, sources, tokenizer, iupac, cache_dir, key, **kwargs)
corpus.build_cache = counted
sys.exit(main(sys.argv[1:]))
"""


def _two_nodes(tmp_path: Path, name: str, out: str, cache: str) -> tuple[list[tuple[int, str]], list[str]]:
    """``ds4sci train`` as 2 nodes of one process (forked ranks, :func:`fork_checks.launch`), node n working in
    ``tmp_path/name/node<n>``: each rank's (exit code, stderr) once both have exited, and the build log."""
    sets = [f"data.fasta={CDS}", "data.tokenizer=codon", "data.dataset=records", "data.seq_len=32",
            "data.val_fraction=0.2", "train.steps=2", "train.micro_batch_size=2", "train.log_every=1",
            "train.eval_every=0", "train.eval_batches=1", "train.save_every=0", "train.progress=false",
            "train.timeout_s=120", f"train.out_dir={out}", f"data.cache_dir={cache}"]
    store = open_store()
    cwds = [tmp_path / name / f"node{rank}" for rank in (0, 1)]
    for cwd in cwds:
        cwd.mkdir(parents=True)
    log = tmp_path / f"{name}.builds"
    envs = [{**ENV, **env, "BUILD_LOG": str(log)} for env in ranks_env(2, store.port, nodes=2)]
    argv = ["train", *[a for s in sets for a in ("--set", s)]]
    ranks = launch(argv, envs, main=functools.partial(run_script, COUNTED), cwd=cwds, timeout=300)
    return [(p.returncode, p.stderr) for p in ranks], log.read_text().splitlines() if log.exists() else []


@pytest.fixture(scope="module")
def two_node_runs(tmp_path_factory):
    """Two 2-node jobs: ``shared`` (one absolute ``train.out_dir``, a relative ``data.cache_dir``) and ``split`` (a
    relative ``train.out_dir``). Their (exit code, stderr) per rank, and the build log of each."""
    tmp = tmp_path_factory.mktemp("nodes")
    return tmp, {"shared": _two_nodes(tmp, "shared", str(tmp / "shared" / "run"), "cache"),
                 "split": _two_nodes(tmp, "split", "run", "cache")}


@pytest.mark.distributed
@pytest.mark.slow
def test_two_nodes_with_a_shared_run_folder_train_and_build_a_node_local_cache_once_each(two_node_runs):
    tmp, done = two_node_runs
    ranks, builds = done["shared"]
    for code, err in ranks:
        assert code == 0 and "Traceback" not in err, err[-3000:]
    assert sorted(builds) == [f"{r} {tmp / 'shared' / f'node{r}' / 'cache'}" for r in (0, 1)], builds
    run = tmp / "shared" / "run"
    assert (run / "export").is_dir() and len((run / "metrics.jsonl").read_text().splitlines()) == 3
    assert _markers(tmp / "shared") == []


@pytest.mark.distributed
@pytest.mark.slow
def test_a_node_that_sees_another_run_folder_is_refused_naming_it(two_node_runs):
    tmp, done = two_node_runs
    ranks, builds = done["split"]
    assert [code for code, _ in ranks] == [2, 2] and builds == [], ranks
    lines = [line for _, err in ranks for line in err.splitlines() if "error:" in line]
    assert lines == [f"ds4sci train: error: {_refusal(tmp / 'split' / 'node0' / 'run')}",  # each its own folder
                     f"ds4sci train (rank 1): error: {_refusal(tmp / 'split' / 'node1' / 'run')}"], lines
    assert not (tmp / "split" / "node0" / "run").exists()  # the refused launch leaves nothing (its lock released)
    assert not (tmp / "split" / "node1" / "run").exists()
