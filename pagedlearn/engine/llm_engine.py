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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from pagedlearn.engine.beam_search import beam_step
from pagedlearn.engine.recovery import Recovery, StepJournal, held_interrupts, recover
from pagedlearn.engine.request import (
    CompletionOutput,
    Request,
    RequestMetrics,
    RequestOutput,
    RequestStatus,
)
from pagedlearn.engine.sampler import Sampler
from pagedlearn.engine.sampling_params import BeamSearchParams, SamplingParams
from pagedlearn.engine.scheduler import Scheduler, SchedulerOutput
from pagedlearn.engine.stats import StepStats
from pagedlearn.errors import PagedLearnError
from pagedlearn.kv_cache import KVCache
from pagedlearn.kv_cache_manager import KVCacheManager
from pagedlearn.models.runner import ModelRunner, SequenceInput
from pagedlearn.trace import EventLog


class RequestRejectedError(PagedLearnError, ValueError):
    """A request the engine can never serve (too long for the model, the pool or the step)."""


class LLMEngine:
    """Continuous batching over a paged KV cache. Built by :class:`~pagedlearn.LLM`."""

    def __init__(
        self,
        model,
        tokenizer,
        kv: KVCacheManager,
        kv_cache: KVCache,
        runner: ModelRunner,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemption_mode: str,
        chunked_prefill: bool = True,
        kv_reservation: str = "paged",
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.kv, self.kv_cache, self.runner = kv, kv_cache, runner
        self.max_model_len = max_model_len
        self.scheduler = Scheduler(
            kv,
            max_num_seqs,
            max_num_batched_tokens,
            preemption_mode,
            chunked_prefill,
            kv_reservation,
            max_model_len,
        )
        self.sampler = Sampler()
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self.last_stats: StepStats | None = None
        self._stats_subscribers: list[Callable[[StepStats], None]] = []
        self._arrivals = 0
        self.num_finished = 0
        self.num_failed = 0
        # Recovery (recovery.py): final outputs of a step that raised, handed out by the next
        # step; what the last recovery did; why the engine refuses work, if its pool is broken.
        self._undelivered: list[RequestOutput] = []
        self._journal: StepJournal | None = None
        self.last_recovery: Recovery | None = None
        self.broken: str | None = None

    # --- requests -----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str | int,
        prompt: str | Sequence[int],
        params: SamplingParams | BeamSearchParams | None = None,
    ) -> None:
        """Queue a request. Raises :class:`RequestRejectedError` (queueing nothing) if it can
        never be served: an empty or over-long prompt, or one larger than the whole pool (with
        ``kv_reservation="max"``: one whose reservation is larger than the whole pool)."""
        rid = str(request_id)
        if self.broken:
            raise PagedLearnError(f"this engine takes no more requests: {self.broken}")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, (SamplingParams, BeamSearchParams)):
            raise RequestRejectedError(
                f"request {rid!r}: params must be SamplingParams or "
                f"BeamSearchParams, got {type(params).__name__}"
            )
        if rid in self.requests:
            raise RequestRejectedError(f"request id {rid!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self._tokenize(rid, prompt)
        n, bs, pool = len(token_ids), self.kv.block_size, self.kv.allocator.num_blocks
        why = None
        if n > self.max_model_len:
            why = f"its prompt has {n} tokens, more than the model's {self.max_model_len} positions"
        elif -(-n // bs) > pool:
            why = (
                f"its prompt needs {-(-n // bs)} blocks of {bs} tokens, more than the whole "
                f"pool of {pool}"
            )
        elif (reserve := self.scheduler.reserved_blocks(n, params)) > pool:
            why = (
                f"kv_reservation='max' reserves {params.n} x blocks for min(prompt + max_tokens, "
                f"{self.max_model_len}) = {reserve} blocks of {bs} tokens, more than the whole "
                f"pool of {pool}"
            )
        elif n > self.scheduler.max_num_batched_tokens and not self.scheduler.chunked_prefill:
            why = (
                f"its prompt has {n} tokens, more than max_num_batched_tokens="
                f"{self.scheduler.max_num_batched_tokens} and enable_chunked_prefill=False"
            )
        elif params.n > self.scheduler.max_num_seqs:
            why = f"it asks for {params.n} sequences, more than max_num_seqs"
        if why:
            raise RequestRejectedError(f"request {rid!r} rejected: {why}")
        generator = None
        if isinstance(params, SamplingParams) and params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed)
        req = Request(
            rid,
            text,
            token_ids,
            params,
            RequestMetrics(time.perf_counter()),
            self._arrivals,
            generator=generator,
        )
        self._arrivals += 1
        req.seqs.append(req.new_sequence(list(token_ids)))
        self.requests[rid] = req
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
            out = self._finish(req)
        self._mark([out])
        return out

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

    # --- one step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns an output for every request that progressed or ended.

        If it raises -- whatever raised, Ctrl-C included -- the requests in flight are preempted
        by recompute (or failed after repeated faults), every block is accounted for, and the
        same exception reaches the caller; the next ``step()`` goes on (see recovery.py)."""
        if self.broken:
            if self._undelivered:  # the requests failed when the pool broke
                outputs, self._undelivered = self._undelivered, []
                return outputs
            raise PagedLearnError(f"this engine cannot step: {self.broken}")
        self._journal = journal = StepJournal(self._undelivered)
        self._undelivered = []
        try:
            return self._step(journal)
        except BaseException as exc:
            recover(self, journal, exc)  # never raises; notes on exc what it did
            raise
        finally:
            self._journal = None

    def _step(self, j: StepJournal) -> list[RequestOutput]:
        t0 = time.perf_counter()
        with held_interrupts():  # bookkeeping: Ctrl-C waits until it is whole
            sched = self.scheduler.schedule(j.sched)
            t1 = time.perf_counter()
            for s in sched.scheduled:
                if s.request.metrics.first_scheduled_time is None:
                    s.request.metrics.first_scheduled_time = t1
            for req in sched.failed:
                j.outputs.append(self._fail(req))
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
            logits = self.runner.execute(
                [
                    SequenceInput(s.new_tokens, s.start_pos, s.slots, s.block_table)
                    for s in sched.scheduled
                ]
            )
            j.phase = "sample"
            logprobs = self.sampler.logprobs(logits)  # (S, vocab) on the CPU
            t3 = time.perf_counter()
            forward_time = t3 - t2
            with held_interrupts():
                j.outputs += self._process(sched, logprobs, t3)
                j.phase = "publish"  # a Ctrl-C held until here finds every request sampled
        j.phase = "publish"
        t4 = time.perf_counter()
        self.num_steps += 1
        # Bookkeeping: the scheduler (with the block manager's appends, admissions, preemptions)
        # plus the Python after the forward (sampling, stop checks, forks and frees).
        post = (t4 - t3) if sched.scheduled else (t4 - t1)
        self._publish(sched, j.outputs, t4 - t0, forward_time, (t1 - t0) + post)
        return j.outputs

    def _process(self, sched: SchedulerOutput, logprobs: torch.Tensor, now: float):
        rows: dict[str, list[int]] = {}  # a chunk short of the prompt's end samples nothing
        for row, s in enumerate(sched.scheduled):
            if s.samples:
                rows.setdefault(s.request.request_id, []).append(row)
        # Greedy picks for every row at once: one reduction instead of one per sequence.
        best_lp, best_tok = logprobs.max(dim=-1)  # ties -> the lowest id, like argmax
        best = list(zip(best_tok.tolist(), best_lp.tolist(), strict=True))
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
                self._sample(req, logprobs, idx, best)
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            req.metrics.token_times.append(now)
            if not req.seqs:
                self.scheduler.remove(req)
                outputs.append(self._finish(req))
            else:
                outputs.append(self._output(req))
            req.num_faults = 0
            journal.done(req, outputs[-1])
        return outputs

    def _sample(self, req: Request, logprobs: torch.Tensor, rows: list[int], best) -> None:
        p = req.params
        fork = p.n > 1 and req.next_seq_index == 1  # the first prefill: one row, n samples
        live = []
        for seq, row in zip(list(req.seqs), rows, strict=True):
            if p.greedy:
                draws = [best[row]] * (p.n if fork else 1)
            else:
                draws = self.sampler.sample(logprobs[row], p, p.n if fork else 1, req.generator)
            children = [seq] + [req.new_sequence(list(seq.token_ids)) for _ in draws[1:]]
            for child, (tok, lp) in zip(children, draws, strict=True):
                child.token_ids.append(tok)
                child.cumulative_logprob += lp
                child.finish_reason = self._stop_reason(p, child, tok)
                if child is not seq and not child.finished:
                    self.kv.fork(seq.seq_id, child.seq_id)  # share the prompt's blocks
                if child.finished:
                    req.done.append(child)
                else:
                    live.append(child)
            if seq.finished:
                self.kv.free_sequence(seq.seq_id)
        req.seqs = live

    def _stop_reason(self, p, seq, tok: int) -> str | None:
        if tok == self.eos_token_id and not p.ignore_eos:
            return "stop"
        if tok in p.stop_token_ids:
            return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    # --- outputs ------------------------------------------------------------------------------
    def _output(self, req: Request) -> RequestOutput:
        if req.is_beam_search and req.seqs:  # live beams, best first
            seqs = sorted(req.seqs, key=lambda s: -s.cumulative_logprob)
        else:
            seqs = sorted(req.seqs + req.done, key=lambda s: s.index)
        outs = [
            CompletionOutput(
                s.index, s.output_token_ids, s.cumulative_logprob, s.finish_reason, self._decode
            )
            for s in seqs
        ]
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

    def _finish(self, req: Request) -> RequestOutput:
        """Final output; the engine forgets the request (its id may be used again)."""
        del self.requests[req.request_id]
        req.status = RequestStatus.FINISHED
        req.done.extend(req.seqs)
        req.seqs = []
        req.metrics.finished_time = time.perf_counter()
        self.num_finished += 1
        return self._output(req)

    def _fail(self, req: Request) -> RequestOutput:
        for seq in req.seqs:
            seq.finish_reason = "error"
        self.num_failed += 1
        return self._finish(req)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _tokenize(self, rid: str, prompt) -> list[int]:
        if isinstance(prompt, str):
            token_ids = list(self.tokenizer.encode(prompt))
        else:
            try:
                token_ids = [int(t) for t in prompt]
            except (TypeError, ValueError):
                raise RequestRejectedError(
                    f"request {rid!r}: a prompt is a string or a list of token ids, got "
                    f"{type(prompt).__name__}"
                ) from None
        if not token_ids:
            raise RequestRejectedError(f"request {rid!r} has an empty prompt")
        vocab = self.model.config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestRejectedError(
                f"request {rid!r}: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})"
            )
        return token_ids

    def stats(self) -> StepStats:
        """The statistics as of now (after an abort, say); timings are those of the last step."""
        return StepStats.collect(self, self.last_stats.step_fields() if self.last_stats else {})

    def _mark(self, outputs: list[RequestOutput], stats: StepStats | None = None) -> None:
        # A ``step`` event (a frame of the live and replay views), if anyone listens.
        if self.kv.trace.listening:
            self.kv.mark_step(**self.step_info(outputs, stats))

    def step_info(
        self, outputs: Sequence[RequestOutput] = (), stats: StepStats | None = None
    ) -> dict:
        """What a frame of the pictures says besides the blocks (JSON-able): the step number,
        the requests in each queue with their sequences, those of ``outputs`` that finished, and
        the stats (:meth:`StepStats.as_dict`; ``stats``, or the engine's as of now)."""
        q = self.scheduler
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
            "step": self.num_steps,
            "requests": requests,
            "finished": finished,
            "stats": (stats or self.stats()).as_dict(),
        }

    def _publish(self, sched, outputs, step_time, forward_time, bookkeeping) -> None:
        step = {
            "num_batched_tokens": sched.num_batched_tokens,
            "num_prefill_seqs": sum(x.is_prefill for x in sched.scheduled),
            "num_decode_seqs": sum(not x.is_prefill for x in sched.scheduled),
            "step_time": step_time,
            "forward_time": forward_time,
            "bookkeeping_time": bookkeeping,
        }
        self.last_stats = StepStats.collect(self, step)
        # The trace's frame first: a stats subscriber that raises does not cost the replay it.
        self._mark(outputs, self.last_stats)  # the stats just published: not collected twice
        for fn in tuple(self._stats_subscribers):
            fn(self.last_stats)
