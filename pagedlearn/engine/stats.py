"""Per-step statistics: the numbers a vLLM operator watches on a dashboard.

After every ``step()`` the engine builds one :class:`StepStats` and hands it to its subscribers
(``engine.subscribe_stats(fn)``). Queue sizes and pool usage describe the moment after the step;
the counters (prefix-cache tokens, evictions, preemptions, swaps, allocation failures) are
running totals since the engine started, so a plot of them is monotone and a difference of two
steps gives the rate.

:func:`queue_changes` reads a recording (``engine.record()``) back as the scheduler's decisions:
which requests each step admitted, swapped back in, preempted or finished -- the paper's policy
(section 4.5), step by step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import ClassVar


@dataclass(frozen=True)
class StepStats:
    step: int
    # requests in each queue after the step, and the sequences they hold
    num_running: int
    num_waiting: int
    num_swapped: int
    num_running_seqs: int
    # the step itself
    num_batched_tokens: int  # tokens in this step's forward pass (prefill + decode)
    num_prefill_seqs: int
    num_decode_seqs: int
    step_time: float  # seconds, the whole step
    forward_time: float  # seconds in the model (input tensors, forward, logits)
    bookkeeping_time: float  # seconds in the scheduler and the block manager
    # the block pool
    num_blocks: int
    used_blocks: int
    free_blocks: int
    cached_blocks: int  # free, but still holding a findable cached prefix
    cpu_used_blocks: int  # in the swap pool
    # running totals
    prefix_query_tokens: int
    prefix_hit_tokens: int
    evictions: int
    preemptions_recompute: int
    preemptions_swap: int
    swap_out_blocks: int
    swap_in_blocks: int
    cow_copies: int
    allocation_failures: int
    num_finished: int
    num_failed: int
    # Models with several KV-cache groups (kv_cache_groups.py): GPU blocks held per group, and
    # the blocks sliding windows have handed back so far. One group: {} and 0.
    group_blocks: dict[str, int] = field(default_factory=dict)
    window_freed_blocks: int = 0

    @property
    def usage(self) -> float:
        """Percent of the pool's blocks referenced by a running sequence."""
        return 100.0 * self.used_blocks / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        """Percent of prompt tokens served from the prefix cache, so far."""
        return 100.0 * self.prefix_hit_tokens / max(self.prefix_query_tokens, 1)

    STEP_FIELDS: ClassVar[tuple[str, ...]] = (
        "num_batched_tokens",
        "num_prefill_seqs",
        "num_decode_seqs",
        "step_time",
        "forward_time",
        "bookkeeping_time",
    )

    def step_fields(self) -> dict:
        """The fields that describe the step itself (not the state after it)."""
        return {k: getattr(self, k) for k in self.STEP_FIELDS}

    @classmethod
    def collect(cls, engine, step: dict) -> StepStats:
        """The engine's queues, pool and counters now, with ``step``'s own numbers (or zeros)."""
        s, q = engine.kv.stats(), engine.scheduler
        return cls(
            step=engine.num_steps,
            num_running=len(q.running),
            num_waiting=len(q.waiting),
            num_swapped=len(q.swapped),
            num_running_seqs=sum(len(r.seqs) for r in q.running),
            **{k: step.get(k, 0) for k in cls.STEP_FIELDS},
            num_blocks=s["num_blocks"],
            used_blocks=s["used_blocks"],
            free_blocks=s["free_blocks"],
            cached_blocks=s["cached_blocks"],
            cpu_used_blocks=s["cpu_used_blocks"],
            prefix_query_tokens=s["prefix_query_tokens"],
            prefix_hit_tokens=s["prefix_hit_tokens"],
            evictions=s["evictions"],
            preemptions_recompute=q.num_preemptions["recompute"],
            preemptions_swap=q.num_preemptions["swap"],
            swap_out_blocks=s["swap_out_blocks"],
            swap_in_blocks=s["swap_in_blocks"],
            cow_copies=s["cow_copies"],
            allocation_failures=s["allocation_failures"],
            num_finished=engine.num_finished,
            num_failed=engine.num_failed,
            group_blocks=dict(s.get("groups", {})),
            window_freed_blocks=s.get("window_freed_blocks", 0),
        )

    def as_dict(self) -> dict:
        return {**asdict(self), "usage": self.usage, "prefix_hit_rate": self.prefix_hit_rate}

    def summary(self) -> str:
        """A few lines of text, for the demo and for logs."""
        return (
            f"step {self.step}: running {self.num_running} ({self.num_running_seqs} seqs), "
            f"waiting {self.num_waiting}, swapped {self.num_swapped}\n"
            f"  blocks: used {self.used_blocks}/{self.num_blocks} ({self.usage:.0f}%), "
            f"free {self.free_blocks} (cached {self.cached_blocks}), "
            f"in swap {self.cpu_used_blocks}\n"
            f"  prefix cache: {self.prefix_hit_tokens}/{self.prefix_query_tokens} prompt tokens "
            f"hit ({self.prefix_hit_rate:.0f}%), evictions {self.evictions}\n"
            f"  preemptions: recompute {self.preemptions_recompute}, swap {self.preemptions_swap} "
            f"(blocks out {self.swap_out_blocks}, in {self.swap_in_blocks}); copy-on-write "
            f"{self.cow_copies}; allocation failures {self.allocation_failures}\n"
            f"  finished {self.num_finished}, failed {self.num_failed}" + self._groups_line()
        )

    def _groups_line(self) -> str:
        if not self.group_blocks:
            return ""
        held = ", ".join(f"{name} {n}" for name, n in self.group_blocks.items())
        return (
            f"\n  KV-cache groups: blocks held {held}; freed by sliding windows "
            f"{self.window_freed_blocks}"
        )


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

    ``events``: an :class:`~pagedlearn.trace.EventLog` from ``engine.record()``, or its events.
    Only the ``step`` events are read: after every step the engine records every request's queue
    (:meth:`~pagedlearn.engine.llm_engine.LLMEngine.step_info`), so two frames in a row say who
    moved. One :class:`QueueChange` per frame (an abort between steps adds a frame of its own). A
    request that no earlier frame lists counts as waiting: it has just arrived. A request
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
