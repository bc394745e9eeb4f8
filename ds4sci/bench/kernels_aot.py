"""``ds4sci bench kernels-aot``: compile the shipped Triton kernels (Evoformer, local attention) for sm_80 and sm_90,
without a GPU.

For every configuration the tile table of :mod:`ds4sci.kernels.triton_evoformer` can return (each dtype x
``BLOCK_D`` bucket) and every kernel variant the launchers can request (forward and the four backward kernels, each
with its ``HAS_MASK`` / ``HAS_PAIR`` / ``MASK_GRAD`` flags), it runs

    triton.compile(ASTSource(fn=kernel, signature=..., constexprs=..., attrs=...), target=GPUTarget("cuda", cc, 32))

and records the dynamic shared memory Triton requests (``compiled.metadata.shared``) and the registers per thread,
stack frame and spill bytes that ``ptxas -v`` reports for the very compile that produced the cubin: Triton always
runs ptxas with ``-v`` and prints its log under ``TRITON_DUMP_PTXAS_LOG=1``, which the workers set (with
``TRITON_ALWAYS_COMPILE=1``, so a cache hit never skips ptxas). So the figures come from the ptxas and flags Triton
itself uses for each target (the wheel's ``ptxas`` for sm_80, its ``ptxas-blackwell`` for sm_90a, with Triton's
``--regAllocOptLevel=2``), i.e. what a launch on that GPU would load.

The sets of launches (``--set``; ``all``: shipped, callers and local):

- ``shipped``: every (dtype, ``BLOCK_D``, kernel, flags) the tile table and the launchers can produce, each for one
  representative launch on contiguous inputs (Z = 1, N = 2, S = 256, H = 8, D = ``BLOCK_D``, biases in q's dtype):
  the shared-memory and spill gate of the tile table.
- ``callers``: the launches OpenFold and OpenFold3 make (:data:`CALLERS`). Triton specialises every integer argument
  on ``== 1`` (a compile-time constant) and on divisibility by 16, every pointer on its dtype and 16-byte alignment,
  so D = 8 or 24, S not a multiple of 16, N = 1, the pair bias as OpenFold's permuted view of ``z [*, S, S, H]``
  (non-unit last stride) and an fp32 mask bias beside bf16 q are each different compiled code from the
  representative launch. Launches that specialise identically are compiled once.
- ``local``: the local-attention kernels of :mod:`ds4sci.kernels.triton_local_attention` (forward, dQ, dK/dV) for
  every entry of its tile table (bf16 and fp32 x ``BLOCK_D`` 16/32/64/128; fp16 shares bf16's tiles and compiled to
  the same registers and shared memory in all 96 of its variants), each with its ``HAS_DOCS`` / ``HAS_ALIBI`` flags
  all off and all on (flag-off variants were seen to spill alone: their loops are software-pipelined, the document
  branch stops that), at one representative causal GQA launch (B = 1, S = 256, H = 8, Hkv = 2, D = ``BLOCK_D``):
  96 compilations. ``local-full``: every dtype and flag combination (288 compilations). The kernels do not
  specialise the integers that change from ring block to ring block (offsets, band), so one launch stands for all.

Launch arguments are never listed here. For each call, small CPU tensors with the caller's shapes, strides and dtypes
go through the public path (``evoformer_attention``, OpenFold's adapter for OpenFold's calls, ``triton_attention``
for the local-attention kernels) forward and backward
with every Triton launch recorded instead of run (:func:`record_launches`); the recorded (kernel, arguments, keywords)
then pass through Triton's own argument specialisation (``native_specialize_impl``, what ``JITFunction.run`` calls,
honouring each parameter's ``do_not_specialize``).
So the signatures follow whatever the launchers pass (new arguments, a max and a sum saved instead of a log-sum-exp).

Every compiled kernel's PTX is also checked for the exponent property of issue #12 (:func:`unsafe_exponents`): each
``ex2.approx`` must take a scaled difference ``(s - m) * log2 e``, never a fused multiply-add ``fma(s, log2 e, -b)``
whose addend is a separately scaled maximum (the GPU contracts ``s*LOG2E - m*LOG2E`` into that form, and for
m near -1e9 the rounding error of ``m*LOG2E``, up to 64, becomes the exponent; the interpreter never shows it).

Compilation runs in worker processes started with ``TRITON_INTERPRET`` removed from their environment (under the
interpreter ``@triton.jit`` returns interpreted functions, which cannot be compiled), so this also works from a
process, such as the test suite, that runs the kernels under the interpreter.

Writes ``kernels_aot.json`` and ``kernels_aot.md`` to ``--out``; returns non-zero when a variant fails to compile,
exceeds the target's shared memory, spills or computes an exponent from a fused multiply-add.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import io
import itertools
import logging
import multiprocessing
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

#: compute capability -> (ptxas --gpu-name, max dynamic shared memory per block in bytes)
TARGETS: dict[int, tuple[str, int]] = {
    80: ("sm_80", 163 * 1024),  # A100: 163 KB opt-in dynamic shared memory per block
    90: ("sm_90a", 227 * 1024),  # H100: 227 KB
}
DTYPES = ("fp16", "bf16", "fp32")
KERNELS = ("fwd", "bwd_preprocess", "bwd_dkdv", "bwd_dq", "bwd_dpair")
#: representative launch shape (Z, N, S, H); D is each BLOCK_D bucket
REPRESENTATIVE = {"Z": 1, "N": 2, "S": 256, "H": 8}


_TORCH_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


@dataclasses.dataclass(frozen=True)
class Call:
    """One attention call as a caller makes it: shapes, dtypes and the layout of each tensor (Z = 1).

    ``pair``: ``"contiguous"`` ``[Z, 1, H, S, S]``; ``"start"`` / ``"end"``: OpenFold's pair or triangle bias, a
    contiguous ``linear(z) [Z, S, S, H]`` permuted to ``[Z, 1, H, S, S]`` (``permute_final_dims`` (2, 0, 1) or, for
    the transposed bias, (2, 1, 0)), so the head dim has stride 1 and the key dim stride H or S*H.
    ``openfold``: q, k, v as OpenFold's ``Attention._prep_qkv`` makes them (``linear(x) [*, Q, H*C]`` viewed as
    ``[*, H, Q, C]``), passed through OpenFold's adapter (``ds4sci.integrations.openfold``); otherwise
    DeepSpeed4Science's layout ``[Z, N, S, H, D]`` contiguous, through ``evoformer_attention``.
    """

    name: str
    dtype: str
    n: int
    s: int
    h: int
    d: int
    mask: Optional[str] = None  # mask-bias dtype; None: no mask bias
    pair: Optional[str] = None  # pair-bias layout (see above); None: no pair bias
    pair_dtype: Optional[str] = None  # default: q's dtype
    mask_grad: bool = False
    pair_grad: bool = False
    openfold: bool = False


#: The launches OpenFold (AlphaFold2 configs) and OpenFold3 (``of3_all_atom`` model config) make through
#: ``use_deepspeed_evo_attention``. Sizes are small (only the compiled code matters) but keep what Triton specialises
#: on in real runs: divisibility of S, N and every stride by 16, ``== 1``, dtypes. Under autocast the mask bias
#: (``1e9 * (mask - 1)`` from the fp32 feature mask) stays fp32 while q, k, v and the pair bias are bf16.
CALLERS: tuple[Call, ...] = (
    Call("msa-row", "bf16", n=4, s=64, h=8, d=32, mask="fp32", pair="start", pair_grad=True, openfold=True),
    Call("msa-row S odd", "bf16", n=4, s=37, h=8, d=32, mask="fp32", pair="start", pair_grad=True, openfold=True),
    Call("msa-row N=1", "bf16", n=1, s=48, h=8, d=32, mask="fp32", pair="start", pair_grad=True, openfold=True),
    Call("msa-row fp32", "fp32", n=4, s=37, h=8, d=32, mask="fp32", pair="start", pair_grad=True, openfold=True),
    Call("extra-msa-row D=8", "bf16", n=16, s=64, h=8, d=8, mask="fp32", pair="start", pair_grad=True, openfold=True),
    Call("extra-msa-row D=8 S odd", "fp16", n=16, s=37, h=8, d=8, mask="fp32", pair="start", pair_grad=True,
         openfold=True),
    Call("msa-column", "bf16", n=37, s=33, h=8, d=32, mask="fp32", openfold=True),
    Call("triangle-start", "bf16", n=48, s=48, h=4, d=32, mask="fp32", pair="start", pair_grad=True, openfold=True),
    Call("triangle-end", "bf16", n=48, s=48, h=4, d=32, mask="fp32", pair="end", pair_grad=True, openfold=True),
    Call("triangle D=64 fp32", "fp32", n=40, s=40, h=4, d=64, mask="fp32", pair="start", pair_grad=True,
         openfold=True),
    Call("template-triangle D=16", "bf16", n=37, s=37, h=4, d=16, mask="fp32", pair="start", pair_grad=True,
         openfold=True),
    Call("pair-bias N=1 D=24", "bf16", n=1, s=37, h=16, d=24, mask="fp32", pair="start", pair_grad=True,
         openfold=True),
    Call("ds4sci layout fp16 biases with grads", "fp16", n=2, s=37, h=8, d=24, mask="fp16", pair="contiguous",
         mask_grad=True, pair_grad=True),
)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One compiled specialisation: a kernel, a table entry (dtype, BLOCK_D) and its bias flags, launched by ``call``
    (None: the representative launch of ``shipped`` variants)."""

    kernel: str
    dtype: str
    block_d: int
    has_mask: bool
    has_pair: bool
    mask_grad: bool = False
    call: Optional[Call] = None

    @property
    def flags(self) -> str:
        names = [n for n, on in (("mask", self.has_mask), ("pair", self.has_pair), ("mask_grad", self.mask_grad)) if on]
        return "+".join(names) or "-"

    @property
    def case(self) -> str:
        return self.call.name if self.call is not None else "representative"

    def launch(self):
        """(jit kernel, positional args, constexpr and launch kwargs), recorded from the call that launches it."""
        return _launch(self)

    def as_call(self) -> Call:
        """The call that launches this variant: ``call``, or the representative launch with these flags."""
        if self.call is not None:
            return self.call
        z, n, s, h = (REPRESENTATIVE[k] for k in ("Z", "N", "S", "H"))
        assert z == 1
        return Call("representative", self.dtype, n=n, s=s, h=h, d=self.block_d,
                    mask=self.dtype if self.has_mask else None, pair="contiguous" if self.has_pair else None,
                    mask_grad=self.mask_grad, pair_grad=self.kernel == "bwd_dpair")


