"""What the engine hands out: an output per request, and a report of every step.

A step ends by telling three readers what happened (llm_engine.py's ``_step`` calls
:func:`publish` last)::

    step() ──> [RequestOutput, ...]       the caller (``generate``, a notebook): one per request
      │                                    that progressed or ended, a CompletionOutput per sample
      ├──> StepStats                       ``engine.last_stats`` and ``subscribe_stats``'s callbacks
      └──> a "step" event in the trace     a frame of the live and replay views (:func:`frame`),
                                           recorded only if someone listens to the trace

A request ends here too: :func:`finish` builds its final output (``finished=True``) and the
engine forgets it, so that its id may be used again; :func:`fail` finishes it with finish
reason "error" (its ``error`` says why). Text is decoded only when someone reads it
(``CompletionOutput.text``): the engine hands out outputs for every request at every step.

Every function takes the ``LLMEngine`` first and reads its state; only :func:`finish` (and so
:func:`fail`) and :func:`publish` change it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

from pagedlearn.engine.beam_search import keep_best_beams
from pagedlearn.engine.request import CompletionOutput, Request, RequestOutput, RequestStatus
from pagedlearn.engine.scheduler import SchedulerOutput
from pagedlearn.engine.stats import StepStats


# --- requests -------------------------------------------------------------------------------------
def request_output(engine, req: Request) -> RequestOutput:
    """``req`` as the caller sees it now: one CompletionOutput per sequence (beam search: the
    live beams, best first; otherwise every sample, finished or not, in index order)."""
    if req.is_beam_search and req.seqs:  # live beams, best first
        seqs = sorted(req.seqs, key=lambda s: -s.cumulative_logprob)
    else:
        seqs = req.seqs + req.done
        if len(seqs) > 1:  # (one sample, the usual case, needs no sort)
            seqs.sort(key=lambda s: s.index)
    # called on first ``.text`` (request.py); the engine keeps one (``LLMEngine._detokenize``)
    text = getattr(engine, "_detokenize", None) or functools.partial(detokenize, engine)
    p = req.params  # stop strings cut the text (request.py); beam search has none
    stop, keep = getattr(p, "stop", ()), getattr(p, "include_stop_str_in_output", False)
    outs = [
        CompletionOutput(
            s.index, s.output_token_ids, s.cumulative_logprob, s.finish_reason, text, stop, keep,
            None if s.logprobs is None else list(s.logprobs),  # a copy, as the token ids
        )
        for s in seqs
    ]  # fmt: skip
    return RequestOutput(
        req.request_id,
        req.prompt,
        req.prompt_token_ids,
        outs,
        req.status is RequestStatus.FINISHED,
        req.metrics,
        req.num_cached_tokens,
        req.error,
    )


def finish(engine, req: Request) -> RequestOutput:
    """Final output; the engine forgets the request (its id may be used again)."""
    del engine.requests[req.request_id]
    req.status = RequestStatus.FINISHED
    if req.is_beam_search:  # aborted or failed mid-search: still at most beam_width beams
        keep_best_beams(req)
    else:
        req.done.extend(req.seqs)
        req.seqs = []
    req.metrics.finished_time = time.perf_counter()
    engine.num_finished += 1
    engine.metrics.observe_request(req)
    return request_output(engine, req)


def fail(engine, req: Request) -> RequestOutput:
    """Finish ``req`` with finish reason "error": the scheduler or recovery gave up on it."""
    for seq in req.seqs:
        seq.finish_reason = "error"
    engine.num_failed += 1
    return finish(engine, req)


def detokenize(engine, token_ids: list[int]) -> str:
    return engine.tokenizer.decode(token_ids, skip_special_tokens=True)


# --- the step's report ----------------------------------------------------------------------------
def publish(
    engine,
    sched: SchedulerOutput,
    outputs: list[RequestOutput],
    step_time: float,
    forward_time: float,
    bookkeeping: float,
) -> None:
    """The end of a step: its :class:`StepStats` (``engine.last_stats``), its frame in the trace,
    then every stats subscriber."""
    prefills = sum(x.is_prefill for x in sched.scheduled)
    step = {
        "num_batched_tokens": sched.num_batched_tokens,
        "num_prefill_seqs": prefills,
        "num_decode_seqs": len(sched.scheduled) - prefills,
        "step_time": step_time,
        "forward_time": forward_time,
        "bookkeeping_time": bookkeeping,
    }
    engine.last_stats = StepStats.collect(engine, step)
    engine.metrics.observe_step(engine.last_stats)  # its windows move on
    # The trace's frame first: a stats subscriber that raises does not cost the replay it.
    mark(engine, outputs, engine.last_stats)  # the stats just published: not collected twice
    for fn in tuple(engine._stats_subscribers):
        fn(engine.last_stats)


def mark(engine, outputs: list[RequestOutput], stats: StepStats | None = None) -> None:
    """A ``step`` event (a frame of the live and replay views), if anyone listens."""
    if engine.kv.trace.listening:
        engine.kv.mark_step(**frame(engine, outputs, stats))


def frame(engine, outputs: Sequence[RequestOutput] = (), stats: StepStats | None = None) -> dict:
    """What a frame of the pictures says besides the blocks (``LLMEngine.step_info``; JSON-able):
    the step number, the requests in each queue with their sequences, those of ``outputs`` that
    finished, and the stats (:meth:`StepStats.as_dict`; ``stats``, or the engine's as of now)."""
    q = engine.scheduler
    requests = [
        {
            "id": r.request_id,
            "status": r.status.value,
            "seqs": [s.seq_id for s in r.seqs],
            "prompt_tokens": len(r.prompt_token_ids),
            "output_tokens": max((len(s.output_token_ids) for s in r.seqs), default=0),
        }
        for r in (*q.running, *q.swapped, *q.waiting)
    ]
    finished = [
        {
            "id": o.request_id,
            "reason": o.outputs[0].finish_reason if o.outputs else None,
            "prompt_tokens": len(o.prompt_token_ids),
            "output_tokens": max((len(c.token_ids) for c in o.outputs), default=0),
        }
        for o in outputs
        if o.finished
    ]
    return {
        "step": engine.num_steps,
        "requests": requests,
        "finished": finished,
        "stats": (stats or engine.stats()).as_dict(),
    }
