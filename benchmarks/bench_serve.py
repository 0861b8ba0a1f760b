"""What serving over HTTP costs: ``python -m pagedlearn serve`` next to ``LLM.generate``, its
time to first token under Poisson load, and its memory over 10,000 requests.

Every server here is a subprocess (``python -m pagedlearn serve --port P ...``, ready once
``GET /health`` answers 200), so that the client -- this process -- and the server do not share
a GIL. Both systems get the in-process load test's pool (loadtest/in_process.py: blocks of 16
tokens, room for two full-context sequences, a swap pool of a quarter of that, swap preemption,
prefix caching on) and the same number of torch threads (``--torch-threads``, 1 by default: on a
small CPU more threads fight the client and each other).

1. **Server overhead** (per model of ``--models``). The HTTP load test (loadtest/http.py) sends
   its seeded mix at rate inf -- every request of a phase at once, so the server sets the pace
   -- and reads ``output tokens / wall seconds`` and ``answered requests / wall seconds``. Then
   ``LLM.generate`` runs the same mix's requests in-process: the same token-id prompts,
   SamplingParams and cache salts, phase by phase (each phase one ``generate`` call, as the
   HTTP run drains each phase before the next). Two differences make output tokens/s the
   number to compare, not requests/s or tokens: a cancelled request stops after a few tokens
   over HTTP (the client closes its stream) but runs to its ``max_tokens`` in-process, and the
   over-long prompt is refused by both (a 400; an output with ``error``) and counted as
   refused, not answered (answered: finished or cancelled). ``server / generate = server
   tokens/s / generate tokens/s``; a request that failed makes the pair NOT COMPARABLE. A warm-up
   (4 short requests) comes first; then the systems take turns on ``--repeats`` runs (median).
2. **TTFT at two arrival rates** (``--rates``, tiny-gpt2): the HTTP load test at each rate,
   client-side TTFT p50 / p90 / p99 over every answered request (the squeeze phase is a burst
   at any rate; the mix phase's alone is printed too), E2E p99, and what the server's /metrics
   said: peak KV-cache usage, prefix-cache hit rate, preemptions, aborts.
3. **Memory stays flat** (tiny-gpt2): the server's resident set (``VmRSS`` of its pid in
   ``/proc/<pid>/status``) after a warm-up, and after each mark of ``--rss-requests`` short
   requests (a few prompt tokens, ``max_tokens`` 4; streaming and not, completions and chat, a
   few streams closed after the first chunk, a few bad bodies that must get a 400), sent by
   ``--concurrency`` clients at once, to the server parts 1 and 2 used. ``growth = (RSS at
   the last mark - RSS at the first) / (thousands of requests between them)``; with more than
   two marks each step's growth is printed too (a plateau after a warm-up shows there). The
   traffic and the RSS reading are serve_traffic.py.

Times on a small shared CPU swing with what else runs: the script prints the load average at the
start and the end, and every timed run. It prints what it measures and asserts nothing. While it
runs, stderr says which part runs, the time so far, and after each run of parts 1 and 2 the time
left, estimated from the rate of the part's requests so far (pagedlearn.progress); part 3 the
same, from its counted requests (the warm-up's are not counted: they pay for one-off costs).

Usage: python benchmarks/bench_serve.py [--models tiny-gpt2,gpt2-size-random] [--num-requests N]
       [--repeats R] [--rates 10,40] [--rate-requests 200] [--rss-requests 1000,10000]
       [--concurrency 16] [--torch-threads 1] [--parts overhead,ttft,rss] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import platform
import re
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from serve_traffic import memory, print_memory

from pagedlearn import LLM, SamplingParams
from pagedlearn.engine.distribution import percentiles
from pagedlearn.loadtest.http import run_http_loadtest, salt_of
from pagedlearn.loadtest.mix import PHASES, build_mix, default_pool
from pagedlearn.loadtest.report import _json_safe
from pagedlearn.models import load
from pagedlearn.models.runner import max_model_len
from pagedlearn.progress import Progress, Stopwatch

ROOT = Path(__file__).resolve().parent.parent
RATE_MODEL = "tiny-gpt2"  # parts 2 and 3 run on it
BLOCK_SIZE = 16
# (requests, timed runs) per model: about a minute each on 2 busy CPU cores. gpt2-size-random
# gets the mix's smallest size: its squeeze alone is 8 requests x 240 new tokens at ~40 tokens/s.
SIZES = {"tiny-gpt2": (1000, 3), "gpt2-size-random": (27, 1)}
START_TIMEOUT = 180.0  # seconds a server may take to answer /health
REQUEST_TIMEOUT = 600.0  # seconds one request of part 1 may take (a squeezed gpt2-size-random)


def machine_line() -> str:
    import fastapi
    import uvicorn

    return (
        f"Python {platform.python_version()}, torch {torch.__version__}, fastapi "
        f"{fastapi.__version__}, uvicorn {uvicorn.__version__}, httpx {httpx.__version__}; "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}"
    )


class Server:
    """``python -m pagedlearn serve`` in a subprocess with ``pool``: ``url``, ``proc`` (its pid:
    part 3 reads its memory), ``problems()`` (its log's lines that report an error), ``stop()``."""

    def __init__(self, model: str, pool: dict, threads: int) -> None:
        with socket.socket() as s:  # a free port (the server binds it a moment later)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.model, self.url = model, f"http://127.0.0.1:{port}"
        # a file, not a pipe: a full pipe would block the server; closed with this object
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115
        cmd = [sys.executable, "-m", "pagedlearn", "serve", "--model", model, "--port", str(port),
               "--block-size", str(pool["block_size"]), "--num-blocks", str(pool["num_blocks"]),
               "--swap-blocks", str(pool["swap_blocks"]),
               "--preemption-mode", pool["preemption_mode"]]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}  # torch reads it at import
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + START_TIMEOUT
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start; its log ends:\n{self.tail()}")
            time.sleep(0.1)

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def tail(self, lines: int = 20) -> str:
        self.log.seek(0)
        return "".join(self.log.readlines()[-lines:])

    def problems(self) -> list[str]:
        self.log.seek(0)
        return [line.strip() for line in self.log if re.search(r"raised|Traceback|ERROR", line)]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # the CLI's Ctrl-C: srv.stop(), exit 0
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def warm_up(url: str, llm: LLM, model: str) -> None:
    """4 short requests to each system: first calls pay for lazy imports and allocations."""
    prompt = list(range(65, 73))
    for _ in range(4):
        body = {"model": model, "prompt": prompt, "max_tokens": 8}
        httpx.post(url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT)  # any answer
    with contextlib.redirect_stdout(io.StringIO()):
        llm.generate([prompt] * 4, SamplingParams(max_tokens=8), use_tqdm=False)