def shipped_variants(
    dtypes=DTYPES, block_ds: Optional[tuple[int, ...]] = None, worst_case_only: bool = False
) -> list[Variant]:
    """Every (kernel, dtype, BLOCK_D, flags) the launchers can request; ``worst_case_only`` keeps, per kernel and
    table entry, only the variant with every flag on: the most code and shared memory, a quick check but not a
    substitute for the full set (ptxas allocates registers per variant; a flag-off variant can spill alone)."""
    from ds4sci.kernels.triton_evoformer import BLOCK_D_BUCKETS

    out = []
    for dtype in dtypes:
        for block_d in block_ds or BLOCK_D_BUCKETS:
            both = [(m, p) for m in (False, True) for p in (False, True)]
            per_kernel = {
                "fwd": [(m, p, False) for m, p in both],
                "bwd_preprocess": [(False, False, False)],
                "bwd_dkdv": [(m, p, g) for m, p in both for g in ((False, True) if m else (False,))],
                "bwd_dq": [(m, p, False) for m, p in both],
                "bwd_dpair": [(m, True, False) for m in (False, True)],
            }
            for kernel in KERNELS:
                flags = per_kernel[kernel]
                if worst_case_only:
                    flags = flags[-1:]
                out += [Variant(kernel, dtype, block_d, m, p, g) for m, p, g in flags]
    return out


