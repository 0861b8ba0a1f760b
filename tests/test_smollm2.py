"""pagedlearn on a real instruct model, token for token against transformers' own ``generate``.

SmolLM2-135M-Instruct (float32, CPU; the ``smollm2`` fixture in conftest.py loads it once per
process) answers real chats rendered with its real chat template. Whatever the engine does to
serve them -- batch them, page their KV, share a long system prompt's blocks, preempt and
recompute or swap, fork beams -- its tokens must be the ones transformers gives for the same
prompts. The tiny offline models check the same things (test_engine.py), but with random weights:
here a wrong token shows as wrong English, and EOS (``<|im_end|>``, id 2) really ends answers.

The model is 540 MB and a step of it is slow on one core, so everything is short (16 new tokens,
four chats), one xdist worker runs the whole file, and transformers' answers are computed once
(:func:`hf_generate`) and shared by the tests that ask the same question.
"""

from __future__ import annotations

import pytest
import torch

from pagedlearn import LLM, BeamSearchParams, SamplingParams
from pagedlearn.serve.chat import chat_prompt, chat_prompt_ids

pytestmark = pytest.mark.xdist_group("smollm2")

EOS = 2  # <|im_end|>
MAX_TOKENS = 16
QUESTIONS = [  # (a chat is 35-38 tokens in the template, its default system prompt included)
    "Write a haiku about the sea.",  # answers longer than MAX_TOKENS: "length"
    "How many legs does a spider have?",
    "What is the capital of France?",  # 8 tokens, then EOS: "stop"
    "Name three primary colors.",  # 13, then EOS
]
CAPITAL = 2  # the question the server is asked
# A long system prompt (about 400 tokens: 25 blocks of 16) that two chats share.
FACTS = [
    "The library opens at 9 in the morning and closes at 8 in the evening, Monday to Friday.",
    "On Saturdays it opens at 10 and closes at 4; on Sundays and public holidays it is closed.",
    "A library card is free for everyone who lives, works or studies in the city.",
    "To get a card, bring a photo identity document and something that shows your address.",
    "Members may borrow up to twelve items at a time: books, magazines, films and music.",
    "Books are lent for three weeks; films and magazines for one week.",
    "An item can be renewed twice, online or at the desk, unless someone else has reserved it.",
    "There are no late fees for children's books; other items cost 20 cents a day late.",
    "Lost or damaged items are charged at the price of a new copy.",
    "The reading room on the second floor is silent; study rooms can be booked for two hours.",
    "Computers and printers are on the first floor; printing costs 10 cents a page.",
    "Wireless internet is free; the network is called Library-Guest and needs no password.",
    "Story time for children under five is on Wednesdays and Saturdays at 11 in the morning.",
    "The book club meets on the first Thursday of every month at 7 in the evening.",
    "Returns can go in the box by the main door at any hour, even when the library is closed.",
    "Parking is free for two hours in the car park behind the building.",
    "The café on the ground floor serves coffee, tea and sandwiches until 5 in the afternoon.",
    "Lockers are in the entrance hall; they take a one-euro coin, which is given back.",
]
SYSTEM = (
    "You are the help desk of the Riverside Public Library. Answer in one short, friendly "
    "sentence, using only these facts:\n" + "\n".join(f"- {fact}" for fact in FACTS)
)
SHARED_QUESTIONS = ["When does the library open on Saturdays?", "How long can I keep a film?"]


def chat_ids(tokenizer, question: str, system: str | None = None) -> tuple[int, ...]:
    """The question as a chat (with ``system`` first, if given) in the model's chat template,
    ending where the assistant's reply starts: what the server feeds the model."""
    messages = [{"role": "system", "content": system}] if system else []
    return tuple(chat_prompt_ids(tokenizer, [*messages, {"role": "user", "content": question}]))


_HF: dict[tuple, list[list[int]]] = {}


