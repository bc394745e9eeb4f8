"""README's promise for every ``ds4sci bench NAME``: it takes ``--quick`` (the CI smoke test) and draws a PNG beside
its JSON and Markdown (``plot(report, path)``). Each benchmark's own test runs its ``--quick`` and checks the three
files (tests/bench/test_bench_*.py, tests/kernels/test_kernels_aot_quick.py; evoformer-speed's needs CUDA:
tests/kernels/test_gpu.py)."""
import importlib

import pytest

from ds4sci import cli
from ds4sci.bench import BENCHMARKS


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_takes_quick_and_plots(name):
    args = cli.build_parser(["bench"]).parse_args(["bench", name, "--quick", "--out", "unused"])
    assert args.quick is True
    assert callable(importlib.import_module(BENCHMARKS[name][0]).plot)
