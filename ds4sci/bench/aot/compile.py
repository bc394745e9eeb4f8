"""One variant compiled for one target: tiles, shared memory, registers, spills and the exponent check.

A variant's recorded launch is compiled with

    triton.compile(ASTSource(fn=kernel, signature=..., constexprs=..., attrs=...), target=GPUTarget("cuda", cc, 32))

which records the dynamic shared memory Triton requests (``compiled.metadata.shared``) and the registers per thread,
stack frame and spill bytes that ``ptxas -v`` reports for the very compile that produced the cubin: Triton always
runs ptxas with ``-v`` and prints its log under ``TRITON_DUMP_PTXAS_LOG=1``, which the workers set (with
``TRITON_ALWAYS_COMPILE=1``, so a cache hit never skips ptxas; :mod:`.pool`). So the figures come from the ptxas and
flags Triton itself uses for each target (the wheel's ``ptxas`` for sm_80, its ``ptxas-blackwell`` for sm_90a, with
Triton's ``--regAllocOptLevel=2``), i.e. what a launch on that GPU would load.

Given a ``cache_dir``, the figures of each compilation are kept there under a key of what determines them (the
kernel's source and the sources it calls, Triton's version, the specialisation, the target, and the source of what
reads the figures: this module, the PTX check, the ptxas log), and a compilation whose key is there is read instead of
compiled: variants of different sets or calls that specialise identically (an OpenFold launch that is also a table
entry, ``--quick``'s entries) are compiled once.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import io
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ds4sci.bench.aot.ptx import unsafe_exponents
from ds4sci.bench.aot.ptxas import ptxas_usage
from ds4sci.bench.aot.specialise import ast_source
from ds4sci.bench.aot.specialise import describe_specialisation
from ds4sci.bench.aot.specialise import specialisation

if TYPE_CHECKING:
    from ds4sci.bench.aot.variants import LocalVariant
    from ds4sci.bench.aot.variants import Variant

#: compute capability -> (ptxas --gpu-name, max dynamic shared memory per block in bytes)
TARGETS: dict[int, tuple[str, int]] = {
    80: ("sm_80", 163 * 1024),  # A100: 163 KB opt-in dynamic shared memory per block
    90: ("sm_90a", 227 * 1024),  # H100: 227 KB
}


#: the fields of a record that come from the compiled code (what ``cache_dir`` keeps)
COMPILED_FIELDS = ("shared_bytes", "registers", "stack_bytes", "spill_stores", "spill_loads", "ex2", "unsafe_ex2")


def compile_variant(variant: Variant | LocalVariant, capability: int, cache_dir: str | None = None) -> dict:
    """Compile one variant for one target; a record of its tiles, resource usage and exponents (or its error).
    ``cache_dir``: a folder of earlier compilations' figures to read this one's from when there, and to add it to when
    not (``record["cached"]`` says which); errors are never kept."""
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
        signature, constexprs, attrs, _ = specialisation(kernel, args, meta, backend)
        record["specialisation"] = describe_specialisation(kernel, signature, constexprs, attrs)
        cached = None
        if cache_dir is not None:
            readers = b"".join(Path(inspect.getsourcefile(f)).read_bytes()  # what reads the figures: this file, ...
                               for f in (compile_variant, unsafe_exponents, ptxas_usage))  # ... the PTX check, ptxas's
            key = repr((kernel.cache_key, triton.__version__, signature, constexprs, attrs, meta, capability,
                        hashlib.sha256(readers).hexdigest()))
            cached = Path(cache_dir) / f"{hashlib.sha256(key.encode()).hexdigest()}.json"
        record["cached"] = cached is not None and cached.exists()
        if record["cached"]:
            record |= json.loads(cached.read_text())
        else:
            src, options = ast_source(kernel, args, meta, backend)
            with contextlib.redirect_stdout(io.StringIO()) as log:  # Triton prints ptxas's -v log here
                compiled = triton.compile(src, target=target, options=options)
            record["shared_bytes"] = int(compiled.metadata.shared)
            record |= ptxas_usage(log.getvalue())
            record["ex2"], record["unsafe_ex2"] = unsafe_exponents(compiled.asm["ptx"])
            if cached is not None:  # written whole, then renamed: a reader never sees half a record
                part = cached.with_suffix(f".{os.getpid()}.part")
                part.write_text(json.dumps({field: record[field] for field in COMPILED_FIELDS}))
                os.replace(part, cached)
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
