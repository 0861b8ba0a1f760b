"""pagedlearn's block trace, said in vLLM's words: ``cache_store`` -> ``BlockStored``, ...

The KV-cache manager announces every block operation on its trace (trace/events.py). Three of
them are what vLLM's KV-cache event stream tells the outside world:

==================  ====================================================================
trace event         KV-cache event
==================  ====================================================================
``cache_store``     ``BlockStored``: the block's hash, the hash it chains on
                    (``info["parent"]``), its tokens, the block size, medium ``"GPU"``, the
                    KV-cache group (``group_idx``: the group's place in the manager's list;
                    its seq id says ``"<seq>|<group>"``) and the group's kind
``evict``           ``BlockRemoved`` (its group: the one the block was stored in)
``cache_reset``     ``AllBlocksCleared``
``step``            the end of a batch: one :class:`KVEventBatch` per engine step that
                    stored or removed anything (as vLLM: none for a step with no events)
==================  ====================================================================

Consecutive blocks of one sequence stored in one step, each chained on the one before, go out as
one ``BlockStored`` with several hashes (a prompt's blocks: vLLM does the same); evictions of one
group in a step go out as one ``BlockRemoved``.

What the stream cannot say (it is vLLM's format, made for routers): physical block ids,
refcounts, which sequence holds a block, copy-on-write, swapping, sliding-window frees, blocks
allocated but not yet full. A cache hit sends nothing either: the block was already announced.

**Block hashes on the wire.** pagedlearn hashes a block into 32 bytes (SHA-256,
core/prefix_cache.py). ``hash_format="int"`` (the default, as vLLM's
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) sends the lower 64 bits as an unsigned integer,
``int.from_bytes(digest, "big") & (2**64 - 1)``: what most routers written for vLLM read. Two
different blocks then share a wire hash with probability about ``n**2 / 2**65`` for ``n`` cached
blocks (1e-9 at 200,000 blocks): the engine itself cannot be fooled (it compares the tokens on
a hit), but a subscriber's picture would merge the two. ``hash_format="bytes"`` sends all 32
bytes (vLLM's ``=0``). The prompt's first block chains on pagedlearn's ``ROOT_HASH``, which goes
on the wire as ``parent_block_hash=None``, as vLLM's first block does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from pagedlearn.core.prefix_cache import ROOT_HASH
from pagedlearn.errors import KVEventsError
from pagedlearn.kv_events import check_positive_ints
from pagedlearn.kv_events.block_hashes import HASH_FORMATS, to_external
from pagedlearn.kv_events.messages import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from pagedlearn.trace.block_events import split_group_seq_id

MEDIUM = "GPU"  # pagedlearn caches prefixes in the GPU pool only (its CPU pool is for swapping)
_ROOT_HEX = ROOT_HASH.hex()


def wire_hash(hex_digest: str, hash_format: str = "int") -> int | bytes:
    """A block hash as it goes on the wire: the lower 64 bits, or the 32 bytes.

    >>> wire_hash("00" * 24 + "0000000000000065"), wire_hash("ab" * 2, "bytes")
    (101, b'\\xab\\xab')
    """
    return to_external(bytes.fromhex(hex_digest), int_hashes=hash_format == "int")


class TraceToEvents:
    """A trace subscriber (``trace.subscribe(TraceToEvents(...))``) that collects one step's
    block events as KV-cache events and hands each step's batch to ``on_batch``.

    ``groups``: the manager's KV-cache groups (objects with ``name`` and ``sliding_window``, as
    hybrid/kv_cache_groups.py's), or None for a model with one full-attention group. It runs on
    the engine's thread, so it only builds small objects; encoding and sending happen on the
    publisher's thread.
    """

    def __init__(
        self,
        block_size: int,
        on_batch: Callable[[KVEventBatch], Any],
        *,
        groups: Sequence[Any] | None = None,
        hash_format: str = "int",
        data_parallel_rank: int | None = 0,
    ) -> None:
        check_positive_ints(block_size=block_size)
        if hash_format not in HASH_FORMATS:
            raise KVEventsError(f"hash_format must be one of {HASH_FORMATS}, got {hash_format!r}")
        self.block_size, self.on_batch, self.hash_format = block_size, on_batch, hash_format
        self.rank = data_parallel_rank
        specs = list(groups) if groups else []
        self._index = {g.name: i for i, g in enumerate(specs)}  # group name -> group_idx
        self._kind = [_spec(g) for g in specs] or [("full_attention", None)]
        self._pending: list[Any] = []  # this step's events, in order
        self._pending_seq: Any = None  # the traced sequence of the last BlockStored pending
        # hash hex -> group_idx of the blocks cached now (at most the pool's size): an evicted
        # block's group is the one it was stored in, not the group of the sequence taking it
        self._group_of: dict[str, int] = {}

    def __call__(self, event) -> None:
        kind = event.kind
        if kind == "cache_store":
            self._store(event)
        elif kind == "evict" and "hash" in event.info:
            self._remove(event)
        elif kind == "cache_reset":
            self._pending.append(AllBlocksCleared())
            self._group_of.clear()
            self.flush()  # a frame of its own in the pictures too
        elif kind == "step":
            self.flush()

    def flush(self) -> None:
        """Hand the pending events to ``on_batch`` as one batch (nothing if none)."""
        if self._pending:
            batch = KVEventBatch(time.time(), self._pending, self.rank)
            self._pending, self._pending_seq = [], None
            self.on_batch(batch)

    def _group(self, traced_seq) -> int:
        _, name = split_group_seq_id(traced_seq)
        return self._index.get(name, 0) if name is not None else 0

    def _store(self, event) -> None:
        info, seq = event.info, event.seqs[0]
        h, g = info["hash"], self._group(seq)
        parent_hex = info.get("parent")  # (a trace without it: None, a prompt's start)
        parent = (
            None if parent_hex in (None, _ROOT_HEX) else wire_hash(parent_hex, self.hash_format)
        )
        wire, tokens = wire_hash(h, self.hash_format), list(info.get("tokens", ()))
        self._group_of[h] = g
        last = self._pending[-1] if self._pending else None
        if (
            isinstance(last, BlockStored)
            and self._pending_seq == seq
            and parent is not None
            and last.block_hashes[-1] == parent
        ):  # the next block of the same chain: one event, as vLLM sends a prompt's blocks
            last.block_hashes.append(wire)
            last.token_ids.extend(tokens)
            return
        kind, window = self._kind[g] if g < len(self._kind) else self._kind[0]
        self._pending.append(
            BlockStored(
                [wire], parent, tokens, self.block_size, None, MEDIUM, None,
                group_idx=g, kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window,
            )
        )  # fmt: skip
        self._pending_seq = seq

    def _remove(self, event) -> None:
        h = event.info["hash"]
        g = self._group_of.pop(h, None)
        g = self._group(event.seqs[0]) if g is None and event.seqs else (g or 0)
        wire, last = wire_hash(h, self.hash_format), self._pending[-1] if self._pending else None
        if isinstance(last, BlockRemoved) and last.group_idx == g:
            last.block_hashes.append(wire)
        else:
            self._pending.append(BlockRemoved([wire], MEDIUM, group_idx=g))


def cached_blocks(kv, hash_format: str = "int") -> dict[int | bytes, tuple]:
    """The prefix cache of ``kv`` (a KV-cache manager, ``engine.kv``) as its stream names it:
    wire hash -> (the parent's wire hash, None for a prompt's first block; the block's tokens).
    A subscriber that applied every batch holds exactly this
    (:meth:`KVCacheState.cached_blocks <pagedlearn.kv_events.cache_state.KVCacheState>`):
    chapter 13 and the tests compare the two."""
    int_hashes = hash_format == "int"

    def wire(digest: bytes) -> int | bytes | None:
        return None if digest == ROOT_HASH else to_external(digest, int_hashes)

    return {wire(h): (wire(e.parent_hash), tuple(e.token_ids)) for h, e in kv.prefix_cache.items()}


def _spec(group) -> tuple[str, int | None]:
    window = getattr(group, "sliding_window", None)
    return ("full_attention", None) if window is None else ("sliding_window", window)
