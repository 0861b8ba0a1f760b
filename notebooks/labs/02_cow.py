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
# # Lab 2: Fork and copy-on-write
#
# **What you will build.** The sharing half of the KV-cache manager
# (`pagedlearn/core/kv_cache_manager.py`), what lets the samples of one request (parallel sampling,
# beam search) share their prompt's KV blocks, in three exercises:
#
# 1. `fork`: `fork`, a new sequence that shares every block of another, and `free_sequence`,
#    which gives a sequence's blocks back;
# 2. `cow`: `append_token`, where a token's K/V goes -- into the last block, into a new block,
#    or into a *copy* of a shared block (copy-on-write);
# 3. `plan`: `blocks_to_append`, how many blocks the next step will need, asked by the
#    scheduler before it runs the step.
#
# The allocator, block tables and the rest of the manager are the package's (lab 1 was about
# them), so every exercise runs on a working manager.
#
# **The chapter it practises:** [03 · Copy-on-write](../03_copy_on_write.ipynb). Read it
# first; the hints below point to its sections.
#
# **How feedback works.** Each exercise cell defines your methods and ends with
# `check("<exercise>")`, which runs that exercise's checks on them at once and prints one line
# per check: `PASS`; `FAIL` with what went wrong -- the shortest sequence of calls that shows it
# (`add_sequence('a', [1, 2, 3, 4, 5]); fork('a', 'b'); append_token('b', 9)`), what was
# expected and what your code gave -- and a picture of your pool beside the reference's; or
# `TODO` while the stub is still there ("Run all" stops at that cell; the stub's message says
# what to do). Each exercise is checked on its own: the methods of the other exercises run the
# reference's code.
#
# **Grade yourself** (the grader an instructor uses, with the points):
#
# ```
# python -m pagedlearn grade cow 02_cow.ipynb
# ```

# %%
from pagedlearn.labs.feedback import start

check = start("cow", globals())


# %% [markdown]
# ## What you work with
#
# The manager keeps one `BlockTable` per sequence (`block_ids`, `token_ids`, `num_tokens`,
# `slot(i)`, `copy()`) in `self._seqs`, and a `BlockAllocator` in `self.allocator` (lab 1:
# `allocate`, `incref`, `free`, `refcount`). Given, and yours to use:
#
# - `self._seqs.on_gpu(seq_id)`: the table of a sequence on the GPU; raises `PagedLearnError`
#   for an unknown (or swapped-out) id. `self._seqs.check_new(seq_id)` raises unless the id is
#   free and hashable. `self._seqs.add(seq_id, table, extra_keys)`, `self._seqs.remove(seq_id)`,
#   `self._seqs.is_swapped(seq_id)` (raises for an unknown id), `self._seqs.table(seq_id)`
#   (wherever it is), and `self._seqs.extra_keys[seq_id]` (what the prefix cache must never
#   share across: the child of a fork keeps its parent's).
# - `self._allocate(n, seq_id, what)`: `n` new blocks for `seq_id`'s new data. It raises
#   `OutOfBlocksError` (naming `what`) when the pool is short, and forgets the hash of a cached
#   block it hands out.
# - `self._events`: announces each block operation on the trace, which the live view and the
#   replays draw: `incref(parent_id, child_id, blocks)`, `free(seq_id, blocks, cpu=...)`,
#   `allocate(seq_id, blocks)`, `cow_copy(seq_id, src, dst)`.
# - `self._copies`: the pending copies `(src, dst)` the engine applies to the KV tensors before
#   the next attention call (`pop_copies` hands them over); `self._counters["cow_copies"]`
#   counts them.
#
# After every call the checks compare your manager with the reference's: what the call returned
# or raised (an error the reference raises must be raised by yours too, and leave **everything**
# as it was), the block tables and tokens, every refcount, the pending copies, the free queue in
# order, the prefix cache, the `cow_copies` counter and the trace events of the call.

# %% [markdown]
# ## Exercise `fork`: share, and give back
#
# **`fork(parent_id, child_id)`** makes `child_id` a sequence with the same tokens as
# `parent_id` that *shares* all of its blocks: the child's table is a copy of the parent's table
# (the same physical block ids), each block gets one reference more, and no KV is copied -- a
# copy happens later, only if a sequence writes into a shared block. The parent must be on the
# GPU and the child id new; check both **before** changing anything. Announce it with one
# `incref` event.
#
# **`free_sequence(seq_id)`** drops one reference on each of the sequence's blocks, with one
# `free` event, and forgets the sequence. A block shared with another sequence stays in use; a
# block whose count drops to 0 returns to the free queue, where a cached one stays findable until
# it is evicted, the least recently freed first. So the order matters: give the blocks back
# **last block first**. A sequence's tail is the least likely to be shared (other requests share
# prompt *prefixes*), so it should be the first to be evicted, and freeing it first puts it
# nearest the front of the queue. The event lists the blocks in that order. A swapped-out
# sequence (`self._seqs.is_swapped`) gives its blocks back to `self.cpu_allocator`, with
# `cpu=True` on the event.
#
# Hints: chapter 03, "Watching the block events"; chapter 02, "The free queue".


