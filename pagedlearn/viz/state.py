"""What the pictures draw: one frozen :class:`PoolState` per moment, from a live run or a replay.

Every drawing in :mod:`pagedlearn.viz` reads a ``PoolState`` and nothing else, and a ``PoolState``
comes from one of two places that must agree:

- **live**: :func:`pool_state` reads a :class:`~pagedlearn.KVCacheManager` (or an ``LLM`` /
  ``LLMEngine``, which adds its requests and stats) as it is now;
- **replay**: :func:`replay_states` rebuilds the same thing from a recorded event trace
  (:class:`~pagedlearn.trace.events.EventLog`) at every ``step`` event -- no model, no manager --
  and at every ``cache_reset`` (a prefix-cache reset between steps gets a frame of its own, which
  ``step_label`` names: "step 7 (prefix cache reset: 5 cached blocks dropped)").

The tests check that both give equal states at every step of a run, so a lab can hand out a JSON
trace and students see exactly what the live view showed. Read-only: nothing here mutates.
A replayed state also carries its run's request colours (``colors``; see ``viz/colors.py``), so
every drawing of it colours a request as the replay view does.

The frames themselves -- :class:`PoolState` in ``viz/frame.py``, :func:`pool_state` and
:func:`build_state` in ``viz/sources.py`` -- live one layer down (below ``viz/colors.py``, which
observes them) and are re-exported here, so ``from pagedlearn.viz.state import ...`` names
everything a drawing reads.
"""

from __future__ import annotations

from pagedlearn.trace.file import FRAME_KINDS
from pagedlearn.viz.frame import (  # noqa: F401 (re-exported: this module names them all)
    CACHED,
    FREE,
    SHARED,
    USED,
    BlockState,
    PoolState,
    RequestState,
    aborted,
    groups_in_order,
    kv_group_order,
    reset_note,
    step_label,
)
from pagedlearn.viz.sources import (  # noqa: F401 (re-exported, as above)
    LiveFrames,
    build_state,
    pool_state,
    reset_info,
    state_of_replay,
)


def replay_states(log) -> list[tuple[int, PoolState]]:
    """Every frame of a recorded run: ``(event index, PoolState)`` at each ``step`` event (and
    each ``cache_reset``: a prefix-cache reset's frame, ``state.cache_reset``), each with its
    colours (``state.colors``: one :class:`~pagedlearn.viz.colors.Palette` observes the
    frames in order, so a request has one colour in every drawing of the run).

    ``log`` is an :class:`~pagedlearn.trace.events.EventLog` (``llm.engine.record()``, or
    ``EventLog.from_json`` of a file a lab handed out). A log without step events (a manager
    driven by hand that never called ``kv.mark_step``) has no frames.
    """
    from pagedlearn.trace.events import PoolReplay
    from pagedlearn.viz.colors import Palette  # a lower module, but it imports matplotlib

    if "num_blocks" not in log.meta or "block_size" not in log.meta:
        raise ValueError(
            "this log has no meta['num_blocks'] / ['block_size']: record it with "
            "engine.record() or kv.record()"
        )
    # The CPU pool's size too, when recorded: an in-memory log gets the check a file gets.
    replay = PoolReplay(log.meta["num_blocks"], log.meta.get("num_cpu_blocks"))
    palette = Palette()
    frames = []
    groups = tuple(log.meta.get("kv_groups", ()))  # a coordinator's recording names them
    for e in log.events:
        replay.apply(e)
        if e.kind in FRAME_KINDS:
            reset = len(e.blocks) if e.kind == "cache_reset" else None
            state = state_of_replay(replay, log.meta["block_size"], groups, reset)
            frames.append((e.index, palette.paint(state)))
    return frames
