"""One sequence's block table: its logical blocks, in order, mapped to physical block ids.

A sequence sees its KV cache as contiguous: token ``i`` lives in *logical* block
``i // block_size`` at offset ``i % block_size``. The block table says which *physical* block holds
each logical block, so the physical blocks can sit anywhere in the pool -- no reservation of a
maximum length, no external fragmentation, at most one partly filled block per sequence.

The *slot* of token ``i`` is its row in the flattened KV slab ``(num_blocks * block_size, ...)``::

    slot(i) = block_ids[i // block_size] * block_size + i % block_size

Example (the paper's Figure 6 spirit): block_size 4, block_ids [7, 2, 11], 10 tokens. Token 5 is in
logical block 1 -> physical block 2, offset 1 -> slot 9. Token 9 sits in block 11 at offset 1,
slot 45; slots 46 and 47 of block 11 are still empty.

In a sliding-window KV-cache group (hybrid/) the blocks a window has left behind go back to the
pool, and their entries become ``NULL_BLOCK`` (-1): the table keeps its positions (logical block
``j`` still starts at token ``j * block_size``), attention never reads those entries, and their
slots are -1 ("skip", ``slot_mapping``). Null entries only ever form the head of a table.

The table also remembers the token ids (the prefix cache hashes full blocks of them) and, when
prefix caching is on, the hash of each full block so far (each hash chains on the previous one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

NULL_BLOCK = -1  # a freed entry of a sliding-window table: no block, never read


@dataclass
class BlockTable:
    """Logical -> physical map of one sequence, with its token ids."""

    block_size: int
    block_ids: list[int] = field(default_factory=list)  # physical id of logical block j
    token_ids: list[int] = field(default_factory=list)  # tokens whose KV is in those blocks
    block_hashes: list[bytes] = field(default_factory=list)  # hash of full block j (caching on)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_full_blocks(self) -> int:
        return self.num_tokens // self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that ``num_tokens`` tokens occupy: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    @property
    def num_null_blocks(self) -> int:
        """Leading entries freed by a sliding window (``NULL_BLOCK``); 0 in a full group."""
        n = 0
        while n < len(self.block_ids) and self.block_ids[n] == NULL_BLOCK:
            n += 1
        return n

    def live_blocks(self) -> list[int]:
        """The physical blocks the table holds (its null entries left out)."""
        if not self.block_ids or self.block_ids[0] != NULL_BLOCK:  # nulls only form the head
            return list(self.block_ids)
        return [b for b in self.block_ids if b != NULL_BLOCK]

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

    def block_tokens(self, j: int) -> list[int]:
        """Token ids stored in logical block ``j``."""
        return self.token_ids[j * self.block_size : (j + 1) * self.block_size]

    def copy(self) -> BlockTable:
        """An independent table pointing at the same physical blocks (used by fork)."""
        return BlockTable(
            self.block_size, list(self.block_ids), list(self.token_ids), list(self.block_hashes)
        )
