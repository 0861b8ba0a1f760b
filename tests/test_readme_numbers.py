"""The README's "Do we get the paper's numbers?" prints what the code computes now.

That section prints two kinds of numbers of ours (beside the paper's, quoted):

- **simulated**: seeded, deterministic results -- the memory simulations (``pagedlearn.sim``, on the
  real ``KVCacheManager``), Figure 12 on a fixed clock, and the throughput benchmark's memory
  columns (which requests run together: the engine's scheduling, not its clock). Every one is
  recomputed here at the README's sizes (``paper.NUM_REQUESTS``, 300 requests per width for
  Figure 15) and must appear in the README as printed: a README edit that changes one, or a
  code change that moves one, fails here with the sentence to write.
- **measured**: timings of one machine's runs (Figure 19's milliseconds, Figure 12's rates on
  the thread-CPU clock, the throughput benchmark's requests per second). Never asserted; the
  last test checks that the README says they are measurements, from which runs.

Each test recomputes one experiment at full size, a few seconds on one core (about 45 s in all),
so that ``pytest -n`` spreads them over the cores.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from pagedlearn.sim import paper, prefix, serving_latency, sharing
from pagedlearn.sim.simulator import simulate

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.fixture(scope="module")
def section() -> str:
    """The section's text on one line (the README wraps where it likes)."""
    text = README.read_text().split("## Do we get the paper's numbers?", 1)[1]
    return " ".join(text.split("\n## ", 1)[0].split())


def said(section: str, *phrases: str) -> None:
    for phrase in phrases:
        assert phrase in section, f"the README should say {phrase!r} (what the code computes)"


def test_the_setting(section):
    said(
        section, f"{paper.POOL_SLOTS:,} token slots ({paper.BYTES_PER_TOKEN // 1024} KiB per token)"
    )
    said(section, f"floor({paper.POOL_SLOTS:,} / 2048) = {paper.POOL_SLOTS // 2048}")
    cap = inspect.signature(simulate).parameters["max_num_seqs"].default
    said(section, f"under the {cap}-request cap")


def test_figure19s_kv_size(section):
    """Figure 19's times are measured; the bytes they move are not. ``gpt2-size-random`` is built
    from ``GPT2Config()``'s defaults (GPT-2 small's shape) in float32 (``models/loader.py``)."""
    from types import SimpleNamespace

    import torch
    from transformers import GPT2Config

    from pagedlearn.models.runner import kv_cache_spec

    spec = kv_cache_spec(SimpleNamespace(config=GPT2Config(), dtype=torch.float32))
    said(section, f"random weights, {spec.bytes_per_token * 512 / 1e6:.1f} MB of KV)")
    said(section, "swapping 512 tokens' KV")


def _fmt(value) -> str:
    """A Figure 2 table number: one decimal, 0 as 0, "—" where the paper gives none."""
    return "—" if value is None else "0" if value == 0 else f"{value:.1f}"


def test_figure2_and_figure13_sharegpt(section):
    names = {"max": "Orca (Max)", "pow2": "Orca (Pow2)", "oracle": "Orca (Oracle)"}
    names["vllm"] = "vLLM (paging, block 16)"
    parts = ("token_states", "reserved", "internal", "external_and_other")
    for row in paper.figure2("sharegpt"):
        cells = [f"{_fmt(row[p])} / {_fmt(row[f'paper_{p}'])}" for p in parts]
        if row["system"] == "vllm":  # paging reserves nothing ahead: no number to give
            assert row["reserved"] == 0
            cells[1] = "—"
        said(section, f"| {names[row['system']]} | " + " | ".join(cells) + " |")
    rows = paper.figure13("sharegpt")
    ours = " / ".join(f"{r['mean_batch']:.2f}" for r in rows)
    theirs = " / ".join(f"{r['paper_mean_batch']:.2f}" for r in rows)
    said(section, f"ShareGPT-like: {ours} vs {theirs}")
    gap = {r["system"]: 100 * (r["mean_batch"] / r["paper_mean_batch"] - 1) for r in rows}
    close = max(abs(gap["pow2"]), abs(gap["vllm"]))
    side = "below" if gap["oracle"] < 0 else "above"
    said(
        section,
        f"Pow2 and vLLM within {close:.1f}% of the paper's, Oracle "
        f"{abs(gap['oracle']):.1f}% {side}",
    )
    assert rows[0]["mean_batch"] == paper.POOL_SLOTS // 2048  # Max: exactly, by arithmetic


