"""Suite-wide setup: Triton's CPU interpreter for every test that runs the triton backend.

``@triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is *defined*, so it is set here, before any test module
imports ``ds4sci.kernels.triton_evoformer``. ``setdefault``: on a GPU machine, ``TRITON_INTERPRET=0 pytest`` runs the
same tests on the GPU instead (see ``DEVICE`` in tests/kernels/test_triton_evoformer.py). If the kernel module was
already imported with the variable unset (a plugin imported it first), it is reloaded so that its kernels are
interpreted functions. The ahead-of-time compile gate needs real JIT functions and compiles in worker processes
started without the variable (``ds4sci.bench.kernels_aot``).
"""
import importlib
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

_KERNELS = "ds4sci.kernels.triton_evoformer"
if os.environ["TRITON_INTERPRET"] == "1" and _KERNELS in sys.modules:
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(sys.modules[_KERNELS]._fwd_kernel, InterpretedFunction):
        importlib.reload(sys.modules[_KERNELS])
