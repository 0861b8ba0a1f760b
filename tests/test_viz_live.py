"""The live dashboard and the replay view, on a real engine (tiny GPT-2, a handful of tokens)."""

import asyncio
import io
import os

import numpy as np
import pytest
from PIL import Image

from pagedlearn import LLM, KVCacheManager, SamplingParams
from pagedlearn.errors import TraceFileError
from pagedlearn.trace import limits as trace_limits
from pagedlearn.viz import pool as pool_module
from pagedlearn.viz import replay as replay_module
from pagedlearn.viz.live import DPI, MAX_BUTTONS, LiveBlockView, ReplayView
from pagedlearn.viz.pool import MAX_DRAWN_BLOCKS, PoolTooLargeError
from pagedlearn.viz.state import pool_state
from pagedlearn.viz.style import block_color

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PROMPT = "Hello there my friend"  # 21 tokens with tiny-gpt2's tokenizer: 5 full blocks + 1


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-gpt2", num_blocks=24, block_size=4, verbose=False)


def add_requests(engine, tag):
    engine.add_request(f"{tag}a", PROMPT, SamplingParams(max_tokens=5))
    two = SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=5)  # forks: shared blocks, CoW
    engine.add_request(f"{tag}b", PROMPT, two)
    engine.add_request(f"{tag}c", "Other words", SamplingParams(max_tokens=3))


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


@pytest.fixture(scope="module")
def recorded(llm):
    """One run watched by a LiveBlockView, with what it drew after every step, and its log."""
    engine = llm.engine
    log = engine.record()
    view = LiveBlockView(llm)
    add_requests(engine, "r")
    frames = []
    while engine.has_unfinished_requests():
        before = view.image.value
        view.step()
        assert view.image.value != before  # the picture changes with every step
        state = view.state
        assert state.blocks == pool_state(engine.kv).blocks  # the view shows the engine now
        colors = [block_color(b, state.group_of, state.colors) for b in state.blocks]
        assert view.artist.face_colors() == colors
        frames.append(
            dict(
                step=state.step,
                drawn=view.artist.drawn(),
                png=view.image.value,
                stats=view.stats.value,
                requests=view.requests.value,
                state=state,
            )
        )
    log.close()
    view.close()
    return view, log, frames


def test_live_view_follows_the_engine(recorded, llm):
    view, _, frames = recorded
    assert [f["step"] for f in frames] == list(range(frames[0]["step"], frames[-1]["step"] + 1))
    shared = [f for f in frames if any(h for _, _, h, _ in f["drawn"])]
    assert shared, "the n=2 request shares blocks: some frame must hatch them"
    last = frames[-1]
    assert last["state"].stats["cow_copies"] >= 1  # its partial last block was copied on write
    assert "CoW copies" in last["stats"] and "prefix hit rate" in last["stats"]
    for rid in ("ra", "rb", "rc"):
        assert f"> {rid}</td><td>finished (length)" in last["requests"]
    assert view.last_draw_seconds < 1.0
    # The picture is the figure: the fast (blitted) render equals a full draw, pixel for pixel.
    buf = io.BytesIO()
    view.figure.savefig(buf, format="png", dpi=DPI)
    assert np.array_equal(pixels(buf.getvalue()), pixels(view.image.value))


def test_replay_shows_what_the_live_view_showed(recorded):
    _, log, frames = recorded
    replay = ReplayView(log)
    assert replay.num_frames == len(frames)
    for k in [*range(len(frames)), 0, len(frames) - 1, 1]:  # forward, then jumps back and forth
        replay.slider.index = k
        f = frames[k]
        assert replay.state == f["state"]
        assert replay.artist.drawn() == f["drawn"], f"frame {k}"
        assert replay.stats.value == f["stats"]
        assert replay.requests.value == f["requests"]
        assert np.array_equal(pixels(replay.image.value), pixels(f["png"]))
    replay.show(2)
    assert replay.slider.index == 2 and replay.frame == 2
    with pytest.raises(ValueError, match="out of range"):
        replay.show(len(frames))


def test_replay_from_json_text_and_file(recorded, tmp_path):
    _, log, frames = recorded
    text = log.to_json()
    path = tmp_path / "run.json"
    path.write_text(text)
    for source in (text, path, str(path)):
        replay = ReplayView(source)
        replay.slider.index = len(frames) - 1
        assert replay.artist.drawn() == frames[-1]["drawn"]
    assert "token ids" not in replay.inspect(0)  # no tokenizer: ids only
    with pytest.raises(FileNotFoundError, match="no trace file"):
        ReplayView(str(tmp_path / "missing.json"))
    with pytest.raises(TypeError, match="EventLog"):
        ReplayView(42)


