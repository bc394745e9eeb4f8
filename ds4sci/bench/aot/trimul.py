"""The triangle multiplicative update's Triton kernels (:mod:`ds4sci.kernels.triton_trimul`) in the compile gate.

``--set trimul`` compiles, for each tile-table entry (bf16, fp32 and fp64: fp16 shares bf16's tiles; channel buckets
16, 32, 64, 128 with c_z = c_hidden), the launches of one forward and backward of ``trimul_triton`` with
projection biases and outgoing edges and one without biases and with incoming edges (every kernel with its flags on
and off; the edge direction changes which operand stride Triton specialises to 1), the same two calls without
autograd (the inference in blocks of :data:`INFERENCE_CHUNK` rows: block products, the output kernel computing LN_in's
statistics), and four calls with an odd N (:data:`ODD_N`, training and inference). Launch arguments are recorded from
the public function on ``meta`` tensors (shapes and strides, no storage), so what is compiled follows the launchers.

The first call is the large-N one, :data:`LARGE_N` (N = 4096, c_z = c_hidden = 128, bf16: a pair tensor of 2^31
elements). Its launches specialise exactly as a small N that is a multiple of 16 does (Triton specialises integers on
``== 1`` and divisibility by 16 only), so the gate's bf16 / 128 entry *is* that specialisation, and
:func:`narrow_offsets` checks in its Triton IR that every load and store of a position-indexed buffer adds a 64-bit
offset (the IR states each pointer offset's integer type), and :func:`large_n_narrow_addresses` checks the PTX for
sm_80 built from it (:func:`~ds4sci.bench.aot.ptx.narrow_addresses`: no address from a 32-bit position product); both
also check the three kernels of its inference (:data:`LARGE_N_INFERENCE`).
"""
from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace
from typing import Optional

from ds4sci.bench.aot.calls import kernel_name
from ds4sci.bench.aot.calls import record_launches
from ds4sci.bench.aot.ptx import narrow_addresses

_TORCH_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "fp64": "float64"}
#: channel buckets of the tile table and the dtypes of ``--set trimul`` (fp16 shares bf16's tiles)
TRIMUL_BUCKETS = (16, 32, 64, 128)
TRIMUL_DTYPES = ("bf16", "fp32", "fp64")
#: representative launch: one batch, N = 64 (a multiple of 16, as N = 4096)
TRIMUL_N = 64
#: rows per block of the gate's inference calls: N = 64 in blocks of 16 specialises as N = 4096 in its default
#: blocks of 512 rows (every size and stride a multiple of 16 or 1)
INFERENCE_CHUNK = 16
#: what each launch of a kernel that one forward and backward starts more than once does, in launch order
ROLES = {"in_fwd": ("stats", "stats_in"), "product": ("A@B^T", "dP@B", "dP^T@A"), "ln_bwd": ("LN_out", "LN_in"),
         "wgrad": ("LN_in", "LN_out")}


@dataclasses.dataclass(frozen=True)
class TrimulCall:
    """One ``trimul_triton`` call: z ``[1, N, N, c_z]`` contiguous, all weights, no mask; forward and backward, or
    (``chunk`` rows per block) inference."""

    name: str
    dtype: str
    n: int
    c_z: int
    c_hidden: int
    bias: bool
    outgoing: bool
    chunk: Optional[int] = None


