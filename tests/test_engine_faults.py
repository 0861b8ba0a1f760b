"""A step that raises must not wedge the engine (recovery.py).

Faults are injected into every phase of a step -- scheduling, swap copies, copy-on-write copies,
the forward, sampling, forks, frees, stats and trace subscribers -- as an error or as a
``KeyboardInterrupt``. After every step, raised or not: the pool's invariants hold, a replay of
the trace equals the real pool, and at the end every request has the tokens of an undisturbed
run (greedy, or sampling with the same seed), or failed with an error naming the fault.
"""

from __future__ import annotations

import functools
import signal

import pytest

pytest.importorskip("hypothesis")  # a bare GPU box may lack it; the dev install has it

from engine_cases import PROMPTS, assert_pool_clean, greedy, make_llm, tokens
from helpers import replay_matches
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedlearn import BeamSearchParams, SamplingParams
from pagedlearn.engine.recovery import MAX_FAULTS, held_interrupts
from pagedlearn.errors import PagedLearnError
from pagedlearn.trace.events import EventLog, PoolReplay

# A trace fault is held by the trace and announced with a warning (trace/events.py): expected here.
pytestmark = pytest.mark.filterwarnings("ignore:trace subscriber Faults._trace:RuntimeWarning")


class Injected(RuntimeError):
    """The fault these tests inject (a real error is never mistaken for it)."""


# phase -> the functions (owner on the engine, name) whose call raises it
PHASES = {
    "schedule": [("kv", "append_token"), ("kv", "add_sequence")],
    "schedule_swap": [("kv", "swap_out"), ("kv", "swap_in")],  # the scheduler moves tables
    "swap": [("kv_cache", "swap_out"), ("kv_cache", "swap_in")],
    "copy": [("kv_cache", "copy_blocks")],
    "forward": [("runner", "execute")],
    "sample": [("sampler", "logprobs"), ("sampler", "sample")],
    "fork": [("kv", "fork")],
    "free": [("kv", "free_sequence")],
    "stats": [],  # a stats subscriber
    "trace": [],  # a trace subscriber: an error at any event, Ctrl-C at the step's frame
}


class Faults:
    """Raises each planned ``(step, phase, kind)`` fault at the first call of one of its phase's
    functions from the ``step``-th call to ``engine.step()`` on; at most one per call (so
    never inside the recovery of a fault). ``kind``: "error" or "interrupt"."""

    def __init__(self, engine, plan) -> None:
        self.plan, self.call, self.raised, self.fired = sorted(plan), 0, None, []
        for phase, targets in PHASES.items():
            for owner, name in targets:
                obj = getattr(engine, owner)
                setattr(obj, name, self._wrap(phase, getattr(obj, name)))
        engine.subscribe_stats(lambda stats: self.maybe("stats"))
        engine.kv.trace.subscribe(self._trace)

    def _wrap(self, phase, real):
        def call(*args, **kw):
            if phase in ("swap", "copy") and not args[0]:  # no block to copy: not that phase
                return real(*args, **kw)
            self.maybe(phase)
            return real(*args, **kw)

        return call

    def _trace(self, event) -> None:
        # An error is held by the trace (trace/events.py) wherever it comes from, often from inside
        # a block-manager operation; a KeyboardInterrupt a subscriber raises itself is not, so it
        # comes where nothing is half done: at the step's frame (as the live view draws).
        self.maybe("trace", ("error", "interrupt") if event.kind == "step" else ("error",))

    def maybe(self, phase: str, kinds=("error", "interrupt")) -> None:
        if self.raised is not None:
            return
        for i, (step, p, kind) in enumerate(self.plan):
            if p == phase and step <= self.call and kind in kinds:
                del self.plan[i]
                self.fired.append((self.call, phase, kind))
                what = f"injected into {phase} at call {self.call}"
                self.raised = Injected(what) if kind == "error" else KeyboardInterrupt(what)
                raise self.raised


