"""The three systems bench_engine.py times, as functions of (prompts, max tokens per prompt).

Each takes a list of prompts (token ids), a list of ``max_tokens`` (one per prompt) and ``eos``:
an EOS id that ends a request early, or ``None`` for fixed-length runs (EOS ignored). Each
returns every prompt's new token ids, cut to what the request asked for (:func:`cut`), greedy.

- pagedlearn ``LLM.generate`` (bench_engine.py builds it: it needs the engine's stats);
- :func:`hf_padded_batches`: transformers ``model.generate()`` on left-padded batches of
  ``batch_size`` prompts in arrival order. A batch runs until its longest request is done
  (its largest ``max_tokens``, or every row at EOS): a padded batch has one length;
- :func:`hf_continuous`: transformers continuous batching, the manager ``generate_batch``
  drives (its own paged cache, a background thread), with one ``add_request`` per prompt so
  that each request has its own ``max_new_tokens``. The manager persists between calls.

:class:`Runner` times one call of a system; :func:`spread` and :func:`same_count` summarize runs.
"""

from __future__ import annotations

import copy
import os
import platform
import random
import statistics
import time

import torch

PAGED, PADDED, CB = (
    "pagedlearn LLM.generate",
    "transformers generate",
    "transformers generate_batch",
)
PAGE_SIZE = 256  # transformers' default page size for generate_batch (tokens per page)


def machine_line(device: str = "cpu") -> str:
    """Machine, versions, threads and load: what a reader needs to judge any timing after it."""
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = f", GPU {torch.cuda.get_device_name()}" if device == "cuda" else ""
    return (
        f"machine: {cpu}, {os.cpu_count()} CPUs{gpu}; Python {platform.python_version()}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}; torch threads "
        f"{torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}"
    )


def short_reason(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:160]


def make_prompts(n: int, vocab: int, special: set, seed: int, lo=8, hi=128) -> list[list[int]]:
    """``n`` prompts of random token ids (no special token), lengths uniform in lo..hi."""
    rng = random.Random(seed)
    ids = [t for t in range(vocab) if t not in special]
    return [[rng.choice(ids) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def cut(tokens: list[int], max_tokens: int, eos: int | None) -> list[int]:
    """A request's output as it asked for it: at most ``max_tokens`` tokens, up to and
    including the first EOS (a padded batch's row runs on past both, with pads)."""
    tokens = list(tokens[:max_tokens])
    if eos is not None and eos in tokens:
        tokens = tokens[: tokens.index(eos) + 1]
    return tokens


def hf_padded(model, prompts, max_tokens: int, pad_id, device):
    """One left-padded batch, exactly ``max_tokens`` new tokens each (EOS ignored): what
    bench_memory_bound.py calls."""
    return hf_padded_batches(model, prompts, [max_tokens] * len(prompts), None, pad_id, device)


def hf_padded_batches(model, prompts, max_tokens, eos, pad_id, device, batch_size=None):
    """transformers generate() on left-padded batches (attention_mask) of ``batch_size``
    prompts (default: all in one) in arrival order."""
    batch_size = batch_size or len(prompts)
    outs = []
    for i in range(0, len(prompts), batch_size):
        chunk, limits = prompts[i : i + batch_size], max_tokens[i : i + batch_size]
        width, longest = max(map(len, chunk)), max(limits)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        cfg = copy.deepcopy(model.generation_config)
        cfg.update(
            max_new_tokens=longest,
            min_new_tokens=longest if eos is None else 0,  # fixed length: nothing stops it
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=pad_id,
        )
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        rows = out[:, width:].tolist()
        outs += [cut(row, m, eos) for row, m in zip(rows, limits, strict=True)]
    return outs


def cb_config(capacity: int, budget: int, max_seqs: int):
    """generate_batch's settings: ``capacity`` tokens of KV cache in pages of PAGE_SIZE, at
    most ``budget`` tokens and ``max_seqs`` requests in a step."""
    from transformers import ContinuousBatchingConfig

    return ContinuousBatchingConfig(
        page_size=PAGE_SIZE,
        num_blocks=-(-capacity // PAGE_SIZE),
        max_batch_tokens=budget,
        max_requests_per_batch=max_seqs,
    )


def hf_continuous(model, prompts, max_tokens, eos, config):
    """transformers continuous batching: every prompt added at once, results in prompt order.

    What ``generate_batch`` does (add the requests, read results until all are finished), but
    with one ``max_new_tokens`` and EOS per request: generate_batch takes one for all."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0)
    with model.continuous_batching_context_manager(
        generation_config=cfg,
        continuous_batching_config=config,
        block=True,
        timeout=5,
        persistent_manager=True,
    ) as manager:
        ids = [
            manager.add_request(p, max_new_tokens=m, eos_token_id=-1 if eos is None else eos)
            for p, m in zip(prompts, max_tokens, strict=True)
        ]
        done = {}
        while len(done) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError(f"its generation thread stopped with {len(done)}/{len(ids)}")
    errors = [r.error for r in done.values() if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
    pairs = zip(ids, max_tokens, strict=True)
    return [cut(list(done[i].generated_tokens), m, eos) for i, m in pairs]


def spread(xs, fmt="{:.3f}") -> str:
    """``median (min..max)``."""
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}..{fmt.format(max(xs))})"


class Runner:
    """Times calls of the systems; a generate_batch failure is reported and drops it (only it
    may fail: its manager is young), any other failure is raised."""

    def __init__(self, systems, sync) -> None:
        self.systems, self.sync, self.failed = systems, sync, {}

    def names(self):
        return [n for n in self.systems if n not in self.failed]

    def __call__(self, name, prompts, limits, eos=None, batch=None):
        """(seconds, outputs) of one call, or None if it failed (now or before)."""
        if name in self.failed:
            return None
        self.sync()
        t0 = time.perf_counter()
        try:
            out = self.systems[name](prompts, limits, eos, batch or len(prompts))
        except Exception as e:
            if name != CB:
                raise
            self.failed[name] = short_reason(e)
            print(f"{name}: unavailable here: {self.failed[name]}")
            return None
        self.sync()
        return time.perf_counter() - t0, out


def same_count(outs, ref) -> str:
    """``same/total``: the requests of the runs ``outs`` whose tokens equal those in ``ref``."""
    ours = [t for run in ref for t in run]
    theirs = [t for run in outs for t in run]
    return f"{sum(a == b for a, b in zip(ours, theirs, strict=True))}/{len(ours)}"
