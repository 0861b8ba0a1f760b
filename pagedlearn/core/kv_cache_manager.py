"""The KV-cache manager: what a serving engine's scheduler talks to (vLLM v1's KVCacheManager).

It never touches a tensor: it answers "where does token i's K/V go?" (``append_token`` returns a
slot) and "which blocks must be copied before the next kernel runs?" (``pop_copies``, ``swap_out``,
``swap_in``); the engine applies those to the KV tensors. This file holds what changes blocks
(add, append with copy-on-write, fork, free, swap); the questions that change nothing
(``block_table``, ``slot_mapping``, ``stats``...) it inherits from :class:`KVCacheQueries`.

Copy-on-write: ``fork`` shares every block (refcount +1). The first write into a *shared, partly
filled* last block copies it first: a fresh block, a pending ``(src, dst)`` copy, one reference
less on ``src``. The sibling that writes next owns ``src`` alone and copies nothing. Any operation
that raises leaves every table, refcount and cache entry as it was.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable

from pagedlearn.core.block_allocator import BlockAllocator
from pagedlearn.core.block_table import NULL_BLOCK, BlockTable
from pagedlearn.core.kv_cache_pool import KVCachePool
from pagedlearn.core.kv_cache_queries import KVCacheQueries
from pagedlearn.core.prefix_cache import ROOT_HASH, PrefixCache, make_extra_keys, parent_hash
from pagedlearn.core.sequence_tables import SequenceTables, check_token, check_tokens, id_list
from pagedlearn.errors import OutOfBlocksError, PagedLearnError
from pagedlearn.trace.block_events import BlockEvents
from pagedlearn.trace.events import StepMarker


class KVCacheManager(KVCacheQueries):
    """Paged KV-cache bookkeeping for many sequences sharing one pool of ``num_blocks`` blocks.

    >>> kv = KVCacheManager(num_blocks=8, block_size=4)
    >>> kv.add_sequence("a", [1, 2, 3, 4, 5])      # 5 tokens -> 2 blocks; returns reused tokens
    0
    >>> kv.block_table("a"), kv.slot_mapping("a")
    ([0, 1], [0, 1, 2, 3, 4])
    >>> kv.fork("a", "b"); kv.append_token("b", 9)  # b writes into the shared block 1: CoW
    9
    >>> kv.pop_copies()                               # the engine copies block 1 -> block 2
    [(1, 2)]
    """

    # Its parts, as class attributes: the labs plug a student's in (labs/plug.py).
    allocator_class = BlockAllocator
    block_table_class = BlockTable
    prefix_cache_class = PrefixCache
    # Whether remove_skipped_blocks can free anything: a scheduler skips calling it otherwise.
    has_sliding_window = False

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        model_id: Hashable = None,
        num_cpu_blocks: int = 0,
        *,
        pool: KVCachePool | None = None,
        group: str | None = None,
    ) -> None:
        """Its own pool of blocks, or the ``pool`` hybrid/'s coordinator shares, named ``group``."""
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise PagedLearnError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.model_id = model_id  # part of every block hash: no sharing across models
        if pool is None:
            pool = KVCachePool(
                num_blocks,
                num_cpu_blocks,
                enable_prefix_caching,
                self.allocator_class,
                self.prefix_cache_class,
            )
        self.pool = pool
        self.allocator, self.prefix_cache, self.trace = (
            pool.allocator,
            pool.prefix_cache,
            pool.trace,
        )
        self.cpu_allocator = pool.swap.cpu_allocator  # None: no swapping
        self._copies = pool.copies  # pending copy-on-write (src, dst), shared by a pool's groups
        self._seqs = SequenceTables()  # every sequence's table, on the GPU or swapped out
        self._sizer = self.block_table_class(block_size)  # an empty table: blocks_needed asks it
        self._events = BlockEvents(self.trace, group)
        self._marker = StepMarker()
        self._counters = {
            "prefix_query_tokens": 0,
            "prefix_hit_tokens": 0,
            "cow_copies": 0,
            "allocation_failures": 0,
            "swap_out_blocks": 0,
            "swap_in_blocks": 0,
        }

    # --- the sequence lifecycle ----------------------------------------------------------------
    def add_sequence(
        self,
        seq_id: Hashable,
        token_ids: Iterable[int],
        cache_salt: Hashable = None,
        adapter_id: Hashable = None,
    ) -> int:
        """Give a new sequence blocks for its prompt; returns how many prompt tokens reuse cached
        KV (whole blocks, never the last token: ``PrefixCache.match``), whose prefill can be
        skipped. :class:`OutOfBlocksError`, changing nothing, if the prompt does not fit."""
        self._seqs.check_new(seq_id)
        tokens = check_tokens(token_ids)
        extra = make_extra_keys(self.model_id, adapter_id, cache_salt)
        hashes, hits = self._find_prefix(tokens, extra)
        return self._add_found(seq_id, tokens, extra, hashes, hits)

    def _add_found(
        self, seq_id: Hashable, tokens: list[int], extra: tuple, hashes: list, hits: list[int]
    ) -> int:
        """:meth:`add_sequence` once ``hits`` are known (the coordinator finds every group's
        first, so that all groups reuse as many)."""
        bs = self.block_size
        # Hits that sit in the free queue are taken out of it, so they count against free space.
        # (A sliding group's hits may start with NULL_BLOCK entries: blocks its window skips.)
        live_hits = [b for b in hits if b != NULL_BLOCK] if hits else hits
        revived = sum(1 for b in live_hits if self.allocator.refcount(b) == 0) if hits else 0
        num_new = -(-len(tokens) // bs) - len(hits)  # ceil(tokens / block_size), less the hits
        if num_new + revived > self.allocator.num_free_blocks:
            self._counters["allocation_failures"] += 1
            raise OutOfBlocksError(
                num_new + revived,
                self.allocator.num_free_blocks,
                self.allocator.num_blocks,
                what=f"add_sequence({seq_id!r}) with {len(tokens)} tokens",
            )
        # Nothing below can fail. Incref the hits first so that allocate cannot evict them.
        if hits:
            self.allocator.incref(live_hits)
            self._events.cache_hit(seq_id, live_hits, skipped=len(hits) - len(live_hits))
        new = self._allocate(num_new, seq_id)
        self._events.allocate(seq_id, new)
        table = self.block_table_class(bs, hits + new, tokens, hashes)
        self._seqs.add(seq_id, table, extra)
        if self.prefix_cache is not None:
            # Register the prompt's full blocks now: the prefill that follows writes their KV,
            # and a request with the same prefix arriving next step can already share them.
            self._index_blocks(seq_id, table, start=len(hits))
            self._counters["prefix_query_tokens"] += len(tokens)
            self._counters["prefix_hit_tokens"] += len(hits) * bs
        return len(hits) * bs

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

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Make ``child_id`` a copy of ``parent_id`` that shares all its blocks (no KV copied)."""
        parent = self._seqs.on_gpu(parent_id)
        self._seqs.check_new(child_id)
        blocks = parent.live_blocks()  # a sliding window's null entries stay null in both
        self.allocator.incref(blocks)
        self._seqs.add(child_id, parent.copy(), self._seqs.extra_keys[parent_id])
        self._events.incref(parent_id, child_id, blocks)

    def fork_prefix(self, parent_id: Hashable, child_id: Hashable, num_tokens: int) -> None:
        """Make ``child_id`` share the first ``num_tokens`` tokens (whole blocks) of ``parent_id``,
        then append its own (refusals: :meth:`check_fork_prefix`); a recomputed request's samples
        share their prompt again so (engine/readmission.py). Whole blocks: a shared partial block
        would be copied on the child's first write, before the forward pass has written it."""
        self.check_fork_prefix(parent_id, child_id, num_tokens)
        source, bs, n = self._seqs.on_gpu(parent_id), self.block_size, num_tokens
        k = n // bs
        prefix = self.block_table_class(
            bs, source.block_ids[:k], source.token_ids[:n], source.block_hashes[:k]
        )
        self.allocator.incref(prefix.live_blocks())
        self._seqs.add(child_id, prefix, self._seqs.extra_keys[parent_id])
        self._events.incref(parent_id, child_id, prefix.live_blocks(), prefix=k)

    def free_sequence(self, seq_id: Hashable) -> None:
        """Free a finished or aborted sequence's GPU or CPU blocks; cached ones stay findable."""
        on_cpu = self._seqs.is_swapped(seq_id)
        # Tail first: a tail is the least likely to be shared, so it should be evicted first --
        # freeing it first puts it nearer the front of the LRU queue.
        blocks = self._seqs.table(seq_id).live_blocks()[::-1]
        (self.cpu_allocator if on_cpu else self.allocator).free(blocks)
        self._events.free(seq_id, blocks, cpu=on_cpu)
        self._seqs.remove(seq_id)

    def pop_copies(self) -> list[tuple[int, int]]:
        """Pending copy-on-write copies ``(src, dst)``, cleared on read: apply them before the
        next attention call, after this step's swap copies (swap.py says why)."""
        copies = list(self._copies)
        self._copies.clear()  # in place: the groups of a coordinator share this list
        return copies

    def remove_skipped_blocks(self, seq_id: Hashable, num_computed_tokens: int) -> int:
        """Free the blocks no query from ``num_computed_tokens`` on reads again; returns how many
        (vLLM's name): 0 with full attention (hybrid/sliding_window_manager.py frees a window's)."""
        self._seqs.on_gpu(seq_id)  # an unknown or swapped-out id raises, as elsewhere
        return 0

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (vLLM's name), e.g. after new weights; returns how many blocks
        were dropped (a ``cache_reset`` event names them). Refused, as in vLLM, while a sequence
        holds blocks: they are in the cache too, and would go on registering pre-reset blocks."""
        held = self.sequences() + self.swapped_sequences()
        if held:
            raise PagedLearnError(
                f"reset_prefix_cache refused: {len(held)} sequences still hold blocks "
                f"({', '.join(map(repr, held[:4]))}{', ...' if len(held) > 4 else ''}); "
                "free them (finish or abort their requests) first"
            )
        if self.prefix_cache is None:
            return 0
        return len(self.pool.drop_free_cached_blocks())

    # --- swapping (swap.py: the rules, the copy order, the code) -------------------------------
    def swap_out(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """:meth:`SwapSpace.swap_out`: one request's samples to the CPU pool."""
        copies = self.pool.swap.swap_out(self._seqs, seq_ids, self._events)
        self._counters["swap_out_blocks"] += len(copies)
        return copies

    def swap_in(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """:meth:`SwapSpace.swap_in`: a swapped-out group back to the GPU."""
        swap = self.pool.swap
        copies = swap.swap_in(self._seqs, seq_ids, self._events, self._allocate, self._index_blocks)
        self._counters["swap_in_blocks"] += len(copies)
        return copies

    # --- planning a step ------------------------------------------------------------------------
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

    # --- internals (swap_in hands _allocate and _index_blocks to the swap space) ----------------
    def _allocate(self, n: int, seq_id: Hashable, what: str = "") -> list[int]:
        """``n`` fresh GPU blocks for ``seq_id`` (``what`` names the request in an
        :class:`OutOfBlocksError`). A cached one loses its entry: an ``evict`` event names it."""
        try:
            blocks = self.allocator.allocate(n)
        except OutOfBlocksError as e:
            self._counters["allocation_failures"] += 1
            raise OutOfBlocksError(e.needed, e.free, e.total, what=what) from None
        if self.prefix_cache is not None:
            for b in blocks:
                if (block_hash := self.prefix_cache.evict(b)) is not None:  # it was cached
                    self._events.evict(seq_id, b, block_hash)
        return blocks

    def _cache_full_block(self, seq_id: Hashable, table: BlockTable) -> None:
        """Hash ``table``'s just-filled last block (chained on the one before) and register it."""
        j = table.num_full_blocks - 1
        parent, extra = parent_hash(table.block_hashes, j), self._seqs.extra_keys[seq_id]
        table.block_hashes.append(
            self.prefix_cache.hash_block(parent, table.block_tokens(j), extra)
        )
        self._index_blocks(seq_id, table, start=j)

    def _index_blocks(self, seq_id: Hashable, table: BlockTable, start: int = 0) -> None:
        """Index ``table``'s hashed full blocks from logical block ``start`` on."""
        if self.prefix_cache is None:
            return
        extra, bs = self._seqs.extra_keys[seq_id], self.block_size
        tokens, hashes, insert = table.token_ids, table.block_hashes, self.prefix_cache.insert
        listening = self.trace.listening
        for j in range(start, len(hashes)):  # a prompt registers many: few calls per block
            block = table.block_ids[j]
            if block == NULL_BLOCK:  # freed by a sliding window: nothing there to find
                continue
            block_tokens = tokens[j * bs : (j + 1) * bs]
            parent = hashes[j - 1] if j else ROOT_HASH  # parent_hash(hashes, j)
            if insert(hashes[j], block, parent, block_tokens, extra):
                self.allocator.mark_cached(block)
                if listening:
                    self._events.cache_store(seq_id, block, hashes[j], block_tokens, parent)