def generate_run(llm: LLM, specs, progress=None) -> dict:
    """The mix's requests through ``llm.generate``, one call per phase (fresh cache salts);
    ``progress`` (a :class:`Progress` in requests) advances after each phase."""
    run_id, wall, tokens, answered, refused, failed = secrets.token_hex(4), 0.0, 0, 0, 0, 0
    for phase in PHASES:
        group = [s for s in specs if s.phase == phase]
        salts = [salt_of(run_id, phase, s.salt, s.adapter) for s in group]
        prompts = [
            {"prompt_token_ids": list(s.prompt_token_ids), "cache_salt": salt}
            for s, salt in zip(group, salts, strict=True)
        ]
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):  # its note on the refused prompt
            outs = llm.generate(prompts, [s.params for s in group], use_tqdm=False)
        wall += time.perf_counter() - t0
        for o in outs:
            bad = o.error is None and any(c.finish_reason == "error" for c in o.outputs)
            refused, failed = refused + (o.error is not None), failed + bad
            answered += o.error is None and not bad
            tokens += sum(len(c.token_ids) for c in o.outputs)
        if progress is not None:
            progress.update(len(group), f"LLM.generate, {phase} phase")
    return {"wall": wall, "output_tokens": tokens, "answered": answered, "refused": refused,
            "errors": failed}  # fmt: skip


