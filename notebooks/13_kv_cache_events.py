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
# # 13 · KV-cache events: a server's prefix cache, seen from outside
#
# **Why this chapter.** Chapter 04 looked at the prefix cache from inside the engine: hashes,
# physical blocks, refcounts. A deployment has several engines behind a router, and the router
# sees none of that. It wants one thing: *which engine already holds the KV of this prompt's
# prefix?* -- send the request there and its prefill is mostly a cache hit. So vLLM tells the
# outside world what its prefix cache does. Started with `--kv-events-config` (a JSON of
# `KVEventsConfig`, `vllm/config/kv_events.py`: `enable_kv_cache_events`, `publisher="zmq"`,
# `endpoint` -- default `tcp://*:5557` --, `replay_endpoint`, `buffer_steps`, `topic`), it
# publishes every block it caches (`BlockStored`), every cached block it drops
# (`BlockRemoved`) and a cleared cache (`AllBlocksCleared`) over ZeroMQ
# (`vllm/distributed/kv_events.py`; the docs' example `examples/features/kv_events` is a
# subscriber). KV-cache-aware routers read that stream: NVIDIA Dynamo's KV router, for one,
# keeps "a prefix tree built from worker-reported KV events" (its docs page *Router Design*) and
# scores each worker by how many of a prompt's blocks it holds. This chapter reads the same
# stream -- from pagedlearn's own server, which speaks vLLM's format -- and draws it.
#
# **What you will learn**
#
# 1. **the wire**: one real message from pagedlearn's publisher, byte by byte, then as msgspec
#    (the library vLLM itself uses) decodes it;
# 2. **two views of one server**: the pool as the engine holds it (chapter 11's live view) next
#    to the prefix cache as the stream describes it, while chats that share system prompts
#    arrive; the picture built from the stream equals the engine's prefix cache, block by block;
# 3. **the prefix tree** (shared prefixes at a glance, coloured by age) and **the timeline** of
#    stored and removed blocks as the pool fills and evicts;
# 4. **what the stream cannot show**: physical block ids, refcounts, copy-on-write, and which
#    cached blocks are in use -- shown on a request with two samples;
# 5. **a new prompt's hit opportunities**, by tokens and by hash, and why a vLLM server's hashes
#    need its hash algorithm and its `PYTHONHASHSEED`;
# 6. **a recording**: the stream saved to a file and looked at again without a server, from the
#    notebook and from the command line (`python -m pagedlearn kv-events --from FILE`); and at
#    the end, questions to check yourself, answered by the runs above.
#
# **What you need.** A CPU and the `[kv-events]` extra (pyzmq, msgspec: `pip install -e
# ".[kv-events]"`); no network: the server and its sockets listen on `127.0.0.1` only. The
# server runs the offline `tiny-gpt2` (random weights, a byte tokenizer: one token per
# character, so a block's tokens read as 8 characters of the prompt). Its replies are
# gibberish; the blocks, hashes and events are real. About half a minute. The requests are sent
# one after the other, so every count printed is the same on every run; the cells that print
# ports, file names or times are tagged `timing`, and the prose says what to look for in them.

# %%
from pagedlearn.cli.notebook import setup

env = setup()

# %%
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from pathlib import Path

import msgspec
import openai
import torch
from IPython.display import display

from pagedlearn.kv_events.block_hashes import BlockHashError, VLLMHasher, make_hasher
from pagedlearn.kv_events.cache_state import KVCacheState
from pagedlearn.kv_events.from_trace import cached_blocks
from pagedlearn.kv_events.messages import decode_batch
from pagedlearn.kv_events.recording import read_recording
from pagedlearn.kv_events.subscriber import KVEventSubscriber
from pagedlearn.serve import serve
from pagedlearn.viz import (
    KVEventsLiveView,
    LiveBlockView,
    draw_block_pool,
    draw_kv_events_timeline,
    draw_prefix_tree,
)
from pagedlearn.viz.state import replay_states

