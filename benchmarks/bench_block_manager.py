"""What does the block manager's bookkeeping cost, beside vLLM's and nano-vllm's? (Prints numbers.)

Five workloads, block_size 16, all systems in ONE process (on a shared machine, timings compare
only within a run): each repetition runs every system on a workload back to back, in an order
rotated between repetitions. The table gives medians over repetitions; PL/x is the median over
repetitions of pagedlearn's time / x's time in the same repetition.

  a   decode: 256 sequences with 100-token prompts (admitted untimed), then 200 steps of one new
      token each (a new block every 16; with caching, its hash).  us/token = s / (seqs x steps)
  b   admission: 512 prompts of 512 tokens sharing a 256-token prefix, each admitted (prefix
      lookup, blocks, hashes), then all freed.                    us/request = s / requests
  c1  churn: a pool half full of 4-block sequences (every other one freed), then cycles of
      admitting and freeing a fresh 64-token prompt.              us/cycle = s / cycles
  c2  pool allocate+free: one block out and back in, on a half-full shuffled pool. ns/op = s / ops
  c3  pool hit take-out: a prefix hit on a free cached block (out of the middle of the free
      queue), then free it again.                                 ns/op = s / ops
c1-c3 run at 1k, 10k and 100k blocks: c2 and c3 are O(1), and the last section shows them flat
beside the same take-out from a ``collections.deque`` (``remove`` scans: O(n), like nano-vllm's).

Columns: ``pagedlearn`` (KVCacheManager on its BlockAllocator and PrefixCache: the one
implementation, the classes the labs blank; there is no "plain" column any more, since the fast
twins were folded into them),
and the optional peers, vLLM and nano-vllm (how to get them, how each is driven:
block_manager_peers.py). Every system must end in the same state (blocks used, cached blocks,
prefix-hit tokens...) in every repetition: printed, and each workload marked same, alone (one
system ran: nothing to compare) or MISMATCH.

Usage: python benchmarks/bench_block_manager.py [--quick] [--reps N] [--nanovllm DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import time
from collections import deque
from pathlib import Path
from typing import NamedTuple

from block_manager_peers import BS, PeerMissing, Prepared, load_nanovllm, load_vllm

import pagedlearn
from pagedlearn import BlockAllocator, KVCacheManager

COLUMNS = {"pagedlearn": 11, "vLLM": 9, "nano-vllm": 10}  # name: width
RATIOS = {"PL/vLLM": "vLLM", "PL/nano": "nano-vllm"}


class PagedLearnDriver:
    """pagedlearn's answers to the driver questions (block_manager_peers.py lists them)."""

    caching_modes = (False, True)

    def __init__(self, manager_class, pool_class, version: str, listen: bool = False) -> None:
        self.Manager, self.Pool, self.version = manager_class, pool_class, version
        self.listen = (
            listen  # someone records every block event (trace/events.py): what does it cost?
        )

    def manager(self, nblocks: int, caching: bool) -> KVCacheManager:
        kv = self.Manager(nblocks, BS, enable_prefix_caching=caching)
        if self.listen:
            kv.record()
        return kv

    def requests(self, prompts, tag: str) -> list:
        return [((tag, i), p) for i, p in enumerate(prompts)]  # (sequence id, prompt)

    def admit(self, kv, r) -> int:
        return kv.add_sequence(*r)

    def free(self, kv, r) -> None:
        kv.free_sequence(r[0])

    def state(self, kv, r=None) -> tuple:
        used, cached = kv.stats()["used_blocks"], len(kv.prefix_cache or ())
        return (used, cached, *((len(kv.block_table(r[0])), kv.num_tokens(r[0])) if r else ()))

    def decode_loop(self, kv, reqs, steps: int):
        def run():
            append, ids = kv.append_token, [seq_id for seq_id, _ in reqs]
            for step in range(steps):
                for seq_id in ids:
                    append(seq_id, step)

        return run

    def pool_alloc_free(self, nblocks: int, ops: int, to_free: list[int]) -> Prepared:
        pool = self.Pool(nblocks)
        held = pool.allocate(nblocks // 2)
        pool.free([held[i] for i in to_free])

        def run():
            alloc, free = pool.allocate, pool.free
            for _ in range(ops):
                free(alloc(1))

        return Prepared(run, lambda _: (nblocks - pool.num_free_blocks,))

    def pool_take_out(self, nblocks: int, picks: list[int]) -> Prepared:
        pool = self.Pool(nblocks)
        ids = pool.allocate(nblocks)
        for b in ids:
            pool.mark_cached(b)
        pool.free(ids)  # every block free and cached, in the LRU queue

        def run():  # a prefix hit on a free cached block: incref takes it out of the queue
            incref, free = pool.incref, pool.free
            for b in picks:
                incref([b])
                free([b])

        return Prepared(run, lambda _: (nblocks - pool.num_free_blocks,))


class DequeTakeOut:
    """c3 on a ``collections.deque``, the O(n) way (nano-vllm's): ``remove`` scans from the left."""

    def pool_take_out(self, nblocks: int, picks: list[int]) -> Prepared:
        queue = deque(range(nblocks))

        def run():
            for b in picks:
                queue.remove(b)
                queue.append(b)

        return Prepared(run, lambda _: None)  # not a block manager: no equal-work check


# --- the five workloads: a, b and c1 drive each manager the same way; c2 and c3 its pool ---------
def decode(d, caching, nblocks, prompts, steps) -> Prepared:
    m = d.manager(nblocks, caching)
    reqs = d.requests(prompts, "d")
    for r in reqs:
        d.admit(m, r)
    return Prepared(d.decode_loop(m, reqs, steps), lambda _: d.state(m, reqs[0]))


def admission(d, caching, nblocks, prompts) -> Prepared:
    m = d.manager(nblocks, caching)
    reqs = d.requests(prompts, "b")

    def run():  # through the driver's admit and free: one more call per request, for every system
        admit, free = d.admit, d.free
        hits = sum([admit(m, r) for r in reqs])
        used = d.state(m)[0]
        for r in reqs:
            free(m, r)
        return used, hits

    return Prepared(run, lambda out: (*out, *d.state(m)))


def churn(d, caching, nblocks, fill, cycles) -> Prepared:
    m = d.manager(nblocks, caching)
    held = d.requests(fill, "f")
    for r in held:
        d.admit(m, r)
    for r in held[::2]:
        d.free(m, r)
    reqs = d.requests(cycles, "c")

    def run():
        admit, free = d.admit, d.free
        for r in reqs:
            admit(m, r)
            free(m, r)

    return Prepared(run, lambda _: d.state(m))


def pool_alloc_free(d, nblocks, ops, to_free) -> Prepared:
    return d.pool_alloc_free(nblocks, ops, to_free)


def pool_take_out(d, nblocks, picks) -> Prepared:
    return d.pool_take_out(nblocks, picks)


class Case(NamedTuple):
    label: str  # workload and unit, e.g. "a decode us/token"
    caching: bool | None  # None: the pool workloads, below any prefix cache
    per_run: int  # units (tokens, requests, cycles, ops) in one timed run
    workload: object  # one of the five functions above: (driver, *args) -> Prepared
    args: tuple
    drivers: dict  # system name -> driver, for the systems that can run it

    def prepare(self, system: str) -> Prepared:
        return self.workload(self.drivers[system], *self.args)


def make_cases(drivers: dict, quick: bool) -> list[Case]:
    """The five workloads at full (or --quick) size, each with the systems that can run it."""
    rng = random.Random(1234)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(50_000) for _ in range(n)]

    n_seqs, steps, n_reqs = (16, 20, 32) if quick else (256, 200, 512)
    sizes = [1_000, 10_000] if quick else [1_000, 10_000, 100_000]
    n_cycles, n_ops, n_picks = (200, 2_000, 500) if quick else (2_000, 20_000, 5_000)
    dec_blocks = n_seqs * -(-(100 + steps) // BS)  # the pool holds exactly what decode needs
    dec = (dec_blocks, [tokens(100) for _ in range(n_seqs)], steps)
    prefix = tokens(256)
    requests = [prefix + tokens(256) for _ in range(n_reqs)]
    cycles = [tokens(64) for _ in range(n_cycles)]
    cases = []

    def add(label, per_run, workload, *args, among=drivers):
        caching = args[0] if workload in (decode, admission, churn) else None
        need = "admit" if caching is not None else workload.__name__
        ok = {s: d for s, d in among.items() if hasattr(d, need)}
        ok = {s: d for s, d in ok.items() if caching is None or caching in d.caching_modes}
        cases.append(Case(label, caching, per_run, workload, args, ok))

    tracing = {s: PagedLearnDriver(d.Manager, d.Pool, d.version, listen=True)
               for s, d in drivers.items() if isinstance(d, PagedLearnDriver)}  # fmt: skip
    for c in (False, True):
        add("a decode us/token", n_seqs * steps, decode, c, *dec)
    add("a decode, trace kept us/token", n_seqs * steps, decode, True, *dec, among=tracing)
    for c in (False, True):
        add("b admission us/request", n_reqs, admission, c, 20_000, requests)
    for n in sizes:
        fill = [tokens(64) for _ in range(n // 2 // 4)]  # 4-block sequences filling half the pool
        for c in (False, True):
            add(f"c1 churn {n // 1000}k us/cycle", n_cycles, churn, c, n, fill, cycles)
    for n in sizes:
        to_free = rng.sample(range(n // 2), n // 4)  # a quarter of the pool freed, shuffled
        add(f"c2 allocate+free {n // 1000}k ns/op", n_ops, pool_alloc_free, n, n_ops, to_free)
    for n in sizes:
        picks = [rng.randrange(n) for _ in range(n_picks)]
        among = {**drivers, "deque.remove": DequeTakeOut()}
        add(f"c3 hit take-out {n // 1000}k ns/op", n_picks, pool_take_out, n, picks, among=among)
    return cases


def measure(cases: list[Case], reps: int) -> tuple[dict, dict]:
    """raw[(case index, system)]: one value per repetition, in the case's unit;
    checks[(case index, system)]: the state that system ended in, one per repetition."""
    raw: dict = {}
    checks: dict = {}
    start = time.perf_counter()
    for rep in range(reps):
        for i, c in enumerate(cases):
            systems = list(c.drivers)
            k = rep % len(systems)
            for s in systems[k:] + systems[:k]:  # rotated: no system always runs first
                prepared = c.prepare(s)
                gc.collect()  # the previous system's garbage is not collected in this one's time
                t0 = time.perf_counter()
                out = prepared.run()
                seconds = time.perf_counter() - t0
                scale = 1e9 if c.label.endswith("ns/op") else 1e6
                raw.setdefault((i, s), []).append(seconds / c.per_run * scale)
                checks.setdefault((i, s), []).append(prepared.check(out))
        took, load = time.perf_counter() - start, os.getloadavg()[0]
        print(f"  repetition {rep + 1}/{reps} done: {took:.0f} s, load average {load:.2f}")
    return raw, checks


def fmt(x: float | None, width: int) -> str:
    if x is None:
        return f"{'n/a':>{width}}"
    return f"{x:>{width}.3g}" if x < 1000 else f"{x:>{width}.0f}"


def equal_work(states: dict[str, list]) -> str:
    """The verdict on one workload, from the state each system ended in, per repetition:
    "same" (two or more systems, one state), "alone" (one system: nothing to compare it with) or
    "MISMATCH" (two states anywhere: across systems, or across one system's repetitions).

    >>> equal_work({"pagedlearn": [(1, 2), (1, 2)], "vLLM": [(1, 2), (1, 2)]})
    'same'
    >>> equal_work({"pagedlearn": [(1, 2), (1, 2)]})
    'alone'
    >>> equal_work({"pagedlearn": [(1, 2), (1, 2)], "vLLM": [(1, 2), (1, 3)]})
    'MISMATCH'
    """
    if len({v for vs in states.values() for v in vs}) > 1:
        return "MISMATCH"
    return "same" if len(states) > 1 else "alone"


def report(cases: list[Case], raw: dict, checks: dict, reps: int) -> None:
    print("\nequal work: the state each system ended in, compared across systems and repetitions")
    print("  same: every system ended in this state; alone: one system ran, nothing to compare;")
    print("  MISMATCH: two states (a peer or a repetition did other work: its timings mislead)")
    print("  a: (used blocks, cached blocks, blocks of sequence 0, its tokens)")
    print("  b: (used blocks after admission, prefix-hit tokens, used and cached ones after free)")
    print("  c1: (used blocks, cached blocks)   c2, c3: (used blocks,)")
    verdicts = []
    for i, c in enumerate(cases):  # the deque (c3) is not a block manager: no state to compare
        got = {s: checks[(i, s)] for s in c.drivers if None not in checks[(i, s)]}
        verdicts.append(flag := equal_work(got))
        label = c.label + {None: "", False: " (cache off)", True: " (cache on)"}[c.caching]
        shown = "  ".join(f"{s}={' / '.join(map(str, dict.fromkeys(v)))}" for s, v in got.items())
        print(f"  {flag:<8} {label:<40} {shown}")
    bad = verdicts.count("MISMATCH")
    if bad:
        print(f"  MISMATCH in {bad} of {len(cases)} workloads: compare their timings with care")
    elif "same" in verdicts:
        print(f"  every system ended in the same state in all {len(cases)} workloads")
    else:
        print(f"  only pagedlearn ran (no peer): its {reps} repetitions ended in the same state")

    print(f"\nmedians of {reps} repetitions; PL/x = median over repetitions of (pagedlearn / x "
          "in the same repetition); < 1: pagedlearn is faster")  # fmt: skip
    header = [f"{s:>{w}}" for s, w in COLUMNS.items()] + [f"{r:>9}" for r in RATIOS]
    print(f"{'workload':<30}{'cache':>6}" + "".join(header))
    for i, c in enumerate(cases):
        med = {s: statistics.median(raw[(i, s)]) for s in c.drivers}
        pl = raw[(i, "pagedlearn")]
        ratios = {r: statistics.median(a / b for a, b in zip(pl, raw[(i, s)], strict=True))
                  for r, s in RATIOS.items() if s in c.drivers}  # fmt: skip
        cells = [fmt(med.get(s), w) for s, w in COLUMNS.items()]
        cells += [f"{ratios[r]:>9.2f}" if r in ratios else f"{'n/a':>9}" for r in RATIOS]
        cache = {None: "-", False: "off", True: "on"}[c.caching]
        print(f"{c.label:<30}{cache:>6}" + "".join(cells))
    print("us/token = timed s x 1e6 / (sequences x steps); us/request = s x 1e6 / requests;")
    print("us/cycle = s x 1e6 / cycles; ns/op = s x 1e9 / ops.  n/a: the system is missing here,")
    print("or has no such mode (nano-vllm always caches prefixes)")


def flatness(cases: list[Case], raw: dict) -> None:
    """c2 and c3 against the pool size: an O(1) operation stays flat, a scan grows with the pool."""
    print("\nO(1) check: ns/op against the pool size; growth = ns/op with the largest pool / with "
          "the smallest (1.0 = flat)")  # fmt: skip
    parts = [[i for i, c in enumerate(cases) if c.label.startswith(k)] for k in ("c2", "c3")]
    sizes = [cases[i].label.split()[-2] for i in parts[0]]  # "1k", "10k", ...
    width = 8 * (len(sizes) + 1)
    print(f"{'':<18}" + "".join(f"{t:>{width}}" for t in ("c2 allocate+free", "c3 hit take-out")))
    print(f"{'':<18}" + "".join(f"{t:>8}" for t in [*sizes, "growth"] * 2))
    for s in (*COLUMNS, "deque.remove"):
        cells = ""
        for found in parts:
            meds = [statistics.median(raw[(i, s)]) if (i, s) in raw else None for i in found]
            growth = f"{meds[-1] / meds[0]:>7.2f}x" if None not in meds else f"{'':>8}"
            cells += "".join(fmt(m, 8) for m in meds) + growth
        if (parts[1][0], s) in raw:
            print(f"  {s:<16}{cells}")
    print("  deque.remove: the same take-out from a collections.deque, which scans (nano-vllm's)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test, seconds")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (7; 2 with --quick)")
    parser.add_argument("--nanovllm", metavar="DIR", help="folder holding nanovllm_copy/, or a "
                        "nano-vllm checkout (see block_manager_peers.py)")  # fmt: skip
    parser.add_argument("--json", metavar="PATH", help="write every raw number here")
    args = parser.parse_args()
    reps = args.reps if args.reps is not None else (2 if args.quick else 7)
    if reps < 1:
        parser.error(f"--reps must be >= 1, got {reps}")

    where = ["git", "-C", str(Path(pagedlearn.__file__).parent), "rev-parse", "--short", "HEAD"]
    try:
        commit = subprocess.run(where, capture_output=True, text=True, check=False).stdout.strip()
    except OSError:  # no git on this machine
        commit = ""
    version = f"pagedlearn {pagedlearn.__version__} @ {commit or 'no git'}"
    drivers = {
        "pagedlearn": PagedLearnDriver(KVCacheManager, BlockAllocator, version),
    }
    peers = []
    for name, load in (("vLLM", load_vllm), ("nano-vllm", lambda: load_nanovllm(args.nanovllm))):
        try:
            drivers[name] = load()
            peers.append(f"peer: {drivers[name].version}")
        except PeerMissing as e:
            peers.append(f"peer missing: {e}")
    print(f"Python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f}; {version}")  # fmt: skip
    print("\n".join(peers), flush=True)

    for c in make_cases(drivers, quick=True):  # untimed warm-up: every path once, first calls
        for s in c.drivers:
            c.prepare(s).run()
    cases = make_cases(drivers, args.quick)
    # The peers' imports (torch) leave a big heap: freeze it, as vLLM's engine does after startup,
    # so that collections in the timed loops scan only what the workloads allocate.
    gc.collect()
    gc.freeze()
    raw, checks = measure(cases, reps)
    report(cases, raw, checks, reps)
    flatness(cases, raw)
    if args.json:  # per workload and system: the value of every repetition, and the end state
        runs = [{"workload": c.label, "caching": c.caching, "values": {s: raw[(i, s)] for s in
                 c.drivers}, "end state": {s: checks[(i, s)][-1] for s in c.drivers}}
                for i, c in enumerate(cases)]  # fmt: skip
        info = {"machine": platform.platform(), "python": platform.python_version(), "peers": peers}
        Path(args.json).write_text(json.dumps({**info, "reps": reps, "runs": runs}, indent=1))
        print(f"\nraw numbers: {args.json}")


if __name__ == "__main__":
    main()
