"""``make demo`` / ``python -m pagedlearn demo``: a real model served from a small paged KV cache.

A mixed batch arrives at once: two chats sharing a system prompt (the second hits the prefix
cache), a short and a long prompt, one request sampling ``n=3`` continuations (forked blocks,
copy-on-write), one beam search (forked beams; losers free their blocks), and one long request
that is cancelled mid-way (its blocks return at once). The pool is sized so that not everything
fits, so requests are preempted and come back (recompute or swap) -- with GPT-2 or OPT; a model
with sliding-window layers (``--model tiny-mistral`` / ``tiny-gemma3``) gets a pool sized the
same way, per KV-cache group, and its windows may hand back enough blocks that nobody is
preempted (the last statistics line counts them). The demo prints what happens
step by step, the outputs, the final statistics (the pool and queues, then the latency, length
and cache-residency percentiles an operator watches), and a map of the physical blocks at the
step with the most sharing. All requests use ``ignore_eos`` so that their lengths, and so the memory
pressure, are the same on every machine.

Without a network or a cached GPT-2, ``--model auto`` uses the offline ``tiny-gpt2`` (random
weights: the text is gibberish, the memory behaviour is real).

Options are checked before the model loads (:func:`check_options`), and against the model's config
right after, before the pool is allocated (:func:`check_for_model`): a block longer than the
model's context could never fill, and a pool beyond :data:`MAX_POOL_BYTES` is a typo, not a demo.
This module imports no torch at load time, so that ``python -m pagedlearn --help`` stays instant.
"""

from __future__ import annotations

import string

from pagedlearn.cli.blocks import format_pool
from pagedlearn.errors import PagedLearnError

MAX_BLOCK_SIZE = 4096  # checked before loading; the model's context bounds it again after
MAX_POOL_BYTES = 2**30  # the whole batch at once: ~1,000 tokens, 75 MiB on GPT-2 (fp32)


class OptionError(PagedLearnError, ValueError):
    """An option the demo cannot run with; ``option`` names it (``"block_size"``), so that the
    command line can report it as ``--block-size``."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


SYSTEM = "You are a concise assistant. Answer in one sentence. "
LONG = (
    "PagedAttention stores the KV cache in fixed-size blocks, like pages of virtual memory, "
    "so that memory is allocated on demand and shared between sequences. "
) * 2


def requests():
    """(request id, prompt, params) of the mixed batch; "cancel" is aborted mid-way."""
    from pagedlearn import BeamSearchParams, SamplingParams  # imports torch: only when used

    sample = dict(ignore_eos=True)
    return [
        ("chat-1", SYSTEM + "What is a KV cache?", SamplingParams(max_tokens=24, **sample)),
        ("chat-2", SYSTEM + "Why use blocks?", SamplingParams(max_tokens=24, **sample)),
        ("short", "Hello!", SamplingParams(max_tokens=8, **sample)),
        ("cancel", "Tell me a long story.", SamplingParams(max_tokens=200, **sample)),
        ("long", LONG, SamplingParams(max_tokens=48, **sample)),
        (
            "n=3",
            "Once upon a time",
            SamplingParams(n=3, max_tokens=32, temperature=0.8, top_p=0.95, seed=0, **sample),
        ),
        (
            "beam",
            "The capital of France is",
            BeamSearchParams(beam_width=3, max_tokens=16, ignore_eos=True),
        ),
    ]


CANCEL_AFTER = 8  # tokens "cancel" generates before its user gives up


def cancel_due(out) -> bool:
    """Whether this step's output is the moment to abort "cancel" (as a user closing a tab)."""
    return (
        out.request_id == "cancel"
        and not out.finished
        and len(out.outputs[0].token_ids) >= CANCEL_AFTER
    )


