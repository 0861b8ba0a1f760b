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
# # Lab 1: The block pool and the block table
#
# **What you will build.** The two smallest parts of the paged KV cache, the ones everything
# else stands on, in two exercises:
#
# 1. `pool`: the physical block pool of `pagedlearn/core/block_allocator.py` -- `allocate`,
#    `incref` and `free` of `BlockAllocator`: which blocks are free, in which order they are
#    handed out, and how many block tables point at each one;
# 2. `table`: one sequence's block table of `pagedlearn/core/block_table.py` -- how many blocks a
#    number of tokens needs, and the *slot* of each token (where its K/V is written).
#
# The KV-cache manager, the scheduler and the engine of the later labs run on this code: in
# lab 3 a real model generates on your allocator.
#
# **The chapter it practises:** [02 · Block tables and the block allocator](
# ../02_block_tables_and_the_allocator.ipynb). Read it first; the hints below point to its
# sections.
#
# **How feedback works.** Each exercise cell defines your code and ends with
# `check("<exercise>")`, which runs that exercise's checks on it at once and prints one line per
# check: `PASS`; `FAIL` with what went wrong -- the shortest sequence of calls that shows it,
# what was expected and what your code gave -- and a picture of your pool beside the
# reference's; or `TODO` while the stub is still there (then "Run all" stops at that cell, with
# the stub's message saying what to do).
#
# **Grade yourself** (the grader an instructor uses, with the points):
#
# ```
# python -m pagedlearn grade allocator 01_allocator.ipynb
# ```

# %%
from pagedlearn.labs.feedback import start

check = start("allocator", globals())


# %% [markdown]
# ## Exercise `pool`: allocate, share, free
#
# A block is only an id, `0 .. num_blocks-1`. `__init__` (given) sets up what your three
# methods keep up to date:
#
# - `self._refcounts[b]`: how many block tables point at block `b` (0: the block is free);
# - two free queues, `OrderedDict`s used as ordered sets (keys are block ids, values `None`):
#   `self._free_empty`, blocks that hold nothing, and `self._free_cached`, free blocks that
#   still hold a prefix the prefix cache can find, **least recently freed first**;
#   `self._cached` is the set of blocks (used or free) that hold cached KV (`mark_cached`, given,
#   adds to it);
# - `self.num_evictions`, `self.on_evict` (a callback, or `None`), and `self._num_shared`, the
#   number of blocks whose refcount is above 1 (kept as you go, so that `num_shared_blocks` is
#   O(1)).
#
# The rules the checks enforce:
#
# - **`allocate(n)`** hands out `n` blocks, refcount 0 -> 1, in the order of `free_queue()`:
#   empty blocks first, oldest first; only then cached blocks, least recently freed first. A
#   cached block handed out is *evicted*: its KV is about to be overwritten, so it is no longer
#   cached, `num_evictions` counts it and `on_evict(block_id)` is called. `n` must be an int
#   `>= 0` (else `PagedLearnError`); when fewer than `n` blocks are free, raise
#   `OutOfBlocksError(n, free, total)` and hand out **nothing** (all or nothing).
# - **`incref(ids)`** adds one reference per id (an id may appear twice). A free *cached* block
#   can be shared -- that is a prefix-cache hit -- and leaves the free queue; a free empty block
#   cannot (allocate it instead). Bad ids and that case raise `PagedLearnError`.
# - **`free(ids)`** drops one reference per id; a block whose count reaches 0 joins the **back**
#   of its queue (cached or empty). Freeing a block more times than it is referenced (a double
#   free, also `free([b, b])` on a block with refcount 1) raises `PagedLearnError`.
# - Every method checks its whole input **before** changing anything: an error leaves the pool
#   exactly as it was. `self._check_ids(ids)` (given) raises for a bad id; `ids` may be any
#   iterable, even one that can be walked only once.
#
# Every operation should be O(1) per block: `OrderedDict.popitem(last=...)` takes from either
# end, `del queue[b]` unlinks a block from the middle.
#
# The checks compare your pool with the reference's after every call: what it returned (or the
# kind of error it raised), every refcount, `free_queue()` in order, the cached blocks,
# `num_shared_blocks`, `num_evictions` and the ids given to `on_evict`. Hints: chapter 02, "The
# free queue" and "A full pool: `OutOfBlocksError`, and nothing changes".


