"""The engine's fast paths against the plain code they stand in for (the speed rule of issue 17).

- ``Sampler.greedy`` (numpy) against ``Sampler.greedy_ref`` (torch);
- ``SchedulerOutput.add_decodes`` against ``add_next_tokens`` request by request: the same plan,
  the same block-manager state and trace (block boundaries, copy-on-write, the prefix cache);
- whole runs with the fast paths on and off (``Scheduler.fast_decodes``: the planning, and
  ``Scheduler._room_for_all`` while a prompt is prefilled in chunks;
  ``LLMEngine.fast_decodes``: ``fast_decode.decode_greedy``): every step's outputs, the block
  trace, the stats and the metrics agree, over greedy, parallel sampling, beam search, stop
  strings, chunked prefill, both preemption modes and a hybrid (sliding-window) model -- and
  the fast paths did run;
- the same faults with the fast paths on and off: the same recoveries and outputs;
- the snapshot ``decode_greedy`` takes is ``Snapshot.of`` of the request.
"""

from __future__ import annotations

import pytest
import torch
from engine_cases import PROMPTS, SYSTEM, make_llm

from pagedlearn import BeamSearchParams, SamplingParams
from pagedlearn.core.kv_cache_manager import KVCacheManager
from pagedlearn.engine import llm_engine
from pagedlearn.engine.recovery import Snapshot, StepJournal
from pagedlearn.engine.request import Request, RequestMetrics
from pagedlearn.engine.sampler import Sampler
from pagedlearn.engine.scheduler import Scheduler
from pagedlearn.engine.scheduler_output import SchedulerOutput
from pagedlearn.trace.events import EventLog

# StepStats fields that are clocks: they differ between any two runs.
TIMES = {"step_time", "forward_time", "bookkeeping_time", "swap_time", "recompute_time"}
TIMES |= {"ttft_p50", "ttft_p99", "preemption_time"}


# --- Sampler.greedy -------------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [0, 1, 7, 64])
def test_greedy_matches_the_torch_reference(rows):
    g = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, 50, generator=g)
    logits[:, 10] = logits[:, 3] = 10.0  # above any randn: a tie, the lowest id wins
    logits[:, 20:30] = float("-inf")
    if rows > 1:
        logits[1] = 0.0  # a row of equal values: id 0
    logprobs = Sampler().logprobs(logits)
    assert Sampler().greedy(logprobs) == Sampler().greedy_ref(logprobs)
    assert all(tok == 3 for tok, _ in Sampler().greedy(logprobs)[2:])


# --- SchedulerOutput.add_decodes ------------------------------------------------------------------
def _decoding_state(block_size: int = 4):
    """A manager with requests in the middle of decoding: sequences at and off block boundaries,
    forks sharing a partly filled last block (copy-on-write), a request with kv_dropped marks,
    prefix caching on; each sequence holds one token more than the manager (the newest sample)."""
    kv = KVCacheManager(num_blocks=64, block_size=block_size, enable_prefix_caching=True)
    log = kv.record()
    reqs = []
    for i, (n_prompt, n_forks) in enumerate([(3, 0), (4, 0), (8, 2), (5, 1), (1, 0), (7, 0)]):
        prompt = [(7 * i + j) % 250 + 1 for j in range(n_prompt)]
        req = Request(f"r{i}", None, prompt, SamplingParams(n=n_forks + 1), RequestMetrics(0.0), i)
        first = req.new_sequence(list(prompt))
        kv.add_sequence(first.seq_id, prompt)
        req.seqs = [first]
        for _ in range(n_forks):
            child = req.new_sequence(list(prompt))
            kv.fork(first.seq_id, child.seq_id)
            req.seqs.append(child)
        for k, seq in enumerate(req.seqs):
            seq.token_ids.append(200 + k)  # sampled last step, no KV yet
        reqs.append(req)
    reqs[5].kv_dropped = {reqs[5].seqs[0].seq_id: 9}  # re-admitted: its next token is recomputed
    return kv, log, reqs


def _plan(out: SchedulerOutput) -> list[tuple]:
    return [
        (s.request.request_id, s.seq.seq_id, s.start_pos, s.new_tokens, s.slots, s.block_tables,
         s.is_prefill, s.samples)
        for s in out.scheduled
    ]  # fmt: skip


@pytest.mark.parametrize("given_starts", [False, True])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_add_decodes_plans_what_add_next_tokens_plans(block_size, given_starts):
    kv1, log1, reqs1 = _decoding_state(block_size)
    kv2, log2, reqs2 = _decoding_state(block_size)
    plain, fast = SchedulerOutput(), SchedulerOutput()
    for _ in range(3):  # three steps: boundaries move, copies happen once
        for req in reqs1:
            plain.add_next_tokens(kv1, req)
        starts = [kv2.num_tokens(s.seq_id) for r in reqs2 for s in r.seqs] if given_starts else None
        fast.add_decodes(kv2, reqs2, starts)
        for reqs in (reqs1, reqs2):
            for req in reqs:
                for seq in req.seqs:
                    seq.token_ids.append(99)
    assert _plan(fast) == _plan(plain)
    assert [r.request_id for r in fast.touched] == [r.request_id for r in plain.touched]
    assert fast.recomputed_tokens == plain.recomputed_tokens == 2  # positions 7 and 8 < 9
    assert reqs2[5].kv_dropped == reqs1[5].kv_dropped == {}
    copies = kv1.pop_copies()
    assert kv2.pop_copies() == copies and (copies != []) == (block_size > 1)  # copy-on-write
    assert kv2.stats() == kv1.stats()
    for seq_id in kv1.sequences():
        assert kv2.block_tables(seq_id) == kv1.block_tables(seq_id)
        assert kv2.token_ids(seq_id) == kv1.token_ids(seq_id)
    assert [e.to_dict() for e in log2.events] == [e.to_dict() for e in log1.events]


