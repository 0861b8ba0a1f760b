r"""The prefix cache a KV-event stream describes: a tree of cached blocks, rebuilt from the events.

vLLM never sends its cache; it sends what changed (``messages.py``). Replaying those changes in
order gives the cache's *content* as a tree: a ``BlockStored`` names its blocks' hashes, in prompt
order, and the hash of the block before the first (``parent_block_hash``, None at a prompt's
start), so every block hangs under its parent, and two prompts that share a prefix share the
path from the root to where they part::

    root "You are a helpful"  ->  " assistant. Answer"  ->  " in French."      (prompt 1)
                                                        \->  " briefly."        (prompt 2)

A block is named by :class:`BlockKey`: its hash *and* where it lives (the data-parallel rank,
the medium -- ``"GPU"``, ``"CPU"`` --, the KV-cache group), because vLLM stores the same hash
once per group and may hold it on GPU and CPU at once. A parent is looked up in the same place.

What the stream cannot show: physical block ids, refcounts (how many running requests use a
block), copy-on-write, and whether a cached block is in use or free-but-findable -- vLLM sends
``BlockRemoved`` only when a block's hash is evicted.

A stream is untrusted and may be joined late, so nothing here raises on bad content; each oddity
is counted in :attr:`KVCacheState.problems` (with the last few described in ``notes``):

- ``parent_unseen``: a block whose parent was never stored (we joined late, or it was removed):
  it stays a root of its own subtree, and is re-attached if the parent is stored later;
- ``unknown_removed``: a ``BlockRemoved`` of a hash not held (stored before we joined, or
  dropped at the cap); ``duplicate_stored``: a hash stored again without being removed;
- ``token_mismatch``: ``len(token_ids) != len(block_hashes) * block_size`` (the blocks are kept
  without tokens); ``bad_event``: an event that is not one of the three, or with fields of the
  wrong type; ``stale_batch``: a batch whose sequence number is not after the last one applied;
- ``dropped_at_cap``: memory is bounded by ``max_blocks``; past it, new blocks are not kept and
  :attr:`KVCacheState.capped` says so. The history of removals and the size series are bounded
  deques (the latest ``history`` entries).

:mod:`~pagedlearn.kv_events.cache_summary` turns it into numbers and words (the terminal's,
``cli/kv_events.py``); ``viz/prefix_tree.py``, ``viz/kv_events_timeline.py`` and
``viz/kv_events_live.py`` draw it.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pagedlearn.errors import KVEventsError
from pagedlearn.kv_events import check_positive_ints

MAX_BLOCKS = 100_000  # blocks held; measured ~0.85 KB each with 16 tokens: ~85 MB at most
HISTORY = 10_000  # removals and batch points kept
MAX_BLOCK_SIZE = 1 << 16  # a block_size beyond this is a bad event, not a block
NOTES = 20  # problems described in words (the latest)


class BlockKey(NamedTuple):
    """Where a cached block lives, and its hash (an int: the digest's low 64 bits; or bytes)."""

    rank: int | None  # data-parallel rank of the engine that sent it
    medium: str | None  # "GPU", "CPU", ... (None: the sender did not say)
    group: int | None  # KV-cache group (None: the sender did not say)
    block_hash: int | bytes


@dataclass(slots=True, eq=False)
class StoredBlock:
    """One cached block as the events describe it."""

    key: BlockKey
    parent_hash: int | bytes | None  # as the event said; None: the first block of a prompt
    token_ids: tuple[int, ...] | None  # [block_size], None when the event's tokens did not fit
    block_size: int
    lora: str | int | None  # lora_name, else lora_id
    extra_keys: Any  # what else went into the hash (vLLM's extra_keys for this block)
    seq: int | None  # sequence number of the batch that stored it
    ts: float  # that batch's timestamp (seconds since the epoch)
    parent: BlockKey | None = None  # the parent held here; None for a root
    children: dict[BlockKey, None] = field(default_factory=dict)  # ordered; O(1) removal

    @property
    def parent_unseen(self) -> bool:
        """A root whose parent is not held (never seen, or removed since)."""
        return self.parent is None and self.parent_hash is not None


class Removal(NamedTuple):
    seq: int | None
    ts: float
    key: BlockKey | None  # None for an AllBlocksCleared
    count: int  # 1, or the blocks an AllBlocksCleared dropped


class BatchPoint(NamedTuple):
    """One applied batch: what it did and the cache's size after it."""

    seq: int | None
    ts: float
    stored: int
    removed: int
    cleared: int
    size: int


class KVCacheState:
    """The cache described by a stream of ``KVEventBatch``es: ``state.apply(batch, seq)``.

    ``max_blocks`` bounds the blocks held, ``history`` the removals and batch points kept.
    Events are dispatched by their class name (``BlockStored``, ``BlockRemoved``,
    ``AllBlocksCleared``), so anything with their fields works, not only ``messages.py``'s.
    """

    def __init__(self, max_blocks: int = MAX_BLOCKS, history: int = HISTORY) -> None:
        check_positive_ints(max_blocks=max_blocks, history=history)
        self.max_blocks, self.history = max_blocks, history
        self.blocks: dict[BlockKey, StoredBlock] = {}
        self.by_hash: dict[int | bytes, set[BlockKey]] = {}  # for removals that omit a field
        self._orphans: dict[BlockKey, set[BlockKey]] = {}  # missing parent -> its children
        self.counts: Counter = Counter()  # (medium, group) -> blocks held now
        self.block_sizes: Counter = Counter()  # block_size -> blocks held now
        self.received: Counter = Counter()  # batches, events, BlockStored, blocks_stored, ...
        self.problems: Counter = Counter()  # see the module docstring
        self.notes: deque[str] = deque(maxlen=NOTES)
        self.removals: deque[Removal] = deque(maxlen=history)
        self.timeline: deque[BatchPoint] = deque(maxlen=history)
        self.last_seq: int | None = None
        self.first_ts: float | None = None
        self.last_ts: float | None = None

    # --- feeding ----------------------------------------------------------------------------------
    def apply(self, batch, seq: int | None = None) -> bool:
        """Apply one batch (or a ``(seq, batch)`` pair, as a subscriber delivers them). Returns
        False for a stale batch (its ``seq`` not after the last one applied), which is skipped."""
        if isinstance(batch, tuple) and len(batch) == 2 and seq is None:
            seq, batch = batch
        events, ts = getattr(batch, "events", None), getattr(batch, "ts", None)
        if not isinstance(events, (list, tuple)) or not isinstance(ts, (int, float)):
            raise KVEventsError(f"apply needs a KVEventBatch, got {type(batch).__name__}")
        if seq is not None and self.last_seq is not None and seq <= self.last_seq:
            self._problem("stale_batch", f"batch {seq} skipped: not after {self.last_seq}")
            return False
        self.last_seq = seq if seq is not None else self.last_seq
        self.first_ts = ts if self.first_ts is None else self.first_ts
        self.last_ts = ts
        self.received["batches"] += 1
        before = Counter(self.received)
        rank = getattr(batch, "data_parallel_rank", None)
        for i, event in enumerate(events):
            self.apply_event(event, seq=seq, ts=ts, rank=rank, where=f"batch {seq} event {i}")
        delta = self.received - before
        self.timeline.append(
            BatchPoint(seq, ts, delta["blocks_stored"], delta["blocks_removed"],
                       delta["blocks_cleared"], len(self.blocks))
        )  # fmt: skip
        return True

    def extend(self, pairs) -> int:
        """Apply every ``(seq, batch)`` of an iterable; returns how many were applied."""
        return sum(self.apply(seq_batch) for seq_batch in pairs)

    def apply_event(self, event, *, seq=None, ts: float = 0.0, rank=None, where="event") -> None:
        """Apply one event (bad content is counted, never raised: see the module docstring)."""
        kind = type(event).__name__
        self.received["events"] += 1
        try:
            if kind == "BlockStored":
                self._store(event, seq, ts, rank, where)
            elif kind == "BlockRemoved":
                self._remove(event, seq, ts, rank, where)
            elif kind == "AllBlocksCleared":
                self._clear(seq, ts, rank)
            else:
                raise KVEventsError(f"not a KV-cache event: {kind}")
            self.received[kind] += 1
        except (KVEventsError, AttributeError, TypeError) as exc:
            self._problem("bad_event", f"{where} ({kind}) ignored: {exc}")

    # --- the three events -------------------------------------------------------------------------
    def _store(self, ev, seq, ts, rank, where) -> None:
        hashes, size, tokens = list(ev.block_hashes), ev.block_size, ev.token_ids
        if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= MAX_BLOCK_SIZE:
            raise KVEventsError(f"block_size must be in 1..{MAX_BLOCK_SIZE}, got {size!r}")
        if not all(isinstance(h, (int, bytes)) and not isinstance(h, bool) for h in hashes):
            raise KVEventsError("block_hashes must be ints or bytes")
        if tokens is None or len(tokens) != len(hashes) * size:
            got = "none" if tokens is None else len(tokens)
            self._problem("token_mismatch", f"{where}: {got} token ids for {len(hashes)} "
                          f"blocks of {size}; kept without tokens")  # fmt: skip
            tokens = None
        extra = getattr(ev, "extra_keys", None)
        extra = extra if isinstance(extra, list) and len(extra) == len(hashes) else None
        medium, group = getattr(ev, "medium", None), getattr(ev, "group_idx", None)
        lora = getattr(ev, "lora_name", None) or getattr(ev, "lora_id", None)
        parent = ev.parent_block_hash
        for j, h in enumerate(hashes):
            key = BlockKey(rank, medium, group, h)
            block_tokens = tuple(tokens[j * size : (j + 1) * size]) if tokens else None
            if key in self.blocks:
                self._problem("duplicate_stored", f"{where}: hash {short(h)} stored again")
            elif len(self.blocks) >= self.max_blocks:
                if not self.problems["dropped_at_cap"]:
                    self.notes.append(self.cap_message())
                self.problems["dropped_at_cap"] += 1
            else:
                extra_j = extra[j] if extra else None
                node = StoredBlock(key, parent, block_tokens, size, lora, extra_j, seq, ts)
                self._add(node, where if j == 0 else None)
                self.received["blocks_stored"] += 1  # (a duplicate or a dropped one: not)
            parent = h

    def _add(self, node: StoredBlock, where: str | None) -> None:
        key = node.key
        self.blocks[key] = node
        self.by_hash.setdefault(key.block_hash, set()).add(key)
        self.counts[key.medium, key.group] += 1
        self.block_sizes[node.block_size] += 1
        if node.parent_hash is not None:
            pkey = key._replace(block_hash=node.parent_hash)
            if pkey in self.blocks and pkey != key:  # (its own parent: refused when adopted)
                self._link(pkey, key)
            else:  # joined late, or the parent was removed: a root until the parent comes
                self._orphans.setdefault(pkey, set()).add(key)
                if where is not None:
                    self._problem("parent_unseen", f"{where}: parent {short(pkey.block_hash)} "
                                  "not held; kept as a root")  # fmt: skip
        for child in sorted(self._orphans.pop(key, ()), key=lambda k: self.blocks[k].ts):
            if self._is_ancestor(child, key):  # a crafted loop (A under B under A): refused
                self._problem("bad_event", f"hash {short(child.block_hash)} would be its own "
                              "ancestor; left a root")  # fmt: skip
            else:
                self._link(key, child)  # the parent of earlier orphans arrived: adopt them

    def _is_ancestor(self, maybe: BlockKey, key: BlockKey) -> bool:
        while key is not None:
            if key == maybe:
                return True
            key = self.blocks[key].parent
        return False

    def _link(self, parent: BlockKey, child: BlockKey) -> None:
        self.blocks[child].parent = parent
        self.blocks[parent].children[child] = None

    def _remove(self, ev, seq, ts, rank, where) -> None:
        medium, group = getattr(ev, "medium", None), getattr(ev, "group_idx", None)
        for h in list(ev.block_hashes):
            keys = [
                k
                for k in self.by_hash.get(h, ())
                if k.rank == rank and medium in (None, k.medium) and group in (None, k.group)
            ]  # a field the sender left out (None) matches any
            if not keys:
                self._problem("unknown_removed", f"{where}: hash {short(h)} removed, not held")
            for key in keys:
                self._drop(key)
                self.removals.append(Removal(seq, ts, key, 1))
            self.received["blocks_removed"] += len(keys)

    def _drop(self, key: BlockKey) -> StoredBlock:
        node = self.blocks.pop(key)
        same = self.by_hash[key.block_hash]
        same.discard(key)
        if not same:
            del self.by_hash[key.block_hash]
        for counter, k in (
            (self.counts, (key.medium, key.group)),
            (self.block_sizes, node.block_size),
        ):
            counter[k] -= 1
            if not counter[k]:
                del counter[k]
        if node.parent is not None:
            del self.blocks[node.parent].children[key]
        elif node.parent_hash is not None:
            missing = key._replace(block_hash=node.parent_hash)
            waiting = self._orphans.get(missing, set())
            waiting.discard(key)
            if not waiting:
                self._orphans.pop(missing, None)
        for child in node.children:  # they stay, as roots waiting for this hash to come back
            self.blocks[child].parent = None
            self._orphans.setdefault(key, set()).add(child)
        return node

    def _clear(self, seq, ts, rank) -> None:
        keys = [k for k in self.blocks if rank is None or k.rank == rank]
        if len(keys) == len(self.blocks):  # all of it: start afresh (the orphan index too)
            for table in (self.blocks, self.by_hash, self._orphans, self.counts, self.block_sizes):
                table.clear()
        else:  # one data-parallel rank's cache, in a stream that carries several
            for key in keys:
                self._drop(key)
        self.removals.append(Removal(seq, ts, None, len(keys)))
        self.received["blocks_cleared"] += len(keys)

    # --- reading ----------------------------------------------------------------------------------
    def roots(self) -> list[StoredBlock]:
        """Blocks with no parent held (prompts' first blocks, parent-unseen ones), oldest first."""
        return sorted((b for b in self.blocks.values() if b.parent is None), key=lambda b: b.ts)

    def walk(self):
        """``(block, depth)`` for every block, parents before children, roots oldest first."""
        stack = [(b, 0) for b in reversed(self.roots())]
        while stack:
            block, d = stack.pop()
            yield block, d
            stack += [(self.blocks[c], d + 1) for c in reversed(list(block.children))]

    def cached_blocks(self) -> dict[int | bytes, tuple]:
        """The picture as hash -> (parent hash, tokens): the shape of
        :func:`pagedlearn.kv_events.from_trace.cached_blocks`, an engine's own prefix cache, to
        compare with. (A hash held in several places -- media, groups, ranks -- appears once.)"""
        return {k.block_hash: (b.parent_hash, b.token_ids) for k, b in self.blocks.items()}

    def leaves_below(self) -> dict[BlockKey, int]:
        """Per block, the leaves of its subtree (a leaf counts itself): how many cached
        continuations share the prefix that ends at it."""
        order = list(self.walk())
        leaves: dict[BlockKey, int] = {}
        for block, _ in reversed(order):  # children before parents
            leaves[block.key] = sum(leaves[c] for c in block.children) or 1
        return leaves

    @property
    def block_size(self) -> int | None:
        """The block size of most blocks held now (a server has one; None while empty)."""
        return self.block_sizes.most_common(1)[0][0] if self.block_sizes else None

    @property
    def capped(self) -> bool:
        return self.problems["dropped_at_cap"] > 0

    def cap_message(self) -> str:
        return (f"cap of {self.max_blocks:,} blocks reached: later stored blocks are not kept "
                "and the picture is incomplete (raise max_blocks / --max-blocks)")  # fmt: skip

    def _problem(self, kind: str, text: str) -> None:
        self.problems[kind] += 1
        self.notes.append(text)

    def summary(self, top: int = 5):
        """Counts, size, depth, shared prefixes: a :class:`~.cache_summary.CacheSummary`."""
        from pagedlearn.kv_events.cache_summary import summarize

        return summarize(self, top)

    def hit_opportunities(self, token_ids, hasher=None, **where):
        """How many leading full blocks of a new prompt are cached now, matched by the prompt's
        hashes (with ``hasher``, from :mod:`~.block_hashes`) and by its tokens: a
        :class:`~.cache_summary.HitReport`. ``where``: ``rank``, ``medium``, ``group`` to look
        in one place only."""
        from pagedlearn.kv_events.cache_summary import hit_opportunities

        return hit_opportunities(self, token_ids, hasher, **where)


def short(h: int | bytes) -> str:
    """A hash for a human: its first 8 hex digits (``0x1a2b3c4d..``); a small int in full."""
    if isinstance(h, int) and h < 1 << 32:
        return f"0x{h:x}"
    text = h.hex() if isinstance(h, bytes) else f"{h:016x}"
    return f"0x{text[:8]}.."
