"""The prefix cache the KV-cache manager runs on: :class:`PrefixCache`'s hashes and entries, faster.

prefix_cache.py is the version to read (and the one lab 3 asks you to write): ``hash_block``
serialises one block and hashes it, ``hash_blocks`` chains it over a prompt, ``lookup`` verifies
one hit. :class:`FastPrefixCache` computes exactly the same 32-byte hashes and stores the same
entries -- tests/test_fast_paths.py checks both on random prompts -- and changes only what
a prompt of hundreds of blocks pays for:

- The extra keys (model, adapter, salt) are the same for every block of a sequence, but
  ``repr(extra_keys).encode()`` ran once per block: here it runs once per sequence (a small dict
  remembers the bytes of each extra-keys tuple the manager hands in).
- The token ids of a block are packed by a precompiled ``struct.Struct`` (one per block size) and
  the chain is one loop with everything it needs in local variables -- no helper call per block.

``python benchmarks/bench_block_manager.py`` measures both (admission and churn with caching on,
the columns ``pagedlearn`` and ``pagedlearn plain``).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from pagedlearn.core.prefix_cache import ROOT_HASH, PrefixCache


class FastPrefixCache(PrefixCache):
    """:class:`PrefixCache` with the same hashes and entries and a faster prompt walk.

    >>> from pagedlearn.core.prefix_cache import hash_blocks
    >>> cache = FastPrefixCache()
    >>> hashes, hits = cache.match([1, 2, 3, 4, 5], 2, ())
    >>> hashes == hash_blocks([1, 2, 3, 4, 5], 2, ()), hits  # the reference's hashes
    (True, [])
    """

    def __init__(self) -> None:
        super().__init__()
        self._extra_bytes: dict[int, tuple[tuple, bytes]] = {}  # id -> (keys, bytes)
        self._packers: dict[int, struct.Struct] = {}  # block size -> its Struct

    def _encoded(self, extra_keys: tuple) -> bytes:
        """``repr(extra_keys).encode()``, remembered per tuple *object*: the manager hands the
        same tuple for every block of a sequence. (By identity, not equality: ``1 == True``,
        but their reprs differ. The dict holds the tuple, so its id cannot be reused.)"""
        seen = self._extra_bytes.get(id(extra_keys))
        if seen is not None and seen[0] is extra_keys:
            return seen[1]
        if len(self._extra_bytes) >= 4096:  # one per live sequence, roughly: keep it bounded
            self._extra_bytes.clear()
        encoded = repr(extra_keys).encode()
        self._extra_bytes[id(extra_keys)] = (extra_keys, encoded)
        return encoded

    def hash_block(self, parent_hash: bytes, token_ids: Sequence[int], extra_keys: tuple) -> bytes:
        """:func:`~pagedlearn.core.prefix_cache.hash_block`, with the extra keys' bytes reused."""
        n = len(token_ids)
        packer = self._packers.get(n) or self._packer(n)
        h = hashlib.sha256(parent_hash)
        h.update(packer.pack(n, *token_ids))
        h.update(self._encoded(extra_keys))
        return h.digest()

    def _packer(self, n: int) -> struct.Struct:
        packer = self._packers[n] = struct.Struct(f"<I{n}q")  # prefix_cache.hash_block's format
        return packer

    def match(
        self, token_ids: Sequence[int], block_size: int, extra_keys: tuple
    ) -> tuple[list[bytes], list[int]]:
        """:meth:`PrefixCache.match`: the prompt's full-block hashes, and the cached blocks
        holding its longest prefix (never all of it). Changes nothing."""
        bs, extra = block_size, self._encoded(extra_keys)
        pack = (self._packers.get(bs) or self._packer(bs)).pack
        sha256, hashes, parent = hashlib.sha256, [], ROOT_HASH
        for start in range(0, len(token_ids) - bs + 1, bs):  # every full block, chained
            h = sha256(parent)
            h.update(pack(bs, *token_ids[start : start + bs]))
            h.update(extra)
            parent = h.digest()
            hashes.append(parent)
        hits: list[int] = []
        by_hash, parent = self._by_hash, ROOT_HASH
        for j in range((len(token_ids) - 1) // bs):  # never the last token (it needs logits)
            entry = by_hash.get(hashes[j])
            if (
                entry is None  # a miss
                or entry.parent_hash != parent  # a hash collision: also a miss
                or entry.token_ids != tuple(token_ids[j * bs : (j + 1) * bs])
                or entry.extra_keys != extra_keys
            ):
                break
            hits.append(entry.block_id)
            parent = hashes[j]
        return hashes, hits
