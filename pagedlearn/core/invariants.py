"""The rules a paged KV cache must keep at every moment, checked one by one.

``KVCacheManager.check_invariants()`` calls :func:`check_invariants` with its parts (sequence
tables, pools, prefix cache); the tests call it after every random operation, and a lab can call
it after every step to see that nothing leaked. It costs O(num_blocks + tokens), so it is for
tests, debugging and teaching, not for each step of a server.

1. Every block's refcount equals the number of block-table entries pointing at it (and the
   allocator's count of shared blocks, refcount > 1, agrees).
2. A block is in the free queue exactly when its refcount is 0 -- never both free and in a table,
   never twice in the queue -- and used + free == num_blocks.
3. Every table has exactly ceil(tokens / block_size) entries, its blocks all distinct; the only
   null entries (-1: blocks a sliding window freed, block_table.py) form its head.
4. (Swapping) rules 1-3 hold for the CPU pool too, counting the swapped-out tables (whose ids name
   CPU blocks); no sequence is both on the GPU and swapped out; without a CPU pool, none is out;
   the extra keys (model, adapter, salt) are kept for exactly the sequences that exist.
5. (Prefix caching) every hash maps to a block holding exactly those tokens, after exactly that
   prefix, for the same model / adapter / salt, and the allocator's cached flags match the cache.
   Only GPU blocks are indexed: a swapped-out table's blocks are registered again on swap-in.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from pagedlearn.core.block_allocator import BlockAllocator
from pagedlearn.core.block_table import BlockTable
from pagedlearn.core.prefix_cache import PrefixCache, parent_hash
from pagedlearn.core.sequence_tables import SequenceTables
from pagedlearn.errors import PagedLearnError


def _fail(msg: str) -> None:
    raise PagedLearnError(f"invariant violated: {msg}")


def check_invariants(
    seqs: SequenceTables,
    allocator: BlockAllocator,
    cpu_allocator: BlockAllocator | None,
    prefix_cache: PrefixCache | None,
    block_size: int,
) -> None:
    """Raise :class:`PagedLearnError` naming the first broken invariant of a manager's pools:
    its sequence tables, its GPU (and CPU) allocator and its prefix cache (None: caching off)."""
    tables = seqs.gpu
    _check_pool(allocator, tables.values(), "")  # 1 and 2 on the GPU
    _check_shapes(tables, "")  # 3

    # 4: the CPU swap pool, with the same rules over the swapped-out tables
    swapped = seqs.cpu
    if cpu_allocator is None:
        if swapped:
            _fail(f"{len(swapped)} sequences are swapped out but there is no CPU pool")
    else:
        _check_pool(cpu_allocator, swapped.values(), "CPU ")
        _check_shapes(swapped, "swapped-out ")
    if both := tables.keys() & swapped.keys():
        _fail(f"{next(iter(both))!r} is both on the GPU and swapped out")
    if seqs.extra_keys.keys() != tables.keys() | swapped.keys():
        _fail("the extra keys (model, adapter, salt) are kept for other sequences than exist")

    # 5: the prefix cache says the truth about every block it indexes
    if prefix_cache is None:
        return
    users: dict[int, list[tuple[object, int]]] = {}  # block -> [(seq_id, logical index)]
    for seq_id, t in tables.items():
        for j, b in enumerate(t.block_ids):
            users.setdefault(b, []).append((seq_id, j))
    indexed = set()
    for block_hash, entry in prefix_cache.items():
        b = entry.block_id
        indexed.add(b)
        if len(entry.token_ids) != block_size:
            _fail(f"cached block {b} holds {len(entry.token_ids)} tokens, not a full block")
        rehash = prefix_cache.hash_block(entry.parent_hash, entry.token_ids, entry.extra_keys)
        if rehash != block_hash:
            _fail(f"cached block {b} is stored under a hash of other content")
        for seq_id, j in users.get(b, []):
            t = tables[seq_id]
            if (
                t.block_tokens(j) != list(entry.token_ids)
                or parent_hash(t.block_hashes, j) != entry.parent_hash
                or seqs.extra_keys[seq_id] != entry.extra_keys
            ):
                _fail(
                    f"cached block {b} is used by {seq_id!r} at logical block {j} "
                    "with other tokens or another prefix"
                )
    if indexed != {b for b in range(allocator.num_blocks) if allocator.is_cached(b)}:
        _fail("the allocator's cached blocks differ from the prefix cache's")


def _check_pool(a: BlockAllocator, tables: Iterable[BlockTable], pool: str) -> None:
    """Rules 1 and 2 for one pool: ``tables`` are all the tables whose ids name its blocks."""
    refs = Counter(b for t in tables for b in t.live_blocks())
    free = a.free_queue()
    free_set = set(free)
    if len(free) != len(free_set):
        _fail(f"a block appears twice in the {pool}free queue")
    used = sum(1 for b in range(a.num_blocks) if a.refcount(b) > 0)
    if used + len(free) != a.num_blocks:
        _fail(f"{pool}used ({used}) + free ({len(free)}) != num_blocks ({a.num_blocks})")
    for b in range(a.num_blocks):
        if a.refcount(b) != refs[b]:
            _fail(f"{pool}block {b} has refcount {a.refcount(b)} but {refs[b]} table references")
        # With the check above, this one also rules out a block both free and in a table.
        if (a.refcount(b) == 0) != (b in free_set):
            _fail(f"{pool}block {b} has refcount {a.refcount(b)} but free={b in free_set}")
    if a.num_shared_blocks != sum(1 for b in range(a.num_blocks) if a.refcount(b) > 1):
        _fail(f"the {pool}allocator counts {a.num_shared_blocks} shared blocks, refcounts disagree")


def _check_shapes(tables: dict, kind: str) -> None:
    """Rule 3: each table has ceil(tokens / block_size) entries, its blocks all distinct, its
    null entries (a sliding window's) at its head only."""
    for seq_id, t in tables.items():
        if len(t.block_ids) != t.blocks_needed(t.num_tokens):
            _fail(f"{kind}{seq_id!r} has {len(t.block_ids)} blocks for {t.num_tokens} tokens")
        live = t.live_blocks()
        if len(set(live)) != len(live):
            _fail(f"{kind}{seq_id!r} points at the same block twice")
        if len(live) + t.num_null_blocks != len(t.block_ids):
            _fail(f"{kind}{seq_id!r} has a null entry after a live block")