MODEL, BLOCK_SIZE, NUM_BLOCKS = "tiny-gpt2", 8, 48
torch.set_num_threads(1)  # the tiny model gains nothing from more; the server's threads need them
RECORDING = Path(tempfile.mkdtemp(prefix="pagedlearn-ch13-")) / "kv_events.jsonl"

# %% [markdown]
# ## 1. A server that publishes its cache, and two views of it
#
# `serve(..., kv_events_endpoint=...)` starts chapter 11's server and attaches a **publisher** to
# its engine (`pagedlearn/kv_events/publisher.py`): every engine step that caches or drops blocks
# sends one batch, in vLLM's transport -- a ZeroMQ PUB socket sending `(topic, 8-byte sequence
# number, msgpack payload)`, and a replay socket that answers "every batch from sequence number
# N", for a subscriber that missed some. `tcp://127.0.0.1:*` binds any free port, as vLLM binds
# a wildcard endpoint; `srv.kv_events.endpoint` says which.
#
# The pool is small on purpose: 48 blocks of 8 tokens, so that the trees stay readable and the
# pool fills within a few requests. On the other end a `KVEventSubscriber`
# (`kv_events/subscriber.py`) follows the stream on a thread of its own (it never blocks the
# kernel), asks the replay socket for whatever it missed, and saves every batch to a file
# (`record=`). Two live views then watch the same server:
#
# * `LiveBlockView(srv)`, chapter 11's: the pool as the **engine** holds it (physical blocks,
#   refcounts), following the engine thread's steps;
# * `KVEventsLiveView(sub)`: the prefix cache as **the stream** describes it, the view a router
#   could have. It applies the subscriber's batches to a `KVCacheState`
#   (`kv_events/cache_state.py`: the tree of cached blocks, parent -> child) and draws its prefix
#   tree and timeline, at most twice a second.

# %%
srv = serve(MODEL, host="127.0.0.1", port=0, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
            verbose=False, kv_events_endpoint="tcp://127.0.0.1:*",
            kv_events_replay_endpoint="tcp://127.0.0.1:*")  # fmt: skip
pub = srv.kv_events
log = srv.call(lambda engine: engine.record())  # the engine's own block trace, for section 5
sub = KVEventSubscriber(pub.endpoint, pub.replay_endpoint, record=RECORDING)
tokenizer = srv.llm.tokenizer
pool_view = LiveBlockView(srv)
stream_view = KVEventsLiveView(sub, tokenizer=tokenizer)
state = stream_view.state  # the stream's picture of the cache, kept up to date by the view
display(pool_view, stream_view)

# %% tags=["timing"]
print(f"events: {pub.endpoint}  replay: {pub.replay_endpoint}")
print(f"the server: {srv.base_url}; the recording: {RECORDING}")

# %% [markdown]
# Requests go in through the `openai` client, one after the other (chapter 11 sent them from
# threads; here every count must be the same on every run). After each, `settle()` waits until
# the stream has caught up: `srv.call` returns between two engine steps, so the last step's
# batch is queued; the publisher has sent everything it accepted; and the view has applied every
# sequence number sent. Only then do we read counts.


# %%
client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)


def complete(prompt, max_tokens=8, **kwargs):
    """One completion, greedy and of a fixed length (ignore_eos): the same blocks every run."""
    return client.completions.create(
        model=srv.model_name, prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True}, **kwargs,
    )  # fmt: skip


def settle(timeout=30.0):
    """Wait until the stream's picture holds every batch the engine made so far."""
    srv.call(lambda engine: None)  # between two steps: the last step's batch is queued
    deadline = time.monotonic() + timeout
    while True:
        st = pub.status()
        if st["published"] == st["accepted"]:  # everything queued was sent
            stream_view.update()  # takes in what the subscriber received
            if state.last_seq == st["published"] - 1:
                break
        if time.monotonic() > deadline:
            raise TimeoutError(f"the stream did not catch up: {st}, {sub.status()}")
        time.sleep(0.005)
    stream_view.update(pairs=[], force=True)  # draw what it holds now


