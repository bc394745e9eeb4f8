"""Tensor- and Ulysses-parallel groups that would span nodes, refused before the process group forms: ``check_launch``
with launches built by hand, ``parallel.allow_cross_node`` (a warning instead), and one ``ds4sci train`` process of a
faked two-node torchrun launch that stops with the one line instead of waiting for its absent peer."""
import logging
import os
import socket
import subprocess
import sys

import pytest
import yaml

from ds4sci.cli import main
from ds4sci.distributed.launch import Launch
from ds4sci.train.config import load_config
from ds4sci.train.launch import check_launch

ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def _two_nodes(rank: int = 0) -> Launch:
    """Rank ``rank`` of two nodes of one process each (torchrun --nnodes 2 --nproc-per-node 1)."""
    return Launch("torchrun", rank, 2, 0, 1, 2, "node01", 29500)


def test_a_ulysses_group_across_two_nodes_is_refused_with_the_layout_that_keeps_it_inside():
    cfg = load_config(overrides=["parallel.ulysses=2"])
    with pytest.raises(ValueError) as err:
        check_launch(cfg, _two_nodes())
    assert str(err.value) == ("parallel: ulysses=2 groups would span nodes on 2 node(s) x 1 process(es) per node; "
                              "parallel.ulysses=1 parallel.ring=2 keeps them inside a node on the same 2 processes, or "
                              "set parallel.allow_cross_node=true")
    one_node = Launch("torchrun", 0, 2, 0, 2, 1, "127.0.0.1", 29500)
    assert check_launch(cfg, one_node).ulysses == 2
    ring = check_launch(load_config(overrides=["parallel.ring=2"]), _two_nodes())  # ring and dp may span nodes
    assert (ring.ring, check_launch(load_config(), _two_nodes()).dp) == (2, 2)


def test_a_tensor_group_across_nodes_of_six_is_refused_and_lowered():
    """6 processes per node with tp=4: the group of ranks 4..7 spans nodes 0 and 1; tp=2 (the rest to dp) fits."""
    cfg = load_config(overrides=["parallel.tp=4", "model.preset=debug"])
    with pytest.raises(ValueError, match=r"^parallel: tp=4 groups would span nodes on 2 node\(s\) x 6 process\(es\) "
                                         r"per node; parallel.tp=2 parallel.dp=6 keeps them inside a node on the same "
                                         r"12 processes, or set parallel.allow_cross_node=true$"):
        check_launch(cfg, Launch("slurm", 7, 12, 1, 6, 2, "node01", 29500))


def test_allow_cross_node_warns_once_and_goes_on(caplog):
    cfg = load_config(overrides=["parallel.ulysses=2", "parallel.allow_cross_node=true"])
    with caplog.at_level(logging.WARNING, logger="ds4sci.train.launch"):
        assert check_launch(cfg, _two_nodes(rank=1)).ulysses == 2  # rank 0 speaks for the run
        assert not caplog.messages
        assert check_launch(cfg, _two_nodes(rank=0)).ulysses == 2
    assert caplog.messages == ["parallel: ulysses=2 groups would span nodes on 2 node(s) x 1 process(es) per node; "
                               "parallel.ulysses=1 parallel.ring=2 keeps them inside a node on the same 2 processes; "
                               "going on (parallel.allow_cross_node=true)"]


def test_print_config_shows_allow_cross_node(capsys):
    assert main(["train", "--set", "parallel.allow_cross_node=true", "--print-config"]) == 0
    text = capsys.readouterr().out
    assert yaml.safe_load(text)["parallel"]["allow_cross_node"] is True
    assert "let tensor- and Ulysses-parallel groups span nodes" in text


def test_one_rank_of_a_two_node_launch_stops_with_one_line_before_waiting_for_the_other(tmp_path):
    """RANK=0 of WORLD_SIZE=2 on GROUP_WORLD_SIZE=2 nodes of LOCAL_WORLD_SIZE=1, its peer never started: with
    ``parallel.ulysses=2`` it exits 2 with the one line at once (a rendezvous would wait for rank 1 until the
    subprocess timeout), and the run folder is never made."""
    with socket.socket() as s:  # a port no store listens on: nothing may answer for the absent rank
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**ENV, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "ds4sci.cli", "train", "--set", "parallel.ulysses=2", "--set", f"train.out_dir={out}",
           "--set", "train.timeout_s=30"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [
        "ds4sci train: error: parallel: ulysses=2 groups would span nodes on 2 node(s) x 1 process(es) per node; "
        "parallel.ulysses=1 parallel.ring=2 keeps them inside a node on the same 2 processes, or set "
        "parallel.allow_cross_node=true"], done.stderr
    assert not out.exists()
