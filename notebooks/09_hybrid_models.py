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
# # 09 · Hybrid models: sliding windows, KV-cache groups, and capacity
#
# **Why this chapter.** Chapters 01-08 served GPT-2 and OPT, where every layer attends to every
# earlier token ("full" attention), so one block table per sequence serves every layer and every
# token costs the same bytes for as long as the sequence lives. Many newer decoders mix in
# **sliding-window** layers, which look back only a fixed number of tokens: Mistral-7B-v0.1 does
# so in every layer (window 4,096), Gemma 3 has five sliding layers to one full, Gemma 2 and
# gpt-oss alternate them (transformers' configuration files, summarised in the docstring of
# `pagedlearn/models/layer_windows.py`). A sliding layer never reads a key again once the window
# has passed it, so its blocks can go back to the pool while the sequence is still generating.
# vLLM's hybrid KV-cache manager exploits that; pagedlearn does the same, small. The lesson to
# take away: "same block size, same capacity" stops being true the moment the architecture
# changes -- measure again.
#
# **What you will learn**
#
# 1. the window rule -- the query at position `p` sees the keys at `p - W < pos <= p` -- and why
#    a sliding-window layer holds at most `ceil(W / block_size) + 1` blocks per sequence, watched
#    on a `SlidingWindowManager` driven by hand; and that attention never reads a freed entry;
# 2. **KV-cache groups**: which layers share block tables, vLLM's rule that makes every block the
#    same size (and its padding), and why all groups draw from one shared pool;
# 3. a Mistral-style and a Gemma-3-style model generating on the engine: token for token what
#    transformers' `generate()` gives, the blocks of each group step by step, the live view;
# 4. tokens held per GiB for GPT-2, the tiny models and the real Mistral-7B and Gemma 3 configs:
#    the same block size, very different capacities -- computed, then measured on the engine;
# 5. what prefix caching can and cannot reuse under a window;
# 6. and at the end, questions to check yourself, answered by the runs above.
#
# **What you need.** A CPU; no network. The models that run are the offline `tiny-mistral`
# (2 layers, both sliding) and `tiny-gemma3` (4 layers: sliding, full, sliding, full), with a
# window of 24 tokens, random weights and a byte tokenizer (one token per byte: the text is
# gibberish, the blocks and numbers are real). The real models appear only as configs on
# PyTorch's *meta* device: shapes without weights, built offline.

# %%
from pagedlearn.cli.notebook import setup

env = setup()

# %%
import math
from collections import Counter

import torch
from IPython.display import display
from matplotlib.figure import Figure

from pagedlearn import LLM, KVCacheManager, SamplingParams
from pagedlearn.attention import contiguous_attention, paged_attention_ref, write_kv_ref
from pagedlearn.attention.inputs import first_visible_key
from pagedlearn.core.prefix_cache import hash_blocks, make_extra_keys, parent_hash
from pagedlearn.hybrid.kv_cache_coordinator import KVCacheCoordinator
from pagedlearn.hybrid.kv_cache_groups import group_layers, layers_per_block, sliding_blocks_held
from pagedlearn.hybrid.sliding_window_manager import SlidingWindowManager
from pagedlearn.models import load
from pagedlearn.models.layer_windows import layer_windows
from pagedlearn.models.reference_configs import meta_model, reference_configs
from pagedlearn.models.runner import kv_cache_spec, max_model_len
from pagedlearn.viz import LiveBlockView, draw_block_tables

# %% [markdown]
# ## 1. Why a sliding window frees blocks
#
# In a layer with sliding window `W`, the query at position `p` attends to the keys at positions
# `p - W < pos <= p`: `W` keys, itself included. That is transformers' rule (its mask keeps
# `kv_idx > q_idx - sliding_window`; see `layer_windows.py`), and the one every attention
# function in pagedlearn follows when given `sliding_window=W`. With `W = 6` and blocks of 4
# tokens:

# %%
W, BS = 6, 4
for p in (0, 3, 5, 6, 9, 13, 20):
    first = first_visible_key(p, W)  # max(0, p - W + 1)
    print(f"query at {p:>2} sees keys {first:>2}..{p:<2} ({p - first + 1} keys), "
          f"in blocks {first // BS}..{p // BS}")  # fmt: skip

# %% [markdown]
# Queries only move forward. Once the next token to compute is at position `n`, no query will
# ever again see a key at position `<= n - W`; a block whose *last* position is that old is dead
# and can go back to the pool. Before planning a sequence's next tokens, the scheduler calls
# `remove_skipped_blocks(seq, n)` (pagedlearn/engine/scheduler.py; vLLM's method of the same
# name in `vllm/v1/core/single_type_kv_cache_manager.py` frees the same blocks). The table entry
# becomes `-1` (a null block): logical block `j` still covers positions `j * BS ..`, so positions
# keep their places, and the table's head turns into a run of `-1`.
#
# Below, a `SlidingWindowManager` and a full-attention `KVCacheManager` get the same 5-token
# prompt and then 20 tokens, one at a time, as a decode would (free what the window left, then
# append). After every token we check the manager against `sliding_blocks_held(n, W, BS)`, the
# closed form in `kv_cache_groups.py`.

