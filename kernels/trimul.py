"""Triangle multiplicative update: public API, weights container and the torch and chunked paths (issue #45).

``triangle_multiplicative_update(z, mask, params, outgoing=..., eps=...)`` computes AF2 supplement Algorithms 11 and
12 (AF3 Algorithms 12 and 13) on a pair representation ``z [*, N_i, N_j, C_z]`` with ``x = LN_in(z)``::

    a = mask * sigmoid(x W_ag + b_ag) * (x W_ap + b_ap)            # [*, N_i, N_j, c], b likewise
    p_ij = sum_k a_ik b_jk  (outgoing)      p_ij = sum_k a_ki b_kj  (incoming)
    out = sigmoid(x W_g + b_g) * (LN_out(p) W_z + b_z)             # [*, N_i, N_j, C_z]

Backends (:class:`~ds4sci.kernels.backends.TriMulBackend`):

- ``"torch"``: the plain autograd graph (:func:`trimul_torch`), the readable oracle; it saves about 14 pair-sized
  tensors for backward and holds several at once in inference.
- ``"chunked"`` (:class:`_ChunkedTriMul`): rows of the product in blocks of ``chunk_size``. Forward keeps the
  full-product operand (``b`` outgoing, ``a`` incoming: ``[*, c, N, N]``) and computes the other operand, the
  product, LN_out and the gated output one row block at a time; it saves only ``z``, the mask and ``p`` (two
  pair-sized tensors and a per-position one). Backward rebuilds the full operand, recomputes each row block with
  autograd on (LN_in, the projections, LN_out and the gate: their statistics are recomputed too, ``O(N^2 C_z)``) and
  accumulates the full operand's gradient in place (one ``baddbmm`` per block), then back-propagates that through its
  projections block by block. Incoming runs as outgoing in the transposed frame (rows of ``z^T``) with the roles of
  ``a`` and ``b`` swapped. Inference (no gradient needed) holds the output and one block: the other operand is
  recomputed from ``z`` a block at a time for every row block, never held whole (:func:`_chunked_forward`). Both
  this and the Triton path's inference follow one row-block plan, :func:`~ds4sci.kernels.trimul_blocks.row_blocks`.
- ``"triton"``: the fused kernels of :mod:`~ds4sci.kernels.triton_trimul` (forward in three kernels, a backward
  that recomputes ``a`` and ``b`` from ``z`` and the saved LayerNorm statistics, inference in row blocks holding
  one block beyond the output; CUDA, or the interpreter).
- ``"auto"``: ``"triton"`` for CUDA tensors its kernels take, ``"chunked"`` otherwise.

:func:`channel_product` is the product alone on channel-major operands (``a, b [*, c, N, N] -> p``): the chunked
path calls it per row block, the context-parallel forms (:mod:`ds4sci.parallel.evoformer`) per shard and per Cannon
step on mesh tiles, between :func:`triangle_operand` and :func:`triangle_finish` (the steps before and after the
product, recomputing in backward as the chunked path does: they save ``z``, the mask and ``p`` only).

The weights travel in :class:`TriMulParams`, built from any module with OpenFold's (and OpenFold3's) attribute names
by :meth:`TriMulParams.from_module`; AlphaFold-Multimer's fused ``linear_ab_p`` / ``linear_ab_g`` become views of
their halves, so both conventions share one container and gradients reach the fused weights.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Optional
from typing import Union

import torch
from torch import Tensor
from torch.nn import functional as F

from .backends import TriMulBackend
from .backends import import_error
from .backends import parse_backend
from .trimul_blocks import default_chunk_size
from .trimul_blocks import frame_mask
from .trimul_blocks import frame_pair
from .trimul_blocks import row_blocks
from .trimul_blocks import rows

logger = logging.getLogger(__name__)

__all__ = ["TriMulParams", "channel_product", "triangle_finish", "triangle_multiplicative_update", "triangle_operand",
           "triangle_product", "trimul_torch"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclasses.dataclass(frozen=True)
class TriMulParams:
    """The weights of one update (``torch.nn.Linear`` layout ``[out, in]``; a bias ``None`` where the convention has
    none: OpenFold3's projections, gate and output). ``ln_*`` ``[C_z]`` (in) and ``[c]`` (out); ``a_*``/``b_*``
    ``[c, C_z]``; ``out_proj_w`` (``linear_z``) ``[C_z, c]``; ``out_gate_w`` (``linear_g``) ``[C_z, C_z]``."""

    ln_in_weight: Tensor
    ln_in_bias: Tensor
    a_proj_w: Tensor
    a_proj_b: Optional[Tensor]
    a_gate_w: Tensor
    a_gate_b: Optional[Tensor]
    b_proj_w: Tensor
    b_proj_b: Optional[Tensor]
    b_gate_w: Tensor
    b_gate_b: Optional[Tensor]
    ln_out_weight: Tensor
    ln_out_bias: Tensor
    out_proj_w: Tensor
    out_proj_b: Optional[Tensor]
    out_gate_w: Tensor
    out_gate_b: Optional[Tensor]

    @property
    def c_z(self) -> int:
        return self.ln_in_weight.shape[0]

    @property
    def c_hidden(self) -> int:
        return self.ln_out_weight.shape[0]

    def tensors(self) -> tuple[Optional[Tensor], ...]:
        """The fields in declaration order (what :meth:`from_tensors` takes back)."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    @classmethod
    def from_tensors(cls, tensors) -> "TriMulParams":
        return cls(*tensors)

    @classmethod
    def from_module(cls, module) -> "TriMulParams":
        """The weights of a triangle multiplicative update module with OpenFold's attribute names (ds4sci's,
        OpenFold's and OpenFold3's classes): ``layer_norm_in``, ``layer_norm_out``, ``linear_g``, ``linear_z`` and
        either ``linear_a_p``, ``linear_a_g``, ``linear_b_p``, ``linear_b_g`` or the fused ``linear_ab_p``,
        ``linear_ab_g`` (``a`` the first half). The tensors are the parameters themselves (or views of them)."""
        c = module.layer_norm_out.weight.shape[0]
        if hasattr(module, "linear_ab_p"):  # AlphaFold-Multimer: a is the first half of each fused projection
            def halves(lin):
                w, b = lin.weight, lin.bias
                return [(w[i * c:(i + 1) * c], None if b is None else b[i * c:(i + 1) * c]) for i in (0, 1)]

            (a_p, b_p), (a_g, b_g) = halves(module.linear_ab_p), halves(module.linear_ab_g)
        else:
            a_p, a_g, b_p, b_g = ((lin.weight, lin.bias) for lin in (module.linear_a_p, module.linear_a_g,
                                                                     module.linear_b_p, module.linear_b_g))
        return cls(module.layer_norm_in.weight, module.layer_norm_in.bias, *a_p, *a_g, *b_p, *b_g,
                   module.layer_norm_out.weight, module.layer_norm_out.bias, module.linear_z.weight,
                   module.linear_z.bias, module.linear_g.weight, module.linear_g.bias)


# ----------------------------------------------------------------------------------------------------------
# The pieces of the math, shared by both paths
# ----------------------------------------------------------------------------------------------------------


def _layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """LayerNorm over the last dim; fp16/bf16 normalised in fp32 and cast back (as ds4sci's and OpenFold's)."""
    if x.dtype in (torch.float16, torch.bfloat16):
        return F.layer_norm(x.float(), x.shape[-1:], weight.float(), bias.float(), eps).to(x.dtype)
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def _operand(x: Tensor, mask: Tensor, params: TriMulParams, which: str) -> Tensor:
    """``mask * sigmoid(Linear_{which}_g(x)) * Linear_{which}_p(x)``: ``x [*, I, J, C_z]``, ``mask [*, I, J, 1]``
    -> ``[*, I, J, c]``."""
    g = F.linear(x, getattr(params, f"{which}_gate_w"), getattr(params, f"{which}_gate_b"))
    p = F.linear(x, getattr(params, f"{which}_proj_w"), getattr(params, f"{which}_proj_b"))
    return mask * torch.sigmoid(g) * p


def _finish(x: Tensor, p: Tensor, params: TriMulParams, eps: float) -> Tensor:
    """``sigmoid(Linear_g(x)) * Linear_z(LN_out(p))``: ``x [*, I, J, C_z]``, ``p [*, I, J, c]`` -> ``[*, I, J, C_z]``.
    """
    y = F.linear(_layer_norm(p, params.ln_out_weight, params.ln_out_bias, eps), params.out_proj_w, params.out_proj_b)
    return torch.sigmoid(F.linear(x, params.out_gate_w, params.out_gate_b)) * y


def channel_product(a: Tensor, b: Tensor, outgoing: bool) -> Tensor:
    """The triangular product of channel-major operands, ``p [*, c, I, J]``: outgoing ``p_ij = sum_k a_ik b_jk``
    (``a [*, c, I, K]``, ``b [*, c, J, K]``), incoming ``p_ij = sum_k a_ki b_kj`` (``a [*, c, K, I]``, ``b [*, c, K,
    J]``), one batched matmul over the channels. Any block of rows (outgoing ``a``) or columns (incoming ``b``)
    gives that block of ``p``, and a sum over blocks of ``k`` the whole: the chunked path calls it per row block, the
    context-parallel forms per shard (1-D) and per Cannon step on mesh tiles (2-D)."""
    if outgoing:
        return torch.matmul(a, b.transpose(-1, -2))
    return torch.matmul(a.transpose(-1, -2), b)


def triangle_product(a: Tensor, b: Tensor, outgoing: bool) -> Tensor:
    """:func:`channel_product` of operands in the pair layout: ``a, b [*, ., ., c]`` -> ``p [*, I, J, c]``."""
    return channel_product(a.movedim(-1, -3), b.movedim(-1, -3), outgoing).movedim(-3, -1)


def trimul_torch(z: Tensor, mask: Tensor, params: TriMulParams, outgoing: bool, eps: float) -> Tensor:
    """The ``"torch"`` backend: the update as one autograd graph (``z [*, N, N, C_z]``, ``mask [*, N, N]`` in z's
    dtype) -> ``[*, N, N, C_z]``."""
    x = _layer_norm(z, params.ln_in_weight, params.ln_in_bias, eps)
    m = mask.unsqueeze(-1)
    p = triangle_product(_operand(x, m, params, "a"), _operand(x, m, params, "b"), outgoing)
    return _finish(x, p, params, eps)


# ----------------------------------------------------------------------------------------------------------
# The steps, recomputing: what the context-parallel forms call around their product of shards and tiles
# ----------------------------------------------------------------------------------------------------------


class _Recomputed(torch.autograd.Function):
    """``forward(ctx, fn, *inputs) -> fn(*inputs)`` without a graph, saving only ``inputs`` (None allowed); backward
    runs ``fn`` again with autograd on and returns the gradients of the inputs that need one."""

    @staticmethod
    def forward(ctx, fn, *inputs):
        ctx.fn = fn
        ctx.save_for_backward(*inputs)
        return fn(*inputs)

    @staticmethod
    def backward(ctx, grad: Tensor):
        needs = ctx.needs_input_grad[1:]
        leaves = [None if t is None else t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, needs)]
        wrt = [t for t, need in zip(leaves, needs) if need]
        with torch.enable_grad():
            grads = iter(torch.autograd.grad(ctx.fn(*leaves), wrt, grad, allow_unused=True))
        return None, *(next(grads) if need else None for need in needs)


