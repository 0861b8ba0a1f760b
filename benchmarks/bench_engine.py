"""Tokens/s of pagedlearn's engine next to transformers' own generation, same model and prompts.

Three systems (engine_systems.py), greedy, the same model: pagedlearn ``LLM.generate`` (paged KV
cache, continuous batching), transformers ``model.generate()`` on left-padded batches, and
transformers' continuous batching (``generate_batch``'s manager: its own paged cache, attention
"sdpa"), in three sections:

1. **fixed length**: ``--num-prompts`` random token-id prompts (lengths uniform in 8..128,
   seeded), exactly ``--max-tokens`` new tokens each (EOS ignored), one padded batch; with
   pagedlearn's per-step breakdown (``engine.subscribe_stats``: bookkeeping = scheduler + block
   manager + the Python after the forward: sampling, stop checks).
2. **decode step** at each of ``--batch-sizes`` (1, 4, 16): the wall time of one generated
   token step of the whole batch after prefill, ``(wall(max_tokens=N) - wall(max_tokens=1)) /
   (N - 1)`` with N = ``--decode-tokens``, each call on B fresh random prompts of 64 tokens (the
   same length, so that the two calls' prefills cost the same); tokens/s = B / step.
3. **the request mix**: the load test's mix (pagedlearn/loadtest/mix.py) as real chats
   (chat_mix.py: shared system prompts, short and long prompts, varied output lengths, early
   stops at EOS), all at once; padded ``generate`` takes them in ``--mix-batch`` batches in
   arrival order, each run to its longest request (see engine_systems.py); tokens counted =
   what each request asked for and got (cut at its EOS and its max_tokens).

pagedlearn's KV pool holds what ``generate()``'s padded cache holds in the largest of the three
sections (``--kv-memory default``: LLM's own budget); generate_batch gets the same tokens, the
same per-step token budget and batch size. Each section first runs once untimed (warm-up), then
the systems take turns on ``--repeats`` runs (interleaved, so that a burst of load from other
processes hits them alike; fresh prompts, or for the mix an emptied prefix cache / a new
generate_batch manager, so that no run finds the previous run's prompts cached). Printed:
medians and the min..max spread, ratios to pagedlearn, how many outputs were token-for-token
the same as pagedlearn's, the machine, torch's thread count and where it came from (``--threads``;
by default the count pagedlearn chose when it was imported, pagedlearn/cli/threads.py: 1 on a busy
two-core machine, where more threads fight over the cores and a step of many small ops suffers
most) and the load average. It asserts nothing.

Goals (issues 17 and 30): pagedlearn at least as fast as both at every batch size, ahead on the
mix, bookkeeping < 10% of a step.

``--model smollm2`` is the real SmolLM2-135M-Instruct with its chat template; ``auto`` takes
``gpt2`` if cached, else smollm2 (else tiny-gpt2); ``gpt2-size-random`` is GPT-2 small's
architecture with random weights and the byte tokenizer: real-size compute without a download.

Usage: python benchmarks/bench_engine.py [--model auto|smollm2|tiny-gpt2|gpt2-size-random|...]
       [--threads N] [--num-prompts 32] [--max-tokens 64] [--batch-sizes 1,4,16]
       [--decode-tokens 32] [--mix-entries 36] [--mix-batch 8] [--repeats 3]
       [--device auto|cpu|cuda] [--kv-memory padded|default] [--quick]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time

import torch
from chat_mix import STOP_MAX_TOKENS, build_chat_mix
from engine_systems import (
    CB,
    PADDED,
    PAGE_SIZE,
    PAGED,
    Runner,
    cb_config,
    hf_continuous,
    hf_padded,  # noqa: F401 (bench_memory_bound.py imports it from here)
    hf_padded_batches,
    machine_line,
    make_prompts,
    same_count,
    spread,
)

from pagedlearn import LLM, SamplingParams
from pagedlearn.cli import threads
from pagedlearn.models import load
from pagedlearn.models.runner import kv_cache_spec

DECODE_PROMPT_LEN = 64


def fixed_section(run, sets, max_tokens, expected, runs):
    """1. Fixed length: the table, the greedy cross-check and pagedlearn's breakdown."""
    times, outs = {n: [] for n in run.names()}, {n: [] for n in run.names()}
    for i, prompts in enumerate(sets):
        for name in run.names():
            got = run(name, prompts, [max_tokens] * len(prompts))
            if got and i:
                times[name].append(got[0])
                outs[name].append(got[1])
    print(f"\n{'system':<31} {'wall s':>8} {'tokens':>7} {'tokens/s':>9} {'vs pagedlearn':>14}")
    rate = {}
    for name in run.names():
        secs, counts = times[name], [sum(map(len, out)) for out in outs[name]]
        rate[name] = statistics.median(counts) / statistics.median(secs)
        flag = "" if set(counts) == {expected} else f"  (per run {counts}; expected {expected})"
        print(
            f"{name:<31} {statistics.median(secs):>8.3f} {counts[0]:>7} {rate[name]:>9.1f} "
            f"{rate[name] / rate[PAGED]:>13.2f}x{flag}"
        )
    print(
        "tokens/s = generated tokens / wall seconds (median of the timed runs); generated tokens "
        "= token ids returned per run, counted; vs pagedlearn = tokens/s / pagedlearn's"
    )
    print("wall s, median (min..max): " + "; ".join(f"{n} {spread(times[n])}" for n in rate))
    for name in list(rate)[1:]:  # the baselines, in order
        n = same_count(outs[name], outs[PAGED])
        print(f"greedy tokens of pagedlearn identical to {name}'s: {n} prompts")
    return rate, breakdown(times[PAGED], runs[1 : 1 + len(times[PAGED])], runs[0])


