"""The pictures of a model with several KV-cache groups: a table per sequence per group, freed
heads drawn without arrows, one colour per request in every group, group tags in the pool."""

from __future__ import annotations

import pytest
from matplotlib.colors import to_hex
from matplotlib.patches import ConnectionPatch, Rectangle

from pagedlearn import KVCacheManager
from pagedlearn.errors import PagedLearnError
from pagedlearn.hybrid.kv_cache_coordinator import KVCacheCoordinator
from pagedlearn.hybrid.kv_cache_groups import group_layers
from pagedlearn.hybrid.sliding_window_manager import SlidingWindowManager
from pagedlearn.trace.events import EventLog
from pagedlearn.viz.panels import inspect_block, key_html, requests_html, stats_html
from pagedlearn.viz.pool import draw_block_pool, pool_figure
from pagedlearn.viz.pool_labels import group_tags, pool_title
from pagedlearn.viz.state import kv_group_order, pool_state, replay_states
from pagedlearn.viz.tables import FREED_NOTE, MAX_LOGICAL, draw_block_tables, row_cells

BS, FULL, SLIDING = 4, "full", "sliding 8"


def _session(live: list | None = None):
    """A full and a sliding group (window 8) over 24 blocks, driven by hand: a window frees a
    head, a fork shares, a swap moves tables out and back, a prefix hit skips a freed block.
    ``live`` collects the live state at every step event."""
    kv = KVCacheCoordinator(group_layers([8, None]), 24, BS, True, num_cpu_blocks=8)
    log = kv.record()
    if live is not None:
        kv.trace.subscribe(lambda e: e.kind == "step" and live.append(pool_state(kv, e.info)))
    kv.add_sequence("a", list(range(22)))  # 6 blocks per group
    kv.mark_step(step=1)
    assert kv.remove_skipped_blocks("a", 22) == 3  # query 22 sees 15..22: blocks 0-2 are dead
    kv.add_sequence("b", [100, 101, 102, 103, 104, 105])
    kv.fork("b", "b.1")
    kv.append_token("b.1", 7)  # copy-on-write in both groups
    kv.mark_step(step=2)
    kv.pop_copies()  # the engine applies the copies before it swaps
    kv.swap_out(["b", "b.1"])
    kv.mark_step(step=3)
    kv.swap_in(["b", "b.1"])
    # c's prompt repeats a's first 20 tokens: the sliding group needs only the window's blocks
    assert kv.add_sequence("c", [*range(20), 99]) == 20
    kv.mark_step(step=4)
    kv.free_sequence("b.1")
    kv.mark_step(step=5)
    kv.check_invariants()
    return kv, log


def test_a_coordinators_states_equal_its_replayed_traces_at_every_step():
    live: list = []
    kv, log = _session(live)
    frames = [s for _, s in replay_states(EventLog.from_json(log.to_json()))]
    assert frames == live and len(frames) == 5
    first, second, swapped, hit = frames[0], frames[1], frames[2], frames[3]
    assert first.kv_groups == (FULL, SLIDING)
    assert set(first.tables) == {"a|full", "a|sliding 8"}
    assert second.tables["a|sliding 8"][:3] == (-1, -1, -1)  # the freed head
    assert set(swapped.swapped) == {"b|full", "b|sliding 8", "b.1|full", "b.1|sliding 8"}
    # c's hit: the query at 20 sees 13..20, so the window needs no block before block 3
    assert hit.tables["c|sliding 8"][:4] == (-1, -1, -1, kv.block_tables("c")[1][3])
    assert live[-1].tables["a|full"] == tuple(kv.managers[0].block_table("a"))
    # The pool's counts, per group, are the coordinator's own.
    assert pool_state(kv).group_counts() == kv.stats()["groups"]