def engine_cache():
    """The engine's prefix cache as the stream names it: wire hash (the low 64 bits, as vLLM
    sends block hashes by default) -> (parent's, None at a prompt's start; tokens)."""
    return srv.call(lambda engine: cached_blocks(engine.kv))


# %% [markdown]
# ## 2. One message, by hand
#
# A first request: `"Hello, KV events!"` is 17 characters, 17 tokens: two full blocks of 8 and
# one token over. Its prefill step caches the two full blocks (a block enters the cache once
# full; chapter 04), and the step's batch goes out. The subscriber's recording keeps the
# payload exactly as it came. Its first bytes are the batch's timestamp, which changes with
# every run: they are shown as `··` below.

# %%
reply = complete("Hello, KV events!", max_tokens=1)
settle()
payload = read_recording(RECORDING).records[0].payload
shown = [f"{b:02x}" for b in payload]
shown[2:10] = ["··"] * 8  # the 8 bytes of the timestamp (a float64)
print(f"{reply.usage.prompt_tokens} prompt tokens; the payload of batch 0, {len(payload)} bytes:")
print(textwrap.fill(" ".join(shown), 72))

# %% [markdown]
# Read it with the msgpack spec at hand (every value says its type in its first byte):
#
# * `93`: an array of 3 -- the batch `[ts, events, data_parallel_rank]`; `cb` then 8 bytes: a
#   float64, the time the batch was made (seconds since the epoch);
# * `91`: an array of 1 event; `8a`: a map of 10 pairs, keys and values in turn: `a4 74 79 70 65`
#   is the 4-byte string `"type"`, `ab 42 6c 6f 63 6b ...` the 11-byte `"BlockStored"` --
#   msgspec's tagged union, the event's class name under `"type"`;
# * `ac "block_hashes"` -> `92 cf ... cf ...`: 2 unsigned 64-bit ints (`cf`, then 8 bytes),
#   one hash per block; `b1 "parent_block_hash"` -> `c0`, nil: the first block of a prompt has
#   no parent;
# * `a9 "token_ids"` -> `dc 00 10` (an array of 16), then the 16 tokens, each a byte of the
#   text as a small positive int: `48 65 6c 6c 6f 2c 20 4b` is `Hello, K`;
# * `aa "block_size"` -> `08`; `lora_id` and `lora_name` nil, `a6 "medium"` -> `a3 "GPU"`,
#   `group_idx` 0, `kv_cache_spec_kind` `"full_attention"`; an unset optional field (vLLM's
#   `extra_keys`, the sliding window) is not written at all (`omit_defaults`);
# * the last byte, `00`: data-parallel rank 0.
#
# That is the shape issue 34 saw from vLLM 0.33's publisher: the batch an array, each event a
# map tagged by `"type"` (older vLLMs sent events as arrays too; `kv_events/messages.py` reads
# both). Here is what msgspec reads from the same bytes, first as plain msgpack, then as the
# typed batch a subscriber works with (`decode_batch`):

# %%
ts, events, rank = msgspec.msgpack.decode(payload)
print(f"plain msgpack:  [<ts>, {events}, {rank}]")
print("decode_batch:  ", decode_batch(payload).events)

# %% [markdown]
# The two hashes are the low 64 bits of pagedlearn's SHA-256 block hashes, the way vLLM sends
# its own by default (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`: `int.from_bytes(digest, "big") &
# (2**64 - 1)`, `maybe_convert_block_hash` in vLLM). The second block's event does not repeat
# its parent: in one `BlockStored` each hash chains on the one before it.
#
# **A fresh start.** An operator can drop the whole prefix cache -- vLLM has `POST
# /reset_prefix_cache` for it, and after new weights it must. pagedlearn's engine does it with
# `reset_prefix_cache()`, here on the engine thread (`srv.call`). The stream says so with the
# third event, which has no fields at all:

