"""``ds4sci bench finetune``: the files of a --quick run (the probe, LoRA and full fine-tuning rows with their
trainable parameters and optimizer bytes), the records it takes, bad options in one line."""
import pytest

from ds4sci.bench import finetune

from bench_checks import bench_args  # tests/bench/ is on sys.path
from bench_checks import quick_report  # tests/bench/ is on sys.path
from bench_checks import refused_in_one_line  # tests/bench/ is on sys.path


def test_quick_run_writes_the_report(tmp_path):
    report = quick_report(tmp_path, "finetune")
    assert report["records"] == {"train": 16, "validation": 16, "test": 16}
    rows = {r["method"]: r for r in report["rows"]}
    assert list(rows) == list(finetune.METHODS)
    for r in rows.values():
        assert 0 <= r["test_auroc"] <= 1 and r["wall_s"] > 0
    assert rows["probe"]["parameters"] == rows["full"]["parameters"] < rows["lora"]["parameters"]  # + the adapters
    hidden = report["config"]["hidden"]
    assert rows["probe"]["trainable_parameters"] == hidden + 1 and rows["probe"]["optimizer_bytes"] is None
    # LoRA trains the adapters and the head; full fine-tuning every weight but the unused LM output projection
    assert rows["lora"]["trainable_parameters"] < rows["full"]["trainable_parameters"] < rows["full"]["parameters"]
    for method in ("lora", "full"):  # AdamW: two fp32 moments per trainable parameter, and a step count per tensor
        moments = 2 * 4 * rows[method]["trainable_parameters"]
        assert moments < rows[method]["optimizer_bytes"] < moments + 8 * 100, rows[method]
    markdown = (tmp_path / "finetune.md").read_text()
    assert "| lora |" in markdown and f"{rows['full']['test_auroc']:.3f}" in markdown
    assert (tmp_path / "finetune.png").read_bytes()[:4] == b"\x89PNG"


def test_records_taken_per_class_and_split(tmp_path):
    cfg = finetune.config_from_args(bench_args(finetune, "--per-class", "3"))
    assert finetune.task_table(cfg, tmp_path / "t.tsv") == {"train": 6, "validation": 6, "test": 6}
    lines = (tmp_path / "t.tsv").read_text().splitlines()[1:]
    assert [line.split("\t")[2:] for line in lines[:6]] == [["0", "train"]] * 3 + [["1", "train"]] * 3


@pytest.mark.parametrize("argv,words", [(["--folds", "1"], "--folds=1: cross-validation needs at least 2"),
                                        (["--init-from", "/nowhere"], "--init-from /nowhere: no such file"),
                                        (["--lr", "0"], "--lr=0.0: must be > 0")])
def test_bad_options_are_one_line(capsys, tmp_path, argv, words):
    assert words in refused_in_one_line(capsys, tmp_path, "finetune", argv)
