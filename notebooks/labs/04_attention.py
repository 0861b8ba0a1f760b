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
# # Lab 4: Paged attention in PyTorch: gather, write, online softmax
#
# **What you will build.** The pure-PyTorch references of `pagedlearn/attention/references.py` that
# the Triton kernel is built from and checked against, in three exercises:
#
# 1. `gather`: `gather_kv`, one sequence's K/V read back in order through its block table, and
#    `paged_attention_ref`, decode attention over the paged cache: gather, then attend;
# 2. `write`: `write_kv_ref`, the KV write: each new token's K/V stored at its *slot*;
# 3. `online`: `paged_attention_online_softmax_ref`, attention computed one block at a time
#    with a running max, a running sum and an accumulator -- the loop a kernel runs -- and
#    flash-decoding's splits, merged by their log-sum-exp.
#
# Lab 5 then asks for the same loop in Triton.
#
# **The chapter it practises:** [05 · The paged attention kernel](
# ../05_paged_attention_kernel.ipynb), sections 2 to 4. Read them first; the hints below point
# to them.
#
# **How feedback works.** Each exercise cell defines your function and ends with
# `check("<exercise>")`, which runs that exercise's checks on it at once and prints one line per
# check: `PASS`; `FAIL` with what went wrong -- the call, the first wrong sequence (its context
# length, block size and blocks), the error against `paged_attention_ref`, and, when your
# output is exactly what a known mistake gives, that mistake; or `TODO` while the stub is still
# there (then "Run all" stops at that cell, with the stub's message saying what to do). The
# test inputs are made to catch mistakes: physical blocks handed out in a shuffled order, NaN
# in every slot no token was written to, partly filled last blocks, empty contexts, scores
# large enough to overflow `exp`.
#
# **Grade yourself** (the grader an instructor uses, with the points):
#
# ```
# python -m pagedlearn grade attention 04_attention.ipynb
# ```

# %%
from pagedlearn.labs.feedback import start

check = start("attention", globals())

# %% [markdown]
# ## Exercise `gather`: paged attention = gather, then attend
#
# The cache is one slab, `key_cache: (num_blocks, block_size, num_kv_heads, head_dim)` (and
# `value_cache` the same). A sequence's `block_table` lists its *physical* block ids in
# *logical* order: logical block `j` (tokens `j * block_size` to `(j + 1) * block_size - 1`)
# is physical block `block_table[j]`, wherever that lies in the slab. So token `t` is at row
# `t % block_size` of physical block `block_table[t // block_size]`.
#
# **`gather_kv(key_cache, value_cache, block_table, context_len)`** returns `(k, v)`, each
# `(context_len, num_kv_heads, head_dim)`, the sequence's tokens in order. A context of `n`
# tokens fills `ceil(n / block_size)` blocks, the last one possibly only in part: what lies
# past `n` in it is not the sequence's (here: NaN). The table row may be longer than the blocks
# the sequence uses; ignore the rest. One indexing with a tensor of block ids gathers all the
# blocks at once; no Python loop over tokens is needed.
#
# **`paged_attention_ref(q, key_cache, value_cache, block_tables, context_lens, scale=None)`**
# is decode attention over the paged cache: one new token per sequence, `q: (num_seqs,
# num_heads, head_dim)`, attends to its sequence's keys. Check the input first with
# `check_decode` (given; pass it all five tensors, `scale`, and `True` to check the tables'
# values too): it raises `AttentionInputError` on bad tensors and returns the sizes, with
# `.scale`, which is `1 / sqrt(head_dim)` when `scale` is None. Then, per sequence,
# gather and call `contiguous_attention(q_i, k, v, scale)` (given, the ground truth of
# chapter 05: plain softmax attention, grouped-query heads included; `q_i` of shape
# `(1, num_heads, head_dim)`). The result is `(num_seqs, num_heads, head_dim)` in q's dtype.
#
# Hints: chapter 05, sections 2 ("The same K/V in blocks") and 3 ("Paged attention = gather,
# then attend").


