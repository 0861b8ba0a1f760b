"""SamplingParams' checks at the boundary (a bad value fails at once, naming it) and the one rule
that decides greedy sampling: a temperature below 1e-5 (vLLM's _SAMPLING_EPS)."""

from __future__ import annotations

import math

import pytest

from pagedlearn import LLM, SamplingParams
from pagedlearn.engine.sampling_params import MAX_SEED, SAMPLING_EPS
from pagedlearn.errors import PagedLearnError


@pytest.mark.parametrize("t", [math.nan, math.inf, -math.inf, -1e-9])
def test_a_temperature_must_be_finite_and_not_negative(t):
    with pytest.raises(PagedLearnError, match="temperature must be a finite number >= 0"):
        SamplingParams(temperature=t)


@pytest.mark.parametrize("seed", [-1, MAX_SEED + 1, 2**64, 1.5])
def test_a_seed_is_an_int_in_vllms_range(seed):
    with pytest.raises(PagedLearnError, match=r"seed must be None or an int in \[0, 2\*\*63 - 1\]"):
        SamplingParams(seed=seed)


def test_the_largest_seed_seeds_a_generator():
    llm = LLM("tiny-gpt2", num_blocks=8, verbose=False)
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=MAX_SEED, ignore_eos=True)
    outs = [llm.generate(["Hi"], params, use_tqdm=False)[0].outputs[0] for _ in range(2)]
    assert outs[0].finish_reason == "length" and outs[0].token_ids == outs[1].token_ids


def test_a_stop_string_must_be_valid_unicode():
    with pytest.raises(PagedLearnError, match=r"stop must be valid Unicode text.*lone surrogate"):
        SamplingParams(stop=["ok", "a\ud800"])


def test_greedy_is_decided_by_the_temperature_below_eps():
    assert SamplingParams(temperature=0).greedy
    for t in (1e-6, 1e-40, 5e-324):
        assert SamplingParams(temperature=t).greedy
    assert not SamplingParams(temperature=SAMPLING_EPS).greedy
    assert not SamplingParams(temperature=1.0).greedy


def test_a_tiny_temperature_generates_the_greedy_tokens():
    # (logits / 1e-40 overflow to -inf everywhere: softmax's NaN failed the request)
    llm = LLM("tiny-gpt2", num_blocks=8, verbose=False)

    def tokens(t: float) -> list[int]:
        params = SamplingParams(max_tokens=6, temperature=t, ignore_eos=True)
        out = llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "length", out
        return out.token_ids

    assert tokens(1e-40) == tokens(5e-324) == tokens(0)