# %%
sliding = SlidingWindowManager(num_blocks=16, block_size=BS, sliding_window=W)
full = KVCacheManager(num_blocks=16, block_size=BS)
for kv in (sliding, full):
    kv.add_sequence("s", list(range(100, 105)))  # a 5-token prompt
bound = math.ceil(W / BS) + 1
peak = 0
print(
    f"{'next pos':>8} {'freed':>5}  {'sliding-window table':<28} {'held':>4}  full-attention table"
)
for t in range(20):
    n = sliding.num_tokens("s")  # the token appended now goes at position n
    freed = sliding.remove_skipped_blocks("s", n)
    full.remove_skipped_blocks("s", n)  # full attention: a no-op
    for kv in (sliding, full):
        kv.append_token("s", 200 + t)
    table = sliding.block_table("s")
    held = sum(b >= 0 for b in table)
    assert held == sliding_blocks_held(n + 1, W, BS)  # the closed form agrees with the manager
    peak = max(peak, held)
    print(f"{n:>8} {freed:>5}  {table!s:<28} {held:>4}  {full.block_table('s')}")
print(f"\nsliding window: at most {peak} blocks held; the bound ceil(W / BS) + 1 = {bound}")
print(f"full attention: {len(full.block_table('s'))} blocks, one more every {BS} tokens")
print("blocks the window handed back:", sliding.stats()["window_freed_blocks"])

# %% [markdown]
# Read the `freed` column: the first block goes when the token at position 9 is appended (its
# query sees keys 4..9, and block 0 ends at position 3 = 9 - W), then one more every 4 tokens.
# The sliding table keeps growing in *length* (positions keep their logical blocks), but never
# holds more than 3 live blocks: `W` consecutive positions touch at most `ceil(W / BS) + 1`
# blocks (the first and the last only partly inside the window). The full-attention table holds
# every block, for as long as the sequence lives.
#
# **Freed entries are never read.** A `-1` cannot be dereferenced safely -- in PyTorch,
# `key_cache[-1]` would quietly read the *last* block of the pool -- so the attention functions
# must not even look at it. A check you can run: write this sequence's K/V into a pool that is
# NaN everywhere else, through its slot mapping (a freed position's slot is `-1`: its K/V is not
# written at all), and compare the paged reference with plain attention over all positions.

# %%
n, table = sliding.num_tokens("s"), sliding.block_table("s")
slots = torch.tensor(sliding.slot_mapping("s"))  # (n,): -1 where the window freed the block
torch.manual_seed(0)
keys, values = torch.randn(n, 2, 8), torch.randn(n, 2, 8)  # (n, num_kv_heads, head_dim)
key_cache = torch.full((16, BS, 2, 8), float("nan"))  # (num_blocks, block_size, heads, dim)
value_cache = key_cache.clone()
write_kv_ref(keys, values, key_cache, value_cache, slots)  # slot -1: skipped
q = torch.randn(1, 4, 8)  # the newest token's query (position n - 1): 4 heads, GQA over 2
tables, lens = torch.tensor([table]), torch.tensor([n])
paged = paged_attention_ref(q, key_cache, value_cache, tables, lens, sliding_window=W)
dense = contiguous_attention(q, keys, values, sliding_window=W)  # every key in one tensor
print(f"positions whose K/V is in the pool: {int((slots >= 0).sum())} of {n}; the rest is NaN")
print("table:", table)
print("paged result finite:", bool(paged.isfinite().all()),
      "| equal to dense attention:", torch.allclose(paged, dense, atol=1e-6))  # fmt: skip

# %% [markdown]
# The paged reference starts at the block that holds the window's first key
# (`first_visible_key(n - 1, W) // BS`) and reads nothing before it. The Triton decode kernel
# (`kernels/decode_attention.py`) starts its loop there too: under a window the decode kernel
# never loads the blocks before it (`benchmarks/bench_sliding_window.py` counts the blocks it
# reads).
#
# ## 2. KV-cache groups: whose blocks are whose
#
# A model that mixes kinds cannot keep one block table per sequence: its full layers need every
# block, its sliding layers only the last few. So layers are put in **KV-cache groups**, one per
# attention kind, each with its own block tables (`kv_cache_groups.py`; vLLM:
# `_get_kv_cache_groups_uniform_page_size` in `vllm/v1/core/kv_cache_utils.py`).
#
# All groups draw from **one shared pool**, so a block must have the same size in every group.
# A block holds `block_size` tokens of K/V for one group's layers, so (the layers here all having
# the same KV heads and head size) every group must have the same number of layers. The rule for
# that number, in `group_layers`: the group size is the smallest number of layers of one kind, or
# the largest when it is below 1.25 times the smallest (fewer groups for a little padding); a kind
# of `n` layers gets `ceil(n / size)` groups, its layers dealt out round-robin
# (`layers[i::num_groups]`), and a group with fewer layers than the group size leaves unused
# **padding** layer slots in every one of its blocks. That is vLLM's
# `_get_kv_cache_groups_uniform_page_size` as of late 2025, and the rule has moved: the version
# that introduced hybrid groups (mid-2025, "FIXME(Chen) ... 2025-06-02" in its comment) took the
# smallest count and no threshold, and cut each kind into contiguous slices; the round-robin deal
# (it balances pipeline-parallel stages) and the `max_num_layers < min_num_layers * 1.25` case
# came later (its comment: "gpt-oss-20b + eagle, with 12 sw + 13 full"; vLLM PR #29303, "Better
# layer padding strategy for gpt-oss eagle"); current vLLM compares with `* 1.5`, to leave room
# for speculative-decoding drafters that add layers to one kind. The two thresholds differ only
# when the largest count is 1.25 to 1.5 times the smallest, which none of the models below is.
# Here are the groups of the two tiny models and of three real configs (their layer windows read
# from transformers' config classes by `layer_windows`):

