"""benchmarks/bench_memory_bound.py keeps working: --quick on tiny-gpt2 prints the three systems at
one KV budget, every request completed by each, and the formulas; its batching respects the budget.
Timings are printed, never asserted."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("paged engine", "reservation engine", "transformers padded")
# system, done/total, wall s, req/s, tok/s, sat tok/s, sat%, peak, mean, KV util%, of alloc%, steps
ROW = (
    r"^{name}\s+(\d+)/(\d+)\s+\d+\.\d+\s+\d+\.\d+\s+\d+\.\d\s+\d+\.\d\s+(\d+)\s+(\d+)"
    r"\s+(\d+\.\d\d)\s+(\d+\.\d)\s+(\d+\.\d)\s+(\d+)\s"
)


def run_bench() -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}  # see test_bench_engine
    return subprocess.run(
        [sys.executable, "benchmarks/bench_memory_bound.py", "--quick", "--model", "tiny-gpt2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_quick_run_reports_the_three_systems_at_one_budget():
    out = run_bench()
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    rows = {}
    for name in SYSTEMS:
        m = re.search(ROW.format(name=name), text, re.M)
        assert m, f"no row for {name}:\n{text}"
        done, total, sat_share, peak, mean, util, util_alloc, steps = m.groups()
        assert done == total == "16", text  # --quick: 16 requests, all completed
        assert 1 <= float(mean) <= int(peak) and int(steps) > 0
        for percent in (sat_share, util, util_alloc):
            assert 0 <= float(percent) <= 100, text
        rows[name] = int(peak)
    assert rows["paged engine"] >= rows["reservation engine"], text
    # The budget is 4 max-length sequences: the reservation engine and the padded batches hold 4.
    assert rows["reservation engine"] == rows["transformers padded"] == 4, text
    assert "= 1,024 B per token" in text and "= 4.00 max-length (L) sequences" in text
    assert "req/s = requests completed" in text and "KV util% = mean over steps of" in text
    assert "greedy tokens identical to the paged engine's: reservation 16/16" in text
    assert re.search(r"^paged / reservation engine: req/s \d+\.\d\dx", text, re.M), text
    assert re.search(r"^paged / transformers padded: req/s \d+\.\d\dx", text, re.M), text
    assert "paper's claim for paged / reservation throughput: 2-4x" in text


def test_padded_batches_fit_the_budget_first_come_first_served(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from bench_memory_bound import make_stream, padded_batches

    max_len, slots = 512, 2048
    stream = make_stream(40, max_len, seed=1)
    for prompt, output, max_tokens in stream:
        assert prompt + output <= max_len and max_tokens == max_len - prompt and output >= 1
    batches = padded_batches(stream, slots, max_len)
    assert [i for b in batches for i in b] == list(range(40))  # every request, in order
    for batch in batches:
        width = max(stream[j][0] for j in batch) + max(stream[j][2] for j in batch)
        assert len(batch) * min(width, max_len) <= slots
    assert max(map(len, batches)) == slots // max_len  # every row reserves L here
