"""Memory-measurement harness shared by the ``ds4sci bench`` memory benchmarks.

- :func:`saved_for_backward`: the bytes autograd saves for backward during a block of code, counted as the unique
  storages packed through ``torch.autograd.graph.saved_tensors_hooks`` (inputs such as q, k, v included when
  autograd saves them; a storage shared by several saved tensors counts once);
- :class:`LiveTensors`: the live bytes and their peak of the tensors torch's ops return inside a block of code (a
  ``TorchDispatchMode``; what the allocator's peak would be if nothing but those tensors were allocated);
- :class:`PeakMemory`: the peak memory of a block of code above the memory held when it starts. On CUDA
  ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``; on the CPU the peak resident set of this
  process, ``VmHWM - VmRSS`` from ``/proc/self/status`` after resetting the high-water mark VmHWM to the current RSS
  through ``/proc/self/clear_refs`` (Linux). ``ru_maxrss`` is not used: it survives fork+exec, so a child would
  report its parent's peak;
- :func:`run_in_subprocess`: one measurement in a fresh interpreter (``python -m ds4sci.bench.memory
  module:function ARGS_JSON RESULT_JSON``), so one configuration's allocations, and the memory the allocator keeps
  after them, never hide another's;
- :func:`allocator_settings`: the allocator variables of the environment (glibc ``MALLOC_*_``, ``GLIBC_TUNABLES``,
  ``PYTORCH_CUDA_ALLOC_CONF``). The harness sets none of them; reports record what was in force, since they change
  how much freed memory stays resident;
- :func:`distinct_bytes`, :func:`model_states`: the bytes of tensors counted once per buffer, and of a DeepSpeed
  engine's parameters, gradients and optimizer state on this rank.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import subprocess
import sys
import tempfile
import weakref
from collections.abc import Iterable
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

#: how a subprocess runs a measurement: ``python -m`` of this module
HARNESS_MODULE = "ds4sci.bench.memory"
_ALLOCATOR_VARIABLES = ("GLIBC_TUNABLES", "PYTORCH_CUDA_ALLOC_CONF")


class SavedBytes:
    """Unique storages autograd packed for backward, by data pointer; :attr:`bytes` is their total size."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """The pack hook: records the tensor's storage and hands the tensor back unchanged."""
        storage = tensor.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def bytes(self) -> int:
        """Total bytes of the storages recorded so far."""
        return sum(self.storages.values())


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@contextlib.contextmanager
def saved_for_backward() -> Iterator[SavedBytes]:
    """Count what autograd saves for backward inside the ``with`` block::

        with saved_for_backward() as saved:
            loss = model(x).sum()
        loss.backward()
        saved.bytes
    """
    saved = SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, _unpack):
        yield saved


class LiveTensors(TorchDispatchMode):
    """Live bytes of the tensors torch's ops return while the mode is active: each storage counted (its whole
    ``nbytes``, once for all its views) from the first op that returns a tensor on it until the last of those tensors
    dies, which is when autograd, a collective's work object and Python have all let go of it. :attr:`peak` is the
    largest total; :meth:`window` starts a new window whose peak is :attr:`window_peak`.

    Seen: every op's outputs, forward and backward (autograd runs CPU backward on the calling thread), the buffers
    collectives are handed (allocated by ops), parameter gradients. Not seen: storages in ``ignore`` (data pointers,
    e.g. the parameters and inputs, allocated before), tensors made outside the mode, scratch an op allocates and
    frees inside itself (a matmul's packed copies, the torch attention backend's logits blocks, a collective
    library's own buffers), and the allocator's caching and fragmentation: it is a count of tensors, not of a
    device's memory.
    """

    def __init__(self, ignore: Iterable[int] = ()) -> None:
        super().__init__()
        self.ignore = set(ignore)
        self.owners: dict[int, set[int]] = {}  # storage data pointer -> ids of its live tensors
        self.size: dict[int, int] = {}  # storage data pointer -> its bytes
        self.now = self.peak = self.window_peak = 0

    def window(self) -> None:
        """Start a new window: :attr:`window_peak` restarts from the bytes live now."""
        self.window_peak = self.now

    def _release(self, key: int, owner: int) -> None:
        owners = self.owners.get(key)
        if owners is not None:
            owners.discard(owner)
            if not owners:
                del self.owners[key]
                self.now -= self.size.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self.ignore:
                continue
            if key not in self.owners:
                self.owners[key], self.size[key] = set(), storage.nbytes()
                self.now += storage.nbytes()
                self.peak, self.window_peak = max(self.peak, self.now), max(self.window_peak, self.now)
            if id(t) not in self.owners[key]:
                self.owners[key].add(id(t))
                weakref.finalize(t, self._release, key, id(t))
        return out


def proc_status_bytes(field: str) -> int:
    """A memory field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ...) in bytes (Linux)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"{field} not found in /proc/self/status")


def reset_peak_rss() -> None:
    """Reset this process's resident high-water mark (VmHWM) to its current RSS (Linux)."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


