"""What the scheduler, the engine and the pictures ask a KV-cache manager: nothing here changes
a block.

:class:`~pagedlearn.core.kv_cache_manager.KVCacheManager` inherits these questions, so that its
own file holds only what changes blocks. They are: *where* (``block_table``, ``slot_mapping``:
``block_id * block_size + offset`` per token; ``block_tables`` / ``slot_mappings`` for every
KV-cache group), *how much* (``num_tokens``, ``blocks_needed``, ``min_blocks_to_run``,
``cached_prefix_tokens``, ``blocks_to_swap_in``: the scheduler sizes each step with these and the
manager's ``blocks_to_append``), *who* (``sequences``, ``swapped_sequences``, ``seq_id in kv``)
and *what happened* (``stats``, ``record`` and ``mark_step`` for the trace, ``check_invariants``).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

from pagedlearn.core.invariants import check_invariants
from pagedlearn.core.prefix_cache import make_extra_keys
from pagedlearn.core.sequence_tables import check_tokens
from pagedlearn.errors import PagedLearnError
from pagedlearn.trace.events import EventLog


class KVCacheQueries:
    """The read-only half of :class:`~pagedlearn.core.kv_cache_manager.KVCacheManager`, over the
    state its ``__init__`` sets (``_seqs``, ``allocator``, ``prefix_cache``, ``pool``...)."""

    def block_table(self, seq_id: Hashable) -> list[int]:
        try:  # a running sequence, asked every step: one dict lookup
            return list(self._seqs.gpu[seq_id].block_ids)
        except (KeyError, TypeError):
            return list(self._seqs.on_gpu(seq_id).block_ids)  # raises, naming the problem

    def slot_mapping(self, seq_id: Hashable, start: int = 0) -> list[int]:
        """The slots of token positions ``start..`` (-1 where a window freed the block)."""
        return self._seqs.on_gpu(seq_id).slot_mapping(start)

    def block_tables(self, seq_id: Hashable) -> list[list[int]]:
        """The sequence's block table in every KV-cache group: one here (the coordinator of a
        hybrid model has one per group). What the model runner hands attention."""
        return [self.block_table(seq_id)]

    def slot_mappings(self, seq_id: Hashable, start: int = 0) -> list[list[int]]:
        """:meth:`slot_mapping` in every KV-cache group (one here), as ``block_tables``."""
        return [self.slot_mapping(seq_id, start)]

    def token_ids(self, seq_id: Hashable) -> list[int]:
        return list(self._seqs.table(seq_id).token_ids)  # swapped sequences too

    def num_tokens(self, seq_id: Hashable) -> int:
        """How many tokens the sequence holds KV slots for (O(1); swapped sequences too)."""
        try:  # a running sequence, asked every step: one dict lookup
            return len(self._seqs.gpu[seq_id].token_ids)
        except (KeyError, TypeError):
            return self._seqs.table(seq_id).num_tokens  # swapped out, or raises

    def sequences(self) -> list[Hashable]:
        """Ids of the sequences whose blocks are on the GPU (not the swapped-out ones)."""
        return list(self._seqs.gpu)

    def swapped_sequences(self) -> list[Hashable]:
        """Ids of the swapped-out sequences (their KV is in the CPU pool)."""
        return list(self._seqs.cpu)

    def is_swapped(self, seq_id: Hashable) -> bool:
        return self._seqs.is_swapped(seq_id)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks a new sequence of ``num_tokens`` tokens takes: ceil(num_tokens / block_size)
        (the coordinator sums its groups). A scheduler asks it to size an admission."""
        return self._sizer.blocks_needed(num_tokens)  # the table class's own rule

    def min_blocks_to_run(self, num_tokens: int) -> int:
        """The fewest blocks a sequence of ``num_tokens`` tokens can run in, prefilled in chunks:
        all here (every query reads every earlier token), a sliding window's only. A scheduler
        asks before it gives up on a request that grew past the pool."""
        return self.blocks_needed(num_tokens)

    def check_fork_prefix(self, parent_id: Hashable, child_id: Hashable, num_tokens: int) -> None:
        """Raise :class:`PagedLearnError` if ``fork_prefix`` would refuse (changes nothing)."""
        source, bs, n = self._seqs.on_gpu(parent_id), self.block_size, num_tokens
        self._seqs.check_new(child_id)  # a new id, before anything changes
        if (
            not isinstance(n, int)
            or isinstance(n, bool)
            or n % bs
            or not 0 <= n <= source.num_tokens
        ):
            raise PagedLearnError(
                f"fork_prefix({parent_id!r}, {child_id!r}, {n!r}): num_tokens must be a multiple "
                f"of block_size {bs} between 0 and the parent's {source.num_tokens} tokens"
            )

    def cached_prefix_tokens(
        self, token_ids: Iterable[int], cache_salt: Hashable = None, adapter_id: Hashable = None
    ) -> int:
        """How many leading tokens ``add_sequence(..., token_ids)`` would reuse from the prefix
        cache right now (0 without caching). Changes nothing: a scheduler asks it to size a
        prefill chunk so that the chunk starts after the cached prefix."""
        extra = make_extra_keys(self.model_id, adapter_id, cache_salt)
        _, hits = self._find_prefix(check_tokens(token_ids), extra)
        return len(hits) * self.block_size

    def _find_prefix(
        self, tokens: list[int], extra: tuple, limit: int | None = None
    ) -> tuple[list[bytes], list[int]]:
        """The hashes of the prompt's full blocks and the cached blocks that hold its longest
        prefix, never all of it (see ``PrefixCache.match``), at most ``limit`` of them;
        ``[], []`` without caching."""
        if self.prefix_cache is None:
            return [], []
        hashes, hits = self.prefix_cache.match(tokens, self.block_size, extra)
        return hashes, hits if limit is None else hits[:limit]

    def blocks_to_swap_in(self, seq_ids: Iterable[Hashable]) -> int:
        """GPU blocks ``swap_in(seq_ids)`` would allocate (see swap.py); changes nothing."""
        return self.pool.swap.blocks_to_swap_in(self._seqs, seq_ids)

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    def stats(self) -> dict[str, Any]:
        """Pool usage and counters, the numbers vLLM operators watch (``num_seqs``: on the GPU,
        ``swapped_seqs``: on the CPU, ``swap_out_blocks`` / ``swap_in_blocks``: blocks copied)."""
        a, cpu = self.allocator, self.cpu_allocator
        return {
            "num_blocks": a.num_blocks,
            "block_size": self.block_size,
            "num_seqs": len(self._seqs.gpu),
            "swapped_seqs": len(self._seqs.cpu),
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
        """Emit a ``step`` event, a frame for replays and live views: every sequence's token
        count, its new tokens since the last mark, and ``info`` (JSON-able). The engine marks
        after each step; a lab driving the manager by hand may too."""
        self._marker.mark(self.trace, self._seqs.all(), info)

    def check_invariants(self) -> None:
        """Raise :class:`PagedLearnError` naming the first broken invariant (see invariants.py)."""
        check_invariants(
            self._seqs, self.allocator, self.cpu_allocator, self.prefix_cache, self.block_size
        )