def http_run(url: str, n: int, seed: int, rate: float) -> tuple[dict, object]:
    r = run_http_loadtest(url, num_requests=n, rate=rate, seed=seed, timeout=REQUEST_TIMEOUT)
    c = r.counts
    row = {"wall": r.wall_time, "output_tokens": r.throughput["output_tokens"],
           "answered": c["stopped"] + c["length"] + c["cancelled"], "refused": c["rejected"],
           "errors": c["error"] + c["timeout"] + c["lost"], "ok": r.ok}  # fmt: skip
    return row, r


def overhead(srv: Server, llm: LLM, n: int, repeats: int, seed: int) -> dict:
    """Part 1 for one model: the systems take turns on ``repeats`` runs of the same mix
    (progress on stderr: requests sent, both systems counted)."""
    eng = llm.engine
    nb, sb = eng.kv.allocator.num_blocks, eng.kv.cpu_allocator.num_blocks
    specs = build_mix(n, seed, math.inf, eng.max_model_len, BLOCK_SIZE, nb, sb)
    warm_up(srv.url, llm, srv.model)
    runs: dict[str, list[dict]] = {"server": [], "generate": []}
    same = True
    progress = Progress(f"bench_serve {srv.model} overhead", 2 * n * repeats, "requests", every=5)
    for i in range(1, repeats + 1):
        row, report = http_run(srv.url, n, seed, math.inf)
        sent = {r["id"]: r["prompt_tokens"] for r in report.requests}
        same &= sent == {s.request_id: len(s.prompt_token_ids) for s in specs}
        runs["server"].append(row)
        progress.update(n, f"server run {i}/{repeats}")
        before = progress.done
        try:
            runs["generate"].append(generate_run(llm, specs, progress))
        except Exception as e:  # a step's error, re-raised by generate (its requests aborted)
            runs["generate"].append({"raised": f"{type(e).__name__}: {e}"})
        progress.set(before + n, what=f"LLM.generate run {i}/{repeats}")
    progress.close()
    out = {"num_requests": n, "repeats": repeats, "seed": seed, "same_requests": same,
           "runs": runs}  # fmt: skip
    for name, rows in runs.items():
        done = [r for r in rows if "raised" not in r]
        out[name] = done and {
            "wall": statistics.median(r["wall"] for r in done),
            "answered": done[0]["answered"], "refused": done[0]["refused"],
            "output_tokens": statistics.median(r["output_tokens"] for r in done),
            "tokens_per_s": statistics.median(r["output_tokens"] / r["wall"] for r in done),
            "requests_per_s": statistics.median(r["answered"] / r["wall"] for r in done),
            "errors": sum(r["errors"] for r in done),
            "raised": [r["raised"] for r in rows if "raised" in r],
        }  # fmt: skip
    both = out["server"] and out["generate"]
    out["ratio"] = both and out["server"]["tokens_per_s"] / out["generate"]["tokens_per_s"]
    out["server_log_problems"] = srv.problems()[:3]
    return out


def print_overhead(model: str, o: dict) -> None:
    print(f"\n{model}: {o['num_requests']} requests of the mix (seed {o['seed']}), "
          f"{o['repeats']} timed run(s) per system")  # fmt: skip
    print(f"  {'system':<28} {'wall s':>8} {'answered':>9} {'refused':>8} {'errors':>7} "
          f"{'out tokens':>11} {'tokens/s':>9} {'requests/s':>11}")  # fmt: skip
    names = {"server": "server (HTTP, rate inf)", "generate": "LLM.generate (in-process)"}
    for key, name in names.items():
        s = o[key]
        if not s:
            print(f"  {name:<28} every run raised: {o['runs'][key][0]['raised'][:160]}")
            continue
        print(f"  {name:<28} {s['wall']:>8.2f} {s['answered']:>9} {s['refused']:>8} "
              f"{s['errors']:>7} {s['output_tokens']:>11.0f} {s['tokens_per_s']:>9.1f} "
              f"{s['requests_per_s']:>11.2f}")  # fmt: skip
    print(
        "  tokens/s = output tokens / wall s; requests/s = answered / wall s (median of the "
        "runs); a cancelled request stops early over HTTP but runs to max_tokens in-process: "
        "compare tokens/s"
    )
    if o["ratio"]:
        print(
            f"  server / generate = {o['server']['tokens_per_s']:.1f} / "
            f"{o['generate']['tokens_per_s']:.1f} tokens/s = {o['ratio']:.2f}x"
        )
    walls = {k: ", ".join(f"{r['wall']:.2f}" if "wall" in r else "raised" for r in rows)
             for k, rows in o["runs"].items()}  # fmt: skip
    print(f"  timed runs (s): server {walls['server']}; generate {walls['generate']}")
    same = "yes" if o["same_requests"] else "NO"
    print(f"  the same requests in both (ids, prompt lengths): {same}")
    failed = {k: (s["errors"], len(s["raised"])) if s else (None, o["repeats"])
              for k, s in ((k, o[k]) for k in names)}  # fmt: skip
    if any(any(v) for v in failed.values()) or o["server_log_problems"]:
        print(
            "  NOT COMPARABLE: failed requests / raised runs: "
            + ", ".join(f"{k} {e} / {r}" for k, (e, r) in failed.items())
            + f"; the server's log: {(o['server_log_problems'] or ['nothing'])[0][:200]}"
        )
    for k in names:
        if o[k] and o[k]["raised"]:
            print(f"  {k} raised: {o[k]['raised'][0][:200]}")