def _operand_of(which: str, eps: float, z: Tensor, mask: Tensor, *tensors) -> Tensor:
    params = TriMulParams.from_tensors(tensors)
    x = _layer_norm(z, params.ln_in_weight, params.ln_in_bias, eps)
    return _operand(x, mask.unsqueeze(-1), params, which).movedim(-1, -3).contiguous()


def _finish_of(eps: float, z: Tensor, p: Tensor, *tensors) -> Tensor:
    params = TriMulParams.from_tensors(tensors)
    return _finish(_layer_norm(z, params.ln_in_weight, params.ln_in_bias, eps), p.movedim(-3, -1), params, eps)


def triangle_operand(z: Tensor, mask: Tensor, params: TriMulParams, which: str, eps: float) -> Tensor:
    """The operand ``which`` (``"a"`` or ``"b"``), ``mask * sigmoid(x W_g + b_g) * (x W_p + b_p)`` with ``x =
    LN_in(z)``, of any block of pairs ``z [*, I, J, C_z]`` (``mask [*, I, J]`` in z's dtype), channel-major and
    contiguous ``[*, c, I, J]`` (what :func:`channel_product` takes). Differentiable in ``z`` and the weights; saves
    only ``z`` and ``mask`` for backward and recomputes the rest there, as the chunked path does."""
    return _Recomputed.apply(functools.partial(_operand_of, which, eps), z, mask, *params.tensors())


