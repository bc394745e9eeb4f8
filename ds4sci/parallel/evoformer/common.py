"""What the axial (1-D) and the mesh (2-D) Evoformer context parallelism share: holding the caller's blocks and
calling them by their own argument names, the parameters' gradient all-reduce, the exit gather, the padding keys,
and the arithmetic of the bytes the parameter gradients cost.

Both wrappers take and return full tensors on every rank with single-process semantics; the parameters are used
through an identity whose backward all-reduces their gradient (as DDP would), except a Pairformer block's
replicated single-representation side (:data:`PAIRFORMER_REPLICATED`), whose gradients every rank computes whole.
"""
from __future__ import annotations

import inspect
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch import nn

from ds4sci.distributed.comm import CommCounter
from ds4sci.distributed.comm import SequenceRegion
from ds4sci.distributed.comm import all_gather
from ds4sci.distributed.comm import split
from ds4sci.distributed.comm import sync_grad
from ds4sci.models.evoformer import EvoformerBlock
from ds4sci.models.evoformer import PairformerBlock

#: Parameters of a Pairformer block whose work is replicated on every rank: their gradients are not all-reduced.
PAIRFORMER_REPLICATED = ("attn_pair_bias.layer_norm_a.", "attn_pair_bias.mha.", "single_transition.")

Blocks = EvoformerBlock | PairformerBlock | Sequence[EvoformerBlock | PairformerBlock]


def gather_out(x: Tensor, group, dim: int, counter: CommCounter | None = None) -> Tensor:
    """A gather along ``dim`` whose every rank's use is the same (the exit; a replicated computation): backward keeps
    this rank's piece (the loss is every rank's)."""
    return SequenceRegion.apply(x, group, dim, counter, all_gather, split)


def gather_leading(x: Tensor, group, dim: int, counter: CommCounter | None = None) -> Tensor:
    """:func:`gather_out` received straight into the tensor it returns: ``dim`` is moved first (one copy of this
    rank's piece), gathered there into one buffer (no list of received pieces beside their concatenation) and moved
    back, so the result is a permuted view of that buffer, not contiguous (z by columns ``[*, N, N/P, C_z]`` comes
    back with its two residue strides swapped). The same values and the same bytes sent; every rank holds one whole
    copy of the result instead of two at once."""
    return gather_out(x.movedim(dim, 0), group, 0, counter).movedim(0, dim)


def padding_keys(mask: Tensor, dim: int, real: int) -> Tensor:
    """``mask`` with its entries past the first ``real`` along ``dim`` (the padding keys) at -inf: the attention's
    mask bias ``inf * (mask - 1)`` is then -inf there, not the block's finite ``-inf``, so a real row whose real
    keys are all masked attends over them alone, as in the single process (which has no padding keys)."""
    index = torch.arange(mask.shape[dim], device=mask.device).view(-1, *[1] * (-dim - 1))
    return torch.where(index >= real, -math.inf, mask)


def block_slice(t: int, size: int) -> slice:
    """Block ``t`` of blocks of ``size`` entries: ``t * size .. (t + 1) * size - 1``."""
    return slice(t * size, (t + 1) * size)


def default_group(group):
    """``group``, or every rank of the default process group when None and one is initialised."""
    return group if group is not None or not dist.is_initialized() else dist.group.WORLD


class HeldBlocks(nn.Module):
    """The base of the 1-D and 2-D wrappers: holds the given block or blocks (their parameters, not copies) as
    ``block`` (one block) or ``blocks`` (a stack; the caller's ``nn.ModuleList`` itself), so its state dict is theirs
    under that prefix, and is called with the block's own signature: ``(m, z, msa_mask=None, pair_mask=None,
    chunk_size=None)`` for Evoformer blocks, ``(s, z, single_mask=None, pair_mask=None, chunk_size=None)`` for
    Pairformer blocks, by position or by name. ``block_groups``: the blocks of each region the subclass runs sharded
    (every block its own region; one region of them all for a single block or ``sharded``)."""

    def __init__(self, block_or_stack: Blocks, sharded: bool):
        super().__init__()
        single = isinstance(block_or_stack, (EvoformerBlock, PairformerBlock))
        iterable = single or isinstance(block_or_stack, (list, tuple, nn.ModuleList, nn.Sequential))
        blocks = [block_or_stack] if single else list(block_or_stack) if iterable else []
        kinds = {type(b) for b in blocks}
        if not blocks or len(kinds) > 1 or not kinds <= {EvoformerBlock, PairformerBlock}:
            raise TypeError("evoformer_context_parallel: expected a ds4sci EvoformerBlock or PairformerBlock or a "
                            f"non-empty stack of one of them, got {type(block_or_stack).__name__} of "
                            f"{sorted(k.__name__ for k in kinds)}")
        if single:
            self.block = block_or_stack
        else:
            self.blocks = block_or_stack if isinstance(block_or_stack, nn.ModuleList) else nn.ModuleList(blocks)
        self.sharded = sharded
        self.block_groups = [blocks] if sharded or single else [[b] for b in blocks]
        self._signature = inspect.signature(blocks[0].forward)

    def bind(self, args: tuple, kwargs: dict) -> tuple:
        """A call's arguments by the block's own names, as ``(x, z, x_mask, pair_mask, chunk_size)`` (x: m or s);
        a name the block does not take is a ``TypeError``, as the block's own call would raise."""
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return tuple(bound.arguments.values())


def synced_parameters(region: nn.Module, group, counter: CommCounter | None) -> dict[str, Tensor]:
    """The parameters of ``region`` (a stack holding ``blocks``, 1-D or 2-D), each through an identity whose backward
    all-reduces its gradient over ``group``, except a Pairformer's replicated single-representation side
    (:data:`PAIRFORMER_REPLICATED`), whose gradients every rank computes whole."""
    synced = {}
    for name, p in region.named_parameters():
        block_name = name.split(".", 2)[2]  # <stack attribute>.<i>.<name in the block>
        replicated = isinstance(region.blocks[0], PairformerBlock) and block_name.startswith(PAIRFORMER_REPLICATED)
        synced[name] = p if replicated else sync_grad(p, group, counter)
    return synced


def ceil_div(a: int, b: int) -> int:
    """``a / b`` rounded up: a length padded to a multiple of ``b``, in blocks."""
    return -(-a // b)


def param_grad_bytes(block: EvoformerBlock | PairformerBlock, ranks: int) -> int:
    """Bytes this rank sends in the all-reduce of ``block``'s parameter gradients over ``ranks`` ranks,
    ``2 (P-1)/P |params|`` as :class:`~ds4sci.sequence.CommCounter` counts it, a Pairformer's replicated s-side
    (:data:`PAIRFORMER_REPLICATED`) left out."""
    params = [q for name, q in block.named_parameters()
              if not (isinstance(block, PairformerBlock) and name.startswith(PAIRFORMER_REPLICATED))]
    return sum(2 * q.numel() * q.element_size() * (ranks - 1) // ranks for q in params)
