"""Plugging the paged KV cache into Hugging Face models, without re-implementing them.

transformers lets a model's attention layers call any function registered under a name in its
``AttentionInterface`` (that is how its SDPA, FlashAttention and flex-attention backends plug in).
We register :func:`paged_attention_forward` as ``"pagedlearn"`` and switch a model to it with
``model.set_attn_implementation("pagedlearn")``. GPT-2, OPT and other decoders then run unmodified:
they compute q, k, v as always and hand them to us, and we

1. write the new tokens' k and v into their slots of the paged cache (``write_kv``), then
2. compute attention for the new queries over everything in the cache, reading it through the
   block tables (decode when every sequence brings one token, prefill when some bring several).

Backends: ``"triton"`` runs the kernels (``kernels.write_kv``, ``paged_attention_decode``,
``paged_attention_prefill``). ``"torch"`` runs :mod:`pagedlearn.attention.sdpa`: the index math
planned once per step (:meth:`PagedAttentionMetadata.plan`), then per layer ``write_kv_planned``
and ``attend``, one SDPA call. ``"reference"`` runs the readable references of
:mod:`pagedlearn.attention` (``write_kv_ref``, ``paged_attention_batched``,
``paged_attention_prefill_ref``): the same numbers, slowly; the one to step through, and what
the tests hold ``"torch"`` against.

The write comes first in every layer, so a query sees its own key, and a sequence that shares a
block written in this very step (a prefix-cache hit on a prompt being prefilled next to it) reads
the freshly written values.

The batch is *packed*: all scheduled tokens of all sequences form one row, ``(1, total_tokens)``,
with no padding (vLLM and transformers' own continuous batching do the same). Which token belongs
to which sequence, where its K/V go, and which blocks each sequence reads travel in a
:class:`PagedAttentionMetadata` passed as the keyword ``paged_metadata`` of the model's forward;
transformers forwards unknown keywords down to the attention function. Positions are passed
explicitly too: OPT, for one, derives them from the attention mask unless it gets ``position_ids``,
and the packed row has no mask. Because no mask function is registered for ``"pagedlearn"``,
transformers does not build a (total_tokens x total_tokens) causal mask that we would not use.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from pagedlearn.attention.kv_cache import KVCache
from pagedlearn.attention.sdpa import AttentionPlan, attend, plan_attention, write_kv_planned
from pagedlearn.errors import PagedLearnError

ATTN_IMPLEMENTATION = "pagedlearn"
BACKENDS = ("torch", "triton", "reference")


@dataclass
class PagedAttentionMetadata:
    """What every attention layer needs to know about the packed batch, built once per step.

    ``S`` sequences bring ``T`` new tokens in total; sequence ``i``'s tokens are rows
    ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` of the packed batch. Slots and block tables come
    once per KV-cache group (one for GPT-2 and OPT); a layer reads its group's
    (``kv_cache.group_of(layer)``).
    """

    kv_cache: KVCache
    slot_mappings: list[torch.Tensor]  # per group, (T,) int64: where each new token's K/V go
    block_tables: list[torch.Tensor]  # per group, (S, max_blocks) int32, padded with -1
    context_lens: torch.Tensor  # (S,) int32: tokens in the cache after this step, new ones included
    cu_seqlens_q: torch.Tensor  # (S + 1,) int32: prefix sums of the new tokens per sequence
    max_query_len: int  # the most new tokens any sequence brings (1 for a pure decode step)
    backend: str = "torch"  # "torch": attention_sdpa; "triton": kernels/; "reference": attention
    calls: int = 0  # attention calls in this forward: one per layer, or the model is not ours
    plans: dict[int, AttentionPlan] = field(default_factory=dict)  # per group, built on first use

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1

    def plan(self, group: int, block_size: int, sliding_window: int | None) -> AttentionPlan:
        """The torch backend's index math for ``group``: built by the group's first layer, then
        read by the others (it depends on the tables and lengths, not on the layer)."""
        if group not in self.plans:
            self.plans[group] = plan_attention(
                self.block_tables[group],
                self.context_lens,
                self.cu_seqlens_q,
                block_size,
                sliding_window,
                self.slot_mappings[group],
            )
        return self.plans[group]


@functools.cache  # called by every layer in every step: build the partials once
def _ops(backend: str):
    """(write_kv, decode, prefill) for the "triton" and "reference" backends (the kernels share the
    references' signatures); "torch" goes through :meth:`PagedAttentionMetadata.plan` instead.

    The engine built the tables, slots and lengths from a KVCacheManager that already validated
    them, so the reference path skips re-checking their values in every layer (the kernels skip it
    on a GPU anyway), and decodes all sequences in one batched call rather than a loop over them.
    """
    if backend == "triton":
        from kernels import paged_attention_decode, paged_attention_prefill, write_kv

        trusted = functools.partial
        return (
            trusted(write_kv, check_values=False),
            paged_attention_decode,  # checks values only on the CPU; cheap next to interpreting
            trusted(paged_attention_prefill, check_values=False),
        )
    from pagedlearn.attention import (
        paged_attention_batched,
        paged_attention_prefill_ref,
        write_kv_ref,
    )

    trusted = functools.partial
    return (
        trusted(write_kv_ref, check_values=False),
        trusted(paged_attention_batched, check_values=False),
        trusted(paged_attention_prefill_ref, check_values=False),
    )


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # (1, num_heads, T, head_dim)
    key: torch.Tensor,  # (1, num_kv_heads, T, head_dim)
    value: torch.Tensor,  # (1, num_kv_heads, T, head_dim)
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged_metadata: PagedAttentionMetadata | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature; returns ``((1, T, num_heads, head_dim), None)``."""
    meta = paged_metadata
    if meta is None:
        raise PagedLearnError(
            f"{type(module).__name__} uses pagedlearn's paged attention but was called without "
            "paged_metadata: run the model through pagedlearn's ModelRunner, or switch it back "
            "with model.set_attn_implementation('sdpa')"
        )
    if query.shape[0] != 1:
        raise PagedLearnError(f"paged attention expects one packed row, got batch {query.shape[0]}")
    layer = module.layer_idx
    meta.calls += 1
    q = query[0].transpose(0, 1)  # (T, num_heads, head_dim), a strided view: no copy
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # (T, num_kv_heads, head_dim)
    cache = meta.kv_cache
    key_cache, value_cache = cache.key_cache(layer), cache.value_cache(layer)
    group = cache.group_of(layer)
    window = cache.groups[group].sliding_window  # None: full attention
    # Mistral and Gemma pass their layer's window; a model that says otherwise than the group
    # we built from its config (layer_windows.py) would read the wrong blocks: refuse it.
    if "sliding_window" in kwargs and kwargs["sliding_window"] != window:
        raise PagedLearnError(
            f"layer {layer} of {type(module).__name__} attends with sliding_window="
            f"{kwargs.get('sliding_window')!r}, but its KV-cache group was built for {window!r}"
        )
    if meta.backend == "torch":  # plan once per step, then SDPA per layer (attention/sdpa.py)
        plan = meta.plan(group, key_cache.shape[1], window)
        write_kv_planned(k, v, key_cache, value_cache, plan)  # first write, then read
        return attend(q, key_cache, value_cache, plan, scaling).unsqueeze(0), None

    tables = meta.block_tables[group]
    write_kv, decode, prefill = _ops(meta.backend)
    write_kv(k, v, key_cache, value_cache, meta.slot_mappings[group])  # first write, then read
    if meta.decode_only:  # one query per sequence: the decode kernel, one row per sequence
        out = decode(
            q, key_cache, value_cache, tables, meta.context_lens, scaling, sliding_window=window
        )
    else:
        args = (q, key_cache, value_cache, tables, meta.cu_seqlens_q, meta.context_lens)
        if meta.backend == "triton":
            out = prefill(*args, scaling, max_query_len=meta.max_query_len, sliding_window=window)
        else:
            out = prefill(*args, scaling, sliding_window=window)
    return out.unsqueeze(0), None  # (1, T, num_heads, head_dim), as transformers expects


def register() -> None:
    """Register the function with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
