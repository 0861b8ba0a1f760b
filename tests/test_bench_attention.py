"""benchmarks/bench_attention.py keeps working: without a GPU it runs its tiny interpreter case."""

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def run_bench() -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # the CPU path, even on a machine with a GPU
    return subprocess.run(
        [sys.executable, "benchmarks/bench_attention.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_attention_benchmark_runs_its_tiny_case_and_matches_the_reference():
    out = run_bench()
    assert out.returncode == 0, out.stdout + out.stderr
    if not torch.cuda.is_available():
        assert "No CUDA GPU: the table needs a GPU" in out.stdout
    assert "bytes = sum(context_lens) * num_kv_heads * head_dim * 2 * elem_size" in out.stdout
    errors = re.findall(
        r"^num_splits=(\d+): .* max abs error vs paged_attention_ref (\S+)$", out.stdout, re.M
    )
    assert [n for n, _ in errors] == ["1", "2"], out.stdout
    assert all(float(err) < 1e-4 for _, err in errors), errors
    assert "FlexAttention paged (eager, CPU, same blocks): " in out.stdout  # a figure or n/a


def test_gpu_check_script_is_valid_and_names_existing_tests():
    script = ROOT / "benchmarks" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    named = re.findall(r"tests/\S+\.py", script.read_text())
    assert named and all((ROOT / path).exists() for path in named)
    kernel_tests = {p.name for p in (ROOT / "tests").glob("test_kernel*.py")}
    assert kernel_tests <= {Path(p).name for p in named}