# --- whole runs, fast paths on and off ------------------------------------------------------------
def _workload(kind: str) -> list[tuple[str, list[int], object]]:
    long = SYSTEM + list(b"Tell me about paged attention, in detail, please.")
    greedy = SamplingParams(max_tokens=14, ignore_eos=True)
    if kind == "greedy":
        return [(f"g{i}", p, greedy) for i, p in enumerate([*PROMPTS, long])]
    if kind == "mixed":
        return [
            ("g", PROMPTS[0], SamplingParams(max_tokens=10)),  # EOS may end it
            ("n3", PROMPTS[1], SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=9)),
            ("n2g", PROMPTS[3], SamplingParams(n=2, max_tokens=8, ignore_eos=True)),
            ("beam", PROMPTS[2], BeamSearchParams(beam_width=3, max_tokens=6)),
            ("stop", long, SamplingParams(max_tokens=20, stop=["e", "zz"], ignore_eos=True)),
            ("ids", SYSTEM, SamplingParams(max_tokens=12, stop_token_ids=[101, 32])),
            ("topk", PROMPTS[0], SamplingParams(max_tokens=7, temperature=1.0, top_k=5, seed=3)),
            ("seeded-greedy", PROMPTS[1], SamplingParams(max_tokens=5, seed=4)),
        ]
    raise ValueError(kind)


def _serve(fast: bool, workload, name="tiny-gpt2", faults=None, final_only=False, **llm_kw):
    """Serve ``workload`` step by step; returns everything a run leaves that is not a clock."""
    llm = make_llm(name, **llm_kw)
    engine = llm.engine
    engine.fast_decodes = engine.scheduler.fast_decodes = fast
    log = engine.record()
    stats = []
    engine.subscribe_stats(stats.append)
    if faults:
        faults(engine)
    for rid, prompt, params in workload:
        engine.add_request(rid, list(prompt), params, final_only=final_only)
    steps = []
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        try:
            got = engine.step()
        except RuntimeError as e:
            steps.append(("raised", str(e), engine.last_recovery))
            continue
        steps.append(
            [
                (o.request_id, o.finished, o.error, o.num_cached_tokens,
                 [(c.index, c.token_ids, c.cumulative_logprob, c.finish_reason, c.text)
                  for c in o.outputs])
                for o in got
            ]
        )  # fmt: skip
    else:
        pytest.fail("the run did not finish")
    events = []
    for e in log.events:
        info = dict(e.info)
        if e.kind == "step":
            info["stats"] = {k: v for k, v in info["stats"].items() if k not in TIMES}
        events.append((e.kind, e.blocks, e.seqs, info))
    m = engine.metrics
    counts = {
        name: (d.count, d.counts)
        for name, d in vars(m).items()
        if hasattr(d, "counts") and name not in ("ttft", "itl", "e2e", "queue_time")
    }
    counts["timed"] = [(d.count) for d in (m.ttft, m.itl, m.e2e, m.queue_time)]
    counts["reasons"] = dict(m.finished_by_reason)
    table = [{k: v for k, v in s.as_dict().items() if k not in TIMES} for s in stats]
    return steps, events, table, counts


def _count_fast_calls(monkeypatch):
    calls = {"add_decodes": 0, "decode_greedy": 0, "room": 0}
    add_decodes, decode_greedy = SchedulerOutput.add_decodes, llm_engine.decode_greedy
    room_for_all = Scheduler._room_for_all

    def counted_room_for_all(self, *a):
        room = room_for_all(self, *a)
        calls["room"] += room
        return room

    monkeypatch.setattr(Scheduler, "_room_for_all", counted_room_for_all)

    def counted_add_decodes(self, *a):
        calls["add_decodes"] += 1
        return add_decodes(self, *a)

    def counted_decode_greedy(*a):
        calls["decode_greedy"] += 1
        return decode_greedy(*a)

    monkeypatch.setattr(SchedulerOutput, "add_decodes", counted_add_decodes)
    monkeypatch.setattr(llm_engine, "decode_greedy", counted_decode_greedy)
    return calls


