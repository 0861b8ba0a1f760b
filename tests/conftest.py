"""Set-up shared by all tests.

Triton's CPU interpreter: Triton compiles kernels for GPUs, but runs them on the CPU (slowly, with
NumPy) when ``TRITON_INTERPRET=1`` is in the environment *before triton is imported*. Without a GPU
we set it here, before any test module imports ``kernels``, so plain ``pytest`` is enough. With a
GPU the kernels compile for real, and the same tests run on it.
"""

import os

import pytest


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


HAS_CUDA = _has_cuda()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped without one, even under ``make test-all`` (``-m ""``)."""
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