# %% tags=["exercise"]
# Exercise 'fork': Share a sequence's blocks, and give them back
class KVCacheManager(KVCacheManager):  # the class so far, with these methods yours
    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Make ``child_id`` a copy of ``parent_id`` that shares all its blocks (no KV copied)."""
        parent = self._seqs.on_gpu(parent_id)
        self._seqs.check_new(child_id)
        blocks = parent.live_blocks()  # a sliding window's null entries stay null in both
        self.allocator.incref(blocks)
        self._seqs.add(child_id, parent.copy(), self._seqs.extra_keys[parent_id])
        self._events.incref(parent_id, child_id, blocks)

    def free_sequence(self, seq_id: Hashable) -> None:
        """Free a finished or aborted sequence's GPU or CPU blocks; cached ones stay findable."""
        on_cpu = self._seqs.is_swapped(seq_id)
        # Tail first: a tail is the least likely to be shared, so it should be evicted first --
        # freeing it first puts it nearer the front of the LRU queue.
        blocks = self._seqs.table(seq_id).live_blocks()[::-1]
        (self.cpu_allocator if on_cpu else self.allocator).free(blocks)
        self._events.free(seq_id, blocks, cpu=on_cpu)
        self._seqs.remove(seq_id)


check("fork")


# %% [markdown]
# ## Exercise `cow`: append a token
#
# **`append_token(seq_id, token_id)`** adds one token (validate it with `check_token`) at
# position `pos = num_tokens` and returns its **slot** (lab 1), where the engine writes its K/V.
# Three cases:
#
# 1. the last block is full, or there is none (`pos` is a multiple of `block_size`): take a new
#    block (an `allocate` event) -- even if the full last block is shared: nobody writes into a
#    full block, so there is nothing to copy;
# 2. the last block has room and nobody else uses it: write in place, nothing to allocate;
# 3. the last block has room but is **shared** (refcount above 1): copy-on-write. Take a fresh
#    block `dst` for this sequence, record the pending copy `(src, dst)` (the engine copies the
#    KV before the next step), drop this sequence's reference on `src`, put `dst` in its table,
#    count it and announce it with a `cow_copy` event. The other sharers keep `src` untouched;
#    when only one of them is left, its refcount is 1 and it writes in place (case 2): of `r`
#    sharers, `r - 1` copy.
#
# Allocate before you change anything: when the pool is full, `OutOfBlocksError` must leave the
# table, the refcounts and the copies as they were. Last, with prefix caching on
# (`self.prefix_cache is not None`), a block that the token just filled is hashed and registered
# so that later prompts can find it: call `self._cache_full_block(seq_id, table)` then.
#
# Hints: chapter 03, "A prompt that ends in the middle of a block" and "The copy is real".


# %% tags=["exercise"]
# Exercise 'cow': Append a token: fill the block, take a new one, or copy on write
class KVCacheManager(KVCacheManager):  # the class so far, with these methods yours
    def append_token(self, seq_id: Hashable, token_id: int) -> int:
        """Add one generated token; returns the slot where its K/V must be written. Allocates a
        block on a block boundary; copies on write if the last block is shared."""
        # Every step, every sequence: on_gpu, check_token and slot() are inlined (run on a problem).
        try:
            table = self._seqs.gpu[seq_id]  # a running sequence: the common case
        except (KeyError, TypeError):
            table = self._seqs.on_gpu(seq_id)  # raises, naming what is wrong with the id
        token = token_id if type(token_id) is int and token_id >= 0 else check_token(token_id)
        pos = len(table.token_ids)
        if pos % self.block_size == 0:  # the last block is full (or there is none): a new one
            (block,) = self._allocate(1, seq_id, f"append_token({seq_id!r}) at position {pos}")
            table.block_ids.append(block)
            self._events.allocate(seq_id, (block,))
        elif self.allocator.refcount(src := table.block_ids[-1]) > 1:  # shared partial block
            (dst,) = self._allocate(1, seq_id, f"copy-on-write for {seq_id!r}")
            self.allocator.free([src])  # one sharer fewer; the others keep src untouched
            table.block_ids[-1] = dst
            self._copies.append((src, dst))
            self._counters["cow_copies"] += 1
            self._events.cow_copy(seq_id, src, dst)
        table.token_ids.append(token)
        if self.prefix_cache is not None and (pos + 1) % self.block_size == 0:  # now full
            self._cache_full_block(seq_id, table)
        if type(table) is not BlockTable:  # a plugged-in table (a lab answer): its own slot()
            return table.slot(pos)
        return table.block_ids[-1] * self.block_size + pos % self.block_size  # table.slot(pos)


