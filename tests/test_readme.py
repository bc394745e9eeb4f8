"""The commands and code of README and of every page of the documentation site (``docs/``), as written.

Every command in README.md and ``docs/**/*.md`` (fenced ``bash`` blocks and inline ``ds4sci ...``, ``torchrun ...``,
``deepspeed ...``, ``python ...``, ``pytest ...``, ``make ...`` spans) is collected and handled by what it costs:

- run as written in a scratch folder that holds ``examples/`` and a small export at ``runs/demo/export`` (what
  ``make demo`` leaves): ``evaluate``, ``generate``, ``embed``, ``score``, ``plan``, ``info``, ``--help``,
  ``--print-config``, the corpus pre-build (its ``FASTA... DIR`` placeholders filled with a bundled genome); each
  in a process forked from :mod:`ds4sci.spawn`'s server (torch imported once for all: tests/fork_checks.py),
  ``--help`` through the console script;
- training runs (minutes each): the launcher's process count, the config file, every ``--set`` and every path
  it names are resolved as ``ds4sci train`` resolves them before any work (``load_config``, then
  ``parallel.dims(world size)``), so a key, a value, a file or a process count that would stop the run fails here;
- benchmarks (minutes to hours; their ``--quick`` forms are run by ``tests/bench/test_bench_*.py``), and commands
  that read what a training on the pages writes (``ds4sci predict runs/coding/export ...``), and ``ds4sci probe``
  (minutes of cross-validated fits; ``tests/infer/test_probe.py`` runs it): parsed by the ``ds4sci`` parser, so every
  option and value must exist;
- scripts launched by ``torchrun`` (``torchrun --nproc-per-node 2 examples/SCRIPT.py``): run as written, their
  printed differences from one process checked;
- pytest invocations: the named test files exist; ``make demo`` / ``make test``: ``tests/test_foundation.py``.

A command that fits none of these fails :func:`test_every_command_is_checked`, so a new command on any page must be
given a check here. The Python blocks run, with inputs of the shapes their comments state where they take inputs.
"""
from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ds4sci.spawn import open_store

from fork_checks import launch  # tests/ is on sys.path (its conftest.py)
from fork_checks import ranks_env  # tests/ is on sys.path (its conftest.py)
from fork_checks import run_in_fork

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
TEXT = "\n".join(page.read_text() for page in PAGES)
PLANNER = (ROOT / "docs" / "performance" / "planner.md").read_text()  # the planner table and the presets' sizes
BIN = Path(sys.executable).parent
GENOME = "examples/data/MN908947.3_sars_cov_2.fasta.gz"
INLINE_STARTS = ("ds4sci ", "torchrun ", "deepspeed ", "python ", "pytest ", "TRITON_INTERPRET=0 pytest ",
                 ".venv/bin/pytest ", "make ")
RUN = {"evaluate", "generate", "embed", "score", "score-variants", "plan", "plan-evoformer", "info", "export-hf"}


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", TEXT, flags=re.S)


def _bash_commands() -> list[str]:
    """The commands of the bash blocks: continuations joined, comments dropped."""
    commands = []
    for block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                commands.append(" ".join(line.split()))
    return commands


def _inline_commands() -> list[str]:
    """Inline code spans that are commands (``ds4sci plan`` alone names a command; it is not one to run)."""
    spans = {" ".join(s.split()) for s in re.findall(r"(?<!`)`([^`]+)`(?!`)", TEXT)}
    commands = []
    for span in sorted(spans):
        words = span.split()
        if not span.startswith(INLINE_STARTS) or len(words) < 2:
            continue
        if words[0] == "ds4sci" and ("/" in words[1] or any(w.isupper() for w in words[1:3]) or "error:" in span
                                     or len(words) == 2 and words[1][0] != "-"):
            continue  # "ds4sci score", "ds4sci train/evaluate/...", "ds4sci bench NAME ...", "ds4sci CMD: error: ..."
        commands.append(span)
    return commands


COMMANDS = sorted(set(_bash_commands()) | set(_inline_commands()))
#: The runs whose exports :func:`scratch` makes, so that the commands reading them run.
SCRATCH_RUNS = {"runs/demo/", "runs/my_genomes/", "runs/ecoli_llama_u2/"}
#: The ``train.out_dir`` of every other training command on the pages: a command that reads from one of them
#: (``ds4sci predict runs/coding/export ...``) is parsed, not run.
TRAINED_HERE = tuple(sorted({m + "/" for m in re.findall(r"train\.out_dir=(runs/[\w.-]+)", TEXT)} - SCRATCH_RUNS))


