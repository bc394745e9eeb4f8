"""Shared setup of the OpenFold integration tests (TRITON_INTERPRET is set suite-wide in tests/conftest.py)."""
import pytest


@pytest.fixture(autouse=True)
def _openfold_patches_never_leak():
    """Every test starts and ends with OpenFold unpatched."""
    from ds4sci.integrations import openfold as ds4sci_openfold

    ds4sci_openfold.disable()
    yield
    ds4sci_openfold.disable()
