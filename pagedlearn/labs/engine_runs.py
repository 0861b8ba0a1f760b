"""Lab 6's engine runs: a workload served on tiny-gpt2 by your scheduler and by the package's.

The ``scheduler`` lab's engine checks (scheduler.py) do not ask a method one question; they let
it run a model. :func:`your_engine` builds the real engine (``LLM(...).engine``, tiny-gpt2:
offline, random weights, CPU) and swaps its scheduler for a class of the student's, built with
the same arguments the engine gave its own. :func:`serve` feeds it a :class:`Workload` -- a
pool, and requests that all arrive at once -- and steps it to the end, recording per step whom
the step admitted, preempted and finished, the queues after it and the free blocks, and checking
the pool's invariants after every step. A run also stops (and says why) when a step raises, when
requests still wait after a step limit (admission never lets them in), when a request is lost
from every queue, or when blocks are still held after the last request finished.

:func:`compare` serves the same workload twice. The student's run happens where their code runs
(:func:`~pagedlearn.labs.remote.in_student` calls :func:`observe_serve` there, which builds their
class with :func:`yours` and sends back the :class:`Served` record as plain data); the package's
own scheduler serves it here, in the grading process (computed once per process: decoding is
greedy, so it never changes). The check then names the *first* difference: a step that admitted,
preempted or finished other requests (shown beside the reference's step, with the queues before
it), else other tokens, else other preemption counts. Recompute is exact, so a preempted request
must generate exactly the tokens it would have generated without being preempted.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from pagedlearn.engine.sampling_params import SamplingParams
from pagedlearn.engine.scheduler import Scheduler
from pagedlearn.errors import PagedLearnError
from pagedlearn.labs.handout import is_stub_function
from pagedlearn.labs.lab import CheckFailed, crashed
from pagedlearn.labs.remote import in_student


def _ids(reqs) -> list:
    """Request ids, for messages and step records (anything else as it is)."""
    return [getattr(r, "request_id", r) for r in reqs]


def plain(x, depth: int = 0):
    """``x`` as plain data, what may cross from the student's process: None, bool, int, float,
    str and bytes as they are; lists, tuples, dicts and sets of them, rebuilt; anything else (an
    object the student's code put where a request id belongs, say) as its ``repr``."""
    if x is None or type(x) in (bool, int, float, str, bytes):
        return x
    if depth < 20 and type(x) in (list, tuple, set, frozenset):
        return type(x)(plain(v, depth + 1) for v in x)
    if depth < 20 and type(x) is dict:
        return {plain(k, depth + 1): plain(v, depth + 1) for k, v in x.items()}
    return repr(x)


def yours(sub, methods: tuple[str, ...] = ()) -> type:
    """The student's scheduler class. With ``methods``: the ``Scheduler`` of *this* process with
    only those methods the student's, so that each exercise is graded on its own -- in the
    repository that Scheduler is the package's; where its other graded methods are stubs (a
    student edition, the grader's sandbox) they are the student's too, and a run that reaches
    one still a stub says which is not written yet. Without: the student's whole Scheduler.
    Built where the student's code runs (in an observe function)."""
    theirs = sub.Scheduler
    if not methods:
        return theirs
    attrs = {m: getattr(theirs, m) for m in methods}
    for m in ("_can_admit", "_choose_victim", "_preempt_by_recompute"):  # the lab's methods
        if m not in attrs and is_stub_function(getattr(Scheduler, m)):  # not here: theirs
            attrs[m] = getattr(theirs, m)
    return type("YourScheduler", (Scheduler,), attrs)


@functools.cache
def _model():
    from pagedlearn.models import load

    return load("tiny-gpt2")  # offline: random weights, byte tokenizer; loaded once per process


def your_engine(scheduler_class: type, model=None, **llm_args):
    """An engine (``LLM(...).engine``) whose scheduler is a ``scheduler_class``, built with the
    arguments the engine gave its own; ``model``: tiny-gpt2 unless given. ``llm_args`` go to
    :class:`~pagedlearn.LLM` (``num_blocks``, ``block_size``, ...)."""
    from pagedlearn import LLM

    llm_args.setdefault("verbose", False)
    engine = LLM(_model() if model is None else model, **llm_args).engine
    s = engine.scheduler
    args = (s.max_num_batched_tokens, s.preemption_mode, s.chunked_prefill, s.kv_reservation)
    engine.scheduler = scheduler_class(engine.kv, s.max_num_seqs, *args, s.max_model_len)
    return engine


@dataclass(frozen=True)
class Workload:
    """A pool, and requests ``(id, prompt tokens, max_tokens, n)`` that all arrive at once."""

    num_blocks: int
    block_size: int
    requests: tuple[tuple[str, int, int, int], ...]

    def __str__(self) -> str:
        reqs = "; ".join(
            f"{r!r}: {p} prompt tokens, max_tokens={m}" + (f", n={n}" if n > 1 else "")
            for r, p, m, n in self.requests
        )
        return f"(pool of {self.num_blocks} blocks of {self.block_size} tokens; {reqs})"


@dataclass
class Served:
    """One run: per step, what moved and the queues after; tokens and counts at the end."""

    steps: list[tuple] = field(default_factory=list)  # see serve
    tokens: dict = field(default_factory=dict)  # request -> its sequences' tokens
    preemptions: dict = field(default_factory=dict)  # request -> its metrics.num_preemptions
    counted: dict = field(default_factory=dict)  # scheduler.num_preemptions at the end
    error: str = ""  # why the run stopped early, or what it left behind


def serve(cls: type, w: Workload, max_steps: int = 200) -> Served:
    """Run ``w`` on the engine with scheduler class ``cls``, checking the pool after each step.
    A step is recorded as (admitted, preempted, finished, running, waiting, free blocks)."""
    import torch

    # One thread: a 2-layer model gains nothing from more, and on a busy machine (a grader
    # beside other jobs) torch's threads waiting for each other made runs 10x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _serve(cls, w, max_steps)
    finally:
        torch.set_num_threads(threads)


def _serve(cls: type, w: Workload, max_steps: int) -> Served:
    engine = your_engine(cls, num_blocks=w.num_blocks, block_size=w.block_size)
    s, kv = engine.scheduler, engine.kv
    for k, (rid, num_tokens, max_tokens, n) in enumerate(w.requests):
        prompt = [(31 * k + 7 * i) % 250 + 1 for i in range(num_tokens)]
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True))
    run = Served()
    while engine.has_unfinished_requests():
        if len(run.steps) == max_steps:
            run.error = (
                f"after {max_steps} steps {len(s.waiting)} requests are still waiting "
                f"{_ids(s.waiting)} with {kv.num_free_blocks} free blocks and {len(s.running)} "
                "running: admission never lets them in"
            )
            return run
        before = _ids(s.running)
        try:
            outs = engine.step()
        except (CheckFailed, NotImplementedError):
            raise
        except Exception as e:
            run.error = crashed([f"engine step {len(run.steps) + 1}"], e).message
            return run
        done = [o.request_id for o in outs if o.finished]
        for o in outs:
            if o.finished:
                run.tokens[o.request_id] = [c.token_ids for c in o.outputs]
                run.preemptions[o.request_id] = o.metrics.num_preemptions
        running, waiting = _ids(s.running), _ids(s.waiting)
        admitted = [r for r in running + done if r not in before]
        preempted = [r for r in waiting if r in before]
        run.steps.append((admitted, preempted, done, running, waiting, kv.num_free_blocks))
        try:
            kv.check_invariants()
        except PagedLearnError as e:
            run.error = f"after step {len(run.steps)} the block pool is broken: {e}"
            return run
    run.counted = dict(s.num_preemptions)
    if lost := [r for r in engine.requests if r not in run.tokens]:
        run.error = f"{lost} never finished, and no queue holds them: they were lost"
    elif kv.num_free_blocks != w.num_blocks:
        held = {q: kv.block_table(q) for q in kv.sequences()}
        run.error = f"after the last request finished, blocks are still held: {held}"
    return run


