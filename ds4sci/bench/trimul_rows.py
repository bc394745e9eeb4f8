"""The triangle multiplicative update's rows of ``ds4sci bench evoformer-memory`` and ``evoformer-speed`` (issue #45).

- Memory (any device, machine-independent counts): one outgoing update
  (:class:`~ds4sci.models.evoformer.TriangleMultiplicationOutgoing`) per backend of
  :func:`ds4sci.kernels.triangle_multiplicative_update`: the bytes saved for backward (saved-tensor hooks, each
  storage once, parameters left out) and the inference peak of live tensors beyond the inputs
  (:class:`~ds4sci.bench.memory.LiveTensors`), each also in units of z's bytes; ``triton`` only on CUDA.
- Speed (CUDA only): forward and forward+backward milliseconds (CUDA events, median of the repeats), the peak CUDA
  memory of one forward+backward above the inputs, and the largest difference from the torch path's output, for
  ``ds4sci-torch``, ``ds4sci-chunked``, ``ds4sci-triton`` and, when ``cuequivariance_torch`` imports, NVIDIA's
  ``triangle_multiplicative_update`` (OpenFold3's convention: no biases, fused a/b weights).
"""
from __future__ import annotations

from typing import Callable

import torch

from ds4sci.bench.memory import LiveTensors
from ds4sci.bench.memory import saved_for_backward
from ds4sci.bench.report import MIB
from ds4sci.bench.report import markdown_table
from ds4sci.bench.rounds import cuda_median_ms
from ds4sci.kernels import TriMulParams
from ds4sci.kernels import triangle_multiplicative_update
from ds4sci.models.evoformer import TriangleMultiplicationOutgoing

#: the backends of every row; CUDA adds "triton" (its kernels: training and the blockwise inference)
BACKENDS = ("torch", "chunked")


def _backends(device: str) -> tuple[str, ...]:
    return BACKENDS + (("triton",) if torch.device(device).type == "cuda" else ())
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _module(c_z: int, c_hidden: int, dtype: torch.dtype, device: str, seed: int) -> TriangleMultiplicationOutgoing:
    """An outgoing update (OpenFold3's convention) with random weights (the init zeroes the output projection)."""
    torch.manual_seed(seed)
    module = TriangleMultiplicationOutgoing(c_z, c_hidden)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return module.to(device=device, dtype=dtype)


def memory_rows(n: int, c: int, dtype: str = "fp32", device: str = "cpu", seed: int = 0) -> dict[str, dict]:
    """Per backend: ``saved_bytes``, ``inference_peak_bytes`` and both over z's bytes (``saved_vs_z``,
    ``peak_vs_z``), for one outgoing update at ``z [1, n, n, c]``, ``c_hidden = c``."""
    module = _module(c, c, _DTYPES[dtype], device, seed)
    z = torch.randn(1, n, n, c, device=device, dtype=_DTYPES[dtype])
    mask = torch.ones(1, n, n, device=device, dtype=z.dtype)
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    rows = {}
    for backend in _backends(device):
        module.backend = backend
        zg = z.clone().requires_grad_()
        with saved_for_backward() as saved:
            out = module(zg, mask)
        del out
        weights = sum(size for ptr, size in saved.storages.items() if ptr in params)  # model state, not activations
        with torch.no_grad(), LiveTensors([*params, z.untyped_storage().data_ptr(),
                                           mask.untyped_storage().data_ptr()]) as live:
            module(z, mask)
        rows[backend] = {"saved_bytes": saved.bytes - weights, "inference_peak_bytes": live.peak,
                         "saved_vs_z": (saved.bytes - weights) / z.nbytes, "peak_vs_z": live.peak / z.nbytes}
    return rows


def memory_markdown(rows: dict[str, dict], n: int, c: int, dtype: str) -> list[str]:
    table = [(name, f"{r['saved_bytes'] / MIB:.2f}", f"{r['saved_vs_z']:.2f}",
              f"{r['inference_peak_bytes'] / MIB:.2f}", f"{r['peak_vs_z']:.2f}") for name, r in rows.items()]
    return ["## Triangle multiplicative update (one outgoing update)", "",
            f"N={n}, c_z=c_hidden={c}, {dtype}: bytes saved for backward (saved-tensor hooks) and the inference peak "
            "of live tensors beyond z and the mask.", "",
            *markdown_table(("backend", "saved for backward (MiB)", "x z", "inference peak (MiB)", "x z"), table)]


