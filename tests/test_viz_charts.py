"""The memory timeline and the fragmentation charts draw what the engine and the simulator did."""

import pytest
from matplotlib.collections import LineCollection
from matplotlib.colors import to_hex
from matplotlib.text import Text

from pagedlearn import LLM, KVCacheManager, PagedLearnError, SamplingParams
from pagedlearn.sim.paper import make_memory
from pagedlearn.sim.plots import OKABE_ITO
from pagedlearn.sim.simulator import simulate
from pagedlearn.sim.workloads import paper_workload
from pagedlearn.viz.fragmentation import (
    as_requests,
    draw_fragmentation,
    draw_reservation_vs_paging,
    fragmentation_breakdown,
)
from pagedlearn.viz.state import replay_states
from pagedlearn.viz.timeline import draw_memory_timeline, timeline_rows

# 6 requests (prompt_len, output_len, max_tokens): Max reserves 512 slots for each.
SMALL = [
    (60, 180, 452),
    (30, 60, 482),
    (120, 300, 392),
    (20, 400, 492),
    (80, 90, 432),
    (40, 250, 472),
]


@pytest.fixture(scope="module")
def run():
    """A recorded tiny-model run on 12 blocks of 4: three requests outgrow the pool, one is
    preempted (recompute) and its cached blocks are evicted later."""
    llm = LLM("tiny-gpt2", num_blocks=12, block_size=4, verbose=False)
    stats = []
    llm.engine.subscribe_stats(stats.append)
    log = llm.engine.record()
    prompts = [list(b"Hello world"), list(b"The quick brown"), list(b"abcdefgh")]
    llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)
    return log, stats


def labels(ax):
    return ax.get_legend_handles_labels()[1]


def increases(stats, field):
    """Steps where a running total of the engine grew."""
    prev, out = 0, []
    for s in stats:
        if getattr(s, field) > prev:
            out.append(s.step)
        prev = getattr(s, field)
    return out


def test_timeline_rows_equal_the_engine_stats_at_every_step(run):
    log, stats = run
    rows = timeline_rows(log)
    assert [r["step"] for r in rows] == [s.step for s in stats]
    for r, s in zip(rows, stats, strict=True):
        assert (r["used"], r["cached"]) == (s.used_blocks, s.cached_blocks)
        assert r["free"] == s.free_blocks - s.cached_blocks  # StepStats' free counts cached ones
        assert r["used"] + r["cached"] + r["free"] == 12
        assert (r["running"], r["waiting"], r["swapped"]) == (
            s.num_running,
            s.num_waiting,
            s.num_swapped,
        )
        assert r["preemptions_recompute"] == s.preemptions_recompute
        assert r["evictions"] == s.evictions
    # The three sources agree (StepStats do not count shared blocks).
    from_stats = timeline_rows(stats)
    from_states = timeline_rows([state for _, state in replay_states(log)])
    assert from_states == rows
    assert [{**r, "shared": 0} for r in from_stats] == rows
    assert increases(stats, "preemptions_recompute"), "the run must preempt for these tests"


def test_timeline_figure_marks_preemptions_and_evictions_at_their_steps(run):
    log, stats = run
    fig = draw_memory_timeline(log, title="tiny run")
    blocks_ax, requests_ax = fig.axes[:2]
    n_pre, n_evict = stats[-1].preemptions_recompute, stats[-1].evictions
    assert labels(blocks_ax) == [
        "used",
        "cached (free, holds a prefix)",
        "free",
        "shared (refcount > 1)",
        f"cached blocks evicted ({n_evict})",
    ]
    assert labels(requests_ax) == [
        "running",
        "waiting",
        "swapped",
        f"preemption: recompute ({n_pre})",
    ]
    marker = next(c for c in requests_ax.collections if isinstance(c, LineCollection))
    assert [seg[0][0] for seg in marker.get_segments()] == increases(stats, "preemptions_recompute")
    evicted = next(line for line in blocks_ax.lines if line.get_label().startswith("cached blocks"))
    assert list(evicted.get_xdata()) == increases(stats, "evictions")
    assert blocks_ax.get_title() == "tiny run"
    assert all(t.get_fontsize() >= 10 for t in fig.findobj(Text) if t.get_text())
    # The stacked areas' top edge (used + cached + free) is the whole pool at every step.
    free_area = blocks_ax.collections[2]
    tops = free_area.get_paths()[0].vertices[:, 1]
    assert tops.max() == 12


