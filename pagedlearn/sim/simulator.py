"""An iteration-level serving simulator over two memory models: contiguous reservation and paging.

The loop is Orca's and vLLM's (iteration-level scheduling), with no model attached: every step

1. admits waiting requests first-come-first-served while memory allows (it stops at the first
   that does not fit: no skipping ahead), up to ``max_num_seqs`` running;
2. records where every token slot of the pool is (a :class:`Snapshot`);
3. advances every running request by one token, growing its KV cache;
4. retires the requests that have generated their ``output_len`` tokens.

Only *memory* is simulated. Which requests are running together, and so the batch size, follows
from memory alone; how long a step takes does not matter for it (arrival times are in steps:
``step_seconds`` converts Poisson arrivals given in seconds).

Two memory models, one interface (``admit`` / ``grow`` / ``release`` / ``breakdown``):

- :class:`ContiguousMemory` -- Orca-style: at admission a request reserves one contiguous run of
  slots for its whole lifetime from a :class:`~pagedlearn.sim.buddy.BuddyAllocator`. Policies
  (Kwon et al., Section 2.3 and Figure 2): ``max`` reserves the model's limit (prompt +
  ``max_tokens``, 2048 in the paper); ``pow2`` reserves the prompt plus the true output length
  rounded up to a power of two (at most 2x over); ``oracle`` reserves exactly the final length.
- :class:`PagedMemory` -- vLLM: the project's real :class:`~pagedlearn.KVCacheManager`. Blocks
  are taken one at a time as tokens arrive; when a step cannot get a block, the most recently
  arrived running request is preempted (recompute: its blocks are freed and it waits again at
  the front of the queue, with the tokens it generated kept as part of its prompt).

Where a slot is, in the paper's Figure 2 words (:meth:`breakdown`):

- **token states**: slots holding the KV of a token already processed;
- **reserved**: slots a request holds for tokens it *will* generate;
- **internal fragmentation**: slots a request holds that it will never use (its reservation
  minus its final length; for paging, the empty tail of each request's last block);
- **buddy rounding**: slots the buddy allocator adds to round a reservation up to a power of two;
- **free**: slots nobody holds. Under load (requests waiting) these are free but unusable: the
  paper counts rounding and free together as "external fragmentation and other".
"""

from collections import deque
from dataclasses import dataclass

from pagedlearn.core.kv_cache_manager import KVCacheManager
from pagedlearn.errors import OutOfBlocksError, PagedLearnError
from pagedlearn.sim.buddy import BuddyAllocator

CATEGORIES = ("token_states", "reserved", "internal", "buddy_rounding", "free")


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass
class Snapshot:
    """The pool at one step, in token slots (the categories sum to the pool size)."""

    step: int
    running: int
    waiting: int
    token_states: int
    reserved: int
    internal: int
    buddy_rounding: int
    free: int
    shared: int = 0  # slots sharing saves: every request's blocks counted apart, minus the pool's


class ContiguousMemory:
    """Orca-style reservation: one contiguous run of slots per request, from a buddy allocator."""

    def __init__(self, num_slots: int, policy: str, max_context: int = 2048):
        if policy not in ("max", "pow2", "oracle"):
            raise ValueError(f"policy must be 'max', 'pow2' or 'oracle', got {policy!r}")
        self.name = f"Orca ({policy.capitalize() if policy != 'pow2' else 'Pow2'})"
        self.policy, self.max_context = policy, max_context
        self.buddy = BuddyAllocator(num_slots)
        self.held = {}  # request_id -> (offset, requested slots)
        self._final = self._internal = self._rounding = 0  # running totals (see admit)

    def reservation(self, req) -> int:
        """Slots requested for ``req`` for its whole lifetime."""
        limit = req.prompt_len + req.max_tokens
        if self.policy == "max":
            return limit
        if self.policy == "pow2":
            return min(req.prompt_len + next_pow2(req.output_len), limit)
        return req.final_len  # oracle

    def admit(self, req, length: int) -> bool:
        size = self.reservation(req)
        offset = self.buddy.allocate(size)
        if offset is None:
            return False
        self.held[req.request_id] = (offset, size)
        # What does not change while it runs, summed over the running requests (so that a
        # step's breakdown is one pass over the lengths): its final length, the slots it will
        # never use, and the buddy allocator's rounding.
        self._final += req.final_len
        self._internal += size - req.final_len
        self._rounding += self.buddy.allocated_size(offset) - size
        return True

    def grow(self, req, length: int) -> bool:
        return True  # everything was reserved up front

    def release(self, req) -> None:
        offset, size = self.held.pop(req.request_id)
        self._final -= req.final_len
        self._internal -= size - req.final_len
        self._rounding -= self.buddy.allocated_size(offset) - size
        self.buddy.free(offset)

    def breakdown(self, running_lengths) -> dict:
        """``running_lengths``: (request, tokens in the cache now) for every running request
        (every request this memory holds: a reservation is held from admission to release)."""
        tokens = sum(length for _, length in running_lengths)
        return {
            "token_states": tokens,
            "reserved": self._final - tokens,  # sum of (final length - length now)
            "internal": self._internal,
            "buddy_rounding": self._rounding,
            "free": self.buddy.num_free_slots,
        }