# ----------------------------------------------------------------------------------------------------------
# Launches, recorded from the public path
# ----------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def record_launches() -> Iterator[list]:
    """Record every Triton kernel launch as (kernel, positional args, keyword args) instead of running it.

    Patches ``run`` of Triton's JIT and interpreted functions (``kernel[grid](...)`` calls it) for the duration; the
    outputs the launches would have written stay uninitialised.
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    launches: list = []

    def run(self, *args, grid, warmup, **kwargs):
        del grid, warmup
        launches.append((self, args, kwargs))

    saved = [(cls, cls.__dict__["run"]) for cls in (JITFunction, InterpretedFunction)]
    for cls, _ in saved:
        cls.run = run
    try:
        yield launches
    finally:
        for cls, original in saved:
            cls.run = original


@contextlib.contextmanager
def _triton_backend_on_cpu() -> Iterator[None]:
    """Let the public function take the triton backend on CPU tensors (it asks for ``TRITON_INTERPRET=1``).

    The kernels were defined when the backend was imported (before this), so they stay what they were (JIT functions
    in the compile workers); with :func:`record_launches` active nothing runs.
    """
    from ds4sci.kernels import triton_evoformer, triton_local_attention  # noqa: F401  (defines the kernels first)

    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


def call_launches(call: Call) -> list[tuple]:
    """[(kernel, args, kwargs)] of every Triton launch of ``call``'s forward and backward, in launch order."""
    import torch

    from ds4sci.kernels import evoformer_attention

    dtype = getattr(torch, _TORCH_DTYPES[call.dtype])
    z, n, s, h, d = 1, call.n, call.s, call.h, call.d

    def leaf(*shape, dtype=dtype, grad=True):
        return torch.empty(shape, dtype=dtype, requires_grad=grad)

    if call.openfold:  # linear(x) [Z, N, S, H*C] -> [Z, N, S, H, C] -> [Z, N, H, S, C] (OpenFold's _prep_qkv)
        q, k, v = (leaf(z, n, s, h * d).view(z, n, s, h, d).transpose(-2, -3) for _ in range(3))
    else:
        q, k, v = (leaf(z, n, s, h, d) for _ in range(3))
    biases = []
    if call.mask is not None:  # [Z, N, 1, 1, S]
        mask_dtype = getattr(torch, _TORCH_DTYPES[call.mask])
        biases.append(leaf(z, n, s, dtype=mask_dtype, grad=call.mask_grad)[:, :, None, None, :])
    if call.pair is not None:
        pair_dtype = getattr(torch, _TORCH_DTYPES[call.pair_dtype or call.dtype])
        if call.pair == "contiguous":
            pair = leaf(z, 1, h, s, s, dtype=pair_dtype, grad=call.pair_grad)
        else:  # linear(z) [Z, S, S, H] -> [Z, H, S, S] -> [Z, 1, H, S, S]
            order = {"start": (0, 3, 1, 2), "end": (0, 3, 2, 1)}[call.pair]
            pair = leaf(z, s, s, h, dtype=pair_dtype, grad=call.pair_grad).permute(order).unsqueeze(1)
        biases.append(pair)
    with record_launches() as launches, _triton_backend_on_cpu():
        if call.openfold:
            from ds4sci.integrations.openfold import EvoAttentionAdapter

            o = EvoAttentionAdapter("triton")(q, k, v, biases)
        else:
            o = evoformer_attention(q, k, v, biases, backend="triton")
        o.backward(torch.zeros_like(o))
    return [(kernel, args, kwargs) for kernel, args, kwargs in launches]


def kernel_name(kernel) -> str:
    """``"fwd"``, ``"bwd_dq"``, ... from ``_fwd_kernel``, ``_bwd_dq_kernel``, ..."""
    return kernel.__name__.removeprefix("_").removesuffix("_kernel")


def launch_flags(name: str, meta: dict) -> tuple[bool, bool, bool]:
    """(HAS_MASK, HAS_PAIR, MASK_GRAD) of a launch; the dpair kernel always has a pair bias."""
    return meta.get("HAS_MASK", False), meta.get("HAS_PAIR", name == "bwd_dpair"), meta.get("MASK_GRAD", False)


def _launch(variant: Variant):
    """(jit kernel, positional args, constexpr and launch kwargs) of ``variant``, recorded from its call."""
    found = [(kernel, args, meta) for kernel, args, meta in call_launches(variant.as_call())
             if kernel_name(kernel) == variant.kernel]
    if len(found) != 1:
        raise RuntimeError(f"{variant.case}: {len(found)} launches of the {variant.kernel} kernel, expected 1")
    kernel, args, meta = found[0]
    flags = launch_flags(variant.kernel, meta)
    if flags != (variant.has_mask, variant.has_pair, variant.mask_grad):
        raise RuntimeError(f"{variant.case}: {variant.kernel} launched with (mask, pair, mask_grad) = {flags}, "
                           f"expected {variant.flags}")
    return kernel, args, meta


def _specialisation(kernel, args, meta, backend) -> tuple[dict, dict, dict, dict]:
    """(signature, constexprs, attrs, options) Triton's JIT derives from these arguments."""
    from triton.runtime.jit import native_specialize_impl

    names = kernel.arg_names
    options = {key: value for key, value in meta.items() if key not in names}  # num_warps, num_stages
    constexprs = {key: value for key, value in meta.items() if key in names}
    runtime_names = [name for name in names if name not in constexprs]
    if len(runtime_names) != len(args):
        raise ValueError(f"{kernel.__name__}: {len(args)} arguments for parameters {runtime_names}")
    signature, attrs = {}, {}
    fixed, unaligned = _not_specialised(kernel)
    for name, arg in zip(runtime_names, args):
        # (type, specialisation): e.g. ("*fp16", "D") for a 16-byte aligned pointer, ("constexpr", 1), ("i32", "");
        # arguments the kernel marks ``do_not_specialize`` (``_on_alignment``) are not, as in JITFunction.run
        ty, desc = native_specialize_impl(backend, arg, False, name not in fixed, name not in unaligned)
        signature[name] = ty
        if ty == "constexpr":
            constexprs[name] = arg
        elif desc:
            attrs[(names.index(name),)] = backend.parse_attr(desc)
    for name in constexprs:
        signature[name] = "constexpr"
    return signature, constexprs, attrs, options


