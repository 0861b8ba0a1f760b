"""Stop strings (``SamplingParams.stop``), as vLLM: a sample ends as soon as its decoded text
contains one; its text is cut before it, its tokens keep every sampled token."""

from __future__ import annotations

import random

import pytest
from engine_cases import PROMPTS, assert_pool_clean, greedy, make_llm

from pagedlearn import BeamSearchParams, SamplingParams
from pagedlearn.engine.request import CompletionOutput, Sequence
from pagedlearn.errors import PagedLearnError
from pagedlearn.models.tokenizer import ByteTokenizer

MAX = 40


@pytest.fixture(scope="module")
def llm():
    return make_llm("tiny-gpt2")


@pytest.fixture(scope="module")
def free_runs(llm):
    """Each prompt's greedy output without stop strings."""
    return [o.outputs[0] for o in llm.generate(PROMPTS, greedy(MAX), use_tqdm=False)]


def first_stop(tokenizer, token_ids: list[int], stop: str) -> int | None:
    """The reference: how many tokens a sample has when its *whole* decoded text first contains
    ``stop`` (the engine decodes only a tail)."""
    for n in range(1, len(token_ids) + 1):
        if stop in tokenizer.decode(token_ids[:n]):
            return n
    return None


def stops_in(text: str, rng: random.Random, k: int) -> list[str]:
    """Up to ``k`` substrings of ``text`` (1-6 characters, no replacement character: a random
    model's bytes are often no UTF-8)."""
    found = {text[a:b] for a in range(len(text)) for b in range(a + 1, min(a + 7, len(text) + 1))}
    found = sorted(s for s in found if "\ufffd" not in s)
    return rng.sample(found, min(k, len(found)))


def test_a_stop_string_ends_the_sample_and_is_cut_from_its_text(llm, free_runs):
    tok = llm.get_tokenizer()
    rng = random.Random(0)
    cases = [(i, s) for i, free in enumerate(free_runs) for s in stops_in(free.text, rng, 4)]
    params = [greedy(MAX, stop=s) for _, s in cases]
    outs = llm.generate([PROMPTS[i] for i, _ in cases], params, use_tqdm=False)
    for (i, stop), out in zip(cases, outs, strict=True):
        free, got = free_runs[i].token_ids, out.outputs[0]
        n = first_stop(tok, free, stop)
        assert got.finish_reason == "stop"
        assert got.token_ids == free[:n]  # the same greedy tokens, up to the one that completed it
        full = tok.decode(got.token_ids)
        assert got.text == full[: full.index(stop)] and stop not in got.text
    assert_pool_clean(llm)


