"""How much does the block manager's bookkeeping cost? (Prints numbers; asserts nothing.)

1. One decode step's bookkeeping: ``append_token`` for every running sequence (256 of them),
   with prefix caching off and on, with and without someone listening to the event trace.
2. ``allocate`` / ``free`` / prefix-hit take-out (``incref`` of a free cached block) as the pool
   grows from 1k to 100k blocks. These are O(1), so the time per operation should stay flat.
   For contrast, the same take-out from a ``collections.deque`` (``remove`` scans: O(n)).

Usage: python benchmarks/bench_block_manager.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
from collections import deque

from pagedlearn import BlockAllocator, KVCacheManager


def decode_step_times(num_seqs: int, steps: int, caching: bool, listen: bool) -> list[float]:
    """Seconds per decode step (append_token for all running sequences)."""
    block_size, prompt_len = 16, 100
    blocks_per_seq = -(-(prompt_len + steps) // block_size)
    kv = KVCacheManager(num_seqs * blocks_per_seq, block_size, enable_prefix_caching=caching)
    if listen:
        kv.record()
    rng = random.Random(0)
    for s in range(num_seqs):
        kv.add_sequence(s, [rng.randrange(50_000) for _ in range(prompt_len)])
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        for s in range(num_seqs):
            kv.append_token(s, step)
        times.append(time.perf_counter() - t0)
    return times


def per_op_ns(num_blocks: int, ops: int) -> dict[str, float]:
    """Nanoseconds per allocate(1)+free pair, and per take-out, with a half-full pool."""
    rng = random.Random(0)
    pool = BlockAllocator(num_blocks)
    held = pool.allocate(num_blocks // 2)
    rng.shuffle(held)
    pool.free(held[: num_blocks // 4])  # scramble the free queue
    t0 = time.perf_counter_ns()
    for _ in range(ops):
        pool.free(pool.allocate(1))
    alloc_free = (time.perf_counter_ns() - t0) / ops

    # Prefix-hit take-out: blocks sit in the middle of the cached LRU queue.
    cached = BlockAllocator(num_blocks)
    ids = cached.allocate(num_blocks)
    for b in ids:
        cached.mark_cached(b)
    cached.free(ids)
    picks = [rng.randrange(num_blocks) for _ in range(ops)]
    t0 = time.perf_counter_ns()
    for b in picks:
        cached.incref([b])
        cached.free([b])
    take_out = (time.perf_counter_ns() - t0) / ops

    q = deque(range(num_blocks))  # the O(n) way: deque.remove scans from the left
    deque_ops = max(ops // 10, 10)
    t0 = time.perf_counter_ns()
    for b in picks[:deque_ops]:
        q.remove(b)
        q.append(b)
    naive = (time.perf_counter_ns() - t0) / deque_ops
    return {"alloc+free": alloc_free, "take-out": take_out, "deque take-out": naive}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    args = parser.parse_args()
    num_seqs, steps = (16, 20) if args.quick else (256, 200)
    sizes, ops = ([1_000, 10_000], 2_000) if args.quick else ([1_000, 10_000, 100_000], 50_000)
    print(f"Python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs")

    print(
        f"\n1) decode-step bookkeeping: append_token x {num_seqs} running sequences, "
        f"block_size 16, {steps} steps (one block boundary every 16 steps)"
    )
    print(
        f"{'prefix caching':>15} {'trace':>10} {'median ms':>10} {'mean ms':>8} {'p99 ms':>7} "
        f"{'us/token':>9}"
    )
    for caching in (False, True):
        for listen in (False, True):
            t = sorted(decode_step_times(num_seqs, steps, caching, listen))
            med, mean = statistics.median(t), statistics.fmean(t)
            p99 = t[min(len(t) - 1, int(0.99 * len(t)))]
            print(
                f"{'on' if caching else 'off':>15} {'recorded' if listen else 'off':>10} "
                f"{med * 1e3:>10.3f} {mean * 1e3:>8.3f} {p99 * 1e3:>7.3f} "
                f"{mean / num_seqs * 1e6:>9.2f}"
            )
    print("   per step; us/token = mean step time / running sequences. Steps that cross a block")
    print("   boundary allocate (and, with caching, hash and register the full block): see p99")

    print("\n2) allocator operations vs pool size (ns per operation; O(1) means flat)")
    print(f"{'num_blocks':>10} {'allocate+free':>14} {'hit take-out':>13} {'deque.remove':>13}")
    for n in sizes:
        r = per_op_ns(n, ops)
        print(
            f"{n:>10} {r['alloc+free']:>14.0f} {r['take-out']:>13.0f} {r['deque take-out']:>13.0f}"
        )
    print("   hit take-out = incref of a free cached block (leaves the LRU queue) + free again;")
    print("   deque.remove = the same take-out from a deque, which scans: it grows with the pool")


if __name__ == "__main__":
    main()
