"""A LiveBlockView following an engine that another thread steps (a server's engine thread).

``Stepper`` stands in for the server's handle: one thread owns the engine and steps it while it
has work; ``call(fn)`` runs ``fn(engine)`` on that thread between steps. Every wait is bounded.
"""

import itertools
import os
import queue
import threading
import time
from concurrent.futures import Future

import pytest

from pagedlearn import LLM, SamplingParams
from pagedlearn.viz.live import FOLLOW_FPS, LiveBlockView, is_idle
from pagedlearn.viz.state import pool_state, replay_states

os.environ.setdefault("HF_HUB_OFFLINE", "1")
WAIT = 30.0  # seconds: the most any test waits for the engine thread


class Stepper:
    """The engine thread of a server, without the server: ``.engine``, ``.llm``, ``.call``."""

    def __init__(self, llm) -> None:
        self.llm, self.engine = llm, llm.engine
        self._calls: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            busy = self.engine.has_unfinished_requests()
            try:
                fn, done = self._calls.get(timeout=0 if busy else 0.01)
            except queue.Empty:
                pass
            else:
                try:
                    done.set_result(fn(self.engine))
                except BaseException as exc:
                    done.set_exception(exc)
                continue
            if busy:
                self.engine.step()

    def call(self, fn):
        done: Future = Future()
        self._calls.put((fn, done))
        return done.result(timeout=WAIT)

    def wait_idle(self) -> None:
        deadline = time.monotonic() + WAIT
        while self.call(lambda e: e.has_unfinished_requests()):
            assert time.monotonic() < deadline, "the engine did not finish its requests"
            time.sleep(0.01)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=WAIT)


@pytest.fixture
def stepper():
    s = Stepper(LLM("tiny-gpt2", num_blocks=32, block_size=4, verbose=False))
    yield s
    s.stop()


def add_requests(engine, tag: str, max_tokens: int = 40) -> None:
    system = "You are a helpful assistant. " * 2  # a shared prefix: shared, cached blocks
    for i in range(4):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(f"{tag}{i}", system + f"Question {i}?", params)


def same_pool(a, b) -> bool:
    return (a.blocks, a.tables, a.num_tokens, a.swapped) == (
        b.blocks,
        b.tables,
        b.num_tokens,
        b.swapped,
    )


def test_a_following_view_draws_at_most_max_fps_and_always_the_idle_frame(stepper):
    log = stepper.call(lambda e: e.record())
    view = LiveBlockView(stepper, max_fps=10)
    assert view.following and view.max_fps == 10
    drawn = []  # (time, state) of every picture drawn, on the engine's thread
    draw = view._draw
    view._draw = lambda state, finished: (
        drawn.append((time.monotonic(), state)),
        draw(state, finished),
    )
    t0 = time.monotonic()
    stepper.call(lambda e: add_requests(e, "a"))
    stepper.wait_idle()
    elapsed = time.monotonic() - t0
    steps = stepper.call(lambda e: e.num_steps)

    assert view.frames_seen == steps  # every step event went through the view
    assert view.frames_drawn == len(drawn) + 1  # + the first picture, drawn before any step
    busy = [t for t, s in drawn if not is_idle(s)]
    assert len(busy) <= elapsed * view.max_fps + 1  # the rate limit...
    assert view.frames_drawn < view.frames_seen  # ... which skipped frames in this run
    gaps = [b - a for (a, _), (b, s) in itertools.pairwise(drawn) if not is_idle(s)]
    assert all(g >= 1 / view.max_fps - 0.005 for g in gaps), gaps
    # The last picture is the pool as it is: the idle frame is always drawn.
    assert is_idle(view.state)
    assert same_pool(view.state, stepper.call(pool_state))
    # Every frame went through the palette: a drawn frame has its replay's colours.
    replayed = {s.step: s for _, s in replay_states(log)}
    for _, state in drawn:
        assert state.colors == replayed[state.step].colors
        assert same_pool(state, replayed[state.step])
    assert view.last_draw_seconds > 0
    view.close()
    log.close()