# %%
configs = reference_configs()  # hub name -> config, built offline
windows = {name: layer_windows(load(name).model.config) for name in ("tiny-mistral", "tiny-gemma3")}
for name in ("mistralai/Mistral-7B-v0.1", "google/gemma-3-1b-it", "google/gemma-3-4b-it"):
    windows[name] = layer_windows(configs[name])
for name, per_layer in windows.items():
    kinds = Counter("full" if w is None else f"sliding {w}" for w in per_layer)
    groups = group_layers(per_layer)
    size = layers_per_block(groups)
    padding = size * len(groups) - len(per_layer)
    print(f"{name}: {len(per_layer)} layers ({', '.join(f'{c} {k}' for k, c in kinds.items())})")
    print(f"    {len(groups)} group(s) of {size} layer slots: "
          + ", ".join(f"{g.name} {len(g.layer_ids)}" for g in groups)
          + f"; padding: {padding} of {size * len(groups)} layer slots")  # fmt: skip
print(
    "\ntiny-gemma3's groups:", [(g.name, g.layer_ids) for g in group_layers(windows["tiny-gemma3"])]
)

# %% [markdown]
# Gemma-3-1B has 4 full layers and 22 sliding ones: groups of 4, so 1 full group and 6 sliding
# groups: four of 4 layers and two of 3, each of those two with 1 padding slot in every one of its
# blocks, 2 slots in all. vLLM logs a warning when it adds padding layers ("Add N padding layers,
# may waste at most ...% KV cache memory"). Hybrid models such as Gemma 3 follow an `n : 1` pattern
# (five sliding layers to one full), for which the smallest count is the natural group size.
#
# Why one pool, and not one per kind? How many blocks each kind needs depends on the traffic:
# long prompts fill the full group's tables, while a sliding group holds a few blocks per
# sequence whatever its length. A fixed split would leave one pool idle while the other runs dry
# (the reasoning of `kv_cache_groups.py`'s docstring; vLLM's hybrid KV-cache manager shares one
# pool the same way).
#
# What "one pool" means in memory: the KV slab is `(2, layers_per_block, num_blocks, block_size,
# num_kv_heads, head_dim)` (`kv_cache.py`), and layer `layer_ids[j]` of *every* group reads layer
# slot `j`. In tiny-gemma3, layer 0 (sliding) and layer 1 (full) read the very same tensor; the
# block tables keep them apart, since the allocator hands each block to one group at a time.

# %%
gemma = LLM("tiny-gemma3", block_size=BS, num_blocks=24, verbose=False)
cache = gemma.engine.kv_cache
print("slab:", tuple(cache.slab.shape), "= (K/V, layer slots, blocks, block_size, kv heads, dim)")
for layer in range(4):
    group = cache.groups[cache.group_of(layer)]
    print(f"layer {layer}: group {group.name!r:13} layer slot {group.layer_ids.index(layer)}")
same = cache.key_cache(0).data_ptr() == cache.key_cache(1).data_ptr()
print("layers 0 and 1 read the same key tensor:", same)
print(type(gemma.engine.kv).__name__, "with managers:",
      [type(m).__name__ for m in gemma.engine.kv.managers])  # fmt: skip

# %% [markdown]
# The engine's block bookkeeping for such a model is a `KVCacheCoordinator`
# (`kv_cache_coordinator.py`; vLLM: `HybridKVCacheCoordinator` in
# `vllm/v1/core/kv_cache_coordinator.py`): one manager per group over one allocator, all or
# nothing across groups. Driven by hand, with a window of 8 tokens and two sequences, 14 and 7
# tokens long, before their next token:

# %%
kv = KVCacheCoordinator(group_layers([8, None]), num_blocks=16, block_size=BS)
kv.add_sequence("a", list(range(14)))
kv.add_sequence("b", list(range(50, 57)))
for seq in ("a", "b"):
    print(f"{seq}: freed {kv.remove_skipped_blocks(seq, kv.num_tokens(seq))}, "
          f"tables (full, sliding 8) {kv.block_tables(seq)}")  # fmt: skip
print("blocks held per group:", kv.stats()["groups"], "| free:", kv.num_free_blocks)
draw_block_tables(kv, title="two sequences, two KV-cache groups, one pool")

