"""The KV-cache manager: block tables, sharing, copy-on-write, prefix caching and swapping.

This is what a serving engine's scheduler talks to (vLLM calls its version the block manager or
KV cache manager). It owns

- a :class:`BlockAllocator` (which physical blocks are free, refcounts),
- one :class:`BlockTable` per sequence (logical -> physical blocks, tokens, slots),
- a :class:`PrefixCache` when ``enable_prefix_caching`` (hash -> block for full blocks),
- a second :class:`BlockAllocator` over a CPU swap pool when ``num_cpu_blocks > 0``,
- a :class:`Trace` that announces every block operation (see trace.py).

It never touches a tensor. It answers "where does token i's K/V go?" (``append_token`` returns a
slot; ``slot_mapping`` gives all of them) and "which blocks must be copied before the next kernel
runs?" (``pop_copies``, ``swap_out``, ``swap_in``); the engine applies those to the KV tensors.

Rules worth knowing:

- Blocks are allocated on demand, one per ``block_size`` tokens; at most the last block of a
  sequence is partly empty.
- ``fork`` shares every block (refcount +1). The first write into a *shared, partly filled* last
  block copies it first (copy-on-write): a fresh block, a pending ``(src, dst)`` copy, one reference
  less on ``src``. The sibling that writes next owns ``src`` alone and copies nothing.
- With prefix caching, a prompt reuses cached full blocks from the start of the prompt, but never
  all of it: at least one token must be computed to get logits, so (as in vLLM and nano-vllm) the
  reused prefix is capped at ``len(prompt) - 1`` tokens, rounded down to whole blocks.
- Any operation that raises leaves every table, refcount and cache entry as it was.

Swapping (preemption by swap, the paper's section 4.5) is in swap.py: with ``num_cpu_blocks > 0``,
``swap_out`` moves the samples of a request to a CPU pool (their tables stay, naming CPU blocks)
and ``swap_in`` brings them back. Like copy-on-write, swaps return copies for the engine, which
applies them before the next forward pass in this order: swap-out, swap-in, copy-on-write.
"""

from __future__ import annotations

import operator
from collections.abc import Hashable, Iterable
from typing import Any

from pagedlearn import swap
from pagedlearn.block_allocator import BlockAllocator
from pagedlearn.block_table import BlockTable
from pagedlearn.errors import OutOfBlocksError, PagedLearnError
from pagedlearn.invariants import check_invariants
from pagedlearn.prefix_cache import PrefixCache, make_extra_keys, parent_hash
from pagedlearn.trace import EventLog, StepMarker, Trace