def triangle_finish(z: Tensor, p: Tensor, params: TriMulParams, eps: float) -> Tensor:
    """The update ``sigmoid(Linear_g(LN_in(z))) * Linear_z(LN_out(p))`` ``[*, I, J, C_z]`` of any block of pairs ``z
    [*, I, J, C_z]`` from that block's product ``p [*, c, I, J]`` (channel-major, :func:`channel_product`).
    Differentiable in ``z``, ``p`` and the weights; saves only ``z`` and ``p`` for backward and recomputes the
    LayerNorms, the gate and the projection there, as the chunked path does."""
    return _Recomputed.apply(functools.partial(_finish_of, eps), z, p, *params.tensors())


# ----------------------------------------------------------------------------------------------------------
# The chunked path
# ----------------------------------------------------------------------------------------------------------


class _ChunkedTriMul(torch.autograd.Function):
    """``forward(ctx, z [*, N, N, C_z], mask [*, N, N], outgoing, eps, chunk, *params) -> [*, N, N, C_z]``, the
    chunked path (module docstring). In the working frame (``z`` outgoing, ``z^T`` incoming) ``p_ij = sum_k r_ik
    f_jk``: ``r`` (the row operand: ``a`` outgoing, ``b^T`` incoming) one row block at a time, ``f`` (``b``, ``a^T``)
    whole, channel-major ``[*, c, N, N]`` so that each block's product is one batched matmul without a copy of ``f``.
    The mask gets no gradient."""

    @staticmethod
    def forward(ctx, z: Tensor, mask: Tensor, outgoing: bool, eps: float, chunk: int, *tensors) -> Tensor:
        out, p = _chunked_forward(z, mask, TriMulParams.from_tensors(tensors), outgoing, eps, chunk, keep_p=True)
        ctx.save_for_backward(z, mask, p)
        ctx.outgoing, ctx.eps, ctx.chunk, ctx.params = outgoing, eps, chunk, tensors
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        z, mask, p_all = ctx.saved_tensors
        outgoing, eps, chunk = ctx.outgoing, ctx.eps, ctx.chunk
        r_name, f_name = ("a", "b") if outgoing else ("b", "a")
        needs = ctx.needs_input_grad[5:]
        leaves = [None if t is None else t.detach().requires_grad_(need) for t, need in zip(ctx.params, needs)]
        params = TriMulParams.from_tensors(leaves)
        wrt = [t for t, need in zip(leaves, needs) if need]
        sums: list[Optional[Tensor]] = [None] * len(wrt)
        need_z = ctx.needs_input_grad[0]
        zf, mf, gf = frame_pair(z, outgoing), frame_mask(mask, outgoing), frame_pair(grad_out, outgoing)
        n = z.shape[-2]
        with torch.no_grad():
            f = _full_operand(zf, mf, params, f_name, eps, chunk)  # [*, c, N_j, N_k]
        df = torch.zeros_like(f)
        grad_z = torch.empty_like(z) if need_z else None
        dzf = frame_pair(grad_z, outgoing) if need_z else None

        def accumulate(grads, rows_of_z):
            if need_z:
                rows_of_z += grads[0]
            for i, g in enumerate(grads[int(need_z):]):
                if g is None:  # a weight of the other operand's projections
                    continue
                sums[i] = g.to(torch.promote_types(g.dtype, torch.float32)) if sums[i] is None else sums[i] + g

        for start in range(0, n, chunk):  # the row operand, the product's block and the output
            stop = min(start + chunk, n)
            z_rows = rows(zf, start, stop).detach().requires_grad_(need_z)
            p = p_all[..., start:stop, :].detach().requires_grad_()  # [*, c, R, N_j]
            with torch.enable_grad():
                x = _layer_norm(z_rows, params.ln_in_weight, params.ln_in_bias, eps)
                r = _operand(x, rows(mf, start, stop, False).unsqueeze(-1), params, r_name).movedim(-1, -3)
                out = _finish(x, p.movedim(-3, -1), params, eps)
            g_rows = rows(gf, start, stop)
            (dp,) = torch.autograd.grad(out, [p], g_rows, retain_graph=True)  # [*, c, R, N_j]
            dr = torch.matmul(dp, f)  # [*, c, R, N_k]: dr_ik = sum_j dp_ij f_jk
            # df_jk += sum_i dp_ij r_ik, in place: [*c, N_j, N_k] += [*c, N_j, R] @ [*c, R, N_k]
            df.view(-1, n, n).baddbmm_(dp.transpose(-1, -2).reshape(-1, n, stop - start),
                                       r.detach().reshape(-1, stop - start, n))
            if need_z:
                rows(dzf, start, stop).zero_()
            accumulate(torch.autograd.grad([out, r], [z_rows][:int(need_z)] + wrt, [g_rows, dr], allow_unused=True),
                       rows(dzf, start, stop) if need_z else None)
        for start in range(0, n, chunk):  # the full operand's projections
            stop = min(start + chunk, n)
            z_rows = rows(zf, start, stop).detach().requires_grad_(need_z)
            with torch.enable_grad():
                x = _layer_norm(z_rows, params.ln_in_weight, params.ln_in_bias, eps)
                f_rows = _operand(x, rows(mf, start, stop, False).unsqueeze(-1), params, f_name).movedim(-1, -3)
            inputs = [z_rows][:int(need_z)] + wrt
            if inputs:
                accumulate(torch.autograd.grad(f_rows, inputs, df[..., start:stop, :], allow_unused=True),
                           rows(dzf, start, stop) if need_z else None)
        summed = iter(sums)
        grads = [next(summed).to(t.dtype) if need else None for t, need in zip(ctx.params, needs)]
        return grad_z, None, None, None, None, *grads


