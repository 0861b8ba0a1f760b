"""One frame: the frozen :class:`PoolState` of the pool at one moment, and the two ways to build it.

- **live**: :func:`pool_state` reads a :class:`~pagedlearn.KVCacheManager` (or an ``LLM`` /
  ``LLMEngine``, which adds its requests and stats) as it is now;
- **replay**: :func:`state_of_replay` reads a :class:`~pagedlearn.trace.PoolReplay` as of a
  ``step`` event -- no model, no manager.

Both go through :func:`build_state`, so they cannot drift apart. Read-only: nothing here mutates.
This file sits below ``viz/colors.py`` (a palette observes frames); ``viz/state.py`` sits above
both and hands out a recorded run's frames with their colours (``replay_states``).

Per block we keep what the paper's figures show: who points at it (``owners``, from the block
tables), its ``refcount``, how many of its ``block_size`` slots hold KV (``num_tokens``, the
fullest owner's view: sharers of a partial block hold the same tokens until one writes and
copies), whether its hash is in the prefix cache (``cached``; a *free* cached block still holds a
findable prefix until it is evicted) and the tokens it holds.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

FREE, CACHED, USED, SHARED = "free", "cached", "used", "shared"


@dataclass(frozen=True)
class BlockState:
    """One physical block at one moment."""

    block_id: int
    refcount: int
    owners: tuple[Hashable, ...]  # sequences whose block table holds it (each once)
    num_tokens: int  # slots holding KV, 0..block_size
    cached: bool  # its hash is in the prefix cache
    block_hash: str | None  # hex of that hash, or None
    token_ids: tuple[int, ...]  # the tokens whose KV it holds (a free cached block: still there)

    @property
    def kind(self) -> str:
        """ "free" (empty), "cached" (free but holding a findable prefix), "used", "shared"."""
        if self.refcount == 0:
            return CACHED if self.cached else FREE
        return SHARED if self.refcount > 1 else USED


@dataclass(frozen=True)
class RequestState:
    """One engine request (waiting, running, swapped, or finished in this step)."""

    request_id: str
    status: str  # "waiting" | "running" | "swapped" | "finished"
    seqs: tuple[Hashable, ...]
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None


@dataclass(frozen=True)
class PoolState:
    """The whole pool at one moment: blocks, tables, swapped tables, requests and stats."""

    block_size: int
    blocks: tuple[BlockState, ...]
    tables: dict[Hashable, tuple[int, ...]]  # GPU-resident sequences, logical order
    num_tokens: dict[Hashable, int]  # tokens with KV, per sequence (swapped ones too)
    swapped: dict[Hashable, tuple[int, ...]] = field(default_factory=dict)  # CPU block ids
    requests: tuple[RequestState, ...] = ()
    step: int | None = None
    stats: dict[str, Any] = field(default_factory=dict)  # StepStats.as_dict() of an engine
    # request -> colour of the requests this frame shows, as the run's Palette assigned them
    # (viz/colors.py); empty for a state read from a live manager. Not part of equality: two
    # states of the same pool are equal whoever coloured them.
    colors: dict[Hashable, str] = field(default_factory=dict, compare=False)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def count(self, kind: str) -> int:
        """How many blocks are of ``kind`` ("free", "cached", "used", "shared")."""
        return sum(b.kind == kind for b in self.blocks)

    def blocks_of(self, seq_id: Hashable) -> tuple[int, ...]:
        """A GPU-resident sequence's block table (empty for one swapped out or gone)."""
        return self.tables.get(seq_id, ())

    def group_of(self, seq_id: Hashable) -> Hashable:
        """The request a sequence belongs to (engine runs), else the sequence itself. Drawings
        colour by group, so that the samples or beams of one request share a colour."""
        for r in self.requests:
            if seq_id in r.seqs:
                return r.request_id
        return _request_of(seq_id)


def groups_in_order(state: PoolState) -> list[Hashable]:
    """The groups (requests) of ``state`` in the order a palette meets them: its requests as
    listed (running, swapped, waiting, finished), then owners of blocks by block id, then
    swapped sequences. Depends only on the state's values, so that a live run and its replay
    hand out the same colours."""
    seen: dict[Hashable, None] = {}
    for r in state.requests:
        seen.setdefault(r.request_id)
    for b in state.blocks:
        for g in sorted({state.group_of(s) for s in b.owners}, key=repr):
            seen.setdefault(g)
    for s in sorted(state.swapped, key=repr):
        seen.setdefault(state.group_of(s))
    return list(seen)


def aborted(state: PoolState) -> list[str]:
    """The requests an abort finished in this frame: an abort between two steps records a frame
    of its own, after step S and numbered S too."""
    return [
        str(r.request_id)
        for r in state.requests
        if r.status == "finished" and r.finish_reason == "abort"
    ]


