"""The KV-cache manager of a sliding-window group: it frees what the window has left behind.

In a sliding-window layer (window ``W``; Mistral, Gemma 2/3, gpt-oss), the query at position
``p`` attends only to the keys at positions ``p - W < key_pos <= p``. Once a block's newest key
is older than that, no later query reads the block again, so it can go back to the pool while
the sequence is still generating. That is the whole difference from full attention, and it
changes three things (vLLM: ``SlidingWindowManager`` in
``vllm/v1/core/single_type_kv_cache_manager.py``):

1. **Freeing.** ``remove_skipped_blocks(seq_id, n)``, called by the scheduler before a sequence's
   next tokens (from position ``n``) are planned, frees every block whose last position is at
   most ``n - W``. Its table entry becomes ``NULL_BLOCK`` (-1): positions keep their blocks'
   places, attention starts at the window (kernels skip those entries, never reading them), and
   the table's head is a run of nulls. A sequence so holds at most ``ceil(W / block_size) + 1``
   blocks (kv_cache_groups.sliding_blocks_held), however long it grows.
2. **Prefix-cache hits.** To skip the prefill of the first ``h`` blocks of a prompt, full
   attention needs all ``h`` cached. A window needs only the blocks the first computed token can
   still see: those holding positions ``h * block_size - W + 1 .. h * block_size - 1``. The
   older ones may have been evicted long ago; they become null entries. So the longest hit is
   found from the right, not from the left, and it need not be the longest cached *prefix*.
3. **Nothing else.** Blocks are still allocated one per ``block_size`` tokens, a prefill chunk
   takes blocks for all its tokens (its queries read them, and the window before the first),
   so a prompt prefilled in one step holds all its blocks for that step; forks share blocks
   (the null entries stay null: the manager's ``fork`` and ``free_sequence`` skip them, as
   swap.py does) and copy the last one on write, swapping moves the live blocks and keeps the nulls.

>>> kv = SlidingWindowManager(num_blocks=8, block_size=4, sliding_window=6)
>>> kv.add_sequence("a", list(range(10)))          # 10 tokens: blocks 0, 1, 2
0
>>> kv.remove_skipped_blocks("a", 10)              # query 10 sees keys 5..10: block 0 is dead
1
>>> kv.block_table("a"), kv.slot_mapping("a")[:5]
([-1, 1, 2], [-1, -1, -1, -1, 4])
"""

from __future__ import annotations

from collections.abc import Hashable

from pagedlearn.core.block_table import NULL_BLOCK
from pagedlearn.core.kv_cache_manager import KVCacheManager
from pagedlearn.core.prefix_cache import hash_blocks, parent_hash
from pagedlearn.errors import PagedLearnError