def _chunked_forward(z: Tensor, mask: Tensor, params: TriMulParams, outgoing: bool, eps: float, chunk: int,
                     keep_p: bool) -> tuple[Tensor, Optional[Tensor]]:
    """The chunked forward without autograd (:func:`~ds4sci.kernels.trimul_blocks.row_blocks` with PyTorch steps):
    the update ``[*, N, N, C_z]`` and, if ``keep_p``, the product of the working frame, channel-major ``[*, c, N_i,
    N_j]`` (what backward needs); :class:`_ChunkedTriMul`. Training (``keep_p``) slices the full ``f``, built once
    (backward needs it whole anyway); inference recomputes each block of ``f`` from ``z`` for every row block, so
    that no more than one block of either operand is ever live. That repeats ``f``'s LayerNorm and projections
    ``N/R`` times (``R`` rows per block): ``N/R * 4 N^2 C_z c`` flops, or ``2 (N/R) C_z / N`` times the product's
    ``2 N^3 c``."""
    n = z.shape[-2]
    full = (_full_operand(frame_pair(z, outgoing), frame_mask(mask, outgoing), params, "b" if outgoing else "a", eps,
                          chunk) if keep_p else None)  # [*, c, N_j, N_k]
    p_all = z.new_empty((*z.shape[:-3], params.c_hidden, n, n)) if keep_p else None  # [*, c, N_i, N_j]

    def product(r: Tensor, f_rows: Tensor, out: Tensor) -> None:
        out.copy_(channel_product(r, f_rows, True))

    def finish(z_rows: Tensor, p: Tensor) -> Tensor:
        x = _layer_norm(z_rows, params.ln_in_weight, params.ln_in_bias, eps)  # [*, R, N, C_z]
        return _finish(x, p.movedim(-3, -1), params, eps)

    out = row_blocks(z, mask, outgoing, chunk, functools.partial(_block_operand, params, eps), product, finish,
                     full, p_all)
    return out, p_all


