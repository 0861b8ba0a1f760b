"""Who may share cached KV: cache salts, LoRA adapters and model versions keep requests apart;
prompts in vLLM's shapes; ``reset_prefix_cache`` in the engine, the trace and the views."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from engine_cases import SYSTEM, assert_pool_clean, greedy, make_llm, tokens

from pagedlearn import BeamSearchParams
from pagedlearn.engine import RequestRejectedError
from pagedlearn.errors import PagedLearnError, TraceFileError
from pagedlearn.trace.events import Event, EventLog, PoolReplay
from pagedlearn.viz.colors import Palette
from pagedlearn.viz.state import pool_state, replay_states, state_of_replay, step_label
from pagedlearn.viz.timeline import draw_memory_timeline, timeline_rows


def LoRA(name: str, int_id: int) -> SimpleNamespace:  # vLLM's LoRARequest shape
    return SimpleNamespace(lora_name=name, lora_int_id=int_id, lora_path="/nowhere")


PROMPT = SYSTEM  # 44 tokens: 11 full blocks of 4 (at least 10 hit: the last token is computed)


def run(llm, rid: str, prompt=PROMPT, **kw):
    """Serve one request alone; returns its final output and the blocks it hit in the cache."""
    engine = llm.engine
    log = engine.record()
    engine.add_request(rid, prompt, greedy(4), **kw)
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    log.close()
    hits = [b for e in log.events if e.kind == "cache_hit" for b in e.blocks]
    return final, hits


def llm(**kw):
    kw.setdefault("enable_prefix_caching", True)
    return make_llm("tiny-gpt2", **kw)


# --- keys that keep requests apart --------------------------------------------------------------
@pytest.mark.parametrize(
    "first, second, shared",
    [
        ({"cache_salt": "alice"}, {"cache_salt": "bob"}, False),
        ({"cache_salt": "alice"}, {"cache_salt": "alice"}, True),
        ({"cache_salt": "alice"}, {}, False),
        ({"lora_request": "adapter-1"}, {"lora_request": "adapter-2"}, False),
        ({"lora_request": 7}, {"lora_request": 7}, True),
        ({"lora_request": "adapter-1"}, {}, False),
        # vLLM's LoRARequest shape: its lora_int_id is the id
        ({"lora_request": LoRA("a", 1)}, {"lora_request": 1}, True),
        ({"lora_request": LoRA("a", 1)}, {"lora_request": LoRA("b", 2)}, False),
        ({"lora_request": LoRA("a", 1)}, {"lora_request": LoRA("a-again", 1)}, True),
        ({"lora_request": SimpleNamespace(lora_name="a")}, {"lora_request": "a"}, True),
    ],
)  # fmt: skip
def test_requests_share_cached_blocks_only_when_their_keys_agree(first, second, shared):
    m = llm()
    out1, hits1 = run(m, "a", **first)
    out2, hits2 = run(m, "b", **second)
    assert out1.num_cached_tokens == 0 and hits1 == []
    if shared:
        assert out2.num_cached_tokens >= 40 and len(hits2) >= 10
    else:
        assert out2.num_cached_tokens == 0 and hits2 == []
    assert tokens([out1]) == tokens([out2])  # the keys change what is shared, not the tokens
    assert_pool_clean(m)


def test_a_salt_in_the_prompt_dict_is_the_same_as_the_argument():
    m = llm()
    run(m, "a", {"prompt_token_ids": PROMPT, "cache_salt": "s"})
    out, hits = run(m, "b", PROMPT, cache_salt="s")
    assert out.num_cached_tokens >= 40 and len(hits) >= 10
    out, hits = run(m, "c", {"prompt_token_ids": PROMPT, "cache_salt": "s"}, cache_salt="s")
    assert out.num_cached_tokens >= 40  # the same salt twice is fine
    out, hits = run(m, "d", {"prompt_token_ids": PROMPT, "cache_salt": "t"})
    assert out.num_cached_tokens == 0 and hits == []


def test_a_new_model_version_hits_nothing_cached_under_the_old_one():
    m = llm(model_version="v1")
    engine = m.engine
    assert engine.model_version == "v1" and engine.kv.model_id == ("tiny-gpt2", "v1")
    assert run(m, "a")[0].num_cached_tokens == 0
    assert run(m, "b")[0].num_cached_tokens >= 40
    engine.model_version = "v2"
    assert engine.kv.model_id == ("tiny-gpt2", "v2")
    out, hits = run(m, "c")
    assert out.num_cached_tokens == 0 and hits == []
    engine.model_version = "v1"  # the old blocks were not dropped: back to v1, they hit again
    assert run(m, "d")[0].num_cached_tokens >= 40
    engine.model_version = None
    assert engine.kv.model_id == "tiny-gpt2" and run(m, "e")[0].num_cached_tokens == 0
    with pytest.raises(PagedLearnError, match="model_version must be hashable as text"):
        engine.model_version = ["v3"]
    assert engine.model_version is None and engine.kv.model_id == "tiny-gpt2"  # unchanged


def test_a_running_sequence_keeps_the_version_it_started_with():
    m = llm()
    engine = m.engine
    engine.add_request("a", PROMPT, greedy(6))
    engine.step()  # a is running, its prompt's blocks cached under the unversioned id
    engine.model_version = "v2"
    while engine.has_unfinished_requests():
        engine.step()
    assert run(m, "b")[0].num_cached_tokens == 0  # a's blocks are the old version's
    engine.model_version = None
    assert run(m, "c")[0].num_cached_tokens >= 40


# --- prompts as vLLM shapes them ----------------------------------------------------------------
def test_dict_prompts_give_the_same_tokens_as_plain_prompts():
    m = llm(enable_prefix_caching=False)
    text = "The quick brown fox"
    plain = m.generate([text, list(text.encode())], greedy(8), use_tqdm=False)
    dicts = m.generate(
        [{"prompt": text}, {"prompt_token_ids": list(text.encode()), "cache_salt": 3}],
        greedy(8),
        use_tqdm=False,
    )
    assert tokens(dicts) == tokens(plain)
    assert dicts[0].prompt == text and dicts[1].prompt is None
    assert dicts[1].prompt_token_ids == list(text.encode())
    single = m.generate({"prompt": text}, greedy(8), use_tqdm=False)  # one dict: one prompt
    assert len(single) == 1 and tokens(single) == tokens(plain[:1])


def test_generate_takes_one_lora_request_per_prompt_or_one_for_all():
    m = llm()
    prompts = [{"prompt_token_ids": PROMPT}] * 3
    first = m.generate(prompts[:1], greedy(4), use_tqdm=False, lora_request=["x"])
    outs = m.generate(prompts, greedy(4), use_tqdm=False, lora_request=["x", "y", None])
    assert first[0].num_cached_tokens == 0
    assert [o.num_cached_tokens >= 40 for o in outs] == [True, False, False]
    assert [o.num_cached_tokens for o in outs][1:] == [0, 0]
    outs = m.generate(prompts[:2], greedy(4), use_tqdm=False, lora_request="y")
    assert all(o.num_cached_tokens >= 40 for o in outs)
    with pytest.raises(PagedLearnError, match="3 prompts but 2 lora_requests"):
        m.generate(prompts, greedy(4), use_tqdm=False, lora_request=["x", "y"])
    beams = m.beam_search(
        {"prompt_token_ids": PROMPT}, BeamSearchParams(beam_width=2, max_tokens=3),
        use_tqdm=False, lora_request="x",
    )  # fmt: skip
    assert beams[0].num_cached_tokens >= 40 and len(beams[0].outputs) == 2
    assert_pool_clean(m)


BAD = [
    ({"prompt": "hi", "extra": 1}, {}, "unknown prompt key(s) 'extra'"),
    ({"prompt": "hi", "prompt_token_ids": [1]}, {}, "not both"),
    ({"cache_salt": "s"}, {}, "and this one has neither"),
    ({"prompt": [104, 105]}, {}, "got prompt=list"),
    ({"prompt_token_ids": "hi"}, {}, "got prompt_token_ids=str"),
    ({"prompt": "hi", "cache_salt": "a"}, {"cache_salt": "b"}, "differ"),
    ({"prompt": "hi", "cache_salt": ["a"]}, {}, "cache_salt must be hashable"),
    ("hi", {"cache_salt": {"a": 1}}, "cache_salt must be hashable"),
    ("hi", {"lora_request": ["a"]}, "lora_request must be hashable"),
    ("hi", {"cache_salt": ("a", 1)}, "cache_salt must be hashable as text"),  # tuple: no
    ("hi", {"cache_salt": True}, "cache_salt must be hashable as text"),
    ("hi", {"lora_request": SimpleNamespace(lora_int_id=[1])}, "lora_request.lora_int_id must"),
    ({"prompt_token_ids": [1, 999]}, {}, "outside the vocabulary"),
]


@pytest.mark.parametrize("prompt, kw, message", BAD)
def test_a_malformed_prompt_or_key_is_rejected_with_nothing_queued(prompt, kw, message):
    m = llm()
    engine = m.engine
    with pytest.raises(RequestRejectedError, match=message.replace("(", r"\(").replace(")", r"\)")):
        engine.add_request("r", prompt, **kw)
    assert engine.requests == {} and not engine.has_unfinished_requests()
    if not kw:  # generate returns it with its error, and serves the others
        outs = m.generate([prompt, "ok"], greedy(2), use_tqdm=False)
        assert outs[0].error and message.split("'")[0] in outs[0].error
        assert outs[0].outputs[0].finish_reason == "error" and outs[1].error is None
    assert_pool_clean(m)


# --- reset_prefix_cache ---------------------------------------------------------------------------
def test_reset_drops_every_cached_block_and_the_next_prompt_hits_nothing():
    m = llm()
    run(m, "a")
    cached = m.engine.kv.stats()["cached_blocks"]
    assert cached >= 10
    assert m.reset_prefix_cache() == cached
    assert m.engine.kv.stats()["cached_blocks"] == 0
    out, hits = run(m, "b")
    assert out.num_cached_tokens == 0 and hits == []
    cached = m.engine.kv.stats()["cached_blocks"]
    assert cached > 0 and m.reset_prefix_cache() == cached
    assert m.reset_prefix_cache() == 0  # nothing cached any more
    assert_pool_clean(m)


def test_reset_is_refused_while_a_request_holds_blocks_and_names_it():
    m = llm()
    engine = m.engine
    run(m, "a")
    engine.add_request("busy", PROMPT, greedy(8))
    engine.step()
    before = engine.kv.stats()["cached_blocks"]
    with pytest.raises(PagedLearnError, match=r"'busy' \(running\)"):
        m.reset_prefix_cache()
    assert engine.kv.stats()["cached_blocks"] == before  # nothing changed
    engine.abort_request("busy")
    assert m.reset_prefix_cache() > 0


def test_reset_is_refused_while_a_request_is_swapped_out():
    m = llm(num_blocks=12, preemption_mode="swap")
    engine = m.engine
    for rid in "ab":
        engine.add_request(rid, list(b"abcdefghijklmnop"), greedy(28))
    while not engine.scheduler.swapped:
        engine.step()
    (swapped,) = [r.request_id for r in engine.scheduler.swapped]
    with pytest.raises(PagedLearnError, match=rf"'{swapped}' \(swapped\)"):
        m.reset_prefix_cache()
    for rid in "ab":
        engine.abort_request(rid)
    assert m.reset_prefix_cache() >= 0
    assert_pool_clean(m)


def test_reset_leaves_waiting_requests_queued():
    m = llm()
    run(m, "a")
    m.engine.add_request("later", PROMPT, greedy(4))  # waiting: holds no block
    assert m.reset_prefix_cache() > 0
    out = None
    while m.engine.has_unfinished_requests():
        out = next((o for o in m.engine.step() if o.finished), out)
    assert out.request_id == "later" and out.num_cached_tokens == 0


@pytest.mark.parametrize("name", ["tiny-gemma3"])
def test_reset_and_model_version_work_on_a_hybrid_model(name):
    m = make_llm(name, enable_prefix_caching=True, num_blocks=96)
    kv = m.engine.kv
    assert run(m, "a")[0].num_cached_tokens == 0
    assert run(m, "b")[0].num_cached_tokens >= 40
    m.engine.model_version = 2
    assert [g.model_id for g in kv.managers] == [((name, 2), g.name) for g in kv.groups]
    assert run(m, "c")[0].num_cached_tokens == 0
    assert run(m, "d")[0].num_cached_tokens >= 40
    dropped = m.reset_prefix_cache()
    assert dropped > 0 and kv.stats()["cached_blocks"] == 0
    assert run(m, "e")[0].num_cached_tokens == 0
    assert_pool_clean(m)


# --- the reset in the trace and the views ---------------------------------------------------------
def recorded_run_with_a_reset():
    m = llm()
    log = m.engine.record()
    run(m, "a")
    dropped = m.reset_prefix_cache()
    run(m, "b")
    return m, log, dropped


def test_a_recorded_reset_replays_saves_and_loads():
    m, log, dropped = recorded_run_with_a_reset()
    resets = [e for e in log.events if e.kind == "cache_reset"]
    assert len(resets) == 1 and len(resets[0].blocks) == dropped and resets[0].seqs == ()
    loaded = EventLog.from_json(log.to_json())
    assert loaded.events == log.events
    after = loaded.replay(upto=resets[0].index + 1)
    assert after.cached == {} and after.cached_tokens == {}
    assert sorted(after.free_blocks) == list(range(len(after.refcounts)))
    state = state_of_replay(after, log.meta["block_size"])
    assert state.count("cached") == 0 and state.count("free") == state.num_blocks
    # The whole run replays to the manager's pool.
    final = loaded.replay()
    assert state_of_replay(final, 4).blocks == pool_state(m.engine.kv, {}).blocks


def test_a_reset_has_a_frame_of_its_own_in_the_replay_and_the_live_view():
    from pagedlearn.viz import LiveBlockView

    m = llm()
    log = m.engine.record()
    view = LiveBlockView(m)
    follow = Palette.follow(m)
    live = []
    m.engine.kv.trace.subscribe(
        lambda e: e.kind in ("step", "cache_reset") and live.append(view.state)
    )
    run(m, "a")
    dropped = m.reset_prefix_cache()
    assert view.state.cache_reset == dropped and view.state.count("cached") == 0
    label = f"prefix cache reset: {dropped} cached blocks dropped"
    assert label in view.stats.value
    run(m, "b")
    frames = replay_states(log)
    (i, reset), = [(i, s) for i, s in frames if s.cache_reset is not None]  # fmt: skip
    before = [s for j, s in frames if j < i][-1]
    assert reset.count("cached") == 0 and before.count("cached") == dropped
    assert reset.step == before.step
    assert step_label(reset) == f"step {before.step} ({label})"
    assert [r for r in reset.requests if r.status == "finished"] == []
    # The live view drew the frames the replay rebuilds, in the same colours.
    assert live == [s for _, s in frames]
    assert [s.colors for s in live] == [s.colors for _, s in frames]
    assert follow.visible == frames[-1][1].colors  # Palette.follow saw the same frames
    view.close()
    follow.close()


def test_the_timeline_marks_a_reset():
    _, log, dropped = recorded_run_with_a_reset()
    rows = timeline_rows(log)
    marked = [r for r in rows if r["cache_resets"]]
    assert len(marked) == 1 and marked[0]["cache_reset_blocks"] == dropped
    assert marked[0]["cached"] == 0
    fig = draw_memory_timeline(log)
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert f"prefix cache reset ({dropped} cached blocks dropped)" in labels


def test_a_reset_that_does_not_fit_the_pool_is_refused():
    pool = PoolReplay(num_blocks=4)
    pool.apply(Event(0, "allocate", (0, 1), ("a",)))
    pool.apply(Event(1, "cache_store", (0,), ("a",), {"hash": "ab", "tokens": [1, 2]}))
    with pytest.raises(TraceFileError, match=r"event 2 \(cache_reset\): resets the prefix cache "
                       r"while sequences \['a'\] hold blocks"):  # fmt: skip
        pool.apply(Event(2, "cache_reset", (0,), ()))
    pool.apply(Event(2, "free", (0, 1), ("a",)))
    with pytest.raises(TraceFileError, match=r"drops the cached blocks but not \[0\]"):
        pool.apply(Event(3, "cache_reset", (), ()))
    with pytest.raises(TraceFileError, match="names a block twice"):
        pool.apply(Event(3, "cache_reset", (0, 0), ()))
    assert pool.cached == {0: "ab"}  # the refused events changed nothing
    pool.apply(Event(3, "cache_reset", (0, 3), ()))  # 3: cached before a recording began
    assert pool.cached == {} and pool.cached_tokens == {} and pool.refcounts == [0] * 4


def test_the_replay_view_names_a_reset_frame():
    from pagedlearn.viz import ReplayView

    _, log, dropped = recorded_run_with_a_reset()
    view = ReplayView(log.to_json())
    names = [name for name, _ in view.slider.options]
    (k,) = [i for i, name in enumerate(names) if name.endswith("(reset)")]
    view.show(k)
    assert view.state.cache_reset == dropped and view.state.count("cached") == 0
    assert f"prefix cache reset: {dropped} cached blocks dropped" in view.stats.value