def test_null_entries_own_no_block_and_the_last_block_is_not_theirs():
    kv = KVCacheCoordinator(group_layers([8, None]), 16, BS)
    kv.add_sequence("a", list(range(22)))
    kv.remove_skipped_blocks("a", 22)
    state = pool_state(kv)
    assert state.blocks[-1].owners == ()  # a -1 entry is not block 15
    owned = {b.block_id for b in state.blocks if b.owners}
    live = {b for t in kv.block_tables("a") for b in t if b >= 0}
    assert owned == live and state.count("used") == len(live)


def test_freed_entries_are_drawn_as_freed_and_get_no_arrow():
    kv, _ = _session()
    fig = draw_block_tables(kv)
    arrows = {a.get_gid() for a in fig.artists if isinstance(a, ConnectionPatch)}
    state = pool_state(kv)
    entries = {f"{s}:{j}->{b}" for s, t in state.tables.items() for j, b in enumerate(t) if b >= 0}
    assert arrows == entries and not any("->-1" in g for g in arrows)
    left = fig.axes[0]
    freed = [p.get_gid() for p in left.patches if (p.get_gid() or "").startswith("freed")]
    nulls = [(s, j) for s, t in state.tables.items() for j, b in enumerate(t) if b < 0]
    assert len(freed) == len(nulls) == 6  # a's head (3) and the 3 blocks c's hit skipped
    assert all(p.get_hatch() == "xx" for p in left.patches if (p.get_gid() or "").startswith("f"))
    texts = [t.get_text() for t in left.texts]
    assert texts.count("freed") == 6
    assert "seq a · sliding 8" in texts and "seq a · full" in texts
    assert FREED_NOTE in fig.get_suptitle() and "KV-cache group" in fig.get_suptitle()


def test_a_long_tables_freed_head_is_one_cell_and_the_rest_fits():
    table = (-1,) * 12 + (40, 41, 42)
    assert row_cells(table) == [("freed", "0–11", 12), ("block", 12, 40), ("block", 13, 41),
                                ("block", 14, 42)]  # fmt: skip
    assert row_cells((-1, 5, 6)) == [("freed", 0, 1), ("block", 1, 5), ("block", 2, 6)]
    full = tuple(range(MAX_LOGICAL + 4))
    cells = row_cells(full)
    assert len(cells) == MAX_LOGICAL and cells[-1] == ("more", "", 5)
    # The same through a drawing: a long generation's sliding row shows its window, not nulls.
    kv = KVCacheCoordinator(group_layers([8, None]), 40, BS)
    kv.add_sequence("long", list(range(50)))
    kv.remove_skipped_blocks("long", 50)
    fig = draw_block_tables(kv, "long")
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "10 freed" in texts and "logical 0–9" in texts
    sliding = {a.get_gid() for a in fig.artists if a.get_gid().startswith("long|sliding")}
    assert sliding == {f"long|sliding 8:{j}->{b}" for j, b in
                       enumerate(kv.block_tables("long")[1]) if b >= 0}  # fmt: skip


def test_a_requests_colour_is_the_same_in_every_group():
    kv, _ = _session()
    state = pool_state(kv)
    _, artist = pool_figure(state.num_blocks, BS)
    artist.update(state)
    colours = artist.face_colors()
    for seq in ("a", "c"):  # c shares a's prefix blocks (grey): its own ones, in both groups
        own = {g: [b for b in state.tables[f"{seq}|{g}"] if b >= 0
                   and {state.group_of(o) for o in state.blocks[b].owners} == {seq}]
               for g in (FULL, SLIDING)}  # fmt: skip
        assert own[FULL] and own[SLIDING]
        drawn = {colours[b] for b in own[FULL] + own[SLIDING]}
        assert drawn == {to_hex(artist.state.colors[seq])}  # one colour, both groups
    assert set(artist.state.colors) == {"a", "b", "c"}  # by sequence, not by table
    tables = draw_block_tables(kv, "a")
    strips = [
        to_hex(p.get_facecolor()) for p in tables.axes[0].patches
        if isinstance(p, Rectangle) and p.get_width() == pytest.approx(0.08)
    ]  # fmt: skip
    assert len(strips) == 2 and len(set(strips)) == 1