def test_timeline_from_stats_has_no_shared_line_and_no_marker_without_events(run):
    _, stats = run
    quiet = stats[:3]  # before the preemption
    fig = draw_memory_timeline(quiet)
    assert labels(fig.axes[0]) == ["used", "cached (free, holds a prefix)", "free"]
    assert labels(fig.axes[1]) == ["running", "waiting", "swapped"]


def test_an_abort_frame_with_a_repeated_step_is_drawn_once(run):
    _, stats = run
    frames = [s.as_dict() for s in stats[:4]] + [stats[3].as_dict()]  # dicts work too
    assert [r["step"] for r in timeline_rows(frames)] == [1, 2, 3, 4, 4]
    running = draw_memory_timeline(frames).axes[1].lines[0].get_xdata()
    assert list(running) == sorted(running) and len(running) == 2 * 4


def test_timeline_of_a_manager_driven_by_hand():
    kv = KVCacheManager(8, 4)
    log = kv.record()
    kv.add_sequence("a", [1, 2, 3, 4, 5])
    kv.mark_step()
    kv.add_sequence("b", [7])
    kv.mark_step()
    rows = timeline_rows(log)
    assert [(r["step"], r["used"], r["free"], r["running"]) for r in rows] == [
        (1, 2, 6, 1),
        (2, 3, 5, 2),
    ]
    draw_memory_timeline(log)


def test_timeline_rejects_bad_sources(run):
    _, stats = run
    with pytest.raises(ValueError, match="empty"):
        timeline_rows([])
    kv = KVCacheManager(4, 4)
    log = kv.record()
    kv.add_sequence("a", [1, 2])
    with pytest.raises(ValueError, match="no 'step' events"):
        draw_memory_timeline(log)
    with pytest.raises(TypeError, match="EventLog"):
        timeline_rows(42)
    with pytest.raises(TypeError, match="PoolState or a StepStats"):
        timeline_rows([1, 2])
    state = replay_states(run[0])[0][1]
    with pytest.raises(TypeError, match="mixes"):
        timeline_rows([state, stats[0]])


@pytest.fixture(scope="module")
def sharegpt_rows():
    return fragmentation_breakdown(paper_workload("sharegpt", 40), 4096)


def test_breakdown_rows_sum_to_the_whole_pool(sharegpt_rows):
    assert [r["system"] for r in sharegpt_rows] == ["max", "pow2", "oracle", "vllm"]
    for r in sharegpt_rows:
        parts = r["token_states"] + r["reserved"] + r["internal"] + r["external_and_other"]
        assert parts == pytest.approx(100)
        assert r["external_and_other"] == pytest.approx(r["buddy_rounding"] + r["free"])
        assert r["under_load"]


def test_max_reservation_admits_exactly_seven_requests_of_2048():
    # The paper's pool (15,728 slots) holds 7 runs of 2048: arenas 8192 + 4096 + 2048 + ...
    requests = [(100 + 7 * i, 20 + 3 * i) for i in range(20)]  # max_tokens = 2048 - prompt
    (row,) = fragmentation_breakdown(requests, 15728, systems=("max",))
    assert row["mean_batch"] == 7.0
    assert row["internal"] > 50  # most of each reservation is never used


