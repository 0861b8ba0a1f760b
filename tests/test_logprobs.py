"""Per-token logprobs (``SamplingParams(logprobs=k)``, vLLM's semantics) on tiny-gpt2.

Every sampled token comes with its raw log-probability and rank (1: the most likely) plus the k
most likely tokens. Checked against transformers' own logits; then that they stay in step with
the tokens through forks, preemption by recompute and a step that raises and is rolled back,
and that requests that do not ask keep the fast greedy path.
"""

from __future__ import annotations

import pytest
import torch
from engine_cases import PROMPTS, assert_pool_clean, greedy, hf_model, make_llm, tokens

from pagedlearn import BeamSearchParams, SamplingParams
from pagedlearn.engine.request import Logprob
from pagedlearn.engine.sampler import Sampler
from pagedlearn.errors import PagedLearnError


def hf_logprobs(prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' log_softmax for each output position: ``(len(output), vocab)``."""
    with torch.no_grad():
        logits = hf_model("tiny-gpt2")(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]


def sampled(c) -> list[float]:
    """A sample's own tokens' log-probabilities, read from its logprobs dicts."""
    return [d[t].logprob for t, d in zip(c.token_ids, c.logprobs, strict=True)]


def assert_in_step(outs) -> None:
    """Every sample has one logprobs dict per token, holding that token."""
    for out in outs:
        for c in out.outputs:
            assert len(c.logprobs) == len(c.token_ids)
            assert all(t in d for t, d in zip(c.token_ids, c.logprobs, strict=True))


def test_greedy_logprobs_are_transformers_log_softmax_with_rank_1():
    llm = make_llm()
    plain = llm.generate(PROMPTS, greedy(10), use_tqdm=False)
    outs = llm.generate(PROMPTS, greedy(10, logprobs=0), use_tqdm=False)
    assert tokens(outs) == tokens(plain)  # asking for logprobs changes no token
    for prompt, out in zip(PROMPTS, outs, strict=True):
        c = out.outputs[0]
        ref = hf_logprobs(prompt, c.token_ids)
        assert len(c.logprobs) == len(c.token_ids) == 10
        for i, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
            assert list(entry) == [tok]  # k = 0: the sampled token alone
            assert entry[tok].rank == 1 and entry[tok].decoded_token is None
            assert entry[tok].logprob == pytest.approx(float(ref[i, tok]), abs=1e-4)
        assert c.cumulative_logprob == pytest.approx(sum(sampled(c)), abs=1e-4)
    assert_pool_clean(llm)


def test_top_k_logprobs_are_the_k_most_likely_tokens():
    llm = make_llm()
    (out,) = llm.generate([PROMPTS[1]], greedy(8, logprobs=3), use_tqdm=False)
    c = out.outputs[0]
    ref = hf_logprobs(PROMPTS[1], c.token_ids)
    for i, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
        assert len(entry) == 3  # the greedy token is the most likely: among the three
        by_rank = sorted(entry.items(), key=lambda kv: kv[1].rank)
        assert [lp.rank for _, lp in by_rank] == [1, 2, 3]
        assert by_rank[0][0] == tok
        values = [lp.logprob for _, lp in by_rank]
        assert values == sorted(values, reverse=True)
        top = torch.topk(ref[i], 3)
        assert [t for t, _ in by_rank] == top.indices.tolist()
        assert values == pytest.approx(top.values.tolist(), abs=1e-4)


def test_sampled_tokens_have_their_own_rank_and_value():
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True, logprobs=2)
    llm = make_llm()
    (out,) = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    c = out.outputs[0]
    ref = hf_logprobs(PROMPTS[0], c.token_ids)
    ranks = []
    for i, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
        assert tok in entry and len(entry) in (2, 3)
        assert {1, 2} <= {lp.rank for lp in entry.values()}
        assert entry[tok].logprob == pytest.approx(float(ref[i, tok]), abs=1e-4)
        # its rank: 1 + tokens strictly more likely (transformers' row, away from near-ties)
        near = (ref[i] - ref[i, tok]).abs() < 1e-4
        higher = int((ref[i] > ref[i, tok]).sum())
        assert higher + 1 <= entry[tok].rank <= higher + int(near.sum())
        assert (len(entry) == 3) == (entry[tok].rank > 2)  # outside the top 2: one more entry
        ranks.append(entry[tok].rank)
    assert max(ranks) > 1  # at temperature 1, some draw is not the argmax