def test_pool_cells_carry_their_groups_tag_and_the_legend_names_them():
    kv, _ = _session()
    state = pool_state(kv)
    _, artist = pool_figure(state.num_blocks, BS)
    artist.update(state)
    tags = group_tags(state.kv_groups)
    assert tags == {FULL: "F", SLIDING: "S"}
    want = [tags[state.kv_group_of(b.owners[0])] if b.owners else "" for b in state.blocks]
    assert artist.group_tags() == want and "F" in want and "S" in want
    legend = [t.get_text() for t in artist.ax.get_legend().get_texts()]
    assert "F: full group" in legend and "S: sliding 8 group" in legend
    counts = state.group_counts()
    assert f"F {counts[FULL]} + S {counts[SLIDING]}" in pool_title(state)
    fig = draw_block_pool(kv)
    assert "F: full group" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


def test_group_names_sort_as_the_coordinator_orders_them():
    names = ["sliding 1024", "sliding 8 #1", "full", "sliding 8 #0", "local"]
    assert sorted(names, key=kv_group_order) == [
        "full", "sliding 8 #0", "sliding 8 #1", "sliding 1024", "local"]  # fmt: skip
    groups = group_layers([None] * 4 + [4096] * 22)  # Gemma-3-1B-like: 1 full, 6 sliding
    assert sorted((g.name for g in groups), key=kv_group_order) == [g.name for g in groups]
    assert list(group_tags(tuple(g.name for g in groups)).values()) == [
        "F", "S1", "S2", "S3", "S4", "S5", "S6"]  # fmt: skip


def test_the_panels_count_blocks_per_group():
    kv, _ = _session()
    state = pool_state(kv)
    counts = state.group_counts()
    text = stats_html(state)
    assert f"blocks per group: full {counts[FULL]}, sliding 8 {counts[SLIDING]}" in text
    engine_like = pool_state(kv, {"step": 5, "stats": {**_stats(), "group_blocks": counts,
                                                        "window_freed_blocks": 3}})  # fmt: skip
    assert "freed by sliding windows: 3" in stats_html(engine_like)
    assert "block tags: F: full group" in key_html(state) and "tags" not in key_html()
    rows = requests_html(state, [])
    a = {b for t in kv.block_tables("a") for b in t if b >= 0}
    full_a = len([b for b in kv.block_tables("a")[0] if b >= 0])
    assert f"{len(a)} (F {full_a}, S {len(a) - full_a})" in rows
    block = kv.block_tables("a")[1][-1]
    text = inspect_block(state, block)
    assert "KV-cache group: sliding 8 (tag S)" in text and "owners: a (request a)" in text


def test_one_group_draws_as_before():
    kv = KVCacheManager(8, BS)
    kv.add_sequence("a", [1, 2, 3, 4, 5])
    state = pool_state(kv)
    assert state.kv_groups == () and state.seq_of("a") == "a" and state.group_counts() == {}
    _, artist = pool_figure(8, BS)
    artist.update(state)
    assert artist._tags == [] and artist.group_tags() == [""] * 8  # no tag artists at all
    assert "per group" not in stats_html(state) and "tags" not in key_html(state)
    # A lone sliding-window manager (one group, plain ids) still draws its freed head.
    sw = SlidingWindowManager(8, BS, sliding_window=4)
    sw.add_sequence("s", list(range(10)))
    sw.remove_skipped_blocks("s", 10)
    fig = draw_block_tables(sw)
    assert pool_state(sw).kv_groups == ()
    assert {a.get_gid() for a in fig.artists} == {"s:1->1", "s:2->2"}
    assert "freed" in [t.get_text() for t in fig.axes[0].texts]