def test_paging_holds_more_tokens_and_wastes_under_a_block_per_request(sharegpt_rows):
    rows = {r["system"]: r for r in sharegpt_rows}
    vllm, orca = rows["vllm"], rows["max"]
    assert vllm["token_states"] > orca["token_states"]
    assert vllm["mean_batch"] > orca["mean_batch"]
    assert vllm["reserved"] == 0 and rows["oracle"]["internal"] == 0
    internal_slots = vllm["internal"] / 100 * 4096
    assert internal_slots < 16 * vllm["mean_batch"]  # at most the last block of each request


def test_drawn_bars_equal_the_rows(sharegpt_rows):
    fig = draw_fragmentation(sharegpt_rows, title="40 requests")
    ax = fig.axes[0]
    assert [c.get_label() for c in ax.containers] == [
        "token states",
        "reserved",
        "internal frag.",
        "external frag. and other",
    ]
    keys = ["token_states", "reserved", "internal", "external_and_other"]
    left = [0.0] * len(sharegpt_rows)
    for colour, key, bars in zip(OKABE_ITO, keys, ax.containers, strict=False):
        assert [p.get_width() for p in bars] == pytest.approx([r[key] for r in sharegpt_rows])
        assert [p.get_x() for p in bars] == pytest.approx(left)
        assert {to_hex(p.get_facecolor()) for p in bars} == {colour.lower()}
        left = [a + r[key] for a, r in zip(left, sharegpt_rows, strict=True)]
    shown = {t.get_text() for t in fig.findobj(Text)}
    assert f"{sharegpt_rows[0]['internal']:.1f}%" in shown  # the segments carry their %
    assert all(t.get_fontsize() >= 10 for t in fig.findobj(Text) if t.get_text())


@pytest.mark.parametrize("step", [0, 30])
def test_the_strips_are_the_simulators_pool_at_that_step(step):
    fig = draw_reservation_vs_paging(SMALL, 2048, step=step)
    for ax, system in zip(fig.axes, ("max", "vllm"), strict=True):
        snap = simulate(as_requests(SMALL), make_memory(system, 2048)).snapshots[step]
        drawn = {c.get_label(): sum(p.get_width() for p in c) for c in ax.containers}
        for part in ("token_states", "reserved", "internal", "buddy_rounding", "free"):
            assert drawn[part] == getattr(snap, part), (system, part)
        assert f"{snap.running} running, {snap.waiting} waiting" in ax.get_title(loc="left")
        if system == "vllm":  # only a request's last block is partly empty
            tails = [p.get_width() for p in ax.containers[2]]
            assert len(tails) <= snap.running and all(0 < w < 16 for w in tails)
    assert fig.axes[0].get_title(loc="left").startswith("Orca (Max): 4 running, 2 waiting")


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="empty"):
        fragmentation_breakdown([], 1024)
    with pytest.raises(TypeError, match=r"requests\[0\]"):
        fragmentation_breakdown([(10,)], 1024)
    with pytest.raises(ValueError, match="max_tokens=5"):
        fragmentation_breakdown([(10, 20, 5)], 1024)
    with pytest.raises(ValueError, match="exceeds max_context"):
        fragmentation_breakdown([(10, 20, 500)], 1024, max_context=256)
    with pytest.raises(ValueError, match="pool_slots"):
        fragmentation_breakdown(SMALL, 0)
    with pytest.raises(ValueError, match="systems"):
        fragmentation_breakdown(SMALL, 2048, systems=("paged",))
    with pytest.raises(PagedLearnError, match="larger than the pool"):
        fragmentation_breakdown([(100, 50)], 1024, systems=("max",))  # reserves 2048
    with pytest.raises(ValueError, match="non-empty"):
        draw_fragmentation([])
    with pytest.raises(ValueError, match="lacks"):
        draw_fragmentation([{"system": "max", "token_states": 50}])
    with pytest.raises(ValueError, match="past the end"):
        draw_reservation_vs_paging(SMALL, 2048, step=10_000)
    with pytest.raises(ValueError, match="step"):
        draw_reservation_vs_paging(SMALL, 2048, step=-1)
