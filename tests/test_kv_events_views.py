"""The pictures of a KV-event stream (viz/prefix_tree.py, viz/kv_events_timeline.py) and the live
view (viz/kv_events_live.py): drawn from a small state, and the live view's update path run with
no kernel -- by hand, and following a real subscriber of pagedlearn's own publisher."""

import time

import pytest

pytest.importorskip("msgspec")

from matplotlib.patches import Rectangle

from pagedlearn.kv_events.cache_state import KVCacheState
from pagedlearn.kv_events.messages import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from pagedlearn.models.tokenizer import ByteTokenizer
from pagedlearn.viz.kv_events_live import KVEventsLiveView
from pagedlearn.viz.kv_events_timeline import draw_kv_events_timeline, timeline_points
from pagedlearn.viz.prefix_tree import draw_prefix_tree, layout

PNG = b"\x89PNG"
TOK = ByteTokenizer()


def stored(hashes, parent, text, medium="GPU"):
    return BlockStored(hashes, parent, TOK.encode(text), 4, None, medium, None)


def batches():
    """Two prompts sharing 'You are ', a CPU copy, a late join, an eviction, then a reset."""
    return [
        (0, KVEventBatch(10.0, [stored([1, 2, 3], None, "You are kind")])),
        (1, KVEventBatch(11.0, [stored([4], 2, "calm")])),
        (2, KVEventBatch(11.5, [stored([1], None, "You ", "CPU"), stored([9], 77, "late")])),
        (3, KVEventBatch(12.0, [BlockRemoved([3], "GPU")])),
        (4, KVEventBatch(13.0, [AllBlocksCleared()])),
        (5, KVEventBatch(14.0, [stored([1, 2], None, "You are ")])),
    ]


def state_before_reset() -> KVCacheState:
    s = KVCacheState()
    s.extend(batches()[:4])
    return s


def boxes(fig) -> list[Rectangle]:
    return [p for p in fig.axes[0].patches if isinstance(p, Rectangle)]


def test_the_tree_draws_one_box_per_block_with_labels_hatching_and_a_key():
    s = state_before_reset()  # GPU: 1 -> 2 -> 4 (3 evicted), CPU: 1, late: 9
    fig = draw_prefix_tree(s, tokenizer=TOK)
    assert len(boxes(fig)) == len(s.blocks) == 5
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert {"You ", "are ", "calm"} <= set(texts)
    assert sum(p.get_hatch() == "//" for p in boxes(fig)) == 1  # the late join's root
    assert "5 cached blocks, 3 roots" in fig._suptitle.get_text()
    by_medium = draw_prefix_tree(s, color_by="medium")
    colors = {p.get_facecolor() for p in boxes(by_medium)}
    assert len(colors) == 2  # GPU and CPU
    legend = [t.get_text() for t in by_medium.legends[0].get_texts()]
    assert legend[:2] == ["CPU", "GPU"] and "parent unseen" in legend[2]


def test_the_layout_stacks_children_inside_their_parent():
    s = KVCacheState()
    s.apply((0, KVEventBatch(1.0, [stored([1, 2], None, "abcdefgh")])))
    s.apply((1, KVEventBatch(2.0, [stored([3], 1, "wxyz"), stored([5], 2, "1234")])))
    placed = {b.key.block_hash: (d, y, h) for b, d, y, h in layout(s)[0]}
    assert placed[1] == (0, 0.0, 2)  # the shared first block spans both continuations
    assert {placed[2][1], placed[3][1]} == {0.0, 1.0} and placed[5][0] == 2


def test_big_trees_are_cut_and_the_title_says_so():
    s = KVCacheState()
    chain = list(range(1, 41))
    s.apply((0, KVEventBatch(1.0, [BlockStored(chain, None, list(range(160)), 4, None, "GPU",
                                               None)])))  # fmt: skip
    fig = draw_prefix_tree(s, max_depth=10)
    assert len(boxes(fig)) == 10 and "+30" in [t.get_text() for t in fig.axes[0].texts]
    notes = [t.get_text() for t in fig.texts]
    assert "30 blocks not drawn one by one; cut at 10 blocks deep" in notes
    assert len(boxes(draw_prefix_tree(s, max_boxes=5))) == 5
    assert "no cached block yet" in [t.get_text() for t in draw_prefix_tree(KVCacheState())
                                     .axes[0].texts]  # fmt: skip
    many = KVCacheState()  # 2,000 one-block prompts: each thinner than a point
    events = [BlockStored([h], None, [h, h], 2, None, "GPU", None) for h in range(2000)]
    many.apply((0, KVEventBatch(1.0, events)))
    texts = [t.get_text() for t in draw_prefix_tree(many).axes[0].texts]
    assert texts == ["2000 more (thin)"]
    with pytest.raises(ValueError, match="color_by"):
        draw_prefix_tree(s, color_by="rainbow")
    with pytest.raises(TypeError, match="KVCacheState"):
        draw_prefix_tree({})


