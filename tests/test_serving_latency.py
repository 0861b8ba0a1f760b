"""Figure 12's measurement (pagedlearn.sim.serving_latency): the metric, the rule, the stream, and
the engine runs on a fixed step cost (``step_seconds``), which makes the simulated clock
deterministic. Measured timings are never asserted."""

import pytest

from pagedlearn.engine.llm import LLM
from pagedlearn.models import load
from pagedlearn.sim import plots
from pagedlearn.sim.serving_latency import (
    KNEE,
    display_rows,
    make_stream,
    measure,
    normalized_latency,
    serve,
    sustainable_rate,
    verdict,
)

STEP = 0.01  # seconds per step on the fixed clock
MAX_LEN = 128


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-gpt2")


def engine(tiny, system, blocks=32):
    return LLM(tiny, block_size=16, num_blocks=blocks, enable_prefix_caching=False,
               max_num_seqs=256, kv_reservation=system, verbose=False)  # fmt: skip


def test_normalized_latency_is_the_mean_of_each_requests_latency_per_output_token():
    # (2 - 0) / 2 = 1.0 and (5 - 1) / 8 = 0.5: the mean of the ratios, not total time / tokens
    assert normalized_latency([0.0, 1.0], [2.0, 5.0], [2, 8]) == pytest.approx(0.75)
    assert normalized_latency([3.0], [3.5], [1]) == pytest.approx(0.5)


def test_sustainable_rate_interpolates_the_first_crossing():
    rates, latency = [1, 2, 3, 4, 5], [1.0, 1.2, 2.0, 5.0, 1.0]  # the dip at 5 comes too late
    assert sustainable_rate(rates, latency, 3.0) == pytest.approx(3 + 1 / 3)
    assert sustainable_rate(rates, latency, 10.0) == 5  # never crossed: the highest rate swept
    assert sustainable_rate(rates, latency, 0.5) is None  # above the target from the start


def test_seeded_stream_is_reproducible_and_fits_the_context():
    a, b = make_stream(300, MAX_LEN, seed=3), make_stream(300, MAX_LEN, seed=3)
    assert a == b
    assert a != make_stream(300, MAX_LEN, seed=4)
    arrivals = [t for t, _, _ in a]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    assert 0.8 < arrivals[-1] / len(a) < 1.2  # a unit-rate Poisson process: one per second
    assert all(n >= 1 and len(p) + n <= MAX_LEN and p for _, p, n in a)


def test_every_request_finishes_and_waits_at_least_its_tokens(tiny):
    stream = make_stream(40, MAX_LEN, seed=1)
    for system in ("paged", "max"):
        run = serve(engine(tiny, system), stream, 200.0, MAX_LEN, step_seconds=STEP)
        assert run.system == system
        for a, f, n in zip(run.arrival, run.finish, run.output_len, strict=True):
            assert f >= a + n * STEP - 1e-9  # one token per step at best
        assert run.steps * STEP == pytest.approx(run.busy_time)


def test_an_idle_server_gives_one_step_per_token(tiny):
    """At a rate so low that every request runs alone, each request's latency is its output
    length times the step: the normalized latency is exactly the step."""
    run = serve(engine(tiny, "paged"), make_stream(8, MAX_LEN, seed=2), 0.01, MAX_LEN, STEP)
    assert run.normalized_latency == pytest.approx(STEP)
    assert max(run.running) == 1


def test_the_fixed_clock_is_deterministic(tiny):
    stream = make_stream(30, MAX_LEN, seed=5)
    runs = [serve(engine(tiny, "max"), stream, 300.0, MAX_LEN, STEP) for _ in range(2)]
    assert runs[0].finish == runs[1].finish and runs[0].running == runs[1].running


def test_max_reservation_runs_fewer_requests_together(tiny):
    stream = make_stream(40, MAX_LEN, seed=0)  # all at once: a saturated server
    paged = serve(engine(tiny, "paged"), stream, None, MAX_LEN, STEP)
    held = serve(engine(tiny, "max"), stream, None, MAX_LEN, STEP)
    assert max(held.running) <= 32 // (MAX_LEN // 16)  # 4 reservations of 8 blocks fit in 32
    assert max(paged.running) > max(held.running)
    assert max(paged.finish) < max(held.finish)  # so it serves the same requests sooner


def test_measure_on_a_fixed_clock_paging_sustains_a_higher_rate():
    rows, summary = measure("tiny-gpt2", 40, MAX_LEN, (0.2, 0.6, 1.0, 1.6), step_seconds=STEP)
    assert summary["clock"] == "fixed" and summary["budget_tokens"] == 4 * MAX_LEN
    for system in ("paged", "max"):
        mine = [r for r in rows if r["system"] == system]
        assert [r["rate"] for r in mine] == sorted(r["rate"] for r in mine)
        assert mine[-1]["normalized_latency"] > mine[0]["normalized_latency"]  # the queue grew
        assert all(r["step_ms"] == pytest.approx(1e3 * STEP) for r in mine)
        assert max(r["peak_running"] for r in mine) <= (4 if system == "max" else 64)
    assert summary["exploded"]["max"]  # the reservation baseline's latency did explode
    assert summary["target_latency"] == pytest.approx(KNEE * STEP, rel=0.05)  # unloaded ~ 1 step
    assert summary["sustainable_paged"] > summary["sustainable_max"] > 0
    assert summary["ratio"] == pytest.approx(
        summary["sustainable_paged"] / summary["sustainable_max"]
    )
    assert "paged / max" in verdict(summary)
    assert len(display_rows(rows)) == len(rows)
    fig = plots.plot_figure12(rows, summary)
    assert len(fig.axes) == 2 and all(len(ax.lines) >= 2 for ax in fig.axes)


def test_measure_rejects_a_bad_sweep():
    with pytest.raises(ValueError, match="ascending"):
        measure(fractions=(1.0, 0.5))


def test_chapter_08_and_the_readme_quote_the_paper_as_it_reads():
    """Section 7.3's sentence whole (not "recompute is cheaper"), and the abstract's 2-4x "with
    the same level of latency" (not "at the same memory")."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    sentence = (
        "Thus, recomputation is more efficient when the block size is small, while swapping is "
        "more efficient when the block size is large, though recomputation overhead is never "
        "higher than 20% of swapping's latency."
    )
    for path in (root / "README.md", root / "notebooks" / "08_reproducing_the_paper.py"):
        lines = path.read_text().splitlines()
        text = " ".join(" ".join(line.removeprefix("#").split()) for line in lines)
        assert sentence in text, path.name
        assert "with the same level of latency" in text, path.name
        assert "at the same memory" not in text, path.name