def hf_generate(loaded, prompts: tuple[tuple[int, ...], ...], **kw) -> list[list[int]]:
    """transformers' own ``generate`` (greedy unless ``kw`` says otherwise) on the prompts as one
    left-padded batch, each output cut after its first EOS as the engine returns it (EOS
    included); with ``num_return_sequences=k``, k outputs per prompt. Computed once per question.

    The model is the one the engine runs: its attention is switched back to transformers' SDPA
    for the call (``LLM`` switched it to pagedlearn's), then to what it was."""
    key = (prompts, tuple(sorted(kw.items())))
    if key not in _HF:
        model, width = loaded.model, max(map(len, prompts))
        ids = torch.tensor([[EOS] * (width - len(p)) + list(p) for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        impl = model.config._attn_implementation
        model.set_attn_implementation("sdpa")
        try:
            with torch.no_grad():
                out = model.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=MAX_TOKENS,
                    do_sample=False,
                    pad_token_id=EOS,
                    **kw,
                )
        finally:
            model.set_attn_implementation(impl)
        rows = out[:, width:].tolist()
        _HF[key] = [row[: row.index(EOS) + 1] if EOS in row else row for row in rows]
    return _HF[key]


def token_ids(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


def assert_pool_clean(llm: LLM) -> None:
    s = llm.engine.kv.stats()
    assert not llm.engine.has_unfinished_requests() and s["used_blocks"] == 0
    assert s["cpu_used_blocks"] == 0
    llm.engine.kv.check_invariants()


@pytest.fixture(scope="module")
def chats(smollm2) -> tuple[tuple[int, ...], ...]:
    return tuple(chat_ids(smollm2.tokenizer, q) for q in QUESTIONS)


@pytest.fixture(scope="module")
def batched(smollm2, chats):
    """The four chats batched in one engine with room to spare (the reference run)."""
    llm = LLM(smollm2, block_size=16, num_blocks=64, verbose=False)
    prompts = [{"prompt_token_ids": list(p)} for p in chats]
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)
    assert_pool_clean(llm)
    return outs


def test_batched_chats_match_transformers(smollm2, chats, batched):
    assert token_ids(batched) == hf_generate(smollm2, chats)
    reasons = [o.outputs[0].finish_reason for o in batched]
    assert reasons == ["stop" if o.outputs[0].token_ids[-1] == EOS else "length" for o in batched]
    assert "stop" in reasons and "length" in reasons  # EOS ends answers; max_tokens cuts others
    assert batched[CAPITAL].outputs[0].text == "The capital of France is Paris."


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_changes_no_token(smollm2, chats, batched, mode):
    """The two long answers in 7 blocks of 16 tokens: both prompts (38 tokens: 3 blocks each)
    are admitted, leaving the scheduler's one-block watermark; past 48 tokens each needs a
    fourth block, and only one is left. The younger chat is preempted -- its KV dropped and
    recomputed later, or swapped out to the CPU and back -- and still gives transformers'
    tokens. (No prefix caching here: the two chats' shared first block would leave the pool a
    block to spare, and no preemption.)"""
    llm = LLM(
        smollm2,
        block_size=16,
        num_blocks=7,
        preemption_mode=mode,
        enable_prefix_caching=False,
        verbose=False,
    )
    prompts = [{"prompt_token_ids": list(p)} for p in chats[:2]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions[mode] > 0
    assert token_ids(outs) == token_ids(batched[:2]) == hf_generate(smollm2, chats)[:2]
    assert_pool_clean(llm)


def test_a_long_shared_system_prompt_is_computed_once(smollm2):
    """Two chats under one ~400-token system prompt, batched: the second reuses the full blocks
    of it that the first writes in the same step (``num_cached_tokens``: its prompt's blocks are
    looked up after the first's are placed), and both answers are transformers' (and real)."""
    tok = smollm2.tokenizer
    prompts = tuple(chat_ids(tok, q, SYSTEM) for q in SHARED_QUESTIONS)
    shared = next(i for i, (a, b) in enumerate(zip(*prompts, strict=False)) if a != b)
    assert len(prompts[0]) >= 300 and shared >= 300  # a long prompt, most of it shared
    llm = LLM(smollm2, block_size=16, num_blocks=80, verbose=False)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    assert outs[0].num_cached_tokens == 0
    assert outs[1].num_cached_tokens == shared // 16 * 16  # every full block of the shared part
    assert token_ids(outs) == hf_generate(smollm2, prompts)
    assert "10" in outs[0].outputs[0].text  # "... opens at 10 ..." on Saturdays
    assert_pool_clean(llm)


def test_seeded_sampling_is_reproducible(smollm2, chats):
    """n=3 samples with a seed: the same three again on a second run (which also hits the
    prefix cache), and three different answers, not one copied. (The sampler draws from its own
    seeded generator, as vLLM's does; it is not defined to match transformers' sampling.)"""
    llm = LLM(smollm2, block_size=16, num_blocks=64, verbose=False)
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=MAX_TOKENS)
    prompt = [{"prompt_token_ids": list(chats[0])}]
    first = token_ids(llm.generate(prompt, params, use_tqdm=False))
    again = llm.generate(prompt, params, use_tqdm=False)
    assert again[0].num_cached_tokens > 0
    assert token_ids(again) == first and len({tuple(t) for t in first}) == 3
    assert_pool_clean(llm)


def test_beam_search_matches_transformers(smollm2, chats):
    """Beam width 3 against ``generate(num_beams=3)``: the same three beams, best first ("The
    capital of France is Paris." and two longer ones, each ending with EOS). Same scoring:
    log-probability / generated tokens ** length_penalty, and the search stops as transformers'
    ``early_stopping=False`` does."""
    llm = LLM(smollm2, block_size=16, num_blocks=64, verbose=False)
    params = BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS, length_penalty=1.0)
    prompt = [{"prompt_token_ids": list(chats[CAPITAL])}]
    (out,) = llm.beam_search(prompt, params, use_tqdm=False)
    want = hf_generate(
        smollm2,
        chats[CAPITAL : CAPITAL + 1],
        num_beams=3,
        num_return_sequences=3,
        length_penalty=1.0,
        early_stopping=False,
    )
    assert [c.token_ids for c in out.outputs] == want
    assert out.outputs[0].text == "The capital of France is Paris."
    assert [c.finish_reason for c in out.outputs] == [
        "stop" if c.token_ids[-1] == EOS else "length" for c in out.outputs
    ]
    assert_pool_clean(llm)