def test_parallel_samples_get_separate_lists_and_outputs_are_copies():
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=2, ignore_eos=True, logprobs=1)
    llm = make_llm()
    engine = llm.engine
    engine.add_request("a", PROMPTS[1], params)
    seen = []
    for _ in range(50):
        if not engine.has_unfinished_requests():
            break
        seen += engine.step()
    assert_in_step(seen)
    assert seen[-1].finished and len(seen[-1].outputs) == 2
    a, b = seen[-1].outputs
    assert a.logprobs is not b.logprobs and a.token_ids != b.token_ids  # seed 3: they differ
    assert a.logprobs[0][a.token_ids[0]].rank >= 1 and len(a.logprobs) == 6 == len(b.logprobs)
    # outputs handed out earlier kept their lengths (copies, not the live lists)
    lengths = [[(len(c.token_ids), len(c.logprobs)) for c in o.outputs] for o in seen]
    assert lengths == [[(i, i), (i, i)] for i in range(1, 7)]
    assert_pool_clean(llm)


def test_without_logprobs_none_are_computed(monkeypatch):
    calls = []
    token_logprobs = Sampler.token_logprobs

    def counted(*args):
        calls.append(1)
        return token_logprobs(*args)

    monkeypatch.setattr(Sampler, "token_logprobs", counted)
    llm = make_llm()
    outs = llm.generate(PROMPTS, greedy(6), use_tqdm=False)
    assert all(c.logprobs is None for o in outs for c in o.outputs)
    assert calls == []  # a request that does not ask costs nothing
    outs = llm.generate(PROMPTS, greedy(6, logprobs=2), use_tqdm=False)
    assert len(calls) == len(PROMPTS) * 6  # one per sampled token of the requests that ask
    assert_in_step(outs)
    (beams,) = llm.beam_search([PROMPTS[0]], BeamSearchParams(2, 4), use_tqdm=False)
    assert all(c.logprobs is None for c in beams.outputs)  # beam search has none


def test_a_step_that_raises_rolls_its_logprobs_back():
    """_stop_reason (called after a token and its logprobs are appended) raises once, midway
    through a step that forks: recovery must drop that step's logprobs with its tokens."""
    requests = {
        "g": (PROMPTS[0], greedy(8, logprobs=2)),
        "s": (
            PROMPTS[1],
            SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=2, ignore_eos=True, logprobs=1),
        ),
    }

    def serve(fault_at: int | None):
        llm = make_llm()
        engine, calls, raised = llm.engine, [], []
        stop_reason = engine._stop_reason

        def faulty(p, seq, tok):
            calls.append(1)
            if len(calls) == fault_at:
                raise RuntimeError("stop check failed (injected)")
            return stop_reason(p, seq, tok)

        engine._stop_reason = faulty
        for rid, (prompt, params) in requests.items():
            engine.add_request(rid, prompt, params)
        finals = {}
        for _ in range(100):
            if not engine.has_unfinished_requests():
                break
            try:
                finals.update((o.request_id, o) for o in engine.step() if o.finished)
            except RuntimeError:
                raised.append(engine.last_recovery)
                for req in engine.requests.values():
                    for seq in req.seqs + req.done:
                        assert len(seq.logprobs) == len(seq.output_token_ids)
        assert_pool_clean(llm)
        return finals, raised

    want, _ = serve(None)
    got, raised = serve(fault_at=3)  # the first step: "g", then "s"'s two samples; the 2nd
    assert [(r.phase, r.requeued) for r in raised] == [("sample", ["s"])]
    for rid in requests:
        assert tokens([got[rid]]) == tokens([want[rid]])
        assert_in_step([got[rid]])
        for c, w in zip(got[rid].outputs, want[rid].outputs, strict=True):
            for d, e in zip(c.logprobs, w.logprobs, strict=True):
                assert list(d) == list(e)
                assert [x.logprob for x in d.values()] == pytest.approx(
                    [x.logprob for x in e.values()], abs=1e-4
                )


def test_preemption_by_recompute_keeps_the_logprobs():
    want = make_llm().generate(PROMPTS, greedy(20, logprobs=1), use_tqdm=False)
    stats = []
    llm = make_llm(num_blocks=20, preemption_mode="recompute")
    llm.engine.subscribe_stats(stats.append)
    outs = llm.generate(PROMPTS, greedy(20, logprobs=1), use_tqdm=False)
    assert stats[-1].preemptions_recompute > 0
    assert tokens(outs) == tokens(want)
    assert_in_step(outs)
    for out, w in zip(outs, want, strict=True):
        assert sampled(out.outputs[0]) == pytest.approx(sampled(w.outputs[0]), abs=1e-4)
    assert_pool_clean(llm)


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True, "3"])
def test_bad_logprobs_are_rejected_naming_them(bad):
    with pytest.raises(PagedLearnError, match="logprobs"):
        SamplingParams(logprobs=bad)


def test_logprobs_bounds_and_the_logprob_record():
    assert SamplingParams(logprobs=0).logprobs == 0 and SamplingParams(logprobs=20).logprobs == 20
    assert SamplingParams().logprobs is None
    assert Logprob(-0.5, 1) == Logprob(logprob=-0.5, rank=1, decoded_token=None)