def test_figure13_alpaca_and_at_30_requests_per_second(section):
    rows = {r["system"]: r for r in paper.figure13("alpaca")}
    ours = " / ".join(f"{r['mean_batch']:.2f}" for r in rows.values())
    theirs = " / ".join(f"{r['paper_mean_batch']:.2f}" for r in rows.values())
    said(section, f"Alpaca-like: {ours} vs {theirs}")
    said(
        section,
        f"vLLM's {rows['vllm']['paper_mean_batch']:.0f} is below what memory allows, "
        f"our {rows['vllm']['mean_batch']:.0f}",
    )
    rates = paper.rate_sensitivity("alpaca", 30.0)
    batch = {(r["system"], r["step_ms"]): r["mean_batch"] for r in rates}
    steps = sorted({r["step_ms"] for r in rates})
    said(section, f"assumed steps of {steps[0]:.0f}, {steps[1]:.0f} and {steps[2]:.0f} ms")
    vllm = [f"{batch['vllm', s]:.0f}" for s in steps]
    said(section, f"vLLM's batch is then {vllm[0]}, {vllm[1]} and {vllm[2]} (demand-bound)")
    assert {f"{batch['max', s]:.0f}" for s in steps} == {"7"}
    said(section, "while Max stays at 7")
    said(section, f"Pow2 stops at {batch['pow2', steps[1]]:.1f} and {batch['pow2', steps[2]]:.1f}")


def test_the_length_spread(section):
    rows = paper.spread_sensitivity("sharegpt", (0.5, 1.5))
    vllm = [f"{r['mean_batch']:.1f}" for r in rows if r["system"] == "vllm"]
    said(section, f"vLLM's ShareGPT batch goes from {vllm[0]} to {vllm[1]} while Max stays at 7")
    assert {r["mean_batch"] for r in rows if r["system"] == "max"} == {7.0}


def test_figure18b_block_size(section):
    internal = {
        (w, r["block_size"]): r["internal"]
        for w in ("sharegpt", "alpaca")
        for r in paper.figure18b(w, block_sizes=(16, 32, 128, 256))
    }
    s, a = "sharegpt", "alpaca"
    said(
        section,
        f"ShareGPT slowly, from {internal[s, 16]:.1f}% at block 16 to "
        f"{internal[s, 128]:.1f}% at 128",
    )
    said(
        section,
        f"Alpaca's short requests fast, from {internal[a, 16]:.1f}% at 16 and "
        f"{internal[a, 32]:.1f}% at 32 to {internal[a, 256]:.1f}% at 256",
    )


def test_figure15_alpaca_and_the_beam_model(section):
    rows = sharing.figure15(workloads=("alpaca",), num_requests=300)
    for mode, label in (("parallel", "parallel sampling"), ("beam", "beam search")):
        mine = [r for r in rows if r["mode"] == mode]
        ours = " / ".join(f"{r['saved_pct']:.1f}" for r in mine)
        theirs = " / ".join(f"{r['paper_saved_pct']:.2f}" for r in mine)
        said(section, f"{label}: {ours} vs {theirs}")
    said(section, f"drops a beam with probability {sharing.DIVERGENCE} per step")
    sweep = sharing.divergence_sweep("alpaca", 4, divergences=(0.0, 0.4), num_requests=300)
    low, high = (f"{r['saved_pct']:.0f}" for r in sweep)
    said(section, f"0 to 0.4 moves width-4 savings from {low}% to {high}%")


def test_figure15_sharegpt_ranges(section):
    rows = sharing.figure15(workloads=("sharegpt",), num_requests=300)
    parallel = [r["saved_pct"] for r in rows if r["mode"] == "parallel"]
    wide_beams = [r["saved_pct"] for r in rows if r["mode"] == "beam" and r["width"] >= 4]
    paper_parallel, paper_beam = (sharing.PAPER_FIG15["sharegpt", m] for m in ("parallel", "beam"))
    said(
        section,
        f"our parallel sampling saves {min(parallel):.0f}-{max(parallel):.0f}%, below "
        f"the paper's {paper_parallel}% or at its low end",
    )
    said(
        section,
        f"our beam search more than its {paper_beam}% at widths 4 and 6 "
        f"({min(wide_beams):.0f}-{max(wide_beams):.0f}%)",
    )
    low, high = map(float, paper_parallel.split("-"))
    assert min(parallel) < low and max(parallel) < (low + high) / 2  # below, or its low end
    assert min(wide_beams) > float(paper_beam.split("-")[1])  # more: above the whole range


