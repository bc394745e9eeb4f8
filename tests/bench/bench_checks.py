"""Helpers shared by the benchmarks' tests (tests/bench/ is on sys.path while its tests run)."""
import argparse
import json
from pathlib import Path

import torch

from ds4sci import cli


def bench_args(module, *argv: str) -> argparse.Namespace:
    """``argv`` parsed by the options of the benchmark ``module`` (its ``add_arguments``)."""
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


def refused_in_one_line(capsys, tmp_path, name: str, argv: list[str]) -> str:
    """Run ``ds4sci bench NAME ARGV --out tmp_path/out``; it must exit with 2, write nothing and say why in one line
    of stderr, which is returned without ``ds4sci bench: error: ``."""
    assert cli.main(["bench", name, *argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ds4sci bench: error: ") and "\n" not in err and not (tmp_path / "out").exists(), err
    return err.removeprefix("ds4sci bench: error: ")


def quick_report(out, name: str, *argv: str, more_threads: bool = False) -> dict:
    """Run ``ds4sci bench NAME --quick ARGV --out OUT``, which must succeed, and return the report it wrote
    (``OUT/NAME.json``, dashes as underscores). ``more_threads``: run with one torch thread more than this process
    has, which the report must record and the run must give back."""
    threads = torch.get_num_threads()
    argv = (*argv, "--threads", str(threads + 1)) if more_threads else argv
    assert cli.main(["bench", name, "--quick", *argv, "--out", str(out)]) == 0
    assert torch.get_num_threads() == threads  # restored after the run
    report = json.loads((Path(out) / f"{name.replace('-', '_')}.json").read_text())
    assert not more_threads or report["config"]["threads"] == threads + 1
    return report
