"""Shared setup of the OpenFold integration tests.

Triton kernels read TRITON_INTERPRET when they are defined, so it is set here, before any test module imports
``ds4sci.kernels.triton_evoformer`` (the CPU has no GPU driver; the interpreter runs the same kernels).
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _openfold_patches_never_leak():
    """Every test starts and ends with OpenFold unpatched."""
    from ds4sci.integrations import openfold as ds4sci_openfold

    ds4sci_openfold.disable()
    yield
    ds4sci_openfold.disable()