def run(requests, plan=(), check=True, max_calls=300, **kw):
    """Serve ``requests`` with the faults of ``plan``; returns (outputs by id, faults, llm)."""
    llm = make_llm(**kw)
    engine, kv = llm.engine, llm.engine.kv
    replay = PoolReplay(kv.allocator.num_blocks)  # follows the trace, as a view would
    kv.trace.subscribe(replay.apply)
    log = engine.record()  # saved and loaded at the end: the file checks pass
    faults = Faults(engine, plan)
    for rid, prompt, params in requests:
        engine.add_request(rid, list(prompt), params)
    outs = {}
    for call in range(max_calls):
        if not engine.has_unfinished_requests():
            break
        faults.call, faults.raised = call, None
        try:
            got = engine.step()
        except (Injected, KeyboardInterrupt) as e:
            assert e is faults.raised  # the very exception, unchanged
            got = []
        assert faults.raised is None or got == []
        outs.update((o.request_id, o) for o in got if o.finished)
        if check:
            kv.check_invariants()
            assert replay_matches(kv, replay)
            assert replay.swapped == {s: kv._seqs.cpu[s].block_ids for s in kv.swapped_sequences()}
            assert engine.broken is None
    else:
        pytest.fail(f"not finished after {max_calls} steps: {engine.stats().summary()}")
    assert_pool_clean(llm)
    assert EventLog.from_json(log.to_json()).replay().refcounts == [0] * kv.allocator.num_blocks
    return outs, faults, llm


def assert_same_or_failed(got, want, faults):
    """Every request has the undisturbed run's tokens, or failed naming an injected fault."""
    assert got.keys() == want.keys()
    for rid, out in got.items():
        if out.error is not None:
            assert out.outputs[0].finish_reason == "error"
            assert "Injected('injected into" in out.error, out.error
            assert any(kind == "error" for _, _, kind in faults.fired)
        else:
            assert [c.token_ids for c in out.outputs] == want[rid], rid


# --- the reported case ----------------------------------------------------------------------------
def test_a_forward_that_raises_does_not_wedge_the_engine():
    """tiny-gpt2, three requests, the third forward raises: before the fix every later step (and
    a new generate) failed. Now the requests in flight go back to waiting, the step's exception
    reaches the caller, and the run ends with the undisturbed tokens."""
    want = tokens(make_llm().generate(PROMPTS[:3], greedy(), use_tqdm=False))
    llm = make_llm()
    engine = llm.engine
    log = engine.record()
    forward, calls = engine.runner.execute, []

    def third_raises(seqs):
        calls.append(len(seqs))
        if len(calls) == 3:
            raise RuntimeError("forward failed (injected)")
        return forward(seqs)

    engine.runner.execute = third_raises
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"r{i}", prompt, greedy())
    engine.step(), engine.step()
    with pytest.raises(RuntimeError, match="forward failed") as info:
        engine.step()
    assert "re-queued to recompute" in info.value.__notes__[0]
    engine.kv.check_invariants()
    rec = engine.last_recovery
    assert (rec.phase, rec.requeued, rec.failed) == ("forward", ["r0", "r1", "r2"], [])
    assert [r.request_id for r in engine.scheduler.waiting] == ["r0", "r1", "r2"]
    assert engine.kv.sequences() == []  # their blocks went back to the pool...
    preempts = [e for e in log.events if e.kind == "preempt"]  # ...and the trace says why
    assert [e.info for e in preempts] == [
        {"mode": "recompute", "reason": "recovery from RuntimeError during forward"}
    ] * 3
    assert EventLog.from_json(log.to_json()).replay().tables == {}
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
        engine.kv.check_invariants()
    assert [[c.token_ids for c in outs[f"r{i}"].outputs] for i in range(3)] == want
    # a brand-new generate works too, and leaves the pool clean
    assert tokens(llm.generate(PROMPTS[:3], greedy(), use_tqdm=False)) == want
    assert_pool_clean(llm)


