"""The KV-cache coordinator: one manager per KV-cache group, one shared pool of blocks.

A model that mixes attention kinds (kv_cache_groups.py: full and sliding-window layers) needs a
block table per sequence *per group*. The coordinator (vLLM: ``HybridKVCacheCoordinator`` in
``vllm/v1/core/kv_cache_coordinator.py``) keeps one :class:`KVCacheManager` per group -- a
:class:`SlidingWindowManager` for a sliding group -- and makes them share one pool: one
allocator (refcounts, the free queue, LRU eviction), one prefix cache (each group's block hashes
carry its name, so groups never share KV), one CPU swap pool, one trace, one list of pending
copies. It speaks the manager's API, so the scheduler and the engine drive either the same way:

::

    coordinator.add_sequence("a", prompt)      every group: a table for "a"
         │                                     full: [3, 7, 8]   sliding 24: [4, 5, 6]
    coordinator.remove_skipped_blocks("a", n)  full: keeps all   sliding: [-1, 5, 6] (4 freed)
    coordinator.append_token("a", t)           every group appends; one new block each at most
    coordinator.block_tables("a")              [[3, 7, 8], [-1, 5, 6]]: what attention reads

Rules worth knowing:

- **All or nothing across groups.** An operation first asks every group how many blocks it
  needs (``blocks_to_append``, ``blocks_to_swap_in``, ...) and checks what each group would
  refuse (a swap's copy order), raises if the sum does not fit, and only then lets each group
  act: no group is left half done. A prompt's prefix-cache hits are taken out of the free queue
  in *every* group before any group allocates, so that one group's new blocks cannot evict the
  cached blocks another group's hit counts on (the window's freed blocks are the first LRU
  evicts).
- **One prefix-cache hit length for all groups.** A prompt's first ``h`` blocks are skipped only
  if *every* group can skip them: the full group needs blocks ``0..h-1`` cached, a sliding group
  only those its window sees (sliding_window_manager.py). The coordinator lowers ``h`` until all
  groups agree. So a hybrid model reuses a cached prefix only as far as the group that can
  reuse the least of it: a window's group loses its hit when the blocks just before ``h`` were
  evicted, which LRU takes first since the window freed them first.
- ``block_table(seq_id)``, ``slot_mapping(seq_id)`` and ``append_token``'s return value are
  group 0's (the full-attention group, when there is one): code written for GPT-2 still reads
  something true. ``block_tables`` and ``slot_mappings`` give every group's.
- The trace names a sequence's table in group ``g`` ``"<seq id>|<g>"`` (block_events.py).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Any

from pagedlearn.core.invariants import check_invariants
from pagedlearn.core.kv_cache_manager import KVCacheManager
from pagedlearn.core.kv_cache_pool import KVCachePool
from pagedlearn.core.prefix_cache import make_extra_keys
from pagedlearn.core.sequence_tables import SequenceTables, check_tokens, id_list
from pagedlearn.errors import OutOfBlocksError, PagedLearnError
from pagedlearn.hybrid.kv_cache_groups import KVCacheGroupSpec
from pagedlearn.hybrid.sliding_window_manager import SlidingWindowManager, check_window
from pagedlearn.trace.block_events import group_seq_id
from pagedlearn.trace.events import EventLog, StepMarker


class KVCacheCoordinator:
    """Block bookkeeping for a model with several KV-cache groups over one pool of
    ``num_blocks`` blocks (each block holds one group's layers; kv_cache.py).

    >>> from pagedlearn.hybrid.kv_cache_groups import group_layers
    >>> kv = KVCacheCoordinator(group_layers([8, None]), num_blocks=16, block_size=4)
    >>> kv.add_sequence("a", list(range(14)))     # 4 blocks in each of the 2 groups
    0
    >>> kv.remove_skipped_blocks("a", 14), kv.block_tables("a")   # query 14 sees 7..14
    (1, [[0, 1, 2, 3], [-1, 5, 6, 7]])
    >>> kv.stats()["groups"]
    {'full': 4, 'sliding 8': 3}
    """

    def __init__(
        self,
        groups: Sequence[KVCacheGroupSpec],
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        model_id: Hashable = None,
        num_cpu_blocks: int = 0,
    ) -> None:
        if not groups:
            raise PagedLearnError("a KV-cache coordinator needs at least one KV-cache group")
        self.groups = list(groups)
        # One pool for every group: one allocator, prefix cache, swap space, trace, copy list.
        self.pool = KVCachePool(num_blocks, num_cpu_blocks, enable_prefix_caching)
        self.managers: list[KVCacheManager] = []
        for g in self.groups:
            # The group's name is in every block hash (model_id): groups never share KV.
            shared = {"model_id": (model_id, g.name), "pool": self.pool, "group": g.name}
            if g.sliding_window is None:
                m = KVCacheManager(num_blocks, block_size, **shared)
            else:
                m = SlidingWindowManager(num_blocks, block_size, g.sliding_window, **shared)
            self.managers.append(m)
        self.block_size, self._model_id = block_size, model_id
        self.has_sliding_window = any(g.is_sliding for g in self.groups)
        self.allocator, self.cpu_allocator = self.pool.allocator, self.pool.swap.cpu_allocator
        self.prefix_cache, self.trace = self.pool.prefix_cache, self.pool.trace
        self._marker = StepMarker()
        # str(seq id) -> seq id: the trace names tables "<seq id>|<group>", so 3 and "3" must
        # not both be in use (their tables would share a name).
        self._names: dict[str, Hashable] = {}

    @property
    def model_id(self) -> Hashable:
        """The model's id in every block hash (each group adds its name). Set it to a new
        version and no later prompt hits a block cached before (running sequences keep theirs)."""
        return self._model_id

    @model_id.setter
    def model_id(self, model_id: Hashable) -> None:
        self._model_id = model_id
        for g, m in zip(self.groups, self.managers, strict=True):
            m.model_id = (model_id, g.name)

    # --- the sequence lifecycle: each group in turn, after checking that all of them fit -------
    def add_sequence(
        self,
        seq_id: Hashable,
        token_ids: Iterable[int],
        cache_salt: Hashable = None,
        adapter_id: Hashable = None,
    ) -> int:
        """A table in every group for the prompt; returns the prompt tokens whose KV is reused
        (the same in every group). Raises :class:`OutOfBlocksError`, changing nothing, when the
        groups' blocks together do not fit."""
        self._check_new(seq_id)
        tokens = check_tokens(token_ids)
        found = self._agreed_hits(tokens, cache_salt, adapter_id)  # per group, hits agreed
        need, pinned = 0, []
        for m, (_, _, hits) in zip(self.managers, found, strict=True):
            live = [b for b in hits if b >= 0]
            need += m.blocks_needed(len(tokens)) - len(hits)
            need += sum(1 for b in live if self.allocator.refcount(b) == 0)  # out of the queue
            pinned += live
        self._fits(need, f"add_sequence({seq_id!r}) with {len(tokens)} tokens")
        # Pin every group's hits before any group allocates: a group's new blocks come from the
        # free queue, where another group's cached hits may wait (least recently used first).
        self.allocator.incref(pinned)
        try:
            for m, (extra, hashes, hits) in zip(self.managers, found, strict=True):
                # Each group's table grows its own token list (and its own hashes).
                m._add_found(seq_id, list(tokens), extra, hashes, hits)
        finally:
            self.allocator.free(pinned)  # each group holds its own reference now
        self._names[str(seq_id)] = seq_id
        return len(found[0][2]) * self.block_size

    def append_token(self, seq_id: Hashable, token_id: int) -> int:
        """Append to every group's table; returns group 0's slot (``slot_mappings`` gives all)."""
        # Each group takes one block at most (a new one, or a copy): with that many free, every
        # group fits, and the exact count (which walks the tables) is not needed.
        if self.allocator.num_free_blocks < len(self.managers):
            self._fits(self.blocks_to_append([seq_id]), f"append_token({seq_id!r})")
        slots = [m.append_token(seq_id, token_id) for m in self.managers]
        return slots[0]

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        self.managers[0]._seqs.on_gpu(parent_id)
        self._check_new(child_id)
        for m in self.managers:
            m.fork(parent_id, child_id)
        self._names[str(child_id)] = child_id

    def fork_prefix(self, parent_id: Hashable, child_id: Hashable, num_tokens: int) -> None:
        """:meth:`KVCacheManager.fork_prefix` in every group. It takes no block, so none can run
        short; every group checks first (a sliding group: the window's freed entries), so that
        a refusal changes nothing."""
        self._check_new(child_id)
        for m in self.managers:
            m.check_fork_prefix(parent_id, child_id, num_tokens)
        for m in self.managers:
            m.fork_prefix(parent_id, child_id, num_tokens)
        self._names[str(child_id)] = child_id

    def free_sequence(self, seq_id: Hashable) -> None:
        self.managers[0]._seqs.is_swapped(seq_id)  # raises for an unknown id
        for m in self.managers:
            m.free_sequence(seq_id)
        del self._names[str(seq_id)]

    def remove_skipped_blocks(self, seq_id: Hashable, num_computed_tokens: int) -> int:
        """Every sliding group frees what its window left behind; returns the blocks freed."""
        return sum(m.remove_skipped_blocks(seq_id, num_computed_tokens) for m in self.managers)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix of every group (one shared cache): see
        :meth:`KVCacheManager.reset_prefix_cache`, refused the same way."""
        return self.managers[0].reset_prefix_cache()  # every group holds the same sequences

    def pop_copies(self) -> list[tuple[int, int]]:
        return self.managers[0].pop_copies()  # one list, shared by every group

    def swap_out(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """Swap a group of sequences out in every KV-cache group (all or nothing)."""
        ids = id_list(seq_ids, "swap_out")
        if self.cpu_allocator is None:
            raise PagedLearnError("swap_out: swap needs num_cpu_blocks > 0")
        for s in ids:
            self.managers[0]._seqs.on_gpu(s)
        reads = [{b for s in ids for b in m._seqs.gpu[s].live_blocks()} for m in self.managers]
        self.pool.swap.check_copy_order("swap_out", reads=set().union(*reads))
        need, cpu = sum(map(len, reads)), self.cpu_allocator
        if need > cpu.num_free_blocks:
            raise OutOfBlocksError(
                need, cpu.num_free_blocks, cpu.num_blocks, f"swap_out({ids!r}) to CPU"
            )
        return [c for m in self.managers for c in m.swap_out(ids)]

    def swap_in(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """Bring a swapped-out group back in every KV-cache group (all or nothing)."""
        ids = id_list(seq_ids, "swap_in")
        self.pool.swap.check_copy_order("swap_in")
        self._fits(self.blocks_to_swap_in(ids), f"swap_in({ids!r})", count=False)
        return [c for m in self.managers for c in m.swap_in(ids)]

    # --- queries ---------------------------------------------------------------------------------
    def block_table(self, seq_id: Hashable) -> list[int]:
        return self.managers[0].block_table(seq_id)

    def block_tables(self, seq_id: Hashable) -> list[list[int]]:
        """The sequence's table in each group, in group order (what attention reads)."""
        return [m.block_table(seq_id) for m in self.managers]

    def slot_mapping(self, seq_id: Hashable, start: int = 0) -> list[int]:
        return self.managers[0].slot_mapping(seq_id, start)

    def slot_mappings(self, seq_id: Hashable, start: int = 0) -> list[list[int]]:
        """The slots of positions ``start..`` in each group (-1 where a window freed the block)."""
        return [m.slot_mapping(seq_id, start) for m in self.managers]

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks a new sequence of ``num_tokens`` tokens takes: a table's worth per group."""
        return sum(m.blocks_needed(num_tokens) for m in self.managers)

    def min_blocks_to_run(self, num_tokens: int) -> int:
        """The fewest blocks a sequence of ``num_tokens`` tokens can run in, summed over the
        groups (a sliding group's is bounded by its window)."""
        return sum(m.min_blocks_to_run(num_tokens) for m in self.managers)

    def blocks_to_append(self, seq_ids: Iterable[Hashable]) -> int:
        ids = id_list(seq_ids, "blocks_to_append")
        return sum(m.blocks_to_append(ids) for m in self.managers)

    def blocks_to_swap_in(self, seq_ids: Iterable[Hashable]) -> int:
        ids = id_list(seq_ids, "blocks_to_swap_in")
        return sum(m.blocks_to_swap_in(ids) for m in self.managers)

    def cached_prefix_tokens(
        self, token_ids: Iterable[int], cache_salt: Hashable = None, adapter_id: Hashable = None
    ) -> int:
        """Prompt tokens ``add_sequence`` would reuse now (every group agreeing); changes
        nothing."""
        found = self._agreed_hits(check_tokens(token_ids), cache_salt, adapter_id)
        return len(found[0][2]) * self.block_size

    def token_ids(self, seq_id: Hashable) -> list[int]:
        return self.managers[0].token_ids(seq_id)

    def num_tokens(self, seq_id: Hashable) -> int:
        return self.managers[0].num_tokens(seq_id)

    def sequences(self) -> list[Hashable]:
        return self.managers[0].sequences()

    def swapped_sequences(self) -> list[Hashable]:
        return self.managers[0].swapped_sequences()

    def is_swapped(self, seq_id: Hashable) -> bool:
        return self.managers[0].is_swapped(seq_id)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self.managers[0]

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    def group_tables(self) -> dict[str, dict]:
        """Every group's tables by traced id ``"<seq id>|<group>"``: GPU ones, then swapped."""
        tables = {}
        for g, m in zip(self.groups, self.managers, strict=True):
            tables.update({group_seq_id(s, g.name): t for s, t in m._seqs.gpu.items()})
        for g, m in zip(self.groups, self.managers, strict=True):
            tables.update({group_seq_id(s, g.name): t for s, t in m._seqs.cpu.items()})
        return tables

    def stats(self) -> dict[str, Any]:
        """The manager's numbers for the shared pool, counters summed over the groups (prefix
        hits counted once, group 0's: every group reuses the same agreed prefix), and
        ``groups``: the GPU blocks each group's tables hold (a block shared by forks counted
        once)."""
        per = [m.stats() for m in self.managers]
        out = dict(per[0])
        for key in ("cow_copies", "allocation_failures", "swap_out_blocks", "swap_in_blocks"):
            out[key] = sum(p[key] for p in per)
        out["window_freed_blocks"] = sum(p.get("window_freed_blocks", 0) for p in per)
        out["groups"] = {
            g.name: len({b for t in m._seqs.gpu.values() for b in t.live_blocks()})
            for g, m in zip(self.groups, self.managers, strict=True)
        }
        return out

    def record(self) -> EventLog:
        """Record every block event, with the groups' names in ``meta["kv_groups"]`` (what a
        replay needs to read the trace's ``"<seq id>|<group>"`` tables as groups)."""
        meta = {"num_blocks": self.allocator.num_blocks, "block_size": self.block_size}
        meta["kv_groups"] = [g.name for g in self.groups]
        if self.cpu_allocator is not None:
            meta["num_cpu_blocks"] = self.cpu_allocator.num_blocks
        return EventLog(self.trace, meta=meta)

    def mark_step(self, **info) -> None:
        self._marker.mark(self.trace, self.group_tables(), info)

    def check_invariants(self) -> None:
        """The manager's invariants over the shared pool, every group's tables counted; every
        group holds the same sequences (on the same side), with the same tokens; no block is in
        two groups' tables; only a sliding group's tables have null entries."""
        merged, first, owner = SequenceTables(), self.managers[0]._seqs, {}
        for g, m in zip(self.groups, self.managers, strict=True):
            for side in ("gpu", "cpu"):
                for s, t in getattr(m._seqs, side).items():
                    getattr(merged, side)[group_seq_id(s, g.name)] = t
                    merged.extra_keys[group_seq_id(s, g.name)] = m._seqs.extra_keys[s]
            same = m._seqs.gpu.keys() == first.gpu.keys() and m._seqs.cpu.keys() == first.cpu.keys()
            if not same or any(
                t.token_ids != first.table(s).token_ids for s, t in m._seqs.all().items()
            ):
                raise PagedLearnError(f"invariant violated: group {g.name!r} holds other sequences")
            if g.is_sliding:
                check_window(m._seqs.gpu, g.sliding_window, self.block_size)
            for s, t in m._seqs.gpu.items():
                if t.num_null_blocks and not g.is_sliding:
                    raise PagedLearnError(f"invariant violated: {s!r} has a null entry in {g.name}")
                for b in t.live_blocks():
                    if owner.setdefault(b, g.name) != g.name:
                        raise PagedLearnError(
                            f"invariant violated: block {b} is in groups {owner[b]} and {g.name}"
                        )
        check_invariants(
            merged, self.allocator, self.cpu_allocator, self.prefix_cache, self.block_size
        )

    # --- internals -------------------------------------------------------------------------------
    def _agreed_hits(self, tokens: list[int], cache_salt, adapter_id) -> list[tuple]:
        """Per group ``(extra keys, block hashes, hits)`` for the prompt, every group's hits as
        long as the others': the most prompt blocks every group can skip, lowered until all of
        them agree (each pass only lowers it, so it ends)."""
        hit: int | None = None
        while True:
            agreed, found = hit, []
            for m in self.managers:
                extra = make_extra_keys(m.model_id, adapter_id, cache_salt)
                hashes, hits = m._find_prefix(tokens, extra, hit)
                hit = len(hits)
                found.append((extra, hashes, hits))
            if hit == agreed or self.prefix_cache is None:  # no cache: no hits, one pass
                return found

    def _check_new(self, seq_id: Hashable) -> None:
        self.managers[0]._seqs.check_new(seq_id)
        if str(seq_id) in self._names:
            other = self._names[str(seq_id)]
            raise PagedLearnError(
                f"sequence id {seq_id!r} would be traced as {other!r} is (the trace names a "
                f"table {group_seq_id(seq_id, self.groups[0].name)!r}): use another id"
            )

    def _fits(self, need: int, what: str, count: bool = True) -> None:
        a = self.allocator
        if need > a.num_free_blocks:
            if count:
                self.managers[0]._counters["allocation_failures"] += 1
            raise OutOfBlocksError(need, a.num_free_blocks, a.num_blocks, what=what)