def ttft_at_rates(srv: Server, rates: list[float], n: int, seed: int) -> dict:
    """Part 2: the HTTP load test at each rate; client-side latency, server-side numbers."""
    out = {}
    progress = Progress(f"bench_serve {RATE_MODEL} TTFT", n * len(rates), "requests")
    for rate in rates:
        _, r = http_run(srv.url, n, seed, rate)
        progress.update(n, f"rate {rate:g}/s")
        mix = [q["ttft"] for q in r.requests if q["phase"] == "mix" and q["ttft"] is not None]
        s = r.server
        out[rate] = {"ttft": r.latency["ttft"], "e2e": r.latency["e2e"], "itl": r.latency["itl"],
                     "ttft_mix": percentiles(mix), "wall": r.wall_time,
                     "requests_per_s": r.throughput["requests_per_s"], "ok": r.ok,
                     "peak_kv_usage": s["peak_kv_usage"], "hit_rate": s["hit_rate"],
                     "preemptions": s["preemptions"], "aborts": s["aborts"]}  # fmt: skip
    progress.close()
    return out


def print_ttft(t: dict, n: int) -> None:
    print(f"\ntime to first token, {RATE_MODEL} over HTTP, {n} requests of the mix per rate "
          "(client's clock, ms)")  # fmt: skip
    print(f"  {'rate/s':>7} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'mix p99':>8} {'E2E p99':>8} "
          f"{'answered/s':>11}  server (/metrics)")  # fmt: skip
    for rate, d in t.items():
        ms = [1e3 * d["ttft"][f"p{q}"] for q in (50, 90, 99)] + [1e3 * d["ttft_mix"][99]]
        kv = d["peak_kv_usage"]
        print(
            f"  {rate:>7g} "
            + " ".join(f"{x:>8.1f}" for x in ms)
            + f" {1e3 * d['e2e']['p99']:>8.1f}"
            f" {d['requests_per_s']:>11.2f}  peak KV {100 * (kv or 0):.0f}%, hit rate "
            f"{100 * d['hit_rate']:.1f}%, preemptions {d['preemptions']:.0f}, aborts "
            f"{d['aborts']:.0f}, checks {'ok' if d['ok'] else 'FAILED'}"
        )
    print("  TTFT: every answered request; mix p99: the Poisson phase alone (the squeeze is a "
          "burst at any rate); answered/s = (finished + cancelled) / wall s")  # fmt: skip


