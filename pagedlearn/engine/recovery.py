"""Recovering from a step that raised: roll the requests in flight back, keep the pool whole.

A forward pass can raise (out of memory, a kernel error), a subscriber can raise, and a person
can press "interrupt kernel" while the live view plays. Without care, one such exception leaves
the engine unusable: the block manager already holds slots for tokens whose K/V were never
written, so every later step feeds the model nonsense. This module makes a step recoverable.

One step changes the engine in three stretches (see the picture in llm_engine.py)::

    bookkeeping            tensors                          bookkeeping
    schedule()  ──>  swap-out, swap-in, CoW copies, forward  ──>  sample, fork, free, stop
    (queues, blocks,       (KV moves and is written;              (tokens appended to
     slots, swaps)          no Python state changes)               sequences, frees)

**Where can it stop?** The tensor stretch changes no bookkeeping, so an exception there is
harmless by itself -- but the bookkeeping before it promised K/V that now may not exist. The two
bookkeeping stretches are made *atomic against Ctrl-C*: :func:`held_interrupts` holds a
``KeyboardInterrupt`` until the stretch is done (a second Ctrl-C goes through at once, in case
the bookkeeping itself is stuck, e.g. in a lab's own scheduler method). Other exceptions come
out between block-manager operations (one that refuses changes nothing: errors.py's rule) --
except one raised from *inside* an operation, which the end of this docstring is about.

**What is kept, what is redone.** The step keeps a :class:`StepJournal`: how far it got (its
``phase``), every request the scheduler touched (``SchedulerOutput.touched``, noted *before*
each change), which requests finished sampling. After an exception, :func:`recover` sorts the
requests the step touched:

- *consistent*: it finished sampling this step; or it is swapped out and its copy to the CPU
  was made; or it is waiting and holds no blocks (preempted by recompute, as planned). Kept.
- *in flight*: anything else. It is **preempted by recompute**, as the scheduler would do: its
  sampling is undone (tokens, scores, forks, the random generator: snapshot taken before), its
  blocks are freed (``free`` events, then a ``preempt`` event with ``mode="recompute"`` and a
  ``reason``, so a recorded trace replays), and it goes back to ``waiting`` in arrival order,
  keeping the tokens it generated in earlier steps. Its next admission prefills them again.
- After :data:`MAX_FAULTS` steps in a row that raised an ``Exception`` while a request was in
  flight, that request is **failed** instead (finish reason "error", ``error`` naming the
  exception): a request that always makes the forward run out of memory must not loop forever.
  ``KeyboardInterrupt`` is the user's doing, not the request's: it never counts.

One more thing may hold no K/V: a full block is registered in the prefix cache when its tokens
are placed, before the forward writes them. So if the step stopped before its forward finished,
the free part of the prefix cache is emptied (:func:`_forget_free_cached_blocks`): otherwise a
later prompt would reuse K/V that was never computed.

Requests that finished in a step that then raised have their outputs handed out by the next
``step()`` (so ``generate`` and the live view see them). Last, the pool's invariants are checked
(invariants.py, O(pool), only after a fault). If they fail -- only an exception raised *inside* a
block-manager operation can do that, e.g. a monkeypatched allocator, or a ``KeyboardInterrupt``
a trace subscriber raises itself (a subscriber's ``Exception`` is held back by the trace until
the step's end: trace/events.py) -- the pool cannot be trusted: every request is failed with the
reason and the engine refuses new work (``broken``). So does a tensor-parallel engine whose
workers are gone (one died, raised or hung: pagedlearn/parallel/executor.py): the KV of every
request lived in them.

The exception itself always reaches the caller unchanged (with a note saying what recovery did).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedlearn.engine.outputs import fail
from pagedlearn.engine.request import Request, RequestOutput, RequestStatus
from pagedlearn.engine.scheduler import SchedulerOutput
from pagedlearn.errors import PagedLearnError, add_note, held_interrupts

PHASES = ("schedule", "swap_out", "swap_in", "copy", "forward", "sample", "publish")
MAX_FAULTS = 3  # steps in a row that raised while a request was in flight: then it fails


@dataclass
class Snapshot:
    """A request's sampling state before this step sampled it (what ``_process`` changes)."""

    seqs: list  # the live Sequence objects
    states: list[tuple]  # per live sequence: (seq, len(token_ids), cumulative_logprob, reason)
    done: list
    next_seq_index: int
    generator_state: object  # torch.Generator.get_state(), when the request has a generator
    num_token_times: int
    first_token_time: float | None

    @classmethod
    def of(cls, req: Request) -> Snapshot:
        gen = req.generator.get_state() if req.generator is not None else None
        m = req.metrics  # (map, not a comprehension: taken for every request at every step)
        return cls(
            list(req.seqs), list(map(_seq_state, req.seqs)), list(req.done), req.next_seq_index,
            gen, len(m.token_times), m.first_token_time,
        )  # fmt: skip

    def restore(self, req: Request) -> None:
        for seq, n, logprob, reason in self.states:
            del seq.token_ids[n:]
            if seq.logprobs is not None:  # one per output token: cut with the tokens
                del seq.logprobs[n - seq.num_prompt_tokens :]
            seq.cumulative_logprob, seq.finish_reason = logprob, reason
        req.seqs, req.done, req.next_seq_index = self.seqs, self.done, self.next_seq_index
        if self.generator_state is not None:
            req.generator.set_state(self.generator_state)
        del req.metrics.token_times[self.num_token_times :]
        req.metrics.first_token_time = self.first_token_time