def test_the_servers_chat_completion_is_generates(smollm2, chats, batched):
    """``POST /v1/chat/completions`` through the ``openai`` client renders the messages with the
    model's chat template and answers what ``LLM.generate`` gives for that prompt, stopping at
    ``<|im_end|>`` (finish reason "stop", the EOS not in the text); streamed too."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from pagedlearn.serve import serve

    messages = [{"role": "user", "content": QUESTIONS[CAPITAL]}]
    assert chat_prompt(smollm2.tokenizer, messages).endswith("<|im_start|>assistant\n")
    want = batched[CAPITAL].outputs[0]  # LLM.generate's answer for this chat
    assert want.token_ids[-1] == EOS and want.finish_reason == "stop"
    with serve(LLM(smollm2, block_size=16, num_blocks=64, verbose=False), port=0) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=60)
        args = dict(model=srv.model_name, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        r = client.chat.completions.create(**args)
        assert r.choices[0].message.content == want.text == "The capital of France is Paris."
        assert r.choices[0].finish_reason == "stop"
        assert r.usage.prompt_tokens == len(chats[CAPITAL])
        assert r.usage.completion_tokens == len(want.token_ids)  # EOS counted, not shown
        chunks = list(client.chat.completions.create(**args, stream=True))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == want.text and chunks[-1].choices[0].finish_reason == "stop"
