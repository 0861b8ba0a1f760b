"""One frame: the frozen :class:`PoolState` of the pool at one moment.

Two places build one (``viz/sources.py``): a live manager or engine (``pool_state``), and a
replayed trace (``state_of_replay``); both go through one constructor, so they cannot drift
apart. Read-only: nothing here mutates. This file sits below ``viz/sources.py`` and
``viz/colors.py`` (a palette observes frames); ``viz/state.py`` sits above them all and hands
out a recorded run's frames with their colours (``replay_states``).

Per block we keep what the paper's figures show: who points at it (``owners``, from the block
tables), its ``refcount``, how many of its ``block_size`` slots hold KV (``num_tokens``, the
fullest owner's view: sharers of a partial block hold the same tokens until one writes and
copies), whether its hash is in the prefix cache (``cached``; a *free* cached block still holds a
findable prefix until it is evicted) and the tokens it holds.

**KV-cache groups.** A model that mixes attention kinds (kv_cache_groups.py: full and
sliding-window layers) keeps a block table per sequence *per group*, over one pool. A frame of
such a model names each table as the trace does, ``"<seq id>|<group>"`` (block_events.py), so
that a live frame and its replay hold the same keys: ``tables["a|sliding 24"]``. A sliding
group's table starts with null entries (-1, ``NULL_BLOCK``): blocks its window left behind,
back in the pool; no block is owned through them. :attr:`PoolState.kv_groups` names the groups,
as the source says them (a coordinator's ``groups``, a recording's ``meta["kv_groups"]``), never
guessed from the ids; empty for a one-group model such as GPT-2. :meth:`PoolState.kv_group_of` and
:meth:`PoolState.seq_of` split a key, and :meth:`PoolState.group_of` -- the *request*, which
decides the colour -- is the same for a sequence's tables in every group.

**A prefix-cache reset** (``reset_prefix_cache``) gets a frame of its own, drawn at its
``cache_reset`` event, between two steps: :attr:`PoolState.cache_reset` says how many cached
blocks it dropped, and :func:`step_label` -- the name every picture and panel gives a frame --
says so: ``"step 7 (prefix cache reset: 5 cached blocks dropped)"``.
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from pagedlearn.core.block_table import NULL_BLOCK
from pagedlearn.trace.block_events import group_seq_id, split_group_seq_id

FREE, CACHED, USED, SHARED = "free", "cached", "used", "shared"


@dataclass(frozen=True)
class BlockState:
    """One physical block at one moment."""

    block_id: int
    refcount: int
    owners: tuple[Hashable, ...]  # tables holding it (each once; "<seq>|<group>" if grouped)
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
    # GPU-resident sequences, logical order; -1: freed by a sliding window (see the docstring)
    tables: dict[Hashable, tuple[int, ...]]
    num_tokens: dict[Hashable, int]  # tokens with KV, per sequence (swapped ones too)
    swapped: dict[Hashable, tuple[int, ...]] = field(default_factory=dict)  # CPU block ids
    requests: tuple[RequestState, ...] = ()
    step: int | None = None
    stats: dict[str, Any] = field(default_factory=dict)  # StepStats.as_dict() of an engine
    # request -> colour of the requests this frame shows, as the run's Palette assigned them
    # (viz/colors.py); empty for a state read from a live manager. Not part of equality: two
    # states of the same pool are equal whoever coloured them.
    colors: dict[Hashable, str] = field(default_factory=dict, compare=False)
    # The KV-cache groups, in the coordinator's order, when the source has several (its
    # tables are then named "<seq>|<group>"); () for a one-group model.
    kv_groups: tuple[str, ...] = ()
    # A prefix-cache reset's frame: how many cached blocks it dropped (None: not a reset's).
    cache_reset: int | None = None

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
        colour by group, so that the samples or beams of one request share a colour -- in every
        KV-cache group: ``"a.0|full"`` and ``"a.0|sliding 24"`` are both request ``a``'s."""
        seq_id = self.seq_of(seq_id)
        for r in self.requests:
            if seq_id in r.seqs:
                return r.request_id
        return _request_of(seq_id)

    def kv_group_of(self, seq_id: Hashable) -> str | None:
        """The KV-cache group a table's name says (``"a|full"`` -> ``"full"``); None without
        groups."""
        return split_group_seq_id(seq_id)[1] if self.kv_groups else None

    def seq_of(self, seq_id: Hashable) -> Hashable:
        """The sequence a table's name belongs to (``"a|full"`` -> ``"a"``); the name itself
        without groups."""
        return split_group_seq_id(seq_id)[0] if self.kv_groups else seq_id

    def tables_of(self, seq_id: Hashable) -> list[Hashable]:
        """The names of a sequence's tables (GPU or swapped): ``[seq_id]`` without groups, one
        per KV-cache group with them (``seq_id`` may be a table's name too)."""
        if not self.kv_groups or split_group_seq_id(seq_id)[1] is not None:
            names = [seq_id]
        else:
            names = [group_seq_id(seq_id, g) for g in self.kv_groups]
        return [s for s in names if s in self.tables or s in self.swapped]

    def group_counts(self) -> dict[str, int]:
        """Blocks each KV-cache group's GPU tables hold (a block shared by forks counted once);
        ``{}`` without groups. The same numbers as the coordinator's ``stats()["groups"]``."""
        held: dict[str, set[int]] = {g: set() for g in self.kv_groups}
        if not held:
            return {}
        for s, table in self.tables.items():
            held[self.kv_group_of(s)].update(b for b in table if b != NULL_BLOCK)
        return {g: len(blocks) for g, blocks in held.items()}


_GROUP_NAME = re.compile(r"(full|sliding (\d+))(?: #(\d+))?")


def kv_group_order(name: str) -> tuple:
    """Sort key of a KV-cache group's name, in ``group_layers``' order: ``full`` groups, then
    ``sliding W`` by window, each kind's ``#k`` in order; other names last, by name."""
    m = _GROUP_NAME.fullmatch(name)
    if m is None:
        return (2, 0, 0, name)
    return (m[2] is not None, int(m[2] or 0), int(m[3] or 0), name)


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
    an abort records after step S, or ``" (prefix cache reset: N cached blocks dropped)"`` for
    a reset's frame. ``None`` for a frame marked without a step number (a reset's frame is
    still named by its note)."""
    note = reset_note(state)
    if state.step is None:
        return note
    names = aborted(state)
    label = f"step {state.step}" + (f" (abort: {', '.join(names)})" if names else "")
    return label + (f" ({note})" if note else "")


def reset_note(state: PoolState) -> str | None:
    """``"prefix cache reset: N cached blocks dropped"`` for a reset's frame, else None."""
    n = state.cache_reset
    if n is None:
        return None
    return f"prefix cache reset: {n} cached block{'' if n == 1 else 's'} dropped"


def _request_of(seq_id: Hashable) -> Hashable:
    # The engine names sequences "<request_id>.<i>"; other ids are their own group.
    if isinstance(seq_id, str) and "." in seq_id:
        return seq_id.rsplit(".", 1)[0]
    return seq_id