def test_replay_takes_json_as_text_or_bytes_and_paths_as_str_or_path(
    recorded, tmp_path, monkeypatch
):
    _, log, frames = recorded
    text = log.to_json()
    path = tmp_path / "run.json"
    path.write_bytes(text.encode())
    for source in (text.encode(), bytearray(text.encode()), " \n\t" + text, path.read_bytes()):
        assert ReplayView(source).num_frames == len(frames)
    # JSON that is no trace: the file check says what is wrong, not "no such file"
    for bad in ("[1, 2, 3]", "  \n[]", " {not json", b"[1]", b"\xff\xfe{"):
        with pytest.raises(TraceFileError):
            ReplayView(bad)
    # a name that is not JSON: a path, named briefly when missing
    long_name = "runs/" + "x" * 500 + ".json"
    with pytest.raises(FileNotFoundError, match="no trace file") as info:
        ReplayView(long_name)
    message = str(info.value)
    assert len(message) < 200 and "(510 characters)" in message and "xxx.json'" in message
    with pytest.raises(FileNotFoundError, match=r"missing\.json"):
        ReplayView(tmp_path / "missing.json")
    monkeypatch.setattr(trace_limits, "MAX_TRACE_CHARS", 100)  # a file past the cap: not read
    with pytest.raises(TraceFileError, match=f"is {len(text)} bytes, above the cap"):
        ReplayView(path)


def test_replay_of_a_log_without_steps_is_a_clear_error():
    kv = KVCacheManager(8, 4)
    log = kv.record()
    kv.add_sequence("a", [1, 2, 3])
    with pytest.raises(ValueError, match="no step events"):
        ReplayView(log)


def test_inspect_names_owners_refcount_and_tokens(llm):
    engine = llm.engine
    view = LiveBlockView(llm)
    engine.add_request("ia", PROMPT, SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=4))
    view.step()
    state = view.state
    b = next(b for b in state.blocks if b.refcount == 2 and b.num_tokens == 4)
    text = view.inspect(b.block_id)
    assert "refcount: 2" in text and "ia.0 (request ia)" in text and "ia.1 (request ia)" in text
    assert repr(llm.tokenizer.decode(list(b.token_ids))) in text
    assert f"hash: {b.block_hash[:12]}" in text and "fill: 4/4 slots" in text
    free = next(b for b in state.blocks if b.kind == "free")
    assert "not cached" in view.inspect(free.block_id)
    view.block_buttons[b.block_id].click()  # what a click shows
    assert "refcount: 2" in view.details.value
    button = view.block_buttons[b.block_id]
    assert button.style.button_color == view.artist.face_colors()[b.block_id]
    with pytest.raises(ValueError, match="no block 99"):
        view.inspect(99)
    with pytest.raises(TypeError):
        view.inspect("3")
    view.run()
    view.close()


