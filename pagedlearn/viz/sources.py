"""Where a frame comes from: a live manager or engine, or a replayed trace.

- **live**: :func:`pool_state` reads a :class:`~pagedlearn.KVCacheManager` -- or the
  :class:`~pagedlearn.hybrid.kv_cache_coordinator.KVCacheCoordinator` of a model with several
  KV-cache groups, or an ``LLM`` / ``LLMEngine``, which add their requests and stats -- as it is
  now;
- **replay**: :func:`state_of_replay` reads a :class:`~pagedlearn.trace.events.PoolReplay` as of a
  ``step`` event -- no model, no manager.

Both go through :func:`build_state`, so they cannot drift apart. A coordinator's tables are read
under the names its trace gives them, ``"<seq id>|<group>"`` (block_events.py), so that a live
frame equals its replay. Read-only: nothing here mutates.

A frame is drawn at every ``step`` event and at every ``cache_reset`` (a prefix-cache reset,
between steps: ``trace_file.FRAME_KINDS``); a reset's frame says what the step before it said
(:func:`reset_info`) and how many cached blocks the reset dropped. :class:`LiveFrames` builds
them live from a trace, as the replay does from a recording (``replay_states`` in state.py).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from pagedlearn.core.block_table import NULL_BLOCK
from pagedlearn.trace.block_events import group_seq_id
from pagedlearn.viz.frame import BlockState, PoolState, RequestState


def build_state(
    num_blocks: int,
    block_size: int,
    tables: dict[Hashable, list[int]],
    tokens: dict[Hashable, list[int]],
    swapped: dict[Hashable, list[int]],
    cached: dict[int, str],
    cached_tokens: dict[int, list[int]],
    info: dict[str, Any] | None = None,
    kv_groups: tuple[str, ...] = (),
    cache_reset: int | None = None,
) -> PoolState:
    """The one constructor both sources go through, so live and replay cannot drift apart.
    ``cache_reset``: the blocks a prefix-cache reset dropped, for a reset's frame."""
    owners: list[list[Hashable]] = [[] for _ in range(num_blocks)]
    fill = [0] * num_blocks
    content: list[tuple[int, ...]] = [()] * num_blocks
    for seq, table in tables.items():
        toks = tokens.get(seq, [])
        for j, b in enumerate(table):
            if b == NULL_BLOCK:  # freed by a sliding window: the table holds no block here
                continue
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
        kv_groups=tuple(kv_groups),
        cache_reset=cache_reset,
    )


def pool_state(
    source, info: dict[str, Any] | None = None, cache_reset: int | None = None
) -> PoolState:
    """The pool as it is now. ``source``: a ``KVCacheManager``, an ``LLMEngine`` or an ``LLM``
    (these add their requests and stats), or a ``PoolState`` (returned as is). ``info``: what a
    ``step`` event said (the live view passes it), instead of asking the engine.
    ``cache_reset``: the blocks a prefix-cache reset just dropped, for the reset's frame."""
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
    if hasattr(kv, "group_tables"):  # a KVCacheCoordinator: every group's tables, as traced
        tables, tokens, swapped = _group_tables(kv)
    else:
        seqs = kv.sequences()
        tables = {s: kv.block_table(s) for s in seqs}
        tokens = {s: kv.token_ids(s) for s in seqs + kv.swapped_sequences()}
        swapped = {s: kv._seqs.cpu[s].block_ids for s in kv.swapped_sequences()}
    return build_state(
        kv.allocator.num_blocks,
        kv.block_size,
        tables,
        tokens,
        swapped,
        cached,
        cached_tokens,
        info,
        tuple(g.name for g in getattr(kv, "groups", ())) if hasattr(kv, "group_tables") else (),
        cache_reset,
    )


def _group_tables(kv) -> tuple[dict, dict, dict]:
    """A coordinator's tables (GPU, then swapped out) under the trace's names ``"<seq>|<group>"``,
    with each one's tokens: what a replay of its trace rebuilds."""
    out = {group_seq_id(s, g.name) for s in kv.swapped_sequences() for g in kv.groups}
    tables, tokens, swapped = {}, {}, {}
    for name, table in kv.group_tables().items():
        (swapped if name in out else tables)[name] = list(table.block_ids)
        tokens[name] = list(table.token_ids)
    return tables, tokens, swapped


def state_of_replay(
    replay, block_size: int, kv_groups: tuple[str, ...] = (), cache_reset: int | None = None
) -> PoolState:
    """A :class:`~pagedlearn.trace.events.PoolReplay` (as of a ``step`` event) as a ``PoolState``;
    ``kv_groups``: the KV-cache groups the recording names (``meta["kv_groups"]``), if any.
    ``cache_reset``: the replay is as of a ``cache_reset`` event that dropped that many blocks
    (the frame then says what the last step said: :func:`reset_info`)."""
    info = replay.step_info if cache_reset is None else reset_info(replay.step_info)
    return build_state(
        len(replay.refcounts),
        block_size,
        replay.tables,
        replay.tokens,
        replay.swapped,
        replay.cached,
        replay.cached_tokens,
        info,
        kv_groups,
        cache_reset,
    )


def reset_info(step_info: dict[str, Any]) -> dict[str, Any]:
    """What a prefix-cache reset's frame says besides the blocks: what the last ``step`` event
    said (its step number, queues and stats: a reset changes none of them), less the requests
    that finished in that step (they are not finishing again)."""
    return {k: v for k, v in step_info.items() if k != "finished"}


class LiveFrames:
    """The frames of a live manager (or engine), one per event that makes a frame: call
    :meth:`at` with every trace event; it returns the ``PoolState`` to draw, or None. The same
    frames a replay of the recording builds (``replay_states``), so a live view and its replay
    agree."""

    def __init__(self, source) -> None:
        engine = getattr(source, "engine", source)
        self.kv = getattr(engine, "kv", engine)
        self.last_info: dict[str, Any] = {}  # the last step event's info

    def at(self, event) -> PoolState | None:
        if event.kind == "step":
            self.last_info = event.info
            return pool_state(self.kv, event.info)
        if event.kind == "cache_reset":
            return pool_state(self.kv, reset_info(self.last_info), len(event.blocks))
        return None
