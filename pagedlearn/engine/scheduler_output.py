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
:class:`~pagedlearn.core.kv_cache_manager.KVCacheManager` as they do:

- :meth:`SchedulerOutput.add_prefill`: a waiting request is admitted; its sequences get their
  blocks, all or none, and the prompt's cached prefix is not computed again;
- :meth:`SchedulerOutput.add_next_tokens`: a running request (or one back from swap) goes on,
  one ``append_token`` per token -- a decode, or the next chunk of its prompt (a decode *is* a
  chunk of one). So a sequence's next tokens are always ``token_ids[kv.num_tokens(seq):]``.

These are not two planners of the same thing: the first creates sequences (all or none, with a
prefix-cache lookup, and a re-admitted request's samples sharing their prefix again), the second
is the one way a sequence that exists gets its next tokens.

The forward then writes each new token's K/V into the slot the plan gives it; the copy-on-write
copies the appends caused wait in the manager, which the engine asks for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedlearn.engine.readmission import readmission_blocks, share_plan
from pagedlearn.engine.request import Request, Sequence
from pagedlearn.errors import OutOfBlocksError, PagedLearnError
from pagedlearn.models.runner import SequenceInput

if TYPE_CHECKING:
    from pagedlearn.core.kv_cache_manager import KVCacheManager


@dataclass(init=False)
class ScheduledSequence(SequenceInput):
    """One sequence's work this step: ``new_tokens`` at positions ``start_pos...``, K/V into
    ``slots``; a prefill when several (or all the prompt's) tokens are new. ``slots`` and
    ``block_tables`` hold one list per KV-cache group (one for GPT-2; kv_cache_groups.py).

    It *is* the model runner's :class:`~pagedlearn.models.runner.SequenceInput` (those four
    fields), plus whose work it is: the engine hands the step's plan to the runner as it is."""

    request: Request
    seq: Sequence
    is_prefill: bool
    samples: bool = True  # the chunk reaches the sequence's last token: sample the next one

    # Written by hand (``init=False``): a generated __init__ would take the parent's four fields
    # first, and every caller passes (request, seq, start_pos, ...), as before the subclassing.
    def __init__(
        self,
        request: Request,
        seq: Sequence,
        start_pos: int,
        new_tokens: list[int],
        slots: list[list[int]],
        block_tables: list[list[int]],
        is_prefill: bool,
        samples: bool = True,
    ) -> None:
        self.request = request
        self.seq = seq
        self.start_pos = start_pos
        self.new_tokens = new_tokens
        self.slots = slots
        self.block_tables = block_tables
        self.is_prefill = is_prefill
        self.samples = samples


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
    # Tokens planned again that a recompute preemption had dropped (Request.kv_dropped), and
    # the prefix-cache lookups of such re-admissions: their tokens and hits.
    recomputed_tokens: int = 0
    readmit_query_tokens: int = 0
    readmit_hit_tokens: int = 0

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
            queried = [min(chunk, len(seq.token_ids))]
        elif readmission_blocks(kv, req.seqs) > kv.num_free_blocks:  # checked: nothing fails
            return False
        else:
            reused, queried = self._readmit(kv, req, keys)
        if req.metrics.first_scheduled_time is None:
            req.num_cached_tokens = reused[0]
        elif req.kv_dropped and kv.prefix_cache is not None:  # back after a recompute
            # preemption: the manager counted a lookup, which is not a new prompt's
            self.readmit_query_tokens += sum(queried)
            self.readmit_hit_tokens += sum(r for r, q in zip(reused, queried, strict=True) if q)
        for seq, r in zip(req.seqs, reused, strict=True):
            n = kv.num_tokens(seq.seq_id)
            planned = ScheduledSequence(
                req, seq, r, seq.token_ids[r:n], kv.slot_mappings(seq.seq_id, r),
                kv.block_tables(seq.seq_id), is_prefill=True, samples=n == len(seq.token_ids),
            )  # fmt: skip
            self.scheduled.append(planned)
        self._count_recomputed(req)
        return True

    def _count_recomputed(self, req: Request) -> None:
        """Add the tokens just planned below where a recompute preemption dropped their K/V
        (``req.kv_dropped``): what the preemption really costs, after cache hits and sharing.
        Once every sequence is past its mark, the request is no longer counted."""
        if not req.kv_dropped:
            return
        behind = False
        for s in self.scheduled[-len(req.seqs) :]:  # this request's, just planned
            end = s.start_pos + len(s.new_tokens)
            dropped = req.kv_dropped.get(s.seq.seq_id, 0)
            self.recomputed_tokens += max(0, min(end, dropped) - s.start_pos)
            behind = behind or end < dropped
        if not behind:
            req.kv_dropped = {}

    @staticmethod
    def _readmit(kv: KVCacheManager, req: Request, keys: dict) -> tuple[list[int], list[int]]:
        """Blocks for every sequence of a re-admitted request; returns the tokens each reuses,
        and the tokens each looked up in the prefix cache. The first sequence (and any that
        shares no whole block) is added as a prompt, reusing what the prefix cache holds; each
        other one shares its sibling's whole blocks through ``fork_prefix`` and appends the
        rest -- the sharing does not depend on the cache, whose entries a group's allocation
        may evict. Where a sliding window freed entries of the sibling that this sequence still
        reads, ``fork_prefix`` refuses (changing nothing) and the sequence is added whole;
        :func:`readmission_blocks` counted blocks for that, so nothing here runs short."""
        plan = share_plan(req.seqs, kv.block_size)
        reused, queried = [], []
        for seq, (parent, shared) in zip(req.seqs, plan, strict=True):
            if parent is not None:
                try:
                    kv.fork_prefix(req.seqs[parent].seq_id, seq.seq_id, shared)
                except PagedLearnError:
                    if not kv.has_sliding_window:  # only a window's freed entries may refuse
                        raise
                else:
                    for t in seq.token_ids[shared:]:
                        kv.append_token(seq.seq_id, t)
                    reused.append(shared)
                    queried.append(0)
                    continue
            reused.append(kv.add_sequence(seq.seq_id, seq.token_ids, **keys))
            queried.append(len(seq.token_ids) if kv.prefix_cache is not None else 0)
        return reused, queried

    def add_next_tokens(self, kv: KVCacheManager, req: Request, chunk: int = 1) -> None:
        """Plan each sequence's next ``chunk`` tokens: the newest sampled token (a decode, a
        chunk of one), or the next piece of a prompt. Each gets its slot now with
        ``kv.append_token`` (maybe a new block, or a copy-on-write copy); the forward writes
        their K/V there."""
        self.touched.append(req)
        for seq in req.seqs:
            start = kv.num_tokens(seq.seq_id)
            new = seq.token_ids[start : start + chunk]
            slots = [kv.append_token(seq.seq_id, t) for t in new]  # (group 0's slots)
            tables = kv.block_tables(seq.seq_id)
            # One KV-cache group (the common case): the slots append_token returned are all
            # there is; with several, the manager gives each group's.
            slots = [slots] if len(tables) == 1 else kv.slot_mappings(seq.seq_id, start)
            planned = ScheduledSequence(
                req, seq, start, new, slots, tables,
                is_prefill=start < seq.num_prompt_tokens or chunk > 1,
                samples=start + chunk == len(seq.token_ids),
            )  # fmt: skip
            self.scheduled.append(planned)
        if req.kv_dropped:  # a later chunk of a re-admitted prompt
            self._count_recomputed(req)
