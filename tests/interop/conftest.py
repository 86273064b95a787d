"""The interop tier's one fixture: the DeePMD-kit installation, or a skip saying how to get it."""

from __future__ import annotations

import pytest

from tests.helpers.deepmd import INSTALL_HINT, DeePMD, find_deepmd


@pytest.fixture(scope="session")
def deepmd() -> DeePMD:
    found = find_deepmd()
    if found is None:
        pytest.skip(f"DeePMD-kit not found: {INSTALL_HINT}")
    return found
