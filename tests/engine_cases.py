"""Shared set-up for the engine tests: tiny offline models, prompts, and the pool-is-clean check."""

from __future__ import annotations

import functools

import torch

from pagedlearn import LLM, SamplingParams

# Prompts of different lengths (bytes are the tiny models' tokens): 1 token to a few blocks.
PROMPTS = [
    list(b"Hello world"),
    list(b"The quick brown fox jumps over the lazy dog"),
    [65],
    list(b"abcdefghijklmnop" * 3),
]
SYSTEM = list(b"You are a helpful assistant. Answer briefly. ")  # 44 tokens


@functools.cache
def hf_model(name: str):
    """A second, untouched copy of the tiny model (the engine switches its own copy's attention)."""
    from pagedlearn.models import load

    return load(name).model


def make_llm(name: str = "tiny-gpt2", **kw) -> LLM:
    kw.setdefault("num_blocks", 64)
    kw.setdefault("block_size", 4)
    return LLM(name, verbose=False, **kw)


def greedy(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def hf_greedy(name: str, prompt: list[int], max_tokens: int) -> list[int]:
    out = hf_model(name).generate(
        torch.tensor([prompt]),
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=256,
        pad_token_id=257,
    )
    return out[0, len(prompt) :].tolist()  # up to and including EOS, as the engine returns


def assert_pool_clean(llm: LLM) -> None:
    """After all requests: no sequence holds a block; every block is free or cached-free."""
    kv = llm.engine.kv
    assert not llm.engine.has_unfinished_requests()
    assert kv.sequences() == [] and kv.swapped_sequences() == []
    s = kv.stats()
    assert s["used_blocks"] == 0 and s["free_blocks"] == s["num_blocks"]
    assert s["cpu_used_blocks"] == 0
    kv.check_invariants()
