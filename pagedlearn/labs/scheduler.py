"""Lab 6 · scheduler: admission under a block budget, and preemption by recompute.

You write the three decisions of the paper's scheduling policy (section 4.5), practised in
chapter 07 (``07_scheduling_and_preemption``), as methods of the engine's own
:class:`~pagedlearn.engine.scheduler.Scheduler`; its step loop, chunked prefill and swapping stay
the package's:

- ``admit`` -- ``_can_admit(blocks)``: may a waiting prompt that needs ``blocks`` blocks start now?
  It must leave a watermark of free blocks, except when nothing runs;
- ``victim`` -- ``_choose_victim(queue, req)``: a running request needs a block and none is free:
  whom to preempt? The most recently arrived one not yet handled this step -- maybe the asker;
- ``preempt`` -- ``_preempt_by_recompute(req, out)``: free every block of every sequence, back to
  the waiting queue at its arrival position, counted.

What the checks look at. Unit checks drive a Scheduler by hand (a ``KVCacheManager``, hand-made
requests) and name the situation where your answer differs. Then the real engine serves
tiny-gpt2 (offline, random weights, CPU) on a small pool with your method inside the package's
scheduler, beside the package's own scheduler on the same workload: the same requests must be
admitted, preempted and finished at the same steps, with the same tokens (greedy decoding, and
recompute is exact); the pool must pass its invariants after every step; no request may be lost
or keep blocks at the end; nothing may wait forever (a step limit). The last check runs your
whole scheduler on those workloads and on random ones (hypothesis shrinks a failing workload to
the smallest it finds).

Where it runs. Your code runs only inside the ``observe_*`` functions below (and
engine_runs.observe_serve), called through :func:`~pagedlearn.labs.remote.in_student`: in the
grader's sandboxed process, or in the notebook's own. They build your class there -- your
method inside *that* process's Scheduler (the package's in the repository; in the student
edition, whose other graded methods are stubs, a run that reaches one says it is not written
yet) -- and send back plain facts: answers, request ids, counts, a run's record. The expected
values (the situation before your call, the package's scheduler serving the same workload) and
every verdict are computed by the check, in the grader.

Your scheduler serves a model: ``your_engine(Scheduler, num_blocks=12, block_size=4)`` is an
engine (``LLM(...).engine``, tiny-gpt2 unless ``model=`` says otherwise) whose scheduler is your
class; the lab notebook's last cell runs a workload on it, step by step.
"""

from __future__ import annotations

import functools

from hypothesis import strategies as st

from pagedlearn.core.kv_cache_manager import KVCacheManager
from pagedlearn.engine.request import Request, RequestMetrics, RequestStatus
from pagedlearn.engine.sampling_params import SamplingParams
from pagedlearn.engine.scheduler import Scheduler, SchedulerOutput
from pagedlearn.errors import PagedLearnError
from pagedlearn.labs.engine_runs import Served as Served  # re-exported: the engine harness's
from pagedlearn.labs.engine_runs import Workload, _ids, compare, plain, yours
from pagedlearn.labs.engine_runs import serve as serve
from pagedlearn.labs.engine_runs import your_engine as your_engine  # the lab notebook's last cell
from pagedlearn.labs.lab import CheckFailed, Exercise, Lab, crashed, explore
from pagedlearn.labs.remote import in_student

LAB = Lab(
    id="scheduler",
    number=6,
    title="Admission and preemption",
    chapter="07_scheduling_and_preemption",
    files=("pagedlearn/engine/scheduler.py",),
    exercises=(
        Exercise(
            "admit",
            "Admission under a block budget",
            {
                "Scheduler._can_admit": "return whether a prompt needing `blocks` new blocks "
                "may start now: while requests run, it must leave self.watermark blocks free; "
                "when nothing runs, it only has to fit in the free blocks"
            },
        ),
        Exercise(
            "victim",
            "Whom to preempt",
            {
                "Scheduler._choose_victim": "return the request to preempt: the most recently "
                "arrived one not yet handled this step (the last of `queue`), or `req` itself "
                "when `queue` is empty"
            },
        ),
        Exercise(
            "preempt",
            "Preemption by recompute",
            {
                "Scheduler._preempt_by_recompute": "free every block of every sequence of "
                "`req`, count the preemption (self._count_preemption), and put `req` back in "
                "the waiting queue at its arrival position, status WAITING (self._enqueue)"
            },
        ),
    ),
)


def _crash(what: str, fn) -> str:
    """Call the student's ``fn`` (in their process); ``""``, or the verdict on what it raised."""
    try:
        fn()
    except (CheckFailed, NotImplementedError):
        raise
    except Exception as e:
        return crashed([what], e).message
    return ""