def test_prefix_caching(section):
    rows = {(r["stream"], r["cache"]): r for r in prefix.experiment()}
    shared = rows["shared-prompt", "cold"]
    said(section, f"{shared['hit_rate_pct']:.0f}% of the prompt tokens asked for are found")
    said(section, f"sharing saves {shared['memory_saved_pct']:.0f}% of the memory in use")
    said(section, f"({shared['preemptions']} preemptions)")
    few, many = "multi-turn (20 chats)", "multi-turn (100 chats)"
    said(
        section,
        f"20 conversations hit {rows[few, 'cold']['hit_rate_pct']:.0f}% cold and "
        f"{rows[few, 'warm']['hit_rate_pct']:.0f}% warm",
    )
    said(section, f"100 conversations hit only {rows[many, 'cold']['hit_rate_pct']:.0f}%")


def test_figure12_on_a_fixed_clock(section):
    """Figure 12 on a fixed clock charges every step the same: no timing in it, so its ratio is
    as deterministic as the simulations (the measured sweep's is not)."""
    _, summary = serving_latency.measure(step_seconds=0.001)
    bound = "at least " if not summary["exploded"]["paged"] else ""
    said(
        section,
        f"(`measure(step_seconds=0.001)`, the quick setting), paged / max is "
        f"{bound}{summary['ratio']:.1f}x",
    )


def test_measured_numbers_are_said_to_be_measurements(section):
    """Timings are not asserted; the README says which runs they come from."""
    said(section, "Figure 19, swap vs recompute, is a measurement, not a simulation")
    # Figure 19's milliseconds: which run, under which conditions
    said(section, "the run that drew `figures/paper_fig19_swap_recompute.png` timed every block")
    said(section, "a point whose spread is large needs a rerun before its shape means anything")
    said(section, "Over two runs the paged engine sustained")  # Figure 12 on the CPU clock
    said(section, "median (min-max) of 3 repeats", "load average")  # the benchmark's table


@pytest.fixture(scope="module")
def bench():
    """benchmarks/bench_memory_bound.py as a module (it imports its neighbour, bench_engine)."""
    import importlib
    import sys

    folder = str(README.parent / "benchmarks")
    sys.path.insert(0, folder)
    try:
        return importlib.import_module("bench_memory_bound")
    finally:
        sys.path.remove(folder)


@pytest.mark.parametrize(
    ("label", "max_len", "num_requests"),
    [
        ("tiny-gpt2, L = 512, 120 requests", 512, 120),
        ("GPT-2-small-sized, L = 256, 128 requests", 256, 128),
    ],
)
def test_the_benchmarks_memory_columns(section, bench, label, max_len, num_requests):
    """The throughput table's memory columns: which requests run together, and which slots hold
    tokens, follow from the stream and the budget in tokens alone (every request stops at its
    sampled length; the clock plays no part), whatever the model computes. So ``tiny-gpt2``
    recomputes them for the GPT-2-small-sized row too, in seconds instead of minutes."""
    import torch

    from pagedlearn.models import load

    loaded = load("tiny-gpt2")
    stream = bench.make_stream(num_requests, max_len, seed=0)
    prompts = bench.make_prompts(stream, loaded.model.config, seed=0)
    num_blocks = bench.DEFAULT_RESERVATIONS * max_len // bench.BLOCK_SIZE  # the default budget
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the benchmark runs: small ops, and another process's cores
    try:
        runs = [
            bench.run_engine(name, llm, prompts, stream)
            for name, llm in bench.engines(loaded, num_blocks, num_requests, "cpu").items()
        ]
    finally:
        torch.set_num_threads(threads)
    assert [r["done"] for r in runs] == [num_requests] * 2
    paged, held = runs
    (row,) = [line for line in README.read_text().splitlines() if line.startswith(f"| {label} |")]
    memory = (
        f"| {paged['mean']:.1f} / {held['mean']:.1f} | {paged['util']:.0f}% / {held['util']:.0f}% |"
    )
    assert row.endswith(memory), f"the README's row {label!r} should end with {memory!r}"
