"""The KV-cache manager: block tables, sharing, copy-on-write, prefix caching and swapping.

This is what a serving engine's scheduler talks to (vLLM calls its version the block manager or
KV cache manager). It owns

- one :class:`BlockTable` per sequence (logical -> physical blocks, tokens, slots), kept in a
  :class:`SequenceTables` that knows which are on the GPU and which are swapped out,
- its :class:`KVCachePool` (kv_cache_pool.py), built from its arguments: a
  :class:`BlockAllocator` (block_allocator.py: which physical blocks are free, refcounts), a
  prefix cache when ``enable_prefix_caching`` (hash -> block for full blocks: the
  :class:`PrefixCache` of prefix_cache.py), a CPU swap pool when ``num_cpu_blocks > 0``
  (swap.py), the pending copies, and a :class:`Trace` that announces every block operation
  (trace/events.py; block_events.py emits them).

It never touches a tensor. It answers "where does token i's K/V go?" (``append_token`` returns a
slot) and "which blocks must be copied before the next kernel runs?" (``pop_copies``,
``swap_out``, ``swap_in``); the engine applies those to the KV tensors. This file holds what
changes blocks; the questions that change nothing (``block_table``, ``slot_mapping``,
``num_tokens``, ``stats``...) it inherits from :class:`KVCacheQueries` (kv_cache_queries.py).

Rules worth knowing:

- Blocks are allocated on demand, one per ``block_size`` tokens; at most the last block of a
  sequence is partly empty.
- ``fork`` shares every block (refcount +1). The first write into a *shared, partly filled* last
  block copies it first (copy-on-write): a fresh block, a pending ``(src, dst)`` copy, one reference
  less on ``src``. The sibling that writes next owns ``src`` alone and copies nothing.
- With prefix caching, a prompt reuses cached full blocks from the start of the prompt, but never
  all of it: at least one token must be computed to get logits, so (as in vLLM and nano-vllm) the
  reused prefix is capped at ``len(prompt) - 1`` tokens, rounded down to whole blocks.
- A free cached block stays findable until an allocation takes it for new data; then its hash is
  forgotten and an ``evict`` event names the sequence that took it.
- Any operation that raises leaves every table, refcount and cache entry as it was.

Swapping (preemption by swap, the paper's section 4.5) is in swap.py: ``swap_out`` moves a
request's samples to a CPU pool, ``swap_in`` brings them back, and the engine applies their copies
in this order: swap-out, swap-in, copy-on-write. The rules that must hold after every operation
are checked in invariants.py.

A model that mixes sliding-window and full-attention layers runs one manager per KV-cache group
over one pool (hybrid/: the coordinator, and a sliding group's manager, whose
``remove_skipped_blocks`` frees the blocks its window has left behind; a no-op here).
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

    With ``num_cpu_blocks``, a request's samples can be swapped out together and back in
    (``swap_out``, ``swap_in``: see swap.py).

    The parts it is built from are class attributes, so that a subclass can swap in its own --
    the labs run a real model on a student's allocator, block table and prefix cache this way
    (``LLM(..., kv_cache_manager=...)``, see :mod:`pagedlearn.labs.plug`).
    """

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
        """A manager over its own pool of ``num_blocks`` GPU blocks (and ``num_cpu_blocks`` CPU
        ones). hybrid/'s coordinator hands every KV-cache group's manager one shared ``pool``,
        built from the same arguments, and the ``group`` name its events carry."""
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
        KV (their prefill can be skipped). Raises :class:`OutOfBlocksError`, changing nothing,
        when the pool cannot hold the prompt."""
        self._seqs.check_new(seq_id)
        tokens = check_tokens(token_ids)
        extra = make_extra_keys(self.model_id, adapter_id, cache_salt)
        hashes, hits = self._find_prefix(tokens, extra)
        return self._add_found(seq_id, tokens, extra, hashes, hits)

    def _add_found(
        self, seq_id: Hashable, tokens: list[int], extra: tuple, hashes: list, hits: list[int]
    ) -> int:
        """:meth:`add_sequence` once the prompt's prefix-cache ``hits`` are known (the
        coordinator finds them for every group first, so that all groups reuse as many)."""
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
        """Add one generated token; returns the slot where its K/V must be written.

        Allocates a block on a block boundary; copies on write if the last block is shared.
        """
        # The engine calls this for every running sequence in every step, so the common case
        # calls no helper: ``self._seqs.on_gpu``, ``check_token`` and ``table.slot(pos)``
        # are inlined (each still runs where the fast check fails, to name the problem).
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
        """Make ``child_id`` share only the first ``num_tokens`` tokens of ``parent_id`` (whole
        blocks: a multiple of ``block_size``); the child then appends its own tokens. The
        scheduler re-admits the samples of a request preempted by recompute this way, so that
        they share their prompt's blocks again (:mod:`pagedlearn.engine.readmission`). Whole
        blocks only, because a shared partly filled block would be copied on the child's first
        write, before the forward pass has written the parent's part of it. Raises
        :class:`PagedLearnError`, changing nothing, when it cannot share them."""
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
        """Return a finished (or aborted) sequence's blocks. Cached blocks stay findable until
        evicted. A swapped-out sequence gives back its CPU blocks."""
        on_cpu = self._seqs.is_swapped(seq_id)
        # Tail first: the tail of a sequence is the least likely to be shared, so it should be
        # the first evicted -- freeing it first puts it nearer the front of the LRU queue.
        blocks = self._seqs.table(seq_id).live_blocks()[::-1]
        (self.cpu_allocator if on_cpu else self.allocator).free(blocks)
        self._events.free(seq_id, blocks, cpu=on_cpu)
        self._seqs.remove(seq_id)

    def pop_copies(self) -> list[tuple[int, int]]:
        """Pending copy-on-write copies ``(src, dst)``; apply them to the KV tensors before the
        next attention call, after this step's swap copies (see the module docstring). Cleared on
        read."""
        copies = list(self._copies)
        self._copies.clear()  # in place: the groups of a coordinator share this list
        return copies

    def remove_skipped_blocks(self, seq_id: Hashable, num_computed_tokens: int) -> int:
        """Free the blocks that no query from position ``num_computed_tokens`` on will read
        again; returns how many (vLLM's name). With full attention every query reads every
        earlier token, so nothing is ever skipped: 0. A sliding-window group frees the blocks
        its window has left behind (sliding_window_manager.py); the scheduler calls this for
        every running sequence before it plans the sequence's next tokens."""
        self._seqs.on_gpu(seq_id)  # an unknown or swapped-out id raises, as elsewhere
        return 0

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (vLLM's name): afterwards no prompt hits a block cached
        before, e.g. after the weights changed. Returns how many cached blocks were dropped and
        emits one ``cache_reset`` event naming them (the views mark it).

        Refused (:class:`PagedLearnError`, nothing changed) while any sequence holds blocks, on
        the GPU or swapped out, as vLLM refuses: their blocks are in the cache too, and they
        would go on registering blocks computed before the reset. Without prefix caching there
        is nothing to drop: 0."""
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
        """Move a group of sequences (the samples of one request) to the CPU pool; returns the
        ``(gpu_block, cpu_block)`` copies to apply first (:meth:`SwapSpace.swap_out`)."""
        copies = self.pool.swap.swap_out(self._seqs, seq_ids, self._events)
        self._counters["swap_out_blocks"] += len(copies)
        return copies

    def swap_in(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """Bring a swapped-out group back to the GPU; returns the ``(cpu_block, gpu_block)``
        copies to apply after swap-out ones (:meth:`SwapSpace.swap_in`)."""
        swap = self.pool.swap
        copies = swap.swap_in(self._seqs, seq_ids, self._events, self._allocate, self._index_blocks)
        self._counters["swap_in_blocks"] += len(copies)
        return copies

    # --- planning a step ------------------------------------------------------------------------
    def blocks_to_append(self, seq_ids: Iterable[Hashable]) -> int:
        """GPU blocks that appending one token to each of ``seq_ids``, in order, would allocate:
        new blocks plus copy-on-write copies. Changes nothing; a scheduler asks before a step.

        A full last block needs a new one. A shared partial last block (refcount ``r > 1``)
        needs a copy -- but when ``k`` of its sharers append, only ``min(k, r - 1)`` copy: each
        copy drops one reference, and the last writer owns the block alone. An id listed twice
        appends twice.

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
            # Blocks that num_tokens + k tokens need, less those the sequence holds already.
            new_blocks += table.blocks_needed(table.num_tokens + k) - len(table.block_ids)
            if table.num_tokens % self.block_size:  # s's first token goes into its last block
                writers[table.block_ids[-1]] += 1
        copies = sum(min(k, self.allocator.refcount(b) - 1) for b, k in writers.items())
        return new_blocks + copies

    # --- internals (swap_in hands _allocate and _index_blocks to the swap space) ----------------
    def _allocate(self, n: int, seq_id: Hashable, what: str = "") -> list[int]:
        """``n`` fresh GPU blocks for ``seq_id``'s new data (``what`` names the request in an
        :class:`OutOfBlocksError`). A free cached block taken here loses its prefix-cache entry:
        the allocator hands out empty blocks first, cached ones least recently used first."""
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
        """The last block of ``table`` just filled up: hash it (chained on the block before) and
        register it in the prefix cache, so that a later prompt can find it."""
        j = table.num_full_blocks - 1
        parent, extra = parent_hash(table.block_hashes, j), self._seqs.extra_keys[seq_id]
        table.block_hashes.append(
            self.prefix_cache.hash_block(parent, table.block_tokens(j), extra)
        )
        self._index_blocks(seq_id, table, start=j)

    def _index_blocks(self, seq_id: Hashable, table: BlockTable, start: int = 0) -> None:
        """Register ``table``'s hashed full blocks from logical block ``start`` on in the prefix
        cache, so that other requests find them (content indexed already keeps its block)."""
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
                    self._events.cache_store(seq_id, block, hashes[j], block_tokens)
