"""The scheduler: iteration-level (continuous) batching over a fixed pool of KV blocks.

Every step it decides which requests run, with the paper's policy (section 4.5, as in vLLM V0):

1. **Running** requests, oldest first, each get one new token per sequence (a decode). Appending
   may need a block (a sequence crossed a block boundary, or a shared last block must be copied).
   When the pool has too few free blocks, the *most recently arrived* running request is preempted
   to make room -- possibly the very request asking, if it is the youngest left:
   - ``recompute``: its blocks are freed and it goes back to ``waiting``, keeping the tokens it
     generated; when readmitted, it prefills prompt + generated tokens in one pass (with prefix
     caching, its earlier full blocks may still be in the cache and are not recomputed);
   - ``swap``: its blocks are copied to the CPU swap pool; it waits in ``swapped`` and is copied
     back before it resumes.
   A request is checked *before* any of its sequences appends, so a preempted request never
   leaves a half-written step behind.
2. **Swapped** requests come back first, in arrival order (FCFS), when the pool has room.
3. **Waiting** requests are admitted (prefill) in arrival order while the block budget, the
   per-step token budget (``max_num_batched_tokens``) and ``max_num_seqs`` allow. Prefill of new
   requests runs in the same step as the decodes: one packed batch. Nothing is admitted in a step
   that preempted (the pool is tight) or while swapped requests wait (they came first), and a
   small watermark of free blocks is kept so that a new prompt does not cause a preemption in
   the very next step.

**Chunked prefill** (on by default): a prompt longer than what is left of the step's token budget
is prefilled a chunk at a time over several steps, next to the other requests' decodes, instead
of waiting for a step of its own (or being refused when it is longer than the whole budget).
Decodes come first: every running sequence that is past its prompt gets its one token, and
prompts in progress share what is left. A sequence samples only when its chunk reaches its last
token. The first chunk starts after the prompt's cached prefix, which costs no budget.

**One planner, no prefill or decode phase** (as vLLM v1): each running request gets a number of
new tokens -- one for a decode, a chunk for a prompt in progress -- planned the same way by
:meth:`SchedulerOutput.add_next_tokens`. In the common step the free blocks cover everyone's
next tokens (:meth:`Scheduler._room_for_all`) and nobody is asked for blocks one by one.
Admitting a waiting request (:meth:`SchedulerOutput.add_prefill`) is separate: it creates the
sequences, all or none, and looks their prompt up in the prefix cache (scheduler_output.py).

A request that can never fit -- it needs more blocks than the whole pool, even alone -- is failed
with an error for that request alone; the others go on.

The policy's three decisions are small methods that read on their own (lab 6, ``scheduler``,
has students write them): ``_can_admit``, ``_choose_victim`` and ``_preempt_by_recompute``.

**Max-length reservation** (``kv_reservation="max"``): the same scheduler as the Orca (Max)
baseline of the paper's section 2.3, admitting a waiting request only when its whole reservation
fits (the policy: :mod:`pagedlearn.engine.reservation`), so that a running request never has
to be preempted.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from pagedlearn.core.kv_cache_manager import KVCacheManager
from pagedlearn.engine.chunked_prefill import (
    blocks_to_start,
    first_chunk,
    fits_budgets,
    pending_prompt_tokens,
)
from pagedlearn.engine.request import Request, RequestStatus
from pagedlearn.engine.reservation import KV_RESERVATIONS as KV_RESERVATIONS  # (re-exported)
from pagedlearn.engine.reservation import KVReservation
from pagedlearn.engine.scheduler_output import ScheduledSequence as ScheduledSequence
from pagedlearn.engine.scheduler_output import SchedulerOutput as SchedulerOutput
from pagedlearn.errors import OutOfBlocksError

PREEMPTION_MODES = ("recompute", "swap")


class Scheduler:
    """Holds the ``waiting``, ``running`` and ``swapped`` queues (each in arrival order)."""

    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemption_mode: str = "recompute",
        chunked_prefill: bool = True,
        kv_reservation: str = "paged",
        max_model_len: int | None = None,
    ) -> None:
        self.reservation = KVReservation(kv, kv_reservation, max_model_len)  # checks the mode
        self.kv_reservation, self.max_model_len = kv_reservation, max_model_len
        self.kv = kv
        self.chunked_prefill = chunked_prefill
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.watermark = max(1, kv.allocator.num_blocks // 100)
        self.num_preemptions = {"recompute": 0, "swap": 0}
        # Tokens computed again after a recompute preemption; and the prefix-cache lookups of
        # re-admissions (their tokens, their hits), which vLLM's hit rate leaves out.
        self.num_recomputed_tokens = 0
        self.num_readmit_query_tokens = self.num_readmit_hit_tokens = 0

    def add(self, req: Request) -> None:
        self._enqueue(self.waiting, req, RequestStatus.WAITING)

    def remove(self, req: Request) -> None:
        """Take a request out of whichever queue holds it and free its blocks (abort, finish)."""
        self._dequeue(req)
        for seq in req.seqs:
            if seq.seq_id in self.kv:
                self.kv.free_sequence(seq.seq_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # --- one step --------------------------------------------------------------------------------
    def schedule(self, out: SchedulerOutput | None = None) -> SchedulerOutput:
        """Plan one step into ``out`` (a new one by default; the engine passes its own, so that
        it can see what a schedule that raised had done so far)."""
        out = SchedulerOutput() if out is None else out
        self._schedule_running(out)
        if not out.preempted:
            self._schedule_swapped(out)
            if not self.swapped:
                self._schedule_waiting(out)
        self.num_recomputed_tokens += out.recomputed_tokens
        self.num_readmit_query_tokens += out.readmit_query_tokens
        self.num_readmit_hit_tokens += out.readmit_hit_tokens
        return out

    def _schedule_running(self, out: SchedulerOutput) -> None:
        kv = self.kv
        # A sliding window's blocks that no query will read again go back to the pool first,
        # so that the checks below count the room they leave (full attention skips nothing).
        if kv.has_sliding_window:
            for r in self.running:
                for seq_id in r.seq_ids:
                    kv.remove_skipped_blocks(seq_id, kv.num_tokens(seq_id))
        pending = {r.request_id: pending_prompt_tokens(self.kv, r) for r in self.running}
        prefilling = {rid: n for rid, n in pending.items() if n}
        decode_seqs = sum(len(r.seqs) for r in self.running if r.request_id not in prefilling)
        prefill_budget = self.max_num_batched_tokens - decode_seqs  # decodes come first
        room = self._room_for_all(decode_seqs, prefilling.values())
        queue, kept = list(self.running), []
        while queue:
            req = queue.pop(0)  # the oldest not yet handled
            chunk = 1  # a decode: a chunk of one
            if req.request_id in prefilling:
                chunk = min(prefilling[req.request_id], prefill_budget)
                if chunk == 0:  # no budget left this step: it waits, keeping its blocks
                    kept.append(req)
                    continue
            ids = req.seq_ids * chunk
            while not room and kv.blocks_to_append(ids) > kv.num_free_blocks:
                victim = self._choose_victim(queue, req)
                if victim in queue:
                    queue.remove(victim)  # it will not be handled this step
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.add_next_tokens(kv, req, chunk)
                if req.request_id in prefilling:
                    prefill_budget -= chunk
                kept.append(req)
        self.running = kept

    def _room_for_all(self, decode_seqs: int, pending: Iterable[int]) -> bool:
        """Whether the free blocks cover every running request's next tokens, so that nobody
        can run short and :meth:`_schedule_running` need not ask ``blocks_to_append`` request
        by request (the common step). Per KV-cache group, a decode takes at most one block (a
        new one, or a copy-on-write copy: ``blocks_needed(1)``), and a chunk of ``n`` of a
        prompt's ``pending`` tokens at most ``blocks_needed(n)``, plus a copy if its partly
        filled last block is shared."""
        kv, one = self.kv, self.kv.blocks_needed(1)
        need = decode_seqs * one + sum(kv.blocks_needed(n) + one for n in pending)
        return need <= kv.num_free_blocks

    def _schedule_swapped(self, out: SchedulerOutput) -> None:
        kv, pool = self.kv, self.kv.allocator.num_blocks
        while self.swapped:
            req = self.swapped[0]
            ids = req.seq_ids
            fits = fits_budgets(self, req, len(ids), out)
            if not fits or not self.reservation.fits(req, self.running):
                return
            alone = not self.running
            # Room for the copies back plus, to be safe, one new block per sequence to append
            # (in every KV-cache group: blocks_needed(1)).
            need = kv.blocks_to_swap_in(ids) + (0 if alone else len(ids) * kv.blocks_needed(1))
            if need > kv.num_free_blocks:
                if alone:
                    self._fail(req, out, f"needs {need} blocks to resume, the pool has {pool}")
                    continue
                return
            out.touched.append(req)
            self.swapped.pop(0)
            out.swap_in.extend(kv.swap_in(ids))
            if kv.blocks_to_append(ids) > kv.num_free_blocks:  # only when it was alone
                self._fail(req, out, f"grew past the whole pool of {pool} blocks")
                continue
            self._enqueue(self.running, req, RequestStatus.RUNNING)
            out.add_next_tokens(kv, req)

    def _schedule_waiting(self, out: SchedulerOutput) -> None:
        kv = self.kv
        while self.waiting:
            req = self.waiting[0]
            total = blocks_to_start(self, req)
            if total > kv.allocator.num_blocks:  # it grew while running, then was preempted
                n, pool = sum(len(s.token_ids) for s in req.seqs), kv.allocator.num_blocks
                why = f"needs {total} blocks for its {n} tokens, more than the whole pool of {pool}"
                self._fail(req, out, why)
                continue
            if not fits_budgets(self, req, req.params.n, out):
                return
            chunk = first_chunk(self, req, out)  # all of the prompt without chunking
            blocks = kv.blocks_needed(chunk) if len(req.seqs) == 1 else total  # no cache hits
            if self.kv_reservation == "max":  # its whole reservation, not just the prompt
                if not self.reservation.fits(req, self.running):
                    return
            elif not self._can_admit(blocks):
                return
            if not out.add_prefill(kv, req, chunk):
                return
            self.waiting.pop(0)
            self._enqueue(self.running, req, RequestStatus.RUNNING)

    # --- the policy's three decisions (lab 6, "scheduler", has students write them) -------------
    def _can_admit(self, blocks: int) -> bool:
        """May a waiting request whose prompt (or first chunk) needs ``blocks`` new blocks be
        admitted now? Under the block budget: it must leave ``self.watermark`` blocks free, so
        that the running requests can still grow next step without a preemption. When nothing
        runs, there is nobody to protect: it is admitted if it fits in the free blocks at all
        (else a prompt that needs the whole pool would wait forever).

        >>> s = Scheduler(KVCacheManager(num_blocks=8, block_size=4), 8, 64)
        >>> s.watermark, s._can_admit(8), s._can_admit(9)  # nothing runs: the whole pool
        (1, True, False)
        >>> s.running.append("a request")  # (any running request will do here)
        >>> s._can_admit(7), s._can_admit(8)  # one block stays free
        (True, False)
        """
        if not self.running:
            return blocks <= self.kv.num_free_blocks
        return blocks + self.watermark <= self.kv.num_free_blocks

    def _choose_victim(self, queue: list[Request], req: Request) -> Request:
        """Which request to preempt when running request ``req`` needs blocks the pool does not
        have: the most recently arrived among those not yet handled this step -- the last of
        ``queue`` (running requests behind ``req``, in arrival order) -- or ``req`` itself when
        none is left (it is then the youngest, and it has not appended yet). Requests handled
        earlier in the step are older; they keep their blocks (first come, first served)."""
        return queue[-1] if queue else req

    def _preempt_by_recompute(self, req: Request, out: SchedulerOutput) -> None:
        """Preempt ``req`` by recompute: every sequence of it gives back all its blocks
        (all or nothing), it goes back to ``waiting`` at its arrival position (so it comes back
        before anyone who arrived after it), and the preemption is counted
        (:meth:`_count_preemption`). Its sequences keep their tokens: readmitted, it prefills
        prompt + generated tokens in one pass."""
        for seq_id in req.seq_ids:
            self.kv.free_sequence(seq_id)
        self._count_preemption(req, out, "recompute")
        self._enqueue(self.waiting, req, RequestStatus.WAITING)

    # --- max-length reservation (the policy: reservation.py) ---------------------------------
    def reserved_blocks(self, num_prompt_tokens: int, params) -> int:
        """Blocks a request reserves for its whole life (0 under paging); ``add_request`` rejects
        one that reserves more than the whole pool (:meth:`KVReservation.reserved_blocks`)."""
        return self.reservation.reserved_blocks(num_prompt_tokens, params)

    def unreserved_blocks(self) -> int:
        """Free blocks no running request's reservation has promised (under paging: all)."""
        return self.reservation.unreserved_blocks(self.running)

    # --- helpers ---------------------------------------------------------------------------------
    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        out.touched.append(req)
        if self.preemption_mode == "swap":
            try:
                out.swap_out.extend(self.kv.swap_out(req.seq_ids))
            except OutOfBlocksError:  # the CPU pool is full: fall back to recomputing
                pass
            else:
                self._count_preemption(req, out, "swap")
                self._enqueue(self.swapped, req, RequestStatus.SWAPPED)
                return
        req.kv_dropped = {s.seq_id: self.kv.num_tokens(s.seq_id) for s in req.seqs}
        self._preempt_by_recompute(req, out)

    def _count_preemption(self, req: Request, out: SchedulerOutput, mode: str) -> None:
        """Book a preemption of ``req`` (``mode``: "recompute" or "swap"): the trace event (the
        live view draws it), the scheduler's and the request's counters, the step's output (no
        admissions in a step that preempted), and ``req`` out of ``running``."""
        self.kv.trace.emit("preempt", (), tuple(req.seq_ids), mode=mode)
        self.num_preemptions[mode] += 1
        req.metrics.num_preemptions += 1
        out.preempted.append(req)
        if req in self.running:
            self.running.remove(req)

    def _fail(self, req: Request, out: SchedulerOutput, why: str) -> None:
        out.touched.append(req)
        self.remove(req)
        req.error = f"request {req.request_id!r} can never fit: it {why}"
        out.failed.append(req)

    def _dequeue(self, req: Request) -> None:
        """Take ``req`` out of whichever queue holds it (if any); its blocks stay."""
        for queue in (self.waiting, self.running, self.swapped):
            if req in queue:
                queue.remove(req)

    @staticmethod
    def _enqueue(queue: list[Request], req: Request, status: RequestStatus) -> None:
        """Insert keeping arrival order, so every queue is served first come, first served."""
        req.status = status
        keys = [r.arrival_index for r in queue]
        queue.insert(bisect.bisect(keys, req.arrival_index), req)