def default_num_blocks(tokenizer, reqs, block_size: int, num_groups: int = 1) -> int:
    """Room for the largest request alone (all its samples or beams), but about half of what
    all of them need together, so that some requests must be preempted. A model with several
    KV-cache groups (sliding-window layers) takes a prompt's blocks in each group (and its
    windows then free blocks as it decodes: it may need no preemption at all)."""
    need = []
    for _, prompt, p in reqs:
        n_tokens = len(tokenizer.encode(prompt)) + min(p.max_tokens, 64)
        need.append(num_groups * p.n * -(-n_tokens // block_size))
    return max(max(need) + 2, sum(need) // 2)


def check_options(block_size, num_blocks) -> None:
    """What can be checked before loading anything: positive ints, a block of at most
    :data:`MAX_BLOCK_SIZE` tokens. Raises :class:`OptionError`."""
    for name, value in (("block_size", block_size), ("num_blocks", num_blocks)):
        if value is None and name == "num_blocks":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise OptionError(name, f"{name} must be a positive int, got {value!r}")
    if block_size > MAX_BLOCK_SIZE:
        raise OptionError(
            "block_size", f"block_size must be at most {MAX_BLOCK_SIZE}, got {block_size}"
        )


def check_block_size(loaded, block_size: int) -> None:
    """A block no longer than the model's context (a longer one could never fill), else an
    :class:`OptionError` naming ``block_size`` (the server checks its option the same way)."""
    from pagedlearn.models.runner import max_model_len

    context = max_model_len(loaded.model)
    if block_size > context:
        raise OptionError(
            "block_size",
            f"block_size {block_size} is more than {loaded.name}'s context of {context} "
            "tokens: a block that long could never fill",
        )


def check_for_model(
    loaded, block_size: int, num_blocks: int, swap: bool, num_blocks_given: bool = True
) -> None:
    """What needs the model's config, checked before the pool is allocated: a block no longer than
    the model's context (a longer one could never fill), and a pool (plus the CPU swap pool of the
    same size, with ``swap``) of at most :data:`MAX_POOL_BYTES`. Raises :class:`OptionError`
    naming ``num_blocks`` if the user chose it, else ``block_size`` (the default pool grew with
    it)."""
    from pagedlearn.models.runner import kv_cache_spec

    check_block_size(loaded, block_size)
    spec = kv_cache_spec(loaded.model)
    per_token = spec.block_bytes(block_size) // block_size  # one group's layers, if several
    pools = 2 if swap else 1
    nbytes = pools * num_blocks * block_size * per_token
    if nbytes > MAX_POOL_BYTES:
        raise OptionError(
            "num_blocks" if num_blocks_given else "block_size",
            f"{num_blocks} blocks x {block_size} tokens x {per_token:,} B per token"
            + (" x 2 (the swap pool)" if swap else "")
            + f" = {nbytes / 2**30:.2f} GiB of KV cache, more than the demo's "
            f"{MAX_POOL_BYTES / 2**30:.0f} GiB: its whole batch holds about 1,000 tokens at most"
            + (" (leave --num-blocks out for about half of that)" if num_blocks_given else ""),
        )


def run_demo(
    model="auto",
    block_size=16,
    num_blocks=None,
    preemption_mode="recompute",
    attention_backend="auto",
    prefix_caching=True,
    tensor_parallel_size=1,
) -> None:
    from pagedlearn import LLM
    from pagedlearn.models import load
    from pagedlearn.models.runner import kv_cache_spec

    check_options(block_size, num_blocks)  # before the model loads: seconds saved on a typo
    reqs = requests()
    loaded = load(model)
    given = num_blocks is not None
    if not given:  # size the pool from the prompts as this model tokenizes them
        groups = len(kv_cache_spec(loaded.model).groups)
        num_blocks = default_num_blocks(loaded.tokenizer, reqs, block_size, groups)
    check_for_model(loaded, block_size, num_blocks, preemption_mode == "swap", given)
    llm = LLM(
        loaded,
        block_size=block_size,
        num_blocks=num_blocks,
        preemption_mode=preemption_mode,
        attention_backend=attention_backend,
        enable_prefix_caching=prefix_caching,
        tensor_parallel_size=tensor_parallel_size,
    )
    try:
        _run(llm, reqs)
    finally:
        llm.shutdown()  # tensor-parallel workers, if any


def _run(llm, reqs) -> None:
    engine = llm.engine
    labels = {}  # "n=3.1" -> "E1": short names for the pool map
    for letter, (rid, prompt, params) in zip(string.ascii_uppercase, reqs, strict=False):
        engine.add_request(rid, prompt, params)
        for i in range(16):
            labels[f"{rid}.{i}"] = f"{letter}{i}" if params.n > 1 else letter
    print(
        "requests: "
        + ", ".join(
            f"{letter}={rid}"
            for letter, (rid, _, _) in zip(string.ascii_uppercase, reqs, strict=False)
        )
    )

    events = []
    engine.kv.trace.subscribe(lambda e: e.kind == "preempt" and events.append(e))
    # The trace is on anyway (the preemption notes), so timing cached blocks costs little more.
    engine.metrics.track_cache_residency()
    finished, busiest = {}, ((-1, -1), "", "")
    while engine.has_unfinished_requests():
        outputs = engine.step()
        st = engine.last_stats
        notes = [f"preempted {e.seqs[0].rsplit('.', 1)[0]} ({e.info['mode']})" for e in events]
        events.clear()
        for out in outputs:
            if out.finished:
                finished[out.request_id] = out
                notes.append(f"{out.request_id} finished" + (" (failed)" if out.error else ""))
            elif cancel_due(out):
                aborted = finished["cancel"] = engine.abort_request("cancel")  # like a user
                notes.append(
                    f"cancel aborted after {len(aborted.outputs[0].token_ids)} tokens, "
                    "its blocks freed"
                )
        # The map worth showing: the most sharing (forks, cache hits), then the fullest pool.
        score = (engine.kv.allocator.num_shared_blocks, st.used_blocks)
        if score > busiest[0]:
            where = f"step {st.step}: {st.used_blocks} blocks used, {score[0]} shared"
            busiest = (score, where, format_pool(engine.kv, labels, per_row=6, width=9))
        print(
            f"step {st.step:>3}: {st.num_batched_tokens:>4} tokens | running {st.num_running} "
            f"waiting {st.num_waiting} swapped {st.num_swapped} | blocks used "
            f"{st.used_blocks:>3}/{st.num_blocks} cached {st.cached_blocks:>3}"
            + (" | " + "; ".join(notes) if notes else "")
        )

    print("\n== outputs")
    for rid, _, _ in reqs:
        out = finished[rid]
        for c in out.outputs:
            tag = f"{rid}[{c.index}]" if len(out.outputs) > 1 else rid
            print(
                f"  {tag:<8} {c.finish_reason:<6} {len(c.token_ids):>3} tokens, logprob "
                f"{c.cumulative_logprob:8.2f}: {c.text[:48]!r}"
            )
        if out.num_cached_tokens:
            print(f"  {'':<8} (prefix cache: {out.num_cached_tokens} prompt tokens reused)")
    print(f"\n== the pool when the most blocks were shared ({busiest[1]})")
    print(busiest[2])
    print("  (A+B x2: a block shared by A and B, refcount 2; c: free but cached; .: empty)")
    if len(getattr(engine.kv, "groups", ())) > 1:
        print("  (A/F, A/S: A's block in the full-attention or the sliding-window group)")
    print("\n== final statistics")
    print(engine.stats().summary())
    print(engine.stats().timing_summary())
    print(engine.metrics.summary())  # latency and length percentiles, cached blocks' times
    print("\n== the pool at the end")
    print(format_pool(engine.kv, labels, per_row=6, width=9))
    engine.kv.check_invariants()