def test_generate_interrupted_drops_its_requests_and_the_next_one_starts_clean():
    llm = make_llm()
    want = tokens(llm.generate(PROMPTS, greedy(), use_tqdm=False))
    engine = llm.engine
    forward, calls = engine.runner.execute, []

    def interrupted(seqs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt  # "interrupt kernel" while generate runs
        return forward(seqs)

    engine.runner.execute = interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert engine.requests == {} and not engine.has_unfinished_requests()
    assert_pool_clean(llm)
    assert tokens(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == want
    assert_pool_clean(llm)


def test_a_request_that_keeps_failing_is_failed_and_the_others_finish():
    """Every forward that holds the poisoned prompt raises: after MAX_FAULTS steps in a row it
    is failed with an error naming the fault; the other request finishes untouched."""
    poison = [7] * 6
    want = tokens(make_llm().generate([PROMPTS[0]], greedy(), use_tqdm=False))[0][0]
    llm = make_llm(max_num_seqs=1)  # one request per step: the poison never shares a batch
    engine = llm.engine
    forward = engine.runner.execute

    def fails_on_poison(seqs):
        if any(list(s.new_tokens[:6]) == poison and s.start_pos == 0 for s in seqs):
            raise Injected("out of memory (injected)")
        return forward(seqs)

    engine.runner.execute = fails_on_poison
    engine.add_request("bad", poison, greedy())
    engine.add_request("good", PROMPTS[0], greedy())
    outs, raised = {}, 0
    while engine.has_unfinished_requests():
        try:
            outs.update((o.request_id, o) for o in engine.step() if o.finished)
        except Injected:
            raised += 1
        engine.kv.check_invariants()
    assert raised == MAX_FAULTS
    assert outs["bad"].outputs[0].finish_reason == "error"
    assert "3 steps in a row" in outs["bad"].error and "out of memory" in outs["bad"].error
    assert outs["good"].outputs[0].token_ids == want
    assert engine.stats().num_failed == 1
    assert_pool_clean(llm)


def test_a_subscriber_that_raises_loses_no_output():
    """A stats subscriber raises at the step where requests finish: the step raises, and the
    next step hands out the finished outputs (an abort drops one of them)."""
    llm = make_llm()
    engine = llm.engine
    seen = []

    def drawing(stats):
        if stats.num_finished and not seen:
            seen.append(stats.step)
            raise ValueError("drawing failed (injected)")

    engine.subscribe_stats(drawing)
    engine.add_request("a", PROMPTS[0], greedy(2))
    engine.add_request("b", PROMPTS[2], greedy(2))
    engine.add_request("c", PROMPTS[1], greedy(6))
    with pytest.raises(ValueError, match="drawing failed"):
        while True:
            engine.step()
    assert engine.last_recovery.requeued == [] and engine.has_unfinished_requests()
    assert engine.abort_request("b") is None  # finished: its undelivered output is dropped
    outs = engine.step()
    assert [o.request_id for o in outs if o.finished] == ["a"]
    assert (
        outs[0].outputs[0].token_ids
        == tokens(make_llm().generate([PROMPTS[0]], greedy(2), use_tqdm=False))[0][0]
    )


def test_a_trace_subscriber_that_raises_inside_an_operation_costs_nothing_but_the_raise():
    """The live view's drawing code hits a bug at an ``allocate`` event, in the middle of the
    scheduler's ``add_sequence``. The trace holds the error (trace/events.py): the operation
    finishes, the recording subscribed after the culprit sees every event, and the step raises the
    very error at its end -- nothing to re-queue, the engine goes on, the tokens are undisturbed.
    (Raised at once, it left half a table behind, and the engine broke for good.)"""
    prompts = [PROMPTS[0], PROMPTS[1]]
    want = tokens(make_llm().generate(prompts, greedy(4), use_tqdm=False))
    llm = make_llm()
    engine, raised = llm.engine, []

    def drawing(event):
        if event.kind == "allocate" and not raised:
            raised.append(ValueError("drawing failed (injected)"))
            raise raised[0]

    engine.kv.trace.subscribe(drawing)
    log = engine.record()  # after the culprit
    engine.add_request("a", prompts[0], greedy(4))
    engine.add_request("b", prompts[1], greedy(4))
    with pytest.warns(RuntimeWarning, match="drawing"), pytest.raises(ValueError) as info:
        engine.step()
    assert info.value is raised[0] and "at event 0 (allocate)" in info.value.__notes__[0]
    assert engine.broken is None and engine.last_recovery.phase == "publish"
    assert engine.last_recovery.requeued == [] and engine.kv.trace.held_error is None
    engine.kv.check_invariants()
    assert replay_matches(engine.kv, log.replay())
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert tokens([outs["a"], outs["b"]]) == want
    assert_pool_clean(llm)


# --- every phase, deterministically -----------------------------------------------------------
# Block size 4, 12 blocks, swap: this workload allocates (calls 0-1), forks its two samples
# (call 1), copies on write (call 2), swaps out (call 5) and in (call 8), frees (from call 7).
# Each phase gets one fault, from call 1 on.
WORKLOAD = (
    ("a", tuple(PROMPTS[0]), greedy(8)),
    ("b", tuple(b"The quick brown"), SamplingParams(max_tokens=8, temperature=1.0, seed=1, n=2)),
    ("c", tuple(PROMPTS[2]), greedy(8)),
)
CONFIG = dict(
    preemption_mode="swap", num_blocks=12, block_size=4, max_num_batched_tokens=16, max_num_seqs=4
)


@functools.cache
def undisturbed(requests, **kw):
    outs, _, _ = run(requests, check=False, **kw)
    return {rid: [c.token_ids for c in o.outputs] for rid, o in outs.items()}


@pytest.mark.parametrize("kind", ["error", "interrupt"])
@pytest.mark.parametrize("phase", list(PHASES))
def test_a_fault_in_any_phase_is_recovered(phase, kind):
    got, faults, _ = run(WORKLOAD, [(1, phase, kind)], **CONFIG)
    assert faults.fired, f"the workload never reached {phase}"
    assert_same_or_failed(got, undisturbed(WORKLOAD, **CONFIG), faults)
    assert all(o.error is None for o in got.values())  # one fault: nobody fails


# --- a fault inside an operation of the step, not between phases ----------------------------------
MIXED = (
    ("g", tuple(PROMPTS[0]), SamplingParams(max_tokens=10)),  # EOS may end it
    ("n3", tuple(PROMPTS[1]), SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=9)),
    ("n2g", tuple(PROMPTS[3]), SamplingParams(n=2, max_tokens=8, ignore_eos=True)),
    ("beam", tuple(PROMPTS[2]), BeamSearchParams(beam_width=3, max_tokens=6)),
    ("stop", tuple(PROMPTS[2]), SamplingParams(max_tokens=20, stop=["e", "zz"], ignore_eos=True)),
    ("seeded-greedy", tuple(PROMPTS[1]), SamplingParams(max_tokens=5, seed=4)),
)


def _fault_at(engine, owner: str, name: str, calls: set[int]) -> list[int]:
    """Make ``engine.<owner>.<name>`` raise :class:`Injected` on its call numbers ``calls``, at
    most once per step (so never inside the recovery of a fault); returns the calls that raised."""
    obj = engine if owner == "engine" else getattr(engine, owner)
    real, real_step, seen, fired, in_step = getattr(obj, name), engine.step, [0], [], [False]

    def call(*args, **kw):
        seen[0] += 1
        if seen[0] in calls and not in_step[0]:
            in_step[0] = True
            fired.append(seen[0])
            raise Injected(f"{name} call {seen[0]}")
        return real(*args, **kw)

    def step():
        in_step[0] = False
        return real_step()

    setattr(obj, name, call)
    engine.step = step
    return fired


@pytest.mark.parametrize(
    "owner, name, calls",
    [
        ("engine", "_stop_reason", {3, 40, 41, 90}),  # while sampling: the snapshot restores it
        ("kv", "free_sequence", {1, 5}),  # a finishing request's free
        ("kv", "append_token", {10, 70}),  # while planning the next tokens
        ("runner", "execute", {6}),
    ],
)
def test_a_fault_inside_an_operation_is_recovered(owner, name, calls):
    """Every request ends with the tokens of a run without faults (greedy, seeded sampling and
    beam search: the snapshot restores the generator too), and the pool is clean."""
    want = undisturbed(MIXED)
    llm = make_llm()
    engine = llm.engine
    fired = _fault_at(engine, owner, name, calls)
    for rid, prompt, params in MIXED:
        engine.add_request(rid, list(prompt), params)
    outs = {}
    for _ in range(300):
        if not engine.has_unfinished_requests():
            break
        try:
            outs.update((o.request_id, o) for o in engine.step() if o.finished)
        except Injected:
            assert engine.last_recovery is not None and engine.broken is None
    assert fired, f"{name} was never called at {calls}"
    assert {rid: [c.token_ids for c in o.outputs] for rid, o in outs.items()} == want
    assert_pool_clean(llm)


# --- Ctrl-C during bookkeeping ----------------------------------------------------------------
needs_default_sigint = pytest.mark.skipif(
    signal.getsignal(signal.SIGINT) is not signal.default_int_handler,
    reason="Ctrl-C is handled by someone else here",
)


@needs_default_sigint
def test_ctrl_c_inside_a_block_manager_operation_waits_until_the_bookkeeping_is_whole():
    """A real SIGINT arrives while ``add_sequence`` is half done (at its allocate event, before
    the table exists): it is held until the schedule ends, so the pool stays consistent."""
    llm = make_llm()
    engine = llm.engine
    pressed = []

    def press_ctrl_c(event):
        if event.kind == "allocate" and not pressed:
            pressed.append(event)
            signal.raise_signal(signal.SIGINT)

    engine.kv.trace.subscribe(press_ctrl_c)
    engine.add_request("a", PROMPTS[1], greedy(4))
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert pressed and engine.last_recovery.phase == "schedule" and engine.broken is None
    engine.kv.check_invariants()
    assert engine.last_recovery.requeued == ["a"]
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_clean(llm)


@needs_default_sigint
def test_ctrl_c_while_sampling_keeps_what_was_sampled():
    """A real SIGINT arrives while sampling forks a request's samples: it is held until sampling
    is done, so the step's tokens stay (nothing to re-queue) and the run matches."""
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=3, n=3)
    want = tokens(make_llm().generate([PROMPTS[1]], params, use_tqdm=False))
    llm = make_llm()
    engine, pressed = llm.engine, []

    def press_ctrl_c(event):
        if event.kind == "incref" and not pressed:  # a fork: only sampling does that
            pressed.append(event)
            signal.raise_signal(signal.SIGINT)

    engine.kv.trace.subscribe(press_ctrl_c)
    engine.add_request("a", PROMPTS[1], params)
    with pytest.raises(KeyboardInterrupt):
        while True:
            engine.step()
    assert engine.last_recovery.phase == "publish" and engine.last_recovery.requeued == []
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert tokens(outs) == want
    assert_pool_clean(llm)


