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
# # Lab 3: The prefix cache: block hashes, verified lookups, lazy eviction
#
# **What you will build.** The prefix cache of `pagedlearn/core/prefix_cache.py`, the part of the
# KV-cache manager that lets a new request reuse the K/V an earlier request already computed
# for the same leading tokens (a system prompt, few-shot examples, the earlier turns of a
# chat). Six functions, in three exercises:
#
# 1. `hash`: the hash of one full block, and the chain of hashes over a prompt's full blocks;
# 2. `lookup`: a lookup that verifies what it finds, and `match`, the longest cached prefix of
#    a prompt;
# 3. `evict`: registering a block, and forgetting it when its slot is reused (lazy eviction).
#
# At the end, a real model (tiny-gpt2 offline, GPT-2 with network) generates on a KV-cache
# manager that uses **your** prefix cache, and the live view draws its blocks.
#
# **The chapter it practises:** [04 · Prefix caching](../04_prefix_caching.ipynb). Read it first;
# the hints below point to its sections.
#
# **How feedback works.** Each exercise cell defines your functions and ends with
# `check("<exercise>")`, which runs that exercise's checks on your code at once and prints one
# line per check: `PASS`, `FAIL` with what went wrong (the smallest operation sequence that
# shows it, what was expected, what your code gave; for the whole-manager checks, a picture of
# your pool beside the reference's), or `TODO` while the stub is still there (then "Run all"
# stops at that cell). The stub's message says what to do.
#
# **Grade yourself** (the grader an instructor uses, with the points):
#
# ```
# python -m pagedlearn grade prefix 03_prefix.ipynb
# ```

# %%
from pagedlearn.labs.feedback import start

check = start("prefix", globals())

# %% [markdown]
# ## Exercise `hash`: the block-hash chain
#
# The K/V of a token depend on every token before it, so a block's identity is its own tokens
# **and** everything before it. A block's hash is `H(parent hash, token ids of the block, extra
# keys)`, where the parent hash is the previous block's hash, or the fixed `ROOT_HASH` for the
# first block: the hash of block *j* names the whole prefix up to the end of block *j*. The extra
# keys (`make_extra_keys(model_id, adapter_id, cache_salt)`) hold what must never be shared
# across: another model, another LoRA adapter, another tenant's cache salt.
#
# **`hash_block(parent_hash, token_ids, extra_keys)`** returns a SHA-256 digest (32 bytes). The
# checks compare your hashes with the package's byte for byte, so use its serialisation:
#
# - start from `hashlib.sha256(parent_hash)`;
# - then feed the token ids as `struct.pack(f"<I{n}q", n, *token_ids)` with `n =
#   len(token_ids)`: the count as a 4-byte unsigned int, then each id as an 8-byte signed int,
#   little-endian. Fixed widths with the count first mean that no two token lists serialise
#   alike (think of `[1, 2]` and `[1, 2, 0]`, or `[12]` and `[1, 2]` written as text);
# - then feed `repr(extra_keys).encode()`: the `repr` of a tuple of strings, ints and `None` is
#   the same in every process, unlike the built-in `hash()`, which is salted per process for
#   strings (and is 64 bits, and easy to collide on purpose);
# - return `.digest()`.
#
# **`hash_blocks(token_ids, block_size, extra_keys)`** returns the hash of every *full* block, in
# order. A partial last block has no hash: it is still being written, and only full blocks are
# ever cached. The helper `parent_hash(hashes, j)` (given) is the hash block `j` chains on.
#
# Hints: chapter 04, "The hash chain" and "Extra keys: who may share". A test you can do by
# hand: the same tokens after two different prefixes must get two different hashes.


# %% tags=["exercise"]
# Exercise 'hash': The block-hash chain
def hash_block(parent_hash: bytes, token_ids: Sequence[int], extra_keys: tuple = ()) -> bytes:
    """SHA-256 of (parent hash, the block's token ids, extra keys); 32 bytes."""
    h = hashlib.sha256(parent_hash)
    # Fixed-width little-endian ints, length first: no two token lists serialise alike.
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    # repr of a tuple of str / int / None is deterministic across runs (unlike hash()).
    h.update(repr(extra_keys).encode())
    return h.digest()


