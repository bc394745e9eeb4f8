"""The dependency rules of the package, read from the source (ast, nothing imported).

The package order, lowest first: kernels <- models <- distributed <- sequence <- parallel <- {data, train, infer, io,
planning, integrations} <- {commands, bench, cli_args, report} <- cli. A module imports only its own level or lower
ones (siblings of one level may import each other, unless they form a cycle). ``ds4sci.progress`` and
``ds4sci.spawn`` are base utilities that any module may import; ``ds4sci/__init__.py`` sits at the cli's level: its
lazy imports expose public API of any layer (``load_model``, ``evoformer_context_parallel``) and nothing below may
import it. Imports inside functions count.

Also: kernels/ imports nothing of ds4sci outside itself; models/ defines no ``torch.autograd.Function`` and imports
no Triton; no import cycle between files; no private name (a leading underscore) taken from another module; no
source file over 600 lines; the torch-free modules import without torch, in a fresh interpreter.
"""
import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNELS, MODELS, SYSTEM = ROOT / "kernels", ROOT / "models", ROOT / "ds4sci"


def _sources(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.py"))


@functools.cache
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _package(path: Path, root: Path = ROOT) -> tuple[str, ...]:
    """The package a source file belongs to: kernels/x.py -> ("ds4sci", "kernels"), models/genslm/x.py -> ...genslm,
    ds4sci/train/x.py -> ("ds4sci", "train")."""
    parts = path.relative_to(root).parent.parts
    return parts if parts[0] == "ds4sci" else ("ds4sci",) + parts


def _imports(path: Path, package: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, relative imports resolved against ``package``."""
    found = []
    for node in ast.walk(_parse(path)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, _absolute(node, package)))
    return found


def _absolute(node: ast.ImportFrom, package: tuple[str, ...]) -> str:
    """The module ``from MODULE import ...`` names, a relative one resolved against ``package``."""
    if not node.level:
        return node.module
    return ".".join(package[: len(package) - node.level + 1] + ((node.module,) if node.module else ()))


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
    for node in ast.walk(_parse(path)):
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
        "probe.py:1 imports ds4sci.models.genslm", "probe.py:2 imports ds4sci.models",
        "probe.py:3 imports ds4sci.train"]
    entry = tmp_path / "entry.py"
    entry.write_text("from ds4sci.cli import main\nfrom ..bench import report\n"
                     "from ds4sci.cli_args import positive_int\n")
    assert _importing(entry, ("ds4sci", "infer"), lambda m: not _within(m, "ds4sci.cli", "ds4sci.bench")) == [
        "entry.py:1 imports ds4sci.cli", "entry.py:2 imports ds4sci.bench"]


# The package order: a module may import modules of its own level or lower ones. The longest matching name wins.
LEVELS = {
    "ds4sci.progress": 0, "ds4sci.spawn": 0,  # base utilities: importable from anywhere
    "ds4sci.kernels": 1,
    "ds4sci.models": 2,
    "ds4sci.distributed": 3,
    "ds4sci.sequence": 4,
    "ds4sci.parallel": 5,
    **dict.fromkeys(["ds4sci.data", "ds4sci.train", "ds4sci.infer", "ds4sci.io", "ds4sci.planning",
                     "ds4sci.integrations"], 6),
    **dict.fromkeys(["ds4sci.commands", "ds4sci.bench", "ds4sci.cli_args", "ds4sci.report"], 7),  # command line
    "ds4sci.cli": 8,
    "ds4sci": 8,  # the package's __init__.py: lazy imports of public API from any level
}
MAX_LINES = 600


def _modules(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> file for every source file of the package (kernels/ and models/ under their installed names)."""
    found = {}
    for path in (p for folder in ("ds4sci", "kernels", "models") for p in _sources(root / folder)):
        package = _package(path, root)
        found[".".join(package if path.stem == "__init__" else package + (path.stem,))] = path
    return found


def _package_of(module: str, path: Path) -> tuple[str, ...]:
    """The package relative imports in a module resolve against: the module itself for an ``__init__.py``."""
    parts = tuple(module.split(".")) if module else ()
    return parts if path.name == "__init__.py" else parts[:-1]


def _targets(node, package: tuple[str, ...], modules) -> list[str]:
    """The modules an import statement loads: ``from a.b import c`` names ``a.b.c`` where that is a module; a ds4sci
    name not among ``modules`` (an attribute, a package not created yet) stands for its longest known prefix."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = _absolute(node, package)
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    resolved = []
    for name in names:
        while name not in modules and "." in name and _within(name, "ds4sci"):
            name = name.rpartition(".")[0]
        if name not in resolved:
            resolved.append(name)
    return resolved


def _graph(modules: dict[str, Path]) -> dict[str, list[tuple[int, str]]]:
    """Module -> (line, module) of each import of another module of ``modules``, imports inside functions included."""
    graph = {}
    for module, path in modules.items():
        edges = graph[module] = []
        for node in ast.walk(_parse(path)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges += [(node.lineno, t) for t in _targets(node, _package_of(module, path), modules)
                          if t in modules and t != module and (node.lineno, t) not in edges]
    return graph


def _level(module: str) -> int | None:
    """The level of a module (None: none listed); ``ds4sci`` itself is the package's __init__.py only."""
    matches = [name for name in LEVELS if module == name or name != "ds4sci" and module.startswith(name + ".")]
    return LEVELS[max(matches, key=len)] if matches else None


def _upward_imports(graph) -> list[str]:
    """Imports of a module of a higher level than the importer's."""
    return [f"{module} (level {_level(module)}):{line} imports {target} (level {_level(target)})"
            for module, edges in graph.items() for line, target in edges
            if None not in (_level(module), _level(target)) and _level(target) > _level(module)]


def _cycles(graph) -> list[list[str]]:
    """One cycle (its modules in import order, the first repeated at the end) per strongly connected component of
    more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for _, target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while node not in component:
                component.add(stack.pop())
            on_stack.difference_update(component)
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_in(graph, component) for component in components]


def _cycle_in(graph, component: set[str]) -> list[str]:
    """A shortest path from the component's first module back to itself (breadth first, within the component)."""
    start = min(component)
    came_from = {start: None}
    queue = [start]
    for node in queue:
        for _, target in graph[node]:
            if target == start:
                path = [node]
                while came_from[path[-1]] is not None:
                    path.append(came_from[path[-1]])
                return path[::-1] + [start]
            if target in component and target not in came_from:
                came_from[target] = node
                queue.append(target)
    raise AssertionError(f"no cycle through {start}")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def _private_imports(path: Path, module: str, modules) -> list[str]:
    """Private names (``_x``, not ``__x__``) that ``path`` (module ``module``) takes from another ds4sci module:
    ``from m import _x``, or ``m._x`` on a module bound by an import."""
    tree = _parse(path)
    package, bad, aliases = _package_of(module, path), [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _absolute(node, package)
            if not _within(source or "", "ds4sci") or source == module:
                continue
            submodules = {a.asname or a.name: f"{source}.{a.name}" for a in node.names
                          if f"{source}.{a.name}" in modules}
            aliases.update(submodules)
            bad += [f"{path.name}:{node.lineno} imports {a.name} from {source}" for a in node.names
                    if _private(a.name) and (a.asname or a.name) not in submodules]
        elif isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.asname and _within(a.name, "ds4sci")})
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _private(node.attr):
            source = aliases.get(node.value.id)
            if source and source != module:
                bad.append(f"{path.name}:{node.lineno} uses {node.attr} of {source}")
    return bad


def _long_files(root: Path = ROOT) -> dict[str, int]:
    """Source files (tests and examples included) over :data:`MAX_LINES` lines -> their length."""
    files = [p for folder in ("ds4sci", "kernels", "models", "tests", "examples") for p in _sources(root / folder)]
    return {str(p.relative_to(root)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}


def test_every_module_has_a_level():
    unplaced = [m for m in _modules() if _level(m) is None]
    assert not unplaced, f"add these to LEVELS: {unplaced}"


def test_no_module_imports_a_higher_level():
    bad = _upward_imports(_graph(_modules()))
    assert not bad, "\n".join(bad)


def test_no_import_cycle_between_files():
    cycles = _cycles(_graph(_modules()))
    assert not cycles, "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_no_private_name_crosses_a_module():
    """Package source and examples/ (tests may use private names of the module they test)."""
    modules = _modules()
    bad = [b for module, path in modules.items() for b in _private_imports(path, module, modules)]
    bad += [b for path in _sources(ROOT / "examples") for b in _private_imports(path, "", modules)]
    assert not bad, "\n".join(bad)


def test_no_source_file_over_600_lines():
    long = _long_files()
    assert not long, "\n".join(f"{path}: {lines} lines" for path, lines in sorted(long.items()))


def test_rule_checks_see_planted_bugs(tmp_path):
    """A planted tree: a cycle through an import inside a function (train.a -> train.b -> train.a), upward imports
    (kernels -> sequence; models -> sequence, relative; data -> the package's __init__), private names (a from-import,
    an attribute of a module alias, one in an example) and a long test file."""
    for name, text in {
        "ds4sci/__init__.py": "def load():\n    from ds4sci.io import weights\n",
        "ds4sci/progress.py": "",
        "ds4sci/sequence/__init__.py": "",
        "ds4sci/sequence/attention.py": "import ds4sci.progress\n",
        "ds4sci/train/__init__.py": "from .a import run\n",
        "ds4sci/train/a.py": "from ds4sci.train import b\n\ndef run():\n    b.step()\n",
        "ds4sci/train/b.py": "def step():\n    from . import a\n    from .a import _helper\n",
        "ds4sci/io/weights.py": "import ds4sci.kernels.k as kk\nx = kk._secret\nfrom ds4sci import progress\n",
        "ds4sci/data/d.py": "from ds4sci import __version__\n",
        "kernels/k.py": "from ds4sci.sequence.attention import Attention\n_secret = 1\n",
        "models/genslm/m.py": "from ...sequence import comm\nfrom ...kernels import k\n",
        "examples/e.py": "from ds4sci.train.a import _private\n",
        "tests/test_long.py": "\n" * (MAX_LINES + 1),
    }.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    modules = _modules(tmp_path)
    assert sorted(modules) == ["ds4sci", "ds4sci.data.d", "ds4sci.io.weights", "ds4sci.kernels.k",
                               "ds4sci.models.genslm.m", "ds4sci.progress", "ds4sci.sequence",
                               "ds4sci.sequence.attention", "ds4sci.train", "ds4sci.train.a", "ds4sci.train.b"]
    graph = _graph(modules)
    assert graph["ds4sci.train.b"] == [(2, "ds4sci.train.a"), (3, "ds4sci.train.a")]
    assert graph["ds4sci.models.genslm.m"] == [(1, "ds4sci.sequence"), (2, "ds4sci.kernels.k")]
    assert _cycles(graph) == [["ds4sci.train.a", "ds4sci.train.b", "ds4sci.train.a"]]
    assert _cycles({**graph, "ds4sci.train.b": []}) == []
    assert _upward_imports(graph) == [
        "ds4sci.data.d (level 6):1 imports ds4sci (level 8)",
        "ds4sci.kernels.k (level 1):1 imports ds4sci.sequence.attention (level 4)",
        "ds4sci.models.genslm.m (level 2):1 imports ds4sci.sequence (level 4)"]
    private = {m: _private_imports(p, m, modules) for m, p in modules.items()}
    assert {m: bad for m, bad in private.items() if bad} == {
        "ds4sci.train.b": ["b.py:3 imports _helper from ds4sci.train.a"],
        "ds4sci.io.weights": ["weights.py:2 uses _secret of ds4sci.kernels.k"]}
    assert _private_imports(tmp_path / "examples/e.py", "", modules) == [
        "e.py:1 imports _private from ds4sci.train.a"]
    assert _long_files(tmp_path) == {"tests/test_long.py": MAX_LINES + 1}


def test_backend_names_and_genslm_config_import_without_torch():
    """ds4sci.kernels.backends and ds4sci.models.genslm.config (and the package inits above them) load neither torch
    nor Triton, so torch-free tools (``ds4sci plan``, config validation) can use the backend enums and limits; nor
    do the planners built on them (every module of ``ds4sci.planning``) or their commands' modules."""
    code = ("import sys, ds4sci.kernels.backends, ds4sci.models.genslm.config, ds4sci.planning.common, "
            "ds4sci.planning.costs, ds4sci.planning.genslm, ds4sci.planning.genslm_search, "
            "ds4sci.planning.evoformer, ds4sci.commands.plan, ds4sci.commands.plan_evoformer; "
            "heavy = sorted(m for m in sys.modules "
            "if m in ('torch', 'triton') or m.startswith(('torch.', 'triton.'))); "
            "print(heavy[:5]); sys.exit(bool(heavy))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
