"""Which tokens each layer attends to, read from a Hugging Face config: ``layer_windows(config)``.

The answer is one entry per layer: ``None`` for full attention (every earlier token), or ``W`` for
a sliding window of ``W`` (the query at position ``p`` sees the keys at ``p - W < pos <= p``, the
rule of transformers' ``sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``). The KV
cache groups layers by that answer (kv_cache_groups.py), and the attention of layer ``i`` is
called with ``sliding_window=layer_windows(config)[i]``.

How the families mix the two kinds (transformers 5.24, ``models/<name>/configuration_<name>.py``
and the ``sliding_window=`` each ``modeling_<name>.py`` passes to its attention function):

- GPT-2, OPT, Llama: no ``sliding_window`` in the config: every layer is full.
- Mistral (also Mixtral, Phi-3, Starcoder2; Qwen3-MoE with ``use_sliding_window``): one
  ``sliding_window`` for every layer (``MistralConfig.sliding_window`` defaults to 4096,
  Mistral-7B-v0.1's value); ``None`` means full attention everywhere (Mistral-7B-Instruct-v0.2's
  config.json has ``null``).
- Configs with ``layer_types`` (a list: ``"sliding_attention"`` / ``"full_attention"`` per layer):
  a sliding layer uses ``config.sliding_window``. Gemma 2 and gpt-oss alternate, starting with a
  sliding layer (``bool((i + 1) % 2)``); Gemma 3 has five sliding layers to one full
  (``sliding_window_pattern`` 6); Cohere2 three to one (pattern 4).
- Qwen2 / Qwen3: sliding only with ``use_sliding_window=True`` (the default is False); then the
  layers ``i >= max_window_layers`` slide and the first ``max_window_layers`` stay full. (Qwen2-MoE
  does the opposite: even layers *below* ``max_window_layers``.) transformers turns both into
  ``layer_types`` in the config's ``__post_init__``, so they need no rule of their own here.

``layer_types`` is read wherever a config carries it (some classes set it in ``__init__`` only:
Falcon-H1, Nemotron-H, RecurrentGemma, whose "hybrid", "linear_attention" or "moe" layers are then
refused), except for Mistral and Mixtral: their attention takes ``config.sliding_window`` in every
layer even when a config.json carries ``layer_types`` (for Mistral, transformers warns and
points to Ministral). And ``sliding_window`` counts only on a config class that declares it: a stray
``sliding_window`` key in a Llama config.json changes nothing in Llama's attention, so it must
change nothing here either.

What pagedlearn's paged attention does not implement is refused by :func:`check_supported`
rather than run silently wrong: attention sinks (gpt-oss: a learned per-head logit in every
softmax), softcapped attention logits (Gemma 2: ``tanh`` on every score), bidirectional attention
(EmbeddingGemma), and layers that are neither full nor sliding (Llama 4's ``chunked_attention``,
the linear-attention and Mamba layers of hybrid models).

>>> from transformers import Gemma3TextConfig
>>> layer_windows(Gemma3TextConfig(num_hidden_layers=7, sliding_window=512))
[512, 512, 512, 512, 512, None, 512]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedlearn.errors import PagedLearnError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

FULL, SLIDING = "full_attention", "sliding_attention"
# Model types whose attention ignores ``layer_types`` (one window for every layer).
IGNORES_LAYER_TYPES = frozenset({"mistral", "mixtral"})
# What transformers' DynamicCache builds for a layer that only attends (full or sliding); any
# other kind (linear attention, Mamba state, ...) holds something a paged KV cache does not.
ATTENTION_CACHE_LAYERS = frozenset({"DynamicLayer", "DynamicSlidingWindowLayer"})

# Model types whose attention adds a learned "sink" logit to every softmax: their modeling file
# passes ``s_aux=`` to the attention function (transformers 5.24). No config field says so.
SINK_MODEL_TYPES = frozenset(
    {"gpt_oss", "granite_swa", "granitemoe_swa", "mimo_v2_flash", "deepseek_v4", "flint",
     "hy_v4", "hy_v4_vl", "openai_privacy_filter"}
)  # fmt: skip


def layer_windows(config: PretrainedConfig) -> list[int | None]:
    """One entry per layer: ``None`` (full attention) or the sliding window ``W`` (an int >= 1).

    Raises :class:`PagedLearnError` for what :func:`check_supported` refuses, and for a config
    that contradicts itself (a sliding layer without a window, ``layer_types`` of the wrong length).
    """
    check_supported(config)
    what = f"model type {config.model_type!r}"
    num_layers = config.num_hidden_layers
    window = (
        getattr(config, "sliding_window", None) if _declares(config, "sliding_window") else None
    )
    types = _layer_types(config)
    if types is None:  # one kind for every layer
        return [_checked(window, what)] * num_layers if window is not None else [None] * num_layers
    if len(types) != num_layers:
        raise PagedLearnError(
            f"{what}: layer_types has {len(types)} entries for {num_layers} layers"
        )
    return [_checked(window, f"{what}, layer {i}") if t == SLIDING else None
            for i, t in enumerate(types)]  # fmt: skip


def check_supported(config: PretrainedConfig) -> None:
    """Raise :class:`PagedLearnError` if the model's attention needs something pagedlearn's paged
    attention does not compute, so that it would give other tokens than transformers.

    The message names the model type and the feature. Full and sliding-window attention, GQA /
    MQA and any ``scaling`` pass; positions (RoPE, learned) are the model's own business.
    """
    kind = f"model type {config.model_type!r}"
    if config.model_type in SINK_MODEL_TYPES:
        raise PagedLearnError(
            f"{kind} uses attention sinks (a learned per-head logit added to every softmax; "
            "transformers passes it as s_aux), which pagedlearn's paged attention does not "
            "implement"
        )
    cap = getattr(config, "attn_logit_softcapping", None)
    if cap is not None:
        raise PagedLearnError(
            f"{kind} softcaps its attention logits (attn_logit_softcapping={cap}: score = "
            "cap * tanh(score / cap)), which pagedlearn's paged attention does not implement"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise PagedLearnError(
            f"{kind} has use_bidirectional_attention=True: its tokens also attend to later tokens, "
            "so it is not a causal decoder and has no KV cache to page"
        )
    types = _layer_types(config)
    other = sorted({t for t in types or () if t not in (FULL, SLIDING)})
    if other:
        layers = [i for i, t in enumerate(types) if t not in (FULL, SLIDING)]
        shown = ", ".join(map(str, layers[:8])) + (", ..." if len(layers) > 8 else "")
        raise PagedLearnError(
            f"{kind} has layers of kind {', '.join(map(repr, other))} (layers {shown}); "
            f"pagedlearn's paged attention implements only {FULL!r} and {SLIDING!r}"
        )

    caches = _cache_layer_kinds(config)
    if caches - ATTENTION_CACHE_LAYERS:
        raise PagedLearnError(
            f"{kind} keeps {', '.join(sorted(caches - ATTENTION_CACHE_LAYERS))} state in its "
            "cache (transformers' DynamicCache): layers that are not attention (linear "
            "attention, Mamba, recurrent), which pagedlearn's paged attention does not implement"
        )


def _declares(config: PretrainedConfig, name: str) -> bool:
    """Whether the config's class declares the field (a stray key in a config.json does not)."""
    return hasattr(type(config), name)


def _layer_types(config: PretrainedConfig) -> list[str] | None:
    """The config's per-layer kinds, or None where the model's attention ignores them."""
    if config.model_type in IGNORES_LAYER_TYPES:
        return None
    return getattr(config, "layer_types", None)


def _cache_layer_kinds(config: PretrainedConfig) -> set[str]:
    """The kinds of cache layer transformers' DynamicCache builds for this config (empty if it
    cannot build one from a config alone)."""
    try:
        from transformers import DynamicCache

        return {type(layer).__name__ for layer in DynamicCache(config=config).layers}
    except Exception:  # an old transformers, or a config it cannot read: nothing to say
        return set()


def _checked(window, where: str) -> int:
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise PagedLearnError(f"{where} is a sliding-window layer, but sliding_window={window!r} "
                              "(it must be an int >= 1)")  # fmt: skip
    return int(window)