#: the large-N specialisation whose 64-bit addressing the gate checks
LARGE_N = TrimulCall("N=4096 c=128", "bf16", 4096, 128, 128, bias=True, outgoing=True)
#: its inference, in the default blocks of an eighth of the rows (checked too: its first launch of each kernel)
LARGE_N_INFERENCE = dataclasses.replace(LARGE_N, name="N=4096 c=128 inference", chunk=4096 // 8)
#: N not a multiple of 16 (nor are N^2 and the operand strides): other compiled code, for the widest channels
ODD_N = (TrimulCall("N=37 bf16 c=128 bias, incoming", "bf16", 37, 128, 128, bias=True, outgoing=False),
         TrimulCall("N=37 fp32 c=128 outgoing", "fp32", 37, 128, 128, bias=False, outgoing=True),
         TrimulCall("N=37 fp64 c=128 bias, incoming", "fp64", 37, 128, 128, bias=True, outgoing=False),
         TrimulCall("N=37 bf16 c=128 inference, bias, incoming", "bf16", 37, 128, 128, True, False, chunk=5),
         TrimulCall("N=37 fp32 c=128 inference, outgoing", "fp32", 37, 128, 128, False, True, chunk=5),
         TrimulCall("N=37 fp64 c=128 inference, outgoing", "fp64", 37, 128, 128, False, True, chunk=5))


def trimul_call_launches(call: TrimulCall) -> list[tuple]:
    """[(kernel, args, kwargs)] of every Triton launch of ``call``'s forward and backward (or inference), in launch
    order (on meta tensors: nothing is allocated or run)."""
    import torch

    from ds4sci.kernels.triton_trimul import PARAM_NAMES
    from ds4sci.kernels.triton_trimul import trimul_triton

    dtype = getattr(torch, _TORCH_DTYPES[call.dtype])
    cz, ch = call.c_z, call.c_hidden
    shapes = {"ln_in": (cz,), "ln_out": (ch,), "out_proj": (cz, ch), "out_gate": (cz, cz)}

    def shape(name):
        prefix = name.rsplit("_", 1)[0]
        if prefix in ("ln_in", "ln_out"):
            return shapes[prefix]
        c_out, c_in = shapes.get(prefix, (ch, cz))
        return (c_out, c_in) if name.endswith("_w") else (c_out,)

    def leaf(*s):
        return torch.empty(s, dtype=dtype, device="meta", requires_grad=call.chunk is None)

    params = {name: None if name.endswith("_b") and not call.bias else leaf(*shape(name)) for name in PARAM_NAMES}
    z = leaf(1, call.n, call.n, cz)
    with record_launches() as launches:
        out = trimul_triton(z, None, SimpleNamespace(**params), call.outgoing, 1e-5, call.chunk)
        if call.chunk is None:
            out.backward(torch.empty_like(out))
    return launches


@dataclasses.dataclass(frozen=True)
class TrimulVariant:
    """One compiled specialisation: the ``index``-th launch of ``kernel`` in ``call``'s forward and backward."""

    kernel: str
    dtype: str
    block_d: int  # c_z = c_hidden of the call: the channel bucket (the tile table's key)
    index: int
    bias: bool
    outgoing: bool
    call: Optional[TrimulCall] = None

    @property
    def flags(self) -> str:
        roles = ROLES.get(self.kernel)
        if self.call is not None and self.call.chunk is not None:
            parts = ["inference"]
        else:
            parts = [roles[self.index]] if roles else []
        return "+".join(parts + (["bias"] if self.bias else []) + ["outgoing" if self.outgoing else "incoming"])

    @property
    def case(self) -> str:
        return self.call.name

    def launch(self):
        """(jit kernel, positional args, constexpr and launch kwargs), recorded from ``trimul_triton``."""
        found = [launch for launch in trimul_call_launches(self.call) if kernel_name(launch[0]) == self.kernel]
        if len(found) <= self.index:
            raise RuntimeError(f"{self.case}: {len(found)} launches of the {self.kernel} kernel, expected at least "
                               f"{self.index + 1}")
        return found[self.index]


def trimul_calls(dtypes=TRIMUL_DTYPES, buckets=TRIMUL_BUCKETS) -> list[TrimulCall]:
    """:data:`LARGE_N` (when bf16 and 128 are asked for), then per (dtype, bucket) the call with biases and outgoing
    edges and the one without biases and with incoming edges, each for training and for inference, then the
    :data:`ODD_N` calls asked for."""
    calls = [LARGE_N] if LARGE_N.dtype in dtypes and LARGE_N.c_z in buckets else []
    for dtype in dtypes:
        for c in buckets:
            calls += [TrimulCall(f"trimul {dtype} c={c} {'inference, ' if chunk else ''}"
                                 f"{'bias, outgoing' if bias else 'incoming'}", dtype, TRIMUL_N, c, c, bias=bias,
                                 outgoing=bias, chunk=chunk)
                      for chunk in (None, INFERENCE_CHUNK) for bias in (True, False)]
    return calls + [call for call in ODD_N if call.dtype in dtypes and call.c_z in buckets]


def trimul_variants(dtypes=TRIMUL_DTYPES, buckets=TRIMUL_BUCKETS) -> list[TrimulVariant]:
    """One variant per distinct specialisation the calls of :func:`trimul_calls` launch (the first call that launches
    it names it)."""
    import triton
    from triton.backends.compiler import GPUTarget

    from ds4sci.bench.aot.specialise import specialisation_key

    backend = triton.compiler.make_backend(GPUTarget("cuda", 80, 32))
    out, seen = [], set()
    for call in trimul_calls(dtypes, buckets):
        counts: dict[str, int] = {}
        for kernel, args, meta in trimul_call_launches(call):
            name = kernel_name(kernel)
            index = counts.get(name, 0)
            counts[name] = index + 1
            variant = TrimulVariant(name, call.dtype, call.c_z, index, call.bias, call.outgoing, call)
            key = specialisation_key(variant, kernel, args, meta, backend)
            if key not in seen:
                seen.add(key)
                out.append(variant)
    return out


def ttir(kernel, args, meta, capability: int = 90) -> str:
    """The Triton IR (after Triton's TTIR passes: helpers inlined, nothing lowered) of a recorded launch, as the JIT
    would specialise it; seconds, no ptxas. Needs JIT functions (a process without ``TRITON_INTERPRET``)."""
    return _lowered(kernel, args, meta, capability, to_ptx=False)


def ptx(kernel, args, meta, capability: int = 80) -> str:
    """The PTX of a recorded launch for ``sm_<capability>``, through Triton's own stages (TTIR, TTGIR, LLVM IR, PTX;
    no ptxas, no GPU). Needs JIT functions (a process without ``TRITON_INTERPRET``)."""
    return _lowered(kernel, args, meta, capability, to_ptx=True)


def _lowered(kernel, args, meta, capability: int, to_ptx: bool) -> str:
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget

    from ds4sci.bench.aot.specialise import ast_source

    target = GPUTarget("cuda", capability, 32)
    backend = triton.compiler.make_backend(target)
    src, options = ast_source(kernel, args, meta, backend)
    opts = backend.parse_options(options)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), context)
    metadata: dict = {}
    module = backend.make_ttir(module, metadata, opts, capability)
    if not to_ptx:
        return str(module)
    for stage in (backend.make_ttgir, backend.make_llir):
        module = stage(module, metadata, opts, capability)
    return backend.make_ptx(module, metadata, opts, capability)


