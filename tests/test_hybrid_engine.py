"""Hybrid models on the engine: sliding-window layers, KV-cache groups, token-exact vs transformers.

tiny-mistral slides in every layer (window 24), tiny-gemma3 alternates sliding (24) and full
layers. Prompts are longer than the window, so a wrong window (or a block freed too early)
changes the logits. Every run must also leave the pool clean and the invariants whole.
"""

from __future__ import annotations

import pytest
from engine_cases import assert_pool_clean, greedy, hf_greedy, make_llm

from pagedlearn import SamplingParams
from pagedlearn.hybrid.kv_cache_coordinator import KVCacheCoordinator
from pagedlearn.hybrid.kv_cache_groups import sliding_blocks_held

HYBRID = ["tiny-mistral", "tiny-gemma3"]
WINDOW = 24
LONG = [
    list(b"The quick brown fox jumps over the lazy dog, twice over."),  # 56 tokens
    list(b"abcdefghijklmnopqrstuvwxyz" * 2),  # 52
    list(b"short"),  # within the window
]


def run(llm, prompts, max_tokens=20, check_every_step=True, **params):
    """Generate step by step, checking the invariants after every step."""
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(max_tokens, **params))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if check_every_step:
            engine.kv.check_invariants()
    return [done[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("name", HYBRID)
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_greedy_matches_transformers_past_the_window(name, backend):
    llm = make_llm(name, attention_backend=backend)
    assert isinstance(llm.engine.kv, KVCacheCoordinator)
    for prompt, out in zip(LONG, run(llm, LONG), strict=True):
        assert out.outputs[0].token_ids == hf_greedy(name, prompt, 20)
    assert_pool_clean(llm)


@pytest.mark.parametrize("name", HYBRID)
def test_greedy_on_the_triton_kernels_in_the_interpreter(name):
    """The Triton decode and prefill kernels with a window, on one long prompt (kept short:
    the interpreter is slow)."""
    llm = make_llm(name, attention_backend="triton")
    (out,) = run(llm, LONG[:1], max_tokens=6)
    assert out.outputs[0].token_ids == hf_greedy(name, LONG[0], 6)


CASES = [
    ("tiny-mistral", {"enable_prefix_caching": True}),
    ("tiny-gemma3", {"enable_prefix_caching": True}),
    ("tiny-mistral", {"max_num_batched_tokens": 16, "max_num_seqs": 4}),  # chunks of <= 16
    ("tiny-gemma3", {"max_num_batched_tokens": 16, "max_num_seqs": 4}),
    # Only a full group grows without bound: tiny-mistral at 20 blocks never runs short (a
    # sliding sequence frees a block for each one it takes), tiny-gemma3 at 30 must preempt.
    ("tiny-mistral", {"preemption_mode": "recompute", "num_blocks": 20}),
    ("tiny-gemma3", {"preemption_mode": "recompute", "num_blocks": 30}),
    ("tiny-gemma3", {"preemption_mode": "swap", "num_blocks": 30}),
    ("tiny-gemma3", {"preemption_mode": "swap", "num_blocks": 30, "enable_prefix_caching": True}),
]


@pytest.mark.parametrize(("name", "kw"), CASES)
def test_tokens_stay_exact_under_caching_preemption_and_chunking(name, kw):
    llm = make_llm(name, **kw)
    prompts = [*LONG, LONG[0][:40] + list(b" and again")]  # shares 40 tokens with the first
    outs = run(llm, prompts, max_tokens=24)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(name, prompt, 24), kw
    stats = llm.engine.stats()
    if "preemption_mode" in kw:
        preempted = stats.preemptions_recompute + stats.preemptions_swap
        assert (preempted > 0) == (name == "tiny-gemma3")
    if kw.get("enable_prefix_caching") and "num_blocks" not in kw:  # a roomy pool: a hit
        assert llm.engine.kv.stats()["prefix_hit_tokens"] > 0  # every lookup's, re-admissions too
    assert_pool_clean(llm)


def test_a_sliding_group_holds_a_bounded_number_of_blocks():
    """tiny-mistral generating 300 tokens with block_size 4: after its prefill (which holds
    all 14 prompt blocks for one step), never more than ceil(24 / 4) + 1 = 7 blocks in its one
    (sliding) group, while the tokens grow."""
    llm = make_llm("tiny-mistral", num_blocks=64)
    engine = llm.engine
    engine.add_request("a", LONG[0], greedy(300))
    engine.step()  # the prefill
    assert len(engine.kv.block_tables("a.0")[0]) == 14
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        if engine.kv.sequences():
            (table,) = engine.kv.block_tables("a.0")
            live = [b for b in table if b >= 0]
            assert len(live) == sliding_blocks_held(engine.kv.num_tokens("a.0"), WINDOW, 4)
            peak = max(peak, len(live))
    assert peak == -(-WINDOW // 4) + 1
    assert engine.stats().window_freed_blocks > 0


def test_gemma3_groups_report_blocks_and_the_full_group_keeps_growing():
    llm = make_llm("tiny-gemma3", num_blocks=128)
    engine = llm.engine
    engine.add_request("a", LONG[0], greedy(60))
    for _ in range(40):
        engine.step()
    stats = engine.stats()
    n = engine.kv.num_tokens("a.0")
    assert stats.group_blocks == {
        "full": -(-n // 4),
        f"sliding {WINDOW}": sliding_blocks_held(n, WINDOW, 4),
    }
    assert "KV-cache groups" in stats.summary()


def test_sampling_and_beams_fork_in_every_group():
    llm = make_llm("tiny-gemma3", num_blocks=200)
    outs = run(llm, LONG[:1], max_tokens=10, n=3, temperature=1.0, seed=1)
    assert len(outs[0].outputs) == 3
    assert_pool_clean(llm)


def test_a_prompt_longer_than_the_pool_in_all_groups_is_rejected():
    """A prompt's prefill takes blocks in every group: 2 groups x 14 blocks > 20."""
    llm = make_llm("tiny-gemma3", num_blocks=20)
    out = llm.generate([LONG[0]], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.error and "more than the whole pool of 20" in out.error


def test_a_custom_manager_is_refused_for_a_hybrid_model():
    from pagedlearn import KVCacheManager, PagedLearnError

    with pytest.raises(PagedLearnError, match="full-attention models only"):
        make_llm("tiny-mistral", kv_cache_manager=KVCacheManager)


def test_a_forward_that_skips_paged_attention_in_a_layer_is_refused():
    """A layer that keeps its own state (a recurrent layer, say) would read no paged KV: the
    runner counts the attention calls of every forward, one per layer."""
    from pagedlearn import PagedLearnError

    llm = make_llm("tiny-gpt2")
    attn = llm.engine.model.transformer.h[1].attn
    attn.forward = lambda hidden_states, *a, **k: (hidden_states, None)
    with pytest.raises(PagedLearnError, match="called paged attention 1 times for its 2 layers"):
        llm.generate([list(b"hi")], greedy(2), use_tqdm=False)


def test_a_sliding_request_preempted_after_it_grew_past_the_pool_comes_back():
    """tiny-mistral on 16 blocks of 4 with chunks of 8 tokens holds at most 7 blocks while it
    decodes; a recompute preemption (here: after a forward that raised) must not fail it as
    'can never fit' although its 75 tokens would take 19 blocks at once (found in review)."""
    llm = make_llm("tiny-mistral", num_blocks=16, max_num_batched_tokens=8, max_num_seqs=2)
    engine = llm.engine
    engine.add_request("r", LONG[0][:40], greedy(80))
    real, steps, out = engine.runner.execute, 0, None

    def fail(inputs):
        raise RuntimeError("a transient fault")

    while engine.has_unfinished_requests():
        steps += 1
        engine.runner.execute = fail if steps == 40 else real
        try:
            for o in engine.step():
                out = o if o.finished else out
        except RuntimeError:
            pass
    assert out.error is None and len(out.outputs[0].token_ids) == 80
    want = hf_greedy("tiny-mistral", LONG[0][:40], 80)  # stops at EOS; ignore_eos goes on
    assert out.outputs[0].token_ids[: len(want)] == want