# %% tags=["exercise"]
# Exercise 'pool': The block pool: allocate, share, free
class BlockAllocator(BlockAllocator):  # the class so far, with these methods yours
    def allocate(self, n: int = 1) -> list[int]:
        """Take ``n`` free blocks (refcount 0 -> 1), all or nothing.

        Raises :class:`OutOfBlocksError`, changing nothing, when fewer than ``n`` are free.
        """
        if (type(n) is not int and not _is_int(n)) or n < 0:  # plain ints: one test
            raise PagedLearnError(f"allocate(n) needs an int n >= 0, got {n!r}")
        empty = self._free_empty
        if n <= len(empty):  # the common case: empty blocks suffice, nothing is evicted
            ids = [empty.popleft()] if n == 1 else [empty.popleft() for _ in range(n)]
        elif n > self.num_free_blocks:
            raise OutOfBlocksError(n, self.num_free_blocks, self._num_blocks)
        else:  # every empty block, then cached ones, least recently used first: evicted
            ids = list(empty)
            empty.clear()
            while len(ids) < n:
                block_id, _ = self._free_cached.popitem(last=False)
                self._cached.discard(block_id)
                self.num_evictions += 1
                if self.on_evict is not None:
                    self.on_evict(block_id)
                ids.append(block_id)
        for b in ids:
            self._refcounts[b] = 1
        return ids

    def incref(self, ids: Iterable[int]) -> None:
        """Add one reference per id (sharing). A free *cached* block is taken back out of the free
        queue (a prefix-cache hit); a free empty block cannot be shared -- allocate it instead."""
        ids = ids if type(ids) is list else list(ids)  # (a generator can be read only once)
        refs, cached, n = self._refcounts, self._cached, self._num_blocks
        for b in ids:  # check every id before changing anything (plain int ids: one test each)
            if type(b) is not int or not 0 <= b < n or (refs[b] == 0 and b not in cached):
                self._check_ids(ids)  # raises, naming the first bad id
                if refs[b] == 0 and b not in cached:
                    raise PagedLearnError(f"incref of block {b}: it is free and holds no cached KV")
        for b in ids:
            if refs[b] == 0:
                del self._free_cached[b]  # O(1): OrderedDict unlinks the node
            elif refs[b] == 1:
                self._num_shared += 1
            refs[b] += 1

    def free(self, ids: Iterable[int]) -> None:
        """Drop one reference per id; a block whose count reaches 0 joins the free queue.

        Cached blocks join the back of the LRU queue (most recently used), so they are evicted
        last. Freeing a block more times than it is referenced raises, changing nothing.
        """
        ids = ids if type(ids) is list else list(ids)  # (a generator can be read only once)
        refs, n = self._refcounts, self._num_blocks
        # Check everything before changing anything. A double free frees a block more times than
        # it is referenced: only a free block or an id listed twice can be one, and counting the
        # ids (a Counter) costs more than the rest of free, so they are counted only then.
        count = len(ids) > 1 and len(set(ids)) < len(ids)  # an id listed twice
        for b in ids:
            if type(b) is not int or not 0 <= b < n or refs[b] == 0:
                self._check_ids(ids)  # raises, naming the first bad id
                count = True
        if count:
            for b, times in Counter(ids).items():
                if times > refs[b]:
                    raise PagedLearnError(
                        f"double free: block {b} freed {times}x but has refcount {refs[b]}"
                    )
        cached, lru, empty = self._cached, self._free_cached, self._free_empty
        for b in ids:
            refs[b] -= 1
            if refs[b] == 0:
                if b in cached:
                    lru[b] = None  # the back of the LRU queue: evicted last
                else:
                    empty.append(b)
            elif refs[b] == 1:
                self._num_shared -= 1


check("pool")


