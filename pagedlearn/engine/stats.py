"""Per-step statistics: the numbers a vLLM operator watches on a dashboard.

After every ``step()`` the engine builds one :class:`StepStats` and hands it to its subscribers
(``engine.subscribe_stats(fn)``). Queue sizes and pool usage describe the moment after the step;
the counters (prefix-cache tokens, evictions, preemptions, swaps, allocation failures) are
running totals since the engine started, so a plot of them is monotone and a difference of two
steps gives the rate.

Besides the pool and the queues, a StepStats carries what ``engine.metrics``
(:mod:`pagedlearn.engine.metrics`) keeps across steps: the fewest free blocks seen at the end of
any step, the prefix-cache hit rate over a recent window, the time preemptions cost, and the
p50 / p99 time to first token. KV usage is vLLM's ``kv_cache_usage_perc``: the fraction of the
pool's blocks that a sequence holds (free blocks still holding a cached prefix count as free,
as in vLLM: they can be taken at once).

What a preemption costs, in seconds (running totals)::

    swap_time      = time in the swap-out and swap-in copies            measured (kv_cache.py)
    recompute_time = sum over steps of  recomputed_tokens gained in the step
                     x  forward_time / num_batched_tokens over the steps that prefilled so far
                                                                        estimated (metrics.py)

(``recomputed_tokens``: the tokens whose K/V a recompute preemption dropped and a later step
computed again -- counted when they are planned, so a prefix-cache hit or a sibling's shared
blocks at re-admission are not counted (scheduler_output.py); they are computed as a prefill,
so they are priced at a prefill token's cost.)

The scheduler's decisions step by step (who was admitted, preempted, swapped back in) are read
back from a recording by :func:`~pagedlearn.engine.queue_changes.queue_changes`.
"""