def _not_specialised(kernel) -> tuple[set[str], set[str]]:
    """Names of the parameters the kernel marks ``do_not_specialize`` and ``do_not_specialize_on_alignment``, from a
    JIT function (its params) or an interpreted one (the keywords ``@triton.jit`` was given: names or indices)."""
    if hasattr(kernel, "params"):
        return ({p.name for p in kernel.params if p.do_not_specialize},
                {p.name for p in kernel.params if p.do_not_specialize_on_alignment})
    keywords = getattr(kernel, "kwargs", {})

    def names(key):
        return {kernel.arg_names[x] if isinstance(x, int) else x for x in keywords.get(key) or ()}

    return names("do_not_specialize"), names("do_not_specialize_on_alignment")


def meta_names(kernel) -> set[str]:
    """The kernel's own ``tl.constexpr`` parameters (flags and tiles), as opposed to arguments Triton specialised."""
    return {p.name for p in kernel.params if p.is_constexpr} if hasattr(kernel, "params") else set()


def describe_specialisation(kernel, signature: dict, constexprs: dict, attrs: dict) -> str:
    """What Triton specialised this launch on, beyond the flags: unit and non-multiple-of-16 integer arguments,
    pointer dtypes and unaligned pointers (e.g. ``==1: N, stride_ph; not %16: S, D, stride_pj; Mask *fp32``)."""
    names = kernel.arg_names
    unit = [n for n, v in constexprs.items() if not isinstance(v, bool) and v == 1 and n not in meta_names(kernel)]
    ints = [n for n, ty in signature.items() if ty in ("i32", "i64") and (names.index(n),) not in attrs]
    ptrs = [f"{n} {ty}" for n, ty in signature.items() if ty.startswith("*")]
    unaligned = [n for n, ty in signature.items() if ty.startswith("*") and (names.index(n),) not in attrs]
    parts = [f"==1: {', '.join(unit)}" if unit else "", f"not %16: {', '.join(ints)}" if ints else "",
             f"unaligned: {', '.join(unaligned)}" if unaligned else "", ", ".join(ptrs)]
    return "; ".join(part for part in parts if part)


def specialisation_key(variant: Variant, kernel, args, meta, backend) -> str:
    """Two launches with one key compile to the same code."""
    signature, constexprs, attrs, options = _specialisation(kernel, args, meta, backend)
    return repr((variant.kernel, sorted(signature.items()), sorted(constexprs.items()), sorted(attrs.items()),
                 sorted(options.items())))


def caller_variants(calls=CALLERS) -> list[Variant]:
    """One Variant per distinct specialisation the calls launch (the first call that launches it names it)."""
    import triton
    from triton.backends.compiler import GPUTarget

    backend = triton.compiler.make_backend(GPUTarget("cuda", 80, 32))  # specialisation does not depend on the target
    out, seen = [], set()
    for call in calls:
        for kernel, args, meta in call_launches(call):
            name = kernel_name(kernel)
            variant = Variant(name, call.dtype, meta["BLOCK_D"], *launch_flags(name, meta), call=call)
            key = specialisation_key(variant, kernel, args, meta, backend)
            if key not in seen:
                seen.add(key)
                out.append(variant)
    return out


# ----------------------------------------------------------------------------------------------------------
# The local attention kernels (ds4sci.kernels.triton_local_attention)
# ----------------------------------------------------------------------------------------------------------

LOCAL_KERNELS = ("fwd", "bwd_dq", "bwd_dkdv")
#: representative local-attention launch (B, S, H, Hkv): GQA groups of 4, so the dK/dV kernel's group loop is a real
#: loop (H == Hkv specialises the group size 1 into a constant); D is each BLOCK_D bucket
LOCAL_REPRESENTATIVE = {"B": 1, "S": 256, "H": 8, "Hkv": 2}
#: (HAS_DOCS, HAS_ALIBI) compiled per (dtype, BLOCK_D, kernel) by ``--set local``: every flag off and every flag on.
#: ``--set local-full`` compiles all four combinations.
LOCAL_FLAG_ENDS = ((False, False), (True, True))
#: dtypes of ``--set local``: one per kind of table entry (fp16 shares bf16's tiles and code but for the MMA operand
#: type and conversions; ``--set local-full`` compiles it too)
LOCAL_DTYPES = ("bf16", "fp32")


@dataclasses.dataclass(frozen=True)
class LocalCall:
    """One local attention call (``triton_attention``): q ``[B, Sq, H, D]``, k and v ``[B, Sk, Hkv, D]``, contiguous,
    causal at aligned offsets unless told otherwise; ``docs``: packed document ids, ``alibi``: one slope per head."""

    name: str
    dtype: str
    b: int
    sq: int
    sk: int
    h: int
    hkv: int
    d: int
    causal: bool = True
    window: Optional[int] = None
    docs: bool = False
    alibi: bool = False
    q_offset: int = 0
    k_offset: int = 0