@needs_default_sigint
def test_a_second_ctrl_c_goes_through_at_once():
    reached = []
    with pytest.raises(KeyboardInterrupt), held_interrupts():
        signal.raise_signal(signal.SIGINT)
        reached.append("held")
        signal.raise_signal(signal.SIGINT)
        reached.append("not reached")
    assert reached == ["held"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_pool_broken_inside_an_operation_fails_every_request_and_says_so():
    """An exception raised halfway through a block-manager operation (here: blocks allocated,
    never put in a table) leaves a pool that cannot be trusted: every request is failed with
    the reason, and the engine refuses new work with a clear error."""
    llm = make_llm()
    engine = llm.engine
    allocate = engine.kv.allocator.allocate

    def leaks(n):
        allocate(n)
        raise Injected("halfway (injected)")

    engine.add_request("a", PROMPTS[0], greedy())
    engine.kv.allocator.allocate = leaks
    with pytest.raises(Injected):
        engine.step()
    assert "inconsistent" in engine.broken
    (out,) = engine.step()  # the failed request's output
    assert out.finished and "halfway" in out.error and "build a new LLM" in out.error
    with pytest.raises(PagedLearnError, match="cannot step"):
        engine.step()
    with pytest.raises(PagedLearnError, match="takes no more requests"):
        engine.add_request("b", PROMPTS[0])


def test_a_recovery_that_fails_leaves_the_first_exception_and_a_clear_refusal():
    llm = make_llm()
    engine = llm.engine

    def fails(*args):
        raise Injected("failed (injected)")

    engine.add_request("a", PROMPTS[0], greedy())
    engine.runner.execute = fails
    engine.kv.free_sequence = fails  # recovery cannot give the blocks back
    with pytest.raises(Injected) as info:
        engine.step()
    assert "build a new LLM" in info.value.__notes__[0]
    assert "recovering from Injected" in engine.broken
    with pytest.raises(PagedLearnError, match="cannot step"):
        engine.step()


# --- faults at random steps, in random phases -----------------------------------------------------
@st.composite
def workloads(draw):
    requests = []
    for i in range(draw(st.integers(2, 4))):
        prompt = tuple(draw(st.lists(st.integers(0, 255), min_size=1, max_size=14)))
        max_tokens = draw(st.integers(1, 10))
        kind = draw(st.sampled_from(["greedy", "sample", "beam"]))
        if kind == "greedy":
            params = greedy(max_tokens)
        elif kind == "sample":  # n > 1: forks, and copy-on-write of the shared last block
            n = draw(st.integers(1, 3))
            params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, n=n)
        else:
            params = BeamSearchParams(beam_width=draw(st.integers(1, 2)), max_tokens=max_tokens)
        requests.append((f"r{i}", prompt, params))
    return tuple(requests)


