"""benchmarks/bench_engine.py keeps working: --quick on tiny-gpt2 prints its table and breakdown."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# a table row: system, wall s, generated tokens, tokens/s, ratio to pagedlearn
ROW = r"^{name}\s+\d+\.\d+\s+(\d+)\s+\d+\.\d\s+(\d+\.\d\d)x$"


def run_bench() -> subprocess.CompletedProcess:
    # One thread: on a small shared machine, two busy processes with two threads each slow the
    # engine's many small ops by 10x or more; this is a smoke test of the script, not of speed.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "benchmarks/bench_engine.py", "--quick", "--model", "tiny-gpt2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_engine_benchmark_prints_the_three_systems_formula_and_breakdown():
    out = run_bench()
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    # --quick: 4 prompts x 8 new tokens; every row counts what its system returned
    paged = re.search(ROW.format(name="pagedlearn LLM.generate"), text, re.M)
    assert paged and paged.groups() == ("32", "1.00"), text
    padded = re.search(ROW.format(name="transformers generate"), text, re.M)
    assert padded and padded.group(1) == "32", text
    cb = re.search(ROW.format(name=re.escape("transformers generate_batch")), text, re.M)
    unavailable = re.search(r"^transformers generate_batch: unavailable here: \S.*$", text, re.M)
    assert (cb and cb.group(1) == "32") or unavailable, text
    assert "tokens/s = generated tokens / wall seconds" in text
    assert re.search(r"identical to transformers generate's: \d/4 prompts", text), text
    assert re.search(
        r"^  bookkeeping / step time = sum\(bookkeeping_time\) / sum\(step_time\) = \d+\.\d%$",
        text,
        re.M,
    ), text
    assert re.search(r"goal: < 10%; measured: \d+\.\d%$", text, re.M), text
    for name in ("generate", "generate_batch"):
        assert f"pagedlearn / transformers {name} tokens/s: goal: >= 1.0x; measured: " in text
    # pagedlearn's pool is sized to generate()'s padded cache: the same MiB, less a partial block
    padded = re.search(r"^KV memory: generate's padded cache = 4 prompts x \((\d+) longest prompt "
                       r"\+ 8 new\) tokens x (\d+) bytes per token = ([\d.]+) MiB; pagedlearn "
                       r"gets the same$", text, re.M)  # fmt: skip
    ours = re.search(
        r"^pagedlearn: .* (\d+) blocks = (\d+) tokens = ([\d.]+) MiB of KV", text, re.M
    )
    assert padded and ours, text
    width = int(padded.group(1))
    assert int(ours.group(2)) == int(ours.group(1)) * 16  # block_size 16
    assert 4 * (width + 8) - 16 < int(ours.group(2)) <= 4 * (width + 8), text
