"""Checkpoint integrity without processes: checkpoint.json records each file's sha256 and its own, the portable
state is split by bytes, and a torn final line of metrics.jsonl is dropped (issue #25). The flipped bytes of a real
checkpoint, refused at resume naming the file, are in tests/distributed/test_checkpoint_faults.py."""
import hashlib
import json
import logging

import pytest

from ds4sci.train.checkpoint import _commit
from ds4sci.train.checkpoint_check import Spread
from ds4sci.train.checkpoint_check import check_checkpoint
from ds4sci.train.run_dir import keep_metrics_until

FINGERPRINT = {"model": {"num_layers": 2}, "zero.stage": 1, "zero partitions": 1,
               "layout": {"tp": 1, "pp": 1, "dp": 1, "ulysses": 1, "ring": 1}}


def test_a_torn_final_metrics_line_is_dropped_and_damage_elsewhere_is_refused(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "loss": 2.5}, {"step": 2, "val_loss": 2.4}, {"step": 2, "loss": 2.3}, {"step": 3, "loss": 2.2}]
    lines = [json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n" + lines[-1][:11])  # the crash cut line 5 after 11 characters
    with caplog.at_level(logging.WARNING, logger="ds4sci.train.run_dir"):
        keep_metrics_until(path, 2)
    assert path.read_text() == "\n".join(lines[:3]) + "\n"
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [f"{path}: line 5, the last, is torn"]

    path.write_text("\n".join([lines[0], lines[1][:-3], *lines[2:]]) + "\n")  # line 2 damaged, 2 lines follow
    with pytest.raises(ValueError, match=rf"^{path}: line 2 is not a metrics record \(JSONDecodeError: "):
        keep_metrics_until(path, 3)
    path.write_text("\n".join([lines[0], "[1, 2]", lines[2]]) + "\n")  # JSON, but no record
    with pytest.raises(ValueError, match=rf"^{path}: line 2 is not a metrics record \(TypeError"):
        keep_metrics_until(path, 3)


def test_the_portable_split_by_bytes_gives_each_rank_about_one_share():
    # by hand: each item to the owner with the fewest bytes so far, the lowest on a tie
    spread = Spread(2)
    assert [spread.take(size) for size in (5, 3, 3, 1)] == [0, 1, 1, 0] and spread.loads == [6, 6]
    # a model's parameters, weight and bias alternating (a split by index put every weight on one rank)
    sizes = [64 * 64 * 12, 64 * 12] * 6 + [10 * 64 * 12]
    for n in (2, 3, 4):
        spread = Spread(n)
        owners = [spread.take(size) for size in sizes]
        loads = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(n)]
        assert max(loads) <= sum(sizes) / n + max(sizes), (n, loads)


def test_checkpoint_json_records_each_file_digest_and_its_own(tmp_path):
    root = tmp_path / "checkpoints"
    tmp = root / ".tmp-step2"
    (tmp / "portable").mkdir(parents=True)
    files = {"mp_rank_00_model_states.pt": b"model" * 100, "portable/rank00000.safetensors": b"portable" * 50,
             "offloaded_tensors/rank0/x.tensor.swp": b"nvme"}  # DeepSpeed's copy: written by no rank of ours
    for name, data in files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_bytes(data)
    by_hand = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    written = [{"mp_rank_00_model_states.pt": "f" * 64},  # taken as reported (not read again)
               {"portable/rank00000.safetensors": "1" * 64}, {"portable/rank00000.safetensors": "2" * 64}]  # 2 writers
    _commit(root, tmp, "step2", {"step": 2, **FINGERPRINT, "portable": {}}, written)
    path = root / "step2"
    meta = json.loads((path / "checkpoint.json").read_text())
    assert meta["format"] == 2 and meta["files"] == {name: len(data) for name, data in files.items()}
    assert meta["sha256"] == {**by_hand, "mp_rank_00_model_states.pt": "f" * 64}
    assert check_checkpoint(path, FINGERPRINT)["step"] == 2 and (root / "latest").read_text() == "step2"

    text = (path / "checkpoint.json").read_text()
    for edited in (text.replace('"step": 2', '"step": 3'), text.replace('"record sha256"', '"record sha255"')):
        assert edited != text
        (path / "checkpoint.json").write_text(edited)  # valid JSON, other content
        with pytest.raises(ValueError, match=rf"^{path}/checkpoint.json: content differs from what the save wrote "
                                             rf"\(sha256 mismatch\); the checkpoint is corrupt\. Resume from an "
                                             rf"earlier one: {root} holds no earlier one"):
            check_checkpoint(path, FINGERPRINT)
    (path / "checkpoint.json").write_text(text[:40] + "\x00" * 64 + text[104:])  # 64 bytes zeroed: no JSON
    with pytest.raises(ValueError, match=rf"^{path}/checkpoint.json: not a ds4sci checkpoint record .*the "
                                         rf"checkpoint is corrupt"):
        check_checkpoint(path, FINGERPRINT)
    # format 1 (no format, no digests: saved by an older ds4sci) still loads, by sizes
    old = {k: v for k, v in meta.items() if k not in ("format", "sha256", "record sha256")}
    (path / "checkpoint.json").write_text(json.dumps(old))
    assert check_checkpoint(path, FINGERPRINT)["step"] == 2