fault_plans = st.lists(  # (from which step, phase, kind); runs last about 5-20 steps
    st.tuples(
        st.integers(0, 6), st.sampled_from(list(PHASES)), st.sampled_from(["error", "interrupt"])
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=workloads(),
    plan=fault_plans,
    tight=st.floats(0.0, 0.5),  # the tighter half: more swaps
    caching=st.booleans(),
    step_tokens=st.sampled_from([8, 2048]),  # 8: prompts go in chunks
)
def test_random_faults_leave_every_request_right_or_clearly_failed(
    requests, plan, tight, caching, step_tokens
):
    """Swap preemption on a small pool (from what the largest request needs alone to what all
    need together), so that swaps and copy-on-write happen; faults at random steps."""
    bs = 2
    need = [p.n * -(-(len(prompt) + p.max_tokens) // bs) for _, prompt, p in requests]
    low, high = max(need) + 1, sum(need) + 1
    config = dict(
        preemption_mode="swap",
        num_blocks=int(low + tight * (high - low)),
        block_size=bs,
        enable_prefix_caching=caching,
        max_num_batched_tokens=step_tokens,
        max_num_seqs=8,
    )
    got, fired, _ = run(requests, plan, **config)
    assert_same_or_failed(got, undisturbed(requests, **config), fired)