# %% [markdown]
# Each sequence has one table per group (the rows on the left); the pool on the right tags every
# block with its group (F, S). Sequence `a`'s query at position 14 sees keys 7..14, so its
# sliding table gave block 0 back (the crossed entry); `b` is still inside its window. Both
# groups' blocks come from the same pool, in the order they were allocated, and block 4, freed by
# `a`'s window, is free for either group.
#
# ## 3. A Mistral-style and a Gemma-3-style model, generating
#
# Now the engine. `LLM("tiny-mistral")` and `LLM("tiny-gemma3")` build their KV-cache groups from
# the model's config, and every attention layer calls pagedlearn's paged attention with its
# group's window (checked against the `sliding_window` transformers passes it:
# `pagedlearn/models/paged_attention.py`). First the check that matters most: greedy decoding
# gives exactly the tokens of transformers' own `generate()`, which applies the window through
# its own cache (`tests/test_hybrid_models.py` checks that it equals a full recomputation, and
# that removing the window changes the tokens). The prompts are longer than the window of 24
# tokens, so a window applied wrongly, or a block freed too early, would change the logits.

# %%
TEXTS = [
    "The quick brown fox jumps over the lazy dog, twice over.",  # 56 tokens (bytes)
    "Gemma 3 mixes five sliding layers with one full layer, repeatedly.",  # 66
]
greedy = SamplingParams(max_tokens=32)  # temperature 0: greedy, stopping at EOS
for name in ("tiny-mistral", "tiny-gemma3"):
    llm = LLM(name, block_size=BS, num_blocks=64, verbose=False)
    outs = llm.generate(TEXTS, greedy, use_tqdm=False)
    hf = load(name).model  # a fresh copy, with transformers' own attention and cache
    for text, out in zip(TEXTS, outs, strict=True):
        ids = llm.tokenizer.encode(text)
        x = torch.tensor([ids])
        ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=32,
                          do_sample=False, eos_token_id=hf.config.eos_token_id,
                          pad_token_id=hf.config.pad_token_id)[0, len(ids):].tolist()  # fmt: skip
        mine = out.outputs[0].token_ids
        print(f"{name:12} prompt {len(ids)} tokens: {len(mine)} generated, "
              f"identical to transformers: {mine == ref}")  # fmt: skip
    print(f"{'':12} {llm.engine.stats().summary().splitlines()[-1].strip()}")

# %% [markdown]
# Under each model, the last line of `llm.engine.stats().summary()` after its two requests:
# *blocks held* is what each group holds now -- 0 in every group, since both requests have
# finished and given all back (tiny-mistral has only a sliding group, tiny-gemma3 a full one
# too); *freed by sliding windows* counts, over the whole run, the blocks a window handed back
# while a request was still running (`remove_skipped_blocks`): blocks the full-attention
# bookkeeping of chapters 01-08 would have held until the end. With blocks of 4 tokens and a
# window of 24, a request of `n` tokens ends holding about 7 of its `ceil(n / 4)` blocks in a
# sliding group, so the two requests free about `ceil(n / 4) - 7` each: 33 in all for
# tiny-mistral, one fewer for tiny-gemma3, whose second request stopped at EOS after 29 tokens.
#
# Now one long generation on tiny-gemma3, with the blocks each group holds after every step
# (`StepStats.group_blocks`). `ignore_eos=True` makes it run its full 120 tokens.

# %%
gemma = LLM("tiny-gemma3", block_size=BS, num_blocks=64, verbose=False)
per_step = []
gemma.engine.subscribe_stats(per_step.append)  # a StepStats after every step
gemma.generate(TEXTS[:1], SamplingParams(max_tokens=120, ignore_eos=True), use_tqdm=False)
names = list(per_step[0].group_blocks)
window = gemma.engine.kv_cache.groups[1].sliding_window
print(
    f"{'step':>4} {'tokens':>6}  " + "  ".join(f"{g:>10}" for g in names) + "  freed by the window"
)
for s in per_step[:3] + per_step[9:-1:20] + per_step[-2:]:
    tokens = len(TEXTS[0]) + s.step - 1  # tokens with K/V after step s
    print(f"{s.step:>4} {tokens:>6}  " + "  ".join(f"{s.group_blocks[g]:>10}" for g in names)
          + f"  {s.window_freed_blocks:>6}")  # fmt: skip
peak = max(s.group_blocks["sliding 24"] for s in per_step[1:])  # after the prefill step
print(f"\nsliding group, after the prefill: at most {peak} blocks "
      f"(bound ceil({window} / {BS}) + 1 = {math.ceil(window / BS) + 1})")  # fmt: skip
decode_held = Counter(s.group_blocks["sliding 24"] for s in per_step[1:-1])  # the decode steps
print("sliding group, blocks held: number of decode steps", dict(sorted(decode_held.items())))

fig = Figure(figsize=(7, 3))
ax = fig.subplots()
steps = [s.step for s in per_step]
for g in names:
    ax.plot(steps, [s.group_blocks[g] for s in per_step], label=f"group {g}")
ax.axhline(math.ceil(window / BS) + 1, color="grey", ls=":", label="ceil(W / block_size) + 1")
ax.set(xlabel="step", ylabel="blocks held", title="tiny-gemma3, one sequence, blocks of 4")
ax.legend()
display(fig)

