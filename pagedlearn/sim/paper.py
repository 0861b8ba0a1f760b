"""The paper's memory experiments, recomputed with the project's own allocator, beside its numbers.

Kwon et al., SOSP 2023 (arXiv 2309.06180). Setting: OPT-13B on one A100-40GB with a 12 GB KV
budget; one token's K/V takes 2 (K and V) x 5120 (hidden) x 40 (layers) x 2 bytes = 800 KiB, so
the pool holds 12 GiB / 800 KiB = 15,728 token slots ("15.7K"). Each experiment returns a tidy
table (a list of dicts, one per row) with the paper's number beside ours.
"""

import os
from functools import lru_cache

from pagedlearn.progress import Progress, Stopwatch, write
from pagedlearn.sim.simulator import ContiguousMemory, PagedMemory, simulate
from pagedlearn.sim.workloads import paper_workload

BYTES_PER_TOKEN = 2 * 5120 * 40 * 2  # OPT-13B, fp16: 819,200 bytes
POOL_SLOTS = 12 * 2**30 // BYTES_PER_TOKEN  # 15,728
SYSTEMS = ("max", "pow2", "oracle", "vllm")
BLOCK_SIZE = 16  # vLLM's default, the paper's setting
# Requests per saturated run. A saturated server's batch drifts towards long requests (they stay
# longest) and settles after several lifetimes of the longest ones; at these sizes doubling the
# run moves no batch size by more than ~2%.
NUM_REQUESTS = {"sharegpt": 2000, "alpaca": 4000}

# Figure 2: % of KV memory (token states, reserved, internal frag., external frag. and other).
PAPER_FIG2 = {
    "max": (20.4, 13.3, 57.3, 8.9),
    "pow2": (26.8, 17.9, 13.6, 41.6),
    "oracle": (38.2, 25.2, 0.0, 36.6),
    "vllm": (96.3, None, None, None),  # the other 3.7% is not broken down in the paper
}
# Figure 13: average number of batched requests, OPT-13B (ShareGPT at 2 req/s, Alpaca at 30).
PAPER_FIG13 = {
    "sharegpt": {"max": 7.00, "pow2": 9.81, "oracle": 13.62, "vllm": 30.42},
    "alpaca": {"max": 7.00, "pow2": 43.24, "oracle": 72.75, "vllm": 132.44},
}


def make_memory(system: str, pool_slots: int = POOL_SLOTS, block_size: int = BLOCK_SIZE):
    """The memory model behind a system name: "max", "pow2", "oracle" or "vllm"."""
    if system == "vllm":
        return PagedMemory(pool_slots, block_size)
    return ContiguousMemory(pool_slots, system)


@lru_cache(maxsize=64)
def run(
    system, workload, num_requests, spread=1.0, seed=0, pool_slots=POOL_SLOTS, block_size=BLOCK_SIZE
):
    """One saturated simulation (cached: Figures 2 and 13 read the same runs)."""
    requests = paper_workload(workload, num_requests, spread=spread, seed=seed)
    return simulate(requests, make_memory(system, pool_slots, block_size))


def figure2_parts(breakdown: dict) -> dict:
    """A simulator's mean breakdown (% of the pool) in Figure 2's categories: the paper counts
    buddy rounding and free-but-unusable slots together as "external fragmentation and other"
    (``buddy_rounding`` stays alongside, to show how much of that is rounding)."""
    b = breakdown
    return {
        "token_states": b["token_states"],
        "reserved": b["reserved"],
        "internal": b["internal"],
        "external_and_other": b["buddy_rounding"] + b["free"],
        "buddy_rounding": b["buddy_rounding"],
    }


def figure2(
    workload="sharegpt",
    num_requests=None,
    spread=1.0,
    seed=0,
    pool_slots=POOL_SLOTS,
    systems=SYSTEMS,
):
    """Figure 2: where the KV memory goes, per system, averaged over the steps under load.

    The server is saturated (every request arrives at once), as in the paper's measurement; the
    average covers the steps with a queue, when free memory is memory no one can use.
    ``systems``: which rows (each is its own run).
    """
    num_requests = num_requests or NUM_REQUESTS[workload]
    rows = []
    for system in systems:
        b = run(system, workload, num_requests, spread, seed, pool_slots, BLOCK_SIZE)
        b = b.mean_breakdown()
        paper = PAPER_FIG2[system]
        rows.append(
            {
                "system": system,
                **figure2_parts(b),
                "paper_token_states": paper[0],
                "paper_reserved": paper[1],
                "paper_internal": paper[2],
                "paper_external_and_other": paper[3],
            }
        )
    return rows