@dataclasses.dataclass(frozen=True)
class LocalVariant:
    """One compiled local-attention specialisation: a kernel, a table entry (dtype, BLOCK_D) and its flags, launched
    by ``call`` (None: the representative launch)."""

    kernel: str
    dtype: str
    block_d: int
    has_docs: bool
    has_alibi: bool
    call: Optional[LocalCall] = None

    @property
    def flags(self) -> str:
        return "+".join(n for n, on in (("docs", self.has_docs), ("alibi", self.has_alibi)) if on) or "-"

    @property
    def case(self) -> str:
        return self.call.name if self.call is not None else "local representative"

    def as_call(self) -> LocalCall:
        if self.call is not None:
            return self.call
        r = LOCAL_REPRESENTATIVE
        return LocalCall("local representative", self.dtype, b=r["B"], sq=r["S"], sk=r["S"], h=r["H"], hkv=r["Hkv"],
                         d=self.block_d, docs=self.has_docs, alibi=self.has_alibi)

    def launch(self):
        """(jit kernel, positional args, constexpr and launch kwargs), recorded from the public path."""
        found = [(kernel, args, meta) for kernel, args, meta in local_call_launches(self.as_call())
                 if kernel_name(kernel) == self.kernel]
        if len(found) != 1:
            raise RuntimeError(f"{self.case}: {len(found)} launches of the {self.kernel} kernel, expected 1")
        kernel, args, meta = found[0]
        flags = (meta["HAS_DOCS"], meta["HAS_ALIBI"])
        if flags != (self.has_docs, self.has_alibi):
            raise RuntimeError(f"{self.case}: {self.kernel} launched with (docs, alibi) = {flags}, "
                               f"expected {self.flags}")
        return kernel, args, meta