def _seq_state(s) -> tuple:
    return s, len(s.token_ids), s.cumulative_logprob, s.finish_reason


@dataclass
class StepJournal:
    """What the step in progress has done so far; :func:`recover` reads it."""

    outputs: list[RequestOutput]  # this step's outputs so far (and undelivered earlier ones)
    phase: str = "schedule"
    sched: SchedulerOutput = field(default_factory=SchedulerOutput)
    processed: set[str] = field(default_factory=set)  # ids of requests sampled to the end
    finished: list[RequestOutput] = field(default_factory=list)  # final outputs while sampling
    current: tuple[Request, Snapshot] | None = None  # the request being sampled, its snapshot

    def begin(self, req: Request) -> None:
        """``req`` is sampled next: its :class:`Snapshot`, in case a fault needs it."""
        self.current = (req, Snapshot.of(req))

    def done(self, req: Request, output: RequestOutput | None) -> None:
        """``req`` is sampled; ``output``: what the step hands out for it (None: nothing)."""
        self.processed.add(req.request_id)
        self.current = None
        if output is not None and output.finished:
            self.finished.append(output)


@dataclass
class Recovery:
    """What the last recovery did (``engine.last_recovery``)."""

    phase: str  # where the step raised (one of PHASES)
    error: str  # repr of the exception
    requeued: list[str]  # request ids preempted by recompute
    failed: list[str]  # request ids failed (MAX_FAULTS reached, or a broken pool)
    broken: str | None = None  # why the engine refuses more work, if it does now

    def note(self) -> str:
        if self.broken:
            return (
                f"pagedlearn: LLMEngine.step() raised during {self.phase!r}; the engine is "
                f"broken ({self.broken}): requests {self.failed} failed"
            )
        return (
            f"pagedlearn: LLMEngine.step() raised during {self.phase!r}; the engine recovered: "
            f"requests {self.requeued} re-queued to recompute, {self.failed} failed"
        )


def recover(engine, journal: StepJournal, exc: BaseException) -> None:
    """Bring ``engine`` back to a state between steps after ``exc`` interrupted a step; sets
    ``engine.last_recovery`` (or ``engine.broken``) and notes on ``exc`` what it did. Never
    raises: the caller re-raises ``exc`` itself."""
    try:
        with held_interrupts(reraise=False):
            engine.last_recovery = _roll_back(engine, journal, exc)
        add_note(exc, engine.last_recovery.note())
    except BaseException as err:  # recovery itself failed: nothing can be trusted now
        engine.broken = f"recovering from {exc!r} during {journal.phase} failed: {err!r}"
        add_note(exc, f"pagedlearn: {engine.broken}; build a new LLM")