def figure13(
    workload="sharegpt",
    num_requests=None,
    spread=1.0,
    seed=0,
    pool_slots=POOL_SLOTS,
    systems=SYSTEMS,
):
    """Figure 13: the average number of requests batched together, per system.

    Saturated arrivals (every request at time 0): the batch is then what each memory model
    allows, memory's limit, whatever a step takes. The paper ran ShareGPT at 2 req/s and Alpaca
    at 30 req/s. ShareGPT's long requests fill memory at that rate (our saturated batches land
    near the paper's). Alpaca's short requests do not: Max stays at its memory limit, but
    vLLM's batch is set by demand (Little's law: rate x time a request stays, which depends on
    the step time), below what memory allows -- :func:`rate_sensitivity` shows it, and chapter
    08 tells it. ``preemptions`` counts vLLM's recompute preemptions. ``systems``: which rows.
    """
    num_requests = num_requests or NUM_REQUESTS[workload]
    rows = []
    for system in systems:
        result = run(system, workload, num_requests, spread, seed, pool_slots, BLOCK_SIZE)
        rows.append(
            {
                "system": system,
                "mean_batch": result.mean_batch(),
                "paper_mean_batch": PAPER_FIG13[workload][system],
                "preemptions": result.preemptions,
                "finished": result.finished,
            }
        )
    return rows


def spread_sensitivity(workload="sharegpt", spreads=(0.5, 0.75, 1.0, 1.25, 1.5), **kwargs):
    """Figure 13's batch sizes as the length distribution's spread varies (sigma x spread).

    The spread was fixed before any experiment ran (see ``workloads``); this shows how much the
    conclusions depend on that choice instead of tuning it to the paper.
    """
    rows = []
    for spread in spreads:
        for row in figure13(workload, spread=spread, **kwargs):
            rows.append({"spread": spread, **row})
    return rows


def rate_sensitivity(workload="alpaca", rate=30.0, step_times=(0.02, 0.04, 0.08), **kwargs):
    """Figure 13 at the paper's arrival rate instead of saturated, for assumed step times.

    How many requests run together at a given rate depends on how long a step takes (a request
    holds memory for ``output_len`` steps), which a memory simulation cannot know: OPT-13B's
    iteration time on an A100 grows with the batch. So this shows the batch each system reaches
    for a few fixed step times, rather than picking one.
    """
    num_requests = kwargs.pop("num_requests", None) or NUM_REQUESTS[workload]
    requests = paper_workload(workload, num_requests, rate=rate, **kwargs)
    rows = []
    for step in step_times:
        for system in SYSTEMS:
            result = simulate(requests, make_memory(system), step_seconds=step)
            rows.append(
                {
                    "step_ms": 1000 * step,
                    "system": system,
                    "mean_batch": result.mean_batch(under_load=False),
                    "paper_mean_batch": PAPER_FIG13[workload][system],
                }
            )
    return rows


def figure18b(
    workload="sharegpt",
    block_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256),
    num_requests=None,
    spread=1.0,
    seed=0,
):
    """Figure 18b, the memory side: paging's internal waste and batch size vs block size."""
    num_requests = num_requests or NUM_REQUESTS[workload]
    rows = []
    for block_size in block_sizes:
        # Same positional arguments as Figures 2 and 13, so block 16 reuses their cached run.
        result = run("vllm", workload, num_requests, spread, seed, POOL_SLOTS, block_size)
        b = result.mean_breakdown()
        rows.append(
            {
                "block_size": block_size,
                "mean_batch": result.mean_batch(),
                "token_states": b["token_states"],
                "internal": b["internal"],
                "preemptions": result.preemptions,
            }
        )
    return rows


