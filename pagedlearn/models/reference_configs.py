"""Real models' shapes, offline: the configs of GPT-2, Mistral-7B and Gemma 3, and their models on
the meta device, for capacity tables ("how many tokens fit in a GiB of KV cache?").

The KV cache a model needs per token depends only on its config: layers, KV heads, head size,
and which layers slide (if any). So a capacity table needs no weights. Each config here is
built from transformers' own config class with the published hyperparameters, without a
network; :func:`meta_model` turns one into a model on PyTorch's *meta* device -- every tensor
has a shape and a dtype but no storage -- so that code which reads a model (the runner's
``kv_cache_spec``, say) runs on a 7B model in milliseconds and zero bytes.

Where each number comes from is written next to it: GPT-2's ``config.json`` on the hub; for
Mistral-7B-v0.1 and Gemma-3-1B, copies of theirs (fine-tunes upload the base model's config with
their weights); for Gemma 3, also transformers' conversion script
(``models/gemma3/convert_gemma3_weights.py``, which converts Google's checkpoints). The meta models'
parameter counts match the published ones we found: GPT-2 small's 124M, and Gemma-3-1B's
999,885,952 in keras-hub's ``gemma3_presets.py``.

>>> configs = reference_configs()
>>> [(name, c.num_hidden_layers) for name, c in configs.items()]  # doctest: +NORMALIZE_WHITESPACE
[('gpt2', 12), ('mistralai/Mistral-7B-v0.1', 32), ('google/gemma-3-1b-it', 26),
 ('google/gemma-3-4b-it', 34)]
>>> meta_model(configs["mistralai/Mistral-7B-v0.1"]).device
device(type='meta')
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel


def reference_configs() -> dict[str, PretrainedConfig]:
    """Hub name -> config, built offline (a few milliseconds). For a multimodal checkpoint
    (Gemma-3-4B reads images too) it is the config of the text decoder: the part with a KV cache."""
    from transformers import Gemma3TextConfig, GPT2Config, MistralConfig

    configs = {
        # openai-community/gpt2's config.json: n_layer 12, n_head 12, n_embd 768 (head size 64),
        # n_positions 1024, vocab 50257 -- GPT2Config()'s defaults. Full attention everywhere.
        "gpt2": GPT2Config(),
        # mistralai/Mistral-7B-v0.1's config.json: hidden 4096, intermediate 14336, 32 layers,
        # 32 heads (head size 128), 8 KV heads (GQA), sliding_window 4096 in every layer, vocab
        # 32000, rope_theta 1e4. MistralConfig()'s defaults are these (its docstring names the
        # checkpoint) except two that do not touch the KV cache: the published file has
        # max_position_embeddings 32768 (the class: 131072) and rms_norm_eps 1e-5 (the class: 1e-6).
        "mistralai/Mistral-7B-v0.1": MistralConfig(
            max_position_embeddings=32768, rms_norm_eps=1e-5
        ),
        # google/gemma-3-1b-it (text only, model type gemma3_text): its config.json (as copied by
        # fine-tunes of unsloth/gemma-3-1b-it) and the conversion script's gemma3_1b: hidden 1152,
        # intermediate 6912 (6 * 1152), 26 layers, 4 heads, 1 KV head (MQA), head_dim 256,
        # sliding_window 512, five sliding layers to one full (sliding_window_pattern 6, the
        # class default), 32768 positions, vocab 262144.
        "google/gemma-3-1b-it": Gemma3TextConfig(
            vocab_size=262_144,
            hidden_size=1152,
            intermediate_size=6912,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            sliding_window=512,
            max_position_embeddings=32_768,
            query_pre_attn_scalar=256,
        ),
        # google/gemma-3-4b-it's text decoder: the conversion script's gemma3_4b (and its
        # text_config as copied in simaai/gemma-3-4b-it-a16w4's vlm_config.json): hidden 2560,
        # intermediate 10240, 34 layers, 8 heads, 4 KV heads, head_dim 256, sliding_window 1024,
        # five sliding to one full, linear RoPE scaling (factor 8) on the full layers; vocab
        # 262208 (the script adds 64 embedding rows for image tokens to 262144 when it keeps the
        # vision encoder). Positions: the script leaves the class default,
        # 131072 (the Gemma 3 report: 128K tokens of context, 32K for the 1B).
        "google/gemma-3-4b-it": Gemma3TextConfig(
            vocab_size=262_208,
            hidden_size=2560,
            intermediate_size=10240,
            num_hidden_layers=34,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            sliding_window=1024,
            query_pre_attn_scalar=256,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
    }
    for name, config in configs.items():
        config.name_or_path = name
    return configs


def meta_model(config: PretrainedConfig, dtype: torch.dtype = torch.bfloat16) -> PreTrainedModel:
    """The causal LM of ``config`` on the meta device: the real module tree and parameter shapes,
    no memory, no weights (its outputs are meaningless; its shapes and config are not).

    ``dtype`` is the dtype its tensors claim -- the KV cache's too, for code that takes it from
    the model. bfloat16 by default: 2 bytes per value, as these models are served.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
