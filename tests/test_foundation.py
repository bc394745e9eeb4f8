"""The repository contract: bundled data, import names, console script."""
import gzip
import hashlib
import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data"

SHA256 = {
    "MN908947.3_sars_cov_2.fasta.gz": "13cb7ce9f60e1a64c06b649189612e1a6b96cad9c21d7b7fecd15c1a7f47cee3",
    "NC_007779.1_ecoli_K12_W3110.fasta.gz": "64083cc14e1057adc9ffbaa8480daa7b00e04036e9ad89b71cdc545e7b83115d",
    "NZ_CP040672.1_cds_100.fna": "c9763f8e21d5a31e1517d37d368ff545450abdd79525153f47cce7ba522d7e61",
    "genslm_codon_vocab_69.tsv": "f05c1f58a60062c35d0e6ed04e8dc16c30e7d2baa6e1df11854b900db276cbce",
    "genslm_codon_vocab_71.tsv": "1c6a2e160ef3811a8ef846a1cdea5e0f7fb65ee1de5b66720dcb7b4c4c6aa920",
    "ecoli_example_variants.vcf": "59a28d6142476effb70132bba1910820ea90a71a75b6cde04b3d269fe6a339bf",
    # examples/tasks/make_coding_task.py (pyrodigal 3.7.1) writes these two
    "ecoli_coding_windows.tsv": "006f867f4436d0c1cb9c881550aecc4bdcd7b66a813aa945036809c4dd6706c0",
    "ecoli_coding_bases.tsv": "a0705698931fd72688eec0d5d02a9f2a4080f5c35b49bab8aae41df4b8080e39",
}


@pytest.mark.parametrize("name", sorted(SHA256))
def test_bundled_file_checksum(name):
    assert hashlib.sha256((DATA / name).read_bytes()).hexdigest() == SHA256[name]


def _fasta_lengths(path: Path) -> list[int]:
    opener = gzip.open if path.suffix == ".gz" else open
    lengths: list[int] = []
    with opener(path, "rt") as handle:
        for line in handle:
            if line.startswith(">"):
                lengths.append(0)
            else:
                lengths[-1] += len(line.strip())
    return lengths


@pytest.mark.parametrize(
    "name, lengths",
    [
        ("NC_007779.1_ecoli_K12_W3110.fasta.gz", [4_646_332]),
        ("MN908947.3_sars_cov_2.fasta.gz", [29_903]),
    ],
)
def test_genome_lengths(name, lengths):
    assert _fasta_lengths(DATA / name) == lengths


def test_cds_file_is_in_frame():
    lengths = _fasta_lengths(DATA / "NZ_CP040672.1_cds_100.fna")
    assert len(lengths) == 100 and sum(lengths) == 89_094
    assert all(n % 3 == 0 for n in lengths)


def test_vocab_69_layout():
    rows = [line.split("\t") for line in (DATA / "genslm_codon_vocab_69.tsv").read_text().splitlines()[1:]]
    ids = {tok: int(i) for tok, i in rows}
    first = [t for t, i in sorted(ids.items(), key=lambda kv: kv[1])][:5]
    assert first == ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
    codons = [t for t in ids if not t.startswith("[")]
    assert len(codons) == 64 and sorted(ids.values()) == list(range(69))


@pytest.mark.parametrize("name", ["ds4sci", "ds4sci.kernels", "ds4sci.models", "ds4sci.sequence", "ds4sci.data"])
def test_package_imports(name):
    importlib.import_module(name)


@pytest.mark.parametrize("name", ["kernels", "models"])
def test_no_top_level_kernels_or_models(name):
    # `kernels`/`models` must only exist as ds4sci.kernels / ds4sci.models; run from a neutral directory so
    # the repository root on sys.path does not make them importable by accident.
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({name!r}) is not None)"
    assert subprocess.run([sys.executable, "-c", code], cwd="/").returncode == 0


def test_light_top_level_import():
    code = "import sys, ds4sci, ds4sci.kernels, ds4sci.models; sys.exit(int('deepspeed' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], cwd="/").returncode == 0


def test_cli_help_lists_commands():
    from ds4sci.cli import COMMANDS

    out = subprocess.run([sys.executable, "-m", "ds4sci.cli", "--help"], capture_output=True, text=True, check=True)
    for name in COMMANDS:
        assert name in out.stdout


def test_cli_info_json(capsys):
    """``ds4sci info --json`` (``cli.main``, what the console script calls: in this process, torch being imported
    here already; ``test_cli_help_lists_commands`` runs the module in a fresh one) prints one JSON object."""
    import json

    from ds4sci.cli import main

    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["torch"].startswith("2.")


