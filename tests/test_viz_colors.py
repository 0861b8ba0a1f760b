"""One colour per request per run: the live view, the replay view and every figure agree, and
two requests on screen together never share a colour (issue 14)."""

import os

import pytest
from matplotlib.colors import to_hex

from pagedlearn import LLM, KVCacheManager, SamplingParams
from pagedlearn.viz import ReplayView, draw_block_pool, draw_block_tables
from pagedlearn.viz.colors import OKABE_ITO, REQUEST_COLORS, TOL_MUTED, Palette, visible_groups
from pagedlearn.viz.live import LiveBlockView
from pagedlearn.viz.state import pool_state, replay_states
from pagedlearn.viz.style import block_color

os.environ.setdefault("HF_HUB_OFFLINE", "1")
BASE = [to_hex(c) for c in REQUEST_COLORS]


def figure_colors(fig, state) -> dict:
    """Request -> the set of colours its blocks have in a draw_block_pool figure."""
    bars = {p.get_gid(): to_hex(p.get_facecolor()) for p in fig.axes[0].patches if p.get_gid()}
    return _by_request(state, [bars[f"fill {b}"] for b in range(state.num_blocks)])


def _by_request(state, faces) -> dict:
    out = {}
    for b in state.blocks:
        groups = {state.group_of(s) for s in b.owners}
        if len(groups) == 1:
            out.setdefault(groups.pop(), set()).add(faces[b.block_id])
    return out


def assert_distinct(colors: dict, where: str) -> None:
    assert len(set(colors.values())) == len(colors), f"{where}: shared colours {colors}"


# --- the rule, on a palette alone -----------------------------------------------------------
def test_a_palette_never_repeats_a_colour_while_nothing_leaves():
    p = Palette()
    first = [p.color(g) for g in "xyz"]
    assert first == BASE[:3] and p.color("y") == first[1]  # Okabe-Ito in order; stable
    many = [p.color(i) for i in range(40)]
    assert len(set(first + many)) == 43  # 7 Okabe-Ito, 9 Tol muted, then generated hues
    assert many[4:13] == [to_hex(c) for c in TOL_MUTED]
    with pytest.raises(ValueError):
        Palette(["not-a-colour"])
    with pytest.raises(ValueError):
        Palette([])
    with pytest.raises(TypeError, match="hashable"):
        p.color(["a", "list"])
    with pytest.raises(TypeError, match="PoolState"):
        p.observe({"a": 1})


def test_black_is_never_a_request_colour():
    """Okabe-Ito's eighth colour, black, would read like the grey of a block several requests
    share: the first tier is the other seven, in order."""
    assert [to_hex(c) for c in OKABE_ITO[:7]] == BASE and to_hex(OKABE_ITO[7]) == "#000000"
    p = Palette()
    assert "#000000" not in {p.color(i) for i in range(60)}
    assert Palette(["#000000", "#0072b2"]).color("a") == "#000000"  # asked for: a course's choice


def _frame(kv, *seqs):
    """Make ``seqs`` (and only they) hold a block each, and return the pool's state."""
    for s in kv.sequences():
        if s not in seqs:
            kv.free_sequence(s)
    for s in seqs:
        if s not in kv.sequences():
            kv.add_sequence(s, [1])
    return pool_state(kv)


def test_a_newcomer_takes_an_unused_colour_then_the_one_freed_longest_ago():
    kv = KVCacheManager(32, 4)
    p = Palette()
    p.observe(_frame(kv, *"abcdefg"))  # all 7 Okabe-Ito colours (black left out)
    assert p.visible == dict(zip("abcdefg", BASE, strict=True))
    p.observe(_frame(kv, *"bcdefg"))  # a leaves: blue is free
    p.observe(_frame(kv, *"cdefg"))  # then b: orange
    colors = p.observe(_frame(kv, *"cdefgij"))
    assert colors["i"] == BASE[0] and colors["j"] == BASE[1]  # the longest-freed first
    colors = p.observe(_frame(kv, *"cdefgijk"))  # 8 visible: the next tier, not black
    assert colors["k"] == to_hex(TOL_MUTED[0])
    assert_distinct(colors, "8 visible")
    colors = p.observe(_frame(kv, "c", "d", "a"))  # i leaves, a comes back: blue is free
    assert colors == {"c": BASE[2], "d": BASE[3], "a": BASE[0]}
    colors = p.observe(_frame(kv, "a", "i"))  # i comes back: blue is a's now
    assert colors["a"] == BASE[0] and colors["i"] not in (BASE[0], BASE[2], BASE[3])


def test_many_requests_at_once_stay_distinct():
    kv = KVCacheManager(64, 4)
    p = Palette()
    colors = p.observe(_frame(kv, *range(30)))
    assert_distinct(colors, "30 visible")
    assert set(BASE) <= set(colors.values())