# %% [markdown]
# The full group grows by one block every 4 tokens, for as long as the sequence runs. The
# sliding group holds all 14 prompt blocks in the prefill step -- the prompt's queries read them
# all -- then gives 8 of them back before the first decode, and from then on stays at 6 or 7
# (the count under the table): the 24 keys in the window fill exactly 6 blocks when the oldest
# of them starts a block, and touch 7 otherwise, so three decode steps in four hold 7. The
# table's rows, 20 steps apart, happen to fall on 7s. The group frees one block for each one it
# takes. In the last step the request finishes, and both groups give everything back (0 and 0).
#
# **The live view.** `LiveBlockView` follows the engine as in chapter 06, and draws each block
# with its group's tag. Two requests on a pool of 64 blocks of tiny-gemma3: watch the sliding
# group's blocks turn light grey (free, but still cached) while the full group's keep
# accumulating.

# %%
live = LLM("tiny-gemma3", block_size=BS, num_blocks=64, verbose=False)
view = LiveBlockView(live, delay=0.3)
display(view)
for i, text in enumerate(TEXTS):
    live.engine.add_request(f"r{i}", text, SamplingParams(max_tokens=12, ignore_eos=True))
view.run(max_steps=4)
print(live.engine.stats().summary())

# %% [markdown]
# The block tables of the same moment: each request has a row per group, and the sliding rows
# start with crossed entries, the blocks the window has handed back.

# %%
draw_block_tables(live, title="tiny-gemma3 after 4 steps")

# %%
view.run()  # to the end
print(live.engine.stats().summary())
live.engine.kv.check_invariants()

# %% [markdown]
# ## 4. Same block size, not the same capacity
#
# Chapter 01's formula, `2 x layers x KV heads x head_dim x bytes`, gives a token's cost while
# *every* layer holds its K/V. Under a window that is true of a token only while it is inside
# the window: a sliding layer drops it afterwards. What one sequence holds depends on its length,
# on each group's window and on the padding; `KVCacheSpec.sequence_bytes(n, block_size)` adds it
# up (`kv_cache.py`). Below, in bfloat16 and blocks of 16 tokens (`LLM`'s default), for GPT-2,
# the two tiny models and the real Mistral-7B and Gemma 3 configs, built on the meta device
# (`reference_configs.py` says where each number comes from):

# %%
GiB, BLOCK = 2**30, 16
LENGTHS = (1024, 4096, 32768)
models = {name: load(name).model for name in ("tiny-mistral", "tiny-gemma3")}
models |= {name: meta_model(config) for name, config in configs.items()}  # no weights, no bytes
specs = {name: kv_cache_spec(m, dtype=torch.bfloat16) for name, m in models.items()}
for name, spec in specs.items():
    print(f"{name}:\n    {spec.formula()}")

# %% [markdown]
# The number to compare is **tokens held per GiB** for sequences of `n` tokens: `n` times the
# number of such sequences 1 GiB holds, `n * 2**30 / sequence_bytes(n)` (a fraction of a
# sequence counted). Next to it, what the same model would hold if every layer were full
# attention (`2**30 / bytes_per_token`, whatever the length).

# %%
rows = {}
head = "".join(f"{f'n = {n:,}':>14}" for n in LENGTHS)
print(f"{'model':27}{'block':>10}{'all full':>12}{head}")
for name, spec in specs.items():
    per_gib = [n * GiB / spec.sequence_bytes(n, BLOCK) for n in LENGTHS]
    rows[name] = per_gib
    limit = max_model_len(models[name])
    marks = ["*" if n > limit else " " for n in LENGTHS]
    cells = "".join(f"{t:>13,.0f}{m}" for t, m in zip(per_gib, marks, strict=True))
    block = f"{spec.block_bytes(BLOCK) // 1024} KiB"
    print(f"{name:27}{block:>10}{GiB / spec.bytes_per_token:>12,.0f}{cells}")
print(
    "\n* longer than the model's positions (max_position_embeddings): the arithmetic of its "
    "shape only"
)
g1b, n = specs["google/gemma-3-1b-it"], 32768
# A prompt computed in one step: a block for every position, in every group.
prefill = len(g1b.groups) * math.ceil(n / BLOCK) * g1b.block_bytes(BLOCK)
decoding = g1b.sequence_bytes(n, BLOCK)
print(f"\ngemma-3-1b-it, {n:,} tokens: {decoding / 2**20:,.0f} MiB while it decodes; "
      f"{prefill / 2**20:,.0f} MiB in the step that computes such a prompt at once")  # fmt: skip

# %% [markdown]
# The tiny models' numbers are huge because their tokens are tiny; what compares across models
# is each one against itself with every layer full. The real configs, as that ratio:

# %%
REAL = ["gpt2", "mistralai/Mistral-7B-v0.1", "google/gemma-3-1b-it", "google/gemma-3-4b-it"]
fig = Figure(figsize=(8, 3.2))
ax = fig.subplots()
width = 0.8 / len(LENGTHS)
for k, n in enumerate(LENGTHS):
    ratios = [rows[name][k] * specs[name].bytes_per_token / GiB for name in REAL]
    ax.bar([i + (k - 1) * width for i in range(len(REAL))], ratios, width, label=f"n = {n:,}")
