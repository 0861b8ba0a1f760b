"""benchmarks/bench_memory_bound.py keeps working: --quick on tiny-gpt2 prints the three systems at
one KV budget, every request completed by each, and the formulas; its batching respects the budget;
repeats are reported as a median and a range, per-repeat ratios included. Timings are printed,
never asserted."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import import_benchmark

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("paged engine", "reservation engine", "generate() in reserved batches")
# system, done/total, wall s, req/s median (min-max), tok/s, sat tok/s, sat%, peak, mean,
# KV util%, of alloc%, steps
ROW = (
    r"^{name}\s+(\d+)/(\d+)\s+\d+\.\d+\s+\d+\.\d\d \(\d+\.\d\d-\d+\.\d\d\)\s+\d+\.\d\s+\d+\.\d"
    r"\s+(\d+)\s+(\d+)\s+(\d+\.\d\d)\s+(\d+\.\d)\s+(\d+\.\d)\s+(\d+)\s"
)
RATIO = r"^paged / {name}: req/s \d+\.\d\dx \(\d+\.\d\dx-\d+\.\d\dx\) \(median \(min-max\) over 1 "


@pytest.fixture(scope="module")
def bench():
    """The script as a module (it imports its neighbour, bench_engine)."""
    return import_benchmark("bench_memory_bound")


def run_bench(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # the script runs torch on one thread itself
    return subprocess.run(
        [sys.executable, "benchmarks/bench_memory_bound.py", "--model", "tiny-gpt2", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_quick_run_reports_the_three_systems_at_one_budget():
    out = run_bench("--quick")
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    rows = {}
    for name in SYSTEMS:
        m = re.search(ROW.format(name=re.escape(name)), text, re.M)
        assert m, f"no row for {name}:\n{text}"
        done, total, sat_share, peak, mean, util, util_alloc, steps = m.groups()
        assert done == total == "16", text  # --quick: 16 requests, all completed
        assert 1 <= float(mean) <= int(peak) and int(steps) > 0
        for percent in (sat_share, util, util_alloc):
            assert 0 <= float(percent) <= 100, text
        rows[name] = int(peak)
    assert rows["paged engine"] >= rows["reservation engine"], text
    # The budget is 4 max-length sequences: the reservation engine and the reserved batches hold 4.
    assert rows["reservation engine"] == rows["generate() in reserved batches"] == 4, text
    assert "torch threads 1, load average" in text  # the machine, before anything is timed
    assert "= 1,024 B per token" in text and "= 4.00 max-length (L) sequences" in text
    assert "req/s = requests completed" in text and "KV util% = mean over steps of" in text
    assert "generate() in reserved batches = transformers generate() on left-padded" in text
    assert "greedy tokens identical to the paged engine's: reservation 16/16" in text
    assert re.search(r"^repeat 1/1: req/s paged engine \d+\.\d+, .*load average \d", text, re.M)
    for name in SYSTEMS[1:]:
        assert re.search(RATIO.format(name=re.escape(name)), text, re.M), text
    assert "paper's claim for paged / reservation throughput: 2-4x" in text
    assert "same latency" in text and "NOT the same in every repeat" not in text
    assert re.search(r"^load average \(1 min\) at the end: \d+\.\d\d on \d+ CPUs$", text, re.M)


def test_bad_arguments_are_refused_before_anything_runs():
    out = run_bench("--repeats", "0")
    assert out.returncode == 2 and "--repeats must be at least 1, got 0" in out.stderr
    assert "model:" not in out.stdout  # refused before loading a model


def _run(wall, done=16, mean=3.0, **extra):
    """One system's run, as run_engine / run_padded return it (the fields report() reads)."""
    return {"name": "?", "done": done, "wall": wall, "tokens": 100, "peak": 4, "mean": mean,
            "util": 20.0, "util_alloc": 90.0, "steps": 50, "busy": [80, wall / 2],
            "outputs": {0: [1, 2]}, **extra}  # fmt: skip


def test_repeats_give_a_median_and_a_range_and_ratios_per_repeat(bench, capsys):
    runs = {
        bench.PAGED: [_run(1.0), _run(2.0), _run(1.0)],  # 16, 8, 16 req/s
        bench.RESERVED: [_run(2.0), _run(2.0), _run(1.6)],  # 8, 8, 10 req/s
        bench.PADDED: [_run(4.0), _run(4.0), _run(4.0, mean=2.0)],  # a changed mean: flagged
    }
    for name, repeats in runs.items():
        for r in repeats:
            r["name"] = name
    rows = bench.report(runs, 16)
    text = capsys.readouterr().out
    assert [r["rates"] for r in rows[:2]] == [[16.0, 8.0, 16.0], [8.0, 8.0, 10.0]]
    assert re.search(r"^paged engine .* 16\.00 \(8\.00-16\.00\) ", text, re.M), text
    # per repeat: 16/8, 8/8, 16/10 -> median 1.60x, range 1.00x-2.00x (not 16/8.0 = 2.00x)
    assert "paged / reservation engine: req/s 1.60x (1.00x-2.00x) (median (min-max) over 3" in text
    assert "NOT the same in every repeat: mean" in text  # only the reserved batches' row
    assert text.count("NOT the same in every repeat") == 1


def test_padded_batches_fit_the_budget_first_come_first_served(bench):
    max_len, slots = 512, 2048
    stream = bench.make_stream(40, max_len, seed=1)
    for prompt, output, max_tokens in stream:
        assert prompt + output <= max_len and max_tokens == max_len - prompt and output >= 1
    batches = bench.padded_batches(stream, slots, max_len)
    assert [i for b in batches for i in b] == list(range(40))  # every request, in order
    for batch in batches:
        width = max(stream[j][0] for j in batch) + max(stream[j][2] for j in batch)
        assert len(batch) * min(width, max_len) <= slots
    assert max(map(len, batches)) == slots // max_len  # every row reserves L here
