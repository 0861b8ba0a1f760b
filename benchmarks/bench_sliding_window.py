"""Does a sliding window make decode cheaper? Blocks read (CPU) or time (GPU), 32k tokens, W = 4096.

A decode step with ``sliding_window=W`` sees only its last ``W`` keys, and
``kernels.paged_attention_decode`` starts its tiles at the window: the blocks before it are never
loaded. Decode is bound by memory bandwidth, so its time should follow the bytes it reads:

    blocks read per sequence and KV head = (n - 1) // bs - max(0, n - W) // bs + 1
                                        <= ceil((W - 1) / bs) + 1        (no window: ceil(n / bs))
    tokens streamed                      = min(W, n)                      (no window: n)
    expected time ratio (window / none) ~= min(W, n) / n                  (4096 / 32768 = 0.125)

with n = context_len, bs = block_size.

- Without a CUDA GPU (Triton's CPU interpreter) it *counts* instead of timing: for one sequence of
  32,768 tokens (block_size 16, 4 query heads on 1 KV head, head_dim 16, float32) it runs the
  kernel with every load recorded (``kernels.count_loads``) and prints the distinct K/V blocks
  read, the tokens streamed and the block-table entries looked up, next to the formula. In the
  windowed run the table entries before the window are set to -1 and their blocks filled with
  NaN, as after the KV-cache manager freed them: the output must stay equal to the reference.
- On a CUDA GPU it times decode at 32k with W = 4096 and without a window (GQA shape: 32 query
  heads, 8 KV heads, head_dim 128, float16, block_size 16; batch 1 and 8; num_splits 1 and
  ``suggest_num_splits``), with CUDA events around each call and the L2 cache flushed before it;
  it prints the median, min and max of the repeats, and the ratio of medians. It asserts nothing.

Usage: python benchmarks/bench_sliding_window.py [--context N] [--window W] [--repeats R]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

CONTEXT, WINDOW, BLOCK_SIZE = 32768, 4096, 16
FORMULA = [
    "blocks = (n - 1) // bs - max(0, n - W) // bs + 1 <= ceil((W - 1) / bs) + 1;"
    "  no window: ceil(n / bs)",
    "tokens = min(W, n);  expected time ratio ~= min(W, n) / n",
]


def make_case(n, num_heads, num_kv_heads, head_dim, dtype, device, batch=1, seed=0):
    """``batch`` sequences of ``n`` tokens in shuffled blocks of BLOCK_SIZE, and their queries."""
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-n // BLOCK_SIZE)
    num_blocks = batch * per_seq + 2
    ids = torch.randperm(num_blocks, generator=g)[: batch * per_seq]
    tables = ids.view(batch, per_seq).to(torch.int32).to(device)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k, v = (torch.randn(shape, generator=g).to(dtype).to(device) for _ in "kv")
    q = torch.randn(batch, num_heads, head_dim, generator=g).to(dtype).to(device)
    return q, k, v, tables, torch.full((batch,), n, dtype=torch.int32, device=device)


def blocks_formula(n: int, window: int | None) -> str:
    if window is None:
        return f"ceil({n} / {BLOCK_SIZE}) = {-(-n // BLOCK_SIZE)}"
    start = max(0, n - window)
    value = (n - 1) // BLOCK_SIZE - start // BLOCK_SIZE + 1
    bound = -(-(window - 1) // BLOCK_SIZE) + 1
    return (
        f"({n} - 1) // {BLOCK_SIZE} - {start} // {BLOCK_SIZE} + 1 = {value}"
        f" (bound ceil(({window} - 1) / {BLOCK_SIZE}) + 1 = {bound})"
    )


def cpu_main(n: int, window: int) -> None:
    """Count what the interpreted kernel loads, with and without the window."""
    from kernels.count_loads import decode_loads, expected_blocks
    from pagedlearn.attention import paged_attention_ref

    q, k, v, tables, lens = make_case(n, 4, 1, 16, torch.float32, "cpu")
    print(
        f"one sequence of {n} tokens, block_size {BLOCK_SIZE}, 4 query heads on 1 KV head, "
        "head_dim 16, float32"
    )
    for line in FORMULA:
        print("  " + line)
    print(
        f"{'window':>8} {'splits':>6} {'K blocks':>9} {'V blocks':>9} {'table':>6} {'tokens':>7} "
        f"{'expected':>9} {'err':>8} {'interp s':>9}  formula"
    )
    counts = {}
    for w in (None, window):
        if w is not None:  # as after the manager freed them: -1 entries, NaN in their blocks
            first = max(0, n - w) // BLOCK_SIZE
            k[tables[0, :first].long()] = float("nan")
            v[tables[0, :first].long()] = float("nan")
            tables = tables.clone()
            tables[0, :first] = -1
        ref = paged_attention_ref(q, k, v, tables, lens, sliding_window=w)
        for splits in (1, 4):
            t0 = time.perf_counter()
            out, loads = decode_loads(q, k, v, tables, lens, splits, sliding_window=w)
            seconds = time.perf_counter() - t0
            err = (out - ref).abs().max().item()
            expected = expected_blocks(n, BLOCK_SIZE, w)
            counts[w] = (len(loads.key_blocks), loads.key_slots)
            print(
                f"{w or 'none':>8} {splits:>6} {len(loads.key_blocks):>9} "
                f"{len(loads.value_blocks):>9} {len(loads.table_entries):>6} "
                f"{loads.key_slots:>7} {expected:>9} {err:>8.1e} {seconds:>9.1f}  "
                f"{blocks_formula(n, w)}"
            )
    (b_none, t_none), (b_w, t_w) = counts[None], counts[window]
    print(
        f"window / none: blocks {b_w} / {b_none} = {b_w / b_none:.4f}, tokens {t_w} / {t_none} = "
        f"{t_w / t_none:.4f}; W / n = {window / n:.4f}"
    )
    print(
        "table = block-table entries looked up; err = max abs diff from paged_attention_ref with "
        "the same window (in the windowed rows, the blocks before the window hold NaN and their "
        "entries -1: a finite err shows they were never read)"
    )


def time_cuda(fn, repeats: int, flush: torch.Tensor) -> list[float]:
    """Milliseconds of ``fn()`` per repeat, CUDA events around the call, L2 flushed before."""
    fn()  # warm-up: compiles the kernel for these constants
    times = []
    for _ in range(repeats):
        flush.zero_()  # evict the previous run's K/V from the L2 cache
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def gpu_rows(batch, n, window, repeats, shape, flush):
    """Time one batch size with and without the window; print a row per (window, num_splits)."""
    from kernels.decode_attention import paged_attention_decode, suggest_num_splits
    from pagedlearn.attention import paged_attention_ref

    heads, kv_heads, head_dim = shape
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    q, k, v, tables, lens = make_case(n, heads, kv_heads, head_dim, torch.float16, "cuda", batch)
    medians = {}  # (num_splits is 1, window) -> median ms
    for w in (None, window):
        tokens = n if w is None else min(w, n)
        nbytes = batch * tokens * kv_heads * head_dim * 2 * 2  # K and V, fp16
        ref = paged_attention_ref(q[:1], k, v, tables[:1], lens[:1], sliding_window=w)
        for splits in sorted({1, suggest_num_splits(batch, kv_heads, tokens, num_sms)}):

            def fn(splits=splits, w=w):
                return paged_attention_decode(
                    q, k, v, tables, lens, num_splits=splits, sliding_window=w
                )

            err = (fn()[:1].float() - ref.float()).abs().max().item()
            ms = time_cuda(fn, repeats, flush)
            med = medians[splits == 1, w] = statistics.median(ms)
            base = medians.get((splits == 1, None))
            ratio = f"{med / base:>7.3f}" if base else f"{'-':>7}"
            print(
                f"{batch:>5} {w or 'none':>7} {splits:>6} {med:>10.4f} {min(ms):>8.4f} "
                f"{max(ms):>8.4f} {nbytes / (med / 1e3) / 1e9:>7.0f} {ratio} {err:>8.1e}",
                flush=True,
            )


def gpu_main(n: int, window: int, repeats: int) -> None:
    shape = (32, 8, 128)  # query heads, KV heads, head_dim
    print(f"{torch.cuda.get_device_name(0)}")
    print(
        f"context {n}, block_size {BLOCK_SIZE}, {shape[0]} query heads, {shape[1]} KV heads, "
        f"head_dim {shape[2]}, float16; {repeats} repeats, L2 flushed before each"
    )
    for line in FORMULA:
        print("  " + line)
    flush = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    print(
        f"{'batch':>5} {'window':>7} {'splits':>6} {'median ms':>10} {'min':>8} {'max':>8} "
        f"{'GB/s':>7} {'x none':>7} {'err':>8}"
    )
    for batch in (1, 8):
        gpu_rows(batch, n, window, repeats, shape, flush)
        torch.cuda.empty_cache()
    print(
        "x none = median / median without a window, both with num_splits 1 or both suggested "
        f"(expect about W / n = {window / n:.3f} if skipped blocks cost nothing); GB/s counts "
        "only the K/V the window needs; err = max abs diff from paged_attention_ref (sequence 0)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=CONTEXT, help="tokens per sequence")
    parser.add_argument("--window", type=int, default=WINDOW, help="sliding window W")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per row (GPU)")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    if not on_gpu:  # before triton is imported: its own tl.* helpers are jitted at import time
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton

    print(f"{platform.machine()}, torch {torch.__version__}, triton {triton.__version__}")
    if on_gpu:
        gpu_main(args.context, args.window, args.repeats)
        return
    print("No CUDA GPU (or TRITON_INTERPRET=1): counting the loads in Triton's CPU interpreter.")
    cpu_main(args.context, args.window)


if __name__ == "__main__":
    main()
