"""What tensor parallelism costs per step: N workers against one process, same model, same batch.

The paper (section 4.6) runs a model too big for one GPU on N GPUs, Megatron-LM style: the
scheduler and block manager stay in one place (the driver), every step's input goes to every
worker, and each layer ends in two all-reduces. This script measures what that costs, on the
same model and the same fixed batch with ``tensor_parallel_size`` N = 1 (the model in this
process) and N = 2 (and 4, ``--sizes 1,2,4``, where the heads divide)::

    one engine.step(), as the driver's clock sees it (N > 1):

    schedule  prepare_inputs  ├─ send ─┤                                    logits    sample
                              ├──── arrival ────┤ busy, per rank             ───────── ────────
    driver    driver          pickle once, N    forward on 1/N of every    the pipe  driver
                              writes; the pipe  layer, 2 x layers          from
                              to each worker    all-reduces                rank 0

    (``arrival`` starts with ``send``: it contains it.)

The batch: ``--batch`` B sequences of ``--prompt-len`` P random token ids (seeded; the same ids
for every N), greedy, ``max_tokens = K + 1`` with EOS ignored, and prefix caching off: one
prefill step of B x P tokens, then ``--steps`` K decode steps of B tokens each, the same work for
every N. The generated token ids of every N are compared with N = 1's (they must agree; summing
partial products across workers may, rarely, flip a near-tie in float32). A warm-up round comes
first; then the sizes take turns for ``--repeats`` rounds (interleaved, so that a burst of load
from other processes hits them alike).

Per step, medians: ``step`` = ``engine.step()``'s wall time; ``forward`` = its
``StepStats.forward_time`` (prepare_inputs, the model -- or the workers --, log-softmax);
``driver = step - forward`` (scheduler, block manager, sampling). For N > 1, from the executor's
``last_timings`` after each step: ``send`` (pickle once + write N pipes), ``arrival`` = the
latest rank's ``received`` (driver's send start -> worker's receive), ``busy`` per rank (its
forward with the all-reduces), ``wait`` per rank (the part of ``busy`` spent inside the
all-reduces the forward made: ``worker.AllReduceClock``), and ``return = forward - max over ranks
(received + busy)`` (prepare_inputs, rank 0's logits through the pipe, log-softmax). The
all-reduces alone, after
each timed round: ``Worker.time_all_reduce(T)`` (``collective_rpc``) times one all-reduce of a
``(T, hidden)`` activation for the step's T tokens, and ``per step = 2 x num_layers x that``.
Also the bytes of the step message (``pickle.dumps(StepInputs)``) and of the logits coming back
(``S x vocab x 4`` bytes, float32). ``overhead = step(N) - step(1)``, ``ratio = step(N) /
step(1)``.

Threads: each of N workers gets ``T // N`` torch threads, where T is the count pagedlearn chose
for this machine (the executor's choice; pagedlearn/cli/threads.py). N = 1 runs the model in this
process with ``--threads``; the default is what one worker of N = 2 gets, ``T // 2``: one
"device" each, as on GPUs (N = 1 on one GPU, N = 2 on two); ``--threads T`` gives N = 1 all of
them instead (the same threads as N workers together). While N > 1
runs, this process (the driver: scheduling and sampling only) keeps one thread, so that its idle
OpenMP threads do not compete with the workers for the cores. Times on a small shared CPU swing
with what else runs -- a multi-threaded step most, as each op waits for its slowest thread: the
load average is printed at the start and the end, and each number's spread over the rounds.
``--device cuda`` needs N GPUs: one worker on each (NCCL), N = 1 on the first. It asserts
nothing.

Usage: python benchmarks/bench_tensor_parallel.py [--model tiny-gpt2|tiny-opt|gpt2-size-random|
       smollm2] [--sizes 1,2 (smollm2: 1,3)] [--batch 8] [--prompt-len 64] [--steps 32]
       [--repeats 3] [--threads T] [--device cpu|cuda] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from pagedlearn import LLM, SamplingParams
from pagedlearn.cli import threads as threads_module
from pagedlearn.errors import PagedLearnError
from pagedlearn.models import load
from pagedlearn.models.runner import prepare_inputs
from pagedlearn.parallel import check_tensor_parallel

BLOCK_SIZE = 16
MS = 1e3


def machine_line() -> str:
    """Versions, cores and load: what a reader needs to judge any timing printed after it."""
    return (
        f"Python {platform.python_version()}, torch {torch.__version__}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}"
    )


def make_prompts(batch: int, length: int, vocab: int, special: set[int], seed: int):
    rng = random.Random(seed)
    ids = [t for t in range(vocab) if t not in special]
    return [[rng.choice(ids) for _ in range(length)] for _ in range(batch)]


def build(model: str, n: int, args) -> LLM:
    """One LLM with N workers; every N gets the same pool, budget and settings."""
    per_seq = -(-(args.prompt_len + args.steps + 1) // BLOCK_SIZE)
    return LLM(
        model, tensor_parallel_size=n, device=args.device, block_size=BLOCK_SIZE,
        num_blocks=args.batch * per_seq, enable_prefix_caching=False, max_num_seqs=args.batch,
        max_num_batched_tokens=args.batch * args.prompt_len, verbose=False,
    )  # fmt: skip


def one_round(llm: LLM, prompts, steps: int, tag: str, capture: list | None = None) -> dict:
    """Prefill ``prompts`` in one step, then ``steps`` decode steps. Returns each step's timings
    and each sequence's token ids. ``capture``: gets each step's SequenceInputs (warm-up only)."""
    engine, tp = llm.engine, llm.tensor_parallel_size > 1
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True, temperature=0.0)
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", ids, params)
    if capture is not None:  # untimed round: keep what the runner is given, to size the message
        execute = engine.runner.execute
        engine.runner.execute = lambda seqs: (capture.append(seqs), execute(seqs))[1]
    records, tokens = [], {}
    try:
        for _ in range(steps + 1):
            t0 = time.perf_counter()
            outs = engine.step()
            wall = time.perf_counter() - t0
            st = engine.last_stats
            rec = {"tokens": st.num_batched_tokens, "step": wall, "forward": st.forward_time}
            if tp:
                t = engine.runner.last_timings
                rec["send"], rec["received"], rec["busy"] = t["send"], t["received"], t["busy"]
                rec["all_reduce"] = t["all_reduce"]
            records.append(rec)
            for o in outs:
                tokens[o.request_id] = list(o.outputs[0].token_ids)
    finally:
        if capture is not None:
            del engine.runner.execute  # the instance attribute; the method shows again
    expected = [len(prompts) * len(prompts[0])] + [len(prompts)] * steps
    if engine.has_unfinished_requests() or [r["tokens"] for r in records] != expected:
        raise RuntimeError(
            f"the batch did not run as one prefill step and {steps} decode steps: tokens per "
            f"step {[r['tokens'] for r in records]}, expected {expected}"
        )
    return {"steps": records, "tokens": [tokens[f"{tag}-{i}"] for i in range(len(prompts))]}


def derived(rec: dict) -> dict:
    """One step's breakdown (see the module docstring for each formula)."""
    d = {"step": rec["step"], "forward": rec["forward"], "driver": rec["step"] - rec["forward"]}
    if "busy" in rec:
        ranks = sorted(rec["busy"])
        end = max(rec["received"][r] + rec["busy"][r] for r in ranks)
        d["send"], d["arrival"] = rec["send"], max(rec["received"].values())
        d.update({f"busy{r}": rec["busy"][r] for r in ranks})
        d.update({f"wait{r}": rec["all_reduce"][r] for r in ranks})
        d["return"] = rec["forward"] - end
    return d