def test_a_following_view_never_steps_and_says_who_does(stepper):
    view = LiveBlockView(stepper)
    assert view.max_fps == FOLLOW_FPS
    buttons = [view.play_button, view.pause_button, view.step_button, view.speed]
    assert all(b.disabled for b in buttons)
    assert "Following" in view.driver.value and "another thread" in view.driver.value
    for action in (view.step, view.run, view.play):
        with pytest.raises(RuntimeError, match="another thread steps"):
            action()
    view.pause()  # harmless, and it enables nothing
    assert all(b.disabled for b in buttons)
    view.close()
    assert all(b.disabled for b in buttons)


def test_close_detaches_on_the_engine_thread(stepper):
    view = LiveBlockView(stepper, max_fps=1000)
    stepper.call(lambda e: add_requests(e, "b", max_tokens=5))
    stepper.wait_idle()
    seen, png = view.frames_seen, view.image.value
    assert seen > 0
    view.close()
    view.close()  # idempotent
    stepper.call(lambda e: add_requests(e, "c", max_tokens=5))
    stepper.wait_idle()
    assert view.frames_seen == seen and view.image.value == png  # nothing more arrived


def test_a_slow_rate_draws_only_the_first_and_the_idle_frame(stepper):
    view = LiveBlockView(stepper, max_fps=1e-3)  # one picture per 1000 s, but the idle one
    stepper.call(lambda e: add_requests(e, "d", max_tokens=10))
    stepper.wait_idle()
    assert view.frames_seen > 2
    assert view.frames_drawn == 2
    assert same_pool(view.state, stepper.call(pool_state))
    view.close()


def test_a_drawing_error_is_shown_and_never_reaches_the_engine(stepper):
    view = LiveBlockView(stepper, max_fps=1000)

    def broken(state, finished):
        raise ValueError("a drawing bug")

    view._draw = broken
    stepper.call(lambda e: add_requests(e, "e", max_tokens=5))
    stepper.wait_idle()  # the engine finished every request anyway
    assert isinstance(view.last_error, ValueError)
    assert "a drawing bug" in view.error.value
    assert stepper.call(lambda e: e.kv.trace.held_error) is None
    view.close()


def test_follow_on_an_llm_and_bad_arguments():
    llm = LLM("tiny-gpt2", num_blocks=16, block_size=4, verbose=False)
    view = LiveBlockView(llm, follow=True)  # a thread of the caller's steps it
    assert view.following and view.step_button.disabled and view.max_fps == FOLLOW_FPS
    view.close()
    plain = LiveBlockView(llm)
    assert not plain.following and plain.max_fps is None and not plain.step_button.disabled
    plain.close()
    handle = Stepper(llm)
    try:
        with pytest.raises(ValueError, match="follow=False on a server's handle"):
            LiveBlockView(handle, follow=False)
        for bad in (0, -1, True, "5"):
            with pytest.raises(ValueError, match="max_fps"):
                LiveBlockView(handle, max_fps=bad)
        with pytest.raises(TypeError, match="follow must be"):
            LiveBlockView(handle, follow="yes")
        assert not llm.engine.kv.trace.listening  # the refused views subscribed nothing
    finally:
        handle.stop()


def test_following_a_real_server():
    serve = pytest.importorskip("pagedlearn.serve").serve
    httpx = pytest.importorskip("httpx")
    with serve("tiny-gpt2", port=0, num_blocks=32, block_size=4, verbose=False) as srv:
        view = LiveBlockView(srv)  # a handle: follows by default
        assert view.following and view.step_button.disabled
        assert srv.url in view.driver.value
        body = {"model": srv.model_name, "prompt": "Hello there", "max_tokens": 12}
        r = httpx.post(srv.base_url + "/completions", json=body, timeout=WAIT)
        assert r.status_code == 200, r.text
        srv.call(lambda e: None)  # the engine thread is between steps: the response's is done
        assert view.frames_seen >= 12 and is_idle(view.state)
        assert same_pool(view.state, srv.call(pool_state))
    view.close()  # after stop(): the call is refused, the view detaches from here
    assert not srv.engine.kv.trace.listening


def test_a_view_whose_first_drawing_fails_subscribes_nothing(stepper, monkeypatch):
    from pagedlearn.viz.view import PoolView

    def broken(self, state, finished):
        raise ValueError("cannot draw")

    monkeypatch.setattr(PoolView, "_draw", broken)
    with pytest.raises(ValueError, match="cannot draw"):  # raised on the engine thread, here
        LiveBlockView(stepper)
    assert not stepper.call(lambda e: e.kv.trace.listening)