# %%
srv.call(lambda engine: engine.reset_prefix_cache())
settle()
cleared = read_recording(RECORDING).records[1].payload
print(f"batch 1, {len(cleared)} bytes: events {msgspec.msgpack.decode(cleared)[1]}")
print(f"the stream's picture now: {len(state.blocks)} blocks; the engine's: {len(engine_cache())}")

# %% [markdown]
# ## 3. Chats that share system prompts, seen both ways
#
# Two assistants, each with its system prompt, three questions each, sent one after the other.
# Each prompt is the system prompt and the question; each reply 8 tokens. A prompt's full blocks
# are cached when they are computed, and the blocks of a later prompt with the same start are
# found in the cache: chapter 04's rule, here seen from outside.

# %%
SYSTEMS = {
    "shop": "You are the assistant of a bicycle shop. Answer briefly and politely. ",
    "code": "You are a coding agent. Read the tool output, then propose the next step. ",
}
QUESTIONS = {
    "shop": ["My chain skips. Why?", "Which tyre pressure?", "My brakes squeak."],
    "code": ["$ pytest: 3 failed", "$ ruff: 2 errors", "$ mypy: ok"],
}
for who, system in SYSTEMS.items():
    for question in QUESTIONS[who]:
        reply = complete(system + question)
        print(f"{who}: {reply.usage.prompt_tokens:>3} prompt tokens, "
              f"{reply.usage.prompt_tokens_details.cached_tokens:>3} found cached")  # fmt: skip
settle()
print(f"\nthe stream's picture: {len(state.blocks)} cached blocks; the engine's prefix cache: "
      f"{len(engine_cache())}; the same blocks, parents and tokens: "
      f"{state.cached_blocks() == engine_cache()}")  # fmt: skip

# %% [markdown]
# The shop's first chat finds nothing: the cache is empty. The coding agent's first finds 8
# tokens, one block -- `You are `, the first 8 characters of *both* system prompts, cached by
# the shop's chats (a block is found by its content, whoever computed it). The later chats find
# their system prompt's full blocks, and one more where their question starts like an earlier
# one. The last line is the point of
# the stream: a subscriber that saw every batch holds the engine's prefix cache exactly, under
# the same hashes, with each block's parent and tokens (`tests/test_kv_events_loadtest.py`
# checks the same after the load test's whole mix).
#
# **The prefix tree.** `draw_prefix_tree` (`pagedlearn/viz/prefix_tree.py`) draws the picture as
# an icicle: column `j` holds the blocks that are the `j`-th block of their prompt, and a block
# is as tall as the cached continuations below it. A tall box on the left is a prefix that many
# prompts share; where a band splits, the prompts part. Colour is age: dark blocks were stored
# first. The byte tokenizer makes each block's label its 8 characters; the last columns hold the
# replies, random bytes of the random model, many of them not printable (`�`).

# %%
draw_prefix_tree(state, tokenizer=tokenizer, title="two system prompts, three questions each")

# %%
print("\n".join(state.summary(top=3).lines(tokenizer, hashes_note=False)[1:]))

# %% [markdown]
# Both system prompts begin with the 8 characters `You are `, so all six prompts share their
# **first block**: one root, which splits at block 1 into the shop's band and the coding
# agent's. Each band splits again where its questions begin. The coding agent's system prompt
# is 74 characters, 9 full blocks and 2 characters over, so block 9 (`. $ pyte`, `. $ ruff`,
# `. $ mypy`) is where its three chats part. The shop's is 70 characters, 8 full blocks and 6
# over: block 8 is `tely. My` for two questions and `tely. Wh` for the third, so the band
# splits in two at block 8 and once more at block 9 -- a block that mixes the end of a system
# prompt and the start of a question is shared only by the questions that start alike. The
# summary lists the branch points (`top shared prefixes`: how many cached continuations share
# the prefix, its length, the hash of its last block, its start).
#
# The two live views of section 1 have followed all of it. Here they are again: the engine's
# pool (each block at its physical place, grey when cached and free) and the stream's tree. The
# pool view knows where every block is and who holds it; the tree knows which prefix every
# block belongs to. Neither picture can be drawn from the other's source.

