"""Peak KV blocks held by one sequence generating 4,096 tokens: sliding window vs full attention.

The model is tiny-mistral (2 layers, every layer sliding with a window of W = 24 tokens), run
on the real engine; the full-attention twin is the same model and weights with its config's
``sliding_window`` set to None (transformers' Mistral then attends to every earlier token, and
pagedlearn builds one full-attention KV-cache group). Both run greedy with ``ignore_eos`` until
the sequence holds ``--tokens`` tokens. Printed per run: the peak blocks the sequence held
(from ``StepStats`` after every step), the bound, the blocks the window handed back, the time.
While it runs, stderr says how many tokens both runs have generated and estimates the time left
from their rate so far (pagedlearn.progress).

The bound for the sliding model: the blocks of the last W positions, at most
ceil(W / block_size) + 1 (kv_cache_groups.sliding_blocks_held), after the prompt's prefill step,
which holds all ceil(prompt / block_size) blocks once. Full attention: ceil(tokens / block_size).

    python benchmarks/bench_hybrid_blocks.py [--tokens 4096] [--block-size 16]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

from pagedlearn import LLM, SamplingParams
from pagedlearn.models import load
from pagedlearn.progress import Progress, write


def run(full_attention: bool, tokens: int, block_size: int, prompt: list[int], progress) -> dict:
    """One sequence grown to ``tokens``; ``progress`` (a :class:`Progress` in generated tokens)
    advances by one per step: each step after the prefill generates one token."""
    loaded = load("tiny-mistral")
    window = loaded.model.config.sliding_window
    if full_attention:
        loaded.model.config.sliding_window = None  # same weights, every key visible
    llm = LLM(loaded, block_size=block_size, num_blocks=-(-tokens // block_size) + 8, verbose=False)
    engine, peak = llm.engine, [0, 0]  # over all steps, over the steps after the prefill
    name = "full attention" if full_attention else f"sliding W={window}"

    def on_stats(st) -> None:
        held = sum(st.group_blocks.values()) if st.group_blocks else st.used_blocks
        peak[0] = max(peak[0], held)
        if st.step > 1:
            peak[1] = max(peak[1], held)
        progress.update(1, name)

    engine.subscribe_stats(on_stats)
    t0 = time.perf_counter()
    params = SamplingParams(max_tokens=tokens - len(prompt), ignore_eos=True)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    held = len(prompt) + len(out.outputs[0].token_ids)
    return {
        "attention": "full" if full_attention else f"sliding W={window}",
        "tokens": held,
        "peak_blocks": peak[0],
        "decode_peak": peak[1],
        "window_freed": engine.stats().window_freed_blocks,
        "seconds": seconds,
        "window": window,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # each result as it comes, even into a pipe
    prompt = list(b"The quick brown fox jumps over the lazy dog, twice over.")  # 56 tokens
    bs = args.block_size
    print(f"machine: {platform.machine()} {platform.processor() or ''}; engine on the CPU")
    print(f"one sequence: prompt {len(prompt)} tokens, grown to {args.tokens} tokens, "
          f"block_size {bs}")  # fmt: skip
    # Progress on stderr (stdout keeps the results): one token per step, both runs.
    progress = Progress("bench_hybrid_blocks", 2 * (args.tokens - len(prompt)), "tokens", every=10)
    for full in (False, True):
        r = run(full, args.tokens, bs, prompt, progress)
        if full:
            bound = f"ceil({r['tokens']} / {bs}) = {-(-r['tokens'] // bs)}"
        else:
            w = r["window"]
            bound = (
                f"max(ceil({len(prompt)} / {bs}) at the prefill, ceil({w} / {bs}) + 1) = "
                f"{max(-(-len(prompt) // bs), -(-w // bs) + 1)}"
            )
        write(  # stdout, clear of the progress bar on a terminal
            f"  {r['attention']:>16}: {r['tokens']} tokens, peak {r['peak_blocks']} blocks held "
            f"(bound: {bound}), {r['decode_peak']} after the prefill step; freed by the "
            f"window {r['window_freed']}; {r['seconds']:.1f} s"
        )
    progress.close()


if __name__ == "__main__":
    main()
