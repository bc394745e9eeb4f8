"""The attention calls the compile gate stands for, and the Triton launches each one makes.

Launch arguments are never listed here. For each call, small CPU tensors with the caller's shapes, strides and dtypes
go through the public path (``evoformer_attention``, OpenFold's adapter for OpenFold's calls, ``triton_attention``
for the local-attention kernels) forward and backward with every Triton launch recorded instead of run
(:func:`record_launches`), so what is compiled follows whatever the launchers pass (new arguments, a max and a sum
saved instead of a log-sum-exp).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Optional

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
    from ds4sci.kernels import triton_evoformer  # noqa: F401  (defines the kernels first)
    from ds4sci.kernels import triton_local_attention  # noqa: F401  (defines the kernels first)

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


def kernel_name(kernel) -> str:
    """``"fwd"``, ``"bwd_dq"``, ... from ``_fwd_kernel``, ``_bwd_dq_kernel``, ..."""
    return kernel.__name__.removeprefix("_").removesuffix("_kernel")


def launch_flags(name: str, meta: dict) -> tuple[bool, bool, bool]:
    """(HAS_MASK, HAS_PAIR, MASK_GRAD) of a launch; the dpair kernel always has a pair bias."""
    return meta.get("HAS_MASK", False), meta.get("HAS_PAIR", name == "bwd_dpair"), meta.get("MASK_GRAD", False)