def breakdown(secs, steps_per_run, warmup_steps) -> float:
    """pagedlearn's per-step breakdown in its median timed run; returns bookkeeping / step."""
    median_run = sorted(range(len(secs)), key=secs.__getitem__)[(len(secs) - 1) // 2]
    steps = steps_per_run[median_run]
    n = len(steps)
    step, fwd, book = (
        sum(getattr(s, f) for s in steps) / n
        for f in ("step_time", "forward_time", "bookkeeping_time")
    )
    hits = steps_per_run[-1][-1].prefix_hit_tokens - warmup_steps[-1].prefix_hit_tokens
    before = steps_per_run[median_run - 1][-1] if median_run else warmup_steps[-1]
    preempted = steps[-1].preemptions_recompute - before.preemptions_recompute
    print(
        f"pagedlearn's median timed run (run {median_run + 1} of {len(secs)}): {n} steps, "
        f"{sum(s.num_batched_tokens for s in steps) / n:.1f} tokens per step on average; "
        f"{hits} prompt tokens served from the prefix cache in the timed runs; "
        f"{preempted} preemptions (recompute) in this run, with a pool of "
        f"{steps[-1].num_blocks} blocks"
    )
    print(f"  mean step time         {step * 1e3:8.3f} ms")
    print(f"  mean forward time      {fwd * 1e3:8.3f} ms  (input tensors, model, logits)")
    print(
        f"  mean bookkeeping time  {book * 1e3:8.3f} ms  (scheduler + block manager, and the "
        "Python after the forward: sampling, stop checks, frees)"
    )
    print(f"  mean other time        {(step - fwd - book) * 1e3:8.3f} ms  (block copies / swaps)")
    print(
        f"  bookkeeping / step time = sum(bookkeeping_time) / sum(step_time) = "
        f"{100 * book / step:.1f}%"
    )
    return book / step


def decode_section(run, sizes, n, repeats, fresh, warmup):
    """2. Decode step time and tokens/s at each batch size; returns {B: {name: tokens/s}}."""
    rates = {}
    print(
        "\nbatch system                       step ms: median (min..max)  tokens/s  vs "
        "pagedlearn  same tokens as pagedlearn"
    )
    for b in sizes:
        steps, outs = {k: [] for k in run.names()}, {k: [] for k in run.names()}
        for r in range(1 - warmup, repeats + 1):  # r = 0: the warm-up
            long, one = fresh(b), fresh(b)
            for name in run.names():
                got_n, got_1 = run(name, long, [n] * b), run(name, one, [1] * b)
                if got_n and got_1 and r:
                    steps[name].append((got_n[0] - got_1[0]) / (n - 1))
                    outs[name].append(got_n[1])
        rates[b] = {k: b / statistics.median(steps[k]) for k in run.names()}
        for name in run.names():
            ms = [s * 1e3 for s in steps[name]]
            print(
                f"{b:>5} {name:<28} {spread(ms, '{:.1f}'):>28} {rates[b][name]:>9.1f} "
                f"{rates[b][name] / rates[b][PAGED]:>13.2f}x  {same_count(outs[name], outs[PAGED])}"
            )
    print(
        f"step = (wall(max_tokens={n}) - wall(max_tokens=1)) / ({n} - 1), each call on B fresh "
        f"prompts of {DECODE_PROMPT_LEN} random tokens, EOS ignored; tokens/s = B / median "
        f"step; (min..max) over {repeats} runs"
    )
    return rates


def mix_section(run, requests, eos, batch, repeats, reset, warmup):
    """3. Throughput on the request mix; returns {name: tokens/s}."""
    prompts, limits = [q.prompt for q in requests], [q.max_tokens for q in requests]
    times, outs = {k: [] for k in run.names()}, {k: [] for k in run.names()}
    for r in range(1 - warmup, repeats + 1):  # r = 0: the warm-up
        for name in run.names():
            reset(name)  # untimed: no run finds the previous run's prompts cached
            got = run(name, prompts, limits, eos, batch)
            if got and r:
                times[name].append(got[0])
                outs[name].append(got[1])
    rate = {}
    print(
        "\nmix  system                       tokens  wall s: median (min..max)  tokens/s  vs "
        "pagedlearn  same tokens as pagedlearn"
    )
    for name in run.names():
        tokens = statistics.median(sum(map(len, o)) for o in outs[name])
        rate[name] = tokens / statistics.median(times[name])
        print(
            f"mix  {name:<28} {tokens:>6.0f} {spread(times[name]):>27} {rate[name]:>9.1f} "
            f"{rate[name] / rate[PAGED]:>13.2f}x  {same_count(outs[name], outs[PAGED])}"
        )
    print(
        f"tokens/s = tokens / median wall s; tokens = each request's output up to its EOS and "
        f"max_tokens (a padded row's tokens past them are not counted); (min..max) over "
        f"{repeats} runs"
    )
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--model", default="auto", help="auto: gpt2 if cached, else smollm2, else tiny-gpt2")
    add("--threads", type=int, help="torch.set_num_threads (default: pagedlearn's choice, "
        "pagedlearn/cli/threads.py; PAGEDLEARN_NUM_THREADS)")  # fmt: skip
    add("--num-prompts", type=int, default=32, help="1. fixed length: prompts")
    add("--max-tokens", type=int, default=64, help="1. fixed length: new tokens per prompt")
    add("--batch-sizes", default="1,4,16", help="2. decode step: batch sizes")
    add("--decode-tokens", type=int, default=32, help="2. decode step: N (>= 2)")
    add("--mix-entries", type=int, default=36, help="3. mix: template entries (12 a cycle)")
    add("--mix-batch", type=int, default=8, help="3. mix: generate()'s padded batch size")
    add("--repeats", type=int, default=3, help="timed runs per system (median, min..max)")
    add("--device", default="auto", choices=["auto", "cpu", "cuda"])
    add("--kv-memory", default="padded", choices=["padded", "default"], help="pagedlearn's KV "
        "cache: generate()'s padded cache (default), or LLM's own default budget")  # fmt: skip
    add("--quick", action="store_true", help="a smoke test: tiny sizes, 1 timed run, sections "
        "2 and 3 without a warm-up run of their own")  # fmt: skip
    args = parser.parse_args()
    if args.quick:
        args.num_prompts, args.max_tokens, args.repeats = 4, 8, 1
        args.decode_tokens, args.mix_entries = 2, 6
    stop_tokens = 16 if args.quick else STOP_MAX_TOKENS  # quick: random weights never stop
    warm = not args.quick  # quick: sections 2 and 3 rely on section 1's warm-up
    sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip().isdigit()]
    small = min(
        [1 if args.threads is None else args.threads, args.mix_entries, args.mix_batch, *sizes]
    )
    if small < 1 or args.decode_tokens < 2 or len(sizes) != len(args.batch_sizes.split(",")):
        parser.error(
            "--threads, --mix-entries, --mix-batch and each of --batch-sizes (comma-separated) "
            "must be integers >= 1, --decode-tokens >= 2"
        )
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)  # EOS/flash notices
    started = time.perf_counter()
    loaded = load(args.model)
    print(machine_line(device))
    print(
        threads.describe() if args.threads is None else f"torch threads: {args.threads} (--threads)"
    )
    why = " (--model auto: no gpt2 or smollm2 here)" if loaded.offline_stand_in else ""
    print(f"model: {loaded.name}{why}, {loaded.model.dtype}, device {device}")
    config, tok = loaded.model.config, loaded.tokenizer
    special = {config.bos_token_id, config.eos_token_id, config.pad_token_id} - {None}
    sets = [
        make_prompts(args.num_prompts, config.vocab_size, special, seed)
        for seed in range(args.repeats + 1)
    ]
    lens = [len(p) for prompts in sets for p in prompts]
    expected = args.num_prompts * args.max_tokens
    ctx = getattr(config, "max_position_embeddings", None) or config.n_positions
    mix = build_chat_mix(tok, args.mix_entries, 0, 16, ctx, stop_tokens)

    # The KV memory every system gets: what generate()'s padded cache holds at the end of the
    # largest section (every prompt of a batch padded to its longest, plus the new tokens).
    per_token = kv_cache_spec(loaded.model).bytes_per_token
    width = max(lens)
    fixed = args.num_prompts * (width + args.max_tokens)
    decode = max(sizes) * (DECODE_PROMPT_LEN + args.decode_tokens)
    chunks = [mix[i : i + args.mix_batch] for i in range(0, len(mix), args.mix_batch)]
    mixed = max(len(c) * max(len(q.prompt) + q.max_tokens for q in c) for c in chunks)
    padded_bytes = max(fixed, decode, mixed) * per_token
    memory = {"padded": padded_bytes, "default": None}[args.kv_memory]
    print(
        f"KV memory: generate's padded cache = {args.num_prompts} prompts x ({width} longest "
        f"prompt + {args.max_tokens} new) tokens x {per_token} bytes per token = "
        f"{fixed * per_token / 2**20:.1f} MiB; decode section {decode} tokens, mix section "
        f"{mixed} tokens; pagedlearn gets "
        + ("the largest of the three" if memory else "its default budget (--kv-memory default)")
    )

    # pagedlearn. LLM() switches its model to the "pagedlearn" attention: the baselines get a
    # copy of their own, loaded again.
    llm = LLM(loaded, block_size=16, device=device, verbose=False, kv_cache_memory=memory)
    engine = llm.engine
    capacity = engine.kv_cache.num_blocks * engine.kv_cache.block_size
    max_seqs, budget = engine.scheduler.max_num_seqs, engine.scheduler.max_num_batched_tokens
    print(
        f"pagedlearn: attention {llm.attention_backend}, block_size 16, "
        f"{engine.kv_cache.num_blocks} blocks = {capacity} tokens = "
        f"{capacity * per_token / 2**20:.1f} MiB of KV cache, prefix caching "
        f"on, max_num_seqs {max_seqs}, max_num_batched_tokens {budget}"
    )
    runs = []  # the StepStats of each pagedlearn call
    engine.subscribe_stats(lambda s: runs[-1].append(s))

    def paged(prompts, limits, eos, batch):
        runs.append([])
        params = [SamplingParams(max_tokens=m, ignore_eos=eos is None) for m in limits]
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    hf = load(loaded.name).model.to(device)
    hf.set_attn_implementation("sdpa")
    pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    cb = cb_config(capacity, budget, max_seqs)
    print(
        f"generate_batch: attention sdpa, page_size {PAGE_SIZE}, num_blocks "
        f"{-(-capacity // PAGE_SIZE)} (the same {capacity} tokens), max_batch_tokens {budget}, "
        f"max_requests_per_batch {max_seqs}, persistent manager (built in the warm-up run)"
    )
    run = Runner(
        {
            PAGED: paged,
            PADDED: lambda ps, lim, eos, b: hf_padded_batches(hf, ps, lim, eos, pad, device, b),
            CB: lambda ps, lim, eos, b: hf_continuous(hf, ps, lim, eos, cb),
        },
        sync,
    )

    print(
        f"\n1. fixed length. prompts: {args.repeats + 1} sets (seeds 0..{args.repeats}: warm-up, "
        f"then {args.repeats} timed) of {args.num_prompts} random token-id prompts, lengths "
        f"{min(lens)}..{max(lens)}; greedy, exactly {args.max_tokens} new tokens each (EOS "
        f"ignored): {args.num_prompts} x {args.max_tokens} = {expected} tokens per run"
    )
    fixed_rate, book = fixed_section(run, sets, args.max_tokens, expected, runs)
    seeds = iter(range(1000, 10**6))

    def fresh(b):
        return make_prompts(b, config.vocab_size, special, next(seeds), *[DECODE_PROMPT_LEN] * 2)

    print(f"\n2. decode step at batch {', '.join(map(str, sizes))}")
    decode_rates = decode_section(run, sizes, args.decode_tokens, args.repeats, fresh, warm)

    kinds = sorted({q.kind for q in mix})
    plens = [len(q.prompt) for q in mix]
    template = "the model's chat template"
    if not getattr(tok, "chat_template", None):
        template = "the plain template (the model has no chat template)"
    print(
        f"\n3. request mix: {len(mix)} requests from the load test's first {args.mix_entries} "
        f"template entries ({', '.join(kinds)}), chats rendered with "
        f"{template}; prompts {min(plens)}..{max(plens)} tokens, max_tokens "
        f"{min(q.max_tokens for q in mix)}..{max(q.max_tokens for q in mix)}, greedy, EOS "
        f"{tok.eos_token_id} ends a request; all at once; generate: batches of "
        f"{args.mix_batch} in arrival order, each to its longest request (EOS or max_new_tokens)"
    )

    def reset(name):
        if name == PAGED:
            llm.reset_prefix_cache()
        elif name == CB:  # a new manager: an empty cache (built here, outside the timing)
            hf.destroy_cached_continuous_batching_manager()
            run(CB, [mix[0].prompt], [1])

    mix_rate = mix_section(run, mix, tok.eos_token_id, args.mix_batch, args.repeats, reset, warm)
    getattr(hf, "destroy_cached_continuous_batching_manager", lambda: None)()

    print("\ngoals (measured, not asserted):")
    for name in (PADDED, CB):
        if name in run.failed:
            print(f"  pagedlearn / {name} tokens/s: goal: >= 1.0x; measured: n/a (did not run)")
            continue
        ratios = [(fixed_rate, "1. fixed length")] + [
            (r, f"batch {b}") for b, r in decode_rates.items()
        ]
        ratios.append((mix_rate, "the mix"))
        print(
            f"  pagedlearn / {name} tokens/s: goal: >= 1.0x; measured: "
            + ", ".join(f"{r[PAGED] / r[name]:.2f}x ({what})" for r, what in ratios if name in r)
        )
    print(f"  bookkeeping / step time (1. fixed length): goal: < 10%; measured: {100 * book:.1f}%")
    print(
        f"load average (1 min) at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; "
        f"whole run {time.perf_counter() - started:.0f} s"
    )


if __name__ == "__main__":
    main()
