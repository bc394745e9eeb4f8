"""The triangle multiplicative update's row-block plan, shared by the chunked path and the Triton path's inference.

In the working frame (``z`` for outgoing edges, its ``(I, J)`` transpose for incoming ones: :func:`frame_pair`) the
product is ``p_ij = sum_k r_ik f_jk`` with the row operand ``r`` (``a`` outgoing, ``b`` incoming) and the full-product
operand ``f`` (``b``, ``a``). :func:`row_blocks` computes the update one block of rows at a time: the block's ``r``,
its product block by block of ``f``'s rows and its output, through three steps the caller supplies (PyTorch ops for
:mod:`~ds4sci.kernels.trimul`, Triton launches for :mod:`~ds4sci.kernels.triton_trimul`), so both paths iterate in
one way. Without ``f`` given whole, each block of ``f`` is recomputed from ``z`` for every row block: no more than one
block of either operand is live (the inference target of issue #45), at the price of ``f``'s LayerNorm and
projections ``N/R`` times over (``R`` rows per block).
"""
from __future__ import annotations

from typing import Callable
from typing import Optional

from torch import Tensor

from .backends import TRIMUL_CHUNK_BYTES

#: ``operand(z_rows [*, R, N, C_z], mask_rows [*, R, N], which)``: the operand ``which`` of those rows,
#: channel-major (its last two dims ``[R, N]``, the channels before them)
Operand = Callable[[Tensor, Tensor, str], Tensor]
#: ``product(r [.., R, N], f [.., J, N], out [.., R, J])``: writes ``r f^T`` (per channel) into ``out``
Product = Callable[[Tensor, Tensor, Tensor], None]
#: ``finish(z_rows [*, R, N, C_z], p [.., R, N])``: those rows of the update ``[*, R, N, C_z]``
Finish = Callable[[Tensor, Tensor], Tensor]


def rows(t: Tensor, start: int, stop: int, pair: bool = True) -> Tensor:
    """Rows ``start:stop`` of ``t [*, N, N, C]`` (``pair``) or of ``t [*, N, N]`` (a view)."""
    return t[..., start:stop, :, :] if pair else t[..., start:stop, :]


def frame_pair(t: Tensor, outgoing: bool) -> Tensor:
    """``t [*, N, N, C]`` in the working frame: itself (outgoing) or its ``(I, J)`` transpose (a view)."""
    return t if outgoing else t.transpose(-2, -3)


def frame_mask(mask: Tensor, outgoing: bool) -> Tensor:
    """``mask [*, N, N]`` in the working frame (a view)."""
    return mask if outgoing else mask.transpose(-1, -2)


def row_blocks(z: Tensor, mask: Tensor, outgoing: bool, chunk: int, operand: Operand, product: Product,
               finish: Finish, full: Optional[Tensor] = None, keep: Optional[Tensor] = None) -> Tensor:
    """The update ``[*, N, N, C_z]`` of ``z [*, N, N, C_z]`` (``mask [*, N, N]``) by blocks of ``chunk`` rows of the
    working frame (module docstring), without autograd. ``full``: ``f`` of every row (``[.., N, N]``, sliced by rows
    instead of recomputed); ``keep``: where to store the frame's product (``[.., N_i, N_j]``, written row block by row
    block; else each block's product is a temporary).

    Raises:
        ValueError: ``chunk`` below 1.
    """
    if chunk < 1:
        raise ValueError(f"row_blocks: chunk must be at least 1 row, got {chunk}")
    r_name, f_name = ("a", "b") if outgoing else ("b", "a")
    zf, mf = frame_pair(z, outgoing), frame_mask(mask, outgoing)
    n = z.shape[-2]
    out = z.new_empty(z.shape)
    outf = frame_pair(out, outgoing)
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        r = operand(rows(zf, start, stop), rows(mf, start, stop, False), r_name)  # [.., R, N_k]
        p = keep[..., start:stop, :] if keep is not None else r.new_empty((*r.shape[:-1], n))  # [.., R, N_j]
        for j in range(0, n, chunk):
            j_stop = min(j + chunk, n)
            f_rows = (full[..., j:j_stop, :] if full is not None
                      else operand(rows(zf, j, j_stop), rows(mf, j, j_stop, False), f_name))  # [.., J, N_k]
            product(r, f_rows, p[..., j:j_stop])
            del f_rows
        del r
        rows(outf, start, stop).copy_(finish(rows(zf, start, stop), p))
        del p
    return out


def default_chunk_size(z: Tensor, c_hidden: int, budget: Optional[int] = TRIMUL_CHUNK_BYTES) -> int:
    """Rows per block: at most an eighth of the rows (so that one block's temporaries stay small beside the output),
    and, given a ``budget`` in bytes (the chunked path's :data:`~ds4sci.kernels.backends.TRIMUL_CHUNK_BYTES`), no
    more than keep one block's widest tensor (``[*, R, N, max(C_z, c)]``) within it; at least one."""
    n = z.shape[-2]
    eighth = -(-n // 8)
    if budget is None:
        return eighth
    row = z[..., 0, :, :].numel() // z.shape[-1] * max(z.shape[-1], c_hidden) * z.element_size()
    return max(1, min(budget // row, eighth))