# %%
display(pool_view, stream_view)

# %% [markdown]
#
# ## 4. A new prompt: how much of it is cached?
#
# A router's question. A new chat for the bicycle shop: its system prompt and a new question.
# `state.hit_opportunities` answers it two ways (`kv_events/cache_summary.py`):
#
# * **by tokens**: walk the tree from the roots with the prompt's tokens, block by block. The
#   events carry every block's tokens, so this needs nothing the stream does not say;
# * **by hash**: compute the prompt's block hashes as the *server* computes them and look them up.
#   `make_hasher("pagedlearn", ...)` computes pagedlearn's (`core/prefix_cache.py`: SHA-256 over
#   the parent's digest, the block's tokens and the extra keys), which include the served model's
#   id -- not in the stream either: `kv.model_id`.

# %%
new = tokenizer.encode(SYSTEMS["shop"] + "Do you sell helmets?")
seq_helmets = state.last_seq + 1  # the first batch of this section (section 7 reads to here)
right = make_hasher("pagedlearn", BLOCK_SIZE, model_id=srv.engine.kv.model_id)
wrong = make_hasher("pagedlearn", BLOCK_SIZE, model_id="gpt2")  # another model's id
report = state.hit_opportunities(new, right)
print("\n".join(report.lines()))
print("\n".join(state.hit_opportunities(new, wrong).lines()))
reply = complete(SYSTEMS["shop"] + "Do you sell helmets?")
print(f"\nthe server, asked: {reply.usage.prompt_tokens_details.cached_tokens} prompt tokens "
      f"found cached (predicted {report.reusable * BLOCK_SIZE})")  # fmt: skip
assert reply.usage.prompt_tokens_details.cached_tokens == report.reusable * BLOCK_SIZE

# %% [markdown]
# With the right model id the hashes find the same 8 blocks as the tokens (the system prompt's
# full blocks; block 8, `tely. Do`, is new); with another
# model's, none: the hash is the model's too, so two models never share KV (chapter 04's extra
# keys). And the server, asked, found exactly what the stream predicted.
#
# **A vLLM server's hashes** are computed differently (`vllm/v1/core/kv_cache_utils.py`,
# `hash_block_tokens`, and the design page *Automatic Prefix Caching* on docs.vllm.ai): a chain
# `H((parent, tokens, extra_keys))` whose `H` is the server's `--prefix-caching-hash-algo`
# (`sha256` over `pickle` by default, or `sha256_cbor`, ...), starting from `NONE_HASH`, which is
# `H(PYTHONHASHSEED)` when the server was started with that variable set and **32 random bytes**
# otherwise. `VLLMHasher` (`kv_events/block_hashes.py`) computes them -- if you know all of it.
# Without the seed it refuses, and says why; with a guessed seed it computes hashes that are
# well formed and match nothing of this server (which is not vLLM):

# %%
try:
    VLLMHasher(BLOCK_SIZE, "sha256")
except BlockHashError as e:
    print(f"BlockHashError: {e}")
guess = VLLMHasher(BLOCK_SIZE, "sha256", python_hash_seed="0")
print("\n".join(state.hit_opportunities(new, guess).lines()))