def test_choosing_a_sequence_shows_its_table_in_every_group():
    kv, _ = _session()
    fig = draw_block_tables(kv, "c")
    assert {a.get_gid().split(":")[0] for a in fig.artists} == {"c|full", "c|sliding 8"}
    fig = draw_block_tables(kv, "c|full")
    assert {a.get_gid().split(":")[0] for a in fig.artists} == {"c|full"}
    with pytest.raises(ValueError, match="no sequence 'zz'"):
        draw_block_tables(kv, "zz")


def test_the_reservation_strip_refuses_a_coordinator_by_name():
    from pagedlearn.viz.fragmentation import _layout

    class Paging:  # what the simulator's PagedMemory offers the layout
        kv = KVCacheCoordinator(group_layers([8, None]), 8, BS)
        block_size = BS

    with pytest.raises(PagedLearnError, match="one per KV-cache group"):
        _layout(Paging(), [])


def test_an_engine_run_of_tiny_gemma3_replays_to_the_live_frames_in_one_colour_per_request():
    from pagedlearn import LLM, SamplingParams
    from pagedlearn.viz.live import LiveBlockView

    llm = LLM("tiny-gemma3", num_blocks=40, block_size=BS, verbose=False, preemption_mode="swap")
    engine = llm.engine
    log = engine.record()
    view = LiveBlockView(llm)
    live = []
    engine.kv.trace.subscribe(
        lambda e: e.kind == "step" and live.append(pool_state(engine.kv, e.info))
    )
    prompt = "The quick brown fox jumps over the lazy dog, and then it ran away"  # > window
    engine.add_request("a", prompt, SamplingParams(max_tokens=16, ignore_eos=True))
    many = SamplingParams(max_tokens=12, n=2, temperature=1.0, seed=1, ignore_eos=True)
    engine.add_request("b", "Once upon a time", many)
    keys, tags = set(), set()
    while engine.has_unfinished_requests():
        view.step()
        keys.add(view.key.value)
        tags |= set(view.artist.group_tags())
    assert any("block tags: F: full group &middot; S: sliding 24 group" in k for k in keys)
    assert tags == {"", "F", "S"} and view.last_error is None
    frames = replay_states(EventLog.from_json(log.to_json()))
    assert [s for _, s in frames] == live
    assert all(s.kv_groups == ("full", "sliding 24") for s in live if s.tables)
    assert any(-1 in t for s in live for t in s.tables.values())  # the window freed blocks
    last = live[-1].stats
    assert last["window_freed_blocks"] > 0 and set(last["group_blocks"]) == {"full", "sliding 24"}
    for _, state in frames:  # the replay's colours: one per request, in every group
        for b in state.blocks:
            owners = {state.group_of(s) for s in b.owners}
            assert owners <= set(state.colors)
        assert set(state.colors) <= {"a", "b"}
    assert "freed by sliding windows" in stats_html(frames[-1][1])


def _stats() -> dict:
    """The engine stats a stats line reads, all zero."""
    keys = ("num_running", "num_waiting", "num_swapped", "preemptions_recompute",
            "preemptions_swap", "cow_copies", "prefix_hit_rate")  # fmt: skip
    return dict.fromkeys(keys, 0)


def test_groups_are_never_guessed_from_the_ids():
    """A one-group manager whose ids hold a '|' draws as one group (found in review), and a
    coordinator's recording names its groups in its meta for the replay."""
    kv = KVCacheManager(8, BS)
    kv.add_sequence("x|1", [1, 2])
    kv.add_sequence("x|2", [3, 4])
    state = pool_state(kv)
    assert state.kv_groups == () and state.seq_of("x|1") == "x|1"
    assert "per group" not in stats_html(state)
    _, log = _session()
    assert log.meta["kv_groups"] == [FULL, SLIDING]
    assert EventLog.from_json(log.to_json()).meta["kv_groups"] == [FULL, SLIDING]
    assert replay_states(log)[-1][1].kv_groups == (FULL, SLIDING)