# --- a Scheduler driven by hand ------------------------------------------------------------------
def _request(rid: str, arrival: int, num_tokens: int) -> Request:
    tokens = [(7 * arrival + 3 * i) % 250 + 1 for i in range(num_tokens)]
    req = Request(rid, None, tokens, SamplingParams(), RequestMetrics(0.0), arrival)
    req.seqs.append(req.new_sequence(list(tokens)))
    return req


def _scheduler(cls: type, num_blocks: int, running: dict[str, int]) -> Scheduler:
    """``cls`` over a pool of ``num_blocks`` blocks of 4 tokens, with running requests
    ``{id: tokens}`` (in arrival order) holding their blocks."""
    s = cls(KVCacheManager(num_blocks, 4), 16, 512)
    for i, (rid, num_tokens) in enumerate(running.items()):
        req = _request(rid, i, num_tokens)
        s.kv.add_sequence(req.seqs[0].seq_id, req.seqs[0].token_ids)
        req.status = RequestStatus.RUNNING
        s.running.append(req)
    return s


# --- the engine workloads (engine_runs.py serves them, beside the package's scheduler) ----------
# Admission: 'c' must leave the watermark free; 'd' needs the whole pool, so it runs alone.
ADMIT = Workload(12, 4, (("a", 15, 6, 1), ("b", 19, 6, 1), ("c", 12, 4, 1), ("d", 46, 2, 1),
                         ("e", 5, 3, 1)))  # fmt: skip
# Preemption: 'c' (2 samples) asks and 'e' is taken; later the youngest running asks for itself.
PREEMPT = Workload(12, 4, (("a", 9, 12, 1), ("b", 7, 12, 1), ("c", 8, 10, 2), ("d", 5, 8, 1),
                           ("e", 6, 6, 1)))  # fmt: skip


# --- admit ---------------------------------------------------------------------------------------
def observe_can_admit(sub, num_blocks: int, running: dict, asks: list) -> dict:
    """(Runs where the student's code is.) The student's ``_can_admit(blocks)`` for each of
    ``asks``, in the process's Scheduler over ``num_blocks`` blocks with ``running`` requests:
    ``answers``, one ``(truth, repr)`` per call up to the first that raised, and ``crashed``:
    the verdict on what that one raised, or ``""``."""
    s = _scheduler(yours(sub, ("_can_admit",)), num_blocks, running)
    answers: list = []

    def ask(blocks):
        got = s._can_admit(blocks)
        answers.append((bool(got), repr(got)))

    for blocks in asks:
        if why := _crash(f"_can_admit({blocks})", functools.partial(ask, blocks)):
            return {"answers": answers, "crashed": why}
    return {"answers": answers, "crashed": ""}


def _can_admit(sub, num_blocks: int, running: dict, asks: list):
    """Yield ``(blocks, truth, repr)`` of the student's answers, in order; a crash is raised as
    its verdict where it happened."""
    obs = in_student(sub, observe_can_admit, num_blocks, running, list(asks))
    for blocks, (truth, text) in zip(asks, obs["answers"], strict=False):
        yield blocks, truth, text
    if obs["crashed"]:
        raise CheckFailed(obs["crashed"])


@LAB.check("admit", points=2)
def admit_keeps_the_watermark_free(sub):
    for num_blocks, held in ((12, 20), (300, 1160)):  # 7 and 10 blocks free; watermarks 1, 3
        s = _scheduler(Scheduler, num_blocks, {"a": held})  # the situation, here
        free, wm = s.kv.num_free_blocks, s.watermark
        asks = (1, free + 1, free, free - wm + 1, free - wm)
        for blocks, got, text in _can_admit(sub, num_blocks, {"a": held}, asks):
            want = blocks + wm <= free
            if got != want:
                rule = f"{blocks} + watermark {wm} {'<=' if want else '>'} {free} free"
                if blocks > free:
                    rule = f"it does not even fit in the {free} free blocks"
                raise CheckFailed(
                    f"with 1 request running and {free} of {num_blocks} blocks free (watermark "
                    f"{wm}), _can_admit({blocks}) should be {want} ({rule}); yours is {text}"
                )


@LAB.check("admit", points=2)
def admit_alone_if_it_fits(sub):
    for num_blocks in (12, 300):
        wm = _scheduler(Scheduler, num_blocks, {}).watermark
        asks = (1, num_blocks + 1, num_blocks, num_blocks - 1)
        for blocks, got, text in _can_admit(sub, num_blocks, {}, asks):
            want = blocks <= num_blocks
            if got != want:
                why = "nobody runs, so no watermark" if want else "it does not fit"
                raise CheckFailed(
                    f"with nothing running and all {num_blocks} blocks free (watermark "
                    f"{wm}), _can_admit({blocks}) should be {want} ({why}); yours is {text}"
                )