# %% [markdown]
# `block_hashes.py` lists what the stream alone cannot tell: the algorithm (no event carries
# it), `NONE_HASH` unless the seed is set and known, a new prompt's extra keys (LoRA name,
# images, `cache_salt`), and the full digests (only 64 bits of each reach the wire, so a prompt's
# hashes must be computed from the root). A router written for vLLM gets them from its own
# configuration (Dynamo's KV router, for one, is told the block size and hashes the tokens
# itself). The match by tokens needs none of them, which is why the picture keeps every block's
# tokens.
#
# ## 5. The pool fills: evictions, and the timeline
#
# Two long documents, 160 characters each (20 blocks), summarised one after the other. The
# pool has 48 blocks and most are cached by now: to make room, the engine evicts the least
# recently used cached blocks that no request holds, and the stream says `BlockRemoved` for each.

# %%
removed_before = state.received["blocks_removed"]
evicted_before = srv.call(lambda engine: engine.stats().evictions)
for i in range(2):
    document = f"Document {i}: " + "".join(f"line {j} of document {i}. " for j in range(9))
    complete(document[:160] + "\nSummary:")
settle()
removed = state.received["blocks_removed"] - removed_before
evicted = srv.call(lambda engine: engine.stats().evictions) - evicted_before
print(f"evicted by the engine: {evicted}; BlockRemoved in the stream: {removed}")
print("cached blocks whose parent is not:", sum(b.parent_unseen for b in state.blocks.values()))
print(f"the stream's picture: {len(state.blocks)} blocks; the engine's prefix cache: "
      f"{len(engine_cache())}; the same: {state.cached_blocks() == engine_cache()}")  # fmt: skip

# %%
draw_prefix_tree(state, tokenizer=tokenizer, title="after two long documents: what survived")

# %% [markdown]
# The documents took the least recently used blocks: every chat of section 3 is gone, and of
# the helmet question, the last chat, only the first blocks of the shop's system prompt are
# left. Among blocks freed at the same moment, the engine evicts a prompt's *last* blocks first
# (`pagedlearn/core/kv_cache_manager.py`, "tail first"; the rule of vLLM's prefix-caching RFC,
# vllm-project/vllm#2614: at equal last access, free the longer prefix first). So what survives
# is always whole prefixes, from a prompt's first block on: no cached block lost its parent
# (the count above), and the next shop chat still finds those first blocks. Had a parent been
# evicted before its child, the tree would draw the child as a hatched root, "parent unseen": a
# block no prompt can reach until its parent is cached again.
#
# The **timeline** (`draw_kv_events_timeline`) shows the run so far, batch by batch: blocks
# stored (up) and removed (down) by each batch, the dash-dotted line where the cache was
# cleared, and below, how many blocks the cache held. Its x axis is the batches' own
# timestamps: on another machine the spikes sit elsewhere; their heights are the same.

# %%
draw_kv_events_timeline(state, title="the stream so far: stored, removed, cleared")

# %% [markdown]
# ## 6. What the stream cannot show
#
# The stream is made for routers: it names cached *content*. Everything about *memory* stays
# inside the engine (`kv_events/from_trace.py` lists it): physical block ids, refcounts, which
# request holds a block, copy-on-write, swapping, and blocks allocated but not yet full. A
# request with two samples (`n=2`, seeded) shows the difference. Both samples share the prompt's
# blocks (refcount 2, chapter 03's fork), including its last, partly filled block; when the
# first sample writes its first token there, the engine copies that block (copy-on-write). The
# engine's trace (`log`, recorded since section 1) has all of it; the stream has only what
# was cached (`BlockStored`) and what was evicted to make room (`BlockRemoved`).

# %%
trace_start, seq_start = len(log.events), state.last_seq
n2 = client.completions.create(model=srv.model_name, prompt=SYSTEMS["code"] + "$ pytest: 1 failed",
                          max_tokens=8, n=2, temperature=1.0, seed=0,
                          extra_body={"ignore_eos": True})  # fmt: skip
