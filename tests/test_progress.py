"""The long commands' progress lines (pagedlearn/progress.py): the estimate is the work left at the
rate measured so far, each line says what it was computed from, a pipe gets plain lines (at most
one per ``every`` seconds, the last always), a terminal gets a tqdm bar; and the progress reaches
the user through the simulations' callbacks and a benchmark's stderr, stdout keeping the results.
"""

import io
import os
import re
import subprocess
import sys
from pathlib import Path

from pagedlearn.progress import Progress, estimate, seconds

ROOT = Path(__file__).resolve().parent.parent


class Clock:
    """A clock the test moves by hand."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_the_estimate_is_the_work_left_at_the_rate_so_far():
    assert estimate(40.0, 2, 6) == 80.0
    assert estimate(10.0, 1000, 1000) == 0.0
    assert estimate(10.0, 1200, 1000) == 0.0  # more done than planned: nothing left, not < 0
    assert estimate(5.0, 0, 10) is None  # nothing measured: no guess
    assert (
        seconds(59.4) == "59 s" and seconds(60) == "1 min 00 s" and seconds(3725) == "62 min 05 s"
    )


def test_a_line_says_the_work_the_time_and_what_the_estimate_comes_from():
    clock, out = Clock(), io.StringIO()
    p = Progress("paper 1/4 memory simulations", 4000, "tokens", file=out, clock=clock)
    assert p.line() == "paper 1/4 memory simulations: 0/4,000 tokens, 0 s so far"
    clock.now += 30
    p.update(1000, "Figure 2 done")
    clock.now += 15
    p.update(500)
    clock.now += 105
    p.update(2500, "Figure 18b done")
    assert out.getvalue().splitlines() == [
        "paper 1/4 memory simulations, Figure 2 done: 1,000/4,000 tokens in 30 s; about 1 min 30 s "
        "left at that rate",
        "paper 1/4 memory simulations: 1,500/4,000 tokens in 45 s; about 1 min 15 s left at that "
        "rate",
        "paper 1/4 memory simulations, Figure 18b done: 4,000/4,000 tokens, done in 2 min 30 s",
    ]


def test_a_pipe_gets_a_line_per_every_seconds_and_always_the_last():
    clock, out = Clock(), io.StringIO()
    p = Progress("sweep", 10, "runs", file=out, every=10, clock=clock)
    for _ in range(10):
        clock.now += 3
        p.update(1)
    lines = out.getvalue().splitlines()
    # after 12 s (run 4), 24 s (run 8), and the last run at 30 s
    assert [re.match(r"sweep: (\d+)/10", line)[1] for line in lines] == ["4", "8", "10"]
    assert lines[-1] == "sweep: 10/10 runs, done in 30 s"


def test_set_up_is_not_billed_to_the_work_and_the_plan_can_shrink():
    clock, out = Clock(), io.StringIO()
    p = Progress("Figure 12", 1, "requests served", file=out, clock=clock)
    clock.now += 50  # loading a model, a warm-up: set-up, not the first requests' cost
    p.set(0, 400)
    clock.now += 10
    p.set(100, 400)
    clock.now += 10
    p.set(200, 300)  # a sweep stopped early: 100 fewer to serve
    p.set(200)  # nothing new: no line
    clock.now += 10
    p.set(300, 300)
    assert out.getvalue().splitlines() == [
        "Figure 12: 100/400 requests served in 10 s; about 30 s left at that rate",
        "Figure 12: 200/300 requests served in 20 s; about 10 s left at that rate",
        "Figure 12: 300/300 requests served, done in 30 s",
    ]


def test_a_terminal_gets_a_tqdm_bar_that_says_its_basis_and_no_plain_lines():
    out = io.StringIO()
    p = Progress("bench", 8, "tokens", file=out, bar=True)
    p.update(2, "sliding")
    p.note("bench: the full-attention run starts")
    p.update(6)
    p.close()
    text = out.getvalue()
    assert "bench, sliding: 2/8 tokens" in text and "8/8 tokens" in text
    assert "left (at the" in text and "measured so far)" in text
    assert "bench: the full-attention run starts\n" in text
    assert "about" not in text  # the plain line's wording: not printed on a terminal


def test_the_figure12_sweep_reports_requests_served_up_to_what_it_really_ran():
    from pagedlearn.sim import serving_latency

    calls = []
    rates = (0.5, 2.0, 4.0, 6.0, 8.0)  # fixed-cost steps: the sweep explodes, stops early
    tick = lambda d, t: calls.append((d, t))  # noqa: E731
    serving_latency.measure("tiny-gpt2", 6, 32, rates, 2, step_seconds=0.01, progress=tick)
    assert calls[0][0] == 0 and calls[1][0] == 6  # after the warm-up; after the calibration
    done, planned = [d for d, _ in calls], [t for _, t in calls]
    assert done == sorted(done) and planned == sorted(planned, reverse=True)
    assert planned[-1] < planned[0]  # the runs it skipped left the plan
    assert calls[-1][0] == calls[-1][1]  # and the estimate ends at 0 s left, not short of it


def test_figure19_reports_each_timed_call_after_the_warm_up():
    from pagedlearn.sim import swap_recompute

    calls = []
    swap_recompute.measure((4, 16), 32, "tiny-gpt2", repeats=2,
                           progress=lambda d, t: calls.append((d, t)))  # fmt: skip
    timed = 2 * 2 * len(swap_recompute.TIMED)  # repeats x block sizes x columns
    assert calls == [(i, timed) for i in range(timed + 1)]


def test_the_hybrid_benchmark_prints_progress_on_stderr_and_results_on_stdout():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONUNBUFFERED", None)
    cmd = [sys.executable, "benchmarks/bench_hybrid_blocks.py", "--tokens", "120"]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    # 2 runs x (120 - 56 prompt tokens) generated: the last line says the whole plan was done
    assert re.search(r"^bench_hybrid_blocks, full attention: 128/128 tokens, done in \d+ s$",
                     run.stderr, re.M), run.stderr  # fmt: skip
    assert run.stdout.startswith("machine: ") and "bench_hybrid_blocks" not in run.stdout
    assert re.search(r"^ +sliding W=\d+: 120 tokens, peak", run.stdout, re.M), run.stdout
    assert re.search(r"^ +full: 120 tokens, peak", run.stdout, re.M), run.stdout