@LAB.check("admit", points=2, timeout_s=30)
def admission_on_the_engine(sub):
    compare(sub, ("_can_admit",), ADMIT)


# --- victim --------------------------------------------------------------------------------------
def observe_victim(sub, names: str, asker: int) -> dict:
    """(Runs where the student's code is.) Running ``names`` (one request each, in arrival
    order), the one at ``asker`` needs a block: the student's ``_choose_victim``. Returns
    ``index``: which of the running requests it returned (``None``: none of them), ``shown``:
    its id as a message shows it, and ``crashed``: the verdict on what it raised, or ``""``."""
    s = _scheduler(yours(sub, ("_choose_victim",)), 16, {r: 6 for r in names})
    running = list(s.running)
    req, queue = running[asker], running[asker + 1 :]
    got: list = []
    call = f"_choose_victim({_ids(queue)}, {req.request_id!r})"
    if why := _crash(call, lambda: got.append(s._choose_victim(list(queue), req))):
        return {"index": None, "shown": "", "crashed": why}
    index = next((i for i, r in enumerate(running) if r is got[0]), None)
    return {"index": index, "shown": repr(_ids(got)[0]), "crashed": ""}


def _victim(sub, names: str, asker: int):
    """Running ``names`` (in arrival order); the one at ``asker`` needs a block, none is free.
    Returns (the expected victim's id, whether the student's is that very request, theirs as
    shown, the situation in words)."""
    want = len(names) - 1 if asker + 1 < len(names) else asker  # the last of the queue, or req
    obs = in_student(sub, observe_victim, names, asker)
    if obs["crashed"]:
        raise CheckFailed(obs["crashed"])
    call = f"_choose_victim({list(names[asker + 1 :])}, {names[asker]!r})"
    when = (
        f"running {list(names)} (in arrival order): when {names[asker]!r} needs a block and "
        f"none is free, with {list(names[:asker])} handled earlier this step, {call}"
    )
    return names[want], obs["index"] == want, obs["shown"], when


@LAB.check("victim", points=2)
def victim_is_the_youngest_not_yet_handled(sub):
    for names, asker in (("abcd", 1), ("abcd", 0), ("abcd", 2), ("abc", 1)):
        want, right, got, when = _victim(sub, names, asker)
        if not right:
            raise CheckFailed(
                f"{when} should return {want!r} (the most recently arrived not yet "
                f"handled); yours returns {got}"
            )


@LAB.check("victim", points=2)
def victim_is_the_asker_when_it_is_the_youngest(sub):
    for names in ("abcd", "a"):
        want, right, got, when = _victim(sub, names, len(names) - 1)
        if not right:
            raise CheckFailed(
                f"{when} should return {want!r} itself: everyone else is older and "
                f"keeps its blocks; yours returns {got}"
            )


@LAB.check("victim", points=2, timeout_s=30)
def preemption_on_the_engine(sub):
    compare(sub, ("_choose_victim",), PREEMPT)


# --- preempt -------------------------------------------------------------------------------------
SETUP = (
    "running a, c (2 samples sharing their first block), d; waiting b (preempted earlier) and e; "
    "arrival order a, b, c, d, e. After _preempt_by_recompute(c), "
)


def _setup_c(cls: type):
    """The situation of SETUP, on a ``cls``; returns the scheduler and c."""
    s = _scheduler(cls, 16, {"a": 6, "c": 5, "d": 9})
    _, c, d = s.running
    c.arrival_index, d.arrival_index = 2, 3
    c.seqs.append(c.new_sequence(list(c.seqs[0].token_ids)))  # n=2: c.1 shares c.0's blocks
    s.kv.fork("c.0", "c.1")
    for seq in c.seqs:  # each appends a token: c.0 copies the shared last block on write
        seq.token_ids.append(9)
        s.kv.append_token(seq.seq_id, 9)
    s.waiting += [_request("b", 1, 7), _request("e", 4, 3)]
    return s, c


