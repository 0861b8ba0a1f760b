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
# # 06 · Watching GPT-2 and OPT serve a mixed stream
#
# **What you will learn**
#
# - what continuous batching looks like in the KV block pool, step by step, while a real model
#   (GPT-2, then OPT) serves a mixed stream of requests: blocks filling slot by slot, forked
#   samples and beams sharing blocks, copy-on-write, prefix-cache hits on a shared system
#   prompt, preemption when the pool runs out, and a cancelled request giving its blocks back;
# - how to drive the live view (`LiveBlockView`) from code, and where in a run to look for each
#   of those events;
# - how to record a run (`engine.record()`), save it as JSON and replay it (`ReplayView`) --
#   the file a lab hands out, so that everyone looks at the same run.
#
# **What you need.** Nothing special: on a CPU without network this chapter runs the offline
# tiny models (`tiny-gpt2`, `tiny-opt`: random weights, a byte-level tokenizer) in well under a
# minute; the first cell says so. Their text is gibberish, but the blocks, block tables and
# numbers are real: the same engine, scheduler and allocator serve them. With a GPU, or with
# network (or a local Hugging Face cache) for `gpt2` and `facebook/opt-125m`, the same cells run
# the real models, and the outputs read as English. The live view needs `ipywidgets`; the Play
# button needs a running Jupyter kernel (in a static copy of this notebook, look at the pictures
# drawn from the recording further down).

# %%
from pagedlearn.notebook import setup

env = setup()

# %% [markdown]
# ## The stream
#
# We serve the project's mixed batch (`pagedlearn.demo.requests()`, what `make demo` runs):
#
# - `chat-1` and `chat-2`: two chats that start with the same system prompt;
# - `short` (a few tokens) and `long` (a document of a few hundred bytes);
# - `cancel`: a request for a long story that we cancel after a few steps;
# - `n=3`: one prompt, three sampled continuations (parallel sampling: forked sequences);
# - `beam`: a beam search of width 3.
#
# They do not arrive at once: `chat-1`, `short` and `cancel` come first, the other four a few
# steps later, while the first ones are running -- continuous batching admits newcomers into the
# running batch at any step, instead of waiting for the batch to finish.
# Every request has `ignore_eos=True`, so lengths (and memory pressure) are the same on every
# run.
#
# The pool is sized by `demo.default_num_blocks`: room for the largest request alone, but about
# half of what all of them need together -- so the scheduler will have to preempt.

# %%
from pagedlearn import LLM
from pagedlearn.demo import default_num_blocks, requests
from pagedlearn.models import load

BLOCK_SIZE = 16
stream = requests()
FIRST_WAVE = ("chat-1", "short", "cancel")

gpt2 = load(env.gpt2)
num_blocks = default_num_blocks(gpt2.tokenizer, stream, BLOCK_SIZE)
for name, prompt, p in stream:
    wave = 1 if name in FIRST_WAVE else 2
    print(f"wave {wave}  {name:<7} {len(gpt2.tokenizer.encode(prompt)):>4} prompt tokens, "
          f"max_tokens {p.max_tokens:>3}, sequences {p.n}   {prompt[:40]!r}")  # fmt: skip

llm = LLM(gpt2, block_size=BLOCK_SIZE, num_blocks=num_blocks)  # prints the pool it built

# %% [markdown]
# `LLM(...)` printed the KV cache's size per token -- `2 x layers x KV heads x head_dim x bytes`,
# K and V for every layer -- and how many tokens the pool holds.
#
# ## The live view
#
# `LiveBlockView(llm)` follows the engine: whoever calls `engine.step()`, it redraws after every
# step. Each square is a physical block; a block's colour says which request owns it, its filled
# height how many of its `BLOCK_SIZE` slots hold K/V, a hatched block with `x2`/`x3` is shared by
# that many block tables (its refcount), light grey is *free but cached* (its K/V can still be
# found by its block hash), white is empty. Below the picture: the queues (running, waiting,
# swapped), the counters, the request list with the blocks each holds, and a block inspector
# (click a block).
#
# In Jupyter, press **Play** (the delay slider sets the speed) or **Step**. Here we drive it
# from code with `view.run(max_steps=...)` (and `view.run()` to the end), which is what runs
# when this notebook is executed headless. We also record the run, to look at it afterwards.

# %%
from IPython.display import display

from pagedlearn.viz import LiveBlockView

engine = llm.engine
log = engine.record()  # every block event from now on, with a frame per step
view = LiveBlockView(llm, delay=0.3)
display(view)