def _make_dry_run(target: str, tmp_path: Path) -> list[str]:
    """The commands ``make TARGET`` would run on a fresh clone (no ``.venv`` yet), in order (``make -n``)."""
    venv = tmp_path / "fresh-venv"
    out = subprocess.run(["make", "-n", target, f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [line.replace(str(venv), ".venv") for line in out.stdout.splitlines()]


@pytest.mark.parametrize("target, last", [("demo", ".venv/bin/python examples/demo.py"),
                                          ("test", ".venv/bin/python -m pytest")])
def test_make_targets_install_then_run(target, last, tmp_path):
    """README's two commands: each creates .venv, installs torch==2.13.0 (the CPU wheel) BEFORE the package and
    its dev and openfold extras (``--no-compile``: bytecode is written at first import), then runs the demo script /
    the whole suite (pytest with no test selection)."""
    lines = _make_dry_run(target, tmp_path)
    steps = [next(i for i, line in enumerate(lines) if pattern in line) for pattern in
             ("-m venv .venv", "pip install --progress-bar off --no-compile torch==2.13.0",
              'pip install --progress-bar off --no-compile -e ".[dev,openfold]"', last)]
    assert steps == sorted(steps), lines
    run = next(line for line in lines if last in line).split(";")[0].strip()
    assert run.startswith(last), run
    # `make test`: pytest-xdist's workers and scheduling only, no file, -k or -m selection
    assert run.removeprefix(last).split() in ([], ["-n", "2", "--dist", "loadscope", "--no-loadscope-reorder"]), run


def test_ci_runs_make_test(tmp_path):
    """`.ci/run` runs exactly `make test` (with CI=true) from the repository root, and fails when it fails."""
    calls = tmp_path / "calls"
    fake = tmp_path / "bin" / "make"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$PWD|$CI|$*" >> {calls}\nexit 3\n')
    fake.chmod(0o755)
    env = {"PATH": f"{fake.parent}:/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", str(ROOT / ".ci" / "run")], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 3
    assert calls.read_text().splitlines() == [f"{ROOT}|true|test"]


def _suite_conftest(request):
    """tests/conftest.py as pytest loaded it (not `import conftest`: each test folder has one of that name)."""
    return request.config.pluginmanager.get_plugin(str(ROOT / "tests" / "conftest.py"))


XDIST = "PYTEST_XDIST_WORKER_COUNT"


@pytest.mark.parametrize("environ, cores, threads", [
    ({XDIST: "2"}, 2, "1"), ({XDIST: "2"}, 16, "8"), ({XDIST: "3"}, 2, "1"),
    ({XDIST: "2", "OMP_NUM_THREADS": "4"}, 2, "4"), ({}, 2, None)])
def test_xdist_workers_share_the_cores(request, environ, cores, threads):
    """Under pytest-xdist each worker's torch/BLAS threads are its share of the cores (an explicit OMP_NUM_THREADS
    kept); without xdist nothing is set. The suite's own workers (``make test``) run with theirs."""
    _suite_conftest(request).share_cores(environ, cores)
    assert environ.get("OMP_NUM_THREADS") == threads
    if XDIST in os.environ:
        import torch

        assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])


def test_modules_marked_first_are_scheduled_first(request):
    """tests/conftest.py moves every test of a module with a ``first``-marked test ahead of the rest, then those of
    modules with a ``slow`` or ``distributed`` test, keeping the order within each part (what lets ``make test``'s two
    workers overlap the compile gates and the long modules with the suite)."""
    conftest = _suite_conftest(request)

    class Item:
        def __init__(self, nodeid, first=False, *markers):
            self.nodeid, self.markers = nodeid, {*markers, *(["first"] if first else [])}

        def get_closest_marker(self, name):
            return name in self.markers or None

    items = [Item("a.py::x"), Item("b.py::x"), Item("b.py::y", first=True), Item("c.py::x"), Item("d.py::x", True)]
    conftest.pytest_collection_modifyitems(items)
    assert [i.nodeid for i in items] == ["b.py::x", "b.py::y", "d.py::x", "a.py::x", "c.py::x"]

    # then modules with a slow or distributed test (the long ones), so that the suite ends on short modules
    items = [Item("a.py::x"), Item("b.py::x"), Item("b.py::y", False, "slow"), Item("c.py::x", False, "distributed"),
             Item("d.py::x", True, "slow"), Item("e.py::x")]
    conftest.pytest_collection_modifyitems(items)
    assert [i.nodeid for i in items] == ["d.py::x", "b.py::x", "b.py::y", "c.py::x", "a.py::x", "e.py::x"]


def test_make_commands_write_bytecode(tmp_path):
    """pip installs without byte-compiling (``--no-compile``), so the commands make runs must be free to write each
    module's .pyc at its first import: PYTHONDONTWRITEBYTECODE, set on the development machines, is not passed on
    (with it every process would compile torch from source, many times the suite's CPU)."""
    probe = tmp_path / "probe.mk"
    probe.write_text("probe:\n\t@echo \"[$${PYTHONDONTWRITEBYTECODE-unset}]\"\n")
    out = subprocess.run(["make", "-s", "-f", str(ROOT / "Makefile"), "-f", str(probe), "probe"], cwd=ROOT,
                         env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[unset]", out.stdout
