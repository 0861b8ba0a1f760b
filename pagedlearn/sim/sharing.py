"""Figure 15: memory saved when the sequences of one request share blocks (copy-on-write).

Parallel sampling and beam search run several sequences per request. Paging lets them share the
blocks they have in common -- the prompt, and for beams a common prefix of generated tokens --
and copy a block only when one of them writes into a shared one. Here every request's sequences
run on the real :class:`~pagedlearn.KVCacheManager` (``fork``, ``append_token`` with its
copy-on-write, ``free_sequence``), and at every step we compare the blocks in use with the blocks
the same sequences would hold without sharing (each its own ``ceil(len / block_size)``):

    saved = 1 - sum over steps of blocks in use / sum over steps of blocks without sharing

summed over all steps of all requests, so a long request weighs as much as it occupies memory.

The model of what the sequences do (ours; the paper does not spell it out):

- **Parallel sampling, n samples**: all n share the prompt; each then generates its own tokens
  and stops at its own EOS, its output length drawn independently from the workload's outputs.
- **Beam search, width k**: k beams extend by one token per step for the request's output length.
  Top-k selection keeps some beams' continuations and drops others: with probability
  ``divergence`` per beam per step, a beam is dropped and replaced by a fork of another beam
  (which had two good continuations). Beams that die free their blocks; the fork shares all of its
  parent's. ``divergence`` is swept: 0 means the beams never re-fork and share only the prompt.
"""

import random

from pagedlearn.core.kv_cache_manager import KVCacheManager
from pagedlearn.sim.workloads import paper_workload

DIVERGENCE = 0.1  # our prior choice: a beam is replaced about every 10 steps (swept below)
# Figure 15, % memory saved by sharing (Alpaca, OPT-13B); the paper gives ShareGPT as ranges.
PAPER_FIG15 = {
    ("alpaca", "parallel"): {2: 6.09, 4: 8.53, 6: 9.79},
    ("alpaca", "beam"): {2: 37.56, 4: 53.13, 6: 55.16},
    ("sharegpt", "parallel"): "16.2-30.5",
    ("sharegpt", "beam"): "44.3-66.3",
}


def _blocks(n_tokens: int, block_size: int) -> int:
    return -(-n_tokens // block_size)


def run_request(req, mode, width, output_lens, divergence, block_size, rng):
    """(blocks in use, blocks without sharing), summed over the steps of one request."""
    longest = req.prompt_len + max(output_lens)
    kv = KVCacheManager(width * _blocks(longest, block_size) + width, block_size)
    kv.add_sequence(0, [0] * req.prompt_len)
    for child in range(1, width):
        kv.fork(0, child)
    alive = dict(enumerate(output_lens))  # sequence id -> tokens it still has to generate
    next_id, used, unshared = width, 0, 0
    while alive:
        for seq, left in list(alive.items()):
            kv.append_token(seq, 0)  # copy-on-write happens here when a block is shared
            alive[seq] = left - 1
        kv.pop_copies()  # the (src, dst) copies an engine would apply to the KV tensors
        if mode == "beam":
            for seq in list(alive):
                if len(alive) > 1 and rng.random() < divergence:
                    parent = rng.choice([s for s in alive if s != seq])
                    kv.free_sequence(seq)
                    kv.fork(parent, next_id)  # the dropped beam's slot goes to a copy of parent
                    alive[next_id] = alive[parent]
                    del alive[seq]
                    next_id += 1
        for seq in [s for s, left in alive.items() if left == 0]:
            del alive[seq]
            kv.free_sequence(seq)  # finished (EOS or the end of the beam search)
        used += kv.allocator.num_blocks - kv.num_free_blocks
        unshared += sum(_blocks(len(kv.token_ids(s)), block_size) for s in alive)
    kv.check_invariants()
    return used, unshared


def savings(workload, mode, width, divergence=DIVERGENCE, num_requests=200, block_size=16, seed=0):
    """% of KV memory saved by sharing, for ``mode`` "parallel" (n = width) or "beam"."""
    if mode not in ("parallel", "beam"):
        raise ValueError(f"mode must be 'parallel' or 'beam', got {mode!r}")
    if not isinstance(width, int) or width < 1:
        raise ValueError(f"width must be a positive int, got {width!r}")
    requests = paper_workload(workload, num_requests, seed=seed)
    rng = random.Random(seed)
    used = unshared = 0
    for req in requests:
        if mode == "parallel":  # each sample stops at its own EOS
            lens = [req.output_len] + [rng.choice(requests).output_len for _ in range(width - 1)]
            lens = [min(n, req.max_tokens) for n in lens]
        else:  # beams all run the search's length
            lens = [req.output_len] * width
        u, w = run_request(req, mode, width, lens, divergence, block_size, rng)
        used, unshared = used + u, unshared + w
    return 100 * (1 - used / unshared)


def figure15(workloads=("alpaca", "sharegpt"), widths=(2, 4, 6), divergence=DIVERGENCE, **kwargs):
    """Figure 15: memory saved per workload, mode and width, beside the paper's numbers."""
    rows = []
    for workload in workloads:
        for mode in ("parallel", "beam"):
            paper = PAPER_FIG15[(workload, mode)]
            for width in widths:
                rows.append(
                    {
                        "workload": workload,
                        "mode": mode,
                        "width": width,
                        "saved_pct": savings(workload, mode, width, divergence, **kwargs),
                        "paper_saved_pct": paper[width] if isinstance(paper, dict) else paper,
                    }
                )
    return rows


def divergence_sweep(workload="alpaca", width=4, divergences=(0.0, 0.05, 0.1, 0.2, 0.4), **kw):
    """Beam search's saving as beams re-fork more or less often: the model's free parameter."""
    return [
        {"divergence": d, "saved_pct": savings(workload, "beam", width, d, **kw)}
        for d in divergences
    ]
