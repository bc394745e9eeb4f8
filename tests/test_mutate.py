"""``make mutate``'s file selection (tests/mutate.py): which files are mutated and which tests run against them.
Nothing here runs mutmut."""
import subprocess
from pathlib import Path

import pytest

from mutate import ROOT
from mutate import changed_files
from mutate import main
from mutate import module_name
from mutate import related_tests
from mutate import stage
from mutate import staged_path


@pytest.mark.parametrize("path, module, staged", [
    ("kernels/rotary.py", "ds4sci.kernels.rotary", "ds4sci/kernels/rotary.py"),
    ("kernels/__init__.py", "ds4sci.kernels", "ds4sci/kernels/__init__.py"),
    ("models/genslm/config.py", "ds4sci.models.genslm.config", "ds4sci/models/genslm/config.py"),
    ("ds4sci/data/tokenizers.py", "ds4sci.data.tokenizers", "ds4sci/data/tokenizers.py"),
    ("ds4sci/cli_args.py", "ds4sci.cli_args", "ds4sci/cli_args.py"),
])
def test_source_files_map_to_their_installed_module(path, module, staged):
    assert module_name(path) == module
    assert staged_path(path) == staged


@pytest.mark.parametrize("path", ["tests/test_cli_args.py", "examples/demo.py", "README.md", "setup.py",
                                  "ds4sci/bench/aot/kernels.json"])
def test_tests_examples_and_other_files_are_not_mutated(path):
    assert module_name(path) is None


def _tree(root, files):
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_a_file_s_tests_are_its_mirror_and_every_test_importing_it(tmp_path):
    """By module, by ``from package import module``, by a name the package re-exports; not by a name the module does
    not define, nor by a module whose name only starts the same."""
    _tree(tmp_path, {
        "ds4sci/data/tokenizers.py": "class CodonTokenizer:\n    pass\n\ndef _private():\n    pass\nVOCAB = 69\n",
        "ds4sci/data/tokenizers_extra.py": "",
        "kernels/rotary.py": "def apply_rotary():\n    pass\n",
        "tests/data/test_tokenizers.py": "",
        "tests/test_whole_module.py": "import ds4sci.data.tokenizers\n",
        "tests/infer/test_from_module.py": "from ds4sci.data.tokenizers import CodonTokenizer\n",
        "tests/io/test_from_package.py": "from ds4sci.data import tokenizers\n",
        "tests/io/test_reexport.py": "def test():\n    from ds4sci.data import VOCAB\n",
        "tests/io/test_other_name.py": "from ds4sci.data import read_fasta, _private\n",
        "tests/io/test_prefix.py": "import ds4sci.data.tokenizers_extra\nfrom ds4sci.data import tokenizers_extra\n",
        "tests/kernels/test_rope.py": "from ds4sci.kernels.rotary import apply_rotary\n",
        "tests/models/test_block.py": "from ds4sci.kernels import apply_rotary\n",
        "tests/helpers.py": "from ds4sci.data.tokenizers import CodonTokenizer\n",  # not a test file
    })
    assert related_tests("ds4sci/data/tokenizers.py", tmp_path) == [
        "tests/data/test_tokenizers.py", "tests/infer/test_from_module.py", "tests/io/test_from_package.py",
        "tests/io/test_reexport.py", "tests/test_whole_module.py"]
    assert related_tests("kernels/rotary.py", tmp_path) == ["tests/kernels/test_rope.py", "tests/models/test_block.py"]
    assert related_tests("ds4sci/data/tokenizers_extra.py", tmp_path) == ["tests/io/test_prefix.py"]


def test_changed_files_are_package_sources_changed_against_the_base_deleted_ones_left_out(tmp_path):
    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    _tree(tmp_path, {"ds4sci/a.py": "", "ds4sci/gone.py": "", "kernels/k.py": "", "models/m.py": "",
                     "tests/test_a.py": ""})
    git("init", "-q")
    git("commit", "-qam", "base", "--allow-empty")
    git("add", ".")
    git("commit", "-qm", "files")
    base = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    _tree(tmp_path, {"kernels/k.py": "x = 1\n", "tests/test_a.py": "x = 1\n", "README.md": "changed\n"})
    (tmp_path / "ds4sci/gone.py").unlink()
    git("commit", "-qam", "change")
    _tree(tmp_path, {"models/m.py": "y = 2\n"})  # uncommitted edits count too
    assert changed_files(base, tmp_path) == ["kernels/k.py", "models/m.py"]


def test_the_staged_package_is_laid_out_as_installed_and_names_files_and_tests(tmp_path):
    root, out = tmp_path / "repo", tmp_path / "repo/.mutate"
    _tree(root, {"ds4sci/__init__.py": "", "ds4sci/data/tokenizers.py": "", "kernels/rotary.py": "",
                 "models/genslm/config.py": "", "tests/test_x.py": "", "pyproject.toml": "", "README.md": "",
                 "setup.py": "", "Makefile": "", "examples/demo.py": ""})
    stage(["kernels/rotary.py"], ["tests/test_x.py"], ["-m", "not slow"], out, root)
    assert (out / "ds4sci/kernels/rotary.py").exists() and (out / "ds4sci/models/genslm/config.py").exists()
    assert (out / "tests/test_x.py").exists() and (out / "examples/demo.py").exists()
    config = (out / "setup.cfg").read_text()
    assert "source_paths = ds4sci\nonly_mutate =\n    ds4sci/kernels/rotary.py\n" in config
    assert "pytest_add_cli_args_test_selection =\n    tests/test_x.py\n" in config
    assert "pytest_add_cli_args =\n    -m\n    not slow\n" in config


def test_dry_run_lists_files_and_tests_and_refuses_an_empty_selection(capsys):
    assert main(["--dry-run", "ds4sci/cli_args.py"]) == 0
    assert "tests/test_cli_args.py" in capsys.readouterr().out.split(":", 1)[1].split()
    assert main(["--dry-run", "README.md"]) == 1
    assert "no package source file" in capsys.readouterr().err


def _make_dry_run(tmp_path: Path, *args: str) -> list[str]:
    """The commands ``make ARGS`` would run on a fresh clone (``make -n``, a .venv that does not exist yet)."""
    venv = tmp_path / "fresh-venv"
    # --no-print-directory: under `make test` (MAKELEVEL set) a nested make would print "Leaving directory" lines
    out = subprocess.run(["make", "--no-print-directory", "-n", *args, f"VENV={venv}"], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    return [line.replace(str(venv), ".venv") for line in out.stdout.splitlines()]


def test_make_test_runs_ruff_before_pytest_and_make_mutate_passes_base_and_files(tmp_path):
    lines = _make_dry_run(tmp_path, "test")
    lint = lines.index(".venv/bin/python -m ruff check .")
    assert lint < next(i for i, line in enumerate(lines) if ".venv/bin/python -m pytest" in line), lines
    assert _make_dry_run(tmp_path, "lint")[-1] == ".venv/bin/python -m ruff check ."
    mutate = _make_dry_run(tmp_path, "mutate", "BASE=HEAD~2", "FILES=kernels/rotary.py", "MUTATE_TIMEOUT=60")[-1]
    assert mutate.split() == ".venv/bin/python tests/mutate.py --base HEAD~2 --timeout 60 kernels/rotary.py".split()
