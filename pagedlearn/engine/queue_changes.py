"""The scheduler's decisions, read back from a recording: who each step admitted, swapped back
in, preempted or finished -- the paper's policy (section 4.5), step by step.

Separate from :mod:`pagedlearn.engine.stats` because it reads no engine: it replays the ``step``
frames of a recording (``engine.record()``; the frames are built in outputs.py), after the fact.
Chapter 07 and lab 6 print it beside the free blocks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class QueueChange:
    """What one step did to the scheduler's queues (request ids, each list in arrival order)."""

    step: int
    admitted: tuple[str, ...]  # waiting -> running: its prefill (or first chunk) starts
    swapped_in: tuple[str, ...]  # swapped -> running: its blocks came back from the CPU pool
    preempted: tuple[str, ...]  # running -> waiting (recompute) or swapped (swap)
    finished: tuple[str, ...]  # ended this step: done, aborted or failed
    running: tuple[str, ...]  # the queues after the step
    swapped: tuple[str, ...]
    waiting: tuple[str, ...]


def queue_changes(events: Iterable) -> list[QueueChange]:
    """The scheduler's decisions, step by step, read back from a recording.

    ``events``: an :class:`~pagedlearn.trace.events.EventLog` from ``engine.record()``, or its
    events. Only the ``step`` events are read: after every step the engine records every request's
    queue (:meth:`~pagedlearn.engine.llm_engine.LLMEngine.step_info`), so two frames in a row say
    who moved. One :class:`QueueChange` per frame (an abort between steps adds a frame of its own).
    A request that no earlier frame lists counts as waiting: it has just arrived. A request
    preempted by recompute goes back to waiting, so it is ``admitted`` again later (it prefills
    again); one preempted by swap comes back as ``swapped_in``.

    The queues are listed as the scheduler keeps them, in arrival order, so the policy can be read
    off: requests are admitted from the front of the waiting queue, a preempted request arrived
    after every request still running, and no step admits anyone while a request stays swapped.
    """
    changes: list[QueueChange] = []
    before: dict[str, str] = {}
    for e in getattr(events, "events", events):
        if e.kind != "step" or "requests" not in e.info:
            continue
        now = {r["id"]: r["status"] for r in e.info["requests"]}
        moved: dict[str, list[str]] = {"admitted": [], "swapped_in": [], "preempted": []}
        for rid, status in now.items():
            was = before.get(rid, "waiting")
            if status == "running" and was != "running":
                moved["admitted" if was == "waiting" else "swapped_in"].append(rid)
            elif was == "running" and status != "running":
                moved["preempted"].append(rid)
        queues = {
            q: tuple(r for r, s in now.items() if s == q) for q in ("running", "swapped", "waiting")
        }
        finished = tuple(f["id"] for f in e.info.get("finished", ()))
        changes.append(QueueChange(e.info["step"], *map(tuple, moved.values()), finished, **queues))
        before = now
    return changes
