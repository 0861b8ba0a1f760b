"""Automatic prefix caching: find full KV blocks that an earlier sequence already computed.

Requests often share a prefix (a system prompt, a few-shot preamble, the earlier turns of a chat).
Each *full* block of tokens gets a content hash, and a map ``hash -> physical block`` lets a new
sequence point its block table at blocks that already hold the KV for the same tokens.

Why the hash chains on the parent: the KV of a token depends on every token before it, not only on
the tokens in its own block. So a block's identity is ``H(parent_hash, tokens of this block, extra
keys)``: two blocks with the same tokens after different prefixes get different hashes. The first
block's parent is the fixed ``ROOT_HASH``.

Extra keys hold whatever must never be shared across: the model, the adapter (LoRA), and an
optional per-user or per-tenant ``cache_salt`` (so one tenant cannot probe whether another one sent
a prompt by timing cache hits).

The hash is SHA-256 (``hashlib``). Python's built-in ``hash()`` is not used: it is 64 bits, and for
ints it is predictable, so crafted prompts could collide on purpose -- vLLM replaced it for that
reason. Even so, a hit compares the stored parent hash, token ids and extra keys too, so a
collision can only cost a miss, never hand back the wrong KV.

Only full blocks are cached (a partial block is still being written); a cached block no sequence
uses stays findable in the allocator's free queue until it is evicted.

This is the class the KV-cache manager runs on, and the one lab 3 asks you to write.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import NamedTuple

ROOT_HASH: bytes = hashlib.sha256(b"pagedlearn prefix cache root").digest()


def hash_block(parent_hash: bytes, token_ids: Sequence[int], extra_keys: tuple = ()) -> bytes:
    """SHA-256 of (parent hash, the block's token ids, extra keys); 32 bytes."""
    h = hashlib.sha256(parent_hash)
    # Fixed-width little-endian ints, length first: no two token lists serialise alike.
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    # repr of a tuple of str / int / None is deterministic across runs (unlike hash()).
    h.update(repr(extra_keys).encode())
    return h.digest()


def parent_hash(block_hashes: Sequence[bytes], j: int) -> bytes:
    """The hash block ``j`` chains on: the previous block's, or ROOT_HASH for the first block."""
    return ROOT_HASH if j == 0 else block_hashes[j - 1]


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


class ExtraKeys(tuple):
    """A tuple of extra keys that computes its ``repr`` once. SHA-256 over a block's tokens is
    cheap; the slowest part of ``hash_block`` is ``repr`` of the extra keys, the same for every
    block of a sequence, so caching it halves the time per block and ``hash_block`` stays the
    plain definition. It equals, hashes and prints as the plain tuple (same block hashes).

    >>> keys = make_extra_keys(model_id="gpt2")
    >>> keys == (("model", "gpt2"), ("adapter", None), ("salt", None))
    True
    >>> repr(keys)
    "(('model', 'gpt2'), ('adapter', None), ('salt', None))"
    """

    def __new__(cls, items: Iterable = ()) -> ExtraKeys:
        keys = super().__new__(cls, items)
        keys._repr = tuple.__repr__(keys)  # the keys are immutable: their repr never changes
        return keys

    def __repr__(self) -> str:
        return self._repr


def make_extra_keys(
    model_id: Hashable = None, adapter_id: Hashable = None, cache_salt: Hashable = None
) -> ExtraKeys:
    """The keys besides tokens that decide whether KV may be shared."""
    return ExtraKeys((("model", model_id), ("adapter", adapter_id), ("salt", cache_salt)))


class CachedBlock(NamedTuple):
    """What the cache remembers about one full block, to verify a hit beyond its hash (a cheap
    ``NamedTuple``: every full block of every prompt makes one)."""

    block_id: int
    parent_hash: bytes
    token_ids: tuple[int, ...]
    extra_keys: tuple


class PrefixCache:
    """Map from block hash to the physical block holding that KV (and back)."""

    def __init__(self) -> None:
        self._by_hash: dict[bytes, CachedBlock] = {}
        self._hash_of: dict[int, bytes] = {}  # block id -> its hash, to evict in O(1)

    def hash_block(self, parent_hash: bytes, token_ids: Sequence[int], extra_keys: tuple) -> bytes:
        return hash_block(parent_hash, token_ids, extra_keys)

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

    def hash_of(self, block_id: int) -> bytes | None:
        return self._hash_of.get(block_id)

    def items(self) -> Iterator[tuple[bytes, CachedBlock]]:
        return iter(self._by_hash.items())

    def __len__(self) -> int:
        return len(self._by_hash)
