"""Tokens/s of pagedlearn's engine next to transformers' own generation, same model and prompts.

One run, one model, the same prompts (random token ids, lengths uniform in 8..128, seeded) and the
same greedy, fixed-length generation (every prompt gets exactly ``--max-tokens`` new tokens: EOS is
ignored / disabled) for three systems:

1. pagedlearn ``LLM.generate`` (paged KV cache, continuous batching), given as much KV memory
   as (2)'s padded cache holds at the end of a run: ``num_prompts x (longest prompt +
   max_tokens)`` tokens x bytes per token (``--kv-memory default``: LLM's own default budget);
2. transformers ``model.generate()`` on one left-padded batch (attention_mask; pad = pad or eos);
3. transformers continuous batching, ``model.generate_batch`` (its own paged cache, attention
   "sdpa", a persistent manager), given the same KV capacity in tokens, per-step token budget and
   batch size as (1).

Every system first runs once on a warm-up prompt set, then the systems take turns on ``--repeats``
fresh prompt sets (interleaved, so that a burst of load from other processes hits them alike; fresh,
so that no run finds the previous run's prompts in a prefix cache). Reported: the median wall time;
``tokens/s = generated tokens / wall seconds``, the generated tokens counted in what each system
returned (they must equal num_prompts * max_tokens); ratios to pagedlearn's tokens/s; how many
prompts got the same greedy tokens from pagedlearn as from each baseline; the smallest call each
system can make (one fixed cost per call); and pagedlearn's per-step breakdown in its median timed
run, from ``engine.subscribe_stats``, bookkeeping = scheduler + block manager + the Python after the
forward (sampling, stop checks).

Times on a small shared CPU swing with what else runs: torch's threads and another busy process's
threads fight over the cores, and a step of many small ops suffers most. The script prints the
load average and the run-to-run spread to show it.

Goals (from issue 17): pagedlearn at least as fast as generate and generate_batch, bookkeeping
< 10% of a step. The script prints what it measures; it asserts nothing.

``--model gpt2-size-random`` is GPT-2 small's architecture (124M parameters, 12 layers, 12
heads of 64) with random weights (seeded) and the byte tokenizer: real-size compute without a
download, for machines that have no cached ``gpt2``. Speed does not depend on the weights.

Usage: python benchmarks/bench_engine.py [--model auto|tiny-gpt2|gpt2|gpt2-size-random|...]
       [--num-prompts 32] [--max-tokens 64] [--repeats 3] [--device auto|cpu|cuda]
       [--kv-memory padded|default] [--quick]
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import random
import statistics
import time

import torch

from pagedlearn import LLM, SamplingParams
from pagedlearn.models import load
from pagedlearn.models.runner import kv_cache_spec

PAGED, PADDED, CB = (
    "pagedlearn LLM.generate",
    "transformers generate",
    "transformers generate_batch",
)
PAGE_SIZE = 256  # transformers' default page size for generate_batch (tokens per page)


def machine_line() -> str:
    """Versions, cores and load: what a reader needs to judge any timing printed after it."""
    import transformers

    return (
        f"Python {platform.python_version()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}; {os.cpu_count()} CPUs, torch threads "
        f"{torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}"
    )


def short_reason(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:160]


def make_prompts(n: int, vocab: int, special: set[int], seed: int) -> list[list[int]]:
    """``n`` prompts of random token ids (no special token), lengths uniform in 8..128."""
    rng = random.Random(seed)
    ids = [t for t in range(vocab) if t not in special]
    return [[rng.choice(ids) for _ in range(rng.randint(8, 128))] for _ in range(n)]


def hf_padded(model, prompts, max_tokens, pad_id, device):
    """transformers generate() on one left-padded batch; each prompt's new token ids."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    cfg = model.generation_config  # eos None: nothing stops early, nothing is suppressed
    cfg.update(
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=pad_id,
    )
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
    return out[:, width:].tolist()