def peak_method(device: str | torch.device) -> str:
    """How :class:`PeakMemory` measures on ``device``, for reports."""
    if torch.device(device).type == "cuda":
        return "torch.cuda.max_memory_allocated"
    return "peak RSS (VmHWM - VmRSS) of a fresh subprocess per run"


class PeakMemory:
    """Peak memory of the ``with`` block above what is held when it starts, in :attr:`bytes`::

        with PeakMemory(device) as peak:
            step()
        peak.bytes

    On the CPU this is the process's peak RSS, so it is meaningful in a process that runs one measurement
    (:func:`run_in_subprocess`), after a warm-up that loads lazily imported libraries.
    """

    def __init__(self, device: str | torch.device) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.before = 0
        self.bytes = 0

    def __enter__(self) -> PeakMemory:
        if self.cuda:
            torch.cuda.synchronize()
            self.before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            reset_peak_rss()
            self.before = proc_status_bytes("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.bytes = torch.cuda.max_memory_allocated() - self.before
        else:
            self.bytes = proc_status_bytes("VmHWM") - self.before


def distinct_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of ``tensors``, each (data pointer, size) once: views of one flat buffer add up, repeats do not."""
    seen = {}
    for t in tensors:
        if t is not None and t.numel():
            seen[(t.data_ptr(), t.numel() * t.element_size())] = t.numel() * t.element_size()
    return sum(seen.values())


def model_states(engine, at_step: dict) -> dict[str, int]:
    """Bytes of a DeepSpeed engine's model states on this rank: params and optimizer bytes now (the optimizer's split
    into AdamW's ``moments`` and DeepSpeed's fp32 ``master`` copies), grads as recorded when the optimizer stepped
    (``at_step``), and ``tp_split``: the bytes of the parameters split over TP (``tensor_model_parallel``), by name,
    before any ZeRO-3 partitioning."""
    # ZeRO-3: each rank's partition ds_tensor, plus the full data of parameters kept gathered (DeepSpeed persists
    # parameters below stage3_param_persistence_threshold elements); others hold an empty tensor between uses
    params = [p for p in engine.module.parameters()] + [p.ds_tensor for p in engine.module.parameters()
                                                         if hasattr(p, "ds_tensor")]
    model_ptrs = {p.untyped_storage().data_ptr() for p in params if p.numel()}
    opt = engine.basic_optimizer
    masters = [q for g in opt.param_groups for q in g["params"] if q.untyped_storage().data_ptr() not in model_ptrs]
    moments = distinct_bytes(t for t in tree_leaves(list(opt.state.values())) if isinstance(t, torch.Tensor))
    master = distinct_bytes(masters)
    split = {n: getattr(p, "ds_numel", p.numel()) * p.element_size() for n, p in engine.module.named_parameters()
             if getattr(p, "tensor_model_parallel", False)}
    return {"params": distinct_bytes(params), "grads": at_step["grads"], "optimizer": moments + master,
            "moments": moments, "master": master, "tp_split": split}


def allocator_settings() -> dict[str, str]:
    """The allocator variables set in this environment (children inherit them); empty means the defaults."""
    return {name: value for name, value in sorted(os.environ.items())
            if name in _ALLOCATOR_VARIABLES or (name.startswith("MALLOC_") and name.endswith("_"))}


def describe_allocator(settings: dict[str, str]) -> str:
    """One line for a report about :func:`allocator_settings`."""
    if not settings:
        return ("Allocator: defaults (no MALLOC_*_ / GLIBC_TUNABLES / PYTORCH_CUDA_ALLOC_CONF set; "
                "glibc's mmap threshold starts at 128 KiB and adapts).")
    return "Allocator: " + ", ".join(f"{name}={value}" for name, value in settings.items()) + "."


def run_in_subprocess(target: str, *args: Any, env: dict[str, str] | None = None) -> Any:
    """Call ``target`` (``"package.module:function"``) with JSON-serialisable ``args`` in a fresh interpreter and
    return its (JSON-serialisable) result. ``env`` adds to this process's environment. Raises ``RuntimeError`` with
    the end of the child's stderr if it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        command = [sys.executable, "-m", HARNESS_MODULE, target, json.dumps(list(args)), str(result)]
        proc = subprocess.run(command, capture_output=True, text=True, check=False, env=os.environ | (env or {}))
        if proc.returncode != 0:
            raise RuntimeError(f"{target}{tuple(args)!r} failed in its subprocess:\n{proc.stderr[-4000:]}")
        return json.loads(result.read_text())


def _main(argv: list[str]) -> None:
    target, args_json, result_path = argv
    module_name, function_name = target.split(":")
    function = getattr(importlib.import_module(module_name), function_name)
    Path(result_path).write_text(json.dumps(function(*json.loads(args_json))))


if __name__ == "__main__":
    _main(sys.argv[1:])