def hash_blocks(token_ids: Sequence[int], block_size: int, extra_keys: tuple) -> list[bytes]:
    """The chained hash of every full block of ``token_ids``, in order (a partial tail has none).

    >>> hashes = hash_blocks([1, 2, 3, 4, 5], 2, ())  # two full blocks; the tail [5] has none
    >>> len(hashes), hashes[1] == hash_block(hashes[0], [3, 4], ())  # block 1 chains on block 0
    (2, True)
    """
    hashes: list[bytes] = []
    parent = ROOT_HASH  # block 0 chains on the root, block j on block j - 1
    for first in range(0, len(token_ids) - block_size + 1, block_size):  # each full block
        parent = hash_block(parent, token_ids[first : first + block_size], extra_keys)
        hashes.append(parent)
    return hashes


check("hash")

# %% [markdown]
# ## Exercise `lookup`: a verified lookup, and the longest cached prefix
#
# `PrefixCache` keeps two dicts (see its `__init__`): `self._by_hash` maps a block hash to a
# `CachedBlock(block_id, parent_hash, token_ids, extra_keys)`, the content that block holds, and
# `self._hash_of` maps a block id back to its hash.
#
# **`lookup(block_hash, parent_hash, token_ids, extra_keys)`** returns the id of the block that
# holds exactly this content, or `None`. Finding an entry under the hash is not enough: compare
# the entry's parent hash, token ids (stored as a tuple) and extra keys with the arguments. With
# SHA-256 a collision is astronomically unlikely, but the check makes the worst case a cache
# miss (the tokens are computed again) instead of a sequence that silently reads another
# prompt's K/V. The checks plant an entry under a hash with other tokens, and expect a miss.
#
# **`match(token_ids, block_size, extra_keys)`** hashes the prompt's full blocks
# (`hash_blocks`) and returns `(hashes, hits)`: `hits` are the ids of the cached blocks that hold
# the prompt's longest cached prefix. Walk the blocks from the first one and stop at the first
# miss: a block after a miss was computed after *other* tokens. (With chained hashes such a
# block cannot even be found; here the checks plant one, to see that you stop.) And never cover
# the whole prompt: the model must compute at least the last prompt token, whose logits give
# the first new token, so try at most `(len(token_ids) - 1) // block_size` blocks. `match`
# changes nothing; the manager acts on its answer.
#
# The match checks use the reference's `lookup`, so a mistake in one does not show up as a
# mistake in the other; they do use your `hash_blocks`.
#
# Hints: chapter 04, "Cold and warm: two chats with one system prompt" (how many tokens a
# prompt finds, and why the last block is computed).