class PagedMemory:
    """vLLM-style paging on the project's own :class:`KVCacheManager` (block size 16 default).

    Requests without token ids use token 0 everywhere: without prefix caching only their count
    matters. With ``enable_prefix_caching`` give them ids (``workloads.attach_tokens``).
    """

    def __init__(self, num_slots: int, block_size: int = 16, enable_prefix_caching=False):
        caching = ", prefix caching" if enable_prefix_caching else ""
        self.name = f"vLLM (block {block_size}{caching})"
        self.block_size = block_size
        self.kv = KVCacheManager(num_slots // block_size, block_size, enable_prefix_caching)
        self.num_slots = num_slots

    @staticmethod
    def _tokens(req, start: int, stop: int) -> list:
        """Token ids at positions [start, stop) of ``req`` (prompt, then output)."""
        if req.prompt_tokens is None:
            return [0] * (stop - start)
        return (req.prompt_tokens + req.output_tokens)[start:stop]

    def admit(self, req, length: int) -> bool:
        try:
            self.kv.add_sequence(req.request_id, self._tokens(req, 0, length))
        except OutOfBlocksError:
            return False
        return True

    def grow(self, req, length: int) -> bool:
        if req.prompt_tokens is None:
            token = 0
        elif length < req.prompt_len:  # a preempted request's prompt is re-fed in order
            token = req.prompt_tokens[length]
        else:
            token = req.output_tokens[length - req.prompt_len]
        try:
            self.kv.append_token(req.request_id, token)
        except OutOfBlocksError:
            return False
        return True

    def release(self, req) -> None:
        self.kv.free_sequence(req.request_id)

    def breakdown(self, running_lengths) -> dict:
        """Physical slots: a block shared by several requests (a cached prefix) counts once."""
        out = dict.fromkeys(CATEGORIES, 0)
        bs, per_request = self.block_size, 0
        if self.kv.prefix_cache is None:  # nothing is shared: count per request (fast)
            for _, length in running_lengths:
                per_request += -(-length // bs) * bs
                out["token_states"] += length
            out["internal"] = per_request - out["token_states"]
            physical = per_request
        else:
            # Physical blocks, each once. Every block but a table's last is full; only full
            # blocks are cached, so a block two requests share is full in both.
            blocks, empty_tails = set(), 0
            for req, length in running_lengths:
                table = self.kv.block_table(req.request_id)
                per_request += len(table) * bs
                blocks.update(table)
                empty_tails += len(table) * bs - length  # slots free in its last block
            physical = len(blocks) * bs
            out["token_states"] = physical - empty_tails
            out["internal"] = empty_tails
        # Slots past the last whole block (num_slots not a multiple of block_size) are never
        # usable, and cached blocks nobody runs on can be reclaimed: both count as free.
        out["free"] = self.num_slots - out["token_states"] - out["internal"]
        out["shared"] = per_request - physical
        return out


@dataclass
class SimResult:
    name: str
    snapshots: list
    finished: int
    preemptions: int
    steps: int
    warmup: int = 0  # steps left out of the averages: the batch has not turned over yet

    def loaded(self) -> list:
        """The steady steps under load: past the warm-up, with requests waiting (memory-bound).

        At step 0 of a saturated run every admitted request is fresh (prompt only, nothing
        generated), which is not what a server that has been running looks like; after about
        one mean output length the running batch has turned over.
        """
        steady = [s for s in self.snapshots if s.step >= self.warmup]
        return [s for s in steady if s.waiting > 0] or steady or self.snapshots

    def mean_batch(self, under_load: bool = True) -> float:
        """Average running requests: over the steps under load, or (``under_load=False``, for
        runs with arrivals) over every step past the warm-up while anything runs."""
        if under_load:
            steps = self.loaded()
        else:
            steps = [s for s in self.snapshots if s.step >= self.warmup and s.running] or [
                s for s in self.snapshots if s.running
            ]
        return sum(s.running for s in steps) / len(steps)

    def mean_breakdown(self) -> dict:
        """Each category's average share of the pool (%) over the loaded steps."""
        steps = self.loaded()
        pool = sum(getattr(steps[0], c) for c in CATEGORIES)
        return {c: 100 * sum(getattr(s, c) for s in steps) / len(steps) / pool for c in CATEGORIES}


def simulate(requests, memory, max_num_seqs=256, step_seconds=None, max_steps=None) -> SimResult:
    """Serve ``requests`` (sorted by arrival) with ``memory``; return every step's snapshot.

    ``step_seconds``: how long one iteration takes, to turn arrival times (seconds) into steps;
    ``None`` lets every request arrive at step 0. ``max_steps`` stops early.
    """
    arrivals = deque(sorted(requests, key=lambda r: r.arrival))
    blocked = []  # arrived, but waiting for another request to finish first (``after``)
    waiting = deque()  # (request, tokens to prefill: prompt + anything generated before)
    running = []  # [request, tokens in the cache, tokens generated], in arrival order
    done = set()
    snapshots, finished, preemptions, step = [], 0, 0, 0
    while arrivals or blocked or waiting or running:
        now = step * step_seconds if step_seconds else float("inf")
        while arrivals and arrivals[0].arrival <= now:
            blocked.append(arrivals.popleft())
        ready = [r for r in blocked if r.after is None or r.after in done]
        blocked = [r for r in blocked if not (r.after is None or r.after in done)]
        waiting.extend((r, r.prompt_len, 0) for r in ready)
        if not waiting and not running:  # idle: jump to the next arrival
            if not arrivals:
                raise PagedLearnError(f"requests wait for ones that never finish: {blocked[:3]}")
            step = max(step + 1, int(arrivals[0].arrival / step_seconds))
            continue
        # 1. Admit first-come-first-served while memory (and the batch limit) allows.
        admitted = False
        while waiting and len(running) < max_num_seqs:
            req, length, generated = waiting[0]
            if not memory.admit(req, length):
                break
            waiting.popleft()
            running.append([req, length, generated])
            admitted = True
        # Keep running in arrival order (FCFS priority): a request back from preemption takes
        # its old place, so the next victim is still the latest arrival, not the one just back.
        if admitted:  # (preemption pops the last and retiring removes: both keep the order)
            running.sort(key=lambda e: (e[0].arrival, e[0].request_id))
        if waiting and not running:  # it will never fit: say so instead of looping forever
            req = waiting[0][0]
            raise PagedLearnError(
                f"request {req.request_id} ({waiting[0][1]} tokens) does not fit in an empty "
                f"pool ({memory.name})"
            )
        # 2. Where every slot of the pool is, this step.
        parts = memory.breakdown([(r, n) for r, n, _ in running])
        snapshots.append(Snapshot(step, len(running), len(waiting), **parts))
        # 3. Every running request produces one token; its KV needs a slot.
        i = 0
        while i < len(running):
            req, length, generated = running[i]
            if not memory.grow(req, length):
                if len(running) == 1:  # alone and still out of room: it can never finish
                    raise PagedLearnError(
                        f"request {req.request_id} needs more than the whole pool "
                        f"({memory.name}) at {length + 1} tokens"
                    )
                # Preempt the latest arrival (recompute) and retry, as vLLM does.
                victim, v_length, v_generated = running.pop()
                memory.release(victim)
                waiting.appendleft((victim, v_length, v_generated))
                preemptions += 1
                continue  # if the victim was this request, the loop ends here
            running[i] = [req, length + 1, generated + 1]
            i += 1
        # 4. Retire the finished.
        for entry in [e for e in running if e[2] >= e[0].output_len]:
            memory.release(entry[0])
            running.remove(entry)
            done.add(entry[0].request_id)
            finished += 1
        step += 1
        if max_steps is not None and step >= max_steps:
            break
    warmup = round(sum(r.output_len for r in requests) / max(len(requests), 1))
    return SimResult(memory.name, snapshots, finished, preemptions, step, warmup)