def _argv(command: str) -> tuple[int, list[str]]:
    """``(processes, ds4sci argv)`` of a ``ds4sci``, ``torchrun -m ds4sci.cli`` or ``deepspeed --module`` line."""
    words = shlex.split(command)
    if words[0] == "ds4sci":
        return 1, words[1:]
    if words[0] == "torchrun":
        m = words.index("-m")
        assert words[m + 1] == "ds4sci.cli", command
        return int(words[words.index("--nproc-per-node") + 1]), words[m + 2:]
    if words[0] == "deepspeed":
        m = words.index("--module")
        assert words[m + 1] == "ds4sci.cli", command
        return int(words[words.index("--num_gpus") + 1]), words[m + 2:]
    raise AssertionError(f"not a ds4sci command: {command}")


def _kind(command: str) -> str:
    words = command.split()
    if words[0] == "make":
        return "make"
    if any(w.endswith("pytest") for w in words[:2]):
        return "pytest"
    if words[0] == "python":
        return "run" if words[1:3] == ["-m", "ds4sci.data.corpus"] else "script"
    if words[0] == "torchrun" and words[-1].endswith(".py"):
        return "launched script"
    if words[0] not in ("ds4sci", "torchrun", "deepspeed"):
        return "unknown"
    _, argv = _argv(command)
    if argv[0] == "train":
        return "run" if "--print-config" in argv else "train"
    if argv[0] == "bench":
        return "bench"
    if len(argv) > 1 and argv[1].startswith(TRAINED_HERE) or argv[0] == "probe":
        return "reads a training's output"
    if argv[0] in RUN or argv[0].startswith("--"):
        return "run"
    return "unknown"


def test_readme_commands_found():
    """The extraction works: commands README and the pages are known to show are among those collected."""
    assert any(c.startswith("ds4sci evaluate runs/demo/export") for c in COMMANDS)
    assert any(c.startswith("torchrun --nproc-per-node 4 -m ds4sci.cli train") for c in COMMANDS)
    assert any(c.startswith("ds4sci bench layouts --layouts") for c in COMMANDS)
    assert any(c.startswith("ds4sci plan --preset 25B") for c in COMMANDS)
    assert len(COMMANDS) >= 25


def test_every_command_is_checked():
    unchecked = [c for c in COMMANDS if _kind(c) == "unknown"]
    assert not unchecked, f"commands in README or docs/ with no check in {__file__}: {unchecked}"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """A working folder like a fresh clone after ``make demo``: ``examples/`` and a small nucleotide export at
    ``runs/demo/export`` (and a Llama-shaped one where ``ecoli_llama_u2.yaml`` exports); ``runs/my_genomes`` stands
    for the run the genome-LM tutorial trains."""
    import torch

    from ds4sci.data import NucleotideTokenizer
    from ds4sci.io.export import export_consolidated
    from ds4sci.models.genslm import GenSLM
    from ds4sci.models.genslm import GenSLMConfig

    root = tmp_path_factory.mktemp("readme")
    (root / "examples").symlink_to(ROOT / "examples")
    torch.manual_seed(0)
    tok = NucleotideTokenizer()
    cfg = GenSLMConfig.preset("debug", vocab_size=tok.vocab_size)
    export_consolidated(GenSLM(cfg).state_dict(), cfg, tok, root / "runs" / "demo" / "export")
    cfg = GenSLMConfig.preset("llama-debug", vocab_size=tok.vocab_size)
    export_consolidated(GenSLM(cfg).state_dict(), cfg, tok, root / "runs" / "ecoli_llama_u2" / "export")
    (root / "runs" / "my_genomes").symlink_to(root / "runs" / "demo")
    return root


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _exec_blocks(programs: list[str]) -> int:
    """Each program in a namespace of its own, one after the other (in the process :func:`run_in_fork` gives it)."""
    for i, code in enumerate(programs):
        exec(compile(code, f"<python block {i}>", "exec"), {"__name__": "__main__"})
    return 0


def _as_run(command: str) -> str:
    """The command as :func:`test_cheap_command_runs_as_written` runs it: ``runs/my_genomes`` is the scratch's
    ``runs/demo`` (a link), so a command that differs from another only by that folder is the same run, made once."""
    return command.replace("runs/my_genomes/", "runs/demo/")