ax.axhline(1, color="grey", lw=0.8)
ax.set_xticks(range(len(REAL)), [name.split("/")[-1] for name in REAL])
ax.set(ylabel="tokens per GiB / all-full", title="bfloat16, blocks of 16 tokens")
ax.legend(fontsize=8)
display(fig)

# %% [markdown]
# What to read in the table:
#
# - **GPT-2**: one number per row. Full attention costs the same per token at any length, which
#   is what chapters 01-08 relied on.
# - **Mistral-7B**: the same as all-full up to its window (4,096); at 32k tokens, 8 times more,
#   since each sequence holds only its window's 256 blocks.
# - **Gemma-3-1B**: 1.6 times all-full already at 1,024 tokens (window 512), about 6 times at 32k:
#   only the full group (4 of 26 layers) grows with the length. Its block is 64 KiB, against
#   GPT-2's 576 KiB, although both hold 16 tokens: it holds only one group's layers (4 layer
#   slots of 1 KV head of 256), where GPT-2's holds all 12 layers of 12 heads of 64.
# - **Gemma-3-4B**: at 1,024 tokens (its window), *fewer* tokens than all-full: the window has
#   freed nothing yet, and its last sliding group pads 4 layers to 5 (35 layer slots for 34
#   layers).
# - **the tiny models** sit at the extremes: with a 24-token window, tiny-mistral holds 2 or 3
#   blocks per sequence whatever its length; tiny-gemma3 approaches twice all-full and can go no
#   further, since half its layers are full.
#
# That last point holds for every hybrid model: as sequences grow, the full group's blocks are all
# that grows, so the gain tends to the number of layers over the full group's layer slots:
# 26 / 4 = 6.5 for Gemma-3-1B, 34 / 5 = 6.8 for Gemma-3-4B. A model whose every layer slides
# (Mistral-7B) has no such ceiling.
#
# And the line under the table: these numbers count a sequence while it decodes. A prompt
# computed in one step holds a block for every position in every group during that step, since
# its own queries read all of them (`kv_cache_groups.py`); a pool sized for the decoding numbers
# must still admit that prompt.
#
# **Measure it.** Arithmetic is a prediction; the engine is the measurement. Give tiny-gpt2,
# tiny-mistral and tiny-gemma3 the same KV budget in bytes (256 KiB; the engine runs them in
# float32) and the same work: 8 requests, sent at once, each a 40-token prompt and 80 generated
# tokens. tiny-gpt2 and tiny-gemma3 cost the same 1,024 bytes per token with every layer
# counted, so they make the fairest pair.

# %%
prompt = "Measure again: the same bytes hold different numbers of tokens."[:40]
budget = 256 * 1024  # bytes of KV cache, the same for the three models
print(f"{'model':13}{'bytes/token':>12}{'block':>8}{'blocks':>8}{'mean running':>14}"
      f"{'preemptions':>13}{'steps':>7}")  # fmt: skip
for name in ("tiny-gpt2", "tiny-mistral", "tiny-gemma3"):
    llm = LLM(name, block_size=BLOCK, kv_cache_memory=budget, verbose=False)
    steps = []
    llm.engine.subscribe_stats(steps.append)
    llm.generate([prompt] * 8, SamplingParams(max_tokens=80, ignore_eos=True), use_tqdm=False)
    spec, stats = llm.engine.kv_cache.spec, llm.engine.stats()
    mean_running = sum(s.num_running for s in steps) / len(steps)
    print(f"{name:13}{spec.bytes_per_token:>12,}{spec.block_bytes(BLOCK):>8,}"
          f"{stats.num_blocks:>8}{mean_running:>14.1f}"
          f"{stats.preemptions_recompute:>13}{stats.step:>7}")  # fmt: skip

# %% [markdown]
# The same bytes give tiny-gpt2 16 blocks and the hybrids 32 blocks of half the size: a
# tiny-gpt2 block holds its 2 layers of 4 KV heads, a hybrid's block one group's 2 layers of 2
# KV heads (a tiny-gemma3 token takes a slot in both of its groups, so with every layer counted
# it costs what a tiny-gpt2 token costs). Each tiny-mistral sequence holds at most 3 blocks (a
# window of 24 spans at most 3 blocks of 16), so all 8 requests run together from start to
# finish, without a preemption, in 80 steps (the mean batch reads 7.9, not 8, because the
# statistics after the last step, when all 8 have finished, count 0 running). tiny-gemma3
# holds its full group's blocks on top,
# which grow with its length: it runs out of blocks and preempts, but less often than tiny-gpt2,
# and finishes in fewer steps. These counts (blocks, mean batch, preemptions, steps) come from
# the scheduler and the allocator, not from a clock: they are the same on every machine. Before
# you size a server for your own model, measure the same way.
#
# ## 5. What prefix caching can and cannot reuse under a window
#
# Chapter 04's prefix cache finds a prompt's leading blocks by their chained hashes. For a full
# group, skipping the first `h` blocks of a prompt needs all `h` of them cached: the first
# computed query reads them all. Under a window it needs only the blocks that query can see --
# the `ceil((W - 1) / block_size)` blocks just before position `h * block_size` (all `h` when the
# prefix is shorter than the window). The older ones may have been evicted long ago; the new
# sequence's table gets `-1` for them. vLLM's `SlidingWindowManager.find_longest_cache_hit`
# searches from the right for that many cached blocks in a row
# (`vllm/v1/core/single_type_kv_cache_manager.py`; the docstring of the abstract
# `SingleTypeKVCacheManager.find_longest_cache_hit` there gives the example, with blocks of 4
# and a window of 8: two null blocks followed by two cached ones), and so does pagedlearn's
# (`sliding_window_manager.py`). The hash of block `h - 1` still covers every token
# before it, so a hit still means "the same prefix".
#
# On tiny-mistral (every layer sliding, `W = 24`), prompt `A` runs first. Prompt `C` shares
# its first 56 tokens (14 blocks of 4); the query at position 56 sees keys 33..56, so a hit on
# 14 blocks needs only blocks 8..13. The pool is small: after `A`, a filler request takes
# exactly the empty blocks plus the 8 least recently used cached ones.

