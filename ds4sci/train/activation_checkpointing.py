"""Activation checkpointing for GenSLM through DeepSpeed's own API (``deepspeed.checkpointing``), applied from
outside the model (``activation_checkpointing:`` in the training config) after
:func:`ds4sci.parallel.parallelize.parallelize`.

- ``"full"``: every block is recomputed in backward; only each block's input ``[B, T/P, hidden]`` is kept (through
  the model's :attr:`~ds4sci.models.genslm.GenSLM.checkpoint_fn` hook: wrapping the blocks would rename their
  parameters). The recomputed block's output is freed when its backward starts (:func:`checkpoint`) and the first
  norm's output is rebuilt when the qkv projection's backward needs it (``Block.recompute_norm``; issue #28). Under
  TP the recomputation reruns the block's sequence-region collectives, on every TP rank in the same order.
- ``"selective"``: only the attention core (``softmax(QK^T) V``, whose activations grow fastest and cost least to
  recompute) is recomputed (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", section 4.2), each ``block.attention.core`` wrapped in the parameterless :class:`CheckpointedCore`. Under
  SP the core is the whole ``DistributedAttention``, whose all-to-alls and ring rotations backward reruns: ring
  attention's backward calls ``torch.autograd.grad``, which a reentrant checkpoint inside it would refuse.
- Tiled MLP (``tiled_mlp``; ALST's TiledMLP, Bekman et al. 2025, arXiv:2506.13996): every MLP runs over tiles of
  ``mlp_tile`` tokens recomputed in backward, so no ``[B, T, intermediate]`` activation is saved; gradients are
  accumulated once per backward (ZeRO's hooks fire once) and under ZeRO-3 each MLP is a leaf module. Under TP the
  tiles cut the gathered input after the all-gather, so the collectives run once per block.
- Tiled loss (``tiled_loss``; ALST's tiled loss): the output head computes the summed cross entropy over tiles of
  ``loss_tile`` tokens, so no ``[B, T, V]`` logits (or ``V/tp`` columns) are saved; the trainer passes the targets
  into the model.

Checkpointed inputs differ across TP ranks (a block's input is this rank's sequence region), so DeepSpeed is
configured with a tensor-parallel group of one and no activation partitioning, and host offload (``cpu``) is
:class:`~ds4sci.train.activation_offload.HostOffload` around the checkpoint (side-stream copies), not DeepSpeed's
``checkpoint_in_cpu``, which needs partitioning. ``None`` arguments never reach DeepSpeed (:func:`checkpoint`).
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm.model import MLP
from ds4sci.train.activation_offload import HostOffload
from ds4sci.train.config import ACTIVATION_CHECKPOINTING_MODES
from ds4sci.train.config import ActivationCheckpointingConfig

__all__ = ["CheckpointedCore", "apply_activation_checkpointing", "apply_tiled_loss", "apply_tiled_mlp", "checkpoint"]


def checkpoint(function, *args):
    """``deepspeed.checkpointing.checkpoint(function, *args)``, with ``None`` arguments kept out of DeepSpeed (bound
    in a closure), whatever its settings. ``function``'s activations are recomputed in backward."""
    import deepspeed

    keep = [i for i, a in enumerate(args) if a is not None]

    def run(*given):
        full = [None] * len(args)
        for i, a in zip(keep, given):
            full[i] = a
        out = function(*full)
        if torch.is_grad_enabled():  # DeepSpeed's backward recomputing (its forward runs without autograd)
            _release_at_backward(out)
        return out

    return deepspeed.checkpointing.checkpoint(run, *(args[i] for i in keep))


def _release_at_backward(out) -> None:
    """Free the storage of a recomputed output ``out`` when autograd starts its backward through it, when ``out`` is
    an addition's own result (a block's residual sum, ``[B, T, hidden]``): DeepSpeed's reentrant backward holds its
    recomputed outputs for the whole backward it runs through them, one hidden vector per token at the working set's
    peak, and an addition's backward reads neither its inputs nor its output. Anything else (a view, an attention
    core's output, which its own backward reads) is left alone."""
    if isinstance(out, torch.Tensor) and out._base is None and type(out.grad_fn).__name__ == "AddBackward0":
        storage = out.untyped_storage()

        def release(grad_outputs):
            storage.resize_(0)

        out.grad_fn.register_prehook(release)