from __future__ import annotations

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
    # the pools' shapes
    block_size: int = 0
    num_cpu_blocks: int = 0  # the swap pool (0: none)
    # what preemptions cost (running totals; see the module docstring)
    recomputed_tokens: int = 0  # tokens computed again after recompute preemptions dropped them
    swap_time: float = 0.0  # seconds, measured
    recompute_time: float = 0.0  # seconds, estimated
    # across steps (engine.metrics)
    min_free_blocks: int = 0  # the fewest free blocks at the end of any step so far
    recent_query_tokens: int = 0  # prefix-cache queried / hit tokens over the last 1,000
    recent_hit_tokens: int = 0  # steps that queried it (metrics.RECENT_STEPS)
    ttft_p50: float | None = None  # seconds, over the last 1,000 requests; None before any
    ttft_p99: float | None = None

    @property
    def usage(self) -> float:
        """Percent of the pool's blocks referenced by a running sequence."""
        return 100.0 * self.used_blocks / self.num_blocks

    @property
    def kv_cache_usage(self) -> float:
        """vLLM's ``kv_cache_usage_perc``: the same as :attr:`usage`, as a fraction (0..1)."""
        return self.used_blocks / self.num_blocks

    @property
    def token_capacity(self) -> int:
        """Tokens the pool holds: num_blocks x block_size -- divided among the KV-cache groups
        when there are several, since a token takes a slot in each group's blocks (vLLM's
        rule: ``num_blocks // num_groups * block_size``)."""
        return self.num_blocks // max(len(self.group_blocks), 1) * self.block_size

    @property
    def cpu_free_blocks(self) -> int:
        return self.num_cpu_blocks - self.cpu_used_blocks

    @property
    def blocks_per_request(self) -> float:
        """GPU blocks held per running request (a block shared by several counted once)."""
        return self.used_blocks / self.num_running if self.num_running else 0.0

    @property
    def preemption_time(self) -> float:
        """Seconds preemptions cost so far: swap copies (measured) + recompute (estimated)."""
        return self.swap_time + self.recompute_time

    @property
    def prefix_hit_rate(self) -> float:
        """Percent of prompt tokens served from the prefix cache, so far."""
        return 100.0 * self.prefix_hit_tokens / max(self.prefix_query_tokens, 1)

    @property
    def prefix_hit_rate_recent(self) -> float:
        """Percent of prompt tokens served from the prefix cache over the recent window: the
        last 1,000 steps that queried it (vLLM's log line: the last 1,000 requests)."""
        return 100.0 * self.recent_hit_tokens / max(self.recent_query_tokens, 1)

    DERIVED: ClassVar[tuple[str, ...]] = (
        "usage",
        "kv_cache_usage",
        "token_capacity",
        "cpu_free_blocks",
        "blocks_per_request",
        "preemption_time",
        "prefix_hit_rate",
        "prefix_hit_rate_recent",
    )

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
        """The engine's queues, pool and counters now, with ``step``'s own numbers (or zeros),
        and ``engine.metrics``' windows as of now (it takes this step in with ``observe_step``:
        ``outputs.publish``)."""
        s, q = dict(engine.kv.stats()), engine.scheduler
        # A re-admitted request's lookup is not a new prompt's: vLLM's prefix_cache_queries and
        # _hits leave preempted requests out, and so do these (the manager counts every lookup).
        s["prefix_query_tokens"] -= getattr(q, "num_readmit_query_tokens", 0)
        s["prefix_hit_tokens"] -= getattr(q, "num_readmit_hit_tokens", 0)
        recomputed = getattr(q, "num_recomputed_tokens", 0)
        copies = getattr(engine.kv_cache, "copy_seconds", {})
        metrics = getattr(engine, "metrics", None)
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
            block_size=s.get("block_size", 0),
            num_cpu_blocks=s.get("cpu_blocks", 0),
            recomputed_tokens=recomputed,
            swap_time=copies.get("swap_out", 0.0) + copies.get("swap_in", 0.0),
            **(metrics.as_of(s, recomputed, step) if metrics is not None else {}),
        )

    def as_dict(self) -> dict:
        """Every field and derived number (JSON-able: a trace file's frames hold it); a p50 /
        p99 not known yet is left out rather than None."""
        out = {k: v for k, v in asdict(self).items() if v is not None}
        return {**out, **{k: getattr(self, k) for k in self.DERIVED}}

    def summary(self) -> str:
        """A few lines of text, for the demo and for logs: the counts (the same on every
        machine for the same run; the times are in :meth:`timing_summary`)."""
        cpu = (
            f"; CPU swap pool: used {self.cpu_used_blocks}/{self.num_cpu_blocks}"
            if self.num_cpu_blocks
            else ""
        )
        return (
            f"step {self.step}: running {self.num_running} ({self.num_running_seqs} seqs), "
            f"waiting {self.num_waiting}, swapped {self.num_swapped}\n"
            f"  blocks: used {self.used_blocks}/{self.num_blocks} ({self.usage:.0f}%), "
            f"free {self.free_blocks} (cached {self.cached_blocks}), fewest free "
            f"{self.min_free_blocks}; {self.blocks_per_request:.1f} per running request\n"
            f"  capacity: {self.token_capacity:,} tokens ({self.num_blocks} blocks x "
            f"{self.block_size}{self._per_group()}){cpu}\n"
            f"  prefix cache: {self.prefix_hit_tokens}/{self.prefix_query_tokens} prompt tokens "
            f"hit ({self.prefix_hit_rate:.0f}%; recent {self.prefix_hit_rate_recent:.0f}%), "
            f"evictions {self.evictions}\n"
            f"  preemptions: recompute {self.preemptions_recompute} ({self.recomputed_tokens} "
            f"tokens recomputed), swap {self.preemptions_swap} (blocks out "
            f"{self.swap_out_blocks}, in {self.swap_in_blocks})\n"
            f"  copy-on-write {self.cow_copies}; allocation failures {self.allocation_failures}\n"
            f"  finished {self.num_finished}, failed {self.num_failed}" + self._groups_line()
        )

    def timing_summary(self) -> str:
        """The times, which vary from run to run: what preemptions cost and the TTFT p50 / p99."""
        ttft = (
            f"\n  time to first token: p50 {self.ttft_p50 * 1e3:.1f} ms, "
            f"p99 {self.ttft_p99 * 1e3:.1f} ms (last 1,000 requests)"
            if self.ttft_p50 is not None and self.ttft_p99 is not None
            else ""
        )
        return (
            f"  preemption time: {self.preemption_time * 1e3:.1f} ms (swap copies "
            f"{self.swap_time * 1e3:.1f} ms, measured; recompute ~{self.recompute_time * 1e3:.1f} "
            f"ms, estimated){ttft}"
        )

    def _per_group(self) -> str:
        groups = len(self.group_blocks)
        return f" / {groups} KV-cache groups" if groups > 1 else ""

    def _groups_line(self) -> str:
        if not self.group_blocks:
            return ""
        held = ", ".join(f"{name} {n}" for name, n in self.group_blocks.items())
        return (
            f"\n  KV-cache groups: blocks held {held}; freed by sliding windows "
            f"{self.window_freed_blocks}"
        )
