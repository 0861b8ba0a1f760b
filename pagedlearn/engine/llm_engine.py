"""The engine: one ``step()`` = schedule, move blocks, one packed forward, sample, bookkeeping.

::

    add_request ──> Scheduler.schedule() ──> KVCache: swap out, swap in, copy-on-write
                                                         │
    RequestOutput <── sample, stop checks, fork/free <── ModelRunner.execute (packed forward)

This is the step-level API that notebooks and the live view drive (``LLM.generate`` is a loop
over it)::

    engine = LLM("tiny-gpt2").engine
    engine.add_request("a", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...
    engine.subscribe_stats(print)          # a StepStats after every step
    engine.kv.trace.subscribe(print)       # every block event, as it happens

A step that raises (an error in the forward, Ctrl-C, a subscriber) does not wedge the engine:
the requests it had in flight are preempted by recompute (or failed, if they keep failing), the
exception reaches the caller, and the next ``step()`` goes on (recovery.py).

What comes in is checked once, at the door, in admission.py (``RequestRejectedError``); what
goes out -- each request's output, a finished or failed request, and each step's stats and its
frame in the trace -- is built in outputs.py. This file is the step in between.

What may share cached KV (the model's version, resetting the prefix cache) is in cache_keys.py.

After the forward, ``_process`` hands each request's rows to
:func:`~pagedlearn.engine.sampler.sample_step` (or beam search's ``beam_step``), which draws the
tokens and their logprobs; stop strings (``SamplingParams(stop=...)``) are checked here, after
every token (:meth:`LLMEngine._stop_reason`), by decoding only the tail of the samples that ask.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Hashable, Sequence

import torch

from pagedlearn.attention.kv_cache import KVCache
from pagedlearn.engine.admission import RequestRejectedError, admit
from pagedlearn.engine.beam_search import beam_step
from pagedlearn.engine.cache_keys import reset, set_model_version
from pagedlearn.engine.metrics import EngineMetrics
from pagedlearn.engine.outputs import detokenize, fail, finish, frame, mark, publish, request_output
from pagedlearn.engine.recovery import Recovery, StepJournal, held_interrupts, recover
from pagedlearn.engine.request import Request, RequestOutput, RequestStatus
from pagedlearn.engine.sampler import Sampler, sample_step
from pagedlearn.engine.sampling_params import BeamSearchParams, SamplingParams
from pagedlearn.engine.scheduler import Scheduler, SchedulerOutput
from pagedlearn.engine.stats import StepStats
from pagedlearn.errors import PagedLearnError
from pagedlearn.models.runner import ModelRunner
from pagedlearn.trace.events import EventLog

__all__ = ["LLMEngine", "RequestRejectedError"]  # RequestRejectedError lives in admission.py


class LLMEngine:
    """Continuous batching over a paged KV cache. Built by :class:`~pagedlearn.LLM`."""

    def __init__(
        self,
        model,
        tokenizer,
        kv_cache: KVCache,
        runner: ModelRunner,
        scheduler: Scheduler,
        max_model_len: int,
    ) -> None:
        """The parts come built (engine_args.py builds them from ``LLM``'s arguments): the
        scheduler holds the KV-cache manager (``self.kv``), ``kv_cache`` the tensors its block
        ids index, ``runner`` the model's packed forward."""
        self.model, self.tokenizer = model, tokenizer
        self.kv, self.kv_cache, self.runner = scheduler.kv, kv_cache, runner
        self.scheduler, self.max_model_len = scheduler, max_model_len
        self.sampler = Sampler()
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self.last_stats: StepStats | None = None
        self._stats_subscribers: list[Callable[[StepStats], None]] = []
        self.metrics = EngineMetrics(max_model_len, self.kv.trace)  # distributions, windows
        self._arrivals = 0
        self.num_finished = 0
        self.num_failed = 0
        # Recovery (recovery.py): final outputs of a step that raised, handed out by the next
        # step; what the last recovery did; why the engine refuses work, if its pool is broken.
        self._undelivered: list[RequestOutput] = []
        self._journal: StepJournal | None = None
        self.last_recovery: Recovery | None = None
        self.broken: str | None = None
        # The model's name in the block hashes, and its version (model_version adds it there).
        self._model_name: Hashable = getattr(self.kv, "model_id", None)
        self._model_version: Hashable = None
        self._detokenize = functools.partial(detokenize, self)

    # --- requests -----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str | int,
        prompt: str | Sequence[int] | dict,
        params: SamplingParams | BeamSearchParams | None = None,
        *,
        cache_salt: Hashable = None,
        lora_request=None,
        final_only: bool = False,
    ) -> None:
        """Queue a request. Raises :class:`RequestRejectedError` (queueing nothing) if it can
        never be served. ``prompt``: text, token ids, or vLLM's ``{"prompt": text}`` /
        ``{"prompt_token_ids": ids}``, each with an optional ``"cache_salt"``; ``cache_salt``
        and ``lora_request`` (an adapter id, or vLLM's ``LoRARequest``: pagedlearn applies no
        adapter, it only keeps each adapter's cached KV apart) go into its blocks' hashes. The
        shapes and checks are in admission.py. ``final_only``: ``step()`` returns the request's
        output only when it finishes, as ``LLM.generate`` wants, instead of after every step that
        gave it tokens (for streaming). vLLM spells it ``SamplingParams.output_kind =
        RequestOutputKind.FINAL_ONLY``, which its ``LLM`` sets for the requests it adds."""
        if self.broken:
            raise PagedLearnError(f"this engine takes no more requests: {self.broken}")
        req = admit(
            self,
            request_id,
            prompt,
            params,
            arrival_index=self._arrivals,
            cache_salt=cache_salt,
            lora_request=lora_request,
        )
        req.final_only = bool(final_only)
        self._arrivals += 1
        self.requests[req.request_id] = req
        self.scheduler.add(req)

    def abort_request(self, request_id: str | int) -> RequestOutput | None:
        """Stop a request now: its blocks go back to the pool at once. Returns its final output
        (finish reason "abort"), or None if it is unknown or already finished. (A request that
        finished in a step that raised, whose output the next ``step()`` would hand out, is
        finished: its output is dropped, and None is returned.)"""
        rid = str(request_id)
        self._undelivered = [o for o in self._undelivered if o.request_id != rid]
        req = self.requests.get(rid)
        if req is None or req.status is RequestStatus.FINISHED:
            return None
        with held_interrupts():  # all of it or none: its blocks, its queue, its output
            self.scheduler.remove(req)
            for seq in req.seqs:
                seq.finish_reason = "abort"
            out = finish(self, req)
        mark(self, [out])
        return out

    # --- the prefix cache (what may share cached KV: cache_keys.py) ----------------------------
    @property
    def model_name(self) -> Hashable:
        """The model's name, as ``LLM`` loaded it (the manager's ``model_id`` without a version):
        what the metrics' ``model_name`` label says."""
        return self._model_name

    @property
    def model_version(self) -> Hashable:
        """The weights' version (None: unversioned), in every block hash. Set it when the weights
        change, and no later prompt hits a block cached under the old version
        (:func:`~pagedlearn.engine.cache_keys.set_model_version` says what happens to the rest)."""
        return self._model_version

    @model_version.setter
    def model_version(self, version: Hashable) -> None:
        set_model_version(self, version)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (vLLM's name); returns how many cached blocks were dropped.
        Refused while a request holds blocks (:func:`~pagedlearn.engine.cache_keys.reset`)."""
        return reset(self)

    def has_unfinished_requests(self) -> bool:
        """Whether a ``step()`` has work: queued requests, or outputs of requests that finished
        in a step that raised (the next step hands them out)."""
        return self.scheduler.has_work() or bool(self._undelivered)

    # --- observers ----------------------------------------------------------------------------
    def subscribe_stats(self, fn: Callable[[StepStats], None]) -> Callable[[], None]:
        """Call ``fn(stats)`` after every step; returns a function that unsubscribes."""
        self._stats_subscribers.append(fn)
        return lambda: fn in self._stats_subscribers and self._stats_subscribers.remove(fn)

    def record(self) -> EventLog:
        """Record every block event from now on (for replay, JSON export and pictures)."""
        return self.kv.record()

    def stats(self) -> StepStats:
        """The statistics as of now (after an abort, say); timings are those of the last step."""
        return StepStats.collect(self, self.last_stats.step_fields() if self.last_stats else {})

    def step_info(
        self, outputs: Sequence[RequestOutput] = (), stats: StepStats | None = None
    ) -> dict:
        """What a frame of the pictures says besides the blocks (JSON-able): the step number,
        the requests in each queue with their sequences, those of ``outputs`` that finished, and
        the stats (:meth:`StepStats.as_dict`; ``stats``, or the engine's as of now)."""
        return frame(self, outputs, stats)

    # --- one step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns an output for every request that progressed or ended
        (for a request added with ``final_only``: only when it ends).

        If it raises -- whatever raised, Ctrl-C included -- the requests in flight are preempted
        by recompute (or failed after repeated faults), every block is accounted for, and the
        same exception reaches the caller; the next ``step()`` goes on (see recovery.py)."""
        if self.broken:
            if self._undelivered:  # the requests failed when the pool broke
                outputs, self._undelivered = self._undelivered, []
                return outputs
            raise PagedLearnError(f"this engine cannot step: {self.broken}")
        self._journal = j = StepJournal(self._undelivered)
        self._undelivered = []
        try:
            t0 = time.perf_counter()
            with held_interrupts():  # bookkeeping: Ctrl-C waits until it is whole
                sched = self.scheduler.schedule(j.sched)
                t1 = time.perf_counter()
                for s in sched.scheduled:
                    if s.request.metrics.first_scheduled_time is None:
                        s.request.metrics.first_scheduled_time = t1
                for req in sched.failed:
                    j.outputs.append(fail(self, req))
            # Order matters: swap-outs read blocks that swap-ins or copies may now overwrite.
            j.phase = "swap_out"
            self.kv_cache.swap_out(sched.swap_out)
            j.phase = "swap_in"
            self.kv_cache.swap_in(sched.swap_in)
            j.phase = "copy"
            self.kv_cache.copy_blocks(self.kv.pop_copies())
            forward_time = 0.0
            if sched.scheduled:
                j.phase = "forward"
                t2 = time.perf_counter()
                # A ScheduledSequence is a SequenceInput: the plan goes in as it is (a copy
                # of the list, so that the runner may do with it what it likes).
                logits = self.runner.execute(list(sched.scheduled))
                j.phase = "sample"
                logprobs = self.sampler.logprobs(logits)  # (S, vocab) on the CPU
                t3 = time.perf_counter()
                forward_time = t3 - t2
                with held_interrupts():
                    j.outputs += self._process(sched, logprobs, t3)
                    j.phase = "publish"  # a Ctrl-C held until here finds all sampled
            j.phase = "publish"
            t4 = time.perf_counter()
            self.num_steps += 1
            # Bookkeeping: the scheduler (with the block manager's appends, admissions,
            # preemptions) plus the Python after the forward (sampling, stop checks, frees).
            post = (t4 - t3) if sched.scheduled else (t4 - t1)
            publish(self, sched, j.outputs, t4 - t0, forward_time, (t1 - t0) + post)
            return j.outputs
        except BaseException as exc:
            recover(self, j, exc)  # never raises; notes on exc what it did
            raise
        finally:
            self._journal = None

    def _process(self, sched: SchedulerOutput, logprobs: torch.Tensor, now: float):
        rows: dict[str, list[int]] = {}  # a chunk short of the prompt's end samples nothing
        for row, s in enumerate(sched.scheduled):
            if s.samples:
                rows.setdefault(s.request.request_id, []).append(row)
        best = self.sampler.greedy(logprobs)  # every row's greedy (token, logprob) at once
        outputs = []
        journal = self._journal or StepJournal([])
        for rid, idx in rows.items():
            req = self.requests[rid]
            journal.begin(req)  # snapshot: if anything below raises, recovery rolls it back
            if req.is_beam_search:
                beam_step(
                    req,
                    list(req.seqs),
                    logprobs[idx],
                    self.kv,
                    self.eos_token_id,
                    self.max_model_len,
                )
            else:
                sample_step(self, req, logprobs, idx, best)
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            req.metrics.token_times.append(now)
            self.metrics.observe_tokens(req.metrics)  # TTFT or an inter-token gap, now
            out = None  # a request that asked for its final output only gets none yet
            if not req.seqs:
                self.scheduler.remove(req)
                out = finish(self, req)
            elif not req.final_only:
                out = request_output(self, req)
            req.num_faults = 0
            journal.done(req, out)
            if out is not None:
                outputs.append(out)
        return outputs

    def _stop_reason(self, p: SamplingParams, seq, tok: int) -> str | None:
        """Why ``seq`` ends now that it sampled ``tok``, or None. As vLLM: EOS and stop token
        ids first, then stop strings (a match on the last allowed token is a "stop"), then
        the length limits."""
        if tok == self.eos_token_id and not p.ignore_eos:
            return "stop"
        if tok in p.stop_token_ids:
            return "stop"
        if p.stop and seq.output_text_has(p.stop, self._detokenize):  # decodes only the tail
            return "stop"
        n = len(seq.token_ids)
        if n - seq.num_prompt_tokens >= p.max_tokens or n >= self.max_model_len:
            return "length"
        return None
