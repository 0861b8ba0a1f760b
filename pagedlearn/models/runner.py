"""The model runner: turn one scheduled step into one packed forward pass and its logits.

The scheduler decides *which* tokens run this step; the runner lays them out for the model. Every
scheduled sequence brings its new tokens (a whole prompt, the part of a prompt the prefix cache did
not cover, or one decoded token), and they are concatenated into a single row::

    seq A prefill (4 tokens)    seq B decode    seq C decode
    input_ids     [a0 a1 a2 a3 | b7           | c12        ]     (1, T) with T = 6
    position_ids  [ 0  1  2  3 |  7           |  12        ]     the tokens' true positions
    slot_mapping  [s  s  s  s  | s            | s          ]     where each token's K/V go
    cu_seqlens_q  [0, 4, 5, 6]                                    sequence i owns rows cu[i]:cu[i+1]

Block tables and context lengths tell attention where each sequence's earlier K/V live. A model
with several KV-cache groups (sliding-window and full layers: kv_cache_groups.py) has one slot
mapping and one set of block tables per group; each layer reads its group's. Only the
last position of each sequence needs logits (the next token is sampled from it), so the LM head
runs on ``S`` rows, not ``T`` (``logits_to_keep``).

Which model fields give the KV shape: :data:`KV_SHAPES` has an entry per ``model_type`` whose
config spells them differently; any decoder whose config has the usual ``num_hidden_layers``,
``num_attention_heads`` (and ``num_key_value_heads`` / ``head_dim`` if it has them) needs none.
"""

from __future__ import annotations

import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pagedlearn.attention.kv_cache import KVCache, KVCacheSpec
from pagedlearn.errors import PagedLearnError
from pagedlearn.models.paged_attention import (
    ATTN_IMPLEMENTATION,
    BACKENDS,
    PagedAttentionMetadata,
    register,
)


def _default_kv_shape(c) -> tuple[int, int, int]:
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return c.num_hidden_layers, kv_heads, head_dim


