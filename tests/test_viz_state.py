"""PoolState: the one thing every picture reads; a live run and its replay must give equal ones."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from pagedlearn import KVCacheManager
from pagedlearn.errors import TraceFileError
from pagedlearn.trace.events import Event, EventLog
from pagedlearn.viz.state import CACHED, FREE, SHARED, USED, pool_state, replay_states


def _manager_session():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    log = kv.record()
    kv.add_sequence("a", [1, 2, 3, 4, 5, 6])  # blocks 0 (full, cached) and 1 (2 of 4)
    kv.mark_step(step=0)
    kv.fork("a", "b")
    kv.append_token("b", 9)  # b copies block 1 on write
    kv.mark_step(step=1)
    kv.free_sequence("a")
    kv.mark_step(step=2)
    return kv, log


def test_block_kinds_fill_owners_and_tokens_follow_the_manager():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    kv.add_sequence("a", [1, 2, 3, 4, 5, 6])
    kv.fork("a", "b")
    s = pool_state(kv)
    b0, b1 = s.blocks[0], s.blocks[1]
    assert (b0.kind, b0.refcount, b0.owners, b0.num_tokens) == (SHARED, 2, ("a", "b"), 4)
    assert b0.cached and b0.block_hash == kv.prefix_cache.hash_of(0).hex()
    assert (b1.kind, b1.num_tokens, b1.token_ids, b1.cached) == (SHARED, 2, (5, 6), False)
    kv.append_token("b", 9)  # copy-on-write: b now owns a fresh block with 3 tokens
    kv.free_sequence("a")
    s = pool_state(kv)
    dst = s.tables["b"][1]
    assert s.blocks[dst].token_ids == (5, 6, 9) and s.blocks[dst].kind == USED
    assert s.blocks[1].kind == FREE and s.blocks[0].kind == USED  # b still holds block 0
    kv.free_sequence("b")
    s = pool_state(kv)
    assert s.blocks[0].kind == CACHED and s.blocks[0].token_ids == (1, 2, 3, 4)
    assert s.count(CACHED) == 1 and s.count(FREE) == 7 and s.tables == {}


def test_a_manager_session_replays_frame_by_frame():
    kv, log = _manager_session()
    frames = replay_states(EventLog.from_json(log.to_json()))
    assert [f.step for _, f in frames] == [0, 1, 2]
    last = frames[-1][1]
    assert last == pool_state(kv, {"step": 2})
    assert last.tables == {"b": tuple(kv.block_table("b"))} and last.num_tokens == {"b": 7}


def test_step_events_send_only_new_tokens():
    _, log = _manager_session()
    steps = [e for e in log.events if e.kind == "step"]
    assert steps[0].info["new_tokens"] == [["a", 0, [1, 2, 3, 4, 5, 6]]]
    assert steps[1].info["new_tokens"] == [["b", 0, [1, 2, 3, 4, 5, 6, 9]]]  # new to the marker
    assert steps[2].info["new_tokens"] == [] and steps[2].info["num_tokens"] == [["b", 7]]


def test_marking_without_a_listener_costs_nothing_and_later_listeners_get_whole_lists():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.add_sequence("a", [1, 2, 3])
    kv.mark_step()  # nobody listens: no event, nothing remembered
    log = kv.record()
    kv.mark_step()
    assert log.events[-1].info["new_tokens"] == [["a", 0, [1, 2, 3]]]
    kv.append_token("a", 4)
    kv.mark_step()
    assert log.events[-1].info["new_tokens"] == [["a", 3, [4]]]


def test_a_new_recording_or_a_reused_id_gets_whole_token_lists():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    first = kv.record()
    kv.add_sequence("a", [1, 2, 3])
    kv.mark_step()
    first.close()
    kv.free_sequence("a")
    kv.add_sequence("a", [7, 8])  # the same id, a new sequence: nobody listened in between
    second = kv.record()
    kv.mark_step()
    assert second.events[-1].info["new_tokens"] == [["a", 0, [7, 8]]]
    kv = KVCacheManager(num_blocks=8, block_size=2)
    log = kv.record()  # and with a listener throughout, a new life is sent whole too
    kv.add_sequence("a", [1, 2, 3])
    kv.mark_step()
    kv.free_sequence("a")
    kv.add_sequence("a", [5, 6, 9])
    kv.mark_step()
    assert log.events[-1].info["new_tokens"] == [["a", 0, [5, 6, 9]]]
    assert replay_states(log)[-1][1] == pool_state(kv, {})


def test_live_and_replayed_states_are_equal_at_every_step_of_an_engine_run():
    from pagedlearn import LLM, BeamSearchParams, SamplingParams

    llm = LLM("tiny-gpt2", num_blocks=20, block_size=4, verbose=False, preemption_mode="swap")
    engine = llm.engine
    log = engine.record()
    live = []
    engine.kv.trace.subscribe(
        lambda e: e.kind == "step" and live.append(pool_state(engine.kv, e.info))
    )
    sample = SamplingParams(max_tokens=20, n=3, seed=1, temperature=1.0, ignore_eos=True)
    engine.add_request("a", "Hello there, my friend", sample)
    engine.add_request("b", "Hello there, you", SamplingParams(max_tokens=30, ignore_eos=True))
    engine.add_request("c", "Hello there, you", BeamSearchParams(beam_width=3, max_tokens=10))
    engine.step()
    engine.abort_request("b")  # an abort is a frame too
    while engine.has_unfinished_requests():
        engine.step()
    frames = replay_states(EventLog.from_json(log.to_json()))
    assert [s for _, s in frames] == live
    assert live[-1].stats["preemptions_swap"] > 0  # the run did move blocks to the CPU and back
    assert any(s.swapped for s in live)
    assert any(b.kind == SHARED for s in live for b in s.blocks)
    assert live[1].step == live[0].step  # the abort frame follows step 1
    assert [r.finish_reason for r in live[1].requests if r.status == "finished"] == ["abort"]
    first = live[0]
    assert {r.request_id: r.status for r in first.requests} == {
        "a": "running",
        "b": "running",
        "c": "running",
    }
    assert first.group_of("a.0") == "a"


def test_pool_state_names_what_it_cannot_read():
    with pytest.raises(TypeError, match="KVCacheManager, an LLMEngine or an LLM"):
        pool_state(object())
    with pytest.raises(ValueError, match="block_size"):
        replay_states(EventLog(meta={"num_blocks": 4}))


def test_an_in_memory_log_gets_the_cpu_pool_check_a_file_gets():
    """replay_states hands the CPU pool's size to the replay: a swapped-out table that names a
    CPU block outside it is refused, in memory as from a file."""
    kv = KVCacheManager(4, 2, num_cpu_blocks=2)
    log = kv.record()
    kv.add_sequence("a", [1, 2, 3])
    kv.swap_out(["a"])
    kv.mark_step(step=0)
    assert len(replay_states(log)) == 1
    i, out = next((i, e) for i, e in enumerate(log.events) if e.kind == "swap_out")
    log.events[i] = Event(out.index, out.kind, out.blocks, out.seqs, {"cpu_blocks": [0, 7]})
    with pytest.raises(TraceFileError, match=r"event 1 \(swap_out\).*7, not a CPU block id"):
        replay_states(log)


def _viz_imports() -> dict[str, set[str]]:
    """pagedlearn.viz.X -> the pagedlearn.viz modules X imports, anywhere in the file (a lazy
    import inside a function closes a circle just as well as one at the top)."""
    root = Path(__file__).resolve().parents[1] / "pagedlearn" / "viz"
    mods = {f"pagedlearn.viz.{p.stem}": p for p in root.glob("*.py") if p.stem != "__init__"}
    graph = {}
    for mod, path in mods.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            edges |= {n for n in names if n in mods and n != mod}
        graph[mod] = edges
    return graph


def test_no_import_circle_among_the_viz_modules():
    """DESIGN.md: a lower file never imports a higher one. frame < colors < state: a palette
    observes frames, and replay_states colours a recorded run's frames with a palette."""
    graph = _viz_imports()
    assert "pagedlearn.viz.colors" in graph["pagedlearn.viz.state"]  # it sees lazy imports
    done: set[str] = set()

    def visit(mod: str, path: list[str]) -> None:
        if mod in path:
            pytest.fail("import circle: " + " -> ".join([*path[path.index(mod) :], mod]))
        if mod not in done:
            for dep in sorted(graph[mod]):
                visit(dep, [*path, mod])
            done.add(mod)

    for mod in sorted(graph):
        visit(mod, [])


def test_the_state_module_loads_without_matplotlib():
    """Reading a pool (pool_state) needs no plotting library: only replay_states' colours do."""
    code = "import sys, pagedlearn.viz.state; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