def large_n_narrow_offsets() -> dict[str, list[str]]:
    """``{kernel (launch index): narrow_offsets(its IR)}`` for every launch of :data:`LARGE_N` (and the first of each
    kernel of :data:`LARGE_N_INFERENCE`)."""
    return {name: narrow_offsets(ttir(kernel, args, meta)) for name, (kernel, args, meta) in _large_n_launches()}


def large_n_narrow_addresses() -> dict[str, list[str]]:
    """``{kernel (launch index): narrow_addresses(its PTX for sm_80)}`` for every launch of :data:`LARGE_N` (and the
    first of each kernel of :data:`LARGE_N_INFERENCE`), the weights' parameters (indexed by channels only) left
    out."""
    from ds4sci.bench.aot.specialise import specialisation

    backend = _sm80_backend()
    out = {}
    for name, (kernel, args, meta) in _large_n_launches():
        signature = specialisation(kernel, args, meta, backend)[0]
        runtime = [arg for arg, ty in signature.items() if ty != "constexpr"]  # the PTX's parameters, in order
        weights = frozenset(i for i, arg in enumerate(runtime) if _WEIGHT_ARG.match(f"%{arg}"))
        out[name] = narrow_addresses(ptx(kernel, args, meta, 80), weights)
    return out


def _sm80_backend():
    import triton
    from triton.backends.compiler import GPUTarget

    return triton.compiler.make_backend(GPUTarget("cuda", 80, 32))


