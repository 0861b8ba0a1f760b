"""Pictures of the paged KV cache, drawn from the real state -- never from a mock.

Read in this order: ``frame`` (one frozen ``PoolState`` per moment), ``sources`` (building one
from a live manager / engine or from a recorded trace), ``colors`` (which request gets which
colour: one assignment per run, never one colour for two requests on screen together),
``state`` (a recorded run's frames with their colours; it also names everything a drawing
reads), ``style`` (fixed looks, fonts), ``pool`` (the physical blocks as a grid), ``tables``
(block tables pointing into the pool, the paper's Figures 6-7), ``timeline`` (blocks and queues
over steps), ``fragmentation`` (reservation vs paging, the paper's Figure 2), ``panels`` and
``view`` (the text panels and the widget layout both dashboards share), ``live`` (the ipywidgets
dashboard that follows a running engine), ``replay`` (the view that scrubs through a recorded
run) and ``workers`` (tensor parallelism: the driver's one block table over each worker's slab).
Then the pictures of a KV-cache event stream (vLLM's, or pagedlearn's own: kv_events/), which
sees hashes, not physical blocks: ``prefix_tree`` (the cached blocks as a tree of shared
prefixes), ``kv_events_timeline`` (blocks stored / removed per batch, the cache's size) and
``kv_events_live`` (the ipywidgets view that follows a subscriber).

A model with sliding-window layers (Mistral: all of them; Gemma 3: with full ones), whose
coordinator keeps its layers' KV-cache groups over one pool, is drawn by the same code: a table
per sequence per group, each named ``"<seq>|<group>"`` as its trace names it; a request keeps
one colour in all its groups, a pool cell carries its group's tag, and a sliding group's table
shows its freed head (entries a window gave back) with no arrows.

Every ``draw_*`` function returns a matplotlib ``Figure`` (no pyplot: nothing global changes).
The names are looked up on first use, so ``import pagedlearn.viz`` loads neither matplotlib nor
ipywidgets until a drawing is asked for.
"""

from importlib import import_module

_NAMES = {
    "PoolState": "state",
    "BlockState": "state",
    "RequestState": "state",
    "pool_state": "state",
    "replay_states": "state",
    "step_label": "state",
    "Palette": "colors",
    "PoolArtist": "pool",
    "draw_block_pool": "pool",
    "draw_block_tables": "tables",
    "draw_memory_timeline": "timeline",
    "timeline_rows": "timeline",
    "fragmentation_breakdown": "fragmentation",
    "draw_fragmentation": "fragmentation",
    "draw_reservation_vs_paging": "fragmentation",
    "draw_worker_slabs": "workers",
    "read_slabs": "workers",
    "LiveBlockView": "live",
    "ReplayView": "replay",
    "draw_prefix_tree": "prefix_tree",
    "draw_kv_events_timeline": "kv_events_timeline",
    "timeline_points": "kv_events_timeline",
    "KVEventsLiveView": "kv_events_live",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(import_module(f"pagedlearn.viz.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'pagedlearn.viz' has no attribute {name!r}")