def _block_operand(params: TriMulParams, eps: float, z_rows: Tensor, mask_rows: Tensor, which: str) -> Tensor:
    """The operand ``which`` of rows ``z_rows [*, R, N, C_z]`` (``mask_rows [*, R, N]``), channel-major ``[*, c, R,
    N]`` (a view of the pair layout's ``[*, R, N, c]``), without autograd."""
    x = _layer_norm(z_rows, params.ln_in_weight, params.ln_in_bias, eps)
    return _operand(x, mask_rows.unsqueeze(-1), params, which).movedim(-1, -3)


def _full_operand(zf: Tensor, mf: Tensor, params: TriMulParams, which: str, eps: float, chunk: int) -> Tensor:
    """The operand ``which`` of every row of the frame, channel-major ``[*, c, N, N]``, built one row block at a
    time (no autograd: callers run it under ``no_grad`` or inside the forward of the autograd.Function)."""
    n = zf.shape[-2]
    f = zf.new_empty((*zf.shape[:-3], params.c_hidden, n, n))
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        f[..., start:stop, :] = _block_operand(params, eps, rows(zf, start, stop), rows(mf, start, stop, False),
                                               which)
    return f


# ----------------------------------------------------------------------------------------------------------
# Validation and the public function
# ----------------------------------------------------------------------------------------------------------


