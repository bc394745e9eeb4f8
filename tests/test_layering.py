"""The dependency direction ``ds4sci.kernels`` <- ``ds4sci.models`` <- the system layer <- the command line, read from
the source (ast, nothing imported): kernels/ imports nothing of ds4sci outside itself; models/ imports only kernels/,
defines no ``torch.autograd.Function`` and imports no Triton (kernels are kernels/'s); no module imports the entry
point ``ds4sci.cli``; only the benchmarks and the command line import ``ds4sci.bench``; and the torch-free modules
import without torch, in a fresh interpreter."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNELS, MODELS, SYSTEM = ROOT / "kernels", ROOT / "models", ROOT / "ds4sci"


def _sources(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.py"))


def _package(path: Path) -> tuple[str, ...]:
    """The package a source file belongs to: kernels/x.py -> ("ds4sci", "kernels"), models/genslm/x.py -> ...genslm,
    ds4sci/train/x.py -> ("ds4sci", "train")."""
    parts = path.relative_to(ROOT).parent.parts
    return parts if parts[0] == "ds4sci" else ("ds4sci",) + parts


def _imports(path: Path, package: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, relative imports resolved against ``package``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ((node.module,) if node.module else ()))
            found.append((node.lineno, module))
    return found


def _within(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _importing(path: Path, package: tuple[str, ...], allowed) -> list[str]:
    """Imports of ds4sci modules in ``path`` for which ``allowed(module)`` is false."""
    return [f"{path.name}:{line} imports {module}" for line, module in _imports(path, package)
            if _within(module, "ds4sci") and not allowed(module)]


def _outside_kernels(path: Path, package: tuple[str, ...]) -> list[str]:
    return _importing(path, package, lambda m: _within(m, "ds4sci.kernels"))


@pytest.mark.parametrize("path", _sources(KERNELS), ids=lambda p: p.name)
def test_kernels_import_nothing_of_ds4sci_outside_kernels(path):
    bad = _outside_kernels(path, _package(path))
    assert not bad, bad


@pytest.mark.parametrize("path", _sources(MODELS), ids=lambda p: str(p.relative_to(MODELS)))
def test_models_hold_no_kernels(path):
    """No ``torch.autograd.Function`` subclass and no Triton import in models/: those belong in kernels/."""
    bad = [f"{path.name}:{line} imports {module}" for line, module in _imports(path, _package(path))
           if module == "triton" or module.startswith("triton.")]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ClassDef):
            bases = [ast.unparse(base) for base in node.bases]
            if any(base.endswith("Function") for base in bases):  # torch.autograd.Function, autograd.Function, ...
                bad.append(f"{path.name}:{node.lineno} class {node.name}({', '.join(bases)})")
    assert not bad, bad


@pytest.mark.parametrize("path", _sources(MODELS), ids=lambda p: str(p.relative_to(MODELS)))
def test_models_import_only_models_and_kernels(path):
    bad = _importing(path, _package(path), lambda m: _within(m, "ds4sci.models", "ds4sci.kernels"))
    assert not bad, bad


def _command_line(path: Path) -> bool:
    """The entry point, the command modules and the benchmarks (each benchmark is a command)."""
    parts = path.relative_to(SYSTEM).parts
    return parts[0] in ("cli.py", "commands", "bench")


@pytest.mark.parametrize("path", _sources(SYSTEM), ids=lambda p: str(p.relative_to(SYSTEM)))
def test_nothing_imports_the_entry_point_and_only_the_command_line_imports_bench(path):
    allowed_bench = _command_line(path)
    bad = _importing(path, _package(path),
                     lambda m: not _within(m, "ds4sci.cli") and (allowed_bench or not _within(m, "ds4sci.bench")))
    assert not bad, bad


def test_layering_check_sees_bad_imports(tmp_path):
    """The check resolves absolute and relative imports: a kernels module importing models or train is caught."""
    probe = tmp_path / "probe.py"
    probe.write_text("from ds4sci.models.genslm import GenSLM\nfrom ..models import genslm\nimport ds4sci.train\n"
                     "from . import backends\nfrom .local_reference import PAD_DOC_ID\nimport torch\n")
    kernels = ("ds4sci", "kernels")
    assert [m for _, m in _imports(probe, kernels)] == [
        "ds4sci.models.genslm", "ds4sci.models", "ds4sci.train", "ds4sci.kernels", "ds4sci.kernels.local_reference",
        "torch"]
    assert _outside_kernels(probe, kernels) == [
        "probe.py:1 imports ds4sci.models.genslm", "probe.py:2 imports ds4sci.models", "probe.py:3 imports ds4sci.train"]
    entry = tmp_path / "entry.py"
    entry.write_text("from ds4sci.cli import main\nfrom ..bench import report\nfrom ds4sci.cli_args import positive_int\n")
    assert _importing(entry, ("ds4sci", "infer"), lambda m: not _within(m, "ds4sci.cli", "ds4sci.bench")) == [
        "entry.py:1 imports ds4sci.cli", "entry.py:2 imports ds4sci.bench"]


def test_backend_names_and_genslm_config_import_without_torch():
    """ds4sci.kernels.backends and ds4sci.models.genslm.config (and the package inits above them) load neither torch
    nor Triton, so torch-free tools (``ds4sci plan``, config validation) can use the backend enums and limits; nor
    do the planners built on them (every module of ``ds4sci.planning``) or their commands' modules."""
    code = ("import sys, ds4sci.kernels.backends, ds4sci.models.genslm.config, ds4sci.planning.common, "
            "ds4sci.planning.costs, ds4sci.planning.genslm, ds4sci.planning.genslm_search, "
            "ds4sci.planning.evoformer, ds4sci.commands.plan, ds4sci.commands.plan_evoformer; "
            "heavy = sorted(m for m in sys.modules if m in ('torch', 'triton') or m.startswith(('torch.', 'triton.'))); "
            "print(heavy[:5]); sys.exit(bool(heavy))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
