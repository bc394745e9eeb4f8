"""tests/distributed: multi-process tests on gloo, spawned with :func:`ds4sci.spawn.run_workers`.

Worker functions live at module level in the test files: spawned processes import them by name, so this
directory must be importable (added to ``sys.path`` here, whatever pytest's import mode).
"""
import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
