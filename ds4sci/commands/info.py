"""``ds4sci info``: versions, devices, the launch this process is part of (launcher, rank/world, local rank/size,
nodes, master) and, per component, each attention backend and whether it is usable here. A launcher's environment
that cannot form its group is shown in the report, then stops the command as any command's: its one line, exit 2.

Components: ``evoformer_attention`` (:mod:`ds4sci.kernels.evoformer`, ``backend=``) and ``genslm_local_attention``
(GenSLM's ``attention_backend``, :mod:`ds4sci.kernels.local_attention`). Backend names come from their enums in
:mod:`ds4sci.kernels.backends` (``EvoformerBackend``, ``LocalBackend``), so a backend added there is listed here
(with "not described by ds4sci info" until :func:`backends` learns about it).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import platform

from ds4sci.distributed.launch import Launch
from ds4sci.distributed.launch import LaunchError
from ds4sci.distributed.launch import resolve_launch


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
        "launch": launch(),
    }


def launch() -> dict | str:
    """What :func:`~ds4sci.distributed.launch.resolve_launch` reads here (launcher, rank/world, local rank/size,
    nodes, master), or its one-line error."""
    try:
        return dataclasses.asdict(resolve_launch())
    except LaunchError as err:
        return f"error: {err}"


def _triton_status(module: str, cuda: bool) -> tuple[bool, str]:
    """(usable, why) for a Triton kernel module of ds4sci.kernels: it must import, and it runs on CUDA devices or,
    slowly, on the CPU under ``TRITON_INTERPRET=1``."""
    try:
        importlib.import_module(module)
    except Exception as err:  # ImportError, or a Triton build that fails while importing
        return False, f"does not import ({type(err).__name__}: {err})"
    if cuda:
        return True, "usable (CUDA)"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True, "usable on the CPU through TRITON_INTERPRET=1 (the interpreter: slow, for tests)"
    return False, "no CUDA device (runs on the CPU under TRITON_INTERPRET=1 only)"


def _flash_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def backends(cuda: bool | None = None) -> dict[str, dict[str, dict]]:
    """``{component: {backend: {"usable": bool, "why": str}}}`` for this environment (``cuda`` overrides detection)."""
    import torch

    from ds4sci.kernels.backends import EvoformerBackend
    from ds4sci.kernels.backends import LocalBackend

    if cuda is None:
        cuda = torch.cuda.is_available()
    evo_triton = _triton_status("ds4sci.kernels.triton_evoformer", cuda)
    local_triton = _triton_status("ds4sci.kernels.triton_local_attention", cuda)
    if not _flash_installed():
        flash = (False, "not installed (pip install flash-attn)")
    elif not cuda:
        flash = (False, "no CUDA device")
    else:
        flash = (True, "usable (CUDA, fp16/bf16, head dim <= 256, no documents/window/mask/ALiBi)")
    known = {
        "evoformer_attention": {
            "auto": (True, f"picks {'triton' if evo_triton[0] and cuda else 'torch'} here (triton for CUDA tensors "
                           "in fp16/bf16/fp32 when it imports, torch otherwise)"),
            "triton": evo_triton,
            "torch": (True, "usable (chunked PyTorch, any device)"),
            "reference": (True, "usable (plain PyTorch autograd; materialises the S x S logits)"),
        },
        "genslm_local_attention": {
            "auto": (True, "picks " + ("flash where it can express the call, else triton, else chunked" if cuda
                                       else "chunked here (no CUDA device; sdpa for a decode step and a causal "
                                            "inference pass)")),
            "flash": flash,
            "triton": local_triton,
            "chunked": (True, "usable (PyTorch online softmax, any device, every option)"),
            "sdpa": (True, "usable (PyTorch SDPA, the O(S^2) reference)"),
        },
    }
    unknown = (False, "not described by ds4sci info")
    names = {"evoformer_attention": [b.value for b in EvoformerBackend],
             "genslm_local_attention": [b.value for b in LocalBackend]}
    return {
        component: {name: dict(zip(("usable", "why"), known[component].get(name, unknown)))
                    for name in names[component]}
        for component in names
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    info = collect()
    table = backends(info["cuda_available"])
    if args.json:
        print(json.dumps(info | {"backends": table}, indent=2))
    else:
        width = max(map(len, info))
        for key, value in info.items():
            if key == "launch" and isinstance(value, dict):
                value = Launch(**value).describe()
            print(f"{key:<{width}}  {value}")
        for component, rows in table.items():
            print(f"\n{component} backends:")
            name_width = max(map(len, rows))
            for name, row in rows.items():
                print(f"  {name:<{name_width}}  {'yes' if row['usable'] else 'no ':<3}  {row['why']}")
    resolve_launch()  # an environment that cannot form its group: after the report, its one line and exit 2
    return 0
