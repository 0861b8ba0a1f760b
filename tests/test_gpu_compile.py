"""The kernels compile for a real GPU (sm_90: H100/H200), even on this machine without one.

The interpreter never compiles anything, so without this a kernel could pass every CPU test and
still fail to build on the first GPU it meets. ``kernels.gpu_compile`` runs Triton's compiler
down to machine code (ptxas) for each kernel and shape, with the constants the wrappers use.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_kernel_compiles_for_sm_90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # really compile
    out = subprocess.run(
        [sys.executable, "-m", "kernels.gpu_compile", "--arch", "90"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = re.findall(r"^(\w+).*sm_90\s+(\S+)\s+(\S+) ok$", out.stdout, re.M)
    assert {name for name, _, _ in rows} == {"decode", "merge", "prefill", "write_kv"}
    assert len(rows) == 4 * 3 * 5  # shapes x dtypes x (decode twice, merge, prefill, write_kv)
    assert "0 failed" in out.stdout
