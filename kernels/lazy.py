"""Names a package exports without importing the modules that define them (PEP 562).

``ds4sci.kernels`` and ``ds4sci.models.genslm`` import without torch, so that their torch-free parts (backend names,
GenSLM's configuration) serve ``--help`` and the planner quickly; their other names load their module on first
access. Here, the lowest layer, so that every package above may use the one implementation.
"""
from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of ``package`` (its ``__name__``) for ``exports``, name ->
    the submodule of ``package`` that defines it: ``__getattr__, __dir__ = lazy_exports(__name__, EXPORTS)``.

    ``__getattr__(name)`` imports the submodule and returns its ``name``; it raises ``AttributeError`` for a name
    outside ``exports``, as for any missing attribute. ``__dir__()`` lists the package's names and ``exports``.
    """

    def __getattr__(name: str) -> object:
        if name in exports:
            return getattr(importlib.import_module(f".{exports[name]}", package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
