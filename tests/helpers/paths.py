"""Where things are, for the tests: the repository, the helper modules and the programs the tests
start (training scripts and simulated nodes under ``helpers/programs/``)."""

from __future__ import annotations

import os

HELPERS = os.path.dirname(os.path.abspath(__file__))
PROGRAMS = os.path.join(HELPERS, "programs")
TESTS = os.path.dirname(HELPERS)
ROOT = os.path.dirname(TESTS)


def program(name: str) -> str:
    """The path of a program under ``helpers/programs/``."""
    path = os.path.join(PROGRAMS, name)
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    return path
