"""Prefix caching: how many prompt tokens hit the cache, and what sharing them saves, cold or warm.

Two streams with real token ids (``workloads.attach_tokens``, ``workloads.multi_turn_workload``):

- **shared system prompt**: the home-server mix, where every chat starts with one of 3 system
  prompts of 100 tokens;
- **multi-turn chat**: each turn resends the whole conversation, so turn ``t + 1`` can reuse the
  blocks of turn ``t``'s prompt *and* reply.

Each runs on the real :class:`~pagedlearn.KVCacheManager` three ways: caching off; caching on
from an empty cache (**cold**); and caching on after the same traffic has passed once (**warm**:
what a server that has been up for a while sees; blocks may have been evicted since, LRU).

- hit rate: prompt tokens found in the cache / prompt tokens asked for (vLLM's metric: prefill
  work the model skips). A request preempted by recompute asks again for its whole context and
  finds its own blocks still cached unless evicted, so these re-admissions count too;
- memory saved: slots that sharing saves while requests run together (blocks of a common prefix
  held once), as a share of what the same requests would hold apart, over the steps under load;
- batch: the average number of running requests under load.
"""

from pagedlearn.sim.paper import POOL_SLOTS  # the paper's OPT-13B pool
from pagedlearn.sim.simulator import PagedMemory, simulate
from pagedlearn.sim.workloads import attach_tokens, home_server_workload, multi_turn_workload


def _measure(requests, memory) -> dict:
    before = dict(memory.kv.stats())
    result = simulate(requests, memory)
    after = memory.kv.stats()
    asked = after["prefix_query_tokens"] - before["prefix_query_tokens"]
    hit = after["prefix_hit_tokens"] - before["prefix_hit_tokens"]
    steps = result.loaded()
    shared = sum(s.shared for s in steps)
    held = sum(s.token_states + s.internal for s in steps) + shared
    return {
        "hit_rate_pct": 100 * hit / asked if asked else 0.0,
        "memory_saved_pct": 100 * shared / held if held else 0.0,
        "mean_batch": result.mean_batch(),
        "preemptions": result.preemptions,
    }


def prefix_caching(stream="shared-prompt", num_requests=600, pool_slots=POOL_SLOTS, seed=0):
    """One row per run (off, cold, warm) of ``stream``: "shared-prompt" or "multi-turn".

    The multi-turn stream has ``num_requests // 6`` conversations of 6 turns: few enough that a
    conversation's blocks can survive in the pool until its next turn. (With many more
    conversations than the pool holds, LRU evicts each history before it is reused.)
    """
    if stream == "shared-prompt":
        requests = attach_tokens(home_server_workload(num_requests, seed=seed), seed=seed)
    elif stream == "multi-turn":
        requests = multi_turn_workload(max(num_requests // 6, 1), turns=6, seed=seed)
    else:
        raise ValueError(f"stream must be 'shared-prompt' or 'multi-turn', got {stream!r}")
    if stream == "multi-turn":
        stream = f"multi-turn ({max(num_requests // 6, 1)} chats)"
    rows = [{"stream": stream, "cache": "off", **_measure(requests, PagedMemory(pool_slots))}]
    memory = PagedMemory(pool_slots, enable_prefix_caching=True)
    rows.append({"stream": stream, "cache": "cold", **_measure(requests, memory)})
    rows.append({"stream": stream, "cache": "warm", **_measure(requests, memory)})
    return rows


def experiment(quick: bool = False) -> list:
    """Both streams, the multi-turn one with few and with many conversations (LRU pressure)."""
    n = 300 if quick else 600
    return (
        prefix_caching("shared-prompt", n)
        + prefix_caching("multi-turn", 120)
        + prefix_caching("multi-turn", n)
    )