class CheckpointedCore(nn.Module):
    """An attention core whose forward is recomputed in backward (``deepspeed.checkpointing.checkpoint``).

    ``forward(q, k, v, *, q_doc=None, k_doc=None)``, the call :class:`~ds4sci.models.genslm.model.Attention` makes
    (on an ``AttentionCore`` or a ``DistributedAttention``). Holds ``core`` as a submodule: GenSLM's cores have no
    parameters and only non-persistent buffers, so no state-dict key changes (checked at wrap time).
    ``checkpoint_fn``: :func:`checkpoint`, or it wrapped in :meth:`HostOffload.checkpoint`.
    """

    def __init__(self, core: nn.Module, checkpoint_fn=checkpoint):
        super().__init__()
        names = [n for n, _ in core.named_parameters()] + list(core.state_dict())
        if names:
            raise ValueError(f"selective checkpointing wraps parameterless attention cores; {type(core).__name__} "
                             f"has parameters or persistent buffers {names}, whose names the wrapper would change")
        self.core = core
        self.checkpoint_fn = checkpoint_fn

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_doc: torch.Tensor | None = None,
                k_doc: torch.Tensor | None = None) -> torch.Tensor:
        same = k_doc is q_doc  # DistributedAttention gathers shared document ids once: keep them one object

        def run(q, k, v, q_doc, k_doc):
            return self.core(q, k, v, q_doc=q_doc, k_doc=q_doc if same else k_doc)

        return self.checkpoint_fn(run, q, k, v, q_doc, None if same else k_doc)


class _TensorGroupOfOne:
    """The ``mpu`` DeepSpeed's activation checkpointing reads: a tensor-parallel group of one, so checkpointed
    inputs are never split over TP ranks (they differ across them; see the module docstring). ``configure`` sets
    module-level state (DeepSpeed's API has no object), so every option is set again for each model."""

    def get_tensor_model_parallel_rank(self) -> int:
        return 0

    def get_tensor_model_parallel_world_size(self) -> int:
        return 1

    def get_tensor_model_parallel_group(self) -> None:
        return None


_UNPARTITIONED = _TensorGroupOfOne()


def _check_tile(key: str, tile) -> None:
    """``activation_checkpointing.<key>``, a tile in tokens, is an integer >= 1 (a one-line error naming it)."""
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise ValueError(f"activation_checkpointing.{key}={tile!r}: must be an integer >= 1 (tokens per tile)")


def apply_tiled_mlp(model: GenSLM, tile: int) -> None:
    """Compute every block's MLP over tiles of ``tile`` tokens, recomputed in backward (in place; see the module
    docstring), each MLP a ZeRO-3 leaf module. Call before the DeepSpeed engine is built (ZeRO-3 registers its hooks
    then)."""
    _check_tile("mlp_tile", tile)
    from deepspeed.utils import set_z3_leaf_modules

    for block in model.layers:
        block.mlp.tile = tile
    set_z3_leaf_modules(model, [MLP])


def apply_tiled_loss(model: GenSLM, tile: int) -> None:
    """Compute the output head's loss over tiles of ``tile`` tokens, recomputed in backward (in place; see the module
    docstring): ``model(..., targets=...)`` then returns the summed loss."""
    _check_tile("loss_tile", tile)
    model.embed_out.tile = tile


def apply_activation_checkpointing(model: GenSLM, cfg: ActivationCheckpointingConfig,
                                   device: torch.device | str = "cpu") -> HostOffload | None:
    """Turn on ``cfg.mode`` activation checkpointing and, with ``cfg.tiled_mlp`` / ``cfg.tiled_loss``, the tiled MLP /
    loss in ``model`` (in place; no-op for ``"none"`` without either), with the checkpointed inputs in host memory
    when ``cfg.cpu`` (:class:`~ds4sci.train.activation_offload.HostOffload` for ``device``, the device the model runs
    on; returned, else None).

    Call after :func:`ds4sci.parallel.parallelize.parallelize` (any tensor, Ulysses and ring degrees) and before the
    DeepSpeed engine is built; torch.distributed must be initialised (DeepSpeed's ``configure`` logs on rank 0).
    """
    if cfg.mode not in ACTIVATION_CHECKPOINTING_MODES:
        raise ValueError(f"activation_checkpointing.mode={cfg.mode!r}: expected none, full or selective")
    if cfg.tiled_mlp:
        apply_tiled_mlp(model, cfg.mlp_tile)
    if cfg.tiled_loss:
        apply_tiled_loss(model, cfg.loss_tile)
    if cfg.mode == "none":
        return None
    import deepspeed

    deepspeed.checkpointing.configure(_UNPARTITIONED, partition_activations=False, contiguous_checkpointing=False,
                                      checkpoint_in_cpu=False, synchronize=False, profile=False)
    offload = HostOffload(device) if cfg.cpu else None
    checkpoint_fn = functools.partial(offload.checkpoint, checkpoint) if offload is not None else checkpoint
    if cfg.mode == "full":
        model.checkpoint_fn = checkpoint_fn
        for block in model.layers:
            block.recompute_norm = True
    else:
        for block in model.layers:
            block.attention.core = CheckpointedCore(block.attention.core, checkpoint_fn)
    return offload
