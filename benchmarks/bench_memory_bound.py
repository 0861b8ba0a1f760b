"""Completed requests per second at one fixed KV memory budget: paging vs max-length reservation.

The paper's end-to-end claim (Kwon et al., abstract and section 6.2, Figure 12): 2-4x the
throughput of FasterTransformer and Orca "with the same level of latency", i.e. 2-4x the request
rate each system sustains before its latency explodes. Its cause is that paging fits more requests
in the batch on the same memory. This script measures that cause, not Figure 12 (for which see
``python -m pagedlearn paper``): completed requests per second on a saturated server, at one KV
budget in bytes, one stream of requests, three systems:

1. **paged engine**: ``LLM(..., kv_reservation="paged")``, a block taken when a token needs it;
2. **reservation engine**: ``LLM(..., kv_reservation="max")``, the same engine admitting a request
   only when the blocks of ``prompt + max_tokens`` can be set aside for it (Orca (Max)). It
   reserves blocks, not one contiguous run: no external fragmentation, an optimistic upper bound;
3. **generate() in reserved batches**: transformers ``model.generate()`` on left-padded batches
   that *this script* forms with its own reservation rule (transformers has none): first come
   first served, as many rows as fit the budget when each row reserves ``min(longest prompt +
   largest max_tokens, L)`` slots, each batch run until its last request stops (static batching).

The stream: ``--requests`` ShareGPT-like requests (``pagedlearn.sim.workloads``: the paper's means,
log-normal), lengths scaled from the paper's 2048-token context to the server's limit ``L``;
random token-id prompts (seeded); all arrive at once (a saturated server, as in the paper's
Figure 2). ``max_tokens = L - prompt``: what a server allows when it cannot know the output length,
and what Orca (Max) reserves. Each request stops at its sampled output length, an emulated EOS
(the random models' EOS is ignored): the engines abort it after the step that produced its last
token (its blocks go back at once, as at a real EOS); transformers runs each batch to its longest
output and we keep each row's first tokens. Prefix caching is off in both engines (transformers
has none; the prompts share nothing). ``--max-model-len`` lowers ``L`` below the model's positions
(vLLM's option of that name): shorter runs, the same memory pressure.

Reported per system: completed requests and returned tokens per wall second, peak and mean
running requests, KV utilisation (slots holding a running request's K/V over the budget, and over
the slots allocated), and the same tokens/s over only the steps when requests were queued for
memory (the drain at the end of a finite stream is not what the paper measures). It prints what
it measures and asserts nothing.

Timings on a small shared CPU swing with what else runs, so, as ``bench_engine.py`` does: the
three systems take turns ``--repeats`` times (interleaved, so that a burst of load hits them
alike), the table gives each rate's median and its min-max, the paged / other ratios are taken
per repeat (one repeat's runs are neighbours in time) and reported as median and min-max, and the
load average is printed before, after each repeat and at the end. Everything but the times
(requests done, running requests, KV utilisation, steps, preemptions, the tokens) follows from the
stream and the budget in tokens alone, whatever the model computes: it is the same in every
repeat, and the script says if it is not.
torch runs on ``--threads`` threads (default 1): the models are small, and with two threads per
process a second busy process makes each op wait for a core, which slowed one run 10x.

Usage: python benchmarks/bench_memory_bound.py [--model tiny-gpt2|gpt2-size-random|gpt2]
       [--budget-mib MiB] [--requests 48] [--repeats 3] [--max-model-len L] [--seed 0]
       [--threads 1] [--device auto|cpu|cuda] [--quick]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch
from bench_engine import hf_padded, machine_line  # this script's neighbour

from pagedlearn import LLM, SamplingParams
from pagedlearn.models import GPT2_SIZE_RANDOM, load
from pagedlearn.models.runner import kv_cache_spec, max_model_len
from pagedlearn.sim.workloads import MAX_CONTEXT, paper_workload

PAGED, RESERVED, PADDED = "paged engine", "reservation engine", "generate() in reserved batches"
BLOCK_SIZE = 16
DEFAULT_RESERVATIONS = 4  # default budget: room for this many max-length (L-token) sequences
MIN_SATURATED = 0.5  # a saturated rate over less of a run than this is flagged
PAPER_CLAIM = "2-4x (paper: vs Orca / FasterTransformer at the same latency, A100 GPUs)"


def make_stream(n: int, max_len: int, seed: int) -> list[tuple[int, int, int]]:
    """``n`` (prompt length, output length, max_tokens): ShareGPT-like, scaled to ``max_len``."""
    scale = max_len / MAX_CONTEXT
    stream = []
    for r in paper_workload("sharegpt", n, seed=seed):
        prompt = min(max(1, round(r.prompt_len * scale)), max_len - 1)
        output = min(max(1, round(r.output_len * scale)), max_len - prompt)
        stream.append((prompt, output, max_len - prompt))
    return stream


def make_prompts(stream, config, seed: int) -> list[list[int]]:
    """Random token ids (no special token), one prompt per request of ``stream``."""
    special = {config.bos_token_id, config.eos_token_id, config.pad_token_id}
    ids, rng = [t for t in range(config.vocab_size) if t not in special], random.Random(seed)
    return [[rng.choice(ids) for _ in range(p)] for p, _, _ in stream]


def engines(loaded, num_blocks: int, num_requests: int, device) -> dict[str, LLM]:
    """The paged and the reservation engine on pools of ``num_blocks``, warmed up."""
    out = {}
    for name, mode in ((PAGED, "paged"), (RESERVED, "max")):
        model = load(loaded.name) if out else loaded  # LLM() takes over its model
        llm = LLM(model, block_size=BLOCK_SIZE, num_blocks=num_blocks, device=device,
                  enable_prefix_caching=False, max_num_seqs=max(num_requests, 2),
                  kv_reservation=mode, verbose=False)  # fmt: skip
        llm.generate([[1] * 8] * 2, SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        out[name] = llm
    return out


def run_engine(name: str, llm: LLM, prompts, stream) -> dict:
    """All requests at once through the step API; the pool measured after every step. The same
    ``llm`` serves every repeat: its request ids are free again once a run has finished."""
    engine = llm.engine
    q, kv, slot_count = engine.scheduler, engine.kv, engine.kv.allocator.num_blocks * BLOCK_SIZE
    steps, samples, outputs, target, busy, reserved = [], [], {}, {}, [0, 0.0], []
    unsubscribe = engine.subscribe_stats(steps.append)  # each step's forward time and tokens
    preempted = sum(q.num_preemptions.values())
    t0 = time.perf_counter()
    for i, (prompt, (_, out_len, max_tokens)) in enumerate(zip(prompts, stream, strict=True)):
        engine.add_request(i, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        target[str(i)] = out_len
    while engine.has_unfinished_requests():
        waiting, t1 = bool(q.waiting), time.perf_counter()
        outs = engine.step()  # one output per request that got a token
        for out in outs:
            rid = out.request_id
            if not out.finished and len(out.outputs[0].token_ids) >= target[rid]:
                out = engine.abort_request(rid)  # the emulated EOS: blocks freed now
            if out.finished and not out.error:
                outputs[int(rid)] = out.outputs[0].token_ids
        # After the step and its EOS: who runs, and which slots hold their K/V.
        live = sum(kv.num_tokens(s.seq_id) for r in q.running for s in r.seqs)
        used = kv.allocator.num_blocks - kv.num_free_blocks
        samples.append((len(q.running), live, used * BLOCK_SIZE))
        reserved.append(
            sum(q.reserved_blocks(len(r.prompt_token_ids), r.params) for r in q.running)
        )
        if waiting:  # a saturated step: requests were queued for memory when it began
            busy[0] += len(outs)
            busy[1] += time.perf_counter() - t1
    wall = time.perf_counter() - t0
    unsubscribe()
    return summarise(
        name, outputs, stream, wall, samples, slot_count, busy,
        preempted=sum(q.num_preemptions.values()) - preempted,
        step_ms=1e3 * statistics.mean(s.step_time for s in steps),
        batch_tokens=statistics.mean(s.num_batched_tokens for s in steps),
        reserved=100 * statistics.mean(reserved) * BLOCK_SIZE / slot_count,
    )  # fmt: skip


def padded_batches(stream, slot_count: int, max_len: int) -> list[list[int]]:
    """First come, first served batches whose padded slots fit the budget:
    ``len(batch) x min(longest prompt + largest max_tokens, L) <= slot_count``."""
    batches, batch = [], []
    for i in range(len(stream)):
        trial = [*batch, i]
        width = max(stream[j][0] for j in trial) + max(stream[j][2] for j in trial)
        if batch and len(trial) * min(width, max_len) > slot_count:
            batches.append(batch)
            trial = [i]
        batch = trial
    return [*batches, batch]


def run_padded(model, prompts, stream, slot_count, max_len, pad_id, device) -> dict:
    """transformers generate() on this script's reserved batches (:func:`padded_batches`),
    batch after batch, each to its longest sampled output."""
    outputs, samples, busy = {}, [], [0, 0.0]
    t0 = time.perf_counter()
    batches = padded_batches(stream, slot_count, max_len)
    for k, batch in enumerate(batches):
        t1 = time.perf_counter()
        lens = [stream[j][:2] for j in batch]  # (prompt, output)
        longest = max(o for _, o in lens)
        rows = hf_padded(model, [prompts[j] for j in batch], longest, pad_id, device)
        for j, row, (_, o) in zip(batch, rows, lens, strict=True):
            outputs[j] = row[:o]
        if k < len(batches) - 1:  # saturated: later batches wait for this one's memory
            busy[0] += sum(o for _, o in lens)
            busy[1] += time.perf_counter() - t1
        width = max(p for p, _ in lens)
        for t in range(1, longest + 1):  # after decode step t: t tokens out, p + t - 1 cached
            live = [p + t - 1 for p, o in lens if t < o]
            samples.append((len(live), sum(live), len(batch) * (width + t - 1)))
    wall = time.perf_counter() - t0
    return summarise(PADDED, outputs, stream, wall, samples, slot_count, busy)


def summarise(name, outputs, stream, wall, samples, slot_count, busy, **extra) -> dict:
    running, live, allocated = zip(*samples, strict=True)
    return {
        "name": name,
        "done": sum(len(outputs.get(i, ())) == o for i, (_, o, _) in enumerate(stream)),
        "wall": wall,
        "tokens": sum(map(len, outputs.values())),
        "peak": max(running),
        "mean": statistics.mean(running),
        "util": 100 * statistics.mean(live) / slot_count,
        "util_alloc": 100 * sum(live) / max(sum(allocated), 1),
        "steps": len(samples),
        "busy": busy,  # [tokens, seconds] while requests waited for memory
        "outputs": outputs,
        **extra,
    }


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    arg = parser.add_argument
    arg("--model", default="tiny-gpt2", choices=["tiny-gpt2", GPT2_SIZE_RANDOM, "gpt2"])
    arg("--budget-mib", type=float, help=f"KV budget (default: {DEFAULT_RESERVATIONS} x L tokens)")
    arg("--requests", type=int, default=48)
    arg("--repeats", type=int, default=3, help="timed runs per system, taking turns (median)")
    arg("--max-model-len", type=int, help="the server's context limit L (default: the model's)")
    arg("--seed", type=int, default=0)
    arg("--threads", type=int, default=1, help="torch threads on a CPU (see the docstring)")
    arg("--device", default="auto", choices=["auto", "cpu", "cuda"])
    arg("--quick", action="store_true", help="16 requests, 1 repeat (a smoke test for CI)")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.repeats = 16, 1
    for name in ("requests", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(args.threads)
    print(f"{machine_line()}; device {device}")
    loaded = load(args.model)
    config, positions = loaded.model.config, max_model_len(loaded.model)
    max_len = args.max_model_len or positions
    if not 2 <= max_len <= positions:
        parser.error(f"--max-model-len must be in 2..{positions}, got {max_len}")
    spec = kv_cache_spec(loaded.model)
    budget = int(
        args.budget_mib * 2**20 if args.budget_mib else DEFAULT_RESERVATIONS * max_len
        * spec.bytes_per_token
    )  # fmt: skip
    num_blocks = spec.num_blocks_for(budget, BLOCK_SIZE)
    slot_count = num_blocks * BLOCK_SIZE
    if slot_count < max_len:
        parser.error(
            f"--budget-mib {budget / 2**20:g} holds {slot_count} tokens: not one max-length "
            f"({max_len}) reservation; give at least {max_len * spec.bytes_per_token / 2**20:.2f}"
        )
    print(
        f"model: {loaded.name}, {loaded.model.dtype}, {positions} positions; server context "
        f"limit L = {max_len}"
    )
    print(
        f"KV budget: {budget:,} B ({budget / 2**20:.2f} MiB) / {spec.formula()}\n"
        f"  = {budget // spec.bytes_per_token:,} tokens -> {num_blocks} blocks x {BLOCK_SIZE} "
        f"= {slot_count:,} slots = {slot_count / max_len:.2f} max-length (L) sequences"
    )
    stream = make_stream(args.requests, max_len, args.seed)
    prompts = make_prompts(stream, config, args.seed)
    p, o = (statistics.mean(x[k] for x in stream) for k in (0, 1))
    print(
        f"stream: {args.requests} ShareGPT-like requests (seed {args.seed}), lengths x L / "
        f"{MAX_CONTEXT}: prompt mean {p:.0f} (max {max(x[0] for x in stream)}), output mean "
        f"{o:.0f} (max {max(x[1] for x in stream)}); max_tokens = L - prompt; all at time 0"
    )

    systems = {}  # name -> one run of the whole stream
    for name, llm in engines(loaded, num_blocks, args.requests, device).items():
        systems[name] = lambda name=name, llm=llm: run_engine(name, llm, prompts, stream)
    hf = load(args.model).model.to(device)
    hf.set_attn_implementation("sdpa")
    # A row that stopped (its emulated EOS) is still computed until its batch ends; clamp its
    # positions to the model's last one so that it cannot index past the position table. Live
    # rows never get there (prompt + output <= L), so their tokens are unchanged.
    hf.register_forward_pre_hook(_clamp_positions(max_len), with_kwargs=True)
    pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    hf_padded(hf, [prompts[0][:8]] * 2, 4, pad, device)  # warm-up
    systems[PADDED] = lambda: run_padded(hf, prompts, stream, slot_count, max_len, pad, device)
    runs = {name: [] for name in systems}
    for k in range(args.repeats):  # the systems take turns: a burst of load hits them alike
        for name, run in systems.items():
            runs[name].append(run())
        print(
            f"repeat {k + 1}/{args.repeats}: req/s "
            + ", ".join(f"{name} {r[-1]['done'] / r[-1]['wall']:.3f}" for name, r in runs.items())
            + f"; load average {os.getloadavg()[0]:.2f}"
        )
    rows = report(runs, args.requests)
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    return rows


def _clamp_positions(max_len: int):
    def hook(module, args, kwargs):
        if kwargs.get("position_ids") is not None:
            kwargs["position_ids"] = kwargs["position_ids"].clamp(max=max_len - 1)
        return args, kwargs

    return hook


DETERMINED = ("done", "tokens", "peak", "mean", "util", "util_alloc", "steps", "outputs")


def spread(values, unit: str = "") -> str:
    """Median and range of repeated measurements: ``1.51x (1.40x-1.62x)``."""
    lo, mid, hi = min(values), statistics.median(values), max(values)
    return f"{mid:.2f}{unit} ({lo:.2f}{unit}-{hi:.2f}{unit})"


def report(runs, num_requests: int) -> list[dict]:
    """The table (medians of the repeats), the greedy cross-check and the paged / other ratios
    per repeat. Returns one row per system: its first run, with ``rates`` (req/s per repeat)."""
    rows = []
    for repeats in runs.values():
        r = dict(repeats[0])
        r["rates"] = [x["done"] / x["wall"] for x in repeats]
        r["wall"] = statistics.median(x["wall"] for x in repeats)
        r["tok_s"] = statistics.median(x["tokens"] / x["wall"] for x in repeats)
        sat = [(t / s if s else 0.0, s / x["wall"]) for x in repeats for t, s in [x["busy"]]]
        r["sat"], r["sat_share"] = (statistics.median(v) for v in zip(*sat, strict=True))
        r["changed"] = [k for k in DETERMINED if any(x[k] != r[k] for x in repeats)]
        rows.append(r)
    print(
        f"\n{'system':<30} {'done':>7} {'wall s':>8} {'req/s (min-max)':>22} {'tok/s':>7} "
        f"{'sat tok/s':>9} {'sat%':>4} {'peak':>4} {'mean':>6} {'KV util%':>8} {'of alloc%':>9} "
        f"{'steps':>5}  notes"
    )
    for r in rows:
        note = "running = live rows (stopped rows run to the batch's end)"
        if "preempted" in r:
            note = (
                f"{r['step_ms']:.1f} ms/step, {r['batch_tokens']:.1f} tokens/step, preemptions "
                f"{r['preempted']}" + (f", reserved {r['reserved']:.0f}%" if r["reserved"] else "")
            )
        if r["changed"]:
            note += f"; NOT the same in every repeat: {', '.join(r['changed'])}"
        print(
            f"{r['name']:<30} {r['done']:>3}/{num_requests:<3} {r['wall']:>8.2f} "
            f"{spread(r['rates']):>22} {r['tok_s']:>7.1f} {r['sat']:>9.1f} "
            f"{100 * r['sat_share']:>4.0f} {r['peak']:>4} {r['mean']:>6.2f} {r['util']:>8.1f} "
            f"{r['util_alloc']:>9.1f} {r['steps']:>5}  {note}"
        )
    repeats = len(rows[0]["rates"])
    print(
        f"wall s, req/s, tok/s, sat tok/s, sat% = median of {repeats} repeat(s), the systems taking"
        " turns; (min-max) = the range of req/s over the repeats\nreq/s = requests completed (all"
        " their sampled tokens returned) / wall s; tok/s = tokens returned / wall s\nsat tok/s ="
        " the same over only the steps (reserved batches: the batches) that began with requests"
        " queued for memory;\n  sat% = their share of the wall time\npeak, mean = requests"
        " running after each step (max, mean over steps); these and the columns after them are"
        " the same in every repeat\nKV util% = mean over steps of (slots holding a running"
        " request's K/V) / (slots in the budget)\nof alloc% = sum of those / sum of slots"
        " allocated (engines: used blocks x block size; reserved batches:\n  batch x (longest"
        " prompt + tokens so far)); reserved = mean over steps of reserved blocks x block size /"
        f" budget\n{PADDED} = transformers generate() on left-padded batches formed by this"
        " script's reservation rule\n  (batch x min(longest prompt + largest max_tokens, L) <="
        " budget; transformers has no such rule), each run to its longest output"
    )
    paged, held, padded = rows
    same = sum(paged["outputs"].get(i) == v for i, v in held["outputs"].items())
    same_hf = sum(paged["outputs"].get(i) == v for i, v in padded["outputs"].items())
    print(
        f"greedy tokens identical to the paged engine's: reservation {same}/{len(held['outputs'])}"
        f", {PADDED} {same_hf}/{len(padded['outputs'])} requests\n"
    )
    for other in (held, padded):
        ratios = [a / b for a, b in zip(paged["rates"], other["rates"], strict=True)]
        sat = f"{paged['sat'] / other['sat']:.2f}x" if other["sat"] else "n/a"
        if min(paged["sat_share"], other["sat_share"]) < MIN_SATURATED:  # mostly the drain
            sat += f" (a run was saturated < {MIN_SATURATED:.0%} of its time: read with care)"
        print(
            f"paged / {other['name']}: req/s {spread(ratios, 'x')} (median (min-max) over "
            f"{repeats} repeat(s)), mean running requests {paged['mean'] / other['mean']:.2f}x, "
            f"sat tok/s {sat}"
        )
    print(f"paper's claim for paged / reservation throughput: {PAPER_CLAIM}")
    return rows


if __name__ == "__main__":
    main()