def step_label(state: PoolState) -> str | None:
    """What every picture and widget calls a frame: ``"step S"``, S the engine's step counter
    (or the ``step=`` a hand-driven manager marked), plus ``" (abort: r)"`` for the extra frame
    an abort records after step S. ``None`` for a frame marked without a step number."""
    if state.step is None:
        return None
    names = aborted(state)
    return f"step {state.step}" + (f" (abort: {', '.join(names)})" if names else "")


def _request_of(seq_id: Hashable) -> Hashable:
    # The engine names sequences "<request_id>.<i>"; other ids are their own group.
    if isinstance(seq_id, str) and "." in seq_id:
        return seq_id.rsplit(".", 1)[0]
    return seq_id


def build_state(
    num_blocks: int,
    block_size: int,
    tables: dict[Hashable, list[int]],
    tokens: dict[Hashable, list[int]],
    swapped: dict[Hashable, list[int]],
    cached: dict[int, str],
    cached_tokens: dict[int, list[int]],
    info: dict[str, Any] | None = None,
) -> PoolState:
    """The one constructor both sources go through, so live and replay cannot drift apart."""
    owners: list[list[Hashable]] = [[] for _ in range(num_blocks)]
    fill = [0] * num_blocks
    content: list[tuple[int, ...]] = [()] * num_blocks
    for seq, table in tables.items():
        toks = tokens.get(seq, [])
        for j, b in enumerate(table):
            owners[b].append(seq)
            held = toks[j * block_size : (j + 1) * block_size]
            if len(held) >= fill[b]:  # the fullest sharer's view (see the module docstring)
                fill[b], content[b] = len(held), tuple(held)
    blocks = []
    for b in range(num_blocks):
        if not owners[b] and b in cached:  # free but findable: its old KV is still there
            fill[b], content[b] = block_size, tuple(cached_tokens.get(b, ()))
        blocks.append(
            BlockState(
                b, len(owners[b]), tuple(owners[b]), fill[b], b in cached, cached.get(b), content[b]
            )
        )
    info = info or {}
    requests = [
        RequestState(
            r["id"],
            r["status"],
            tuple(r["seqs"]),
            r.get("prompt_tokens", 0),
            r.get("output_tokens", 0),
        )
        for r in info.get("requests", ())
    ]
    requests += [
        RequestState(
            f["id"],
            "finished",
            (),
            f.get("prompt_tokens", 0),
            f.get("output_tokens", 0),
            finish_reason=f.get("reason"),
        )
        for f in info.get("finished", ())
    ]
    return PoolState(
        block_size,
        tuple(blocks),
        {s: tuple(t) for s, t in tables.items()},
        {s: len(t) for s, t in tokens.items() if s in tables or s in swapped},
        {s: tuple(t) for s, t in swapped.items()},
        tuple(requests),
        info.get("step"),
        dict(info.get("stats", {})),
    )


def pool_state(source, info: dict[str, Any] | None = None) -> PoolState:
    """The pool as it is now. ``source``: a ``KVCacheManager``, an ``LLMEngine`` or an ``LLM``
    (these add their requests and stats), or a ``PoolState`` (returned as is). ``info``: what a
    ``step`` event said (the live view passes it), instead of asking the engine."""
    if isinstance(source, PoolState):
        return source
    engine = getattr(source, "engine", source)
    kv = getattr(engine, "kv", engine)
    if not hasattr(kv, "allocator"):
        raise TypeError(
            "pool_state needs a KVCacheManager, an LLMEngine or an LLM, got "
            f"{type(source).__name__}"
        )
    if info is None and engine is not kv:
        info = engine.step_info()
    cached, cached_tokens = {}, {}
    if kv.prefix_cache is not None:
        for block_hash, entry in kv.prefix_cache.items():
            cached[entry.block_id] = block_hash.hex()
            cached_tokens[entry.block_id] = list(entry.token_ids)
    seqs = kv.sequences()
    return build_state(
        kv.allocator.num_blocks,
        kv.block_size,
        {s: kv.block_table(s) for s in seqs},
        {s: kv.token_ids(s) for s in seqs + kv.swapped_sequences()},
        {s: kv._swapped[s].block_ids for s in kv.swapped_sequences()},
        cached,
        cached_tokens,
        info,
    )


def state_of_replay(replay, block_size: int) -> PoolState:
    """A :class:`~pagedlearn.trace.PoolReplay` (as of a ``step`` event) as a ``PoolState``."""
    return build_state(
        len(replay.refcounts),
        block_size,
        replay.tables,
        replay.tokens,
        replay.swapped,
        replay.cached,
        replay.cached_tokens,
        replay.step_info,
    )
