"""KV-cache groups: which layers share block tables, in a model that mixes attention kinds.

GPT-2 and OPT have one attention kind: every layer attends to every earlier token ("full"
attention), so one block table per sequence serves all layers. Newer decoders mix kinds.
A *sliding-window* layer with window ``W`` lets the query at position ``p`` see only the keys at
positions ``p - W < key_pos <= p``; Mistral-7B is sliding in every layer, Gemma 3 has five
sliding layers to one full, Gemma 2 and gpt-oss alternate. A sliding layer never reads a key
again once it is ``W`` tokens old, so its blocks can go back to the pool while the sequence
grows: it holds at most ``ceil(W / block_size) + 1`` blocks while it decodes, however long the
sequence gets (a prompt prefilled in one step holds all its blocks for that step). A full layer
must keep them all.

So layers of different kinds cannot share one block table. vLLM's hybrid KV-cache manager
(``vllm/v1/core/kv_cache_utils.py``, ``kv_cache_coordinator.py``) puts layers of the same kind in
a *KV-cache group*; each group has its own block tables, over **one shared pool** of blocks.
Shared, not one pool per kind, because how many blocks each kind needs depends on the workload
(long prompts fill the full layers, many short ones fill both alike); a fixed split would leave
one pool idle while the other runs dry.

A shared pool needs every block to be the same size in bytes. A block of a group holds
``block_size`` tokens of K/V for *that group's* layers, so every group must have the same
number of layers. vLLM's rule (``_get_kv_cache_groups_uniform_page_size`` in
``vllm/v1/core/kv_cache_utils.py``, as of late 2025), used here: take the smallest number of
layers of one kind as the group size, or the largest if it is below 1.25 times the smallest
(fewer groups for a little padding); a kind of ``n`` layers gets ``ceil(n / size)`` groups, its
layers dealt out round-robin (``layers[i::num_groups]``), and a group with fewer layers than
``size`` pads the rest of every block's layer slots. The rule has moved: the version that
introduced hybrid groups (mid-2025) took the smallest count with no threshold and contiguous
slices; the round-robin deal and the ``* 1.25`` case came later (its comment cites gpt-oss-20b +
Eagle; vLLM PR #29303); current vLLM uses ``* 1.5``. They differ only when the largest count is
1.25 to 1.5 times the smallest.

Gemma-3-1B (4 full layers, 22 sliding) becomes 1 full group and 6 sliding groups, four of 4
layers and two of 3: 2 layer slots of padding in all (vLLM's warning: "Add 2 padding layers, may
waste at most 9.09% KV cache memory").

>>> groups = group_layers([24, None, 24, None])     # tiny-gemma3: sliding, full, sliding, full
>>> [(g.name, g.layer_ids) for g in groups]
[('full', (1, 3)), ('sliding 24', (0, 2))]
>>> [len(g.layer_ids) for g in group_layers([None] * 4 + [4096] * 22)]  # Gemma-3-1B-like
[4, 4, 4, 4, 4, 3, 3]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedlearn.errors import PagedLearnError


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share an attention kind, and so one block table per sequence."""

    layer_ids: tuple[int, ...]  # the model's layers in this group, in order
    sliding_window: int | None = None  # None: full attention
    name: str = "full"  # "full", "sliding 24", or with a suffix when a kind has several groups

    @property
    def is_sliding(self) -> bool:
        return self.sliding_window is not None

    def blocks_held(self, num_tokens: int, block_size: int) -> int:
        """Blocks one sequence of ``num_tokens`` tokens holds in this group, at most, once its
        last token is computed (see :func:`sliding_blocks_held`)."""
        if self.sliding_window is None:
            return -(-num_tokens // block_size)
        return sliding_blocks_held(num_tokens, self.sliding_window, block_size)


def sliding_blocks_held(num_tokens: int, window: int, block_size: int) -> int:
    """Blocks a sliding-window group holds for a sequence of ``num_tokens`` tokens once it
    decodes: the blocks of its last ``W`` positions, ``num_tokens - W .. num_tokens - 1`` (the
    newest token's query reads them all). Older blocks were freed at the start of the step
    (``remove_skipped_blocks``). ``W`` positions span at most ``ceil(W / block_size) + 1``
    blocks, however long the sequence. (A prefill step holds more: the blocks of every key its
    queries see, the whole prompt when it runs in one chunk.)

    >>> [sliding_blocks_held(n, 24, 16) for n in (1, 16, 17, 40, 41, 4096)]
    [1, 1, 2, 2, 2, 2]
    >>> max(sliding_blocks_held(n, 24, 8) for n in range(1, 500)), -(-24 // 8) + 1
    (4, 4)
    """
    if num_tokens <= 0:
        return 0
    first = max(0, num_tokens - window) // block_size  # the oldest block still read
    last = (num_tokens - 1) // block_size  # the block of the newest token
    return last - first + 1


def group_layers(layer_windows: Sequence[int | None]) -> list[KVCacheGroupSpec]:
    """The KV-cache groups of a model whose layer ``i`` has window ``layer_windows[i]`` (None:
    full attention). Full-attention groups come first, then sliding ones by window; group 0 is
    the one a full-attention-only caller sees (``block_table(seq_id)``)."""
    if not layer_windows:
        raise PagedLearnError("a model needs at least one layer to have a KV cache")
    kinds: dict[int | None, list[int]] = {}
    for i, w in enumerate(layer_windows):
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise PagedLearnError(f"layer {i}'s sliding window must be an int >= 1, got {w!r}")
        kinds.setdefault(w, []).append(i)
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))
    if len(kinds) == 1:
        (w,) = kinds
        return [KVCacheGroupSpec(tuple(kinds[w]), w, _kind_name(w))]
    counts = [len(v) for v in kinds.values()]
    size = max(counts) if max(counts) < 1.25 * min(counts) else min(counts)
    groups = []
    for w in order:
        layers = kinds[w]
        num_groups = -(-len(layers) // size)
        chunks = [tuple(layers[i::num_groups]) for i in range(num_groups)]  # round-robin
        for k, chunk in enumerate(chunks):
            name = _kind_name(w) + (f" #{k}" if len(chunks) > 1 else "")
            groups.append(KVCacheGroupSpec(chunk, w, name))
    return groups


def _kind_name(window: int | None) -> str:
    return "full" if window is None else f"sliding {window}"


def layers_per_block(groups: Sequence[KVCacheGroupSpec]) -> int:
    """How many layers' K/V one block holds: the largest group (smaller ones pad)."""
    return max(len(g.layer_ids) for g in groups)