# %% [markdown]
# The first wave arrives. Each request's prompt is written into its blocks in one step (its
# prefill), then every step adds one token per request (a decode), filling the last block slot
# by slot until the next block is needed. Once a block is full, its block hash goes into the
# prefix cache -- `chat-1`'s system prompt is now findable.

# %%
finished = []  # the final RequestOutput of every request, as they finish
for name, prompt, p in stream:
    if name in FIRST_WAVE:
        engine.add_request(name, prompt, p)
finished += view.run(max_steps=3)
print(engine.stats().summary())

# %% [markdown]
# The second wave arrives while the first is running. `chat-2` starts with the same system
# prompt as `chat-1`: the full blocks of that prompt are **prefix-cache hits**, shared
# (refcount 2) instead of computed again. `long` takes many blocks at once. A little later `n=3`
# prefills its prompt once and **forks** three sequences that share the prompt's blocks, and
# `beam` does the same with its beams; when one of them writes into a shared, partly filled
# last block, that block is **copied on write** first.

# %%
for name, prompt, p in stream:
    if name not in FIRST_WAVE:
        engine.add_request(name, prompt, p)
finished += view.run(max_steps=2)
shared = [b.block_id for b in view.state.blocks if b.kind == "shared"]
print(f"step {view.state.step}: {len(shared)} shared blocks {shared}")
if shared:
    print(view.inspect(shared[0]))

# %% [markdown]
# A user closes the tab of the `cancel` request. `engine.abort_request` takes it out of its
# queue and frees its blocks at once (its full blocks stay findable in the prefix cache, as
# *cached*, until the pool needs them). The view redraws: the abort is a frame of its own.

# %%
free_before = engine.kv.num_free_blocks
out = engine.abort_request("cancel")
finished.append(out)
print(f"cancel: {out.outputs[0].finish_reason} after {len(out.outputs[0].token_ids)} tokens; "
      f"free blocks {free_before} -> {engine.kv.num_free_blocks}")  # fmt: skip

# %% [markdown]
# Now the rest, to the end. This is where most of the action is (the next section finds the
# step of each):
#
# - `n=3` and `beam` **fork**: their sequences share the prompt's blocks (`x3`), and a write
#   into a shared last block is a **copy-on-write**;
# - the pool is too small for everything that is running: when a running request needs a block
#   and none is free, the scheduler **preempts** the most recently arrived request (recompute:
#   its blocks are freed and it goes back to waiting; when it comes back, the prefix cache often
#   still holds its full blocks, so it does not compute them again);
# - free but cached blocks are **evicted** (least recently used first) when new data needs
#   room -- a light-grey block turns into someone's colour.

# %%
finished += view.run()
print(engine.stats().summary())
engine.kv.check_invariants()

# %% [markdown]
# ## Where to look
#
# The recording holds every block event and one frame per step (the abort added one more), so
# we can find when each thing first happened: the frames to scrub to in a replay (or the steps
# to step to live). The names on the right are sequences, `<request>.<i>`.

# %%
from pagedlearn.viz import replay_states

WATCH = {
    "allocate": "blocks allocated",
    "cache_store": "a full block's hash enters the prefix cache",
    "cache_hit": "prefix-cache hit: a prompt reuses cached blocks",
    "incref": "fork: a sequence shares all its blocks with a new one",
    "cow_copy": "copy-on-write of a shared last block",
    "preempt": "preemption",
    "evict": "a cached block evicted for new data",
}
frames = replay_states(log)  # (event index, PoolState) per frame
first, frame = {}, 0
for e in log.events:
    if e.kind == "step":
        frame += 1
    elif e.kind in WATCH and e.kind not in first:
        first[e.kind] = (frame, e)
for kind, (f, e) in sorted(first.items(), key=lambda kv: kv[1][0]):
    who = ", ".join(map(str, e.seqs))
    print(f"frame {f:>3} (step {frames[f][1].step:>3}): {WATCH[kind]:<52} {who}")
print(f"{len(frames)} frames, {len(log.events)} events")

# %% [markdown]
# Two frames, drawn from the recording: the moment the pool held the most requests at once
# (the busiest batch), and the frame of the first preemption.

# %%
from pagedlearn.viz import draw_block_pool


def requests_in_pool(state):
    return len({state.group_of(s) for s in state.tables})


busiest = max(range(len(frames)), key=lambda i: (requests_in_pool(frames[i][1]),
                                                 frames[i][1].count("shared")))  # fmt: skip
state = frames[busiest][1]
draw_block_pool(state, title=f"frame {busiest}: {requests_in_pool(state)} requests in the pool, "
                f"{state.count('shared')} blocks shared")  # fmt: skip