def _cueq() -> Callable | None:
    try:
        from cuequivariance_torch import triangle_multiplicative_update as cueq
    except ImportError:
        return None
    return cueq


def _implementations(module, eps: float) -> dict[str, Callable]:
    impls = {f"ds4sci-{b}": (lambda z, m, b=b: triangle_multiplicative_update(
        z, m, TriMulParams.from_module(module), outgoing=True, eps=eps, backend=b)) for b in _backends("cuda")}
    cueq = _cueq()
    if cueq is not None:
        def run_cueq(z, m):
            p = TriMulParams.from_module(module)
            return cueq(z, direction="outgoing", mask=m, norm_in_weight=p.ln_in_weight, norm_in_bias=p.ln_in_bias,
                        g_in_weight=torch.cat([p.a_gate_w, p.b_gate_w]),
                        p_in_weight=torch.cat([p.a_proj_w, p.b_proj_w]),
                        norm_out_weight=p.ln_out_weight, norm_out_bias=p.ln_out_bias, p_out_weight=p.out_proj_w,
                        g_out_weight=p.out_gate_w, eps=eps)
        impls["cuequivariance"] = run_cueq
    return impls


def speed_rows(sizes: list[int], c: int, dtypes: list[str], warmup: int, repeats: int) -> list[dict]:
    """On CUDA: per N in ``sizes``, dtype and implementation, ``fwd_ms``, ``fwd_bwd_ms``, ``peak_bytes`` and
    ``max_abs_diff`` from ds4sci-torch (or the error, recorded)."""
    results = []
    for n in sizes:
        for dtype in dtypes:
            module = _module(c, c, _DTYPES[dtype], "cuda", 0)
            z = torch.randn(1, n, n, c, device="cuda", dtype=_DTYPES[dtype], requires_grad=True)
            mask = (torch.rand(1, n, n, device="cuda") > 0.1).to(z.dtype)
            grad = torch.randn_like(z)
            reference = None
            for name, fn in _implementations(module, module.layer_norm_in.eps).items():
                record = {"impl": name, "n": n, "c": c, "dtype": dtype}
                try:
                    with torch.no_grad():
                        out = fn(z, mask)
                    reference = out if reference is None else reference
                    record["max_abs_diff"] = (out.float() - reference.float()).abs().max().item()
                    del out
                    record["fwd_ms"] = cuda_median_ms(lambda: fn(z, mask), warmup, repeats)
                    record["fwd_bwd_ms"] = cuda_median_ms(lambda: fn(z, mask).backward(grad), warmup, repeats)
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    fn(z, mask).backward(grad)
                    torch.cuda.synchronize()
                    record["peak_bytes"] = torch.cuda.max_memory_allocated() - base
                except Exception as err:  # noqa: BLE001 - recorded in the report, the other rows still run
                    record["error"] = f"{type(err).__name__}: {err}"
                z.grad = None
                module.zero_grad(set_to_none=True)
                results.append(record)
            torch.cuda.empty_cache()
    return results


def speed_markdown(results: list[dict]) -> list[str]:
    table = [(r["impl"], str(r["n"]), r["dtype"], *((f"{r['fwd_ms']:.2f}", f"{r['fwd_bwd_ms']:.2f}",
                                                       f"{r['peak_bytes'] / MIB:.0f}", f"{r['max_abs_diff']:.1e}")
                                                      if "error" not in r else (r["error"][:60], "", "", "")))
             for r in results]
    return ["## Triangle multiplicative update (outgoing, c_z = c_hidden)", "",
            *markdown_table(("implementation", "N", "dtype", "fwd (ms)", "fwd+bwd (ms)", "peak fwd+bwd (MiB)",
                             "max abs diff vs ds4sci-torch"), table)]