# %%
A_TEXT = "Once upon a time, in a land far away, there lived a small dragon named Pip."
small = LLM("tiny-mistral", block_size=BS, num_blocks=24, verbose=False)
tok, engine = small.tokenizer, small.engine
A = tok.encode(A_TEXT)  # 75 tokens
C = A[:56] + tok.encode(" Who ate the moon?")
evicted = []
engine.kv.trace.subscribe(lambda e: evicted.extend(e.blocks) if e.kind == "evict" else None)
small.generate([A], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)

group = engine.kv.managers[0]  # tiny-mistral's only group: sliding 24
extra = make_extra_keys(group.model_id)  # its block hashes carry the model and the group name
hashes = hash_blocks(C, BS, extra)


def cached_blocks():
    """For each of C's first 14 blocks: 'x' if the prefix cache still holds it, else '.'."""
    return "".join(
        "x" if group.prefix_cache.lookup(hashes[j], parent_hash(hashes, j),
                                         C[j * BS : (j + 1) * BS], extra) is not None else "."
        for j in range(14)
    )  # fmt: skip


def leading(marks):
    """What a full-attention group could reuse: the cached blocks before the first gap."""
    return (marks + ".").index(".") * BS


def report(when):
    marks, window_rule = cached_blocks(), engine.kv.cached_prefix_tokens(C)
    print(f"{when:28} C's blocks cached {marks}: the window rule finds {window_rule} tokens, "
          f"a full-attention rule {leading(marks)}")  # fmt: skip


need_from = first_visible_key(56, 24) // BS  # 8: the oldest block the query at 56 sees
report("after A:")
empty = engine.kv.num_free_blocks - engine.kv.stats()["cached_blocks"]
filler = tok.encode("z" * (empty + need_from) * BS)  # its prompt takes that many blocks
small.generate([filler], SamplingParams(max_tokens=1), use_tqdm=False)
report(f"filler evicted {len(evicted)} blocks:")

# %% [markdown]
# The filler evicted `A`'s blocks 0..7, exactly the ones the window freed first: at `A`'s first
# decode step, blocks 0..12 went back to the pool at once, oldest first, so LRU eviction takes them
# first too. (That order is pagedlearn's choice: vLLM's `remove_skipped_blocks` hands a batch back
# newest first, so an LRU there evicts the newest skipped blocks first.) The window rule still finds
# all 56 tokens; a full-attention group, needing the chain from block 0, would find none. Run `C`
# and check the result against transformers: the reused K/V at positions 32..55 were computed, in
# `A`'s run, from the same tokens as `C`'s, so `C`'s tokens must be exact.

# %%
engine.add_request("C", C, SamplingParams(max_tokens=16))
(first_step,) = engine.step()
print(f"C: {first_step.num_cached_tokens} prompt tokens from the cache; "
      f"its table after the first step: {engine.kv.block_table('C.0')}")  # fmt: skip
display(draw_block_tables(small, title="C: logical blocks 0-7 null, 8-13 reused from A"))
out = first_step
while engine.has_unfinished_requests():
    (out,) = engine.step()
hf = load("tiny-mistral").model
x = torch.tensor([C])
ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16, do_sample=False,
                  eos_token_id=hf.config.eos_token_id,
                  pad_token_id=hf.config.pad_token_id)[0, len(C):].tolist()  # fmt: skip
print("C's tokens identical to transformers':", out.outputs[0].token_ids == ref)

# %% [markdown]
# **A hybrid model needs every group to agree.** In a model with full and sliding groups, a
# prompt's first `h` blocks are skipped only if *every* group can skip them; the coordinator
# lowers `h` until they agree (`kv_cache_coordinator.py`, "one prefix-cache hit length for all
# groups"). And the groups' copies of the same prompt are freed at different times: the sliding
# group's while the request is still decoding, the full group's when it ends. So LRU evicts the
# sliding group's first. Driven by hand (window 8, blocks of 4): `A` (24 tokens) decodes 8
# tokens and ends; `C` shares its first 20 tokens (5 blocks, so a hit needs the sliding group's
# blocks 3 and 4). Then two fillers evict 2 blocks each.

# %%
kv = KVCacheCoordinator(group_layers([8, None]), num_blocks=24, block_size=BS,
                        enable_prefix_caching=True)  # fmt: skip
