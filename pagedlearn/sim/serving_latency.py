"""Figure 12: normalized latency against request rate, measured on the real engine.

The paper's headline (Kwon et al., SOSP 2023, sections 6.1-6.2, Figure 12): requests arrive as a
Poisson process, and each system's **normalized latency** -- the mean over requests of
(end-to-end latency / output length), in seconds per output token, as in Orca -- is plotted
against the request rate. It rises slowly, then explodes: past the server's capacity the queue
keeps growing. On ShareGPT, vLLM sustains 1.7x-2.7x the request rate of Orca (Oracle) and 2.7x-8x
that of Orca (Max) at similar latency (the abstract's 2-4x throughput "with the same level of
latency", against FasterTransformer and Orca).

What we run: ShareGPT-like requests (``pagedlearn.sim.workloads``, lengths scaled from 2048 tokens
to the server's limit ``max_len``; random token-id prompts) into ``LLM(kv_reservation="paged")``
and the same engine with ``kv_reservation="max"`` (Orca (Max)-style: a request is admitted only
when the blocks of ``prompt + max_tokens`` can be set aside; blocks, not a contiguous run: an
optimistic Orca (Max)), on one KV budget of ``reservations`` max-length sequences.
``max_tokens = max_len - prompt`` (the server cannot know the output length); each request stops
at its sampled length, an emulated EOS (aborted after the step that produced its last token).

**The clock** is simulated, driven by measured step durations. A request joins the engine when
the clock passes its arrival time; each ``engine.step()`` advances the clock by the time it took
-- on a CPU the CPU time of the engine's thread (``time.thread_time``, torch on one thread), so
that other processes on a shared machine do not stretch it; on a GPU the wall time (sampling
copies the logits to the CPU, which waits for the GPU). When nothing runs, the clock jumps to the
next arrival. Nothing sleeps: a sweep costs only its steps. ``step_seconds`` replaces the
measurement by a fixed cost per step (a model: for tests, or "what if a step cost the same at
any batch").

**The sweep.** Rates are fractions of the paged engine's saturated throughput (``num_requests``
arriving at once, measured first), so that the sweep brackets both knees on any machine. Each
run is a trace of fixed duration (the paper's are an hour long): the time ``num_requests`` take to
arrive at the saturated rate, so a run at fraction ``f`` serves about ``f x num_requests`` of the
same requests (a unit-rate Poisson process, seeded, with arrival times divided by the rate). A
system's sweep stops ``STOP_AFTER`` points past the target: higher rates only queue longer.

**The sustainable rate** (our rule; the paper states none): where a system's curve first passes
``KNEE`` x the unloaded latency (the lower of the two systems' latencies at the lowest rate; one
target for both: "at similar latency"), interpolated linearly between the two sweep points around
the crossing. The ratio paged / max is the number to put beside the paper's.

A CPU shows the mechanism (paging runs more requests together on one budget, so its queue
explodes at a higher rate), not absolute numbers: a 2-layer random model's requests per second
say nothing of OPT-13B on an A100. Its step is mostly Python (scheduling, block tables, packing
inputs); how much it grows with the batch (``step_ms``) decides how much of paging's extra
concurrency becomes rate. Timings are noisy on a shared machine: rerun and compare. The paper's
Orca baselines also lose memory to external fragmentation (buddy allocation); ours does not.
"""

from __future__ import annotations

import itertools
import random
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from pagedlearn.engine.llm import LLM
from pagedlearn.engine.sampling_params import SamplingParams
from pagedlearn.models import GPT2_SIZE_RANDOM, load
from pagedlearn.sim.workloads import MAX_CONTEXT, paper_workload

SYSTEMS = ("paged", "max")  # LLM(kv_reservation=...): vLLM's paging, Orca (Max)-style reservation
KNEE = 3.0  # latency "explodes" past this multiple of the unloaded latency
STOP_AFTER = 2  # sweep points above the target a system runs before its sweep stops
BLOCK_SIZE = 16
# Rates, as fractions of the paged engine's saturated throughput (measured first).
QUICK_FRACTIONS = (0.15, 0.3, 0.45, 0.6, 0.8, 1.0, 1.3, 1.7, 2.2)
FULL_FRACTIONS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.15, 1.3, 1.5, 1.75, 2.0, 2.5)
PAPER_FIG12 = (
    "Paper (section 6.2, Figure 12, OPT-13B/66B/175B on A100s, ShareGPT): at similar latency, "
    "vLLM sustains 1.7x-2.7x the request rate of Orca (Oracle) and 2.7x-8x that of Orca (Max)."
)