def hf_generate_batch(model, prompts, max_tokens, capacity, budget, max_seqs):
    """transformers continuous batching; each prompt's new token ids, in prompt order.

    Its KV cache holds ``capacity`` tokens, a step at most ``budget`` tokens and ``max_seqs``
    requests. The manager persists: the warm-up run builds it, later calls reuse it."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    cb_config = ContinuousBatchingConfig(
        page_size=PAGE_SIZE,
        num_blocks=-(-capacity // PAGE_SIZE),
        max_batch_tokens=budget,
        max_requests_per_batch=max_seqs,
    )

    cfg = GenerationConfig(
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=-1,
        pad_token_id=0,
    )  # -1: EOS disabled
    res = model.generate_batch(
        inputs=prompts,
        generation_config=cfg,
        continuous_batching_config=cb_config,
        persistent_manager=True,
    )
    outs = list(res.values())
    if len(outs) != len(prompts) or any(o.error for o in outs):
        errors = [o.error for o in outs if o.error]
        raise RuntimeError(f"{len(outs)}/{len(prompts)} results; errors: {errors[:1]}")
    return [list(o.generated_tokens) for o in outs]


def measure(systems, sets, max_tokens, sync):
    """Warm-up on ``sets[0]``, then the systems take turns on each further set.

    Returns {name: [seconds per timed run]}, {name: [outputs per timed run]}, {name: why it
    failed}; only generate_batch may fail (then it is reported and left out)."""
    times, outs, failed = {n: [] for n in systems}, {n: [] for n in systems}, {}
    for i, prompts in enumerate(sets):
        for name, fn in systems.items():
            if name in failed:
                continue
            sync()
            t0 = time.perf_counter()
            try:
                result = fn(prompts, max_tokens)
            except Exception as e:
                if name != CB:
                    raise
                failed[name] = short_reason(e)
                continue
            sync()
            if i:
                times[name].append(time.perf_counter() - t0)
                outs[name].append(result)
    return times, outs, failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="auto", help="auto: gpt2 if cached, else tiny-gpt2")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per system (median)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument(
        "--kv-memory",
        default="padded",
        choices=["padded", "default"],
        help="pagedlearn's KV cache: the size of generate()'s padded cache (default), or "
        "LLM's own default budget",
    )
    parser.add_argument("--quick", action="store_true", help="4 prompts x 8 tokens, 1 timed run")
    args = parser.parse_args()
    if args.quick:
        args.num_prompts, args.max_tokens, args.repeats = 4, 8, 1
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)  # EOS/flash notices
    loaded = load(args.model)
    print(machine_line())
    why = " (--model auto: gpt2 is not in the local HF cache)" if loaded.offline_stand_in else ""
    print(f"model: {loaded.name}{why}, {loaded.model.dtype}, device {device}")
    config = loaded.model.config
    special = {config.bos_token_id, config.eos_token_id, config.pad_token_id} - {None}
    sets = [
        make_prompts(args.num_prompts, config.vocab_size, special, seed)
        for seed in range(args.repeats + 1)
    ]
    lens = [len(p) for prompts in sets for p in prompts]
    expected = args.num_prompts * args.max_tokens
    print(
        f"prompts: {args.repeats + 1} sets (seeds 0..{args.repeats}: warm-up, then "
        f"{args.repeats} timed) of {args.num_prompts} random token-id prompts, lengths "
        f"{min(lens)}..{max(lens)}; greedy, exactly {args.max_tokens} new tokens each (EOS "
        f"ignored): {args.num_prompts} x {args.max_tokens} = {expected} tokens per run"
    )

    # The KV memory every system gets: what generate()'s padded cache holds at the end of a run
    # (every prompt padded to the longest one, plus the new tokens, in every layer, K and V),
    # for the longest prompt of all the runs: an upper bound over them.
    per_token = kv_cache_spec(loaded.model).bytes_per_token
    width = max(len(p) for prompts in sets for p in prompts)
    padded_tokens = args.num_prompts * (width + args.max_tokens)
    padded_bytes = padded_tokens * per_token
    memory = {"padded": padded_bytes, "default": None}[args.kv_memory]
    print(
        f"KV memory: generate's padded cache = {args.num_prompts} prompts x ({width} longest "
        f"prompt + {args.max_tokens} new) tokens x {per_token} bytes per token = "
        f"{padded_bytes / 2**20:.1f} MiB; pagedlearn gets "
        + ("the same" if memory else "its default budget (--kv-memory default)")
    )

    # 1. pagedlearn. LLM() switches its model to the "pagedlearn" attention: the baselines get a
    #    copy of their own, loaded again.
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
    runs = []  # the StepStats of each pagedlearn run
    engine.subscribe_stats(lambda s: runs[-1].append(s))

    def paged(prompts, max_tokens):
        runs.append([])
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    # 2. and 3. transformers
    hf = load(loaded.name).model.to(device)
    hf.set_attn_implementation("sdpa")
    pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    print(
        f"generate_batch: attention sdpa, page_size {PAGE_SIZE}, num_blocks "
        f"{-(-capacity // PAGE_SIZE)} "
        f"(the same {capacity} tokens), max_batch_tokens {budget}, max_requests_per_batch "
        f"{max_seqs}, persistent manager (built in the warm-up run)"
    )
    systems = {
        PAGED: paged,
        PADDED: lambda ps, n: hf_padded(hf, ps, n, pad, device),
        CB: lambda ps, n: hf_generate_batch(hf, ps, n, capacity, budget, max_seqs),
    }
    times, outs, failed = measure(systems, sets, args.max_tokens, sync)
    for name, reason in failed.items():
        print(f"{name}: unavailable here: {reason}")
        del systems[name], times[name], outs[name]
    small = [sets[0][0][:8]]  # one prompt of 8 tokens, 1 new token
    small_ms = {name: [] for name in systems}
    for _ in range(args.repeats):
        for name, fn in systems.items():
            t0 = time.perf_counter()
            fn(small, 1)
            sync()
            small_ms[name].append((time.perf_counter() - t0) * 1e3)
    getattr(hf, "destroy_cached_continuous_batching_manager", lambda: None)()
    report(times, outs, expected, runs[1 : 1 + args.repeats], runs[0])
    print(
        "smallest call (1 prompt of 8 tokens, 1 new token; median ms): "
        + ", ".join(f"{name} {statistics.median(ms):.1f}" for name, ms in small_ms.items())
    )
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")


def report(times, outs, expected, steps_per_run, warmup_steps) -> None:
    """The table, the greedy cross-check, pagedlearn's step breakdown and the goals."""
    print(f"\n{'system':<31} {'wall s':>8} {'tokens':>7} {'tokens/s':>9} {'vs pagedlearn':>14}")
    rate = {}
    for name, secs in times.items():
        counts = [sum(map(len, out)) for out in outs[name]]
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
    print(
        "timed runs (s): "
        + "; ".join(f"{k}: " + ", ".join(f"{t:.3f}" for t in v) for k, v in times.items())
    )
    print(
        "run-to-run spread (slowest / fastest timed run): "
        + ", ".join(f"{k} {max(v) / min(v):.2f}x" for k, v in times.items())
    )
    ours = [toks for out in outs[PAGED] for toks in out]
    for name in (PADDED, CB):
        if name in outs:
            theirs = [toks for out in outs[name] for toks in out]
            same = sum(a == b for a, b in zip(ours, theirs, strict=True))
            print(f"greedy tokens of pagedlearn identical to {name}'s: {same}/{len(ours)} prompts")

    secs = times[PAGED]  # the breakdown of pagedlearn's median run, the one in the table
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
        f"\npagedlearn's median timed run (run {median_run + 1} of {len(secs)}): {n} steps, "
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
    print(
        f"  mean other time        {(step - fwd - book) * 1e3:8.3f} ms  (step - forward - "
        "bookkeeping: block copies / swaps)"
    )
    print(
        f"  bookkeeping / step time = sum(bookkeeping_time) / sum(step_time) = "
        f"{100 * book / step:.1f}%"
    )
    print("\ngoals (measured, not asserted):")
    for name in (PADDED, CB):
        ratio = f"{rate[PAGED] / rate[name]:.2f}x" if name in rate else f"n/a ({name} did not run)"
        print(f"  pagedlearn / {name} tokens/s: goal: >= 1.0x; measured: {ratio}")
    print(f"  bookkeeping / step time: goal: < 10%; measured: {100 * book / step:.1f}%")


if __name__ == "__main__":
    main()