def _large_n_launches() -> list[tuple[str, tuple]]:
    """``[(kernel and its launch index, (kernel, args, meta))]`` for every launch of :data:`LARGE_N`, then
    ``[(kernel "inference", ...)]`` for the first launch of each kernel of :data:`LARGE_N_INFERENCE`."""
    out, counts = [], {}
    for launch in trimul_call_launches(LARGE_N):
        name = kernel_name(launch[0])
        counts[name] = counts.get(name, 0) + 1
        out.append((f"{name} {counts[name]}", launch))
    first: dict[str, tuple] = {}
    for launch in trimul_call_launches(LARGE_N_INFERENCE):
        first.setdefault(kernel_name(launch[0]), launch)
    return out + [(f"{name} inference", launch) for name, launch in first.items()]


# ---- The 64-bit offset check -------------------------------------------------------------------------------

_DEF = re.compile(r"^\s*(%[\w.]+) = (tt\.addptr|tt\.splat|tt\.broadcast|tt\.expand_dims|tt\.reshape) (%[\w.]+)"
                  r"(?:, (%[\w.]+))?[^:]*: (.*?)(?: loc\(.*)?$")
_ACCESS = re.compile(r"\btt\.(load|store) (%[\w.]+)")
_ITER_ARGS = re.compile(r"iter_args\(([^)]*)\)")
#: kernel arguments holding weights (LayerNorm weights, projection weights and biases): indexed by channels only
_WEIGHT_ARG = re.compile(r"^%(Ln[A-Z]|W[a-z]|B[a-z])")


def narrow_offsets(ttir: str) -> list[str]:
    """The loads and stores of a kernel's Triton IR (``compiled.asm["ttir"]``) whose pointer is built from a kernel
    argument other than a weight by adding only 32-bit offsets (one message each; empty: every position-indexed
    access has a 64-bit term).

    Each access's pointer is followed back through ``tt.addptr`` (collecting its offset's integer type),
    ``tt.splat``, ``tt.broadcast``, ``tt.expand_dims``, ``tt.reshape`` and loop-carried values (to their initial
    value) to the argument it starts from. The IR reuses value names in sibling regions (two loops one after the
    other), so each step takes the name's nearest definition above the line that uses it (the one that dominates
    it)."""
    defs: dict[str, list[tuple[int, tuple[str, str]]]] = {}  # name -> [(line, (source, offset type))]
    accesses = []
    for number, line in enumerate(ttir.splitlines(), start=1):
        match = _DEF.match(line)
        if match:
            result, op, source, _, types = match.groups()
            defs.setdefault(result, []).append(
                (number, (source, types.rsplit(",", 1)[-1].strip() if op == "tt.addptr" else "")))
        for group in _ITER_ARGS.findall(line):  # a loop block argument: its initial value, no offset
            for pair in group.split(","):
                if "=" in pair:
                    name, init = (part.strip().split(":")[0].strip() for part in pair.split("=", 1))
                    defs.setdefault(name, []).append((number, (init, "")))
        access = _ACCESS.search(line)
        if access:
            accesses.append((number, access.group(1), access.group(2)))
    problems = []
    for number, kind, pointer in accesses:
        wide, name, at, steps = False, pointer, number, 0
        while steps < 10_000:
            steps += 1
            above = [(line, found) for line, found in defs.get(name, ()) if line < at]
            if not above:
                break
            at, (name, offset_type) = above[-1]
            wide = wide or offset_type.endswith("i64>") or offset_type == "i64"
        if not wide and not _WEIGHT_ARG.match(name):
            problems.append(f"line {number}: tt.{kind} through {name} with 32-bit offsets only")
    return problems