check("cow")


# %% [markdown]
# ## Exercise `plan`: how many blocks the next step needs
#
# Before a decoding step the scheduler asks **`blocks_to_append(seq_ids)`**: how many blocks
# appending one token to each id, in order, would allocate -- without doing it (nothing may
# change). An id listed `k` times appends `k` tokens.
#
# - A sequence needs new blocks for the tokens that do not fit in its last block (a table's
#   `blocks_needed` helps).
# - A shared, partly filled last block with refcount `r` costs copies, but not one per writer:
#   each copy drops a reference, and the last sharer left writes in place. When `k` of its
#   sharers write into it this step, it costs `min(k, r - 1)` copies. A sequence that writes
#   twice copies at most once (its second token goes into its own copy).
# - An unknown id raises `PagedLearnError`, and so does a bare string (`"ab"` is not a list of
#   ids: `id_list(seq_ids, "blocks_to_append")` turns the argument into a list, or raises).
#
# The checks compare your answer with the reference's on the states that random calls
# (`add_sequence`, `fork`, `append_token`, `free_sequence`) leave. Hint: the method's docstring
# has worked examples.


# %% tags=["exercise"]
# Exercise 'plan': How many blocks the next step needs
class KVCacheManager(KVCacheManager):  # the class so far, with these methods yours
    def blocks_to_append(self, seq_ids: Iterable[Hashable]) -> int:
        """GPU blocks that appending one token to each of ``seq_ids`` (an id listed twice appends
        twice) would allocate; changes nothing. A full last block needs a new one. A shared partial
        last block (refcount ``r > 1``) needs a copy -- but when ``k`` of its sharers append, only
        ``min(k, r - 1)`` copy: each copy drops a reference, the last writer owns the block alone.

        >>> kv = KVCacheManager(num_blocks=8, block_size=4)
        >>> kv.add_sequence("a", [1, 2, 3, 4, 5, 6]); kv.fork("a", "b"); kv.fork("a", "c")
        0
        >>> kv.blocks_to_append(["a", "b", "c"])    # block 1 has 3 sharers: 2 copies
        2
        >>> kv.add_sequence("d", [1, 2, 3, 4])      # full last block: d needs a new one
        0
        >>> kv.blocks_to_append(["a", "d"]), kv.blocks_to_append(["d", "d", "d", "d", "d"])
        (2, 2)
        """
        ids = id_list(seq_ids, "blocks_to_append")
        tables = {s: self._seqs.on_gpu(s) for s in ids}  # an unknown or swapped-out id raises
        new_blocks = 0
        writers: Counter[int] = Counter()  # shared partial last block -> sequences writing into it
        for s, k in Counter(ids).items():  # s appends k tokens
            table = tables[s]
            new_blocks += table.blocks_needed(table.num_tokens + k) - len(table.block_ids)
            if table.num_tokens % self.block_size:  # s's first token goes into its last block
                writers[table.block_ids[-1]] += 1
        copies = sum(min(k, self.allocator.refcount(b) - 1) for b, k in writers.items())
        return new_blocks + copies


check("plan")

# %% [markdown]
# ## Your copy-on-write, drawn
#
# Three samples of one prompt on your manager: the prompt's blocks are shared three ways, each
# sample writes one token, and two of them copy the partly filled last block (the third, left
# alone with it, writes in place). (These cells are tagged `demo`: the grader skips them.)

# %% tags=["demo"]
from pagedlearn.viz import draw_block_pool

kv = KVCacheManager(num_blocks=8, block_size=4)
kv.add_sequence("s.0", [1, 2, 3, 4, 5, 6])  # a full block and a half-full one
kv.fork("s.0", "s.1")
kv.fork("s.0", "s.2")
print("blocks the next step needs:", kv.blocks_to_append(["s.0", "s.1", "s.2"]))
draw_block_pool(kv, title="Three samples share the prompt's two blocks")

# %% tags=["demo"]
slots = {s: kv.append_token(s, 7) for s in ["s.0", "s.1", "s.2"]}
print("slots:", slots, "| copies for the engine:", kv.pop_copies())
draw_block_pool(kv, title="After one token each: two copies, one write in place")