@dataclass
class Run:
    """One system at one rate: per request, times on the clock; running requests per step."""

    system: str
    rate: float | None  # requests per second; None = all at time 0 (saturated)
    arrival: list[float]
    finish: list[float]
    output_len: list[int]
    running: list[int]
    preemptions: int
    busy_time: float  # clock time spent in steps (the rest is idle, waiting for arrivals)

    @property
    def steps(self) -> int:
        return len(self.running)

    @property
    def normalized_latency(self) -> float:
        return normalized_latency(self.arrival, self.finish, self.output_len)


def normalized_latency(arrival, finish, output_len) -> float:
    """The paper's metric (section 6.1): mean over requests of (finish - arrival) / output
    length, in seconds per output token."""
    per_request = [(f - a) / n for a, f, n in zip(arrival, finish, output_len, strict=True)]
    return statistics.mean(per_request)


def sustainable_rate(rates, latencies, target: float) -> float | None:
    """The rate where the latency curve first rises above ``target``, interpolated linearly
    between the last sweep point under it and the first above; None if the first point is
    already above it; ``rates[-1]`` (a lower bound) if it never gets there."""
    points = list(zip(rates, latencies, strict=True))
    if points[0][1] > target:
        return None
    for (r0, l0), (r1, l1) in itertools.pairwise(points):
        if l1 > target:
            return r0 + (r1 - r0) * (target - l0) / (l1 - l0)
    return points[-1][0]


def make_stream(num_requests: int, max_len: int, seed: int = 0, vocab: int = 256):
    """``num_requests`` ShareGPT-like requests: (arrival at rate 1, prompt ids, output length).

    Lengths scaled by ``max_len / 2048`` and clipped so that prompt + output <= ``max_len``.
    Arrivals are a unit-rate Poisson process (seeded); :func:`serve` divides them by the rate,
    which gives a Poisson process at that rate over the very same requests.
    """
    scale, rng = max_len / MAX_CONTEXT, random.Random(seed)
    stream = []
    for r in paper_workload("sharegpt", num_requests, rate=1.0, seed=seed):
        prompt = min(max(1, round(r.prompt_len * scale)), max_len - 1)
        output = min(max(1, round(r.output_len * scale)), max_len - prompt)
        stream.append((r.arrival, [rng.randrange(vocab) for _ in range(prompt)], output))
    return stream


def serve(llm: LLM, stream, rate: float | None, max_len: int, step_seconds=None) -> Run:
    """Feed ``stream`` to ``llm``'s engine at ``rate`` on the simulated clock (module docstring).
    ``rate=None``: everything arrives at time 0."""
    engine, q = llm.engine, llm.engine.scheduler
    timer = time.thread_time if llm.device.type == "cpu" else time.perf_counter
    arrival = [0.0 if rate is None else a / rate for a, _, _ in stream]
    finish = [float("nan")] * len(stream)
    target = {str(i): n for i, (_, _, n) in enumerate(stream)}
    preempted = sum(q.num_preemptions.values())
    with _one_torch_thread(llm.device):
        now, nxt, running, busy = 0.0, 0, [], 0.0
        while nxt < len(stream) or engine.has_unfinished_requests():
            if not engine.has_unfinished_requests():
                now = max(now, arrival[nxt])  # idle: jump to the next arrival
            while nxt < len(stream) and arrival[nxt] <= now:
                prompt = stream[nxt][1]
                params = SamplingParams(max_tokens=max_len - len(prompt), ignore_eos=True)
                engine.add_request(nxt, prompt, params)
                nxt += 1
            t0 = timer()
            outs = engine.step()
            done = []
            for out in outs:
                if not out.finished and len(out.outputs[0].token_ids) >= target[out.request_id]:
                    out = engine.abort_request(out.request_id)  # the emulated EOS: blocks freed
                if out.finished:
                    done.append(int(out.request_id))
            took = timer() - t0 if step_seconds is None else step_seconds
            now, busy = now + took, busy + took
            for i in done:
                finish[i] = now
            running.append(len(q.running))
    preemptions = sum(q.num_preemptions.values()) - preempted
    lengths = [n for _, _, n in stream]
    return Run(q.kv_reservation, rate, arrival, finish, lengths, running, preemptions, busy)