# model_type -> config -> (num_layers, num_kv_heads, head_dim). A new decoder needs an entry here
# only if its config names these differently.
KV_SHAPES: dict[str, Callable] = {
    "gpt2": lambda c: (c.n_layer, c.n_head, c.n_embd // c.n_head),
    "opt": _default_kv_shape,
}


def kv_cache_spec(model, dtype: torch.dtype | None = None) -> KVCacheSpec:
    """The per-token KV shape of a Hugging Face causal LM (in the model's dtype by default),
    with each layer's sliding window when some layer has one (layer_windows.py). Raises
    :class:`PagedLearnError` for an attention feature pagedlearn does not implement."""
    from pagedlearn.models.layer_windows import check_supported, layer_windows

    config = model.config
    check_supported(config)
    try:
        layers, kv_heads, head_dim = KV_SHAPES.get(config.model_type, _default_kv_shape)(config)
    except AttributeError as e:  # no attention heads: a recurrent model (RWKV, Mamba), say
        raise PagedLearnError(
            f"cannot tell the KV-cache shape of model type {config.model_type!r} from its config "
            f"({e}): pagedlearn pages the keys and values of attention layers"
        ) from e
    windows = tuple(layer_windows(config))
    hybrid = any(w is not None for w in windows)
    return KVCacheSpec(
        layers, kv_heads, head_dim, dtype or model.dtype, windows if hybrid else None
    )


def max_model_len(model) -> int:
    """The most positions the model has embeddings for (GPT-2: 1024, OPT: 2048)."""
    c = model.config
    for name in ("max_position_embeddings", "n_positions"):
        if getattr(c, name, None):
            return int(getattr(c, name))
    raise PagedLearnError(f"cannot tell the maximum length of {c.model_type!r} from its config")


def _ints(values: list[int], dtype: torch.dtype, device) -> torch.Tensor:
    """A 1-D tensor of Python ints. ``torch.tensor(list)`` converts element by element;
    ``array.array`` packs the list in C and the tensor copies it whole."""
    if not values:  # frombuffer refuses an empty buffer
        return torch.empty(0, dtype=dtype, device=device)
    packed = array.array("q" if dtype == torch.int64 else "i", values)  # int64 / int32
    return torch.frombuffer(packed, dtype=dtype).to(device)


@dataclass
class SequenceInput:
    """One scheduled sequence's share of the step: ``new_tokens`` at positions
    ``start_pos .. start_pos + len(new_tokens) - 1``, whose K/V go to ``slots``. ``slots`` and
    ``block_tables`` hold one list per KV-cache group, in the KV cache's group order."""

    new_tokens: Sequence[int]
    start_pos: int
    slots: Sequence[Sequence[int]]
    block_tables: Sequence[Sequence[int]]


@dataclass
class StepInputs:
    """The packed step in plain ints (the picture at the top of this file), built once from the
    scheduled sequences by :func:`prepare_inputs`. It is what a tensor-parallel driver sends
    every worker (pagedlearn/parallel/): the same ints, so every worker's KV write and
    attention touch the same block ids (paper section 4.6)."""

    input_ids: list[int]  # (T,)
    positions: list[int]  # (T,)
    context_lens: list[int]  # (S,) tokens in the cache after this step
    cu_seqlens_q: list[int]  # (S + 1,)
    slot_mappings: list[list[int]]  # per group: (T,)
    block_tables: list[list[int]]  # per group: (S * width,) flat, rows padded with -1
    widths: list[int]  # per group: the padded row width
    max_query_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


def prepare_inputs(seqs: Sequence[SequenceInput], num_groups: int) -> StepInputs:
    """Lay the scheduled sequences out as one packed row (see the module docstring)."""
    ids, positions, lens, cu = [], [], [], [0]
    slots: list[list[int]] = [[] for _ in range(num_groups)]  # per group: (T,)
    tables: list[list[int]] = [[] for _ in range(num_groups)]  # per group: (S, width), flat
    widths = [max(len(s.block_tables[g]) for s in seqs) for g in range(num_groups)]
    for s in seqs:
        n = len(s.new_tokens)
        ids.extend(s.new_tokens)
        positions.extend(range(s.start_pos, s.start_pos + n))
        lens.append(s.start_pos + n)
        cu.append(cu[-1] + n)
        for g in range(num_groups):
            slots[g].extend(s.slots[g])
            tables[g].extend(s.block_tables[g])  # then pad the row with -1 to the width
            tables[g].extend([-1] * (widths[g] - len(s.block_tables[g])))
    max_query = max(len(s.new_tokens) for s in seqs)
    return StepInputs(ids, positions, lens, cu, slots, tables, widths, max_query)


class ModelRunner:
    """Runs a Hugging Face causal LM over a paged KV cache, one packed batch per call."""

    def __init__(self, model, kv_cache: KVCache, backend: str = "torch") -> None:
        if backend not in BACKENDS:
            raise PagedLearnError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
        register()
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.device = kv_cache.device

    def execute(self, seqs: Sequence[SequenceInput]) -> torch.Tensor:
        """One forward pass over all new tokens; returns logits ``(S, vocab)`` in float32, one row
        per sequence: the prediction after its last new token."""
        return self.run(prepare_inputs(seqs, len(self.kv_cache.groups)))

    @torch.inference_mode()
    def run(self, x: StepInputs) -> torch.Tensor:
        """:meth:`execute` for inputs already laid out (what a tensor-parallel worker gets)."""
        dev, num_seqs = self.device, x.num_seqs
        meta = PagedAttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mappings=[_ints(s, torch.int64, dev) for s in x.slot_mappings],
            block_tables=[
                _ints(t, torch.int32, dev).view(num_seqs, w)
                for t, w in zip(x.block_tables, x.widths, strict=True)
            ],
            context_lens=_ints(x.context_lens, torch.int32, dev),
            cu_seqlens_q=_ints(x.cu_seqlens_q, torch.int32, dev),
            max_query_len=x.max_query_len,
            backend=self.backend,
        )
        last = _ints([c - 1 for c in x.cu_seqlens_q[1:]], torch.int64, dev)  # (S,) last rows
        input_ids = _ints(x.input_ids, torch.int64, dev)[None]  # (1, T)
        out = self.model(
            input_ids=input_ids,
            # All ones: a packed batch holds no padding. Without a mask GPT-2 guesses padding
            # whenever the first or last id is the config's pad id (which a random model samples)
            # and warns "We strongly recommend passing in an attention_mask". Paged attention
            # ignores the mask (the block tables say what each token sees), and transformers
            # passes a 2-D mask through untouched to a custom attention function (masking_utils).
            attention_mask=torch.ones_like(input_ids),
            position_ids=_ints(x.positions, torch.int64, dev)[None],
            use_cache=False,  # the paged cache is ours; no transformers Cache object
            logits_to_keep=last,
            paged_metadata=meta,
        )
        if meta.calls != self.kv_cache.spec.num_layers:  # a layer kept its own state instead
            raise PagedLearnError(
                f"{type(self.model).__name__}'s forward called paged attention {meta.calls} "
                f"times for its {self.kv_cache.spec.num_layers} layers: some of its layers do not "
                "attend through transformers' attention interface (recurrent or state-space "
                "layers, say), so pagedlearn's KV cache cannot serve it"
            )
        return out.logits[0].float()  # (S, vocab)