def format_rows(rows, digits=1) -> str:
    """A plain-text table of tidy rows (floats rounded, None as '-')."""
    if not rows:
        return "(no rows)"
    keys = list(rows[0])

    def cell(v):
        if v is None:
            return "-"
        return f"{v:.{digits}f}" if isinstance(v, float) else str(v)

    cells = [[cell(r[k]) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    lines = ["  ".join(k.rjust(w) for k, w in zip(keys, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def report(quick: bool = False, out=None, figures_dir=None) -> list:
    """Run every experiment and print ours beside the paper's (``python -m pagedlearn paper``):
    the memory simulations, then Figures 19 and 12, measured on this machine's engine.

    ``out``: where the tables go (default: stdout, flushed after each). Progress goes to stderr
    whatever ``out`` is (:mod:`pagedlearn.progress`): four parts, each with its own estimate,
    since their units of work (a simulated token, a simulated beam-search request, a timed copy,
    a served request) cost different amounts.
    With ``figures_dir``, also write one PNG per experiment there; returns their paths.
    """
    from pagedlearn.sim import prefix, serving_latency, sharing, swap_recompute

    out = out or write  # stdout, flushed, clear of the progress bars on a terminal
    n = {"sharegpt": 300, "alpaca": 800} if quick else NUM_REQUESTS
    spreads = (0.5, 1.0, 1.5) if quick else (0.5, 0.75, 1.0, 1.25, 1.5)
    per_request = 60 if quick else 300
    watch = Stopwatch()
    # The work of parts 1 and 2, to estimate what is left. Part 1 counts tokens (prompt + output)
    # of the requests simulated anew: a ShareGPT-like request is ~6x an Alpaca-like one, and costs
    # about that much more. run() is cached: Figure 13 (ShareGPT) is Figure 2's runs, spread 1.0
    # and Figure 18b's block 16 are Figure 13's. Rate: 3 step times; 18b: 9 block sizes. Part 2
    # counts requests: Figure 15, 2 workloads x 2 modes x 3 widths; beams, 5 divergences;
    # prefix.experiment, 3 streams x 3 runs.
    tokens = {w: sum(r.prompt_len + r.output_len for r in paper_workload(w, n[w])) for w in n}
    sg, al, ways = tokens["sharegpt"], tokens["alpaca"], len(SYSTEMS)
    work = {
        "Figure 2": ways * sg, "Figure 13, sharegpt": 0, "Figure 13, alpaca": ways * al,
        "Figure 13 at 30 req/s": 3 * ways * al,
        "spread sensitivity": (len(spreads) - 1) * ways * sg,
        "Figure 18b, sharegpt": 8 * sg, "Figure 18b, alpaca": 8 * al,
        "Figure 15": 12 * per_request, "beam sensitivity": 5 * per_request,
        "prefix caching": 3 * (2 * (300 if quick else 600) + 120),
    }  # fmt: skip
    part2 = ("Figure 15", "beam sensitivity", "prefix caching")
    total = sum(work.values()) - sum(work[k] for k in part2)
    part = Progress("paper 1/4 memory simulations", total, "tokens")

    def section(name, rows, heading, digits=1):  # a table, and its part of the progress
        out(heading)
        out(format_rows(rows, digits))
        part.update(work[name], f"{name} done")
        return rows

    out(f"OPT-13B KV pool: 12 GiB / {BYTES_PER_TOKEN:,} bytes per token = {POOL_SLOTS:,} slots")
    fig2 = section(
        "Figure 2",
        figure2("sharegpt", n["sharegpt"]),
        "\nFigure 2 -- % of the KV pool, ShareGPT-like, saturated (paper_* = Kwon et al.)",
    )
    fig13 = {
        w: section(
            f"Figure 13, {w}",
            figure13(w, n[w]),
            f"\nFigure 13 -- average batched requests, {w}-like, saturated",
            2,
        )
        for w in ("sharegpt", "alpaca")
    }
    section(
        "Figure 13 at 30 req/s",
        rate_sensitivity("alpaca", 30.0, num_requests=n["alpaca"]),
        "\nFigure 13 at 30 req/s (Alpaca-like) for assumed step times, instead of saturated",
        2,
    )
    sensitivity = spread_sensitivity("sharegpt", spreads, num_requests=n["sharegpt"])
    keep = ("spread", "system", "mean_batch")
    section(
        "spread sensitivity",
        [{k: r[k] for k in keep} for r in sensitivity],
        "\nSensitivity -- Figure 13 (ShareGPT-like) as the length spread varies (1.0 = ours)",
        2,
    )
    fig18b = {w: section(f"Figure 18b, {w}", figure18b(w, num_requests=n[w]),
                         f"\nFigure 18b (memory side) -- paging vs block size, {w}-like")
              for w in ("sharegpt", "alpaca")}  # fmt: skip
    part.close()
    part = Progress("paper 2/4 sharing simulations", sum(work[k] for k in part2), "requests")
    fig15 = section(
        "Figure 15",
        sharing.figure15(num_requests=per_request),
        f"\nFigure 15 -- % memory saved by sharing (beam divergence {sharing.DIVERGENCE})",
    )
    section(
        "beam sensitivity",
        sharing.divergence_sweep("alpaca", 4, num_requests=per_request),
        "\nBeam model sensitivity -- Alpaca-like, width 4, vs divergence (our choice: 0.1)",
        2,
    )
    caching = section("prefix caching", prefix.experiment(quick),
                      "\nPrefix caching -- hit rate, memory saved by sharing, batch (not in the "
                      "paper)")  # fmt: skip
    part.close()

    model = "tiny-gpt2" if quick else swap_recompute.GPT2_SIZE_RANDOM
    timed = Progress("paper 3/4 Figure 19", 1, "timed calls", every=10)
    watch.note(f"paper 3/4: Figure 19, swap vs recompute on {model} (a warm-up, then the timed "
               "calls)")  # fmt: skip
    fig19 = swap_recompute.figure19(quick, progress=timed.set)
    timed.close()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    out(
        f"\nFigure 19 -- swap vs recompute of {swap_recompute.NUM_TOKENS} tokens of {model}, "
        "measured on this machine (ms, median of rounds that time every block size once, in a "
        f"shuffled order, after a warm-up; load average {load:.1f}: other work on the cores "
        "inflates these)"
    )
    keep = ("block_size", *swap_recompute.TIMED, "recompute_over_swap")
    out(format_rows([{k: r[k] for k in keep} for r in fig19], digits=3))
    out("spread of the repetitions, (slowest - fastest) / median, % (large: rerun before "
        "reading a shape into that point)")  # fmt: skip
    out(format_rows(swap_recompute.spread_rows(fig19), digits=0))
    out(swap_recompute.PAPER_FIG19)

    served = Progress("paper 4/4 Figure 12", 1, "requests served", every=10)
    watch.note("paper 4/4: Figure 12, latency vs request rate")
    fig12, fig12_summary = serving_latency.figure12(quick, progress=served.set)
    served.close()
    out(f"\nFigure 12 -- normalized latency vs request rate, measured on this machine "
        f"({serving_latency.describe(fig12_summary)})")  # fmt: skip
    out(format_rows(serving_latency.display_rows(fig12), digits=2))
    out(serving_latency.verdict(fig12_summary))
    out(serving_latency.PAPER_FIG12)
    served.note(f"paper: every experiment done in {watch}")
    if figures_dir is None:
        return []
    from pagedlearn.sim import plots

    # What each figure draws, with the sizes it was computed at (tests/test_figures.py recomputes
    # a few rows of each at those sizes); Figures 19 and 12's timings under "measured".
    sizes = {"sharegpt": n["sharegpt"], "alpaca": n["alpaca"]}
    sweep_model = fig12_summary["model"]
    data = {
        "paper_fig2_memory_breakdown": {"workload": "sharegpt", "num_requests": n["sharegpt"],
                                        "rows": fig2},
        "paper_fig13_batch_size": {"num_requests": sizes, "rows": fig13},
        "paper_fig15_sharing": {"num_requests": per_request, "rows": fig15},
        "paper_fig18b_block_size": {"num_requests": sizes, "rows": fig18b},
        "paper_spread_sensitivity": {"workload": "sharegpt", "num_requests": n["sharegpt"],
                                     "rows": sensitivity},
        "prefix_caching": {"quick": quick, "rows": caching},
        "paper_fig19_swap_recompute": {
            "model": model,
            "num_tokens": swap_recompute.NUM_TOKENS,
            "rows": [{k: r[k] for k in ("block_size", "num_blocks", "bytes")} for r in fig19],
            "measured": fig19,
        },
        "paper_fig12_latency": {"model": sweep_model,
                                "measured": {"rows": fig12, "summary": fig12_summary}},
    }  # fmt: skip

    figures = {
        "paper_fig2_memory_breakdown": plots.plot_figure2(fig2),
        "paper_fig13_batch_size": plots.plot_figure13(fig13),
        "paper_fig15_sharing": plots.plot_figure15(fig15),
        "paper_fig18b_block_size": plots.plot_figure18b(fig18b),
        "paper_spread_sensitivity": plots.plot_sensitivity(sensitivity),
        "prefix_caching": plots.plot_prefix_caching(caching),
        "paper_fig19_swap_recompute": swap_recompute.plot_figure19(fig19),
        "paper_fig12_latency": plots.plot_figure12(fig12, fig12_summary),
    }
    paths = plots.save_all(figures, figures_dir, data)
    out("\nfigures: " + ", ".join(str(p) for p in paths))
    return paths