# %% tags=["exercise"]
# Exercise 'gather': Paged attention = gather, then attend
def gather_kv(key_cache, value_cache, block_table, context_len):
    """One sequence's K/V made contiguous: ``(context_len, num_kv_heads, head_dim)`` each.

    Logical token ``t`` lives in logical block ``t // block_size``, which the table maps to a
    physical block, at offset ``t % block_size`` inside it. (Under a sliding window the callers
    pass the row from the first block in the window on, ``block_table[first:]``, and the length
    from there: the blocks before it may be freed.)
    """
    block_size = key_cache.shape[1]
    num_blocks = -(-context_len // block_size)  # ceil: the last block may be partly filled
    ids = block_table[:num_blocks].long()  # (num_blocks,) physical ids, in logical order
    k = key_cache[ids].flatten(0, 1)[:context_len]  # (num_blocks * block_size, ...) -> trimmed
    v = value_cache[ids].flatten(0, 1)[:context_len]
    return k, v


def paged_attention_ref(
    q, key_cache, value_cache, block_tables, context_lens, scale=None, *, sliding_window=None
):
    """Decode attention over a paged KV cache: gather, then :func:`contiguous_attention`.

    q: ``(num_seqs, num_heads, head_dim)``, one new token per sequence;
    key_cache, value_cache: ``(num_blocks, block_size, num_kv_heads, head_dim)``;
    block_tables: int ``(num_seqs, max_blocks_per_seq)``; context_lens: int ``(num_seqs,)``.
    Returns ``(num_seqs, num_heads, head_dim)``. ``scale`` defaults to ``1 / sqrt(head_dim)``.
    ``sliding_window=W``: the new token (at position ``context_len - 1``) sees its last ``W``
    keys; the blocks before the one holding the first of them are not read (may be -1).
    Raises :class:`~pagedlearn.errors.AttentionInputError` (a ``ValueError``) on bad input.
    """
    window = check_sliding_window(sliding_window)  # an int >= 1, or None
    shape = check_decode(q, key_cache, value_cache, block_tables, context_lens, scale, True, window)
    bs = shape.block_size
    out = torch.empty_like(q)
    for i, n in enumerate(context_lens.tolist()):
        start = first_visible_key(n - 1, window)  # the window's first key; 0 without one
        first = start // bs  # its block: the blocks before it are not read (they may be freed)
        k, v = gather_kv(key_cache, value_cache, block_tables[i, first:], n - first * bs)
        k, v = k[start - first * bs :], v[start - first * bs :]  # the keys in the window
        out[i] = contiguous_attention(q[i : i + 1], k, v, shape.scale)[0]
    return out


check("gather")

# %% [markdown]
# ## Exercise `write`: K/V at their slots
#
# The other direction: the engine computes the K/V of new tokens and must store them where the
# block tables say. It hands the kernel a *slot mapping*, one slot per token:
# `slot = physical block * block_size + offset`, so slot `s` is row `s % block_size` of block
# `s // block_size`. A slot of `-1` marks a padding token: write nothing for it.
#
# **`write_kv_ref(key, value, key_cache, value_cache, slot_mapping, *, check_values=True)`**
# writes in place (into the caches it is given; it returns nothing). Before writing anything
# it checks its input with `check_write_kv` (given; pass it the five tensors and
# `check_values`; it returns the cache's shape, with `.block_size`): a slot past the
# cache, or two tokens sent to one slot, must raise `AttentionInputError` and leave the cache
# untouched.
#
# Hints: chapter 05, section 2, and `pagedlearn/attention/inputs.py` for the checks.


# %% tags=["exercise"]
# Exercise 'write': Write K/V at their slots
def write_kv_ref(key, value, key_cache, value_cache, slot_mapping, *, check_values=True):
    """Write each token's K/V into its slot of the paged cache (in place); skip negative slots.

    key, value: ``(num_tokens, num_kv_heads, head_dim)``; slot_mapping: int ``(num_tokens,)``.
    Slot ``s`` is row ``s % block_size`` of physical block ``s // block_size``.
    ``check_values=False`` skips checking the slots (in range, no two tokens in one slot).
    """
    shape = check_write_kv(key, value, key_cache, value_cache, slot_mapping, check_values)
    keep = slot_mapping >= 0  # padding tokens carry slot -1 and are not written
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // shape.block_size, slots % shape.block_size
    key_cache[blocks, offsets] = key[keep]
    value_cache[blocks, offsets] = value[keep]


check("write")

# %% [markdown]
# ## Exercise `online`: the online softmax, block by block
#
# `paged_attention_ref` gathers each sequence's K/V and takes an ordinary softmax over
# the whole row of scores. A kernel cannot hold that row: it streams K/V through a fixed amount
# of fast memory, one block at a time. So per sequence and query head it keeps, in float32:
#
# - `m`: the largest score seen so far (starts at `-inf`);
# - `l`: the sum of `exp(score - m)` over the scores seen so far (starts at 0);
# - `acc`: the sum of `exp(score - m) * v` (a `head_dim` vector, starts at 0).
#
# For each block: its scores `s = q . k * scale` (only the tokens the block really holds),
# `m_new = max(m, max(s))`, `alpha = exp(m - m_new)`, `p = exp(s - m_new)`; then
# `l = l * alpha + sum(p)` and `acc = acc * alpha + p @ v`; `m = m_new`. At the end,
# `acc / l` -- divided **once**. Every `exp` is of a number `<= 0`, so nothing overflows, however
# large the scores.
#
# **`paged_attention_online_softmax_ref(q, key_cache, value_cache, block_tables, context_lens,
# scale=None, num_splits=1)`**, with `q: (num_seqs, num_heads, head_dim)`, returns
# `(num_seqs, num_heads, head_dim)` in q's dtype, equal to `paged_attention_ref` to ~1e-5:
#
# - check the input first, with `check_decode` as in `paged_attention_ref`; it returns the
#   sizes (`.block_size`, `.group_size`, `.scale`, `.num_heads`, `.head_dim`). A `num_splits`
#   that is not an int `>= 1` is a `ValueError`;
# - grouped-query attention: `num_kv_heads` may be smaller than `num_heads`; query head `h`
#   reads KV head `h // group_size` (`repeat_interleave`, not `repeat`);
# - a sequence with no keys gets zeros;
# - `num_splits > 1` (flash-decoding): cut each sequence's blocks into `num_splits` slices of
#   `ceil(blocks / num_splits)` blocks (the last slices may be empty); run the loop on each
#   slice on its own, then merge the slices' `(m_s, l_s, acc_s)`: with `M = max m_s` and
#   `w_s = exp(m_s - M)`, the result is `sum w_s acc_s / sum w_s l_s`. An empty slice has
#   `m_s = -inf`, weight 0.
#
# Hints: chapter 05, sections 3 ("Paged attention = gather, then attend") and 4 ("The online
# softmax: one block at a time").


# %% tags=["exercise"]
# Exercise 'online': The online softmax, block by block, with splits
def paged_attention_online_softmax_ref(
    q,
    key_cache,
    value_cache,
    block_tables,
    context_lens,
    scale=None,
    num_splits=1,
    *,
    sliding_window=None,
):
    """:func:`paged_attention_ref` computed the way the Triton kernel does, one block at a time.

    Per sequence and head it keeps, in float32: ``m_i`` the largest score seen so far, ``l_i`` the
    sum of ``exp(score - m_i)``, and ``acc`` the sum of ``exp(score - m_i) * v``. When a new block
    raises the max, ``l_i`` and ``acc`` are rescaled by ``exp(m_old - m_new)``; at the end
    ``acc / l_i`` is the softmax-weighted sum, divided once. A whole row of scores never exists,
    which is why a kernel can stream K/V of any length through a fixed amount of on-chip memory.

    ``num_splits > 1`` is flash-decoding: the blocks are cut into ``num_splits`` slices that run
    independently (on a GPU, in parallel: more work for short batches with long contexts). Each
    slice ends with its own ``(m_i, l_i, acc)``; they are merged exactly, weighting slice ``s`` by
    ``exp(m_s - max_s m_s)``. A slice with no blocks has ``l_i = 0`` and weight 0.

    ``sliding_window=W``: the loop starts at the block holding key ``context_len - W`` (the
    first the new token sees); the blocks before it are skipped, never loaded, and the slices
    divide only the window's blocks. In that first block, the keys before the window score -inf.
    """
    window = check_sliding_window(sliding_window)  # an int >= 1, or None
    shape = check_decode(q, key_cache, value_cache, block_tables, context_lens, scale, True, window)
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    bs, group, dev = shape.block_size, shape.group_size, q.device
    out = torch.empty_like(q)
    for i, n in enumerate(context_lens.tolist()):
        qi = q[i].float()  # (num_heads, head_dim)
        num_blocks = -(-n // bs)
        start = first_visible_key(n - 1, window)  # the window's first key; 0 without one
        first = start // bs  # its block: the blocks before it are never visited (may be freed)
        per_split = -(-(num_blocks - first) // num_splits)  # per slice; trailing ones may be empty
        parts = []  # one (m_i, l_i, acc) per slice
        for split in range(num_splits):
            m_i = torch.full((shape.num_heads,), float("-inf"), device=dev)  # running max
            l_i = torch.zeros(shape.num_heads, device=dev)  # running sum of exp(score - m_i)
            acc = torch.zeros(shape.num_heads, shape.head_dim, device=dev)  # sum of exp(...) * v
            begin = first + split * per_split
            for j in range(begin, min(begin + per_split, num_blocks)):
                # 1. Look up where logical block j lives, and load it.
                block_id = int(block_tables[i, j])
                valid = min(bs, n - j * bs)  # tokens in this block; the last may be partial
                k = key_cache[block_id, :valid].float()  # (valid, num_kv_heads, head_dim)
                v = value_cache[block_id, :valid].float()
                k = k.repeat_interleave(group, dim=1)  # each KV head serves `group` query heads
                v = v.repeat_interleave(group, dim=1)  # (valid, num_heads, head_dim)
                # 2. Scores of this block only: (num_heads, valid). The window's first block may
                #    begin with keys before the window: they score -inf, so weigh 0.
                s = torch.einsum("hd,thd->ht", qi, k) * shape.scale
                s[:, : max(start - j * bs, 0)] = float("-inf")  # nothing, past the first block
                # 3. Raise the running max; rescale what was summed under the old max.
                m_new = torch.maximum(m_i, s.max(dim=1).values)
                alpha = torch.exp(m_i - m_new)  # exp(-inf) = 0 on the first block
                p = torch.exp(s - m_new[:, None])  # (num_heads, valid)
                l_i = l_i * alpha + p.sum(dim=1)
                acc = acc * alpha[:, None] + torch.einsum("ht,thd->hd", p, v)
                m_i = m_new
            parts.append((m_i, l_i, acc))
        # 4. Merge the slices (one slice: this is just acc / l_i). Empty slices have m_i = -inf.
        m_all = torch.stack([m for m, _, _ in parts])  # (num_splits, num_heads)
        m_max = m_all.max(dim=0).values
        m_max = torch.where(torch.isinf(m_max), torch.zeros_like(m_max), m_max)  # n == 0
        w = torch.exp(m_all - m_max)  # (num_splits, num_heads); 0 for empty slices
        l_total = sum(w[s] * parts[s][1] for s in range(num_splits))
        acc_total = sum(w[s][:, None] * parts[s][2] for s in range(num_splits))
        safe_l = torch.where(l_total > 0, l_total, torch.ones_like(l_total))
        out[i] = (acc_total / safe_l[:, None]).to(q.dtype)  # no keys at all -> zeros
    return out


check("online")

# %% [markdown]
# ## Your online softmax, side by side with the reference
#
# The same random batch for several `num_splits`: the largest difference from the package's
# `paged_attention_ref` should be around 1e-7 (float32 rounding: the sums run in another
# order), also when there are more splits than blocks. (Not graded: the grader skips this cell.)

# %% tags=["demo"]
from pagedlearn.attention import paged_attention_ref as package_ref
from pagedlearn.labs.attention_cases import make_case

case = make_case([3, 17, 40], block_size=4, heads=4, kv_heads=2, seed=0)
want = package_ref(*case.args())
for num_splits in (1, 2, 3, 8, 16):
    got = paged_attention_online_softmax_ref(*case.args(), num_splits=num_splits)
    print(f"num_splits={num_splits:2d}: max |yours - the package's paged_attention_ref| = "
          f"{(got - want).abs().max().item():.1e}")  # fmt: skip
