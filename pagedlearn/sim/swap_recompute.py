"""Figure 19: swapping vs recomputation, measured for real on this machine.

When the KV pool runs dry, vLLM preempts a request by *swapping* its blocks to CPU memory (and back
later) or by *recomputing* them (free the blocks; later, prefill the prompt and the tokens already
generated again). Kwon et al. (SOSP 2023, Figure 19a) timed both on an A100 with OPT-13B while
varying the block size, and found:

- swapping is expensive for small blocks: vLLM issued one ``cudaMemcpyAsync`` per block (per layer,
  for K and for V), and many small copies over PCIe cannot use its bandwidth;
- recomputation is flat: a prefill does not depend on how the cache is cut into blocks;
- so recomputation wins for small blocks and swapping for large ones, "though recomputation
  overhead is never higher than 20% of swapping's latency"; end to end (Figure 19b) the two are
  comparable for block sizes 16 to 64.

What we time here, with the project's own code, for ``num_tokens`` tokens of one sequence:

- ``swap_out_ms`` / ``swap_in_ms``: :meth:`KVCache.swap_out` / :meth:`KVCache.swap_in` of the
  blocks that hold those tokens -- the engine's path: one gather and one scatter per direction,
  every layer at once (a block sits at the same index in every layer of the slab);
- ``swap_*_per_block_ms``: the same bytes moved as one copy per block, layer, and K or V -- how
  vLLM issued its copies, and what makes small blocks expensive in the paper. This is the
  measurement's comparison (:func:`swap_per_block`), not a path the engine takes;
- ``recompute_ms``: a prefill of the same tokens through :class:`ModelRunner` into the paged cache,
  as the engine's re-prefill after a recompute preemption writes them.

Why our numbers can differ from the paper's: on a CPU the "device" slab is in CPU memory too, so a
swap is a CPU-to-CPU tensor copy (memory bandwidth, tens of GB/s, and no PCIe link; a small copy
costs a few microseconds of framework overhead instead of a DMA launch), while a prefill runs on
CPU cores that do some thousand times fewer FLOP/s than an A100. So recomputation looks far more
expensive here than on a GPU; the shape of the swap curves (many small copies cost more than a
few large ones) is what carries over. The model also differs: a GPT-2-sized model in float32,
not OPT-13B in float16. ``device="cuda"`` measures it on a GPU instead.
Nothing here asserts a timing: the rows are what this machine measured. Every block size is timed
under the same conditions, so that a difference between two block sizes is not a difference
between two moments: all the benches are built and each of their timed calls is made once
(warm-up: torch's lazy set-up, first-touch page faults) before any call is timed; then each of
``repeats`` rounds times every (block size, what) pair once, in an order shuffled anew each round
(seeded). A busy spell on a shared machine then hits random block sizes rather than the ones
that ran at that moment, and shows in the spread (``*_spread_pct``: (slowest - fastest) /
median, in %) instead of bending a curve; the medians resist a few such outliers. A large
spread says: rerun on a quieter machine before reading a shape into that point.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

from pagedlearn.attention.kv_cache import KVCache
from pagedlearn.models import GPT2_SIZE_RANDOM, load
from pagedlearn.models.runner import ModelRunner, SequenceInput, kv_cache_spec, max_model_len

if TYPE_CHECKING:
    from matplotlib.figure import Figure

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
NUM_TOKENS = 512  # per measurement: the paper's Figure 19 does not say; a typical prompt's worth
PAPER_FIG19 = (
    "Paper (Figure 19a, OPT-13B on an A100 over PCIe): swapping is expensive for small blocks "
    "(many small PCIe transfers); recomputation is flat across block sizes; 'recomputation "
    "overhead is never higher than 20% of swapping's latency'; end to end (19b) the two are "
    "comparable for block sizes 16 to 64."
)
FIELDS = (
    "block_size", "num_blocks", "bytes", "swap_out_ms", "swap_in_ms", "swap_out_per_block_ms",
    "swap_in_per_block_ms", "recompute_ms", "recompute_over_swap",
)  # fmt: skip
TIMED = ("recompute_ms", "swap_out_ms", "swap_in_ms", "swap_out_per_block_ms",
         "swap_in_per_block_ms")  # fmt: skip
# Per timed column: (slowest - fastest repetition) / median, in %; after FIELDS in every row.
SPREADS = tuple(c.removesuffix("_ms") + "_spread_pct" for c in TIMED)


@dataclass
class Setup:
    """One block size's bench: a paged cache of ``2 * n`` device blocks (the tokens sit in blocks
    ``0 .. n-1``; swap-in lands in ``n .. 2n-1``, other ids, as a real swap-in would get) and ``n``
    CPU blocks, a runner over it, and the ``tokens`` to prefill."""

    cache: KVCache
    runner: ModelRunner
    tokens: list[int]

    @property
    def num_blocks(self) -> int:  # blocks holding the tokens: ceil(num_tokens / block_size)
        return -(-len(self.tokens) // self.cache.block_size)

    def out_pairs(self) -> list[tuple[int, int]]:  # (device block, CPU block)
        return [(b, b) for b in range(self.num_blocks)]

    def in_pairs(self) -> list[tuple[int, int]]:  # (CPU block, device block)
        return [(b, self.num_blocks + b) for b in range(self.num_blocks)]

    def prefill(self) -> torch.Tensor:
        """Prefill the tokens into blocks ``0 .. n-1``: the recompute. Returns the last logits."""
        bs = self.cache.block_size
        table = list(range(self.num_blocks))
        slots = [table[t // bs] * bs + t % bs for t in range(len(self.tokens))]
        # One KV-cache group (GPT-2's shape): one slot list and one table.
        return self.runner.execute([SequenceInput(self.tokens, 0, [slots], [table])])


def prepare(loaded, block_size: int, num_tokens: int, device="cpu", seed: int = 0) -> Setup:
    """A :class:`Setup` for ``loaded`` (a :class:`~pagedlearn.models.LoadedModel` on ``device``).
    The tokens are random byte ids (seeded): a prefill's cost does not depend on which."""
    model = loaded.model
    n = -(-num_tokens // block_size)
    cache = KVCache(kv_cache_spec(model), 2 * n, block_size, device, num_cpu_blocks=n)
    rng = random.Random(seed)
    tokens = [rng.randrange(min(256, model.config.vocab_size)) for _ in range(num_tokens)]
    return Setup(cache, ModelRunner(model, cache, "torch"), tokens)


def swap_per_block(cache: KVCache, pairs: list[tuple[int, int]], direction: str) -> None:
    """The comparison, not an engine path: move ``pairs`` as vLLM's swap did, one copy per block,
    per layer, for K and for V (``2 * num_layers * len(pairs)`` copies). ``direction`` "out":
    ``(device, cpu)`` pairs; "in": ``(cpu, device)`` pairs. Same bytes as ``cache.swap_out/in``."""
    if direction not in ("out", "in"):
        raise ValueError(f"direction must be 'out' or 'in', got {direction!r}")
    src, dst = (cache.slab, cache.cpu_slab) if direction == "out" else (cache.cpu_slab, cache.slab)
    if src is None or dst is None:
        raise ValueError("this KV cache has no CPU swap pool (num_cpu_blocks=0)")
    for kv in range(2):  # K, then V
        for layer in range(cache.spec.num_layers):
            for s, d in pairs:  # (block_size, num_kv_heads, head_dim) each
                dst[kv, layer, d].copy_(src[kv, layer, s], non_blocking=True)


def _check(block_sizes, num_tokens, repeats):
    if not block_sizes:
        raise ValueError("block_sizes is empty: give at least one block size, e.g. (16,)")
    for name, values in (("block size", block_sizes), ("num_tokens", [num_tokens]),
                         ("repeats", [repeats])):  # fmt: skip
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
            if v < 1:
                raise ValueError(f"{name} must be at least 1, got {v}")


def layout(block_sizes, num_tokens: int, bytes_per_token: int) -> list[dict]:
    """The rows' columns that are not measured: ``block_size``, ``num_blocks`` = ceil(num_tokens
    / block size) and ``bytes`` moved per direction (whole blocks: the last one may be partly
    filled, and a swap copies it whole). Cheap: no model, no timing."""
    rows = []
    for bs in block_sizes:
        n = -(-num_tokens // bs)
        rows.append({"block_size": bs, "num_blocks": n, "bytes": n * bs * bytes_per_token})
    return rows


@torch.inference_mode()
def measure(
    block_sizes=BLOCK_SIZES,
    num_tokens=NUM_TOKENS,
    model="tiny-gpt2",
    repeats=5,
    device="cpu",
    seed=0,
    progress=None,
) -> list[dict]:
    """Time swap out / in (batched, and one copy per block) and recompute per block size.

    ``model``: anything :func:`pagedlearn.models.load` takes, or ``"gpt2-size-random"``. One row
    per block size with :data:`FIELDS` (:func:`layout`'s columns, then the medians in ms of
    ``repeats`` timed calls and ``recompute_over_swap`` = recompute / (swap out + swap in),
    batched) and :data:`SPREADS`. Every call is made once untimed first, then the rounds time
    every (block size, column) pair once each, in an order shuffled by ``seed`` (module
    docstring: the same conditions for every block size). ``progress``: called as
    ``progress(timed calls done, timed calls in all)`` once the warm-up is over (0 done) and after
    each timed call (between the calls, so that its own time is never billed to one).
    """
    _check(block_sizes, num_tokens, repeats)
    loaded = load(model)
    dev = torch.device(device)
    loaded.model.to(dev)
    limit = max_model_len(loaded.model)
    if num_tokens > limit:
        raise ValueError(f"num_tokens={num_tokens} is more than {loaded.name} has positions for "
                         f"({limit})")  # fmt: skip
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    calls = {}  # (block size, column) -> the call it times
    for bs in dict.fromkeys(block_sizes):
        s = prepare(loaded, bs, num_tokens, dev)
        cache, out_pairs, in_pairs = s.cache, s.out_pairs(), s.in_pairs()
        calls |= {  # the prefill first: it fills blocks 0 .. n-1, which the swaps then move
            (bs, "recompute_ms"): s.prefill,
            (bs, "swap_out_ms"): partial(cache.swap_out, out_pairs),
            (bs, "swap_in_ms"): partial(cache.swap_in, in_pairs),
            (bs, "swap_out_per_block_ms"): partial(swap_per_block, cache, out_pairs, "out"),
            (bs, "swap_in_per_block_ms"): partial(swap_per_block, cache, in_pairs, "in"),
        }
    for fn in calls.values():  # warm-up, in the same order for every block size
        fn()
    sync()
    tick, done = progress or (lambda done, total: None), 0
    tick(done, repeats * len(calls))
    times = {key: [] for key in calls}
    order, rng = list(calls), random.Random(seed)
    for _ in range(repeats):
        rng.shuffle(order)
        for key in order:
            sync()  # on a GPU, wait for earlier work so that it is not billed to this call
            t0 = time.perf_counter()
            calls[key]()
            sync()  # ... and for this call's own asynchronous work
            times[key].append(1e3 * (time.perf_counter() - t0))
            done += 1
            tick(done, repeats * len(calls))
    rows = []
    for row in layout(block_sizes, num_tokens, kv_cache_spec(loaded.model).bytes_per_token):
        bs = row["block_size"]
        for column in TIMED:
            row[column] = statistics.median(times[bs, column])
        row["recompute_over_swap"] = row["recompute_ms"] / (row["swap_out_ms"] + row["swap_in_ms"])
        spreads = {}
        for column, name in zip(TIMED, SPREADS, strict=True):
            ts = times[bs, column]
            spreads[name] = 100 * (max(ts) - min(ts)) / statistics.median(ts)
        rows.append({**{k: row[k] for k in FIELDS}, **spreads})
    return rows


def spread_rows(rows) -> list[dict]:
    """The spread of each row's repetitions, for printing beside the medians: ``block_size`` and
    :data:`SPREADS`."""
    return [{"block_size": r["block_size"], **{k: r[k] for k in SPREADS}} for r in rows]


def figure19(quick: bool = False, progress=None) -> list[dict]:
    """Figure 19a on this machine: ``tiny-gpt2``, 4 block sizes, 3 repeats when ``quick``; else
    ``gpt2-size-random`` (GPT-2 small's size), every block size 1..256, 5 repeats. 512 tokens.
    The paper's findings, for a table's notes: :data:`PAPER_FIG19`. ``progress``: as
    :func:`measure`'s."""
    if quick:
        return measure((1, 4, 16, 64), NUM_TOKENS, "tiny-gpt2", repeats=3, progress=progress)
    return measure(BLOCK_SIZES, NUM_TOKENS, GPT2_SIZE_RANDOM, repeats=5, progress=progress)


def plot_figure19(rows, title=None) -> Figure:
    """Lines over block size (log2 axis), in ms (log axis: the curves span orders of magnitude):
    swap out / in batched (solid) and one copy per block (dashed), and recompute."""
    from matplotlib.figure import Figure

    from pagedlearn.sim.plots import OKABE_ITO, _styled

    @_styled
    def draw():
        fig = Figure(figsize=(8, 4.5))
        ax = fig.subplots()
        sizes = [r["block_size"] for r in rows]
        lines = [  # (column, label, colour, line style, marker): out and in often overlap
            ("swap_out_ms", "swap out (batched)", OKABE_ITO[0], "-", "o"),
            ("swap_in_ms", "swap in (batched)", OKABE_ITO[1], "-", "s"),
            ("swap_out_per_block_ms", "swap out (one copy per block)", OKABE_ITO[0], "--", "o"),
            ("swap_in_per_block_ms", "swap in (one copy per block)", OKABE_ITO[1], "--", "s"),
            ("recompute_ms", "recompute (prefill)", OKABE_ITO[2], "-", "D"),
        ]
        for column, label, colour, style, marker in lines:
            ax.plot(sizes, [r[column] for r in rows], style, color=colour, marker=marker,
                    markersize=5, linewidth=2, label=label)  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel("time (ms, median)")
        ax.set_title(title or "Figure 19: swapping vs recomputation, measured on this machine")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        return fig

    return draw()