def observe_preempt_c(sub) -> dict:
    """(Runs where the student's code is.) The situation of SETUP; the student preempts c.
    Returns the facts the checks judge, as plain data (``crashed``: the verdict on what it
    raised, or ``""``)."""
    s, c = _setup_c(yours(sub, ("_preempt_by_recompute",)))
    events: list = []
    s.kv.trace.subscribe(events.append)
    out = SchedulerOutput()
    if why := _crash("_preempt_by_recompute(c)", lambda: s._preempt_by_recompute(c, out)):
        return {"crashed": why}
    try:
        s.kv.check_invariants()
        broken = ""
    except PagedLearnError as e:
        broken = str(e)
    status = c.status
    return plain(
        {
            "crashed": "",
            "held": {q: s.kv.block_table(q) for q in ("c.0", "c.1") if q in s.kv},
            "free": s.kv.num_free_blocks,
            "broken": broken,
            "tokens": {q.seq_id: q.token_ids for q in c.seqs},
            "waiting": _ids(s.waiting),
            "status": status.name if isinstance(status, RequestStatus) else None,
            "status_shown": str(status),
            "counted": {
                "scheduler.num_preemptions": s.num_preemptions,
                "c.metrics.num_preemptions": c.metrics.num_preemptions,
                "out.preempted": _ids(out.preempted),
                "the running queue": _ids(s.running),
                "the trace's preempt events": [
                    (e.seqs, e.info) for e in events if e.kind == "preempt"
                ],
            },
        }
    )


def _preempt_c(sub) -> dict:
    """The student's facts after preempting c (see observe_preempt_c); a crash is its verdict."""
    obs = in_student(sub, observe_preempt_c)
    if obs["crashed"]:
        raise CheckFailed(obs["crashed"])
    return obs


@LAB.check("preempt", points=2)
def recompute_frees_every_block(sub):
    s, c = _setup_c(Scheduler)  # before the preemption, here
    free, tokens = s.kv.num_free_blocks, {q.seq_id: list(q.token_ids) for q in c.seqs}
    obs = _preempt_c(sub)
    for seq_id in ("c.0", "c.1"):
        if seq_id in obs["held"]:
            raise CheckFailed(
                f"{SETUP}{seq_id!r} still holds blocks {obs['held'][seq_id]}: every "
                "sequence of the request must give back all its blocks (self.kv.free_sequence)"
            )
    if obs["free"] != free + 3:
        raise CheckFailed(
            f"{SETUP}{free + 3} blocks should be free ({free} before, + the 3 distinct blocks "
            f"of c); yours leaves {obs['free']}"
        )
    if obs["broken"]:
        raise CheckFailed(f"{SETUP}the block pool is broken: {obs['broken']}")
    if (now := obs["tokens"]) != tokens:
        raise CheckFailed(
            f"{SETUP}c's sequences should keep their tokens {tokens} (they are prefilled again "
            f"when c is readmitted); they are {now}"
        )


@LAB.check("preempt", points=2)
def recompute_requeues_in_arrival_order(sub):
    obs = _preempt_c(sub)
    if (waiting := obs["waiting"]) != ["b", "c", "e"]:
        raise CheckFailed(
            f"{SETUP}the waiting queue should be ['b', 'c', 'e']: c goes back at its arrival "
            f"position, ahead of e who arrived after it; yours is {waiting}"
        )
    if obs["status"] != RequestStatus.WAITING.name:
        raise CheckFailed(f"{SETUP}c's status should be WAITING; yours is {obs['status_shown']}")


@LAB.check("preempt", points=1)
def recompute_is_counted(sub):
    found = _preempt_c(sub)["counted"]
    want = {
        "scheduler.num_preemptions": {"recompute": 1, "swap": 0},
        "c.metrics.num_preemptions": 1,
        "out.preempted": ["c"],
        "the running queue": ["a", "d"],
        "the trace's preempt events": [(("c.0", "c.1"), {"mode": "recompute"})],
    }
    for what, value in want.items():
        if found.get(what) != value:
            raise CheckFailed(
                f"{SETUP}{what} should be {value}; yours is {found.get(what)} (count the "
                "preemption with self._count_preemption(req, out, 'recompute'): it books all "
                "of these)"
            )


@LAB.check("preempt", points=2, timeout_s=30)
def recompute_on_the_engine(sub):
    compare(sub, ("_preempt_by_recompute",), PREEMPT)


WORKLOADS = st.builds(  # small pools under pressure: most of them preempt
    Workload,
    st.integers(6, 10),  # blocks in the pool (a 12-token prompt always fits)
    st.sampled_from([2, 4]),  # tokens per block
    st.lists(  # requests: prompt tokens, max_tokens, n
        st.tuples(st.integers(1, 12), st.integers(1, 16), st.sampled_from([1, 1, 1, 2])),
        min_size=2,
        max_size=6,
    ).map(lambda rs: tuple((chr(97 + i), *r) for i, r in enumerate(rs))),
)


@LAB.check("preempt", points=3, timeout_s=60)
def your_scheduler_on_random_workloads(sub):
    # All three of your methods together (and, in a .py file, the rest of your Scheduler).
    for w in (ADMIT, PREEMPT):
        compare(sub, (), w)
    explore(WORKLOADS, lambda w: compare(sub, (), w), max_examples=40)