settle()
n2_prompt = n2.usage.prompt_tokens
engine_saw = Counter(e.kind for e in log.events[trace_start:] if e.kind != "step")
batches = [b for _, b in read_recording(RECORDING).batches()][seq_start + 1 :]
stream_saw = Counter(type(e).__name__ for b in batches for e in b.events)
copies = [e.blocks for e in log.events[trace_start:] if e.kind == "cow_copy"]
print("the engine's trace:", dict(sorted(engine_saw.items())))
print("the stream:        ", dict(sorted(stream_saw.items())))
print("copy-on-write, physical block src -> dst:", ", ".join(f"{s} -> {d}" for s, d in copies))

# %% [markdown]
# The trace says which blocks were allocated, found in the cache, shared by the fork
# (`incref`), copied (`cow_copy`, with the physical ids) and freed; the stream says which blocks
# of content were cached (`BlockStored`) or dropped (`BlockRemoved`, if the request needed room).
# The pool view draws the trace. Here is the pool at the step where the most blocks were shared
# (the hatched blocks, `x2`: held by both samples):

# %%
frames = [f for f in srv.call(lambda engine: replay_states(log)) if f[0] >= trace_start]
busiest = max(range(len(frames)), key=lambda i: (frames[i][1].count("shared"), -i))
pool = frames[busiest][1]
print(f"step {pool.step}: {pool.count('shared')} blocks shared (refcount 2); the stream, "
      "which has no refcounts, shows none of this")  # fmt: skip
draw_block_pool(pool, title=f"n=2 at step {pool.step}: the prompt's blocks shared by two samples")

# %% [markdown]
# And the last difference: **in use or free**. Now that every request has finished, the engine
# holds none of its cached blocks for a request -- they are free, and evictable; during a
# request, some were in use. The stream's picture is the same in both cases: a cached block is
# cached, whoever holds it. A router that needs the load of an engine reads it elsewhere (vLLM's
# `/metrics`, chapter 10: `kv_cache_usage_perc`).

# %%
stats = srv.call(lambda engine: engine.stats())
print(f"the engine: {stats.used_blocks} blocks in use, {stats.cached_blocks} cached and free; "
      f"the stream: {len(state.blocks)} cached blocks")  # fmt: skip

# %% [markdown]
# ## 7. A recording, looked at again without a server
#
# The subscriber has written every batch it delivered to `RECORDING` (`kv_events/recording.py`:
# JSON lines, the payloads as they came, base64), so a reading group can look at a server's
# stream without the server. We stop the server (its publisher sends what is queued and closes),
# the views (they keep their last pictures) and the subscriber (which closes the file).

# %%
srv.stop()
pool_view.close()
stream_view.stop()
sub.close()
log.close()
recording = read_recording(RECORDING)
print(f"published {pub.status()['published']} batches; recorded {len(recording)}; "
      f"malformed {sub.status()['malformed']}, missed {sub.status()['missed']}")  # fmt: skip

# %% [markdown]
# The recording read back into a fresh `KVCacheState` gives the same picture as the live one --
# and, since it holds every batch with its sequence number, any picture *before*: here the
# cache as it was at the end of section 3 (every batch before the helmet question's), drawn
# from the file alone.

# %%
again = KVCacheState()
again.extend(recording.batches())
print(f"replayed: {len(again.blocks)} blocks, the live picture {len(state.blocks)}; the same: "
      f"{set(again.blocks) == set(state.blocks)}")  # fmt: skip
before = KVCacheState()
before.extend((seq, b) for seq, b in recording.batches() if seq < seq_helmets)
draw_prefix_tree(before, tokenizer=tokenizer, title="from the file: the cache after section 3")

# %% [markdown]
# The same from a shell: `python -m pagedlearn kv-events --from FILE` reads a recording and
# prints a summary (`pagedlearn/cli/kv_events.py`; with `--endpoint tcp://HOST:PORT` it follows
# a live server -- vLLM's too -- and `--record FILE` saves what it sees). `--tokenizer
# pagedlearn/byte` decodes the prefixes shown; `--tokens` with `--hash-algo` asks the hit
# question of section 4. The file's name and the span in seconds change with every run:

