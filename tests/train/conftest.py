"""Fixtures of the training-side tests."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture
def shm_root() -> Iterator[str]:
    """A snapshot root under /dev/shm for this test's agents; must be empty at the end."""
    root = tempfile.mkdtemp(prefix="elasticstore-test-", dir="/dev/shm")
    try:
        yield root
        left = os.listdir(root)
        assert left == [], f"left in {root}: {left}"
    finally:
        shutil.rmtree(root, ignore_errors=True)