def test_run_finishes_everything_and_close_detaches(llm):
    engine = llm.engine
    view = LiveBlockView(llm, delay=0)
    assert "application/vnd.jupyter.widget-view+json" in view._repr_mimebundle_()
    add_requests(engine, "u")
    done = view.run()
    assert sorted(o.request_id for o in done) == ["ua", "ub", "uc"]
    assert not engine.has_unfinished_requests()
    assert view.state.count("used") + view.state.count("shared") == 0
    view.close()
    picture = view.image.value
    engine.add_request("after", PROMPT, SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    assert view.image.value == picture  # closed: no longer following
    with pytest.raises(RuntimeError, match="closed"):
        view.step()
    with pytest.raises(ValueError, match="delay"):
        LiveBlockView(llm, delay=-1)
    with pytest.raises(TypeError, match="LLM"):
        LiveBlockView("tiny-gpt2")


def test_play_runs_in_a_task_and_shows_errors(llm, monkeypatch):
    engine = llm.engine
    view = LiveBlockView(llm, delay=0)
    engine.add_request("p", PROMPT, SamplingParams(max_tokens=3))

    async def play():
        view.play()
        assert view.pause_button.disabled is False
        await view._task

    asyncio.run(play())
    assert not engine.has_unfinished_requests() and view.play_button.disabled is False

    engine.add_request("q", PROMPT, SamplingParams(max_tokens=3))

    def boom():
        raise RuntimeError("boom in step")

    monkeypatch.setattr(engine, "step", boom)
    asyncio.run(play())
    assert "boom in step" in view.error.value and isinstance(view.last_error, RuntimeError)
    assert view.play_button.disabled is False  # playing stopped, can be resumed
    monkeypatch.undo()
    view.run()
    view.close()


def test_large_pool_uses_a_block_box():
    kv = KVCacheManager(MAX_BUTTONS + 8, 4, enable_prefix_caching=True)
    log = kv.record()
    kv.add_sequence("a", list(range(10)))
    kv.mark_step()
    kv.fork("a", "b")
    kv.mark_step()
    replay = ReplayView(log)
    assert replay.block_buttons == [] and replay.num_frames == 2
    replay.slider.index = 1
    replay.block_box.value = 1
    assert "refcount: 2" in replay.details.value and "tokens: 4 5 6 7" in replay.details.value


def test_views_of_a_pool_too_large_to_draw_are_refused_before_any_frame(llm, monkeypatch):
    kv = KVCacheManager(MAX_DRAWN_BLOCKS + 1, 4)
    log = kv.record()
    kv.add_sequence("a", [1, 2, 3])
    kv.mark_step()
    monkeypatch.setattr(replay_module, "replay_states", lambda log: pytest.fail("built frames"))
    for source in (log, log.to_json()):  # a file within the trace caps, beyond the picture's
        with pytest.raises(PoolTooLargeError, match=f"{MAX_DRAWN_BLOCKS + 1} blocks"):
            ReplayView(source)
    monkeypatch.setattr(pool_module, "MAX_DRAWN_BLOCKS", 16)  # the live view of a 24-block pool
    subscriptions = llm.engine.kv.trace.num_subscriptions
    with pytest.raises(PoolTooLargeError, match="MAX_DRAWN_BLOCKS = 16"):
        LiveBlockView(llm)
    assert llm.engine.kv.trace.num_subscriptions == subscriptions  # it never subscribed


def test_a_reader_without_a_kernel_sees_the_picture(llm):
    """A notebook read on GitHub has no widgets: the view's output also carries its PNG and
    its stats line, as they were when it was displayed."""
    import base64

    view = LiveBlockView(llm, delay=0)
    try:
        llm.engine.add_request("r", "Hello there", SamplingParams(max_tokens=3, ignore_eos=True))
        view.step()
        bundle = view._repr_mimebundle_()
        assert "application/vnd.jupyter.widget-view+json" in bundle
        assert base64.b64decode(bundle["image/png"]) == view.image.value
        step = view.state.step
        assert bundle["text/plain"].startswith(f"LiveBlockView: step {step} · blocks:")
    finally:
        view.close()
        while llm.engine.has_unfinished_requests():
            llm.engine.step()


def test_play_with_nothing_to_run_says_how_to_add_requests(llm):
    """After Run All every request is done: Play must say what to do, then play what is added."""
    engine = llm.engine
    view = LiveBlockView(llm, delay=0)
    try:
        assert not engine.has_unfinished_requests()
        view.play_button.click()
        assert "Nothing to run" in view.error.value and "add_request(" in view.error.value
        assert view._task is None and view.play_button.disabled is False
        before = view.image.value
        engine.add_request("more", "Once upon a time")  # the one-liner the message gives

        async def play():
            view.play_button.click()
            await view._task

        asyncio.run(play())
        assert view.image.value != before and "Done at step" in view.error.value
        assert view.play_button.description == "Play"
        assert "every request" in view.play_button.tooltip
    finally:
        view.close()


def test_frames_are_named_by_their_step_everywhere(llm):
    """One numbering rule: the replay's slider, its stats line, a figure of the frame and the
    live view's stats line all name a frame by its engine step; an abort's frame says so."""
    import re

    from pagedlearn.viz import draw_block_pool

    engine = llm.engine
    log = engine.record()
    view = LiveBlockView(llm, delay=0)
    live = []
    engine.kv.trace.subscribe(lambda e: e.kind == "step" and live.append(view.stats.value))
    add_requests(engine, "n")
    view.run(max_steps=2)
    engine.abort_request("nc")
    view.run()
    log.close()
    view.close()
    replay = ReplayView(log)
    steps = [s.step for s in replay.frames]
    assert steps[:3] == [steps[0], steps[0] + 1, steps[0] + 1]  # step, step, its abort frame
    for i, state in enumerate(replay.frames):
        replay.show(i)
        label = re.match(r"<b>(step \d+[^<]*)</b>", replay.stats.value).group(1)
        assert label == re.match(r"<b>(step \d+[^<]*)</b>", live[i]).group(1)
        assert replay.slider.label == label.removeprefix("step ").replace(": nc", "")
        title = draw_block_pool(state).axes[0].get_title()
        assert title.startswith(f"KV block pool, {label}:"), title
    assert replay.slider.options[2][0] == f"{steps[2]} (abort)"
    replay.show_step(steps[1])
    assert replay.frame == 1
    with pytest.raises(ValueError, match="no frame of step 999"):
        replay.show_step(999)


def test_the_views_fit_a_notebook_column(llm):
    """The block buttons wrap (none is cut off on the right), the panels wrap under each other,
    and the picture is the grid and its title: no band kept empty for a legend."""
    view = LiveBlockView(llm, delay=0)
    try:
        picker = view.inspector.children[1]
        assert picker.layout.flex_flow == "row wrap" and len(picker.children) == 24
        panels = view.widget.children[-1]
        assert panels.children == (view.requests, view.inspector)
        assert panels.layout.flex_flow == "row wrap"
        assert view.artist.ax.get_legend() is None
        rows = view.artist.rows
        assert view.figure.get_size_inches()[1] == pytest.approx(rows * 0.62 + 0.6)
        img = Image.open(io.BytesIO(view.image.value))
        assert img.size[1] == round((rows * 0.62 + 0.6) * DPI)
    finally:
        view.close()
