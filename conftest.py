"""Before pytest collects anything: is this the project's Python?

Plain ``pytest`` outside the virtual environment that ``make install`` builds finds a pytest
without pagedlearn's dependencies, and every test file then fails to import (hundreds of
collection errors, each ending in ``No module named ...``). This file, at the repository's root,
is the first conftest pytest loads, so it checks the dependencies first and ends the run with one
line saying what to run instead. It only looks the modules up (``find_spec``), importing none of
them: the normal run pays nothing. The tests' own set-up is ``tests/conftest.py``.
"""

import importlib.util
import sys
from pathlib import Path

import pytest

# What every test module needs (pyproject.toml's dependencies, and the dev extra's hypothesis).
NEEDED = ("torch", "transformers", "numpy", "matplotlib", "hypothesis")


def _missing(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except ValueError:  # sys.modules[name] = None, as a test that hides a module sets it
        return True


def pytest_configure(config):
    """Runs before collection (and before xdist starts its workers)."""
    missing = [name for name in NEEDED if _missing(name)]
    if missing:
        venv = Path(__file__).resolve().parent / ".venv"
        pytest.exit(
            f"{sys.executable} has no {', '.join(missing)}: this is not the project's Python. "
            "Run `make test` (it installs .venv first), or `.venv/bin/python -m pytest` after "
            "`make install`" + ("" if venv.exists() else " (there is no .venv yet)") + "; with "
            "conda: `conda activate pagedlearn`, then `python -m pytest`",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )
