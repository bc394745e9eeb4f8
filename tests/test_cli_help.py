"""What a newcomer meets first: every ``ds4sci COMMAND --help`` is quick (imports no torch) and tells the truth
(the presets listed from the presets table)."""
import subprocess
import sys

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