def _check(z: Tensor, mask: Optional[Tensor], params: TriMulParams, eps: float, chunk_size: Optional[int]) -> Tensor:
    """``mask`` expanded to ``z.shape[:-1]`` in z's dtype (ones when None); raises on bad inputs."""
    name = "triangle_multiplicative_update"
    if not isinstance(z, Tensor):
        raise TypeError(f"{name}: z must be a torch.Tensor, got {type(z).__name__}")
    if z.ndim < 3 or z.shape[-2] != z.shape[-3]:
        raise ValueError(f"{name}: z must have shape [*, N, N, C_z] (square in its last two dims but one), got "
                         f"{tuple(z.shape)}")
    if z.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name}: z must be float16, bfloat16, float32 or float64, got {z.dtype}")
    if not isinstance(params, TriMulParams):
        raise TypeError(f"{name}: params must be a TriMulParams, got {type(params).__name__}")
    if z.shape[-1] != params.c_z:
        raise ValueError(f"{name}: z has {z.shape[-1]} channels but the weights expect C_z = {params.c_z}")
    if not (isinstance(eps, float) and eps > 0):
        raise ValueError(f"{name}: eps must be a positive float, got {eps!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"{name}: chunk_size must be a positive int or None, got {chunk_size!r}")
    if mask is None:
        return z.new_ones(z.shape[:-1])
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name}: mask must be a torch.Tensor or None, got {type(mask).__name__}")
    try:
        return mask.to(z.dtype).expand(z.shape[:-1])
    except RuntimeError:
        raise ValueError(f"{name}: mask of shape {tuple(mask.shape)} does not broadcast to [*, N_i, N_j] = "
                         f"{tuple(z.shape[:-1])}") from None


