"""Suite-wide setup: Triton's CPU interpreter for every test that runs a Triton kernel.

``@triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is *defined*, so it is set here, before any test module
imports the kernel modules (``ds4sci.kernels.triton_evoformer``, ``ds4sci.kernels.triton_local_attention`` and the
helpers they share). ``setdefault``: on a GPU machine, ``TRITON_INTERPRET=0 pytest`` runs the same tests on the GPU
instead (see ``DEVICE`` in tests/kernels/test_triton_evoformer.py). If a kernel module was already imported with the
variable unset (a plugin imported it first), it is reloaded so that its kernels are interpreted functions, and so is
every module after it in :data:`_KERNEL_MODULES` (they import from it). The ahead-of-time compile gate needs real JIT
functions and compiles in worker processes started without the variable (``ds4sci.bench.aot.pool``). Under the
interpreter, :func:`_patching_once` spares the interpreter's repeated patching of ``triton.language`` inside a launch.
"""
import importlib
import os
import sys

import pytest

import ds4sci.spawn

os.environ.setdefault("TRITON_INTERPRET", "1")

# The tests' fork server (ds4sci.spawn.run_workers and fork_checks share it) also imports what a forked
# ``ds4sci.cli.main(["train", ...])`` imports on its way (the trainer with DeepSpeed, TensorBoard's writer, pyplot):
# ~1.9 CPU-s less for each of the suite's forked commands. It starts at the first call, after this, with the
# environment of that moment (TRITON_INTERPRET set above; DeepSpeed picks its accelerator then: the CPU here).
ds4sci.spawn.PRELOAD = (*ds4sci.spawn.PRELOAD, "ds4sci.cli", "ds4sci.train.trainer", "torch.utils.tensorboard",
                        "matplotlib.pyplot")

# Modules defining @triton.jit functions, each before the modules that import from it -> one of its jit functions
_KERNEL_MODULES = {
    "ds4sci.kernels.triton_common": "dot",
    "ds4sci.kernels.triton_evoformer": "_fwd_kernel",
    "ds4sci.kernels.triton_local_attention": "_fwd_kernel",
    "ds4sci.kernels.triton_trimul": "_in_fwd_kernel",
}
if os.environ["TRITON_INTERPRET"] == "1":
    from triton.runtime.interpreter import InterpretedFunction

    _stale = False
    for _module, _function in _KERNEL_MODULES.items():
        if _module not in sys.modules:
            continue
        _stale = _stale or not isinstance(getattr(sys.modules[_module], _function, None), InterpretedFunction)
        if _stale:
            importlib.reload(sys.modules[_module])

    import triton.runtime.interpreter as _interpreter

    class _NothingToRestore:
        def restore(self):
            pass

    def _patching_once(patch_lang):
        """Triton's interpreter patches ``triton.language`` for a launch (an ``inspect.getmembers`` walk over it,
        milliseconds) and restores it when the launch is done; it also patches it again, never restoring, on every
        call of a ``@triton.jit`` helper inside the launch: a third of the interpreter's time in kernels built of
        helpers. The returned ``patch_lang`` skips the repeat when the helper sees no language module the launch
        has not patched: the same modules are patched during the launch and restored after it, so every result is
        the same, bit for bit."""
        patched: list[set[int]] = []  # ids of the language modules the running launch has patched (one entry)

        def patch_lang_once(fn):
            langs = {id(value) for value in fn.__globals__.values()
                     if value is _interpreter.tl or value is _interpreter.tl.core}
            if patched and langs and langs <= patched[-1]:
                return _NothingToRestore()  # a helper inside a launch that has patched what it sees
            scope = patch_lang(fn)
            if patched:  # a helper seeing a module the launch has not patched: patched as Triton does
                patched[-1].update(langs)
                return scope
            restore = scope.restore  # a launch: patched until its GridExecutor restores

            def restore_and_forget():
                patched.pop()
                restore()

            scope.restore = restore_and_forget
            patched.append(langs)
            return scope

        return patch_lang_once

    if hasattr(_interpreter, "_LangPatchScope"):  # Triton versions whose launches restore what they patched
        _interpreter._patch_lang = _patching_once(_interpreter._patch_lang)


def pytest_collection_modifyitems(items):
    """Longest modules first: those holding a test marked ``first`` (the ahead-of-time compile gates, minutes of
    compiling each), then those holding a ``slow`` or ``distributed`` test, then the rest. ``make test``'s two workers
    take one module at a time each, in this order: the long modules overlap with the rest of the suite, and what is
    left when one worker runs out of modules is a short one on the other, not minutes of a long one."""
    def holding(marker):
        return {item.nodeid.split("::")[0] for item in items if item.get_closest_marker(marker)}

    first, slow = holding("first"), holding("slow") | holding("distributed")
    module = {id(item): item.nodeid.split("::")[0] for item in items}
    items.sort(key=lambda item: (module[id(item)] not in first, module[id(item)] not in slow))  # stable


def _restore_environ():
    """Put ``os.environ`` back as it was once the test (or module) is done: code under test exports what it resolved
    (``Launch.export`` writes ``RANK``, ``LOCAL_WORLD_SIZE``, ... as torchrun would), and a later test in the same
    worker that starts ranks by hand would otherwise inherit another launch's variables."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


module_environ = pytest.fixture(scope="module", autouse=True)(_restore_environ)
test_environ = pytest.fixture(autouse=True)(_restore_environ)