# %% [markdown]
# ## Exercise `table`: blocks and slots
#
# A sequence sees its KV as contiguous: token `i` is in *logical* block `i // block_size`, at
# offset `i % block_size`. The table's `block_ids[j]` is the *physical* block holding logical
# block `j`, and the **slot** of token `i` is its row in the flattened KV slab
# `(num_blocks * block_size, ...)`: the start of its physical block plus its offset.
#
# - **`blocks_needed(num_tokens)`**: how many blocks `num_tokens` tokens occupy -- a partly
#   filled block counts (0 tokens need 0 blocks).
# - **`slot(i)`**: the slot of token position `i`; a position outside `0 .. num_tokens - 1`
#   raises `IndexError` (negative ones too: `-1` is not "the last token" here).
# - **`slot_mapping()`**: the slot of every position, in order -- the list the KV-write kernel
#   consumes.
#
# Check yourself on the chapter's example: `block_size` 4, `block_ids` `[7, 2, 11]`, 10
# tokens; token 5 is in slot 9. Hint: chapter 02, "Logical blocks, physical blocks and slots".


# %% tags=["exercise"]
# Exercise 'table': One sequence's block table: blocks and slots
class BlockTable(BlockTable):  # the class so far, with these methods yours
    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that ``num_tokens`` tokens occupy: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def slot(self, i: int) -> int:
        """Row of the KV slab holding token position ``i``."""
        if not 0 <= i < self.num_tokens:
            raise IndexError(f"token position {i} out of range for {self.num_tokens} tokens")
        return self.block_ids[i // self.block_size] * self.block_size + i % self.block_size

    def slot_mapping(self, start: int = 0) -> list[int]:
        """One slot per token position, ``start`` .. num_tokens-1 (what the KV write kernel
        consumes: the engine asks from the first position it has not computed yet), with -1
        ("skip") where a sliding window freed the block.

        Built a block at a time: a block's slots are consecutive, so one ``slot`` call per block
        gives the first and a ``range`` the rest (tests check it against ``slot`` per position).

        >>> BlockTable(4, [-1, 2, 11], list(range(10))).slot_mapping(start=3)
        [-1, 8, 9, 10, 11, 44, 45]
        """
        bs, ids, end, slots = self.block_size, self.block_ids, self.num_tokens, []
        if start < 0:
            raise IndexError(f"token position {start} out of range for {end} tokens")
        for j in range(start // bs, -(-end // bs) if start < end else 0):
            lo, hi = max(start, j * bs), min(end, (j + 1) * bs)  # positions lo..hi-1 in block j
            if ids[j] == NULL_BLOCK:
                slots.extend([NULL_BLOCK] * (hi - lo))
            else:
                first = self.slot(lo)
                slots.extend(range(first, first + hi - lo))
        return slots


check("table")

# %% [markdown]
# ## Your pool, drawn
#
# The package's own drawing of a pool, on your allocator: a prompt's blocks, two of them shared
# by a second sequence (hatched, `x2`); then, once everyone is done, those two still hold a
# cached prefix (grey) and are handed out last, the least recently freed first. Change the
# calls and run it again. (These cells are tagged `demo`: the grader skips them.)

# %% tags=["demo"]
from IPython.display import display

from pagedlearn.labs.allocator import allocator_state
from pagedlearn.viz import draw_block_pool

pool = BlockAllocator(8)
prompt = pool.allocate(3)  # a prompt's three blocks
pool.incref(prompt[:2])  # a second sequence shares the first two
for b in prompt[:2]:
    pool.mark_cached(b)  # full blocks that the prefix cache indexes
other = pool.allocate(3)
display(draw_block_pool(allocator_state(pool), title="Two sequences share blocks 0 and 1"))
pool.free(prompt)
pool.free(prompt[:2])  # the sharer finishes too: blocks 0 and 1 are free, and still cached
pool.free(other[1:])
print("free queue (next allocation first):", pool.free_queue())
draw_block_pool(allocator_state(pool), title="Everyone is done: 0 and 1 are free but cached")

# %% tags=["demo"]
late = pool.allocate(6)  # every empty block first, then the least recently freed cached one
print(f"allocate(6) -> {late}; free queue: {pool.free_queue()}; evictions: {pool.num_evictions}")