@pytest.mark.parametrize("command", sorted({_as_run(c) for c in COMMANDS if _kind(c) == "run"}))
def test_cheap_command_runs_as_written(command, scratch, tmp_path):
    """Each command, as written, exits 0 and writes each ``--out`` it names. ``--help`` runs through the console
    script in a fresh interpreter (the entry point, torch-free); the others are ``ds4sci.cli.main`` (what the console
    script calls) in a process forked from :mod:`ds4sci.spawn`'s server, torch already imported (tests/fork_checks.py):
    a lone one, or as many ranks as the ``torchrun`` line launches, in one process group."""
    words = shlex.split(command.replace("[", "").replace("]", ""))  # "[--reverse-complement]": run with it
    if "--help" in words:
        proc = _run([str(BIN / "ds4sci"), *words[1:]], scratch)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        assert "usage: ds4sci" in proc.stdout, proc.stdout
        return
    if words[:3] == ["python", "-m", "ds4sci.data.corpus"]:
        fill = {"FASTA...": GENOME, "DIR": str(tmp_path / "cache")}
        from ds4sci.data.corpus import main

        processes, argv = 1, [fill.get(w, w) for w in words[3:]]
    else:
        from ds4sci.cli import main

        processes, argv = _argv(command.replace("[", "").replace("]", ""))
    env = {"OMP_NUM_THREADS": "1"}
    if processes == 1:
        ranks = [run_in_fork(argv, scratch, main=main, env=env)]
    else:
        store = open_store()  # torchrun's agent's part: the store its ranks meet at
        ranks = launch(argv, [{**env, **rank} for rank in ranks_env(processes, store.port)], main=main, cwd=scratch,
                       timeout=600)
    for rank in ranks:
        assert rank.returncode == 0, f"{command}\n{rank.stdout[-2000:]}\n{rank.stderr[-2000:]}"
    for out in re.findall(r"--out (\S+)", command):
        if "plan" not in command and "DIR" not in out:
            assert (scratch / out).stat().st_size > 0, out


@pytest.mark.parametrize("command", [c for c in COMMANDS if _kind(c) == "train"])
def test_training_command_resolves(command, scratch):
    """What a training command would meet before its first step: the config, every --set, the paths it names and
    the launched process count."""
    from ds4sci.cli import build_parser
    from ds4sci.train.config import load_config

    processes, argv = _argv(command)
    args = build_parser(["train"]).parse_args(argv)
    cwd = os.getcwd()
    os.chdir(scratch)
    try:
        cfg = load_config(args.config, args.overrides)
        fasta = cfg.data.fasta if isinstance(cfg.data.fasta, list) else [cfg.data.fasta]
        for pattern in fasta:
            assert glob.glob(str(pattern), recursive=True), f"{command}: data.fasta={pattern} matches no file"
        if cfg.model.init_from:
            assert Path(cfg.model.init_from).exists(), f"{command}: model.init_from={cfg.model.init_from}"
        cfg.parallel.dims(processes)  # raises naming the parallel.* keys when the process count does not fit
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize("command", [c for c in COMMANDS if _kind(c) in ("bench", "reads a training's output")])
def test_command_parses(command):
    from ds4sci.cli import build_parser

    _, argv = _argv(command)
    build_parser(argv[:1]).parse_args([w if w != "DIR" else "/tmp/out" for w in argv])


@pytest.mark.slow  # two processes that import torch
@pytest.mark.parametrize("command", [c for c in COMMANDS if _kind(c) == "launched script"])
def test_launched_script_runs_as_written(command, scratch):
    """``torchrun ... examples/SCRIPT.py`` as written (the Evoformer-across-ranks tutorial's): it exits 0 and each
    rank's printed difference from one process is float32 rounding."""
    words = shlex.split(command)
    proc = _run([str(BIN / "torchrun"), *words[1:]], scratch)
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    diffs = [float(d) for d in re.findall(r"largest difference from one process.*: (\S+)$", proc.stdout, flags=re.M)]
    processes = int(words[words.index("--nproc-per-node") + 1])
    assert len(diffs) == processes and max(diffs) < 1e-5, proc.stdout


@pytest.mark.parametrize("command", [c for c in COMMANDS if _kind(c) in ("pytest", "script")])
def test_named_files_exist(command):
    for word in command.split():
        if word.endswith(".py") or word.rstrip("/.") == "tests":
            assert (ROOT / word.rstrip(".")).exists(), f"{command}: {word}"


