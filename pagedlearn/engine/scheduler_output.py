"""The step's plan: what the scheduler hands the engine after deciding who runs.

:meth:`Scheduler.schedule <pagedlearn.engine.scheduler.Scheduler.schedule>` fills one
:class:`SchedulerOutput` per step, and the engine runs the step from it:

- ``scheduled``: one :class:`ScheduledSequence` per sequence that runs -- its new tokens, the
  slots their K/V go to and its block table (a prefill, a chunk of a prompt, or a decode: the
  model packs them all into one batch);
- ``swap_out`` / ``swap_in``: block copies between the device pool and the CPU swap pool
  (preemption by swap, swapped requests coming back), made before the forward;
- ``preempted`` and ``failed``: what the step did to requests besides running them;
- ``touched``: every request whose queue or blocks the step changed, noted before the change,
  so that the engine can undo a step that raised (:mod:`pagedlearn.engine.recovery`).

A request's tokens enter the plan in one of two ways, taking their blocks and slots from the
:class:`~pagedlearn.kv_cache_manager.KVCacheManager` as they do:

- :meth:`SchedulerOutput.add_prefill`: a waiting request is admitted; its sequences get their
  blocks, all or none, and the prompt's cached prefix is not computed again;
- :meth:`SchedulerOutput.add_next_tokens`: a running request (or one back from swap) goes on,
  one ``append_token`` per token -- a decode, or the next chunk of its prompt (a decode *is* a
  chunk of one). So a sequence's next tokens are always ``token_ids[kv.num_tokens(seq):]``.

The forward then writes each new token's K/V into the slot the plan gives it; the copy-on-write
copies the appends caused wait in the manager, which the engine asks for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedlearn.engine.readmission import readmission_blocks, share_plan
from pagedlearn.engine.request import Request, Sequence
from pagedlearn.errors import OutOfBlocksError

if TYPE_CHECKING:
    from pagedlearn.kv_cache_manager import KVCacheManager


@dataclass
class ScheduledSequence:
    """One sequence's work this step: ``new_tokens`` at positions ``start_pos...``, K/V into
    ``slots``; a prefill when several (or all the prompt's) tokens are new. ``slots`` and
    ``block_tables`` hold one list per KV-cache group (one for GPT-2; kv_cache_groups.py)."""

    request: Request
    seq: Sequence
    start_pos: int
    new_tokens: list[int]
    slots: list[list[int]]
    block_tables: list[list[int]]
    is_prefill: bool
    samples: bool = True  # the chunk reaches the sequence's last token: sample the next one


@dataclass
class SchedulerOutput:
    """One step's plan (see the module docstring): who runs, with which slots, and the copies,
    preemptions and failures the step made."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)
    preempted: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)  # can never fit; request.error says why
    # Every request whose queue or blocks this step changed, noted *before* the change: if the
    # step raises, the engine rolls these back (recovery.py).
    touched: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        """Tokens the step's forward runs so far: what admissions check against the per-step
        token budget, ``max_num_batched_tokens``."""
        return sum(len(s.new_tokens) for s in self.scheduled)

    # --- how a request's tokens enter the plan: they take their slots now ------------------------
    def add_prefill(self, kv: KVCacheManager, req: Request, chunk: int) -> bool:
        """Give every sequence of a waiting request its blocks (all or none) and plan its
        prefill: its first ``chunk`` tokens, less the prefix the cache already holds. A request
        re-admitted after a recompute preemption with several sequences takes all their tokens,
        its sequences sharing their common prefixes again (:mod:`~pagedlearn.engine.readmission`).
        The request's cache salt and adapter go into its block hashes. Returns False, with no
        blocks taken, if they don't fit."""
        self.touched.append(req)
        keys = {"cache_salt": req.cache_salt, "adapter_id": req.adapter_id}
        if len(req.seqs) == 1:
            seq = req.seqs[0]
            try:
                reused = [kv.add_sequence(seq.seq_id, seq.token_ids[:chunk], **keys)]
            except OutOfBlocksError:
                return False
        elif readmission_blocks(kv, req.seqs) > kv.num_free_blocks:  # checked: nothing fails
            return False
        else:
            reused = self._readmit(kv, req, keys)
        if req.metrics.first_scheduled_time is None:
            req.num_cached_tokens = reused[0]
        for seq, r in zip(req.seqs, reused, strict=True):
            n = kv.num_tokens(seq.seq_id)
            planned = ScheduledSequence(
                req, seq, r, seq.token_ids[r:n], kv.slots(seq.seq_id, r),
                kv.block_tables(seq.seq_id), is_prefill=True, samples=n == len(seq.token_ids),
            )  # fmt: skip
            self.scheduled.append(planned)
        return True

    @staticmethod
    def _readmit(kv: KVCacheManager, req: Request, keys: dict) -> list[int]:
        """Blocks for every sequence of a re-admitted request; returns the tokens each reuses.
        Without prefix caching a sequence shares its sibling's blocks through ``fork_prefix``;
        with it, ``add_sequence`` finds them in the cache (the sibling's full blocks were just
        registered) and maybe more of its own."""
        plan = share_plan(req.seqs, kv.block_size)
        reused = []
        for seq, (parent, shared) in zip(req.seqs, plan, strict=True):
            if parent is None or kv.prefix_cache is not None:
                reused.append(kv.add_sequence(seq.seq_id, seq.token_ids, **keys))
                continue
            kv.fork_prefix(req.seqs[parent].seq_id, seq.seq_id, shared)
            for t in seq.token_ids[shared:]:
                kv.append_token(seq.seq_id, t)
            reused.append(shared)
        return reused

    def add_next_tokens(self, kv: KVCacheManager, req: Request, chunk: int = 1) -> None:
        """Plan each sequence's next ``chunk`` tokens: the newest sampled token (a decode, a
        chunk of one), or the next piece of a prompt. Each gets its slot now with
        ``kv.append_token`` (maybe a new block, or a copy-on-write copy); the forward writes
        their K/V there."""
        self.touched.append(req)
        for seq in req.seqs:
            start = kv.num_tokens(seq.seq_id)
            new = seq.token_ids[start : start + chunk]
            for t in new:
                kv.append_token(seq.seq_id, t)
            planned = ScheduledSequence(
                req, seq, start, new, kv.slots(seq.seq_id, start), kv.block_tables(seq.seq_id),
                is_prefill=start < seq.num_prompt_tokens or chunk > 1,
                samples=start + chunk == len(seq.token_ids),
            )  # fmt: skip
            self.scheduled.append(planned)
