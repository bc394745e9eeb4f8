"""Checkpointed inputs kept in host memory between forward and backward, copied on a side stream and fetched back
one checkpoint ahead (``activation_checkpointing.cpu``; the activation offload of Arctic Long Sequence Training,
Snowflake 2025).

With activation checkpointing each checkpointed region (a whole block in ``full`` mode, the attention core in
``selective`` mode) keeps only its inputs for backward; for a block those are ``[B, T/sp, hidden]``, one hidden
vector per token per layer, which at 100K+ tokens is most of what stays on the device. :class:`HostOffload` wraps the
checkpoint call:

- forward: after the region runs, each of its floating-point tensor inputs that owns its whole storage is copied to
  (pinned) host memory on a side stream and its device storage is released (``record_stream`` keeps the allocator
  from reusing the memory before the copy has read it). The checkpoint's own reference to the tensor stays valid:
  only the storage behind it is emptied and later refilled, in place.
- backward: a hook on the region's output fires when its gradient is ready, just before the checkpoint recomputes
  the region; it refills the inputs (waiting for a copy already in flight) and starts fetching the inputs of the
  region offloaded just before this one, so that copy overlaps this region's recomputation.

A tensor input that is a view of a larger storage (say, value heads split out of a fused QKV projection) stays on
the device: releasing a shared storage would take it from the other tensors on it. A released tensor read before
it is refilled raises PyTorch's error on an empty storage rather than giving wrong numbers.

DeepSpeed's ``checkpoint_in_cpu`` does the same move synchronously, and only with ``partition_activations`` (its
copy of an unpartitioned input is emptied with the device copy when both live on the CPU); this module replaces it.
On a CPU-only machine the "device" is the CPU: the copies are plain clones, which is what the tests check (order,
exactness, what is released); overlap and speed need a GPU.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from dataclasses import field

import torch
from torch import Tensor

__all__ = ["HostOffload"]


@dataclass(eq=False)
class _Offloaded:
    """The inputs of one checkpointed region: the device tensors (storage released), their host copies, and the
    event after which a fetch has landed (None while on the host, or on the CPU)."""

    tensors: list[Tensor]
    host: list[Tensor]
    fetched: bool = False
    ready: torch.cuda.Event | None = field(default=None)


class HostOffload:
    """Moves checkpointed inputs to host memory and back, one region ahead (see the module docstring).

    ``offload.checkpoint(checkpoint_fn, function, *args)`` runs ``checkpoint_fn(function, *args)`` (a checkpoint
    that keeps ``args`` for backward, such as :func:`ds4sci.train.activation_checkpointing.checkpoint`) and offloads
    ``args``; :attr:`offloaded_bytes` counts what is in host memory now.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._pending: list[_Offloaded] = []  # offloaded and not yet refilled, in forward order

    @property
    def offloaded_bytes(self) -> int:
        """Bytes of checkpointed inputs held in host memory now (released from the device)."""
        return sum(h.nbytes for entry in self._pending for h in entry.host)

    def checkpoint(self, checkpoint_fn, function, *args):
        out = checkpoint_fn(function, *args)
        if not (torch.is_grad_enabled() and isinstance(out, Tensor) and out.requires_grad):
            return out
        tensors = [a for a in args if isinstance(a, Tensor) and a.is_floating_point() and _owns_storage(a)]
        if tensors:
            entry = self._offload(tensors)
            out.register_hook(functools.partial(self._before_backward, entry))
        return out

    def _offload(self, tensors: list[Tensor]) -> _Offloaded:
        host = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.cuda) for t in tensors]
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the region has written its inputs
            with torch.cuda.stream(self.stream):
                for t, h in zip(tensors, host):
                    h.copy_(t, non_blocking=True)
                    t.record_stream(self.stream)  # not reused before this copy has read it
        else:
            for t, h in zip(tensors, host):
                h.copy_(t)
        for t in tensors:
            t.untyped_storage().resize_(0)
        entry = _Offloaded(tensors, host)
        self._pending.append(entry)
        return entry

    def _fetch(self, entry: _Offloaded) -> None:
        """Refill ``entry``'s storages from the host (on the side stream on a GPU; :meth:`_wait` waits for it)."""
        for t in entry.tensors:
            t.untyped_storage().resize_(t.numel() * t.element_size())
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the refilled memory is allocated
            with torch.cuda.stream(self.stream):
                for t, h in zip(entry.tensors, entry.host):
                    t.copy_(h, non_blocking=True)
                entry.ready = torch.cuda.Event()
                entry.ready.record(self.stream)
        else:
            for t, h in zip(entry.tensors, entry.host):
                t.copy_(h)
        entry.fetched = True

    def _before_backward(self, entry: _Offloaded, grad: Tensor) -> None:
        """The gradient of ``entry``'s region output is ready: refill its inputs before the recomputation reads
        them, and start fetching the region before it."""
        if entry not in self._pending:  # a second hook call on the same output (never in a plain backward)
            return
        index = self._pending.index(entry)
        if not entry.fetched:
            self._fetch(entry)
        if index > 0 and not self._pending[index - 1].fetched:
            self._fetch(self._pending[index - 1])  # overlaps this region's recomputation
        if entry.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(entry.ready)
        self._pending.pop(index)


def _owns_storage(t: Tensor) -> bool:
    """``t`` alone spans its storage (no view of a larger tensor), so releasing the storage releases only ``t``."""
    return (t.storage_offset() == 0 and t.is_contiguous()
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())