class KVCacheManager:
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
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        model_id: Hashable = None,
        num_cpu_blocks: int = 0,
    ) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise PagedLearnError(f"block_size must be a positive int, got {block_size!r}")
        n_cpu = num_cpu_blocks
        if not isinstance(n_cpu, int) or isinstance(n_cpu, bool) or n_cpu < 0:
            raise PagedLearnError(f"num_cpu_blocks must be an int >= 0, got {n_cpu!r}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.model_id = model_id  # part of every block hash: no sharing across models
        self.trace = Trace()
        self._marker = StepMarker()
        self.allocator = BlockAllocator(num_blocks, on_evict=self._on_evict)
        self.prefix_cache = PrefixCache() if enable_prefix_caching else None
        # The swap pool holds KV only while its sequence is swapped out: no caching, no eviction.
        self.cpu_allocator = BlockAllocator(n_cpu) if n_cpu else None
        self._tables: dict[Hashable, BlockTable] = {}  # resident sequences: ids name GPU blocks
        self._swapped: dict[Hashable, BlockTable] = {}  # swapped out: ids name CPU blocks
        self._extra_keys: dict[Hashable, tuple] = {}  # per sequence: model, adapter, salt
        self._copies: list[tuple[int, int]] = []  # pending copy-on-write (src, dst)
        self._allocating_for: Hashable = None  # the sequence an allocation in progress serves
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
        self._check_new_id(seq_id)
        tokens = _check_tokens(token_ids)
        bs = self.block_size
        table = BlockTable(bs, token_ids=tokens)
        extra = make_extra_keys(self.model_id, adapter_id, cache_salt)

        hits = self._lookup_prefix(table, extra)

        # Hits that sit in the free queue are taken out of it, so they count against free space.
        revived = sum(1 for b in hits if self.allocator.refcount(b) == 0)
        num_new = table.blocks_needed(len(tokens)) - len(hits)
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
            self.allocator.incref(hits)
            self.trace.emit("cache_hit", hits, (seq_id,))
        new = self._allocate(num_new, seq_id)
        self.trace.emit("allocate", new, (seq_id,))
        table.block_ids = hits + new
        self._tables[seq_id] = table
        self._extra_keys[seq_id] = extra
        if self.prefix_cache is not None:
            # Register the prompt's full blocks now: the prefill that follows writes their KV,
            # and a request with the same prefix arriving next step can already share them.
            for j in range(len(hits), len(table.block_hashes)):
                self._register(seq_id, table, j)
            self._counters["prefix_query_tokens"] += len(tokens)
            self._counters["prefix_hit_tokens"] += len(hits) * bs
        return len(hits) * bs

    def append_token(self, seq_id: Hashable, token_id: int) -> int:
        """Add one generated token; returns the slot where its K/V must be written.

        Allocates a block on a block boundary; copies on write if the last block is shared.
        """
        table = self._table(seq_id)
        (token,) = _check_tokens([token_id])
        pos = table.num_tokens
        if pos % self.block_size == 0:  # the last block is full (or there is none): a new one
            (block,) = self._allocate(1, seq_id, f"append_token({seq_id!r}) at position {pos}")
            table.block_ids.append(block)
            self.trace.emit("allocate", (block,), (seq_id,))
        elif self.allocator.refcount(src := table.block_ids[-1]) > 1:  # shared partial block
            (dst,) = self._allocate(1, seq_id, f"copy-on-write for {seq_id!r}")
            self.allocator.free([src])  # one sharer fewer; the others keep src untouched
            table.block_ids[-1] = dst
            self._copies.append((src, dst))
            self._counters["cow_copies"] += 1
            self.trace.emit("cow_copy", (src, dst), (seq_id,))
        table.token_ids.append(token)
        if self.prefix_cache is not None and table.num_tokens % self.block_size == 0:
            j = table.num_full_blocks - 1  # the block just filled up: hash it and register it
            table.block_hashes.append(self._hash_block(table, j, self._extra_keys[seq_id]))
            self._register(seq_id, table, j)
        return table.slot(pos)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Make ``child_id`` a copy of ``parent_id`` that shares all its blocks (no KV copied)."""
        parent = self._table(parent_id)
        self._check_new_id(child_id)
        self.allocator.incref(parent.block_ids)
        self._tables[child_id] = parent.copy()
        self._extra_keys[child_id] = self._extra_keys[parent_id]
        self.trace.emit("incref", parent.block_ids, (parent_id, child_id))

    def free_sequence(self, seq_id: Hashable) -> None:
        """Return a finished (or aborted) sequence's blocks. Cached blocks stay findable until
        evicted. A swapped-out sequence gives back its CPU blocks."""
        tables = self._where(seq_id)
        # Tail first: the tail of a sequence is the least likely to be shared, so it should be
        # the first evicted -- freeing it first puts it nearer the front of the LRU queue.
        blocks = tables[seq_id].block_ids[::-1]
        if tables is self._swapped:
            self.cpu_allocator.free(blocks)
            self.trace.emit("free", blocks, (seq_id,), cpu=True)
        else:
            self.allocator.free(blocks)
            self.trace.emit("free", blocks, (seq_id,))
        del tables[seq_id], self._extra_keys[seq_id]

    def pop_copies(self) -> list[tuple[int, int]]:
        """Pending copy-on-write copies ``(src, dst)``; apply them to the KV tensors before the
        next attention call, after this step's swap copies (see the module docstring). Cleared on
        read."""
        copies, self._copies = self._copies, []
        return copies

    # --- swapping (swap.py: the rules, the copy order, the code) -----------------------------
    def swap_out(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """Move a group of sequences (the samples of one request) to the CPU pool; returns the
        ``(gpu_block, cpu_block)`` copies to apply first. See :func:`pagedlearn.swap.swap_out`."""
        return swap.swap_out(self, seq_ids)

    def swap_in(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """Bring a swapped-out group back to the GPU; returns the ``(cpu_block, gpu_block)``
        copies to apply after swap-out ones. See :func:`pagedlearn.swap.swap_in`."""
        return swap.swap_in(self, seq_ids)

    # --- queries -------------------------------------------------------------------------------
    def block_table(self, seq_id: Hashable) -> list[int]:
        return list(self._table(seq_id).block_ids)

    def slot_mapping(self, seq_id: Hashable) -> list[int]:
        return self._table(seq_id).slot_mapping()

    def token_ids(self, seq_id: Hashable) -> list[int]:
        return list(self._where(seq_id)[seq_id].token_ids)  # swapped sequences too

    def cached_prefix_tokens(
        self, token_ids: Iterable[int], cache_salt: Hashable = None, adapter_id: Hashable = None
    ) -> int:
        """How many leading tokens ``add_sequence(..., token_ids)`` would reuse from the prefix
        cache right now (0 without caching). Changes nothing: a scheduler asks it to size a
        prefill chunk so that the chunk starts after the cached prefix."""
        table = BlockTable(self.block_size, token_ids=_check_tokens(token_ids))
        extra = make_extra_keys(self.model_id, adapter_id, cache_salt)
        return len(self._lookup_prefix(table, extra)) * self.block_size

    def num_tokens(self, seq_id: Hashable) -> int:
        """How many tokens the sequence holds KV slots for (O(1); swapped sequences too)."""
        return self._where(seq_id)[seq_id].num_tokens

    def sequences(self) -> list[Hashable]:
        """Ids of the sequences whose blocks are on the GPU (not the swapped-out ones)."""
        return list(self._tables)

    def swapped_sequences(self) -> list[Hashable]:
        """Ids of the swapped-out sequences (their KV is in the CPU pool)."""
        return list(self._swapped)

    def is_swapped(self, seq_id: Hashable) -> bool:
        return self._where(seq_id) is self._swapped

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._tables or seq_id in self._swapped

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
        count = 0
        tokens: dict[Hashable, int] = {}  # the token count each sequence would have so far
        last: dict[Hashable, int | None] = {}  # its last block; None: a fresh one of its own
        refs: dict[int, int] = {}  # refcounts of the shared blocks, as the appends lower them
        for s in self._id_list(seq_ids, "blocks_to_append"):
            table = self._table(s)
            n = tokens.get(s, table.num_tokens)
            block = last.get(s, table.block_ids[-1])
            if n % self.block_size == 0:  # full last block: a new block
                count += 1
                last[s] = None
            elif block is not None and refs.setdefault(block, self.allocator.refcount(block)) > 1:
                count += 1  # copy-on-write: one sharer fewer on the old block
                refs[block] -= 1
                last[s] = None
            tokens[s] = n + 1
        return count

    def blocks_to_swap_in(self, seq_ids: Iterable[Hashable]) -> int:
        """GPU blocks ``swap_in(seq_ids)`` would allocate (see swap.py); changes nothing."""
        return swap.blocks_to_swap_in(self, seq_ids)

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    def stats(self) -> dict[str, Any]:
        """Pool usage and counters, the numbers vLLM operators watch. ``num_seqs`` counts the
        sequences on the GPU, ``swapped_seqs`` those on the CPU; ``swap_out_blocks`` and
        ``swap_in_blocks`` count the blocks copied so far in each direction."""
        a, cpu = self.allocator, self.cpu_allocator
        return {
            "num_blocks": a.num_blocks,
            "block_size": self.block_size,
            "num_seqs": len(self._tables),
            "swapped_seqs": len(self._swapped),
            "cpu_blocks": cpu.num_blocks if cpu else 0,
            "cpu_used_blocks": cpu.num_blocks - cpu.num_free_blocks if cpu else 0,
            "used_blocks": a.num_blocks - a.num_free_blocks,
            "free_blocks": a.num_free_blocks,
            "cached_blocks": a.num_cached_free_blocks,  # free, but holding a reusable prefix
            "shared_blocks": a.num_shared_blocks,  # refcount > 1
            **self._counters,
            "evictions": a.num_evictions,
        }

    def record(self) -> EventLog:
        """Start recording every block event (for replay, JSON export, pictures)."""
        meta = {"num_blocks": self.allocator.num_blocks, "block_size": self.block_size}
        if self.cpu_allocator is not None:
            meta["num_cpu_blocks"] = self.cpu_allocator.num_blocks
        return EventLog(self.trace, meta=meta)

    def mark_step(self, **info) -> None:
        """Emit a ``step`` event: a frame for replays and live views, with every sequence's
        token count, its new tokens since the last mark, and ``info`` (JSON-able values).
        The engine marks after each step; a lab driving the manager by hand may mark too."""
        self._marker.mark(self.trace, {**self._tables, **self._swapped}, info)

    def check_invariants(self) -> None:
        """Raise :class:`PagedLearnError` naming the first broken invariant (see invariants.py)."""
        check_invariants(self)

    # --- internals -----------------------------------------------------------------------------
    def _where(self, seq_id: Hashable) -> dict[Hashable, BlockTable]:
        """The dict that holds ``seq_id``'s table: ``_tables`` (GPU) or ``_swapped`` (CPU)."""
        try:
            return next(d for d in (self._tables, self._swapped) if seq_id in d)
        except (StopIteration, TypeError):
            raise PagedLearnError(f"unknown sequence id {seq_id!r}") from None

    def _table(self, seq_id: Hashable) -> BlockTable:
        """The table of a sequence on the GPU (the only kind that can grow, fork or be read)."""
        if self._where(seq_id) is self._swapped:
            raise PagedLearnError(
                f"sequence {seq_id!r} is swapped out to the CPU: swap_in([{seq_id!r}]) first"
            )
        return self._tables[seq_id]

    def _check_new_id(self, seq_id: Hashable) -> None:
        try:
            exists = seq_id in self  # on the GPU or swapped out
        except TypeError:
            raise PagedLearnError(f"sequence id {seq_id!r} is not hashable") from None
        if exists:
            raise PagedLearnError(f"sequence id {seq_id!r} already exists")

    @staticmethod
    def _id_list(seq_ids: Iterable[Hashable], what: str) -> list[Hashable]:
        # A bare string is iterable too: "req-1" would become five one-letter ids.
        if isinstance(seq_ids, (str, bytes)) or not isinstance(seq_ids, Iterable):
            raise PagedLearnError(f"{what} takes a list of sequence ids, got {seq_ids!r}")
        return list(seq_ids)

    def _allocate(self, n: int, seq_id: Hashable, what: str = "") -> list[int]:
        self._allocating_for = seq_id  # named in the evict events this allocation may cause
        try:
            return self.allocator.allocate(n)
        except OutOfBlocksError as e:
            self._counters["allocation_failures"] += 1
            raise OutOfBlocksError(e.needed, e.free, e.total, what=what) from None

    def _lookup_prefix(self, table: BlockTable, extra: tuple) -> list[int]:
        """Hash the table's full blocks into ``table.block_hashes``; return the cached blocks
        that hold its longest prefix (capped: at least one token is left to compute)."""
        hits: list[int] = []
        if self.prefix_cache is None:
            return hits
        tokens, bs = table.token_ids, self.block_size
        for j in range(len(tokens) // bs):  # hash every full block, each chained on the last
            table.block_hashes.append(self._hash_block(table, j, extra))
        for j in range((len(tokens) - 1) // bs):  # cap: keep >= 1 token to compute
            parent = parent_hash(table.block_hashes, j)
            block = self.prefix_cache.lookup(
                table.block_hashes[j], parent, table.block_tokens(j), extra
            )
            if block is None:
                break
            hits.append(block)
        return hits

    def _hash_block(self, table: BlockTable, j: int, extra: tuple) -> bytes:
        parent = parent_hash(table.block_hashes, j)
        return self.prefix_cache.hash_block(parent, table.block_tokens(j), extra)

    def _register(self, seq_id: Hashable, table: BlockTable, j: int) -> None:
        block, block_hash = table.block_ids[j], table.block_hashes[j]
        if self.prefix_cache.insert(
            block_hash,
            block,
            parent_hash(table.block_hashes, j),
            table.block_tokens(j),
            self._extra_keys[seq_id],
        ):
            self.allocator.mark_cached(block)
            if self.trace.listening:
                tokens = table.block_tokens(j)
                self.trace.emit(
                    "cache_store", (block,), (seq_id,), hash=block_hash.hex(), tokens=tokens
                )

    def _on_evict(self, block_id: int) -> None:
        # Called by the allocator when it hands out a free cached block for new data.
        block_hash = self.prefix_cache.evict(block_id) if self.prefix_cache else None
        self.trace.emit(
            "evict",
            (block_id,),
            (self._allocating_for,),
            hash=block_hash.hex() if block_hash else None,
        )


def _check_tokens(token_ids: Iterable[int]) -> list[int]:
    """Token ids as a list of ints >= 0 (numpy / torch ints welcome); names the first bad one."""
    if isinstance(token_ids, (str, bytes)):
        raise PagedLearnError("token ids must be ints, got a string: tokenize it first")
    try:
        items = iter(token_ids)
    except TypeError:
        raise PagedLearnError(f"token ids must be ints, got {token_ids!r}") from None
    tokens = []
    for i, t in enumerate(items):
        try:
            tokens.append(operator.index(t))
        except TypeError:
            raise PagedLearnError(f"token ids must be ints: position {i} is {t!r}") from None
        if tokens[-1] < 0:
            raise PagedLearnError(f"token ids must be >= 0: position {i} is {t!r}")
    if not tokens:
        raise PagedLearnError("a sequence needs at least one token")
    return tokens
