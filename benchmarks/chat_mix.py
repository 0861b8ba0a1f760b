"""The load test's request mix as real chats: the workload of bench_engine.py's mix section.

The load test (pagedlearn/loadtest/mix.py) cycles through :data:`TEMPLATES`, a prompt kind, an
ending and a number of samples, with byte-token prompts sized for the offline models. Here each
entry becomes a chat, rendered with the model's chat template (``chat_prompt_ids``: a base model
without one gets the plain ``role: content`` template), so that a real instruct model such as
SmolLM2 answers real questions:

============== =========================================================================
short          a question, no system prompt (a template may add its default one)
shared-prefix  one of ``NUM_SYSTEM_PROMPTS`` system prompts, clipped to ``SYSTEM_BLOCKS + 1``
               blocks of tokens (so at least ``SYSTEM_BLOCKS`` whole blocks are shared with
               every other chat that starts with it), then a question
near-limit     "summarize this": a passage of Python's own reference manual (``pydoc_data``,
               shipped with Python: offline and real text), ``LONG_TOKENS`` tokens or what the
               context leaves; not the context's limit, which would take minutes on a CPU
============== =========================================================================

Every request is greedy (so the systems' outputs can be compared token for token) and stops at
EOS or at its ``max_tokens``, whichever comes first:

- ``stop``: a question with a short answer and ``STOP_MAX_TOKENS``: EOS ends it early;
- ``length``: a request for a long answer, ``max_tokens`` drawn in 16..64: it runs to the end;
- ``cancel``: ``max_tokens`` = the load test's ``cancel_after`` draw (2..12): transformers'
  ``generate`` cannot abort a request, so a cancel becomes a stop at the same token;
- ``n > 1``: n requests with the same prompt (greedy samples of one prompt would be equal;
  what stays is n requests sharing a whole prompt).

All requests arrive at once, in the mix's order; one ``random.Random(seed)`` draws everything.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pagedlearn.loadtest.mix import NUM_SYSTEM_PROMPTS, SYSTEM_BLOCKS, TEMPLATES
from pagedlearn.serve.chat import chat_prompt_ids

LONG_TOKENS = 384  # the near-limit passage, at most
STOP_MAX_TOKENS = 128
SHORT_ANSWERS = (
    "What is the capital of France?",
    "How many days are there in a leap year?",
    "Which planet is closest to the sun?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "How many legs does a spider have?",
    "What colour do you get when you mix blue and yellow?",
    "What is the largest ocean on Earth?",
)
LONG_ANSWERS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a bicycle stays upright when it moves.",
    "Describe the water cycle in detail.",
    "Give me ten tips for learning a new language.",
    "Write a poem about autumn in a big city.",
    "Explain why the sky is blue to a ten-year-old.",
)
SYSTEM_PROMPTS = (
    "You are a patient tutor for a first-year university course on programming. The students "
    "are new to computers, and many of them are nervous about mathematics. Answer in plain "
    "English, in short paragraphs, and give one small example whenever you introduce a new "
    "idea. Never make fun of a question. If a question is unclear, say what you understood "
    "and answer that. If you do not know something, say so instead of guessing. Keep every "
    "answer friendly, accurate and brief, and end with a question that checks understanding.",
    "You are the help desk of a small public library in a quiet town. Visitors ask about "
    "opening hours, borrowing rules, local history and books to read next. Be warm and "
    "concise. Recommend books only when you are sure that they exist, and mention the author "
    "of every book you recommend. Do not give medical, legal or financial advice; suggest a "
    "professional instead. When a visitor asks about the town, tell them that the archive on "
    "the second floor keeps old newspapers and maps, open on weekday mornings.",
)
PASSAGES = ("assignment", "for", "try", "with", "import", "class")  # pydoc_data topics


@dataclass(frozen=True)
class ChatRequest:
    """One request of the mix: its prompt's token ids, how many tokens it may get, and the
    template entry it came from (prompt kind, ending)."""

    prompt: list[int]
    max_tokens: int
    kind: str  # e.g. "shared-prefix/stop"


def clip(tokenizer, text: str, num_tokens: int) -> str:
    """``text`` cut to its first ``num_tokens`` tokens (and decoded back to text)."""
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:  # the offline models' byte tokenizer adds none, and takes no option
        ids = tokenizer.encode(text)
    return tokenizer.decode(list(ids)[:num_tokens])


def build_chat_mix(
    tokenizer, num_entries, seed, block_size, max_model_len, stop_max_tokens=STOP_MAX_TOKENS
) -> list[ChatRequest]:
    """The first ``num_entries`` entries of the load test's template cycle as chats (an entry
    with n samples gives n requests); ``stop_max_tokens``: the stop requests' max_tokens."""
    from pydoc_data.topics import topics

    rng = random.Random(seed)
    systems = [clip(tokenizer, s, (SYSTEM_BLOCKS + 1) * block_size) for s in SYSTEM_PROMPTS]
    long_tokens = max(16, min(LONG_TOKENS, max_model_len - stop_max_tokens - 64))  # template
    requests, passages = [], iter(PASSAGES * num_entries)
    for i in range(num_entries):
        prompt, ending, n = TEMPLATES[i % len(TEMPLATES)]
        if ending == "stop":
            question, max_tokens = rng.choice(SHORT_ANSWERS), stop_max_tokens
        elif ending == "length":
            question, max_tokens = rng.choice(LONG_ANSWERS), rng.randint(16, 64)
        else:  # cancel: aborted after a few tokens in the load test
            question, max_tokens = rng.choice(LONG_ANSWERS), rng.randint(2, 12)
        messages = [{"role": "user", "content": question}]
        if prompt == "shared-prefix":
            messages.insert(0, {"role": "system", "content": systems[i % NUM_SYSTEM_PROMPTS]})
        elif prompt == "near-limit":
            passage = clip(tokenizer, topics[next(passages)], long_tokens)
            messages[0]["content"] = f"Summarize this passage in one sentence.\n\n{passage}"
            if ending == "length":
                messages[0]["content"] = f"Explain this passage in detail.\n\n{passage}"
        ids = chat_prompt_ids(tokenizer, messages)
        requests += [ChatRequest(ids, max_tokens, f"{prompt}/{ending}")] * n
    return requests