# --- one run, every drawing ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def run():
    """A run where requests come and go: 3, then 4 more, then 6 more while some still run --
    more requests than Okabe-Ito has colours, and an order of appearance that no single frame
    knows. The live view is created when recording starts, as the chapters do."""
    llm = LLM("tiny-gpt2", num_blocks=40, block_size=4, verbose=False)
    engine = llm.engine
    log = engine.record()
    view = LiveBlockView(llm, delay=0)
    live = []
    engine.kv.trace.subscribe(lambda e: e.kind == "step" and live.append(view.colors))
    waves = [["a", "b", "c"], ["d", "e", "f", "g"], [f"h{i}" for i in range(6)]]
    for i, wave in enumerate(waves):
        for k, rid in enumerate(wave):
            params = SamplingParams(max_tokens=2 + 3 * k, ignore_eos=True)
            engine.add_request(rid, "Hello there", params)
        view.run(max_steps=None if i == len(waves) - 1 else 3)
    engine.add_request("x", "Hello", SamplingParams(max_tokens=6, ignore_eos=True))
    view.step()
    engine.abort_request("x")  # an abort is a frame of its own
    log.close()
    view.close()
    return view, log, live


def test_the_live_view_colours_each_frame_as_the_replay_does(run):
    _, log, live = run
    frames = replay_states(log)
    assert len(frames) == len(live) > 10
    for i, ((_, state), seen) in enumerate(zip(frames, live, strict=True)):
        assert state.colors == seen, f"frame {i}"
        assert list(state.colors) == visible_groups(state)
        assert_distinct(state.colors, f"frame {i}")
    assert max(len(s.colors) for _, s in frames) > len(BASE)  # past the first tier


def test_widget_and_figures_of_a_frame_draw_the_same_colours(run):
    _, log, _ = run
    replay = ReplayView(log.to_json())
    for i in range(replay.num_frames):
        replay.show(i)
        state = replay.state
        widget = _by_request(state, replay.artist.face_colors())
        buttons = [b.style.button_color for b in replay.block_buttons]
        assert buttons == replay.artist.face_colors()
        assert figure_colors(draw_block_pool(state), state) == widget, f"frame {i}"
        # a request's blocks have one colour, different from every other request's
        assert all(len(c) == 1 for c in widget.values())
        assert_distinct({g: c.pop() for g, c in widget.items()}, f"frame {i}")
        for g, color in state.colors.items():
            if not state.requests or any(r.request_id == g for r in state.requests):
                assert f"color:{color}'>&#9632;</span> {g}<" in replay.requests.value
    replay.show(max(range(replay.num_frames), key=lambda i: len(replay.frames[i].tables)))
    tables = draw_block_tables(replay.state)
    assert len(replay.state.colors) > 3 and tables.artists  # arrows in their request's colour
    for arrow in tables.artists:
        seq = arrow.get_gid().split(":")[0]
        assert to_hex(arrow.get_edgecolor()) == replay.state.colors[replay.state.group_of(seq)]


def test_a_palette_following_a_manager_colours_as_its_replay():
    """Chapter 02: figures of the live manager, the replay view and a figure of a replayed
    frame agree (R was blue in the figures, yellow in the replay, before)."""
    kv = KVCacheManager(num_blocks=12, block_size=4)
    log = kv.record()
    palette = Palette.follow(kv)
    step, drawn = 0, {}
    for name, n in {"A": 8, "B": 3, "C": 16, "D": 2, "E": 12, "F": 4}.items():
        kv.add_sequence(name, list(range(1, n + 1)))
        step += 1
        kv.mark_step(step=step)
    for name in ("D", "B", "F"):
        kv.free_sequence(name)
        step += 1
        kv.mark_step(step=step)
    kv.add_sequence("R", list(range(101, 113)))
    step += 1
    kv.mark_step(step=step)
    state = pool_state(kv)
    drawn = figure_colors(draw_block_pool(kv, palette=palette), state)
    tables = draw_block_tables(kv, ["R"], palette=palette)
    palette.close()
    replay = ReplayView(log)
    replay.show_step(step)
    assert replay.state.tables["R"] == (7, 2, 11)
    assert _by_request(replay.state, replay.artist.face_colors()) == drawn
    assert figure_colors(draw_block_pool(replay.state), replay.state) == drawn
    assert {to_hex(a.get_edgecolor()) for a in tables.artists} == drawn["R"]
    assert drawn["R"] == {BASE[6]}  # never-used yellow, not a colour that just left
    # the request panel of a manager-only replay lists its sequences (it said "no requests")
    assert "no requests" not in replay.requests.value
    for name in "ACER":
        assert f"&#9632;</span> {name}<" in replay.requests.value


def test_finished_requests_give_their_colour_up_in_the_request_list(run):
    _, log, _ = run
    replay = ReplayView(log)
    replay.show(replay.num_frames - 1)
    assert "&#9633;</span> a<" in replay.requests.value  # a hollow grey square: no colour
    shown = {g: c for g, c in replay.colors.items()}
    assert_distinct(shown, "last frame")


def test_block_color_reads_a_state_or_a_palette(run):
    _, log, _ = run
    _, state = next((i, s) for i, s in replay_states(log) if s.tables)
    block = next(b for b in state.blocks if b.refcount == 1)
    want = state.colors[state.group_of(block.owners[0])]
    assert block_color(block, state.group_of, state.colors) == want
    palette = Palette()
    asked = block_color(block, state.group_of, palette)
    assert asked == palette.color(state.group_of(block.owners[0]))