def test_include_stop_str_in_output_keeps_it(llm, free_runs):
    stop = next(s for s in stops_in(free_runs[1].text, random.Random(1), 20) if len(s) >= 2)
    out = llm.generate(
        PROMPTS[1], greedy(MAX, stop=[stop], include_stop_str_in_output=True), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.text.endswith(stop)
    assert out.text.count(stop) == 1


def test_the_first_stop_string_in_the_list_decides_where_the_text_is_cut(llm, free_runs):
    text = free_runs[1].text
    a = next(k for k in range(len(text) - 3) if "\ufffd" not in text[k : k + 3])
    long, short = text[a : a + 3], text[a + 1 : a + 3]  # both end on the same character
    for stop, cut in (([short, long], short), ([long, short], long)):
        out = llm.generate(PROMPTS[1], greedy(MAX, stop=stop), use_tqdm=False)[0].outputs[0]
        full = llm.get_tokenizer().decode(out.token_ids)
        assert out.text == full[: full.index(cut)]


def test_no_stop_string_in_the_output_changes_nothing(llm, free_runs):
    out = llm.generate(PROMPTS[0], greedy(MAX, stop="never said"), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and out.token_ids == free_runs[0].token_ids
    assert out.text == free_runs[0].text


def test_a_running_sample_holds_back_what_may_start_a_stop_string(llm):
    engine = llm.engine
    engine.add_request("r", PROMPTS[0], greedy(8, stop=["never said", "x"]))
    for _ in range(4):
        (out,) = engine.step()
    running = out.outputs[0]
    assert running.finish_reason is None
    full = llm.get_tokenizer().decode(running.token_ids)
    assert running.text == full[: len(full) - (len("never said") - 1)]  # as vLLM streams it
    engine.abort_request("r")


def test_parallel_samples_stop_each_on_their_own(llm):
    params = SamplingParams(max_tokens=MAX, n=4, temperature=1.0, seed=3, ignore_eos=True)
    free = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs
    stop = stops_in(free[0].text, random.Random(2), 1)[0]
    outs = llm.generate(
        PROMPTS[1], SamplingParams(**{**params.__dict__, "stop": (stop,)}), use_tqdm=False
    )[0].outputs
    tok = llm.get_tokenizer()
    for o in outs:
        assert stop not in o.text
        assert (o.finish_reason == "stop") == (stop in tok.decode(o.token_ids))
    assert outs[0].finish_reason == "stop"  # the same first sample: it stops at the same place
    assert_pool_clean(llm)


def test_beam_search_has_no_stop_strings(llm):
    outs = llm.beam_search(PROMPTS[1], BeamSearchParams(beam_width=2, max_tokens=5), False)
    assert all(o.text == llm.get_tokenizer().decode(o.token_ids) for o in outs[0].outputs)


# --- the pieces ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "stop, want",
    [(None, ()), ("a", ("a",)), (["a", "bc"], ("a", "bc")), (("\n",), ("\n",))],
)
def test_stop_takes_a_string_or_a_list_of_strings(stop, want):
    assert SamplingParams(stop=stop).stop == want


@pytest.mark.parametrize("stop", ["", [""], ["a", ""], [1], 5, [b"a"], {"a"}])
def test_a_bad_stop_is_refused_when_the_params_are_made(stop):
    with pytest.raises(PagedLearnError, match="stop must be a non-empty string or a list"):
        SamplingParams(stop=stop)


def test_include_stop_str_in_output_must_be_a_bool():
    with pytest.raises(PagedLearnError, match="include_stop_str_in_output must be True or False"):
        SamplingParams(include_stop_str_in_output="yes")


def test_the_tail_window_finds_every_stop_string_the_whole_text_has():
    """Random byte outputs with multi-byte characters (2-4 bytes, split across tokens): the
    window of the last few tokens finds each stop string at the same token as the whole text."""
    tok, rng = ByteTokenizer(), random.Random(7)
    chars = ["a", "b", " ", "é", "€", "😀", "\n"]
    for _ in range(200):
        ids = list("".join(rng.choice(chars) for _ in range(12)).encode())
        text = tok.decode(ids)
        a = rng.randrange(len(text))
        stop = text[a : a + rng.randint(1, 4)]
        want = first_stop(tok, ids, stop)
        seq = Sequence("s.0", [65, 66], num_prompt_tokens=2)
        got = None
        for n, t in enumerate(ids, 1):
            seq.token_ids.append(t)
            if seq.output_text_has((stop,), tok.decode):
                got = n
                break
        assert got == want, (ids, stop)


def test_completion_text_is_cut_only_for_a_stop_string():
    decode = ByteTokenizer().decode
    ids = list(b"one. two. three")
    out = CompletionOutput(0, ids, 0.0, "stop", decode, stop=(". t",))
    assert out.text == "one" and out.token_ids == ids
    kept = CompletionOutput(0, ids, 0.0, "stop", decode, (". t",), include_stop_str_in_output=True)
    assert kept.text == "one. t"
    assert CompletionOutput(0, ids, 0.0, "stop", decode, stop=("!",)).text == "one. two. three"
    assert CompletionOutput(0, ids, 0.0, "length", decode, stop=(". t",)).text.endswith("three")


def test_a_stop_string_split_by_special_tokens_is_still_found():
    """EOS and padding decode to nothing: the window widens until it holds enough text."""
    from pagedlearn import LLM
    from pagedlearn.engine.request import Sequence

    e = LLM("tiny-gpt2", num_blocks=16, block_size=4, verbose=False).engine
    p = SamplingParams(stop=["bc"], ignore_eos=True, max_tokens=100)
    seq = Sequence("s", list(b"Hi"), 2)
    reasons = []
    for tok in [ord("a"), ord("b")] + [e.eos_token_id] * 6 + [ord("c")]:
        seq.token_ids.append(tok)
        reasons.append(e._stop_reason(p, seq, tok))
    assert reasons == [None] * 8 + ["stop"]
