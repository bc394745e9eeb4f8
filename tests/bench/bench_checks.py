"""Helpers shared by the benchmarks' tests (tests/bench/ is on sys.path while its tests run)."""
import argparse

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
