"""What a newcomer meets first: ``make demo`` says what it installs and runs, every ``ds4sci COMMAND --help`` is
quick (imports no torch) and tells the truth (the presets listed from the presets table)."""
import subprocess
import sys

import pytest

HELP_IMPORTS = """
import sys
from ds4sci.cli import COMMANDS, main
for name in COMMANDS:
    try:
        main([name, "--help"])
    except SystemExit as e:
        assert e.code == 0, (name, e.code)
    if "torch" in sys.modules:
        print("imports torch:", name)
        sys.exit(1)
print("commands:", len(COMMANDS))
"""


def test_every_command_help_imports_no_torch():
    """One process runs each command's --help in turn; the first that imports torch is named (imports only
    accumulate, so a clean end means no command imported it)."""
    proc = subprocess.run([sys.executable, "-c", HELP_IMPORTS], capture_output=True, text=True, cwd="/")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "commands:" in proc.stdout


BENCH_HELP_IMPORTS = """
import sys
from ds4sci.bench import BENCHMARKS
from ds4sci.cli import main
for name in [*sys.argv[1:], None]:
    assert "torch" not in sys.modules, f"ds4sci bench {last} --help imports torch"
    if name is None:
        break
    try:
        main(["bench", name, "--help"])
    except SystemExit as e:
        assert e.code == 0, (name, e.code)
    last = name
print("benchmarks:", len(sys.argv) - 1)
"""


def test_every_benchmark_help_imports_no_torch():
    """``ds4sci bench NAME --help`` for every benchmark, in one process, in turn: the first that imports torch is
    named."""
    from ds4sci.bench import BENCHMARKS

    proc = subprocess.run([sys.executable, "-c", BENCH_HELP_IMPORTS, *BENCHMARKS], capture_output=True, text=True,
                          cwd="/")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"benchmarks: {len(BENCHMARKS)}" in proc.stdout


def test_preset_help_lists_every_preset_with_the_count_plan_prints(capsys, monkeypatch):
    """``--print-config``'s model.preset and ``plan --help`` list the whole presets table, and the count they give a
    preset is the one ``plan`` prints for it (both at the nucleotide vocabulary a run uses by default)."""
    from ds4sci.cli import main
    from ds4sci.data import NucleotideTokenizer
    from ds4sci.models.genslm.config import NUCLEOTIDE_VOCAB_SIZE
    from ds4sci.models.genslm.config import PRESETS

    assert NUCLEOTIDE_VOCAB_SIZE == NucleotideTokenizer().vocab_size
    assert main(["train", "--print-config"]) == 0
    preset_line = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("preset:"))
    monkeypatch.setenv("COLUMNS", "10000")  # argparse would wrap "llama-debug" at its hyphen
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    plan_help = " ".join(capsys.readouterr().out.split())
    for text in (preset_line, plan_help):
        assert all(f'"{name}" (' in text for name in PRESETS), text
    argv = ["plan", "--preset", "25M", "--seq-len", "1024", "--gpus-per-node", "1", "--zero-stage", "0",
            "--offload", "none", "--checkpointing", "none"]
    assert main(argv) == 0
    title = capsys.readouterr().out.splitlines()[0]
    count = title.split("): ")[1].split(" parameters")[0]
    assert f'"25M" ({count})' in preset_line and f'"25M" ({count})' in plan_help, (title, plan_help)


def test_make_install_and_demo_say_what_they_do(tmp_path):
    """``make demo`` on a fresh clone (``make -n``, a virtual environment that does not exist yet): pip is never
    quiet (a line per package, no progress bar for CI logs) and each long step is announced by a ``make:`` line."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(["make", "--no-print-directory", "-n", "demo", f"VENV={tmp_path / 'venv'}"], cwd=root,
                          capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    steps = [i for i, line in enumerate(lines) if " -m pip install" in line or line.endswith("examples/demo.py")]
    assert len(steps) == 4, lines
    for before, i in zip([-1] + steps, steps):
        assert " -q" not in lines[i] and ("--progress-bar off" in lines[i]) != lines[i].endswith("demo.py"), lines[i]
        assert any(line.startswith('echo "make: ') for line in lines[before + 1:i]), lines[before + 1:i + 1]