def summarise(rounds: list[dict], phase: str) -> dict:
    """Median of each quantity over the steps of ``phase`` in every timed round, and the spread:
    the smallest and largest of the rounds' own medians."""
    pick = (lambda r: r["steps"][:1]) if phase == "prefill" else (lambda r: r["steps"][1:])
    per_round = [[derived(s) for s in pick(r)] for r in rounds]
    out = {}
    for key in per_round[0][0]:
        medians = [statistics.median(d[key] for d in steps) for steps in per_round]
        every = [d[key] for steps in per_round for d in steps]
        out[key] = {"median": statistics.median(every), "min": min(medians), "max": max(medians)}
    return out


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run(args) -> dict:
    loaded = load(args.model)
    for n in args.sizes:  # before any worker starts
        try:
            check_tensor_parallel(loaded.model, n)
        except PagedLearnError as e:
            raise SystemExit(f"--sizes: {e}") from None
    config = loaded.model.config
    layers, hidden, vocab = config.num_hidden_layers, config.hidden_size, config.vocab_size
    special = {config.bos_token_id, config.eos_token_id, config.pad_token_id} - {None}
    sets = [make_prompts(args.batch, args.prompt_len, vocab, special, seed)
            for seed in range(args.repeats + 1)]  # fmt: skip
    print(
        f"model: {args.model} ({config.model_type}, {layers} layers, {config.num_attention_heads}"
        f" heads, hidden {hidden}, vocab {vocab}, {loaded.model.dtype}), device {args.device}\n"
        f"batch: {args.batch} sequences x {args.prompt_len} random prompt tokens (seeds "
        f"0..{args.repeats}: warm-up, then {args.repeats} timed rounds), greedy, EOS ignored, "
        "prefix caching off: "
        f"1 prefill step of {args.batch * args.prompt_len} tokens + {args.steps} decode steps of "
        f"{args.batch} tokens per round"
    )
    llms, results = {}, {}
    try:
        for n in args.sizes:
            t0 = time.perf_counter()
            llms[n] = build(args.model, n, args)
            results[n] = {"start_s": time.perf_counter() - t0, "rounds": []}
        for n, llm in llms.items():  # warm-up: not timed, sizes the step message
            torch.set_num_threads(args.threads if n == 1 else 1)
            seen: list = []
            results[n]["warmup"] = one_round(llm, sets[0], args.steps, "w", seen)
            groups = len(seen[0][0].slots)  # KV-cache groups: one per attention kind
            results[n]["message_bytes"] = {
                phase: len(pickle.dumps(prepare_inputs(seen[i], groups), pickle.HIGHEST_PROTOCOL))
                for phase, i in (("prefill", 0), ("decode", len(seen) - 1))
            }  # the last decode step's: block tables grow over the steps
        for r in range(1, args.repeats + 1):
            for n, llm in llms.items():
                torch.set_num_threads(args.threads if n == 1 else 1)  # see the module docstring
                results[n]["rounds"].append(one_round(llm, sets[r], args.steps, f"r{r}"))
                if n > 1:  # the all-reduce alone, once per round: its spread like the steps'
                    results[n]["rounds"][-1]["all_reduce"] = {
                        phase: max(llm.collective_rpc("time_all_reduce", (tokens,)))
                        for phase, tokens in (("prefill", args.batch * args.prompt_len),
                                              ("decode", args.batch))
                    }  # fmt: skip
        for n in llms:
            res = results[n]
            res["prefill"], res["decode"] = (summarise(res["rounds"], p) for p in PHASES)
            if n > 1:
                res["all_reduce"] = {phase: spread([r["all_reduce"][phase] for r in res["rounds"]])
                                     for phase in PHASES}  # fmt: skip
    finally:
        for llm in llms.values():
            llm.shutdown()
    ref = results[args.sizes[0]]
    for res in results.values():
        pairs = [(a, b) for x, y in zip(ref["rounds"], res["rounds"], strict=True)
                 for a, b in zip(x["tokens"], y["tokens"], strict=True)]  # fmt: skip
        res["same_tokens"], res["sequences"] = sum(a == b for a, b in pairs), len(pairs)
    return {"model": args.model, "layers": layers, "hidden": hidden, "vocab": vocab,
            "batch": args.batch, "prompt_len": args.prompt_len, "steps": args.steps,
            "repeats": args.repeats, "sizes": results}  # fmt: skip


