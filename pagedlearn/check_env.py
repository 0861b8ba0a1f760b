"""``python -m pagedlearn check-env``: one [OK] / [FAIL] line per dependency, then the hardware.

Paste its output into a bug report (the README's troubleshooting section asks for it). Lines:

- ``[OK]``   installed and importable (with its version);
- ``[FAIL]`` a required package is missing or broken -- the fix is printed beside it;
- ``[--]``   something optional that is absent here (a GPU, a dev tool): pagedlearn works
  without it.

The exit code is 1 when a required package fails, 0 otherwise (a machine without a GPU passes).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path

# (distribution name, import name). tests/test_packaging.py checks these against pyproject.toml.
REQUIRED = [
    ("torch", "torch"),
    ("triton", "triton"),
    ("transformers", "transformers"),
    ("matplotlib", "matplotlib"),
    ("ipywidgets", "ipywidgets"),
    ("jupyterlab", "jupyterlab"),
]
DEV = [
    ("pytest", "pytest"),
    ("hypothesis", "hypothesis"),
    ("nbmake", "nbmake"),
    ("jupytext", "jupytext"),
    ("ruff", "ruff"),
]

PROBE_TIMEOUT_S = 120  # the interpreter probe imports torch and Triton in a fresh process


def _probe(dist: str, module: str) -> tuple[bool, str]:
    try:
        importlib.import_module(module)
    except Exception as e:  # a broken install raises anything, not only ImportError
        return False, f"{type(e).__name__}: {e}".splitlines()[0][:160]
    try:
        return True, importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return True, "(version unknown)"


def _run_triton_probe(device: str) -> tuple[bool, str]:
    env = dict(os.environ)
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    root = Path(__file__).resolve().parent.parent  # so `kernels` imports from a source checkout
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    try:
        out = subprocess.run(
            [sys.executable, "-m", "kernels.probe", device],
            env=env,
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return False, f"no answer within {PROBE_TIMEOUT_S} s"
    lines = (out.stdout + out.stderr).strip().splitlines()
    return out.returncode == 0, (lines[-1] if lines else f"exit code {out.returncode}")


def check_env(include_dev: bool = True) -> int:
    """Print the report; return the exit code."""
    print(
        f"pagedlearn environment check -- Python {platform.python_version()}, "
        f"{platform.system()} {platform.machine()}"
    )
    ok = True
    linux = platform.system() == "Linux"
    for dist, module in REQUIRED:
        good, detail = _probe(dist, module)
        if good:
            print(f"[OK]   {dist} {detail}")
        elif dist == "triton" and not linux:
            print(
                "[--]   triton: not available on this platform; the kernels need it, "
                "the PyTorch reference backend does not"
            )
        else:
            ok = False
            print(f"[FAIL] {dist}: {detail}  -> run `make install` (or pip install -e .)")
    if include_dev:
        for dist, module in DEV:
            good, detail = _probe(dist, module)
            print(
                f"[OK]   {dist} {detail} (dev)"
                if good
                else f"[--]   {dist}: not installed (dev extra: pip install -e '.[dev]')"
            )

    torch_ok, _ = _probe("torch", "torch")
    triton_ok, _ = _probe("triton", "triton")
    gpu = False
    if torch_ok:
        import torch

        gpu = torch.cuda.is_available()
        if gpu:
            print(f"[OK]   GPU: {torch.cuda.get_device_name(0)} (torch CUDA {torch.version.cuda})")
        else:
            print(
                "[--]   GPU: none -- fine: the reference backend runs on the CPU, and the "
                "Triton kernels run in Triton's CPU interpreter (slowly)"
            )
    if torch_ok and triton_ok:
        if gpu:
            good, detail = _run_triton_probe("cuda")
            print(f"[{'OK' if good else 'FAIL'}]{'  ' if good else ''} Triton on the GPU: {detail}")
            ok &= good
        good, detail = _run_triton_probe("cpu")
        print(
            f"[{'OK' if good else 'FAIL'}]{'  ' if good else ''} Triton CPU interpreter "
            f"(TRITON_INTERPRET=1): {detail}"
        )
        ok &= good
    print("all required parts are usable" if ok else "some required parts failed (see [FAIL])")
    return 0 if ok else 1
