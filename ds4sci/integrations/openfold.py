"""Route OpenFold's DeepSpeed Evoformer-attention path to ds4sci's kernels.

OpenFold3 (``openfold3`` on PyPI) and OpenFold (aqlaboratory/openfold, the AlphaFold2 reproduction) both
implement ``use_deepspeed_evo_attention=True`` in ``Attention.forward`` by calling a module-level function
``_deepspeed_evo_attn(q, k, v, biases)`` (``openfold3.core.model.primitives.attention`` and
``openfold.model.primitives``), with q, k, v ``[*, H, Q, C_hidden]`` (unscaled) and biases broadcasting to
``[*, H, Q, K]``. That function refuses to run unless ``deepspeed.ops.deepspeed4science`` is importable,
casts fp32 inputs to bf16, and calls DeepSpeed's CUTLASS kernel (JIT-built on first use).

:func:`enable` replaces that module attribute with an :class:`EvoAttentionAdapter`, which calls
``ds4sci.kernels.evoformer_attention`` in the caller's dtype (fp32 stays fp32) and needs neither DeepSpeed nor
CUTLASS. ``Attention.forward`` itself is untouched, so OpenFold's own decisions stay in force: its fallback to
the plain PyTorch path for short sequences (``q_x.shape[-2] <= 16``), the at-most-two-biases check, the
unscaled queries on this path, the choice between LMA / cuEquivariance / DeepSpeed. :func:`disable` puts the
original function objects back (the very same objects); :func:`enabled` is the context-manager form::

    from ds4sci.integrations import openfold as ds4sci_openfold

    ds4sci_openfold.enable()                # every use_deepspeed_evo_attention=True now runs ds4sci
    with ds4sci_openfold.enabled(backend="torch"):
        ...
    ds4sci_openfold.disable()

Patching is process-global (it edits the OpenFold modules); the record of what was replaced lives here.

:func:`context_parallel` is the same kind of switch for axial context parallelism (issue #29): every OpenFold3
``EvoformerStack`` and ``PairFormerStack`` in a model runs its blocks as ds4sci blocks across a process group
(:mod:`ds4sci.parallel.evoformer`), on the OpenFold3 parameters themselves; :func:`context_parallel_off` undoes
it. Unlike :func:`enable` it edits the given model's stacks only (their ``forward``), not OpenFold3's modules::

    ds4sci_openfold.context_parallel(model, group)     # every rank: the same inputs, the same outputs and .grad
    ds4sci_openfold.context_parallel_off(model)

:func:`triangle_updates` replaces the ``forward`` of OpenFold3's ``TriangleMultiplicativeUpdate`` and
``FusedTriangleMultiplicativeUpdate`` classes (so every ``TriangleMultiplicationOutgoing`` / ``Incoming`` and their
fused forms, in every model) with one that runs :func:`ds4sci.kernels.triangle_multiplicative_update` on the
module's own parameters: the plain path and the in-place inference path (``inplace_safe=True``, z overwritten with
``z + update``, or ``update``, as OpenFold3's ``_inference_forward`` does); a call that asks for
``use_cueq_triangle_kernels`` or ``use_triton_triangle_kernels`` still runs OpenFold3's own. It is process-global, like
:func:`enable`; :func:`triangle_updates_off` puts the original methods back.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
from collections.abc import Iterator
from collections.abc import Sequence
from types import ModuleType
from typing import Any
from typing import Optional
from typing import Union

import torch
from torch import Tensor
from torch import nn

from ds4sci.kernels import EvoformerBackend
from ds4sci.kernels import TriMulBackend
from ds4sci.kernels import TriMulParams
from ds4sci.kernels import evoformer_attention
from ds4sci.kernels import parse_backend
from ds4sci.kernels import triangle_multiplicative_update

logger = logging.getLogger(__name__)

#: package -> (module, attribute) of each OpenFold code base's DeepSpeed Evoformer-attention function.
TARGETS: dict[str, tuple[str, str]] = {
    "openfold3": ("openfold3.core.model.primitives.attention", "_deepspeed_evo_attn"),
    "openfold": ("openfold.model.primitives", "_deepspeed_evo_attn"),
}


class EvoAttentionAdapter:
    """Stands in for OpenFold's ``_deepspeed_evo_attn(q, k, v, biases)``: same inputs, same output.

    q, k, v ``[*, H, Q, C_hidden]`` (queries not yet scaled; the kernel scales by ``1/sqrt(C_hidden)``),
    ``biases`` at most two tensors broadcasting to ``[*, H, Q, K]``; returns ``[*, Q, H, C_hidden]`` in q's dtype
    (what OpenFold's function returns, before ``Attention._wrap_up``).
    """

    def __init__(self, backend: Union[str, EvoformerBackend] = EvoformerBackend.AUTO, original: Any = None):
        self.backend = parse_backend(backend, EvoformerBackend)
        self.original = original  # the function this adapter replaced, for reference only

    def __repr__(self) -> str:
        return f"EvoAttentionAdapter(backend={self.backend.value!r})"

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, biases: Sequence[Optional[Tensor]]) -> Tensor:
        biases = [b for b in (biases or []) if b is not None]
        if len(biases) > 2:
            raise ValueError(f"Evoformer attention takes at most two biases, got {len(biases)}")
        # [*, H, Q, C] -> [*, Q, H, C]: DeepSpeed4Science's [*, N, S, H, D] with the last batch dim as N
        q, k, v = (t.transpose(-2, -3) for t in (q, k, v))
        out_shape = q.shape
        q, k, v, biases = _ds_layout(q, k, v, biases)
        o = evoformer_attention(q, k, v, biases, backend=self.backend)  # [*, N, Q, H, C]
        return o.reshape(out_shape)  # [*, Q, H, C]


def _is_mask_like(bias: Tensor) -> bool:
    """A bias constant over heads and queries (``[*, 1, 1, K]`` in the ``[*, H, Q, K]`` frame): a key mask."""
    return bias.ndim < 3 or (bias.shape[-3] == 1 and bias.shape[-2] == 1)


def _ds_layout(q: Tensor, k: Tensor, v: Tensor, biases: list[Tensor]) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """Views of q, k, v ``[*, Q, H, C]`` and of the biases (frame ``[*, H, Q, K]``) in the kernel's layout.

    The bias frame ``[*', N, H, Q, K]`` IS the kernel's layout: a mask bias ``[*', N|1, 1, 1, K]`` and a pair bias
    ``[*', 1, H, Q, K]``. Two cases need more than views of the inputs:

    - a bias that varies over heads or queries AND over the last batch dim N (OpenFold's ``chunk_layer`` expands
      the pair bias over the flattened batch, giving ``[chunk, H, Q, K]`` with q ``[chunk, Q, H, C]``): a unit N
      axis is inserted so that every entry of the last batch dim becomes its own batch element;
    - two biases of the same kind (never produced by OpenFold's layers): they are summed.

    q, k, v get leading unit dims up to rank 5; biases broadcast over H, Q or K are expanded (stride 0).
    """
    h, s = q.shape[-2], q.shape[-3]
    biases = [b.reshape((1,) * (q.ndim - b.ndim) + tuple(b.shape)) if b.ndim < q.ndim else b for b in biases]
    if len(biases) == 2 and _is_mask_like(biases[0]) == _is_mask_like(biases[1]):
        biases = [biases[0] + biases[1]]
    if any(not _is_mask_like(b) and b.ndim >= 4 and b.shape[-4] != 1 for b in biases):
        q, k, v = (t.unsqueeze(-4) for t in (q, k, v))  # [*, Q, H, C] -> [*, 1, Q, H, C]
        biases = [b.unsqueeze(-4) for b in biases]  # [*, H, Q, K] -> [*, 1, H, Q, K]
    while q.ndim < 5:
        q, k, v = (t.unsqueeze(0) for t in (q, k, v))
    out = []
    for b in biases:
        b = b.reshape((1,) * (q.ndim - b.ndim) + tuple(b.shape))  # leading unit dims up to q's rank
        if _is_mask_like(b):
            out.append(b.expand(*b.shape[:-1], s))  # [*, N|1, 1, 1, K]
        else:
            out.append(b.expand(*b.shape[:-3], h, s, s))  # [*, 1, H, Q, K]
    return q, k, v, out


# ----------------------------------------------------------------------------------------------------------
# enable / disable
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Patch:
    module: ModuleType
    attr: str
    original: Any


# package name -> what enable() replaced there; empty when disabled
_patches: dict[str, _Patch] = {}


def _import_target(package: str) -> Optional[ModuleType]:
    module_name, attr = TARGETS[package]
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        if package == "openfold3":
            logger.info("ds4sci.integrations.openfold: %s is not importable (%s)", module_name, err)
        else:
            logger.debug("ds4sci.integrations.openfold: %s is not importable (%s)", module_name, err)
        return None
    if not hasattr(module, attr):
        logger.warning(
            "ds4sci.integrations.openfold: %s has no %s (an unsupported %s version); left alone",
            module_name, attr, package,
        )
        return None
    return module


def enable(backend: Union[str, EvoformerBackend] = EvoformerBackend.AUTO) -> list[str]:
    """Route ``use_deepspeed_evo_attention=True`` of OpenFold3 and OpenFold (whichever import) to ds4sci.

    Calling it again changes the backend; the functions recorded as original stay those found before the
    first call. Returns the packages patched.

    Raises:
        ImportError: neither ``openfold3`` nor ``openfold`` could be patched.
        ValueError: an unknown backend.
    """
    backend = parse_backend(backend, EvoformerBackend)  # validated before anything is touched
    patched = []
    for package, (_, attr) in TARGETS.items():
        module = _import_target(package)
        if module is None:
            continue
        record = _patches.get(package)
        original = record.original if record is not None else getattr(module, attr)
        setattr(module, attr, EvoAttentionAdapter(backend, original=original))
        _patches[package] = _Patch(module, attr, original)
        patched.append(package)
    if not patched:
        raise ImportError(
            "ds4sci.integrations.openfold.enable: neither openfold3 (pip install openfold3) nor openfold "
            "(aqlaboratory/openfold) is importable"
        )
    logger.info("ds4sci.integrations.openfold: %s use ds4sci Evoformer attention (backend=%s)",
                ", ".join(patched), backend.value)
    return patched


def disable() -> None:
    """Put back exactly the functions :func:`enable` replaced; a no-op when not enabled."""
    while _patches:
        package, record = _patches.popitem()
        setattr(record.module, record.attr, record.original)
        logger.info("ds4sci.integrations.openfold: %s restored", package)


def is_enabled() -> bool:
    return bool(_patches)


@contextlib.contextmanager
def enabled(backend: Union[str, EvoformerBackend] = EvoformerBackend.AUTO) -> Iterator[list[str]]:
    """Context manager form of :func:`enable`; on exit the state before entering is restored exactly
    (the same function objects, whether or not ds4sci was already enabled)."""
    saved_patches = dict(_patches)
    saved_attrs = {package: getattr(p.module, p.attr) for package, p in saved_patches.items()}
    try:
        yield enable(backend)
    finally:
        for package, record in list(_patches.items()):
            if package in saved_patches:
                setattr(record.module, record.attr, saved_attrs[package])
            else:
                setattr(record.module, record.attr, record.original)
        _patches.clear()
        _patches.update(saved_patches)


# ----------------------------------------------------------------------------------------------------------
# context parallelism of OpenFold3's Evoformer and Pairformer stacks
# ----------------------------------------------------------------------------------------------------------


def _is_swiglu(transition: nn.Module) -> bool:
    return type(transition).__name__.startswith("SwiGLU")


def _block_args(block: nn.Module) -> tuple[type, dict[str, Any]]:
    """The ds4sci block class and constructor arguments of an OpenFold3 ``EvoformerBlock`` or ``PairFormerBlock``,
    read from its sub-modules' attributes (OpenFold3 keeps no constructor record)."""
    from ds4sci.models.evoformer import EvoformerBlock
    from ds4sci.models.evoformer import PairformerBlock

    ps = block.pair_stack
    pair = dict(c_hidden_mul=ps.tri_mul_out.c_hidden, c_hidden_pair_att=ps.tri_att_start.c_hidden,
                no_heads_pair=ps.tri_att_start.no_heads, pair_dropout=ps.ps_dropout_row_layer.r,
                fuse_projection_weights=type(ps.tri_mul_out).__name__.startswith("Fused"),
                transition_type="swiglu" if _is_swiglu(ps.pair_transition) else "relu")
    if type(block).__name__ == "PairFormerBlock":
        apb = block.attn_pair_bias
        return PairformerBlock, dict(c_s=apb.c_s, c_z=apb.c_z, c_hidden_pair_bias=apb.mha.c_hidden,
                                     no_heads_pair_bias=apb.mha.no_heads, transition_n=block.single_transition.n,
                                     inf=apb.inf, **pair)
    row = block.msa_att_row
    return EvoformerBlock, dict(c_m=row.c_in, c_z=row.c_z, c_hidden_msa_att=row.c_hidden,
                                c_hidden_opm=block.outer_product_mean.c_hidden, no_heads_msa=row.no_heads,
                                transition_n=block.msa_transition.n, msa_dropout=block.msa_dropout_layer.r,
                                no_column_attention=block.no_column_attention, opm_first=block.opm_first, inf=row.inf,
                                **pair)


def _sharing_block(block: nn.Module, backend: EvoformerBackend) -> nn.Module:
    """A ds4sci block holding ``block``'s parameters themselves (its state dict's names and shapes, strictly)."""
    cls, kwargs = _block_args(block)
    with torch.device("meta"):
        ours = cls(**kwargs, backend=backend)
    theirs = dict(block.named_parameters())
    mine = {name: p.shape for name, p in ours.named_parameters()}
    if {k: v.shape for k, v in theirs.items()} != mine or set(block.state_dict()) != set(ours.state_dict()):
        raise ValueError(f"context_parallel: OpenFold3 {type(block).__name__}'s parameters are not those of ds4sci's "
                         f"{cls.__name__}({kwargs})")
    for name, param in theirs.items():
        owner, _, leaf = name.rpartition(".")
        setattr(ours.get_submodule(owner), leaf, param)  # the very Parameter: no copy
    return ours


def context_parallel(model: nn.Module, group=None, mesh: Optional[tuple[int, int]] = None, *, sharded: bool = True,
                     backend: Union[str, EvoformerBackend] = EvoformerBackend.AUTO) -> list[str]:
    """Run every OpenFold3 ``EvoformerStack`` and ``PairFormerStack`` in ``model`` (``model`` itself included) by
    context parallelism over ``group`` (default: the default process group), axial or, with ``mesh=(p, p)``, by 2-D
    tiles on a p x p mesh of the group's ranks: the stack's ``forward`` runs its blocks as ds4sci blocks sharing its
    parameters, through :func:`ds4sci.evoformer_context_parallel` (``sharded``: m and z stay split or tiled between
    the blocks), then its own wrap-up (the Evoformer's single projection). Every rank passes the same inputs and gets
    the single process's outputs; parameter gradients are reduced over the group.

    OpenFold3's per-call options are ignored except ``chunk_size`` (attention runs on ds4sci's kernels with
    ``backend``; no activation checkpointing of blocks); ``_mask_trans=False`` is refused (ds4sci masks the
    transitions). Dropout draws per-rank masks: single-process equality in training needs dropout rate 0.
    Returns the names of the stacks switched.

    Raises:
        ImportError: openfold3 is not importable.
        ValueError: no stack in ``model``, or a block whose parameters ds4sci's block does not hold.
    """
    from openfold3.core.model.latent.evoformer import EvoformerStack
    from openfold3.core.model.latent.pairformer import PairFormerStack

    from ds4sci.parallel.evoformer import evoformer_context_parallel

    backend = parse_backend(backend, EvoformerBackend)
    switched = []
    for name, stack in model.named_modules():
        if not isinstance(stack, (EvoformerStack, PairFormerStack)):
            continue
        blocks = nn.ModuleList(_sharing_block(b, backend) for b in stack.blocks)
        parallel = evoformer_context_parallel(blocks, group, mesh, sharded=sharded)
        stack.forward = _stack_forward(stack, parallel)  # an instance attribute: context_parallel_off deletes it
        switched.append(name or type(stack).__name__)
    if not switched:
        raise ValueError(f"context_parallel: no OpenFold3 EvoformerStack or PairFormerStack in {type(model).__name__}")
    logger.info("ds4sci.integrations.openfold: %s run by %s context parallelism", ", ".join(switched),
                "axial" if mesh is None else f"{mesh[0]}x{mesh[1]} mesh")
    return switched


def _stack_forward(stack: nn.Module, parallel: nn.Module):
    """``stack``'s forward through ``parallel`` (OpenFold3's call signature; m/s, z, their masks first)."""

    def forward(x: Tensor, z: Tensor, x_mask: Tensor, pair_mask: Tensor, chunk_size: Optional[int] = None,
                *args: Any, _mask_trans: bool = True, **kwargs: Any):
        if not _mask_trans:
            raise ValueError("context_parallel: _mask_trans=False is not supported (ds4sci masks the transitions)")
        parallel.train(stack.training)  # the ds4sci blocks are not sub-modules of the model: follow its mode
        x, z = parallel(x, z, x_mask, pair_mask, chunk_size)
        return stack._wrap_up(x, z) if hasattr(stack, "_wrap_up") else (x, z)

    forward.context_parallel = parallel  # what context_parallel_off recognises
    return forward


def context_parallel_off(model: nn.Module) -> list[str]:
    """Put back the OpenFold3 forward of every stack :func:`context_parallel` switched in ``model``; returns their
    names."""
    restored = []
    for name, stack in model.named_modules():
        if hasattr(stack.__dict__.get("forward"), "context_parallel"):
            del stack.forward
            restored.append(name or type(stack).__name__)
    return restored


# ----------------------------------------------------------------------------------------------------------
# OpenFold3's triangle multiplicative updates
# ----------------------------------------------------------------------------------------------------------

#: module and classes of OpenFold3 whose ``forward`` :func:`triangle_updates` replaces
TRIMUL_TARGET = ("openfold3.core.model.layers.triangular_multiplicative_update",
                 ("TriangleMultiplicativeUpdate", "FusedTriangleMultiplicativeUpdate"))
_trimul_originals: dict[type, Any] = {}  # class -> its own forward, while replaced


def _trimul_forward(original, backend: TriMulBackend):
    """OpenFold3's ``forward(z, mask, inplace_safe, use_cueq_triangle_kernels, use_triton_triangle_kernels,
    _add_with_inplace, _inplace_chunk_size)`` on ds4sci's kernel (module docstring)."""

    def forward(self, z: Tensor, mask: Optional[Tensor] = None, inplace_safe: bool = False,
                use_cueq_triangle_kernels: bool = False, use_triton_triangle_kernels: bool = False,
                _add_with_inplace: bool = False, _inplace_chunk_size: Optional[int] = 256) -> Tensor:
        if use_cueq_triangle_kernels or use_triton_triangle_kernels:
            return original(self, z, mask, inplace_safe, use_cueq_triangle_kernels, use_triton_triangle_kernels,
                            _add_with_inplace, _inplace_chunk_size)
        update = triangle_multiplicative_update(z, mask, TriMulParams.from_module(self), outgoing=self._outgoing,
                                                eps=self.layer_norm_in.eps, backend=backend)
        if inplace_safe:  # OpenFold3's in-place inference contract: z overwritten, returned
            return z.add_(update) if _add_with_inplace else z.copy_(update)
        return update

    forward.ds4sci_backend = backend
    return forward


def triangle_updates(backend: Union[str, TriMulBackend] = TriMulBackend.AUTO) -> list[str]:
    """Run OpenFold3's triangle multiplicative updates on ds4sci's kernel (module docstring); calling it again
    changes the backend. Returns the classes patched.

    Raises:
        ImportError: openfold3 is not importable.
        ValueError: an unknown backend.
    """
    backend = parse_backend(backend, TriMulBackend)
    module_name, class_names = TRIMUL_TARGET
    module = importlib.import_module(module_name)
    for name in class_names:
        cls = getattr(module, name)
        original = _trimul_originals.setdefault(cls, cls.forward)
        cls.forward = _trimul_forward(original, backend)
    logger.info("ds4sci.integrations.openfold: OpenFold3's %s use ds4sci's triangle update (backend=%s)",
                ", ".join(class_names), backend.value)
    return list(class_names)


def triangle_updates_off() -> None:
    """Put back the ``forward`` methods :func:`triangle_updates` replaced; a no-op when not switched."""
    while _trimul_originals:
        cls, original = _trimul_originals.popitem()
        cls.forward = original


__all__ = ["EvoAttentionAdapter", "TARGETS", "TRIMUL_TARGET", "context_parallel", "context_parallel_off", "disable",
           "enable", "enabled", "is_enabled", "triangle_updates", "triangle_updates_off"]