def _triton_module():
    from . import triton_trimul  # imports Triton: only when a CUDA tensor or backend="triton" asks for it

    return triton_trimul


def _triton_max_channels() -> int:
    from .triton_trimul_tiles import MAX_CHANNELS  # imports Triton (its helpers): only once it is known to import

    return MAX_CHANNELS


@functools.lru_cache(maxsize=None)
def _triton_import_error() -> str:
    return import_error(_triton_module, logger, "triangle_multiplicative_update: the triton backend",
                        "auto uses the chunked backend")


def _choose_backend(backend: Union[str, TriMulBackend], z: Tensor, params: TriMulParams) -> TriMulBackend:
    """Parse ``backend``; ``"auto"``: triton for CUDA tensors of a dtype and channel counts its kernels take (when
    Triton imports), chunked otherwise."""
    chosen = parse_backend(backend, TriMulBackend)
    if chosen is TriMulBackend.AUTO:
        use_triton = (z.is_cuda and not _triton_import_error()
                      and max(params.c_z, params.c_hidden) <= _triton_max_channels())
        return TriMulBackend.TRITON if use_triton else TriMulBackend.CHUNKED
    if chosen is TriMulBackend.TRITON:
        if not z.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"triangle_multiplicative_update: the triton backend needs CUDA tensors (or "
                             f"TRITON_INTERPRET=1 on the CPU), got z on {z.device}")
        error = _triton_import_error()
        if error:
            raise RuntimeError(f"triangle_multiplicative_update: the triton backend is unavailable: {error}")
    return chosen


def triangle_multiplicative_update(z: Tensor, mask: Optional[Tensor], params: TriMulParams, *, outgoing: bool,
                                   eps: float = 1e-5, backend: Union[str, TriMulBackend] = TriMulBackend.AUTO,
                                   chunk_size: Optional[int] = None) -> Tensor:
    """The update (not yet added to ``z``) of the pair representation ``z [*, N_i, N_j, C_z]`` (``N_i == N_j``), mask
    ``mask [*, N_i, N_j]`` (broadcastable; None: all ones; 0 drops a pair from both operands; it gets no gradient),
    weights ``params``; ``outgoing``: Algorithm 11 (True) or 12 (False); ``eps`` of both LayerNorms. Returns
    ``[*, N_i, N_j, C_z]`` in z's dtype; differentiable in ``z`` and every weight.

    ``backend``: ``"auto"``, ``"triton"``, ``"chunked"`` or ``"torch"`` (module docstring; ``"triton"`` takes
    every float dtype with up to 128 channels); ``chunk_size``: rows per block of the chunked
    path (None: :func:`~ds4sci.kernels.trimul_blocks.default_chunk_size`) and of the Triton path's inference (None:
    an eighth of the rows), ignored by the torch path.

    Raises:
        TypeError: z, mask or params of the wrong type, or z not a floating dtype.
        ValueError: z not ``[*, N, N, C_z]``, C_z not the weights', a mask that does not broadcast, a non-positive
            eps or chunk_size, an unknown backend, ``"triton"`` off CUDA (outside the interpreter) or beyond its
            channel counts.
        RuntimeError: ``"triton"`` when Triton does not import.
    """
    mask = _check(z, mask, params, eps, chunk_size)
    backend = _choose_backend(backend, z, params)
    if backend is TriMulBackend.TORCH:
        return trimul_torch(z, mask, params, bool(outgoing), eps)
    if backend is TriMulBackend.TRITON:
        return _triton_module().trimul_triton(z, mask, params, bool(outgoing), eps, chunk_size)
    chunk = min(chunk_size or default_chunk_size(z, params.c_hidden), z.shape[-2])
    tensors = params.tensors()
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (z, *tensors)):
        return _ChunkedTriMul.apply(z, mask, bool(outgoing), eps, chunk, *tensors)
    with torch.no_grad():  # inference: no product kept
        return _chunked_forward(z, mask, params, bool(outgoing), eps, chunk, keep_p=False)[0]
