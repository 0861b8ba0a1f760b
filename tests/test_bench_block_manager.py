"""benchmarks/bench_block_manager.py keeps working without its peers: --quick prints the machine,
says which peers are missing and how to get them, checks equal work, and fills the pagedlearn
columns of every workload. Timings are never asserted."""

import doctest
import json
import re
import subprocess
import sys
from pathlib import Path

from helpers import import_benchmark

ROOT = Path(__file__).resolve().parent.parent
NUM = r"\d[\d.e+]*"  # a printed median: 0.312, 12.4, 1357
RATIO = rf"(?:{NUM}|n/a)"
# --quick: two pool sizes (1k, 10k); caching off and on where the workload has the switch
ROWS = [
    ("a decode us/token", "off"),
    ("a decode us/token", "on"),
    ("a decode, trace kept us/token", "on"),
    ("b admission us/request", "off"),
    ("b admission us/request", "on"),
    *[(f"c1 churn {n} us/cycle", c) for n in ("1k", "10k") for c in ("off", "on")],
    *[(f"c{k} {w} {n} ns/op", "-") for k, w in ((2, "allocate+free"), (3, "hit take-out"))
      for n in ("1k", "10k")],
]  # fmt: skip


def test_quick_run_without_peers_prints_every_workload(tmp_path):
    out_json = tmp_path / "raw.json"
    cmd = [sys.executable, "benchmarks/bench_block_manager.py", "--quick", "--json", str(out_json)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    first = text.splitlines()[0]
    assert re.match(
        r"Python \d+\.\d+\.\d+ on \S+, \d+ CPUs, load average \d+\.\d\d; pagedlearn ", first
    )
    # CI has no vLLM; nano-vllm needs --nanovllm DIR: each missing peer gets a line saying how
    vllm_line = re.search(r"^peer( missing)?: vLLM.*$", text, re.M)
    assert vllm_line, text
    if vllm_line.group(1):
        assert "vllm==0.33.0" in vllm_line.group(0)
    assert re.search(r"^peer missing: nano-vllm: no --nanovllm DIR given; .*nano-vllm", text, re.M)

    assert "MISMATCH in" not in text, text  # the systems end in one state
    peers = "same" if not vllm_line.group(1) else "alone"  # without a peer: nothing compared
    if peers == "alone":
        assert "only pagedlearn ran (no peer): its 2 repetitions ended in the same state" in text
    for label, cache in ROWS:  # pagedlearn's median, then vLLM's and nano-vllm's (or n/a)
        row = rf"^{re.escape(label)}\s+{cache}\s+({NUM})\s+(?:{NUM}|n/a)\s+(?:{NUM}|n/a)"
        assert re.search(rf"{row}\s+{RATIO}\s+{RATIO}$", text, re.M), (label, cache, text)
        assert re.search(rf"^  {peers}\s+{re.escape(label)}", text, re.M), label
    assert re.search(r"^nano-vllm\s", text, re.M) is None  # a missing peer gets no rows of its own
    assert "PL/x = median over repetitions of (pagedlearn / x" in text
    assert "us/token = timed s x 1e6 / (sequences x steps)" in text
    assert "pagedlearn plain" not in text  # one pagedlearn: the fast twins are gone
    for system in ("pagedlearn", "deque.remove"):  # the O(1) section
        assert re.search(rf"^  {system}\s+({NUM}|n/a)\s", text, re.M), system

    raw = json.loads(out_json.read_text())
    assert raw["reps"] == 2 and len(raw["runs"]) == len(ROWS)
    assert all(len(v) == 2 for run in raw["runs"] for v in run["values"].values())


def test_equal_work_says_alone_when_nothing_was_compared_and_catches_a_repetition():
    # The report once printed "ok" beside one system's state, under "(MISMATCH: ...)".
    bench = import_benchmark("bench_block_manager")
    assert doctest.testmod(bench).failed == 0
    assert bench.equal_work({"pagedlearn": [(4,), (4,)]}) == "alone"
    assert bench.equal_work({"pagedlearn": [(4,), (5,)]}) == "MISMATCH"  # one system, two states
    assert bench.equal_work({"pagedlearn": [(4,)], "nano-vllm": [(4,)]}) == "same"
