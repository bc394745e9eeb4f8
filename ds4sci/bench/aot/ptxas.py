"""The ``ptxas -v`` log of Triton's own compile (registers, stack frame, spills) and the ptxas Triton runs."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

_PTXAS_LOG_RE = {
    "registers": re.compile(r"Used (\d+) registers"),
    "stack_bytes": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


def ptxas_usage(log: str) -> dict:
    """Registers, stack frame and spill bytes of the (single) entry function in a ``ptxas -v`` log."""
    usage = {}
    for key, pattern in _PTXAS_LOG_RE.items():
        found = pattern.findall(log)
        if len(found) != 1:
            raise RuntimeError(f"expected one {key} figure in the ptxas -v log, found {found}:\n{log}")
        usage[key] = int(found[0])
    return usage


def ptxas_versions(targets: dict[int, tuple[str, int]]) -> dict[str, str]:
    """The ptxas Triton runs for each target (its own rule: ``ptxas`` below sm_90, ``ptxas-blackwell`` from sm_90), by
    ``--gpu-name``; ``targets``: compute capability -> (``--gpu-name``, ...), as :data:`.compile.TARGETS`."""
    import triton

    versions = {}
    for cc, (name, _) in targets.items():
        tool = triton.knobs.nvidia.ptxas if cc < 90 else triton.knobs.nvidia.ptxas_blackwell
        proc = subprocess.run([tool.path, "--version"], capture_output=True, text=True, check=False)
        last = proc.stdout.strip().splitlines()[-1:] or ["unknown"]
        versions[name] = f"{Path(tool.path).name}: {last[0]}"
    return versions