PHASES = ("prefill", "decode")


def ms(stat: dict) -> str:
    """A median and its spread, in ms: ``median [min-max of the rounds' medians]``."""
    return f"{stat['median'] * MS:.3f} [{stat['min'] * MS:.3f}-{stat['max'] * MS:.3f}]"


def report(res: dict) -> None:
    sizes, base = res["sizes"], res["sizes"][1]
    b, p, layers, hidden = res["batch"], res["prompt_len"], res["layers"], res["hidden"]
    for phase in PHASES:
        tokens = b * p if phase == "prefill" else b
        steps = 1 if phase == "prefill" else res["steps"]
        one = base[phase]
        print(
            f"\n{phase} step: {tokens} tokens ({b} sequences), ms; median over {res['repeats']} "
            f"rounds x {steps} step(s) [min-max of the rounds' medians]"
        )
        head = f"{'N':>3}  {'step':>26} {'forward':>26} {'driver':>22}"
        print(f"{head} {'overhead':>10} {'ratio':>7}")
        for n, size in sizes.items():
            st, mine, theirs = size[phase], size[phase]["step"]["median"], one["step"]["median"]
            print(
                f"{n:>3}  {ms(st['step']):>26} {ms(st['forward']):>26} {ms(st['driver']):>22} "
                f"{(mine - theirs) * MS:>+10.3f} {mine / theirs:>6.2f}x"
            )
        for n, size in sizes.items():
            if n == 1:
                continue
            st, ar = size[phase], size["all_reduce"][phase]
            busy = [st[f"busy{r}"] for r in range(n)]
            print(
                f"  N={n}: send {ms(st['send'])}, arrival {ms(st['arrival'])}, busy "
                + ", ".join(f"rank {r} {ms(x)}" for r, x in enumerate(busy))
                + f", return {ms(st['return'])}"
            )
            per_step, busy0 = 2 * layers * ar["median"], busy[0]["median"]
            print(
                f"        all-reduces: one of ({tokens}, {hidden}) float32 = "
                f"{tokens * hidden * 4:,} B takes {ms(ar)} ms alone (per round: the slowest "
                f"rank's median of 20); per step = 2 x {layers} layers x {ar['median'] * MS:.3f} "
                f"= {per_step * MS:.3f} ms = {100 * per_step / busy0:.0f}% of rank 0's busy"
            )
            waits = [st[f"wait{r}"] for r in range(n)]
            print(
                "        in the step, the all-reduces the forward made took (worker."
                "AllReduceClock): "
                + ", ".join(f"rank {r} {ms(x)}" for r, x in enumerate(waits))
                + f" ms; rank 0's busy without them: {(busy0 - waits[0]['median']) * MS:.3f} ms "
                f"(1/{n} of every layer + the whole embeddings and LM head); N=1's forward: "
                f"{one['forward']['median'] * MS:.3f} ms"
            )
            parts = [st["driver"]["median"] - one["driver"]["median"], st["arrival"]["median"],
                     busy0 - one["forward"]["median"], st["return"]["median"]]  # fmt: skip
            overhead = st["step"]["median"] - one["step"]["median"]
            print(
                "        overhead ~ (driver - N=1's) + arrival + (busy - N=1's forward) + return"
                f" = {' + '.join(f'{x * MS:.3f}' for x in parts)} = {sum(parts) * MS:.3f} ms "
                f"(a sum of medians: near, not equal to, {overhead * MS:.3f})"
            )
        print(
            f"  step message: len(pickle.dumps(StepInputs)) = {base['message_bytes'][phase]:,} B;"
            f" logits back = S x vocab x 4 B = {b} x {res['vocab']} x 4 = "
            f"{b * res['vocab'] * 4:,} B"
        )
    print(
        "\nstep = engine.step() wall time; forward = StepStats.forward_time; driver = step - "
        "forward;\nsend = last_timings['send'] (pickle once + N pipe writes); arrival = max over "
        "ranks of received (driver's send start -> worker's receive);\nbusy = the rank's time "
        "handling the step (its forward incl. the all-reduces); return = forward - max over "
        "ranks (received + busy)\n(prepare_inputs + logits back + log-softmax); overhead = "
        "step(N) - step(1); ratio = step(N) / step(1)"
    )
    for n, size in sizes.items():
        if n != 1:
            print(
                f"greedy token ids of N={n} identical to N=1's: {size['same_tokens']}/"
                f"{size['sequences']} sequences ({res['steps'] + 1} tokens each)"
            )
    print("start-up, s (LLM(...) with its workers; the first to start workers starts the fork "
          "server, later ones reuse it): "
          + ", ".join(f"N={n} {size['start_s']:.1f}" for n, size in sizes.items()))  # fmt: skip


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="tiny-gpt2",
        help="tiny-gpt2|tiny-opt|gpt2-size-random|smollm2 (3 KV heads: --sizes 1,3)",
    )  # fmt: skip
    parser.add_argument("--sizes", default="1,2", help="tensor_parallel_size values, 1 first")
    parser.add_argument("--batch", type=int, default=8, help="sequences B")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens P")
    parser.add_argument("--steps", type=int, default=32, help="decode steps K per round")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds")
    parser.add_argument(
        "--threads", type=int, help="N=1's torch threads (default T // 2: T, pagedlearn's count)"
    )
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda: one GPU per worker (NCCL), the model on cuda:0 for N=1",
    )
    parser.add_argument("--quick", action="store_true", help="4 x 16 tokens, 4 steps, 1 round")
    parser.add_argument("--json", metavar="PATH", help="write every number here")
    args = parser.parse_args(argv)
    try:
        args.sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--sizes: comma-separated ints such as 1,2,4, got {args.sizes!r}")
    total = threads_module.chosen.count  # T: set by `import pagedlearn` (cli/threads.py)
    if args.threads is None:
        args.threads = max(1, total // 2)
    if args.quick:
        args.batch, args.prompt_len, args.steps, args.repeats = 4, 16, 4, 1
    if not args.sizes or args.sizes[0] != 1 or len(set(args.sizes)) != len(args.sizes):
        parser.error(f"--sizes: distinct sizes starting with 1 (the baseline), got {args.sizes}")
    if min(args.batch, args.prompt_len, args.steps, args.repeats, args.threads) < 1:
        parser.error("--batch, --prompt-len, --steps, --repeats and --threads must be >= 1")
    load_start = os.getloadavg()[0]
    print(machine_line())
    print(
        f"torch threads: N=1 runs the model in this process with {args.threads}; N>1: each worker"
        f" gets T // N ({', '.join(f'N={n}: {max(1, total // n)}' for n in args.sizes[1:])})"
        f" of the T = {total} pagedlearn chose, and this process (the driver) keeps 1 for "
        "scheduling and sampling"
    )
    t0 = time.perf_counter()
    res = run(args)
    report(res)
    res.update(machine=machine_line(), threads=args.threads, chosen_threads=total,
               load_start=load_start, load_end=os.getloadavg()[0],
               wall_s=time.perf_counter() - t0)  # fmt: skip
    print(f"bench wall time {res['wall_s']:.1f} s; load average (1 min) at the end: "
          f"{res['load_end']:.2f} on {os.cpu_count()} CPUs")  # fmt: skip
    if args.json:
        for s in res["sizes"].values():  # the raw steps stay; the warm-up's go
            s.pop("warmup", None)
        Path(args.json).write_text(json.dumps(res, indent=1))
        print(f"every number: {args.json}")
    return res


if __name__ == "__main__":
    main()