def test_python_blocks_run(scratch):
    """Every Python block: the Evoformer call with inputs of the shapes its comments give (B=1, N=3, S=20, H=2,
    D=16), ``load_model`` on the scratch export, the others as written (they make their own inputs)."""
    blocks = _blocks("python")
    evoformer = [b for b in blocks if "evoformer_attention(q, k, v" in b]
    load_model = [b for b in blocks if "ds4sci.load_model(" in b]
    assert len(evoformer) == len(load_model) == 1 and len(blocks) >= 3
    prelude = ("import torch\nB, N, S, H, D = 1, 3, 20, 2, 16\n"
               "q, k, v = (torch.randn(B, N, S, H, D) for _ in range(3))\n"
               "mask_bias = torch.zeros(B, N, 1, 1, S)\npair_bias = torch.randn(B, 1, H, S, S)\n")
    checks = {evoformer[0]: (prelude, "assert o.shape == q.shape\n"),
              load_model[0]: ("", "assert logits.shape[:2] == ids.shape\n"
                                  "assert hidden.shape[-1] == model.config.hidden_size\n")}
    # One process forked from the spawn server (torch imported there once), each block in a namespace of its own
    programs = []
    for block in blocks:
        before, after = checks.get(block, ("", ""))
        programs.append(before + block + after)
    proc = run_in_fork(programs, scratch, main=_exec_blocks, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]


def _plan_rows() -> dict[tuple[str, int, str], tuple[int, int, float]]:
    """The planner page's table: ``(model, GPUs, 'new' | 'old') -> (published K, predicted, ratio)``."""
    rows = re.findall(r"^\| (25B|33B) \| (32|64) \| (new|old) Megatron-DeepSpeed \| (\d+)K \| ([\d,]+) \| ([\d.]+) \|",
                      PLANNER, flags=re.M)
    return {(model, int(gpus), release): (int(k), int(n.replace(",", "")), float(ratio))
            for model, gpus, release, k, n, ratio in rows}


def test_planner_table_is_what_the_command_prints(capsys, monkeypatch, tmp_path):
    """Each predicted length in the planner page's DeepSpeed4Science table is what its plan command prints: as written
    for 25B on 64 GPUs, with its comments' ``num_layers=80`` for 33B, ``--nodes 4 --tp 32`` for 32 GPUs and ``old
    release: add ...`` flags for the old rows; each ratio is the prediction over the published length (K = 1024);
    and the free search the last comment describes prints the lengths the page's prose gives for ds4sci's own layout."""
    from ds4sci.cli import main

    monkeypatch.chdir(tmp_path)  # the plan writes its report into the working directory
    command = next(c for c in _bash_commands() if c.startswith("ds4sci plan --preset 25B"))
    block = next(b for b in _blocks("bash") if "ds4sci plan --preset 25B" in b)
    old = shlex.split(re.search(r"# old release: add (.*)", block).group(1))
    assert re.search(r"# 33B: num_layers=80; 32 GPUs: --nodes 4 --tp 32", block)
    rows = _plan_rows()
    assert len(rows) == 8

    def longest(argv: list[str], model: str) -> int:
        if model == "33B":
            argv = [w.replace("num_layers=64", "num_layers=80") for w in argv]
        assert main(argv) == 0
        return int(re.search(r"Longest sequence that fits: (\d+) tokens", capsys.readouterr().out).group(1))

    for (model, gpus, release), (k, predicted, ratio) in rows.items():
        argv = shlex.split(command)[1:] + (old if release == "old" else [])
        if gpus == 32:
            argv += ["--nodes", "4", "--tp", "32"]
        assert longest(argv, model) == predicted, (model, gpus, release)
        assert round(predicted / (k * 1024), 2) == ratio, (model, gpus, release)
    argv = shlex.split(command)[1:]
    free = argv[:argv.index("--tp")] + argv[argv.index("--position-table") + 2:]
    prose = re.search(r"ds4sci's own layout on the same 64 GPUs \(the free search\) reaches ([\d,]+) tokens for 25B "
                      r"and ([\d,]+) for 33B", " ".join(PLANNER.split()))
    assert [longest(free, m) for m in ("25B", "33B")] == [int(n.replace(",", "")) for n in prose.groups()]


def test_preset_counts():
    """The parameter count the planner page gives for each preset is the model's own count."""
    from ds4sci.models.genslm.config import PRESETS
    from ds4sci.models.genslm.config import GenSLMConfig
    from ds4sci.models.genslm.config import format_parameters

    sentence = " ".join(PLANNER[PLANNER.index("Presets (`--preset`"):].split("\n\n")[0].split())
    for name in PRESETS:
        assert f"`{name}` {format_parameters(GenSLMConfig.preset(name).num_parameters())}" in sentence, name
