"""Activation checkpointing for GenSLM through DeepSpeed's own API (``deepspeed.checkpointing``), applied from
outside the model (``activation_checkpointing:`` in the training config).

Modes:

- ``"full"``: every block is recomputed in backward; only each block's input ``[B, T/P, hidden]`` is kept. Set
  through the model's :attr:`~ds4sci.models.genslm.GenSLM.checkpoint_fn` hook (wrapping the blocks would rename
  their parameters). Two things keep the recomputed block's working set down (issue #28): its output is freed when
  its backward starts (:func:`checkpoint`; DeepSpeed keeps it referenced throughout), and on every ``Block`` (not a
  ``TensorParallelBlock``) the first norm's output is rebuilt from the block input when the qkv projection's backward
  needs it (``Block.recompute_norm``), each one hidden vector per token less at the peak.
- ``"selective"``: only the attention core (``softmax(QK^T) V``: the part whose activations grow fastest and cost
  least to recompute) is recomputed; the projections and the MLP keep their activations (Korthikanti et al. 2022,
  "Reducing Activation Recomputation in Large Transformer Models", section 4.2). Each ``block.attention.core``
  is wrapped in :class:`CheckpointedCore`, a module without parameters or persistent buffers, so parameter and
  state-dict names do not change.

Tiled MLP (``tiled_mlp: true``, with any mode; ALST's TiledMLP, Bekman et al. 2025, arXiv:2506.13996): every
block's MLP runs over tiles of ``mlp_tile`` tokens and is recomputed tile by tile in backward
(:class:`~ds4sci.models.genslm.model.MLP`'s ``tile``), so its ``[B, T, intermediate]`` activations (two of them, three
with SwiGLU) are never saved, and never alive for more than one tile; only its input is saved. Under full
checkpointing the block's recomputation calls the tiled MLP again, whose backward then recomputes each tile once
more. Parameter gradients are summed over the tiles and accumulated once per backward, so DeepSpeed's ZeRO 1/2
gradient hooks fire once per backward, as without tiling (ZeRO-2 refuses a gradient reduced twice). Under ZeRO-3 each MLP is made a ZeRO-3 leaf module
(``deepspeed.utils.set_z3_leaf_modules``): its parameters are gathered for the whole MLP forward (all tiles) and
again for its whole backward (every recomputed tile), not once per tile, and are full-shaped when the tiled function
takes them as inputs; DeepSpeed reduces a leaf module's gradients in its backward hook, once. Under tensor
parallelism the MLP holds no collective (:class:`~ds4sci.parallel.genslm_tp.TensorParallelBlock` all-gathers
its input and reduce-scatters its partial sums outside it), so the tiles cut the gathered ``[B, T, hidden]`` input
of the full SP shard after the all-gather, each tile computing this rank's ``intermediate/tp`` columns; the
collectives run once per block, as without tiling. The tiled function saves that gathered input (its column-parallel
layers then read their tiles as plain linear layers), so under TP a tiled MLP keeps ``[B, T, hidden]`` where an untiled
one keeps this rank's region ``[B, T/tp, hidden]`` and the ``[B, T, intermediate/tp]`` activations.

Tiled loss (``tiled_loss: true``, with any mode; ALST's tiled loss): the output head computes the summed cross
entropy itself over tiles of ``loss_tile`` tokens, recomputed in backward
(:class:`~ds4sci.models.genslm.model.OutputHead`'s ``tile``; under TP
:class:`~ds4sci.parallel.tensor_parallel.VocabParallelOutput`'s, with the vocabulary-parallel cross entropy per
tile), so no ``[B, T, V]`` logits (or ``V/tp`` columns) and no fp32 log-softmax of them are saved, and none is alive
for more than one tile; the trainer passes the targets into the model (``GenSLM.forward(..., targets=...)``) and gets
the loss sum back. Only the final hidden states ``[B, T, hidden]`` and the targets are saved. The head's weight
gradient (the embedding's, when tied) is summed over the tiles and accumulated once per backward, as the tiled MLP's.
Under ZeRO-3 the head needs no leaf marking: it computes with its own weight, which ZeRO-3 gathers for its forward
(all tiles) and, through the hook on its output (the loss), for its backward (every recomputed tile), with no
submodule called per tile. Under pipeline parallelism the last stage returns the final hidden states and
:class:`~ds4sci.train.pipeline.PipelineLoss` calls the head with the targets.

Applied AFTER :func:`ds4sci.parallel.parallelize.parallelize`. Under tensor parallelism a full-mode block is a
:class:`~ds4sci.parallel.genslm_tp.TensorParallelBlock`, whose recomputation reruns its sequence-region
all-gather and reduce-scatter over the TP group (every TP rank recomputes, in the same order); the selective core
holds this TP rank's heads. Under sequence parallelism the checkpointed core is the whole
:class:`~ds4sci.sequence.DistributedAttention`: backward reruns its forward communication (Ulysses: the q, k, v and
output all-to-alls; ring: the key/value rotations), as Megatron-LM's selective recompute does with context
parallelism. Checkpointing only the local attention inside it would save that traffic, but ring attention's
backward already recomputes its local blocks with ``torch.autograd.grad``, which DeepSpeed's (reentrant)
checkpoint refuses ("Checkpointing is not compatible with .grad()").
Note that the memory-efficient local attention backends (``chunked``, ``triton``, ``flash``) already save only
q, k, v, the output and the log-sum-exp; selective checkpointing then saves the output and the log-sum-exp (and
the SP layout changes); with ``attention_backend="sdpa"`` it saves the ``S x S`` mask and probabilities.

DeepSpeed 0.19.8 facts (``deepspeed/runtime/activation_checkpointing/checkpointing.py``, checked here on the CPU):

- ``deepspeed.checkpointing.configure`` sets module-level state (DeepSpeed's API has no object): the trainer calls
  :func:`apply_activation_checkpointing` once per model, which re-configures every option explicitly.
- ``activation_checkpointing.cpu`` does not use DeepSpeed's ``checkpoint_in_cpu``: that copy is synchronous and works
  only with ``partition_activations``, which splits each checkpointed input over the ``mpu``'s tensor-parallel group
  and all-gathers it in backward, assuming the input is REPLICATED over that group (Megatron-LM without sequence
  parallelism); under :mod:`ds4sci.parallel.tensor_parallel` no checkpointed input is (a block's input is this TP
  rank's sequence region, an attention core's q, k, v hold this rank's heads). The checkpoint call is wrapped in
  :class:`ds4sci.train.activation_offload.HostOffload` instead (side-stream copies, fetched one region ahead), and
  DeepSpeed is configured with :data:`_UNPARTITIONED`, a tensor-parallel group of one, and no partitioning.
- With ``partition_activations`` DeepSpeed miscounts non-tensor arguments (a ``None`` becomes two entries:
  "run() takes 5 positional arguments but 7 were given"); :func:`checkpoint` passes only the non-``None``
  arguments through DeepSpeed and binds the others in a closure, so none reach it whatever the setting.
- The forward's CPU and accelerator RNG states are restored for the recomputation (dropout masks are redrawn
  identically), and the recomputation runs ZeRO-3's parameter gathering hooks again.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm.model import MLP
from ds4sci.train.activation_offload import HostOffload
from ds4sci.train.config import ACTIVATION_CHECKPOINTING_MODES, ActivationCheckpointingConfig

__all__ = ["CheckpointedCore", "apply_activation_checkpointing", "apply_tiled_loss", "apply_tiled_mlp", "checkpoint"]


def checkpoint(function, *args):
    """``deepspeed.checkpointing.checkpoint(function, *args)``, with ``None`` arguments kept out of DeepSpeed
    (bound in a closure; see the module docstring). ``function``'s activations are recomputed in backward."""
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
    inputs are never split over TP ranks (they differ across them; see the module docstring)."""

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