def test_the_timeline_shows_stores_removals_resets_and_the_size():
    s = KVCacheState()
    s.extend(batches())
    points = timeline_points(s)
    assert [p["size"] for p in points] == [3, 4, 6, 5, 0, 2]
    assert points[0]["t"] == 0.0 and points[4]["cleared"] == 5
    fig = draw_kv_events_timeline(s)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["stored (8 blocks)", "removed (1 blocks)", "all blocks cleared (1)"]
    with pytest.raises(ValueError, match="no batch"):
        draw_kv_events_timeline(KVCacheState())


def test_the_live_view_updates_by_hand_at_a_bounded_rate():
    view = KVEventsLiveView(tokenizer=TOK, max_fps=1e-6)  # a drawing at most every 11 days
    assert view.frames_drawn == 1 and bytes(view.tree_image.value[:4]) == PNG
    assert view.update(batches()[:2], force=True) == 2 and view.frames_drawn == 2
    assert "cached now: 4 blocks" in view.status.value
    assert view.update(batches()[2:4]) == 2 and view.frames_drawn == 2  # too soon: status only
    assert "cached now: 5 blocks" in view.status.value and "parent_unseen 1" in view.status.value
    view.color.value = "medium"  # a new colouring is drawn at once
    assert view.frames_drawn == 3 and bytes(view.timeline_image.value[:4]) == PNG
    assert view.update([("not", "a batch")]) == 0 and view.last_error is not None
    assert "needs a KVEventBatch" in view.problems.value  # shown, not raised
    assert view._repr_mimebundle_()["image/png"]
    with pytest.raises(RuntimeError, match="no subscriber"):
        view.start()


def test_the_live_view_summarizes_the_cache_again_only_when_something_new_came(monkeypatch):
    # The summary walks the whole tree; the view updates max_fps times a second, mostly idle.
    view = KVEventsLiveView(max_fps=1e-6)
    made = []
    real = view.state.summary
    monkeypatch.setattr(view.state, "summary", lambda top=5: made.append(top) or real(top))
    view.update(batches()[:2])
    assert len(made) == 1 and "cached now: 4 blocks" in view.status.value
    for _ in range(3):
        view.update(pairs=[])  # nothing new: the line is the same, the summary is not redone
    assert len(made) == 1 and "cached now: 4 blocks" in view.status.value
    view.state.apply_event(BlockRemoved([4], "GPU"))  # the state changed under the view
    view.update(pairs=[])
    assert len(made) == 2 and "cached now: 3 blocks" in view.status.value


def test_the_live_view_follows_a_real_subscriber_on_a_thread_and_stops():
    from pagedlearn.kv_events.publisher import KVEventPublisher
    from pagedlearn.kv_events.subscriber import KVEventSubscriber

    with KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
        for _, batch in batches()[:3]:
            pub.publish(batch)
        deadline = time.monotonic() + 10
        while pub.status()["published"] < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        with KVEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:  # replays 0..2
            view = KVEventsLiveView(sub, max_fps=50)
            assert view.following  # no running loop here: a thread of its own
            while len(view.state.blocks) < 6 and time.monotonic() < deadline:
                time.sleep(0.02)
            view.stop()  # waits for the thread's last update
            assert not view.following
            assert len(view.state.blocks) == 6 and view.frames_drawn >= 2
            assert "replayed 3" in view.status.value and "stopped" in view.status.value


def test_the_live_view_follows_on_the_running_event_loop_as_in_a_kernel():
    import asyncio

    from pagedlearn.kv_events.publisher import KVEventPublisher
    from pagedlearn.kv_events.subscriber import KVEventSubscriber

    async def follow(sub) -> KVEventsLiveView:
        view = KVEventsLiveView(sub, max_fps=50)
        assert view._task is not None and view._thread is None  # a task, not a thread
        deadline = time.monotonic() + 10
        while len(view.state.blocks) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # the loop stays free: the view's task runs in between
        view.stop()
        await asyncio.sleep(0)  # let the cancelled task finish
        return view

    with KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
        pub.publish(batches()[0][1])
        deadline = time.monotonic() + 10
        while pub.status()["published"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)  # sent (to nobody) and kept: the subscriber's catch-up replays it
        with KVEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:
            view = asyncio.run(follow(sub))
    assert len(view.state.blocks) == 3 and not view.following and view.frames_drawn >= 2