RUNS = {
    "greedy": ("greedy", "tiny-gpt2", {}),
    "final-only": ("mixed", "tiny-gpt2", {"final_only": True}),  # as LLM.generate asks
    "mixed": ("mixed", "tiny-gpt2", {}),
    "opt": ("mixed", "tiny-opt", {}),
    "chunked": ("greedy", "tiny-gpt2", {"max_num_batched_tokens": 16, "max_num_seqs": 4}),
    "chunked-tight": (
        "mixed",
        "tiny-gpt2",
        {"max_num_batched_tokens": 16, "max_num_seqs": 8, "num_blocks": 32},
    ),
    "recompute": ("mixed", "tiny-gpt2", {"num_blocks": 24}),
    "swap": ("mixed", "tiny-gpt2", {"num_blocks": 24, "preemption_mode": "swap"}),
    "no-cache": ("greedy", "tiny-gpt2", {"enable_prefix_caching": False, "block_size": 2}),
    "max-reservation": ("greedy", "tiny-gpt2", {"kv_reservation": "max", "num_blocks": 40}),
    "hybrid-gemma3": ("greedy", "tiny-gemma3", {"num_blocks": 96}),
    "hybrid-mistral": ("mixed", "tiny-mistral", {"num_blocks": 96}),
}


@pytest.mark.parametrize("run", RUNS)
def test_a_run_is_the_same_with_and_without_the_fast_paths(run, monkeypatch):
    kind, name, kw = RUNS[run]
    plain = _serve(False, _workload(kind), name, **kw)
    calls = _count_fast_calls(monkeypatch)
    fast = _serve(True, _workload(kind), name, **kw)
    assert calls["add_decodes"] > 0 and calls["decode_greedy"] > 0  # the fast paths ran
    if run.startswith("chunked"):  # a step with a prompt in progress skipped blocks_to_append
        assert calls["room"] > 0
    for what, a, b in zip(("outputs", "trace", "stats", "metrics"), fast, plain, strict=True):
        assert a == b, what


@pytest.mark.parametrize("fast", [False, True])
def test_final_only_leaves_out_the_outputs_of_requests_still_running(fast):
    """``add_request(..., final_only=True)`` (what LLM.generate asks for) changes only which
    outputs ``step()`` returns: the finished ones, the same; everything else is the same."""
    every = _serve(fast, _workload("mixed"), num_blocks=24)
    final = _serve(fast, _workload("mixed"), num_blocks=24, final_only=True)
    assert final[0] == [[o for o in step if o[1]] for step in every[0]]
    assert final[1:] == every[1:]


def test_preemptions_happened_in_the_tight_runs():
    """(So that the recompute and swap runs above compare the paths around a preemption.)"""
    for run in ("recompute", "swap", "chunked-tight"):
        kind, name, kw = RUNS[run]
        table = _serve(True, _workload(kind), name, **kw)[2]
        mode = kw.get("preemption_mode", "recompute")
        assert table[-1][f"preemptions_{mode}"] > 0, run


class Injected(RuntimeError):
    pass


def _fault_at(owner: str, name: str, calls: set[int]):
    """Make ``engine.<owner>.<name>`` raise :class:`Injected` on its call numbers ``calls``,
    at most once per step (so never inside the recovery of a fault)."""

    def install(engine):
        obj = engine if owner == "engine" else getattr(engine, owner)
        real, real_step, seen, fired = getattr(obj, name), engine.step, [0], [False]

        def call(*args, **kw):
            seen[0] += 1
            if seen[0] in calls and not fired[0]:
                fired[0] = True
                raise Injected(f"{name} call {seen[0]}")
            return real(*args, **kw)

        def step():
            fired[0] = False
            return real_step()

        setattr(obj, name, call)
        engine.step = step

    return install


@pytest.mark.parametrize(
    "owner, name, calls",
    [
        ("engine", "_stop_reason", {3, 40, 41, 90}),  # while sampling: the snapshot restores it
        ("kv", "free_sequence", {1, 5}),  # a finishing request's free
        ("kv", "append_token", {10, 70}),  # while planning the decodes
        ("runner", "execute", {6}),
    ],
)
def test_faults_are_recovered_the_same_with_and_without_the_fast_paths(owner, name, calls):
    fault = _fault_at(owner, name, calls)
    plain = _serve(False, _workload("mixed"), faults=fault)
    fast = _serve(True, _workload("mixed"), faults=fault)
    assert any(step[0] == "raised" for step in plain[0])
    for what, a, b in zip(("outputs", "trace", "stats", "metrics"), fast, plain, strict=True):
        assert a == b, what


def test_decode_greedy_snapshots_what_snapshot_of_would(monkeypatch):
    begin_one, checked = StepJournal.begin_one, []

    def checking_begin_one(self, req):
        begin_one(self, req)
        assert self.current[0] is req and self.snapshot() == Snapshot.of(req)
        checked.append(req.request_id)

    monkeypatch.setattr(StepJournal, "begin_one", checking_begin_one)
    _serve(True, _workload("mixed"))
    assert checked


def test_the_event_log_of_a_fast_run_replays():
    llm = make_llm()
    log = llm.engine.record()
    llm.generate(PROMPTS, SamplingParams(max_tokens=9, ignore_eos=True), use_tqdm=False)
    replay = EventLog.from_json(log.to_json()).replay()
    assert replay.refcounts == [0] * llm.engine.kv.allocator.num_blocks