def _roll_back(engine, journal: StepJournal, exc: BaseException) -> Recovery:
    kv, q = engine.kv, engine.scheduler
    reason = f"recovery from {type(exc).__name__} during {journal.phase}"
    rec = Recovery(journal.phase, repr(exc), [], [])
    failed: list[RequestOutput] = []
    freed: list[str] = []  # sequences whose blocks recovery gave back
    kv.pop_copies()  # copies not applied yet: their blocks belong to requests freed below
    current = journal.current[0] if journal.current else None
    swapped_copied = PHASES.index(journal.phase) > PHASES.index("swap_out")
    touched = [*journal.sched.touched, *([current] if current else [])]
    # Tensor parallelism: workers that died or failed took the KV of every request with them;
    # nothing is re-queued, every request fails below.
    if dead := getattr(engine.runner, "dead", None):
        engine.broken = f"the tensor-parallel workers are stopped: {dead}"
        touched = []
    for req in {id(r): r for r in touched}.values():  # each once, in order
        if engine.requests.get(req.request_id) is not req:  # finished: output in journal
            continue
        hi = req.next_seq_index  # before restoring: forks made this step count too
        if req is current:
            journal.current[1].restore(req)
        if req in journal.sched.failed:  # the scheduler found it can never fit
            _free(engine, req, hi)
            failed.append(fail(engine, req))
            rec.failed.append(req.request_id)
            continue
        if req is not current and _consistent(engine, req, journal, swapped_copied, hi):
            continue
        q._dequeue(req)
        _mark_dropped(req, kv, journal)
        if held := _free(engine, req, hi):
            kv.trace.emit("preempt", (), tuple(held), mode="recompute", reason=reason)
            freed.extend(held)
            q.num_preemptions["recompute"] += 1
            req.metrics.num_preemptions += 1
        if isinstance(exc, Exception):
            req.num_faults += 1
        if req.num_faults >= MAX_FAULTS:
            req.error = (
                f"request {req.request_id!r} failed: {req.num_faults} steps in a row raised "
                f"while it was in flight, the last: {exc!r}"
            )
            failed.append(fail(engine, req))
            rec.failed.append(req.request_id)
        else:
            q._enqueue(q.waiting, req, RequestStatus.WAITING)
            rec.requeued.append(req.request_id)
    written = PHASES.index(journal.phase) > PHASES.index("forward")
    if freed and not written and kv.prefix_cache is not None:
        _forget_free_cached_blocks(kv, freed[0], reason)
    try:
        kv.check_invariants()
    except PagedLearnError as e:  # changed inside a block-manager operation: cannot be trusted
        engine.broken = (
            f"the block pool was left inconsistent by {exc!r} raised inside a block-manager "
            f"operation during {journal.phase} ({e}); build a new LLM"
        )
    if engine.broken:
        for req in list(engine.requests.values()):
            q._dequeue(req)
            req.error = f"request {req.request_id!r} failed: {engine.broken}"
            failed.append(fail(engine, req))
            rec.failed.append(req.request_id)
    # Sampling's outputs join the step's only when sampling returns: before, they are apart.
    outputs = journal.outputs + (journal.finished if journal.phase == "sample" else [])
    engine._undelivered = [o for o in outputs if o.finished] + failed
    rec.broken = engine.broken
    return rec


def _mark_dropped(req: Request, kv, journal: StepJournal) -> None:
    """Before ``req``'s blocks go: mark, per sequence, the tokens whose K/V existed (what a
    re-admission will count as recomputed, scheduler_output.py). A step that stopped before
    its forward finished computed none of the tokens it planned: the mark is where they start;
    a sequence re-added this step but not planned yet computed nothing new -- its earlier mark
    stands. Marks only ever rise."""
    written = PHASES.index(journal.phase) > PHASES.index("forward")
    planned = {s.seq.seq_id: s.start_pos for s in journal.sched.scheduled if s.request is req}
    readmitting = bool(req.kv_dropped)
    for s in req.seqs:
        if s.seq_id not in kv:
            continue
        n = kv.num_tokens(s.seq_id)
        if not written:
            n = planned.get(s.seq_id, 0 if readmitting else n)
        req.kv_dropped[s.seq_id] = max(req.kv_dropped.get(s.seq_id, 0), n)


def _ids(req: Request, hi: int) -> list[str]:
    """Every sequence id ``req`` may hold in the pool: ``"<request_id>.<i>"`` for i < ``hi``."""
    return [f"{req.request_id}.{i}" for i in range(hi)]


def _free(engine, req: Request, hi: int) -> list[str]:
    """Free whatever ``req``'s sequences hold (GPU or CPU blocks); returns their ids."""
    held = [s for s in _ids(req, hi) if s in engine.kv]
    for seq_id in held:
        engine.kv.free_sequence(seq_id)
    return held


def _forget_free_cached_blocks(kv, seq_id: str, reason: str) -> None:
    """Empty the free part of the prefix cache: some of its blocks may hold no KV.

    The manager registers a full block in the prefix cache when its tokens are placed, before
    the forward writes their K/V (so that a request admitted in the same step can share it). A
    step that stopped before its forward finished leaves such blocks registered with no KV;
    they belonged to the requests just freed, so they are free now -- and a later prompt would
    hit them. So the free ones lose their entries (``KVCachePool.uncache_free_blocks``; ``evict``
    events, for the trace), while blocks in use keep theirs (their KV was written by earlier
    steps).
    """
    for b, block_hash in kv.pool.uncache_free_blocks():
        kv.trace.emit("evict", (b,), (seq_id,), hash=block_hash.hex(), reason=reason)


def _consistent(engine, req: Request, journal: StepJournal, swapped_copied: bool, hi: int):
    """Whether a request the step touched is in a state a next step can go on from."""
    q, kv = engine.scheduler, engine.kv
    if req.request_id in journal.processed:  # sampled: its KV and tokens agree
        return True
    if req.status is RequestStatus.SWAPPED and req in q.swapped:
        copied = swapped_copied or req not in journal.sched.preempted  # else: copy not made
        return copied and all(kv.is_swapped(s.seq_id) for s in req.seqs)
    if req.status is RequestStatus.WAITING and req in q.waiting:  # preempted by recompute
        return not any(s in kv for s in _ids(req, hi))
    return False
