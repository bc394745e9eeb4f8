"""``make mutate``: mutation testing (mutmut) of the source files a change touches, run against their tests.

The files are those changed against a base (``git diff --name-only BASE``: commits and uncommitted edits) or named
ones. A file's tests are its mirror (``tests/<package>/test_<module>.py``) and every test file that imports the
module, or a name the module defines through its package. mutmut copies the code it mutates to ``mutants/`` and
names mutants by file path, while ``kernels/`` and ``models/`` install as ``ds4sci.kernels`` and ``ds4sci.models``:
so it runs in a staging folder (``.mutate/``) laid out as the installed package (``ds4sci/kernels/``, ...), and
the tests import the mutated copy, not the editable install.
"""
from __future__ import annotations

import argparse
import ast
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Source folder -> its package: kernels/ and models/ are installed inside ds4sci (setup.py's package_dir)
PACKAGE_DIRS = {"ds4sci": ("ds4sci",), "kernels": ("ds4sci", "kernels"), "models": ("ds4sci", "models")}
# Copied beside the staged package so that tests which read them (examples/data, README.md, docs/) find them
ALSO_COPY = ["examples", "README.md", "docs", "mkdocs.yml", "setup.py", "Makefile"]


def module_name(path: str) -> str | None:
    """The dotted module of a source file (``kernels/rotary.py`` -> ``ds4sci.kernels.rotary``); None for a file
    that is not package source (tests, examples, non-Python files)."""
    parts = Path(path).parts
    if not path.endswith(".py") or len(parts) < 2 or parts[0] not in PACKAGE_DIRS:
        return None
    names = PACKAGE_DIRS[parts[0]] + parts[1:-1] + (Path(path).stem,)
    return ".".join(names[:-1] if names[-1] == "__init__" else names)


def staged_path(path: str) -> str:
    """Where a source file lies in the staged package: ``kernels/rotary.py`` -> ``ds4sci/kernels/rotary.py``."""
    return "/".join(module_name(path).split(".")) + ("/__init__.py" if path.endswith("__init__.py") else ".py")


def changed_files(base: str, root: Path = ROOT) -> list[str]:
    """Package source files changed between ``base`` and the working tree, deleted ones left out."""
    out = subprocess.run(["git", "diff", "--name-only", base, "--"], cwd=root, capture_output=True, text=True,
                         check=True).stdout
    return [f for f in out.split() if module_name(f) and (root / f).exists()]


def _defined_names(source: Path) -> set[str]:
    """Public names a module binds at top level (what its package may re-export)."""
    names = set()
    for node in ast.parse(source.read_text(), str(source)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return {name for name in names if not name.startswith("_")}


def _imports_module(test: Path, module: str, defined: set[str]) -> bool:
    """``test`` imports ``module``, a name of it, or one of ``defined`` from a package above it."""
    package, _, leaf = module.rpartition(".")
    for node in ast.walk(ast.parse(test.read_text(), str(test))):
        if isinstance(node, ast.Import) and any(a.name == module or a.name.startswith(module + ".")
                                                 for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = {alias.name for alias in node.names}
            if node.module == module or node.module.startswith(module + "."):
                return True
            if node.module == package and leaf in names:
                return True
            if (module + ".").startswith(node.module + ".") and names & defined:
                return True
    return False


def related_tests(path: str, root: Path = ROOT) -> list[str]:
    """Test files of one source file: its mirror ``tests/<package>/test_<module>.py`` (``ds4sci/x.py``:
    ``tests/test_x.py``) and every test file importing the module or a name it defines."""
    module = module_name(path)
    parts = module.split(".")[1:]  # below ds4sci
    folder = parts[0] if len(parts) > 1 else ""
    mirror = root / "tests" / folder / f"test_{parts[-1]}.py"
    defined = _defined_names(root / path)
    found = {mirror} if mirror.exists() else set()
    found |= {test for test in (root / "tests").rglob("test_*.py") if _imports_module(test, module, defined)}
    return sorted(str(test.relative_to(root)) for test in found)


def stage(files: list[str], tests: list[str], pytest_args: list[str], stage_dir: Path, root: Path = ROOT) -> None:
    """A fresh folder mutmut runs in: the package laid out as installed, tests, and a setup.cfg naming the files to
    mutate and the tests to run."""
    shutil.rmtree(stage_dir, ignore_errors=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(root / "ds4sci", stage_dir / "ds4sci", ignore=ignore)
    for folder, package in PACKAGE_DIRS.items():
        if folder != "ds4sci":
            shutil.copytree(root / folder, stage_dir.joinpath(*package), ignore=ignore)
    shutil.copytree(root / "tests", stage_dir / "tests", ignore=ignore)
    shutil.copy2(root / "pyproject.toml", stage_dir / "pyproject.toml")
    for name in ALSO_COPY:
        (stage_dir / name).symlink_to(root / name)
    lines = ["[mutmut]", "source_paths = ds4sci", "only_mutate =", *(f"    {staged_path(f)}" for f in files),
             "also_copy =", *(f"    {name}" for name in ALSO_COPY),
             "pytest_add_cli_args_test_selection =", *(f"    {t}" for t in tests),
             "pytest_add_cli_args =", *(f"    {arg}" for arg in pytest_args),
             # A fork server imports torch and collects the tests once; each mutant forks from it, warm
             "process_isolation = forkserver",
             # A mutant's wall-clock limit is (its tests' time + constant) x multiplier: a forked test run still
             # takes seconds on a busy 2-core machine, so the default (+1 s, x15) times out mutants that pass
             "timeout_constant = 30", "timeout_multiplier = 3"]
    (stage_dir / "setup.cfg").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", help="source files to mutate (default: those changed against --base)")
    parser.add_argument("--base", default="main", help="git revision the change is measured against")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds mutmut may run; then the results so far")
    parser.add_argument("--max-children", type=int, default=1, help="mutants tested at once")
    parser.add_argument("--pytest-args", default="-m 'not distributed and not gpu' -p no:cacheprovider",
                        help="extra pytest arguments (shell-quoted)")
    parser.add_argument("--dry-run", action="store_true", help="print the files and their tests, run nothing")
    args = parser.parse_args(argv)
    files = [f for f in args.files if module_name(f)] if args.files else changed_files(args.base)
    if not files:
        print("make mutate: no package source file to mutate", file=sys.stderr)
        return 1
    by_file = {f: related_tests(f) for f in files}
    for f, tests in by_file.items():
        print(f"{f}: {' '.join(tests) or 'NO TESTS'}")
    tests = sorted({t for tests in by_file.values() for t in tests})
    if args.dry_run:
        return 0
    if not tests:
        print("make mutate: no test imports these files", file=sys.stderr)
        return 1
    stage_dir = ROOT / ".mutate"
    stage(files, tests, shlex.split(args.pytest_args), stage_dir)
    mutmut = [sys.executable, "-m", "mutmut"]
    # its own session, so that a timeout stops mutmut's fork server and the test processes with it
    run = subprocess.Popen([*mutmut, "run", "--max-children", str(args.max_children)], cwd=stage_dir,
                           start_new_session=True)
    try:
        run.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
        print(f"make mutate: stopped after {args.timeout:.0f} s; the results so far:")
    # the mutants not killed (survived, timed out, not checked yet), by name
    done = subprocess.run([*mutmut, "results"], cwd=stage_dir)
    print(f"a mutant's diff: (cd {stage_dir.relative_to(ROOT)} && {sys.executable} -m mutmut show NAME)")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
