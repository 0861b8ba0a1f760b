"""The worker-slab picture (tensor parallelism, paper section 4.6): the driver's one block table
over each worker's KV slab -- the same block ids, different heads -- static and live.

One tp=2 tiny GPT-2 for the module (two worker processes, ~4 s to start); every test leaves it
with no unfinished request. Every wait is bounded."""

import base64
import io
import os
import time

import numpy as np
import pytest
from PIL import Image

from pagedlearn import LLM, SamplingParams
from pagedlearn.errors import WorkerError
from pagedlearn.viz.colors import Palette
from pagedlearn.viz.live import LiveBlockView
from pagedlearn.viz.state import pool_state
from pagedlearn.viz.style import CACHED_COLOR, FREE_COLOR
from pagedlearn.viz.workers import (
    WorkerSlab,
    described,
    draw_worker_slabs,
    heads_label,
    read_slabs,
    slab_cells,
    slabs_figure,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
NOT_A_REQUEST = {FREE_COLOR, CACHED_COLOR}
MAX_STEPS = 64  # more than any request here needs


@pytest.fixture(scope="module")
def tp2():
    # On the CPU even where there is a GPU: tp=2 on CUDA needs two of them.
    kw = {"num_blocks": 32, "block_size": 4, "verbose": False, "device": "cpu"}
    llm = LLM("tiny-gpt2", tensor_parallel_size=2, **kw)
    yield llm
    llm.shutdown()  # bounded: the workers get a few seconds, then are killed


def add_requests(engine, tag: str) -> None:
    engine.add_request(f"{tag}a", "Hello there my friend", SamplingParams(max_tokens=8))
    engine.add_request(f"{tag}b", "Other words, another table", SamplingParams(max_tokens=8))


def finish(engine) -> None:
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            return
        engine.step()
    raise AssertionError("the requests did not finish")


def marked(band: list[list[str]]) -> list[set[int]]:
    """Per row of a band: the block ids drawn in a request's colour."""
    return [{b for b, c in enumerate(row) if c not in NOT_A_REQUEST} for row in band]


def test_worker_rows_mark_the_blocks_the_block_table_holds(tp2):
    engine = tp2.engine
    add_requests(engine, "fig")
    for _ in range(3):
        engine.step()
    timings = engine.runner.last_timings
    state = Palette().paint(pool_state(engine))
    slabs = read_slabs(tp2)
    assert engine.runner.last_timings is timings  # the rpcs left the step's timings alone
    used = {b.block_id for b in state.blocks if b.owners}
    assert len(used) >= 4 and len({state.group_of(s) for s in state.tables}) == 2
    assert [s.head_ids for s in slabs] == [(0, 1), (2, 3)]
    assert len({s.pid for s in slabs} | {os.getpid()}) == 3  # two worker processes
    for s in slabs:  # each worker wrote its heads of every block the driver's table holds
        assert used <= {b for b in range(32) if s.written[b].all()}
    assert (slabs[0].written.any(1) == slabs[1].written.any(1)).all()  # at the same block ids
    first = min(used)  # a slab that has written one head of one block shows that cell only
    half = WorkerSlab(0, 1, "cpu", (0, 1), np.zeros((32, 2), bool))
    half.written[first, 0] = True
    assert marked(slab_cells(state, half)) == [{first}, set()]

    _, artist = slabs_figure(state.num_blocks, [described(s) for s in slabs])
    artist.update(state, slabs)
    driver, *bands = artist.cell_colors()
    assert len(bands) == 2 and [len(b) for b in bands] == [2, 2]
    assert marked(driver) == [used]
    for band in bands:  # the same block ids in both workers, each head, in the driver's colour
        assert marked(band) == [used, used]
        for row in band:
            assert [row[b] for b in sorted(used)] == [driver[0][b] for b in sorted(used)]
    for b in used:
        (owner,) = {state.group_of(s) for s in state.blocks[b].owners}
        assert driver[0][b] == state.colors[owner]

    finish(engine)  # the blocks are freed: no request colour left, though the K/V stays
    state = Palette().paint(pool_state(engine))
    slabs = read_slabs(engine)
    assert all(s.written.any() for s in slabs)
    artist.update(state, slabs)
    assert all(marked(band) == [set()] * len(band) for band in artist.cell_colors())


def test_draw_worker_slabs_static_figure(tp2, tmp_path):
    engine = tp2.engine
    add_requests(engine, "png")
    engine.step()
    fig = draw_worker_slabs(tp2)
    gids = [img.get_gid() for ax in fig.axes for img in ax.images]
    assert gids == ["driver", "worker 0", "worker 1"]
    labels = [ax.get_ylabel() for ax in fig.axes]
    assert labels[0].startswith(f"driver (pid {os.getpid()})")
    assert "KV heads 0-1" in labels[1] and "KV heads 2-3" in labels[2]
    assert "pnga.0: [" in "".join(t.get_text() for t in fig.legends[0].get_texts())
    path = tmp_path / "slabs.png"
    fig.savefig(path)
    assert Image.open(path).size[0] > 800
    finish(engine)
    with pytest.raises(ValueError, match=r"layer must be an int in 0\.\.1"):
        read_slabs(tp2, layer=2)  # refused on the driver: the workers never see it
    assert tp2.generate(["Hi"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    with pytest.raises(TypeError, match="LLM or an LLMEngine"):
        draw_worker_slabs("tiny-gpt2")


def test_one_worker_holds_every_head():
    llm = LLM("tiny-gpt2", num_blocks=16, block_size=4, verbose=False)
    llm.engine.add_request("a", "Hello there my friend", SamplingParams(max_tokens=4))
    llm.engine.step()
    (slab,) = read_slabs(llm)
    assert slab.head_ids == (0, 1, 2, 3) and slab.pid == os.getpid()
    assert heads_label(slab.head_ids) == "KV heads 0-3"
    state = Palette().paint(pool_state(llm))
    _, artist = slabs_figure(16, [described(slab)])
    artist.update(state, [slab])
    driver, band = artist.cell_colors()
    used = {b.block_id for b in state.blocks if b.owners}
    assert used and marked(band) == [used] * 4 and marked(driver) == [used]
    assert "tensor_parallel_size=1" in artist._title.get_text()
    view = LiveBlockView(llm)  # one worker: not shown unless asked
    assert view.slabs is None and view.workers_image is None
    view.close()
    view = LiveBlockView(llm, workers=True)
    view.run(MAX_STEPS)
    assert view.workers_image.value and len(view.slabs.artist.images) == 2
    view.close()
    with pytest.raises(TypeError, match="workers must be True, False or None"):
        LiveBlockView(llm, workers="yes")


def test_live_view_redraws_the_slabs_with_each_frame(tp2):
    engine = tp2.engine
    view = LiveBlockView(tp2)  # two workers: shown by default
    kids = list(view.widget.children)
    assert kids[kids.index(view.image) + 1] is view.workers_image
    first = view.workers_image.value
    assert first  # the attach frame
    add_requests(engine, "live")
    seen = []
    while engine.has_unfinished_requests() and len(seen) < MAX_STEPS:
        view.step()
        seen.append(view.workers_image.value)
        state = view.state  # the frame just drawn, with its colours
        used = {b.block_id for b in state.blocks if b.owners}
        _, *bands = view.slabs.artist.cell_colors()
        assert all(marked(band) == [used, used] for band in bands)
    assert view.last_error is None and view.error.value == ""
    assert len(set(seen)) >= 2 and seen[0] != first
    size = Image.open(io.BytesIO(seen[-1])).size
    assert size[0] > 600 and size[1] > 150
    # A reader without a kernel (a stored notebook) gets both pictures, one above the other.
    stored = base64.b64decode(view._repr_mimebundle_()["image/png"])
    pool = Image.open(io.BytesIO(view.image.value)).size
    assert Image.open(io.BytesIO(stored)).size == (max(pool[0], size[0]), pool[1] + size[1])
    view.close()


def test_workers_false_hides_them(tp2):
    view = LiveBlockView(tp2, workers=False)
    assert view.slabs is None and view.workers_image is None
    assert not any(isinstance(k, type(view.image)) and k is not view.image
                   for k in view.widget.children)  # fmt: skip
    view.close()


def test_a_failing_rpc_is_shown_not_raised(tp2, monkeypatch):
    import pagedlearn.parallel

    def dead(*args, **kwargs):
        raise WorkerError("worker 1 died (a test)")

    monkeypatch.setattr(pagedlearn.parallel, "collective_rpc", dead)
    view = LiveBlockView(tp2)  # the attach frame fails: shown, and the view still subscribes
    assert isinstance(view.last_error, WorkerError) and "worker 1 died" in view.error.value
    tp2.engine.add_request("faila", "Hello", SamplingParams(max_tokens=3))
    before = view.image.value
    assert view.step() is not None  # the step goes on; the pool picture too
    assert view.image.value != before and "worker 1 died" in view.error.value
    assert not view.workers_image.value
    monkeypatch.undo()
    view.step()
    assert view.error.value == "" and view.workers_image.value  # the slabs are back
    finish(tp2.engine)
    view.close()


def test_following_a_served_tensor_parallel_engine(tp2):
    from openai import OpenAI

    from pagedlearn.serve import serve

    srv = serve(tp2, port=0)
    try:
        view = LiveBlockView(srv)  # its rpcs run on the server's engine thread
        assert view.following and view.workers_image.value
        drawn = view.frames_drawn
        client = OpenAI(base_url=srv.base_url, api_key="none", timeout=30, max_retries=0)
        out = client.completions.create(model=srv.model_name, prompt="Hello", max_tokens=4)
        assert out.choices[0].text
        deadline = time.monotonic() + 30
        while view.frames_drawn == drawn and time.monotonic() < deadline:
            time.sleep(0.01)
        assert view.frames_drawn > drawn and view.last_error is None
        view.close()
    finally:
        srv.stop()
    assert tp2.generate(["Hi"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