# %% tags=["exercise"]
# Exercise 'lookup': Verified lookup and the longest cached prefix
class PrefixCache(PrefixCache):  # the class so far, with these methods yours
    def lookup(
        self, block_hash: bytes, parent_hash: bytes, token_ids: Sequence[int], extra_keys: tuple
    ) -> int | None:
        """The block holding exactly this content, or None (a miss, or a hash collision)."""
        entry = self._by_hash.get(block_hash)
        if entry is None:
            return None
        same = (
            entry.parent_hash == parent_hash
            and entry.token_ids == tuple(token_ids)
            and entry.extra_keys == extra_keys
        )
        return entry.block_id if same else None

    def match(
        self, token_ids: Sequence[int], block_size: int, extra_keys: tuple
    ) -> tuple[list[bytes], list[int]]:
        """Hash a prompt's full blocks and find the cached blocks that hold its longest prefix;
        returns ``(hashes, hits)``. Changes nothing.

        The hits run from the first block to the first miss, and never cover the whole prompt:
        its last token must be computed to get logits, so at most ``(len(token_ids) - 1) //
        block_size`` blocks hit (vLLM and nano-vllm cap it the same way).
        """
        hashes = hash_blocks(token_ids, block_size, extra_keys)
        hits: list[int] = []
        for j in range((len(token_ids) - 1) // block_size):
            tokens = token_ids[j * block_size : (j + 1) * block_size]
            block = self.lookup(hashes[j], parent_hash(hashes, j), tokens, extra_keys)
            if block is None:
                break
            hits.append(block)
        return hashes, hits


check("lookup")

# %% [markdown]
# ## Exercise `evict`: insert, and lazy eviction
#
# **`insert(block_hash, block_id, parent_hash, token_ids, extra_keys)`** registers a full block
# and returns whether it did. The first block stored under a hash keeps it: when two sequences
# computed the same content in two blocks, the second copy is not indexed (and a block already
# indexed is not indexed twice). The manager relies on the answer: when `insert` returns `True`
# it marks the block *cached* in the allocator, so that once the block is free it waits in the
# free queue's cached part, least recently used first, instead of being handed out as empty.
#
# **`evict(block_id)`** forgets a block. A free cached block stays findable until the allocator
# hands its slot out for new data (lazy eviction: nothing is thrown away before the space is
# needed). At that moment the manager calls `evict` on it: the block's hash must disappear from
# *both* dicts. A hash left in `self._by_hash` is a stale entry: the next prompt with that prefix
# would be pointed at a block that now holds someone else's K/V. Return the hash you removed, or
# `None` when the block was not cached.
#
# The LRU order itself is the allocator's (lab 1). So the last checks of this exercise run a
# whole `KVCacheManager` on your prefix cache beside the reference one, on fixed scenarios
# (eviction, cache salts) and on random sequences of `add_sequence`, `append_token` and
# `free_sequence`, and compare the reused tokens, the block tables, what the cache indexes, the
# free queue and the evictions after every operation.
#
# Hints: chapter 04, "Eviction: least recently used first".


# %% tags=["exercise"]
# Exercise 'evict': Insert and lazy eviction
class PrefixCache(PrefixCache):  # the class so far, with these methods yours
    def insert(
        self,
        block_hash: bytes,
        block_id: int,
        parent_hash: bytes,
        token_ids: Sequence[int],
        extra_keys: tuple,
    ) -> bool:
        """Register a full block. The first block stored under a hash keeps it (a second copy of
        the same content is not indexed); returns whether this block was registered."""
        if block_hash in self._by_hash or block_id in self._hash_of:
            return False
        self._by_hash[block_hash] = CachedBlock(block_id, parent_hash, tuple(token_ids), extra_keys)
        self._hash_of[block_id] = block_hash
        return True

    def evict(self, block_id: int) -> bytes | None:
        """Forget the hash of a block whose slot is being reused; returns that hash."""
        block_hash = self._hash_of.pop(block_id, None)
        if block_hash is not None:
            del self._by_hash[block_hash]
        return block_hash


check("evict")

# %% [markdown]
# ## Your prefix cache serves a model
#
# `your_kv_cache_manager(...)` builds a `KVCacheManager` class from your labs: the
# `PrefixCache` (and the `hash_block`) defined in this notebook, and your allocator, block table,
# fork and copy-on-write from the notebooks of labs 1 and 2 beside this one (`nearby` finds
# them). Each of those is graded first and used only if it passes every check; until then that
# part is the reference's. It prints which parts are whose. `LLM(..., kv_cache_manager=Manager)`
# serves a model on it.
#
# Three chats with one system prompt arrive a few steps apart. Watch the live view: the system
# prompt's full blocks are computed once, registered by your `insert`, found by your `match` for
# the next chats (shared blocks, marked `x2`), and they stay grey -- free but cached -- after
# the chats finish. Press **Play** in Jupyter; a headless run steps it from code. The
# numbers printed below come from your cache: how many prompt tokens each chat found, and the
# manager's invariants (every cached block holds what its hash says) checked at the end.
#
# This cell is not part of what the grader runs (it is tagged `demo`).

# %% tags=["demo"]
from IPython.display import display

from pagedlearn import LLM, SamplingParams
from pagedlearn.cli.notebook import setup
from pagedlearn.labs.plug import nearby, your_kv_cache_manager
from pagedlearn.viz import LiveBlockView, draw_block_pool

env = setup()
# Your prefix cache (this notebook) on your allocator and copy-on-write (labs 1 and 2, read from
# their notebooks beside this one and graded first: one not passing yet is the reference's).
Manager = your_kv_cache_manager(allocator=nearby("allocator"), cow=nearby("cow"), prefix=globals())
llm = LLM(env.gpt2, num_blocks=32, block_size=8, kv_cache_manager=Manager, verbose=False)
view = LiveBlockView(llm, delay=0.3)
display(view)

SYSTEM = "System: you are a helpful assistant; answer in one short sentence.\n"
greedy = SamplingParams(max_tokens=8, ignore_eos=True)
finished = []
for i, question in enumerate(["what is a KV cache?", "why blocks?", "what is paging?"]):
    llm.engine.add_request(f"chat-{i + 1}", SYSTEM + "User: " + question, greedy)
    finished += view.run(max_steps=3)  # the next chat arrives while this one still runs
title = "chats 2 and 3 share the system prompt's blocks: your match found them"
shared = draw_block_pool(llm, per_row=16, title=title)  # a still picture, for readers
finished += view.run()
for out in sorted(finished, key=lambda o: o.request_id):
    found = out.num_cached_tokens
    print(f"{out.request_id}: {found} prompt tokens found in your prefix cache")
llm.engine.kv.check_invariants()  # raises, naming the rule, if your cache broke one
print("the manager's invariants hold on your prefix cache")
print(llm.engine.stats().summary())
display(shared)