class SlidingWindowManager(KVCacheManager):
    """A :class:`KVCacheManager` for layers with a sliding window of ``sliding_window`` tokens.

    Same API; ``remove_skipped_blocks`` frees the blocks the window has left behind, and a
    prefix-cache hit needs only the window's blocks (module docstring).
    """

    has_sliding_window = True

    def __init__(self, num_blocks: int, block_size: int, sliding_window: int, **kwargs) -> None:
        w = sliding_window
        if not isinstance(w, int) or isinstance(w, bool) or w < 1:
            raise PagedLearnError(f"sliding_window must be an int >= 1, got {w!r}")
        super().__init__(num_blocks, block_size, **kwargs)
        self.sliding_window = w
        self._counters["window_freed_blocks"] = 0

    def remove_skipped_blocks(self, seq_id: Hashable, num_computed_tokens: int) -> int:
        """Free the blocks no query from position ``num_computed_tokens`` on can see: those whose
        last position is ``<= num_computed_tokens - W``. Returns how many were freed."""
        table = self._seqs.on_gpu(seq_id)
        n = num_computed_tokens
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= table.num_tokens:
            raise PagedLearnError(
                f"num_computed_tokens must be an int in 0..{table.num_tokens} for {seq_id!r}, "
                f"got {n!r}"
            )
        # Block j's last position is (j + 1) * bs - 1; it is dead when that is <= n - W.
        dead = min(max(0, n - self.sliding_window + 1) // self.block_size, len(table.block_ids))
        first = table.num_null_blocks  # entries before it were freed already
        if dead <= first:
            return 0
        blocks = table.block_ids[first:dead]
        # Oldest first: in the free queue they are also the first evicted.
        self.allocator.free(blocks)
        table.block_ids[first:dead] = [NULL_BLOCK] * len(blocks)
        self._events.window_free(seq_id, blocks, first)
        self._counters["window_freed_blocks"] += len(blocks)
        return len(blocks)

    def check_fork_prefix(self, parent_id: Hashable, child_id: Hashable, num_tokens: int) -> None:
        """The manager's checks, and: the parent's entries that its window freed must be ones the
        child's next query (at position ``num_tokens``) does not read either -- else the child
        would share a prefix whose K/V is gone."""
        super().check_fork_prefix(parent_id, child_id, num_tokens)
        nulls = self._seqs.on_gpu(parent_id).num_null_blocks
        allowed = max(0, num_tokens - self.sliding_window + 1) // self.block_size
        if min(nulls, num_tokens // self.block_size) > allowed:
            raise PagedLearnError(
                f"fork_prefix({parent_id!r}, {child_id!r}, {num_tokens}): the window freed "
                f"{nulls} of the parent's first blocks, but a query at position {num_tokens} "
                f"still reads all but {allowed} of them"
            )

    def min_blocks_to_run(self, num_tokens: int) -> int:
        """A prompt prefilled a token at a time holds only its window's blocks, at most
        ``ceil(W / block_size) + 1`` (:meth:`KVCacheManager.min_blocks_to_run`)."""
        return min(self.blocks_needed(num_tokens), -(-self.sliding_window // self.block_size) + 1)

    def check_invariants(self) -> None:
        """The manager's invariants, and: no table has freed a block its next query reads."""
        super().check_invariants()
        check_window(self._seqs.gpu, self.sliding_window, self.block_size)

    def _find_prefix(
        self, tokens: list[int], extra: tuple, limit: int | None = None
    ) -> tuple[list[bytes], list[int]]:
        """The prompt's block hashes, and the longest hit of at most ``limit`` blocks that the
        window allows: ``h`` blocks hit when the blocks the query at position ``h * bs`` can
        see are all cached; the entries before them are ``NULL_BLOCK``."""
        if self.prefix_cache is None:
            return [], []
        bs, w, cache = self.block_size, self.sliding_window, self.prefix_cache
        top = (len(tokens) - 1) // bs  # never the whole prompt: its last token is computed
        if limit is not None:
            top = min(top, limit)
        hashes = hash_blocks(tokens, bs, extra)
        cached: list[int | None] = []
        run = []  # run[j]: how many blocks up to j, inclusive, are cached back to back
        for j in range(top):
            block = cache.lookup(
                hashes[j], parent_hash(hashes, j), tokens[j * bs : (j + 1) * bs], extra
            )
            cached.append(block)
            run.append(0 if block is None else (run[-1] if run else 0) + 1)
        for h in range(top, 0, -1):
            first = max(0, h * bs - w + 1) // bs  # the oldest block the query at h*bs sees
            if run[h - 1] >= h - first:
                return hashes, [NULL_BLOCK] * first + cached[first:h]
        return hashes, []


def check_window(tables: dict, window: int, block_size: int) -> None:
    """Raise :class:`PagedLearnError` if a table's null head reaches a block that the query at
    its next position (``num_tokens``) still sees: only blocks whose last position is at most
    ``num_tokens - W`` may have been freed."""
    for seq_id, t in tables.items():
        allowed = max(0, t.num_tokens - window + 1) // block_size
        if t.num_null_blocks > allowed:
            raise PagedLearnError(
                f"invariant violated: {seq_id!r} freed {t.num_null_blocks} blocks, but its next "
                f"query (position {t.num_tokens}) still reads block {allowed}"
            )