# %% tags=["timing"]
command = [sys.executable, "-m", "pagedlearn", "kv-events", "--from", str(RECORDING),
           "--tokenizer", "pagedlearn/byte", "--top", "3"]  # fmt: skip
done = subprocess.run(command, capture_output=True, text=True, timeout=120)
print("$ python -m pagedlearn kv-events --from", RECORDING.name, "--tokenizer pagedlearn/byte "
      "--top 3")  # fmt: skip
print(done.stdout + done.stderr)

# %%
cli_lines = done.stdout.splitlines()
ours = again.summary(top=3).lines(tokenizer)
print(f"exit code {done.returncode}; the command's summary is the notebook's, line for line "
      f"after the first: {cli_lines[2:] == ours[1:]}")  # fmt: skip
assert done.returncode == 0 and cli_lines[2:] == ours[1:]

# %% [markdown]
# ## Check yourself
#
# Answer each question before you run the cell below: write your answers into `my_answers`
# (`None` skips one). The cell checks them against the runs above, and checks the rule behind
# each answer too.
#
# 1. Section 2's prompt has 17 tokens and the block size is 8. How many hashes does its
#    `BlockStored` carry?
# 2. In section 3, how many roots does the stream's tree have -- how many different first
#    blocks are cached?
# 3. Section 6's request has a 92-token prompt and two samples. How many blocks did the two
#    samples share (refcount 2) at the busiest step, before either wrote into the last one?

# %%
my_answers = [None, None, None]  # your answers to questions 1-3, then run the cell

first_batch = decode_batch(recording.records[0].payload)
rules = [  # only full blocks are cached; shared first blocks are one root; CoW is not content
    len(tokenizer.encode("Hello, KV events!")) // BLOCK_SIZE,
    len(
        {
            tuple(tokenizer.encode(SYSTEMS[who] + q)[:BLOCK_SIZE])
            for who in SYSTEMS
            for q in QUESTIONS[who]
        }
    ),
    -(-n2_prompt // BLOCK_SIZE),  # every block of the prompt, the partly filled last one too
]
seen = [len(first_batch.events[0].block_hashes), before.summary(top=0).roots,
        pool.count("shared")]  # fmt: skip
for q, (rule, got, mine) in enumerate(zip(rules, seen, my_answers, strict=True), start=1):
    assert got == rule, f"question {q}: the run gave {got}, the rule {rule}"
    verdict = "" if mine is None else ("  right" if mine == got else f"  (you said {mine})")
    print(f"question {q}: {got}{verdict}")
print(f"(and the stream mentioned none of the {len(copies)} copies: "
      f"{sum(stream_saw.values())} events, all BlockStored / BlockRemoved)")  # fmt: skip

# %% [markdown]
# ## Exercises
#
# 1. **A late subscriber.** Start a second `KVEventSubscriber` after section 3, once without
#    `replay_endpoint` and once with it. What does each one's picture hold after section 5, and
#    what do their `status()["problems"]` and the tree's hatched roots say?
# 2. **Tenants.** Send section 3's chats again with `extra_body={"cache_salt": "user-1", ...}`.
#    Which blocks does the tree show twice, and what does `hit_opportunities` say for a prompt
#    of the salted tenant by tokens, and by hash (`make_hasher("pagedlearn", ..., cache_salt=
#    "user-1")`)?
# 3. **A real vLLM.** On a machine with vLLM, start `vllm serve` with `--kv-events-config
#    '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
#    "replay_endpoint": "tcp://*:5558"}'` and `PYTHONHASHSEED=0`, and follow it with
#    `python -m pagedlearn kv-events --endpoint tcp://127.0.0.1:5557 --record run.jsonl`. Send a
#    prompt twice; then ask `--from run.jsonl --tokens ... --hash-algo sha256
#    --python-hash-seed 0` how much of it is cached. Do the hash and token counts agree?
