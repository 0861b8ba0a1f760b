"""benchmarks/bench_serve.py keeps working: --quick starts a server subprocess on tiny-gpt2 and
prints its three parts, each derived number next to its formula. Structure only, no timing."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NUM = r"(\d+(?:\.\d+)?)"


def test_serve_benchmark_prints_overhead_ttft_and_memory(tmp_path):
    raw = tmp_path / "raw.json"
    # One torch thread (the benchmark's default too): a smoke test of the script, not of speed.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "benchmarks/bench_serve.py", "--quick", "--json", str(raw)]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    text = out.stdout
    assert out.returncode == 0, text + out.stderr

    # 1. --quick: 27 requests of the mix, the over-long one refused by both systems, no error
    for system in (r"server \(HTTP, rate inf\)", r"LLM\.generate \(in-process\)"):
        row = rf"^  {system}\s+{NUM}\s+26\s+1\s+0\s+\d+\s+{NUM}\s+{NUM}$"
        assert re.search(row, text, re.M), text
    ratio = re.search(rf"^  server / generate = {NUM} / {NUM} tokens/s = {NUM}x$", text, re.M)
    assert ratio, text
    ours, theirs, shown = map(float, ratio.groups())
    assert abs(ours / theirs - shown) < 0.01, text  # the printed formula is the printed number
    assert "the same requests in both (ids, prompt lengths): yes" in text
    assert "compare tokens/s" in text and "NOT COMPARABLE" not in text

    # 2. both default rates, p50 <= p90 <= p99, every correctness check of the load test passed
    for rate in ("10", "40"):
        row = re.search(rf"^\s+{rate}" + rf" +{NUM}" * 6 + "  peak KV .*, checks ok$", text, re.M)
        assert row, text
        p50, p90, p99 = map(float, row.groups()[:3])
        assert p50 <= p90 <= p99

    # 3. RSS after the warm-up and both marks; the growth is the formula it prints
    rss = [re.search(rf"^  after {when}\s+{NUM} MiB", text, re.M) for when in
           ("the warm-up", "40 requests", "100 requests")]  # fmt: skip
    assert all(rss), text
    growth = rf"^  growth = \({NUM} - {NUM}\) MiB / \(100 - 40\) requests x 1,000 = (-?[\d.]+) MiB"
    growth = re.search(growth, text, re.M)
    assert growth, text
    b, a, g = map(float, growth.groups())
    assert abs((b - a) / 60 * 1000 - g) < 0.01 / 60 * 1000 + 0.001, text  # RSS printed to 0.01
    # every answer was the expected one (bad bodies: 400; the rest: 200, streams ending [DONE])
    assert re.search(r"^  answers: .*bad ok 6.*; unexpected: 0$", text, re.M), text
    assert "after the run (/metrics): 0 blocks held, 0 requests running" in text

    numbers = json.loads(raw.read_text())
    o = numbers["overhead"]["tiny-gpt2"]
    assert o["num_requests"] == 27 and o["same_requests"] is True
    assert o["ratio"] == o["server"]["tokens_per_s"] / o["generate"]["tokens_per_s"]
    assert sorted(numbers["ttft"]) == ["10.0", "40.0"]
    assert [p["requests"] for p in numbers["rss"]["points"]] == [0, 40, 100]