A, C = list(range(100, 124)), [*range(100, 120), 1, 2, 3, 4]
kv.add_sequence("A", A)
label = {}  # physical block -> "F3" (full group, logical block 3) or "S3" (sliding)
for t in range(8):
    for g, table in zip(kv.groups, kv.block_tables("A"), strict=True):
        label |= {b: f"{'S' if g.is_sliding else 'F'}{j}" for j, b in enumerate(table) if b >= 0}
    kv.remove_skipped_blocks("A", kv.num_tokens("A"))
    kv.append_token("A", 200 + t)
print("A's tables (full, sliding 8):", kv.block_tables("A"))
kv.free_sequence("A")
queue = [label.get(b, "empty") for b in kv.allocator.free_queue()]
print("free queue, evicted first ->", " ".join(q for q in queue if q != "empty"), "(after",
      queue.count("empty"), "empty blocks)")  # fmt: skip


def hits(when):
    full_hit, sliding_hit = (m.cached_prefix_tokens(C) for m in kv.managers)
    print(f"{when:28} full group alone {full_hit:>2}, sliding group alone {sliding_hit:>2}, "
          f"agreed {kv.cached_prefix_tokens(C):>2} tokens")  # fmt: skip


hits("A ended:")
kv.add_sequence("F1", list(range(500, 500 + (queue.count("empty") // 2 + 1) * BS)))
hits("2 cached blocks evicted:")
kv.add_sequence("F2", list(range(600, 600 + BS)))
hits("2 more evicted:")

# %% [markdown]
# - After 2 evictions, the sliding group has lost its blocks `S0` and `S1` and still finds all
#   20 tokens: the window needs only `S3` and `S4`. A full-attention rule in that group would
#   have found nothing.
# - After 2 more, `S3` is gone: the sliding group can skip nothing, and neither can the model,
#   although its full group still holds every block of the prefix. A cached prefix is worth
#   only as much as the group that can reuse the least of it.
#
# Together: a window lets prefix caching survive the loss of old blocks, which pagedlearn's LRU
# evicts first since the window freed them first (vLLM frees a batch newest first). But in a hybrid
# model the blocks that count are the ones the *sliding* group needs near the end of the shared
# prefix, and when the request that left them had decoded past them, they were freed, and so are
# evicted, before any of the full group's.

# %% [markdown]
# ## Check yourself
#
# Answer each question before you run the cell below: write your answers into `my_answers`
# (`None` skips one). The cell checks them against the runs above, and checks the rule behind
# each answer too.
#
# 1. In section 3's long tiny-gemma3 run (window 24, blocks of 4), what is the most blocks the
#    sliding group holds in one step after the prefill?
# 2. Gemma-3-1B has 4 full and 22 sliding layers. How many KV-cache groups does it get?
# 3. How many padding layer slots do those groups leave in every block?
# 4. In the same long run, how many blocks does the full group hold in the last decode step,
#    with 174 tokens in the sequence?

# %%
my_answers = [None, None, None, None]  # your answers to questions 1-4, then run the cell

g1b = group_layers(windows["google/gemma-3-1b-it"])
rules = [  # what the rules predict
    math.ceil(window / BS) + 1,  # the window's keys touch at most this many blocks
    1 + math.ceil(22 / 4),  # group size 4 (22 >= 1.25 x 4): one full group, ceil(22 / 4) sliding
    4 * (1 + math.ceil(22 / 4)) - 26,  # layer slots of all groups - layers
    math.ceil(174 / BS),  # a full layer keeps every token: a block per 4 tokens
]
seen = [peak, len(g1b), layers_per_block(g1b) * len(g1b) - len(windows["google/gemma-3-1b-it"]),
        per_step[-2].group_blocks["full"]]  # fmt: skip
for q, (rule, got, mine) in enumerate(zip(rules, seen, my_answers, strict=True), start=1):
    assert got == rule, f"question {q}: the run gave {got}, the rule {rule}"
    verdict = "" if mine is None else ("  right" if mine == got else f"  (you said {mine})")
    print(f"question {q}: {got}{verdict}")

# %% [markdown]
# ## Exercises
#
# 1. In section 1, take `W = 8` (a multiple of `BS`): what is the most blocks the sliding table
#    holds, and is the bound `ceil(W / BS) + 1` still reached? Find the positions where it is,
#    and check with `sliding_blocks_held`.
# 2. Give tiny-gemma3 a longer generation (`max_tokens=400`, `num_blocks=160`) and plot
#    `group_blocks` again. At what length does the full group hold 10 times the sliding group's
#    blocks? Predict it from `ceil(n / 4)` and the bound first.
# 3. In the capacity table, give Gemma-3-1B a window of 4,096 instead of 512
#    (`configs["google/gemma-3-1b-it"].sliding_window = 4096`, then rebuild its meta model and
#    spec). At which of the three lengths does it hold fewer tokens per GiB than all-full, and
#    why fewer, not the same?
# 4. In the hand-driven coordinator of section 5, make the window 16 instead of 8. Which blocks
#    does `C`'s hit need now, and after how many evictions does the agreed hit drop to 0?
