"""The compiled variants of each ``--set`` of ``ds4sci bench kernels-aot`` (``all``: shipped, callers, local, trimul).

- ``shipped``: every (dtype, ``BLOCK_D``, kernel, flags) the tile table of :mod:`ds4sci.kernels.triton_evoformer` and
  the launchers can produce (forward and the four backward kernels, each with its ``HAS_MASK`` / ``HAS_PAIR`` /
  ``MASK_GRAD`` flags), each for one representative launch on contiguous inputs (Z = 1, N = 2, S = 256, H = 8,
  D = ``BLOCK_D``, biases in q's dtype): the shared-memory and spill gate of the tile table.
- ``callers``: the launches OpenFold and OpenFold3 make (:data:`~ds4sci.bench.aot.calls.CALLERS`). Triton specialises
  every integer argument on ``== 1`` (a compile-time constant) and on divisibility by 16, every pointer on its dtype
  and 16-byte alignment, so D = 8 or 24, S not a multiple of 16, N = 1, the pair bias as OpenFold's permuted view of
  ``z [*, S, S, H]`` (non-unit last stride) and an fp32 mask bias beside bf16 q are each different compiled code from
  the representative launch. Launches that specialise identically are compiled once.
- ``local``: the local-attention kernels of :mod:`ds4sci.kernels.triton_local_attention` (forward, dQ, dK/dV) for
  every entry of its tile table (bf16 and fp32 x ``BLOCK_D`` 16/32/64/128; fp16 shares bf16's tiles and compiled to
  the same registers and shared memory in all 96 of its variants), each with its ``HAS_DOCS`` / ``HAS_ALIBI`` flags
  all off and all on (flag-off variants were seen to spill alone: their loops are software-pipelined, the document
  branch stops that), at one representative causal GQA launch (B = 1, S = 256, H = 8, Hkv = 2, D = ``BLOCK_D``):
  96 compilations. ``local-full``: every dtype and flag combination (288 compilations). The kernels do not
  specialise the integers that change from ring block to ring block (offsets, band), so one launch stands for all.
- ``trimul``: the triangle multiplicative update's kernels (:mod:`ds4sci.bench.aot.trimul`): per bf16/fp32/fp64
  tile-table entry one call with biases and outgoing edges and one without and incoming, the first the N = 4096 one.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Optional

from ds4sci.bench.aot.calls import CALLERS
from ds4sci.bench.aot.calls import Call
from ds4sci.bench.aot.calls import LocalCall
from ds4sci.bench.aot.calls import call_launches
from ds4sci.bench.aot.calls import kernel_name
from ds4sci.bench.aot.calls import launch_flags
from ds4sci.bench.aot.calls import local_call_launches
from ds4sci.bench.aot.specialise import specialisation_key
from ds4sci.bench.aot.trimul import TRIMUL_BUCKETS
from ds4sci.bench.aot.trimul import TRIMUL_DTYPES
from ds4sci.bench.aot.trimul import trimul_variants

DTYPES = ("fp16", "bf16", "fp32")
KERNELS = ("fwd", "bwd_preprocess", "bwd_dkdv", "bwd_dq", "bwd_dpair")
#: representative launch shape (Z, N, S, H); D is each BLOCK_D bucket
REPRESENTATIVE = {"Z": 1, "N": 2, "S": 256, "H": 8}

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
        return _the_launch(self, call_launches(self.as_call()), lambda meta: launch_flags(self.kernel, meta),
                           (self.has_mask, self.has_pair, self.mask_grad), "mask, pair, mask_grad")

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
        return _the_launch(self, local_call_launches(self.as_call()),
                           lambda meta: (meta["HAS_DOCS"], meta["HAS_ALIBI"]), (self.has_docs, self.has_alibi),
                           "docs, alibi")


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


SETS = ("shipped", "callers", "local", "local-full", "trimul", "all")
#: ``--quick``: one tile-table entry per kernel family (Evoformer: OpenFold's head dim 32; local attention: GenSLM's
#: 64), bf16, every kernel with every flag on
QUICK = {"shipped": ("bf16", 32), "local": ("bf16", 64)}


def quick_variants() -> list:
    """The variants of ``--quick``: :data:`QUICK`'s entries, every flag on (8 variants, 16 compilations): a smoke
    test of the command, not of the tile tables (flag-off variants can spill alone)."""
    (dtype, block_d), (local_dtype, local_block_d) = QUICK["shipped"], QUICK["local"]
    return (shipped_variants((dtype,), (block_d,), worst_case_only=True)
            + local_variants((local_dtype,), (local_block_d,), worst_case_only=True))


def variants_for(which: str, dtypes=None, block_ds=None, worst_case_only: bool = False) -> list:
    """The variants of ``--set``: ``shipped`` (the Evoformer tile table), ``callers``
    (:data:`~ds4sci.bench.aot.calls.CALLERS`), ``local`` (the local-attention tile table for :data:`LOCAL_DTYPES`,
    every flag off and every flag on), ``local-full`` (every dtype and flag combination), ``trimul`` (the triangle
    multiplicative update's kernels, :mod:`~ds4sci.bench.aot.trimul`) or ``all`` (shipped, callers, local and
    trimul). ``dtypes`` (None: each set's own) and ``block_ds`` (None: every bucket) narrow the table sets."""
    out: list = []
    if which in ("shipped", "all"):
        out += shipped_variants(dtypes or DTYPES, block_ds, worst_case_only)
    if which in ("callers", "all"):
        out += caller_variants()
    if which in ("local", "all"):
        out += local_variants(dtypes or LOCAL_DTYPES, block_ds, worst_case_only=worst_case_only)
    if which in ("trimul", "all"):
        out += trimul_variants(dtypes or TRIMUL_DTYPES, block_ds or TRIMUL_BUCKETS)
    if which == "local-full":
        out += local_variants(dtypes or DTYPES, block_ds, itertools.product((False, True), repeat=2),
                              worst_case_only)
    return out


def _the_launch(variant, launches: list[tuple], flags_of, expected: tuple, flag_names: str):
    """The one launch of ``variant``'s kernel among its call's ``launches``: (jit kernel, positional args, constexpr and
    launch kwargs), checked to carry the variant's flags (``flags_of(meta)`` must equal ``expected``)."""
    found = [(kernel, args, meta) for kernel, args, meta in launches if kernel_name(kernel) == variant.kernel]
    if len(found) != 1:
        raise RuntimeError(f"{variant.case}: {len(found)} launches of the {variant.kernel} kernel, expected 1")
    kernel, args, meta = found[0]
    flags = flags_of(meta)
    if flags != expected:
        raise RuntimeError(f"{variant.case}: {variant.kernel} launched with ({flag_names}) = {flags}, "
                           f"expected {variant.flags}")
    return kernel, args, meta
