"""``ds4sci info``: versions, devices and usable attention backends."""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform


def collect() -> dict:
    """Return a JSON-serialisable description of this environment."""
    import torch

    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "ds4sci": version("ds4sci"),
        "torch": torch.__version__,
        "triton": version("triton"),
        "deepspeed": version("deepspeed"),
        "biopython": version("biopython"),
        "openfold3": version("openfold3"),
        "flash_attn_importable": importlib.util.find_spec("flash_attn") is not None,
        "cuda_available": cuda,
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "cpu_threads": torch.get_num_threads(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(map(len, info))
        for key, value in info.items():
            print(f"{key:<{width}}  {value}")
    return 0