@contextmanager
def _one_torch_thread(device: torch.device):
    """On a CPU, torch on one thread while we time: a step's thread CPU time is then all of its
    work (the tiny model's ops are too small to gain from more threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1 if device.type == "cpu" else before)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _row(run: Run) -> dict:
    busy = [n for n in run.running if n]  # steps with someone running
    return {
        "system": run.system,
        "rate": run.rate,
        "normalized_latency": run.normalized_latency,
        "mean_running": statistics.mean(busy) if busy else 0.0,
        "step_ms": 1e3 * run.busy_time / run.steps,
        "peak_running": max(run.running),
        "preemptions": run.preemptions,
        "finished": sum(f == f for f in run.finish),  # NaN != NaN: not finished
    }


def measure(
    model="tiny-gpt2",
    num_requests: int = 80,
    max_len: int = 128,
    fractions=QUICK_FRACTIONS,
    reservations: int = 4,
    seed: int = 0,
    device: str = "cpu",
    step_seconds: float | None = None,
    progress=None,
) -> tuple[list[dict], dict]:
    """Sweep the rate for both systems on one KV budget; returns (rows, summary).

    ``num_requests``: the saturated calibration's requests, and each trace's length (module
    docstring); ``fractions``: the rates, ascending, as fractions of the saturated rate. Rows: one
    per (system, rate) with ``normalized_latency`` (s/token), ``mean_running`` (running requests
    after each step, mean over the steps where any ran), ``step_ms`` (mean step on the clock),
    ``peak_running``, ``preemptions``, ``finished``. Summary: the budget in token slots, the
    saturated rate (req/s), the target latency (s/token), each system's sustainable rate, their
    ratio (None where undefined), and whether each system's latency passed the target at all
    (if not, its sustainable rate is only a lower bound: the highest rate swept).
    ``progress``: called as ``progress(requests served, requests in all)`` after the warm-up (0
    served), then after each run (the calibration's, then each sweep point's; "in all" shrinks
    when a sweep stops early).
    """
    if not fractions or list(fractions) != sorted(fractions) or fractions[0] <= 0:
        raise ValueError(f"fractions must be positive and ascending, got {fractions!r}")
    if num_requests < 1 or reservations < 1:
        raise ValueError("num_requests and reservations must be at least 1")
    loaded = load(model)
    budget_blocks = reservations * -(-max_len // BLOCK_SIZE)
    vocab = min(256, loaded.model.config.vocab_size)
    longest = max(fractions) * num_requests  # unit-rate arrival time of the last one we need
    stream = make_stream(max(int(1.5 * longest) + 20, num_requests), max_len, seed, vocab)

    def engine(system):  # one model, one fresh engine per run: nothing carries over
        return LLM(loaded, block_size=BLOCK_SIZE, num_blocks=budget_blocks, device=device,
                   enable_prefix_caching=False, max_num_seqs=len(stream) + 1,
                   kv_reservation=system, verbose=False)  # fmt: skip

    def cut(fraction):  # the requests that arrive within the trace's duration
        return [s for s in stream if s[0] <= fraction * num_requests]

    def run(system, fraction):
        requests = cut(fraction)
        result = serve(engine(system), requests, fraction * capacity, max_len, step_seconds)
        served[0] += len(requests)
        tick(*served)
        return result

    tick = progress or (lambda done, total: None)
    served = [0, num_requests + len(SYSTEMS) * sum(len(cut(f)) for f in fractions)]  # done, all
    runs = []
    with _one_torch_thread(torch.device(device)):
        warm = engine("paged")  # first steps pay for torch's lazy set-up: not measured
        warm.generate([stream[0][1]] * 2, SamplingParams(max_tokens=8), use_tqdm=False)
        tick(*served)
        saturated = serve(engine("paged"), stream[:num_requests], None, max_len, step_seconds)
        capacity = num_requests / max(saturated.finish)
        served[0] = num_requests
        tick(*served)
        for system in SYSTEMS:  # the lowest rate of both first: it sets the target latency
            runs.append(run(system, fractions[0]))
        target = KNEE * min(r.normalized_latency for r in runs)
        for system in SYSTEMS:
            above = 0
            for i, fraction in enumerate(fractions[1:], 1):
                if above == STOP_AFTER:  # exploded: higher rates only queue longer
                    served[1] -= sum(len(cut(f)) for f in fractions[i:])
                    tick(*served)
                    break
                runs.append(run(system, fraction))
                above += runs[-1].normalized_latency > target
    rows = [_row(run) for run in sorted(runs, key=lambda r: (SYSTEMS.index(r.system), r.rate))]
    knee, exploded = {}, {}
    for system in SYSTEMS:
        mine = [r for r in rows if r["system"] == system]
        lat = [r["normalized_latency"] for r in mine]
        knee[system] = sustainable_rate([r["rate"] for r in mine], lat, target)
        exploded[system] = max(lat) > target  # else its rate is only a lower bound
    ratio = knee["paged"] / knee["max"] if knee["paged"] and knee["max"] else None
    summary = {
        "model": loaded.name,
        "max_len": max_len,
        "budget_tokens": budget_blocks * BLOCK_SIZE,
        "duration": num_requests / capacity,  # of each trace, on the clock
        "saturated_rate": capacity,
        "knee": KNEE,
        "target_latency": target,
        "sustainable_paged": knee["paged"],
        "sustainable_max": knee["max"],
        "ratio": ratio,
        "exploded": exploded,
        "clock": "fixed" if step_seconds else ("thread CPU time" if device == "cpu" else "wall"),
    }
    return rows, summary


def describe(summary) -> str:
    """One line: what was measured (for a table's heading)."""
    return (f"{summary['model']}, context {summary['max_len']}, KV budget "
            f"{summary['budget_tokens']} slots, Poisson arrivals, traces of "
            f"{1e3 * summary['duration']:.0f} ms, clock: {summary['clock']}")  # fmt: skip


def display_rows(rows) -> list[dict]:
    """The rows in readable units: requests/s, ms per output token, ms per step."""
    return [{"system": r["system"], "req_per_s": r["rate"],
             "ms_per_token": 1e3 * r["normalized_latency"], "running": r["mean_running"],
             "step_ms": r["step_ms"], "preempted": r["preemptions"], "finished": r["finished"]}
            for r in rows]  # fmt: skip


def verdict(summary) -> str:
    """The sustainable rates and their ratio, with the rule that gave them."""
    rate = {}
    for system in SYSTEMS:
        value, lower = summary[f"sustainable_{system}"], not summary["exploded"][system]
        rate[system] = "n/a" if value is None else f"{'>= ' if lower else ''}{value:.0f} req/s"
    ratio = "n/a" if summary["ratio"] is None else f"{summary['ratio']:.2f}x"
    return (f"sustainable rate (where latency first passes {KNEE:g} x the unloaded latency = "
            f"{1e3 * summary['target_latency']:.2f} ms/token): paged {rate['paged']}, max "
            f"{rate['max']}; paged / max = {ratio}")  # fmt: skip


def figure12(quick: bool = False, device: str = "cpu", progress=None) -> tuple[list[dict], dict]:
    """Figure 12 on this machine: context 128, a KV budget of 4 max-length sequences. Quick:
    ``tiny-gpt2``, traces of 80 requests at the saturated rate, 9 rates (a few seconds on a
    CPU). Full: traces of 300, 16 rates (``tiny-gpt2`` on a CPU, about half a minute; on a GPU,
    ``gpt2-size-random``, GPT-2 small's size). ``progress``: as :func:`measure`'s."""
    if quick:
        return measure("tiny-gpt2", 80, 128, QUICK_FRACTIONS, device=device, progress=progress)
    model = GPT2_SIZE_RANDOM if device != "cpu" else "tiny-gpt2"
    return measure(model, 300, 128, FULL_FRACTIONS, device=device, progress=progress)
