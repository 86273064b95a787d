"""The interop tier's one fixture: the DeePMD-kit installation, or a skip saying how to get it."""

from __future__ import annotations

import pytest

from tests.helpers.deepmd import INSTALL_HINT, PT_ENV_VAR, DeePMD, find_deepmd


@pytest.fixture(scope="session")
def deepmd() -> DeePMD:
    found = find_deepmd()
    if found is None:
        pytest.skip(f"DeePMD-kit not found: {INSTALL_HINT}")
    return found


@pytest.fixture(scope="session")
def deepmd_pt() -> DeePMD:
    """DeePMD-kit with its PyTorch backend (``dp --pt``): ``MDTRAIN_DEEPMD_PT_PYTHON``."""
    found = find_deepmd(PT_ENV_VAR)
    if found is None:
        pytest.skip(
            f"DeePMD-kit's PyTorch backend not found: set {PT_ENV_VAR} to the Python of a "
            'DeePMD-kit 3.2.0 environment with torch (pip install "deepmd-kit[torch]==3.2.0")'
        )
    return found