def _line(step: tuple) -> str:
    admitted, preempted, done, running, waiting, free = step
    moves = [f"{v} {x}" for v, x in (("admits", admitted), ("preempts", preempted)) if x]
    moves += [f"finishes {done}"] if done else []
    what = "; ".join(moves) or "moves nobody"
    return f"{what} -> running {running}, waiting {waiting}, {free} free blocks"


def _record(run: Served) -> dict:
    """``run`` as plain data: a dict of its fields."""
    return {f.name: plain(getattr(run, f.name)) for f in dataclasses.fields(run)}


@functools.cache
def _reference_run(w: Workload) -> Served:
    return Served(**_record(serve(Scheduler, w)))  # as plain as the student's, to compare


def observe_serve(sub, methods: tuple, workload: tuple) -> dict:
    """(Runs where the student's code is.) Serve ``workload`` -- a :class:`Workload` as the
    tuple ``(num_blocks, block_size, requests)`` -- with :func:`yours` ``(sub, methods)``; the
    :class:`Served` record as a plain dict."""
    num_blocks, block_size, requests = workload
    w = Workload(num_blocks, block_size, tuple(tuple(r) for r in requests))
    return _record(serve(yours(sub, tuple(methods)), w))


def compare(sub, methods: tuple[str, ...], w: Workload) -> None:
    """Serve ``w`` with the student's scheduler (:func:`yours` ``(sub, methods)``, in their
    process) and with the package's (here); raise CheckFailed at the first difference: a step
    that moved other requests, other tokens, other counts."""
    workload = (w.num_blocks, w.block_size, w.requests)
    ref, run = _reference_run(w), Served(**in_student(sub, observe_serve, methods, workload))
    run.steps = [tuple(step) for step in run.steps]
    for i, (a, b) in enumerate(zip(ref.steps, run.steps, strict=False)):
        if a != b:
            before = _line(ref.steps[i - 1]).split("-> ")[1] if i else "all waiting"
            then = f"\nand then: {run.error}" if run.error else ""
            raise CheckFailed(
                f"{w}\nstep {i + 1} (before it: {before}):\n  the reference {_line(a)}\n"
                f"  yours {_line(b)}{then}"
            )
    if run.error or len(run.steps) != len(ref.steps):
        raise CheckFailed(f"{w}\n{run.error or 'your run ended after the reference'}")
    for rid, want in ref.tokens.items():
        if (got := run.tokens.get(rid)) != want:
            raise CheckFailed(
                f"{w}\nrequest {rid!r} generated {got}; the reference {want} (a "
                "preempted request keeps its tokens and prefills them again)"
            )
    for what, a, b in (
        ("scheduler.num_preemptions", ref.counted, run.counted),
        ("each request's metrics.num_preemptions", ref.preemptions, run.preemptions),
    ):
        if a != b:
            raise CheckFailed(f"{w}\nat the end, {what} should be {a}; yours is {b}")
