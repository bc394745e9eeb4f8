"""One activation recomputed in backward instead of saved: inside :func:`recompute_saved`, whatever autograd saves
that lies in a given tensor's storage is packed as a recipe and rebuilt by calling a function again when backward
unpacks it (``torch.autograd.graph.saved_tensors_hooks``; the selective recomputation of Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", applied to one cheap tensor). GenSLM's full
checkpointing uses it for the first norm's output, which the fused q/k/v projection would otherwise keep through the
whole recomputed block's backward, and to hand the attention's other saved tensors over once (issue #28's working
set).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from collections.abc import Iterator

import torch
from torch import Tensor

__all__ = ["recompute_saved"]


class _Once:
    """A saved tensor handed to backward once and then let go, so that a backward done with it can free it early."""

    __slots__ = ("tensor",)

    def __init__(self, t: Tensor):
        self.tensor = t


class _Recipe:
    """A saved view of the recomputed tensor: its shape, strides and offset in the tensor's storage."""

    __slots__ = ("shape", "stride", "offset")

    def __init__(self, t: Tensor):
        self.shape, self.stride, self.offset = t.shape, t.stride(), t.storage_offset()


@contextlib.contextmanager
def recompute_saved(tensor: Tensor, fn: Callable[[], Tensor]) -> Iterator[None]:
    """Inside the ``with`` block, a tensor autograd saves on ``tensor``'s storage (``tensor`` itself or a view, e.g.
    a linear layer's ``[B*T, hidden]`` input) is not kept: backward gets the same view of ``fn()``, run again without
    autograd when it is unpacked. ``fn`` must return ``tensor``'s values bitwise (a deterministic function of tensors
    that live on anyway, e.g. a norm of the block input) in a fresh contiguous tensor of its shape; ``tensor`` must be
    contiguous. Every other saved tensor is handed to backward once and then let go by the hook, so that a backward
    done with one can free it early (the chunked attention frees its output once it has formed ``rowsum(dO * O)``):
    backward must run through the graph made inside once, as a reentrant checkpoint's recomputation does; a second
    read raises ``RuntimeError``."""
    if not tensor.is_contiguous():
        raise ValueError(f"recompute_saved: the recomputed tensor must be contiguous; got shape {tuple(tensor.shape)}, "
                         f"strides {tensor.stride()}")
    key, dtype = tensor.untyped_storage().data_ptr(), tensor.dtype  # not the tensor: autograd keeps these hooks

    def pack(t: Tensor) -> _Once | _Recipe:
        if t.untyped_storage().data_ptr() == key and t.dtype == dtype:
            return _Recipe(t)
        return _Once(t)

    def unpack(saved: _Once | _Recipe) -> Tensor:
        if isinstance(saved, _Once):
            t, saved.tensor = saved.tensor, None
            if t is None:
                raise RuntimeError("recompute_saved: a tensor saved for backward was read twice; inside "
                                   "recompute_saved backward runs once through the graph (a reentrant checkpoint's "
                                   "recomputation), not with retain_graph")
            return t
        with torch.no_grad():
            return fn().as_strided(saved.shape, saved.stride, saved.offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
