"""The engine on tiny offline models (CPU, fp32): same tokens and logits as transformers, whatever
the block size, caching, preemption or attention backend; sharing, beams, aborts, rejections."""

from __future__ import annotations

import pytest
import torch
from engine_cases import (
    PROMPTS,
    SYSTEM,
    assert_pool_clean,
    greedy,
    hf_greedy,
    hf_model,
    make_llm,
    tokens,
)

from pagedlearn import BeamSearchParams, SamplingParams
from pagedlearn.engine import RequestRejectedError
from pagedlearn.errors import PagedLearnError

MODELS = ["tiny-gpt2", "tiny-opt"]


@pytest.mark.parametrize("name", MODELS)
def test_greedy_matches_transformers_generate(name):
    llm = make_llm(name)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        want = hf_greedy(name, prompt, 16)
        assert out.outputs[0].token_ids == want
        assert out.outputs[0].finish_reason == ("stop" if want[-1] == 256 else "length")
    assert_pool_clean(llm)


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_transformers_at_every_step(name):
    """Capture the engine's logits per request and step; compare with one full HF forward."""
    llm = make_llm(name)
    engine = llm.engine
    seen: dict[str, list[torch.Tensor]] = {}
    execute, process = engine.runner.execute, engine._process
    last = {}

    def capture_execute(seqs):
        last["logits"] = execute(seqs)
        return last["logits"]

    def capture_process(sched, logprobs, now):
        for row, s in enumerate(sched.scheduled):
            seen.setdefault(s.request.request_id, []).append(last["logits"][row])
        return process(sched, logprobs, now)

    engine.runner.execute, engine._process = capture_execute, capture_process
    outs = llm.generate(PROMPTS, greedy(10), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        full = prompt + out.outputs[0].token_ids
        with torch.no_grad():
            ref = hf_model(name)(torch.tensor([full])).logits[0].float()
        ours = torch.stack(seen[out.request_id]).cpu()  # (steps, vocab); HF's copy is on the CPU
        expected = ref[len(prompt) - 1 : len(full) - 1]
        assert ours.shape == expected.shape
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    assert_pool_clean(llm)


def _run(prompts=PROMPTS, params=None, **kw):
    llm = make_llm(**kw)
    outs = llm.generate(prompts, params or greedy(20), use_tqdm=False)
    assert_pool_clean(llm)
    return llm, tokens(outs)


@pytest.fixture(scope="module")
def baseline():
    return _run()[1]


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_block_size_does_not_change_outputs(baseline, block_size):
    assert _run(block_size=block_size, num_blocks=2048 // block_size)[1] == baseline


def test_prefix_caching_hits_and_changes_nothing():
    prompts = [SYSTEM + list(b"What is a block?"), SYSTEM + list(b"Why page the KV cache?")]
    outs = {}
    for caching in (False, True):
        llm = make_llm(enable_prefix_caching=caching)
        first = llm.generate(prompts[:1], greedy(), use_tqdm=False)  # fills the cache
        second = llm.generate(prompts[1:], greedy(), use_tqdm=False)
        outs[caching] = tokens(first + second)
        assert second[0].num_cached_tokens == (44 if caching else 0)  # 11 full blocks of 4
        assert_pool_clean(llm)
    assert outs[True] == outs[False]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs_identical(baseline, mode):
    stats = []
    llm = make_llm(num_blocks=20, preemption_mode=mode)
    llm.engine.subscribe_stats(stats.append)
    outs = llm.generate(PROMPTS, greedy(20), use_tqdm=False)
    assert tokens(outs) == baseline
    last = stats[-1]
    assert (last.preemptions_recompute if mode == "recompute" else last.preemptions_swap) > 0
    if mode == "swap":
        assert last.swap_out_blocks > 0 and last.swap_in_blocks == last.swap_out_blocks
    assert all(s.used_blocks <= 20 for s in stats)
    assert_pool_clean(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_chunked_prefill_keeps_outputs_identical(baseline, mode):
    """A step may compute at most 8 tokens: prompts of 43 and 48 tokens go in chunks, next to
    the other requests' decodes, even on a pool small enough to preempt."""
    stats = []
    llm = make_llm(num_blocks=20, max_num_batched_tokens=8, max_num_seqs=8, preemption_mode=mode)
    llm.engine.subscribe_stats(stats.append)
    outs = llm.generate(PROMPTS, greedy(20), use_tqdm=False)
    assert tokens(outs) == baseline
    assert max(s.num_batched_tokens for s in stats) == 8
    assert any(s.num_prefill_seqs and s.num_decode_seqs for s in stats)  # mixed steps
    assert_pool_clean(llm)


def test_chunked_prefill_starts_after_the_cached_prefix():
    """With 8 tokens per step, the second chat still reuses the system prompt's 11 full blocks
    that the first one prefilled chunk by chunk, and computes only the other 17 tokens."""
    llm = make_llm(max_num_batched_tokens=8, max_num_seqs=8)
    first = llm.generate([SYSTEM + list(b"What is a block?")], greedy(), use_tqdm=False)
    stats = []
    llm.engine.subscribe_stats(stats.append)
    second = llm.generate([SYSTEM + list(b"Why page the KV?")], greedy(), use_tqdm=False)
    assert second[0].num_cached_tokens == 44
    prefill_steps = [s.num_batched_tokens for s in stats if s.num_prefill_seqs]
    assert prefill_steps == [8, 8, 1]  # 61 prompt tokens: 44 cached, 17 computed in chunks
    want = make_llm(enable_prefix_caching=False).generate(
        [SYSTEM + list(b"What is a block?"), SYSTEM + list(b"Why page the KV?")],
        greedy(),
        use_tqdm=False,
    )
    assert tokens(first + second) == tokens(want)
    assert_pool_clean(llm)


def test_without_chunked_prefill_a_prompt_longer_than_a_step_is_refused():
    kw = dict(max_num_batched_tokens=16, max_num_seqs=8)
    with pytest.raises(RequestRejectedError, match="enable_chunked_prefill"):
        make_llm(enable_chunked_prefill=False, **kw).engine.add_request("x", PROMPTS[1], greedy())
    llm = make_llm(**kw)
    (out,) = llm.generate([PROMPTS[1]], greedy(4), use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy("tiny-gpt2", PROMPTS[1], 4)


def test_triton_interpreter_backend_matches_torch():
    pytest.importorskip("triton")
    prompts, params = PROMPTS[:2], greedy(4)
    want = _run(prompts, params, attention_backend="torch")[1]
    assert _run(prompts, params, attention_backend="triton")[1] == want


def test_parallel_sampling_is_reproducible_and_shares_the_prompt():
    prompt = list(b"Once upon a time, in a land far away")  # 36 tokens: 9 blocks of 4
    params = SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)

    def peak_blocks(requests):
        llm = make_llm(enable_prefix_caching=False)
        peak = []
        llm.engine.subscribe_stats(lambda s: peak.append(s.used_blocks))
        outs = llm.generate(*requests, use_tqdm=False)
        assert_pool_clean(llm)
        return tokens(outs), max(peak)

    shared, shared_peak = peak_blocks(([prompt], params))
    again, _ = peak_blocks(([prompt], params))
    assert shared == again and len(shared[0]) == 4
    assert len({tuple(t) for t in shared[0]}) > 1  # four samples, not four copies of one
    single = SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    _, separate_peak = peak_blocks(([prompt] * 4, single))
    assert shared_peak < separate_peak


def test_beam_width_one_is_greedy(baseline):
    llm = make_llm()
    outs = llm.beam_search(
        PROMPTS, BeamSearchParams(beam_width=1, max_tokens=20, ignore_eos=True), use_tqdm=False
    )
    assert [[o.outputs[0].token_ids] for o in outs] == baseline
    assert_pool_clean(llm)


def test_beam_search_returns_sorted_beams_and_keeps_invariants():
    llm = make_llm(num_blocks=48)
    engine = llm.engine
    params = BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=1.0)
    engine.add_request("b", PROMPTS[1], params)
    while engine.has_unfinished_requests():
        outs = engine.step()
        engine.kv.check_invariants()
    (out,) = outs
    assert out.finished and len(out.outputs) == 3
    scores = [params.score(o.cumulative_logprob, len(o.token_ids)) for o in out.outputs]
    assert scores == sorted(scores, reverse=True)
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3
    assert_pool_clean(llm)


# Random weights never pick the real EOS; on this prompt the beams pick byte 213 from their 4th
# token on, so calling it EOS makes some beams finish ("stop") while others go on.
BEAM_EOS, BEAM_PROMPT = 213, "Hello there, you"


def _beam_outputs(llm, params):
    llm.engine.eos_token_id = BEAM_EOS
    (out,) = llm.beam_search([BEAM_PROMPT], params, use_tqdm=False)
    assert out.finished and [o.index for o in out.outputs] == list(range(len(out.outputs)))
    scores = [params.score(o.cumulative_logprob, len(o.token_ids)) for o in out.outputs]
    assert scores == sorted(scores, reverse=True)  # best first
    assert_pool_clean(llm)
    return out


def test_a_beam_search_that_outgrows_the_pool_returns_its_best_beam_width_beams():
    """Issue 30's quirk: beams that finished, then live beams that outgrew the pool, came back
    together (2 "stop" + 3 "error" for beam width 3). Now: the 3 best of them, and the error."""
    params = BeamSearchParams(beam_width=3, max_tokens=200)
    out = _beam_outputs(make_llm(num_blocks=10), params)
    assert out.error and "whole pool" in out.error
    assert len(out.outputs) == 3
    # ranked together: finished beams ("stop") and the live ones the failure cut short
    assert {o.finish_reason for o in out.outputs} == {"stop", "error"}


def test_an_aborted_beam_search_returns_at_most_beam_width_beams():
    """Aborted after a beam finished: the finished and the aborted beams ranked together (it
    used to return every finished beam plus the live ones)."""
    llm = make_llm()
    engine = llm.engine
    engine.eos_token_id = BEAM_EOS
    params = BeamSearchParams(beam_width=3, max_tokens=50)
    engine.add_request("b", BEAM_PROMPT, params)
    while not engine.requests["b"].done:  # until a beam has finished
        engine.step()
    out = engine.abort_request("b")
    assert out.finished and len(out.outputs) == 3
    assert {o.finish_reason for o in out.outputs} <= {"stop", "abort"}
    assert "abort" in {o.finish_reason for o in out.outputs}
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert_pool_clean(llm)


def test_abort_frees_blocks_at_once():
    llm = make_llm()
    engine = llm.engine
    engine.add_request("keep", PROMPTS[0], greedy(8))
    engine.add_request("stop", PROMPTS[1], greedy(50))
    for _ in range(3):
        engine.step()
    before = engine.kv.stats()["used_blocks"]
    out = engine.abort_request("stop")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.kv.stats()["used_blocks"] < before
    assert not any(s.startswith("stop.") for s in engine.kv.sequences())
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.abort_request("stop") is None
    assert_pool_clean(llm)


def test_a_request_that_cannot_fit_fails_alone():
    llm = make_llm(num_blocks=8)  # 32 tokens
    outs = llm.generate([PROMPTS[0], list(range(40)), PROMPTS[2]], greedy(4), use_tqdm=False)
    assert outs[1].error and "pool" in outs[1].error and outs[1].outputs[0].token_ids == []
    assert len(outs[0].outputs[0].token_ids) == 4 and len(outs[2].outputs[0].token_ids) == 4
    with pytest.raises(RequestRejectedError, match="512 positions"):
        make_llm(num_blocks=512).engine.add_request("x", [1] * 513, greedy())
    assert_pool_clean(llm)


def test_a_request_that_outgrows_the_pool_fails_with_a_reason():
    llm = make_llm(num_blocks=4)  # 16 tokens; the prompt fits, its output cannot
    (out,) = llm.generate([PROMPTS[0]], greedy(30), use_tqdm=False)
    assert out.error and "pool" in out.error
    assert_pool_clean(llm)


def test_bad_arguments_are_refused_clearly():
    with pytest.raises(PagedLearnError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(PagedLearnError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(PagedLearnError, match="preemption_mode"):
        make_llm(preemption_mode="drop")
    with pytest.raises(PagedLearnError, match="not both"):
        make_llm(kv_cache_memory=2**20)
    with pytest.raises(PagedLearnError, match="swap_blocks=0"):
        make_llm(preemption_mode="swap", swap_blocks=0)
    llm = make_llm()
    engine = llm.engine
    with pytest.raises(RequestRejectedError, match="empty"):
        engine.add_request("e", [], greedy())
    with pytest.raises(RequestRejectedError, match="vocabulary"):
        engine.add_request("v", [999], greedy())
    engine.add_request("a", [1, 2], greedy())
    with pytest.raises(RequestRejectedError, match="already in use"):
        engine.add_request("a", [1, 2], greedy())
    with pytest.raises(RequestRejectedError, match="SamplingParams"):
        engine.add_request("p", [1, 2], {"max_tokens": 3})
    while engine.has_unfinished_requests():  # the refused requests left nothing behind
        engine.step()
    assert not engine.requests  # finished ones are forgotten, refused ones never entered
    assert_pool_clean(llm)


def test_another_decoder_needs_no_config_entry():
    """A Llama-style model -- rotary positions, grouped-query attention (4 heads, 2 KV heads) --
    runs unmodified on the paged cache and matches its own generate()."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedlearn import LLM
    from pagedlearn.models import ByteTokenizer

    def llama():
        config = LlamaConfig(
            vocab_size=258,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            max_position_embeddings=512,
            initializer_range=0.2,
            bos_token_id=None,
            eos_token_id=256,
            pad_token_id=257,
        )
        with torch.random.fork_rng():  # the same weights twice, the caller's RNG untouched
            torch.manual_seed(0)
            return LlamaForCausalLM(config).eval()

    llm = LLM(llama(), tokenizer=ByteTokenizer(), num_blocks=64, block_size=4, verbose=False)
    assert llm.engine.kv_cache.spec.num_kv_heads == 2
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12), use_tqdm=False)
    ref = llama()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        want = ref.generate(
            torch.tensor([prompt]),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=256,
            pad_token_id=257,
        )[0, len(prompt) :].tolist()
        assert out.outputs[0].token_ids == want
    assert_pool_clean(llm)


def _serve_steps(final_only: bool) -> tuple[list, list]:
    """Serve a mixed workload step by step: each step's outputs, and the block trace."""
    llm = make_llm(num_blocks=24)  # tight: preemptions happen
    engine = llm.engine
    log = engine.record()
    workload = [
        ("g", PROMPTS[0], SamplingParams(max_tokens=10)),
        ("n3", PROMPTS[1], SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=9)),
        ("beam", PROMPTS[2], BeamSearchParams(beam_width=3, max_tokens=6)),
        ("stop", PROMPTS[3], SamplingParams(max_tokens=20, stop=["e", "zz"], ignore_eos=True)),
    ]
    for rid, prompt, params in workload:
        engine.add_request(rid, list(prompt), params, final_only=final_only)
    steps = []
    while engine.has_unfinished_requests():
        steps.append(
            [(o.request_id, o.finished, [(c.token_ids, c.finish_reason) for c in o.outputs])
             for o in engine.step()]
        )  # fmt: skip
    events = [(e.kind, e.blocks, e.seqs) for e in log.events]
    assert engine.scheduler.num_preemptions["recompute"] > 0
    return steps, events


def test_final_only_leaves_out_the_outputs_of_requests_still_running():
    """``add_request(..., final_only=True)`` (what LLM.generate asks for) changes only which
    outputs ``step()`` returns: the finished ones, the same; the blocks move the same."""
    every, every_events = _serve_steps(final_only=False)
    final, final_events = _serve_steps(final_only=True)
    assert final == [[o for o in step if o[1]] for step in every]
    assert final_events == every_events


@pytest.mark.parametrize("victims", [["gen-1"], ["gen-0", "gen-1", "gen-2"]])
def test_generate_returns_every_output_when_other_code_aborts_its_requests(victims):
    """A stats subscriber (on generate's own thread) aborts some of generate's requests after
    step 3: generate still returns one output per prompt -- the aborted ones with finish reason
    "abort" and the tokens they had -- and the others run to the end (issue 32: a bare
    ``KeyError: 'gen-1'`` lost every output)."""
    llm = make_llm()
    engine, seen = llm.engine, []

    def abort_some(stats) -> None:
        seen.append(stats)
        if len(seen) == 3:
            for rid in victims:
                assert engine.abort_request(rid).outputs[0].finish_reason == "abort"

    engine.subscribe_stats(abort_some)
    outs = llm.generate(PROMPTS[:3], greedy(12), use_tqdm=False)
    assert [o.request_id for o in outs] == ["gen-0", "gen-1", "gen-2"]
    for o in outs:
        c = o.outputs[0]
        assert o.finished
        if o.request_id in victims:
            assert c.finish_reason == "abort" and 0 < len(c.token_ids) < 12
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 12
    assert_pool_clean(llm)


def test_generate_survives_an_abort_from_another_thread():
    """Another thread aborts one of generate's requests while it runs; the engine is not
    thread-safe, so the abort is made between steps (from a stats subscriber that waits for the
    other thread), as a server's engine loop would hand it over."""
    import threading

    llm = make_llm()
    engine, steps = llm.engine, []

    def between_steps(stats) -> None:
        steps.append(stats)
        if len(steps) == 2:
            t = threading.Thread(target=engine.abort_request, args=("gen-0",))
            t.start()
            t.join()

    engine.subscribe_stats(between_steps)
    outs = llm.generate(PROMPTS[:3], greedy(8), use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["abort", "length", "length"]
    assert_pool_clean(llm)
