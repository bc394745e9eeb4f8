"""The node check (:mod:`ds4sci.distributed.storage`) without processes: a lone process is its only node and writes
nothing, and a marker a killed run left in a run folder is none of the run's files. The multi-process checks are in
test_storage_nodes.py."""
import socket
from pathlib import Path

from ds4sci.distributed.launch import Launch
from ds4sci.distributed.storage import MARKER_PREFIX
from ds4sci.distributed.storage import NodeView
from ds4sci.distributed.storage import nodes_seeing
from ds4sci.train.config import load_config
from ds4sci.train.run_dir import prepare_run_dir

ROOT = Path(__file__).resolve().parents[2]
CDS = ROOT / "examples" / "data" / "NZ_CP040672.1_cds_100.fna"


def test_a_lone_process_is_node_0_and_sees_its_folder_without_writing_there(tmp_path):
    lone = Launch("none", 0, 1, 0, 1, 1, "127.0.0.1", 0)
    assert nodes_seeing(tmp_path / "out", lone) == [NodeView(0, socket.gethostname(), True)]
    assert not (tmp_path / "out").exists()


def test_a_marker_left_by_a_killed_check_is_not_part_of_a_run_folder(tmp_path):
    """A new run into a folder holding only a stale marker starts (the folder counts as empty), and ``--overwrite``
    of a run leaves it alone."""
    out = tmp_path / "run"
    out.mkdir()
    (out / f"{MARKER_PREFIX}0123").write_text("0123")
    cfg = load_config(None, [f"train.out_dir={out}", f"data.fasta={CDS}"])
    assert prepare_run_dir(cfg) is None
    (out / "config.yaml").write_text(cfg.to_yaml())
    assert prepare_run_dir(cfg, overwrite=True) is None
    assert sorted(p.name for p in out.iterdir()) == [f"{MARKER_PREFIX}0123"]