# %%
if "preempt" in first:
    f, e = first["preempt"]
    state = frames[f][1]
    title = f"frame {f}: request {state.group_of(e.seqs[0])} preempted ({e.info['mode']})"
    display(draw_block_pool(state, title=title))
else:
    print("no preemption in this run: try a smaller num_blocks")

# %% [markdown]
# ## What the model wrote
#
# The final output of every request (`cancel` stopped with finish reason "abort"; the others
# ran to `max_tokens`, "length").

# %%
order = [name for name, _, _ in stream]
for out in sorted(finished, key=lambda o: order.index(o.request_id)):
    for c in out.outputs:
        tag = f"{out.request_id}[{c.index}]" if len(out.outputs) > 1 else out.request_id
        print(f"{tag:<9} {c.finish_reason:<6} {len(c.token_ids):>3} tokens: {c.text[:60]!r}")
    if out.num_cached_tokens:
        print(f"{'':<9} ({out.num_cached_tokens} prompt tokens came from the prefix cache)")
if llm.model_name.startswith("tiny"):
    print("\ntiny-gpt2 has random weights and a byte-level tokenizer: each token is a byte that "
          "random weights picked, so the text is gibberish (often not even valid UTF-8). The "
          "memory behaviour above does not depend on the weights.")  # fmt: skip

# %% [markdown]
# ## The same on OPT, recorded for a lab
#
# OPT has a different architecture (learned positions with an offset, a different attention
# module), but pagedlearn plugs the same paged attention into it: `env.opt` is
# `facebook/opt-125m`, or `tiny-opt` offline. This time all seven requests arrive at once, and
# we cancel `cancel` after a few steps. The recording (`engine.record()` before the first
# step) is what we save.

# %%
opt = load(env.opt)
llm_opt = LLM(opt, block_size=BLOCK_SIZE, num_blocks=default_num_blocks(opt.tokenizer, stream,
                                                                        BLOCK_SIZE))  # fmt: skip
opt_log = llm_opt.engine.record()
opt_view = LiveBlockView(llm_opt, delay=0.3)
display(opt_view)
for name, prompt, p in stream:
    llm_opt.engine.add_request(name, prompt, p)
opt_finished = opt_view.run(max_steps=6)
opt_finished.append(llm_opt.engine.abort_request("cancel"))
opt_finished += opt_view.run()
print(llm_opt.engine.stats().summary())
for out in opt_finished:
    print(f"{out.request_id:<7} {out.outputs[0].finish_reason:<6} {out.outputs[0].text[:50]!r}")

# %% [markdown]
# ## Hand this JSON to a lab
#
# `log.to_json()` is the whole run: every block event plus a frame per step (token counts, the
# requests in each queue, the stats). No model and no GPU are needed to replay it:
# `ReplayView(path)` (or `EventLog.from_json(text)`) rebuilds every frame -- exactly the states
# the live view showed (the tests check that they are equal). Move the slider, or press play.

# %%
import tempfile
from pathlib import Path

from pagedlearn.viz import ReplayView

path = Path(tempfile.gettempdir()) / "pagedlearn_opt_run.json"
path.write_text(opt_log.to_json(), encoding="utf-8")
print(f"{path}: {path.stat().st_size / 1024:.0f} KiB, {len(opt_log.events)} events")

replay = ReplayView(path, tokenizer=llm_opt.tokenizer)
print(f"{replay.num_frames} frames")
display(replay)

# %% [markdown]
# From code, `replay.show(frame)` jumps to a frame, and `replay.state` / `replay.inspect(block)`
# read it. Here: the frame with the most shared blocks, and what its first shared block holds.

# %%
most = max(range(replay.num_frames), key=lambda i: replay.frames[i].count("shared"))
replay.show(most)
shared = [b.block_id for b in replay.state.blocks if b.kind == "shared"]
print(f"frame {most} (step {replay.state.step}): shared blocks {shared}")
print(replay.inspect(shared[0]) if shared else "no shared block")
draw_block_pool(replay.state, title=f"OPT run, replayed from JSON: frame {most}")

# %% [markdown]
# ## Exercises
#
# 1. Make the pool bigger (`num_blocks = 2 * num_blocks`) and run again: does anything get
#    preempted? Then make it as small as `add_request` allows: what happens to `long`?
# 2. Set `enable_prefix_caching=False` in `LLM(...)`. Which frames in "Where to look" disappear,
#    and how many blocks does `chat-2` take now?
# 3. Rerun with `preemption_mode="swap"`: find the `swapped` queue in the view, and the
#    requests that hold blocks "on CPU".
# 4. Save the GPT-2 run's `log` as JSON too and give it to a neighbour: open it with
#    `ReplayView(path)` and find the frame where `chat-2` hit `chat-1`'s system prompt.