def local_call_launches(call: LocalCall) -> list[tuple]:
    """[(kernel, args, kwargs)] of every Triton launch of ``call``'s forward and backward (through ``triton_attention``,
    with a gradient into out and lse), in launch order."""
    import torch

    from ds4sci.kernels.triton_local_attention import triton_attention

    dtype = getattr(torch, _TORCH_DTYPES[call.dtype])
    q = torch.empty(call.b, call.sq, call.h, call.d, dtype=dtype, requires_grad=True)
    k, v = (torch.empty(call.b, call.sk, call.hkv, call.d, dtype=dtype, requires_grad=True) for _ in range(2))
    kw = dict(causal=call.causal, window=call.window, q_offset=call.q_offset, k_offset=call.k_offset)
    if call.docs:  # packed documents of 100 tokens over global positions
        kw["q_doc"] = (torch.arange(call.q_offset, call.q_offset + call.sq) // 100).expand(call.b, -1)
        kw["k_doc"] = (torch.arange(call.k_offset, call.k_offset + call.sk) // 100).expand(call.b, -1)
    if call.alibi:
        kw["alibi_slopes"] = torch.ones(call.h)
    with record_launches() as launches, _triton_backend_on_cpu():
        out, lse = triton_attention(q, k, v, return_lse=True, **kw)
        torch.autograd.backward((out, lse), (torch.zeros_like(out), torch.zeros_like(lse)))
    return launches


def local_variants(dtypes=LOCAL_DTYPES, block_ds: Optional[tuple[int, ...]] = None, flag_sets=LOCAL_FLAG_ENDS,
                   worst_case_only: bool = False) -> list[LocalVariant]:
    """(kernel, dtype, BLOCK_D, flags) of the local-attention kernels for each table entry; ``flag_sets`` the
    (HAS_DOCS, HAS_ALIBI) pairs (every pair the launchers can produce: ``itertools.product((False, True), repeat=2)``);
    ``worst_case_only`` keeps every flag on."""
    from ds4sci.kernels.triton_local_attention import BLOCK_D_BUCKETS

    flag_sets = ((True, True),) if worst_case_only else tuple(flag_sets)
    return [LocalVariant(kernel, dtype, block_d, docs, alibi)
            for dtype in dtypes for block_d in block_ds or BLOCK_D_BUCKETS
            for kernel in LOCAL_KERNELS for docs, alibi in flag_sets]


def _ast_source(kernel, args, meta, backend):
    """ASTSource with the signature/constexprs/attrs Triton's JIT would derive from these arguments, and the
    compile options."""
    import triton

    signature, constexprs, attrs, options = _specialisation(kernel, args, meta, backend)
    return triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs), options


# ----------------------------------------------------------------------------------------------------------
# PTX check: what feeds each ex2.approx (issue #12)
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PtxInstruction:
    line: int  # 1-based line of the PTX text
    opcode: str  # e.g. "fma.rn.f32"
    operands: tuple[str, ...]  # destination first; a vector "{%r1, %r2}" stays one operand

    def __str__(self) -> str:
        return f"line {self.line}: {self.opcode} {', '.join(self.operands)}"


_PTX_REGISTER = re.compile(r"%[A-Za-z_$][\w$]*")
#: opcodes whose first operand is not a register they define
_PTX_NO_DEST = ("st.", "red.", "bra", "bar.", "ret", "exit", "call", "cp.async", "prefetch", "fence", "membar",
                "trap", "wgmma.fence", "wgmma.commit", "wgmma.wait")
#: copies and conversions: a value's origin is their source operand
_PTX_TRANSPARENT = ("mov.", "cvt.")


def parse_ptx(ptx: str) -> list[PtxInstruction]:
    """The instructions of a PTX text (directives, labels, braces and comments skipped; predicates dropped)."""
    out = []
    for number, raw in enumerate(ptx.splitlines(), start=1):
        line = raw.split("//", 1)[0].strip()
        while line.startswith("$") and ":" in line:  # a label before an instruction
            line = line.split(":", 1)[1].strip()
        if not line or line.startswith((".", "{", "}", "(", ")")) or not line.endswith(";"):
            continue
        line = line[:-1].strip()
        if line.startswith("@"):  # @%p1 / @!%p1 predicate
            line = line.split(None, 1)[1] if " " in line else ""
        opcode, _, rest = line.partition(" ")
        if not opcode or not opcode[0].isalpha():
            continue
        operands, depth, current = [], 0, ""
        for ch in rest:  # split on top-level commas (vectors "{a, b}" and addresses "[a + 4]" stay whole)
            depth += (ch in "{[") - (ch in "}]")
            if ch == "," and depth == 0:
                operands.append(current.strip())
                current = ""
            else:
                current += ch
        if current.strip():
            operands.append(current.strip())
        out.append(PtxInstruction(number, opcode, tuple(operands)))
    return out


def _is_zero_immediate(operand: str) -> bool:
    return operand in ("0f00000000", "0f80000000", "0d0000000000000000", "0d8000000000000000", "0", "0.0")


def _is_register(operand: str) -> bool:
    return bool(_PTX_REGISTER.fullmatch(operand))


class _PtxValues:
    """Definitions of PTX registers, to trace where a value comes from (a register may be defined several times:
    loop-carried values are moved into the same register at the loop's end)."""

    def __init__(self, instructions: list[PtxInstruction]):
        self.defs: dict[str, list[PtxInstruction]] = {}
        for inst in instructions:
            if not inst.operands or inst.opcode.startswith(_PTX_NO_DEST):
                continue
            for reg in _PTX_REGISTER.findall(inst.operands[0]) if inst.operands[0].startswith("{") else \
                    [inst.operands[0]] if _is_register(inst.operands[0]) else []:
                self.defs.setdefault(reg, []).append(inst)

    def origins(self, operand: str, _seen: Optional[set] = None) -> list:
        """The instructions (or immediates, as strings) a value comes from, looking through moves, conversions and
        selects (both selected values). Registers without a definition (kernel parameters) come back as names."""
        if not _is_register(operand):
            return [operand]
        seen = set() if _seen is None else _seen
        if operand in seen:
            return []
        seen.add(operand)
        out: list = []
        for inst in self.defs.get(operand, []) or [operand]:
            if isinstance(inst, str):
                out.append(inst)
            elif inst.opcode.startswith(_PTX_TRANSPARENT) and len(inst.operands) == 2:
                out += self.origins(inst.operands[1], seen)
            elif inst.opcode.startswith("selp.") and len(inst.operands) == 4:
                out += self.origins(inst.operands[1], seen) + self.origins(inst.operands[2], seen)
            else:
                out.append(inst)
        return out

    def is_difference(self, operand: str) -> bool:
        """Whether every origin of the value is a subtraction of two registers (``x - y``, or ``x + neg(y)``)."""
        origins = self.origins(operand)
        return bool(origins) and all(self._difference(o) for o in origins)

    def _difference(self, origin) -> bool:
        if not isinstance(origin, PtxInstruction) or len(origin.operands) != 3:
            return False
        a, b = origin.operands[1:]
        if origin.opcode.startswith("sub.f"):
            return _is_register(a) and _is_register(b)
        if origin.opcode.startswith("add.f"):
            return any(isinstance(o, PtxInstruction) and o.opcode.startswith("neg.f")
                       for x in (a, b) for o in self.origins(x))
        return False

    def from_fma(self, operand: str) -> bool:
        return any(isinstance(o, PtxInstruction) and o.opcode.startswith("fma.") for o in self.origins(operand))

    def describe(self, operand: str, depth: int = 4) -> str:
        """A value as a short expression, e.g. ``neg(selp(0f00000000, mul(max(...), 0f3FB8AA3B)))``."""
        if not _is_register(operand) or depth == 0:
            return operand if _is_register(operand) or depth else "..."
        insts = self.defs.get(operand, [])
        if len(insts) != 1:
            return operand
        inst = insts[0]
        op = inst.opcode.split(".")[0]
        return f"{op}({', '.join(self.describe(x, depth - 1) for x in inst.operands[1:])})"


def unsafe_exponents(ptx: str) -> tuple[int, list[str]]:
    """(number of ``ex2`` instructions, one message per ``ex2`` whose argument is not a scaled difference).

    The rule (issue #12): after moves, conversions and selects, every ``ex2`` argument must be

    - a product ``mul(x, c)`` (or ``fma(x, c, 0)``) with a factor that is a difference of two registers
      (``(s - m) * log2 e``: exact where s == m, whatever the compiler fuses), or
    - a difference of two registers neither of which comes from an ``fma`` (already scaled separately), or
    - an immediate.

    Anything else is flagged, in particular ``fma(s, log2 e, b)`` with a register addend: ``s*LOG2E - m*LOG2E``
    contracted by the compiler into one fused multiply-add whose addend ``b = -round(m*LOG2E)`` carries the rounding
    error of the scaled maximum into the exponent.
    """
    instructions = parse_ptx(ptx)
    values = _PtxValues(instructions)
    exps = [inst for inst in instructions if inst.opcode.startswith("ex2.")]
    problems = []
    for ex2 in exps:
        for origin in values.origins(ex2.operands[1]):
            why = _exponent_problem(values, origin)
            if why:
                problems.append(f"{ex2}: argument {why}")
    return len(exps), problems


def _exponent_problem(values: _PtxValues, origin) -> str:
    """Why an ex2 argument's origin is unsafe, or "" if it is a scaled difference."""
    if not isinstance(origin, PtxInstruction):
        return "" if not _is_register(origin) else f"is the parameter {origin}, not a scaled difference"
    op, operands = origin.opcode, origin.operands
    if op.startswith("fma.") and len(operands) == 4:
        a, b, c = operands[1:]
        if not _is_zero_immediate(c):
            return (f"comes from a fused multiply-add ({origin}) with addend {c} = {values.describe(c)}: "
                    f"the scale is applied before the subtraction")
        if values.is_difference(a) or values.is_difference(b):
            return ""
        return f"comes from {origin}, a product of no difference"
    if op.startswith("mul.f") and len(operands) == 3:
        if values.is_difference(operands[1]) or values.is_difference(operands[2]):
            return ""
        return f"comes from {origin}, a product of no difference (x - max)"
    if values._difference(origin):
        fused = [x for x in operands[1:] if values.from_fma(x)]
        if not fused:
            return ""
        return f"comes from {origin}, a difference with an operand from a fused multiply-add ({', '.join(fused)})"
    return f"comes from {origin}, not a scaled difference"


_PTXAS_LOG_RE = {
    "registers": re.compile(r"Used (\d+) registers"),
    "stack_bytes": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


def _ptxas_usage(log: str) -> dict:
    """Registers, stack frame and spill bytes of the (single) entry function in a ``ptxas -v`` log."""
    usage = {}
    for key, pattern in _PTXAS_LOG_RE.items():
        found = pattern.findall(log)
        if len(found) != 1:
            raise RuntimeError(f"expected one {key} figure in the ptxas -v log, found {found}:\n{log}")
        usage[key] = int(found[0])
    return usage


def ptxas_versions() -> dict[str, str]:
    """The ptxas Triton runs for each target (its own rule: ``ptxas`` below sm_90, ``ptxas-blackwell`` from sm_90)."""
    import triton

    versions = {}
    for cc, (name, _) in TARGETS.items():
        tool = triton.knobs.nvidia.ptxas if cc < 90 else triton.knobs.nvidia.ptxas_blackwell
        proc = subprocess.run([tool.path, "--version"], capture_output=True, text=True, check=False)
        last = proc.stdout.strip().splitlines()[-1:] or ["unknown"]
        versions[name] = f"{Path(tool.path).name}: {last[0]}"
    return versions


def compile_variant(variant: Variant, capability: int) -> dict:
    """Compile one variant for one target; a record of its tiles, resource usage and exponents (or its error)."""
    import triton
    from triton.backends.compiler import GPUTarget

    gpu_name, smem_limit = TARGETS[capability]
    record = {key: value for key, value in dataclasses.asdict(variant).items() if key != "call"}
    record |= {"case": variant.case, "call": dataclasses.asdict(variant.call) if variant.call else None,
               "flags": variant.flags, "target": gpu_name, "smem_limit": smem_limit}
    start = time.perf_counter()
    try:
        kernel, args, meta = variant.launch()
        record |= {key: meta[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_D", "num_warps", "num_stages", "maxnreg")
                   if key in meta}
        target = GPUTarget("cuda", capability, 32)
        backend = triton.compiler.make_backend(target)
        signature, constexprs, attrs, _ = _specialisation(kernel, args, meta, backend)
        record["specialisation"] = describe_specialisation(kernel, signature, constexprs, attrs)
        src, options = _ast_source(kernel, args, meta, backend)
        with contextlib.redirect_stdout(io.StringIO()) as log:  # Triton prints ptxas's -v log here
            compiled = triton.compile(src, target=target, options=options)
        record["shared_bytes"] = int(compiled.metadata.shared)
        record |= _ptxas_usage(log.getvalue())
        record["ex2"], record["unsafe_ex2"] = unsafe_exponents(compiled.asm["ptx"])
        record["error"] = None
    except Exception as err:  # recorded and reported; the gate fails on any error
        record["error"] = f"{type(err).__name__}: {err}"
    record["compile_s"] = round(time.perf_counter() - start, 2)
    record["resources_ok"] = (
        record["error"] is None and record["shared_bytes"] <= smem_limit
        and record["spill_stores"] == 0 and record["spill_loads"] == 0
    )
    record["exponents_ok"] = record["error"] is None and not record["unsafe_ex2"]
    record["ok"] = record["resources_ok"] and record["exponents_ok"]
    return record


def _worker_init() -> None:
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # Triton prints the log of its own `ptxas -v` run
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"  # a cache hit would skip ptxas and its log
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated to silence its warning


@contextlib.contextmanager
def _without_interpreter() -> Iterator[None]:
    """Spawned workers inherit os.environ: drop TRITON_INTERPRET while they start, so they get JIT functions."""
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


def compile_all(variants: list[Variant], capabilities=(80, 90), jobs: int = 1) -> list[dict]:
    """Compile every (variant, target) in ``jobs`` spawned worker processes; records in input order."""
    tasks = [(v, cc) for v in variants for cc in capabilities]
    ctx = multiprocessing.get_context("spawn")
    with _without_interpreter(), concurrent.futures.ProcessPoolExecutor(
        max_workers=max(1, jobs), mp_context=ctx, initializer=_worker_init
    ) as pool:
        return list(pool.map(compile_variant, *zip(*tasks)))


def _markdown(report: dict) -> str:
    rep = report["representative"]
    local = report.get("local_representative", LOCAL_REPRESENTATIVE)
    names = [name for name, _ in TARGETS.values()]
    lines = [
        "# Triton kernels compiled ahead of time (Evoformer, local attention)",
        "",
        f"Triton {report['triton_version']}; registers and spills from the `ptxas -v` log of Triton's own compile "
        f"({'; '.join(f'{k}: {v}' for k, v in report['ptxas'].items())}); "
        f"`representative`: Evoformer launch Z={rep['Z']}, N={rep['N']}, S={rep['S']}, H={rep['H']}, D=BLOCK_D, "
        "contiguous, biases in q's dtype; `local representative`: causal local attention B={B}, S={S}, H={H}, "
        "Hkv={Hkv}, D=BLOCK_D, contiguous; other cases: OpenFold's and OpenFold3's calls, each distinct "
        "specialisation once. ".format(**local) +
        "Shared memory is Triton's dynamic request (limits: "
        f"{', '.join(f'{n} {lim} B' for n, lim in TARGETS.values())}). "
        "`unsafe ex2`: exponents (of all `ex2` in the PTX) computed from a fused multiply-add of a scaled maximum "
        "(issue #12).",
        "",
        "| case | kernel | dtype | BLOCK_D | flags | specialisation | BLOCK_MxN | warps | stages | maxnreg | "
        + " | ".join(f"{name} regs | {name} spill B | {name} smem B | {name} unsafe ex2" for name in names)
        + " | ok |",
        "| --- " * (11 + 4 * len(names)) + "|",
    ]
    by_variant: dict[tuple, dict[str, dict]] = {}
    for r in report["results"]:
        key = (r["case"], r["kernel"], r["dtype"], r["block_d"], r["flags"])
        by_variant.setdefault(key, {})[r["target"]] = r
    for (case, kernel, dtype, block_d, flags), per_target in by_variant.items():
        first = next(iter(per_target.values()))
        cells = []
        for name in names:
            r = per_target.get(name)
            if r is None:
                cells += ["", "", "", ""]
            elif r["error"]:
                cells += ["error", "", "", ""]
            else:
                cells += [str(r["registers"]), str(r["spill_stores"] + r["spill_loads"]), str(r["shared_bytes"]),
                          f"{len(r['unsafe_ex2'])}/{r['ex2']}"]
        ok = all(r["ok"] for r in per_target.values())
        lines.append(
            f"| {case} | {kernel} | {dtype} | {block_d} | {flags} | {first.get('specialisation', '')} | "
            f"{first.get('BLOCK_M', '-')}x{first.get('BLOCK_N', '-')} | "
            f"{first.get('num_warps', '')} | {first.get('num_stages', '')} | {first.get('maxnreg') or '-'} | "
            + " | ".join(cells) + f" | {'yes' if ok else 'NO'} |"
        )
    results = report["results"]
    errors = [r for r in results if r["error"]]
    unsafe = [r for r in results if r["error"] is None and r["unsafe_ex2"]]
    lines += ["", f"{len(results)} compilations ({report['wall_s']} s), {len(errors)} errors; within limits and "
              f"spill-free: {'yes' if all(r['resources_ok'] for r in results) else 'NO'}; exponents from scaled "
              f"differences only: {'yes' if not unsafe else f'NO ({len(unsafe)} compilations)'}."]
    for r in errors:
        lines.append(f"- {_where(r)}: {r['error'][:500]}")
    for r in unsafe[:5]:
        lines.append(f"- {_where(r)}: {len(r['unsafe_ex2'])} of {r['ex2']} ex2, e.g. {r['unsafe_ex2'][0]}")
    return "\n".join(lines) + "\n"


def _where(r: dict) -> str:
    return f"{r['case']}: {r['kernel']} {r['dtype']} BLOCK_D={r['block_d']} {r['flags']} {r['target']}"


SETS = ("shipped", "callers", "local", "local-full", "all")


def variants_for(which: str, dtypes=None, block_ds=None, worst_case_only: bool = False) -> list:
    """The variants of ``--set``: ``shipped`` (the Evoformer tile table), ``callers`` (:data:`CALLERS`), ``local``
    (the local-attention tile table for :data:`LOCAL_DTYPES`, every flag off and every flag on), ``local-full``
    (every dtype and flag combination) or ``all`` (shipped, callers and local). ``dtypes`` (None: each set's own)
    and ``block_ds`` (None: every bucket) narrow the table sets."""
    out: list = []
    if which in ("shipped", "all"):
        out += shipped_variants(dtypes or DTYPES, block_ds, worst_case_only)
    if which in ("callers", "all"):
        out += caller_variants()
    if which in ("local", "all"):
        out += local_variants(dtypes or LOCAL_DTYPES, block_ds, worst_case_only=worst_case_only)
    if which == "local-full":
        out += local_variants(dtypes or DTYPES, block_ds, itertools.product((False, True), repeat=2),
                              worst_case_only)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", dest="variant_set", choices=SETS, default="all",
                        help="shipped: every Evoformer tile-table variant at a representative launch; callers: the "
                             "specialisations OpenFold/OpenFold3 launch; local: the local-attention kernels for every "
                             "tile-table entry, flags all off and all on; local-full: every flag combination; all: "
                             "shipped, callers and local (default: %(default)s)")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=None,
                        help="shipped and local sets: dtypes (default: all for shipped and local-full, "
                             f"{' '.join(LOCAL_DTYPES)} for local)")
    parser.add_argument("--block-d", nargs="+", type=int, default=None,
                        help="shipped and local sets: BLOCK_D buckets (default: all)")
    parser.add_argument("--targets", nargs="+", type=int, choices=sorted(TARGETS), default=sorted(TARGETS),
                        help="compute capabilities (default: %(default)s)")
    parser.add_argument("--worst-case-only", action="store_true",
                        help="shipped set: per kernel and table entry only the variant with every flag on (quick, "
                             "not complete)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="compile processes (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    import triton

    from ds4sci.bench.report import write_report

    variants = variants_for(args.variant_set, tuple(args.dtypes) if args.dtypes else None,
                            tuple(args.block_d) if args.block_d else None, args.worst_case_only)
    start = time.perf_counter()
    results = compile_all(variants, tuple(args.targets), args.jobs)
    report = {
        "triton_version": triton.__version__,
        "ptxas": ptxas_versions(),
        "targets": {name: {"capability": cc, "smem_limit": lim} for cc, (name, lim) in TARGETS.items()},
        "representative": REPRESENTATIVE,
        "local_representative": LOCAL_REPRESENTATIVE,
        "set": args.variant_set,
        "callers": [dataclasses.asdict(call) for call in CALLERS] if args.variant_set != "shipped" else [],
        "worst_case_only": bool(args.worst_case_only),
        "wall_s": round(time.perf_counter() - start, 1),
        "all_ok": all(r["ok"] for r in results),
        "results": results,
    }
    path = write_report(args.out, "kernels_aot", report, _markdown(report))
    bad = [r for r in results if not r["ok"]]
    for r in bad:
        if r["error"]:
            why = r["error"]
        elif not r["resources_ok"]:
            why = f"smem {r['shared_bytes']} B, spills {r['spill_stores']}/{r['spill_loads']} B"
        else:
            why = f"{len(r['unsafe_ex2'])} of {r['ex2']} exponents from a fused multiply-add, e.g. {r['unsafe_ex2'][0]}"
        logger.error("kernels-aot: %s: %s", _where(r), why)
    logger.info("kernels-aot: %d compilations in %.0f s, %d not ok; wrote %s", len(results), report["wall_s"], len(bad),
                path)
    return 0 if not bad else 1