def numbers(text: str, kind=float) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--models", default=None, help="default: tiny-gpt2,gpt2-size-random")
    parser.add_argument("--num-requests", type=int, default=None, help="part 1 (default: SIZES)")
    parser.add_argument("--repeats", type=int, default=None, help="part 1's timed runs per system")
    parser.add_argument("--rates", default="10,40", help="part 2's arrival rates, requests/s")
    parser.add_argument("--rate-requests", type=int, default=200, help="part 2's requests per rate")
    parser.add_argument("--rss-requests", default="1000,10000", help="part 3's marks")
    parser.add_argument("--rss-warmup", type=int, default=200, help="part 3's warm-up requests")
    parser.add_argument("--concurrency", type=int, default=16, help="part 3's requests at once")
    parser.add_argument("--torch-threads", type=int, default=1, help="each system's (CPU)")
    parser.add_argument("--parts", default="overhead,ttft,rss")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="write every number here")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: tiny-gpt2, 27 requests, 1 run, small marks",
    )
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    models = args.models or ("tiny-gpt2" if args.quick else "tiny-gpt2,gpt2-size-random")
    models = [m for m in models.split(",") if m] if "overhead" in parts else []
    if args.quick:
        args.num_requests, args.repeats = args.num_requests or 27, args.repeats or 1
        args.rate_requests, args.rss_requests, args.rss_warmup = 27, "40,100", 20
    rates, marks = numbers(args.rates), numbers(args.rss_requests, int)
    if len(marks) < 2 or marks != sorted(set(marks)) or marks[0] < 1:
        parser.error(f"--rss-requests: two or more growing counts (1000,10000), got {marks}")
    if not all(r > 0 for r in rates):
        parser.error(f"--rates: requests per second > 0 (inf: all at once), got {rates}")
    torch.set_num_threads(args.torch_threads)
    sys.stdout.reconfigure(line_buffering=True)  # each result as it comes, even into a pipe
    print(machine_line())
    print(f"torch threads: {args.torch_threads} in each system (server: OMP_NUM_THREADS)")
    results: dict = {"machine": machine_line(), "overhead": {}}
    wanted = models + [RATE_MODEL] * bool({"ttft", "rss"} & parts and RATE_MODEL not in models)
    watch = Stopwatch()

    def say(what: str) -> None:  # what starts now, on stderr (stdout keeps the results)
        watch.note(f"bench_serve: {what}")

    for model in wanted:
        say(f"{model}: loading it, starting its server")
        loaded = load(model)
        nb, sb = default_pool(max_model_len(loaded.model), BLOCK_SIZE)
        pool = {"block_size": BLOCK_SIZE, "num_blocks": nb, "swap_blocks": sb,
                "preemption_mode": "swap"}  # fmt: skip
        print(f"\n{model}: pool of {nb} blocks of {BLOCK_SIZE} tokens, swap pool {sb} blocks, "
              "swap preemption, prefix caching on (both systems)")  # fmt: skip
        with Server(model, pool, args.torch_threads) as srv:
            if model in models:
                n, repeats = SIZES.get(model, (200, 1))
                n, repeats = args.num_requests or n, args.repeats or repeats
                say(f"{model} overhead: a warm-up, then {repeats} run(s) of {n} requests each way")
                llm = LLM(loaded, verbose=False, **pool)
                o = overhead(srv, llm, n, repeats, args.seed)
                del llm
                print_overhead(model, o)
                results["overhead"][model] = o
            if model == RATE_MODEL and "ttft" in parts:
                n = args.rate_requests
                say(f"{RATE_MODEL} TTFT: {n} requests at each of {len(rates)} rate(s)")
                results["ttft"] = ttft_at_rates(srv, rates, args.rate_requests, args.seed)
                print_ttft(results["ttft"], args.rate_requests)
            if model == RATE_MODEL and "rss" in parts:
                pid = srv.proc.pid
                say(
                    f"{RATE_MODEL} memory: {args.rss_warmup} requests to warm up, then "
                    f"{marks[-1]:,} (the estimate starts after the warm-up)"
                )
                label = f"bench_serve {RATE_MODEL} memory"
                progress = Progress(label, marks[-1], "requests", every=5)
                results["rss"] = memory(
                    srv.url, srv.model, pid, marks, args.rss_warmup, args.concurrency,
                    progress=progress.set,
                )  # fmt: skip
                progress.close()
                print_memory(results["rss"], RATE_MODEL, pid)
    print(f"bench_serve: done in {watch}", file=sys.stderr, flush=True)
    print(f"\nload average (1 min) at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    if args.json:
        Path(args.json).write_text(json.dumps(_json_safe(results), indent=1, default=str))
        print(f"every number: {args.json}")


if __name__ == "__main__":
    main()
