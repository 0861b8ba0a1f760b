"""The offline models: small random-initialised decoders that need no download.

``"tiny-gpt2"`` / ``"tiny-opt"`` are a 2-layer GPT-2 and OPT; ``"tiny-mistral"`` and
``"tiny-gemma3"`` the same kind of model whose layers see only a sliding window of the last 24
tokens: every layer (Mistral), or every other layer (Gemma 3's architecture, alternating sliding
and full attention). ``"gpt2-size-random"`` is GPT-2 small's shape (124M parameters) with random
weights, for timings. Each is built from transformers' own config and model classes with a fixed
seed (:data:`TINY_SEED`), in a private RNG stream: the same bits on every load, in milliseconds,
and the caller's torch RNG left where it was. Their text is random, but the attention they run is
the real thing, so every lab and test works on a machine without a network. The loader
(loader.py) gives them the byte tokenizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedlearn.errors import ModelLoadError

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

OFFLINE_MODELS = ("tiny-gpt2", "tiny-opt", "tiny-mistral", "tiny-gemma3")
GPT2_SIZE_RANDOM = "gpt2-size-random"  # GPT-2 small's shape, random weights: for timings
TINY_SEED = 0
_CLASSES = {"tiny-opt": "OPTForCausalLM", "tiny-mistral": "MistralForCausalLM",
            "tiny-gemma3": "Gemma3ForCausalLM"}  # fmt: skip


def tiny_config(name: str) -> PretrainedConfig:
    """The config of an offline model: 4 heads of 16 dims (hidden 64), 258 tokens; tiny-gpt2 and
    tiny-opt have 2 layers and 512 positions.

    The initialiser's std is 0.2, not the usual 0.02. With 0.02 a random model's logits are nearly
    flat (std 0.16), so greedy decoding picks between near-ties that float rounding can flip, and a
    paged implementation would "disagree" with Hugging Face for no real reason. With 0.2 (logit
    std 1.6), the median gap between the best and the second-best logit is 0.44 for tiny-gpt2 and
    0.36 for tiny-opt over random byte prompts (0.95 and 0.31 along greedy generations; tiny-opt
    at 0.02: 0.05) -- far above float32 rounding, about 1e-6.

    tiny-mistral (2 layers) and tiny-gemma3 (4 layers: sliding, full, sliding, full -- two of each,
    so their KV-cache groups are the same size) have 2 KV heads (GQA), a sliding window of 24 tokens
    (on purpose not a multiple of the usual block sizes 4, 8, 16) and 8192 positions, room for a
    4,096-token generation after a long prompt. At std 0.2 their median gap is 0.38 (tiny-mistral)
    and 0.32 (tiny-gemma3) over random byte prompts, 0.39 and 0.38 along a 4,096-token greedy
    generation, whose smallest gap (3e-4) is still about 30 times the largest logit difference
    between transformers' eager and SDPA attention on it (1e-5). Two choices keep tiny-gemma3
    honest: untied input and output embeddings (Gemma ties them, and scales its input embeddings
    by sqrt(hidden); tied and random, the model predicts the token it was just given 88% of the
    time, so the window hardly changes a token), and query_pre_attn_scalar 4, so Gemma's attention
    scale (4**-0.5) is not the usual head_dim**-0.5: an engine that ignores the ``scaling``
    transformers passes to attention gets other tokens.
    """
    from transformers import Gemma3TextConfig, GPT2Config, MistralConfig, OPTConfig

    ids = {"bos_token_id": 256, "eos_token_id": 256, "pad_token_id": 257, "vocab_size": 258}
    shape = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 24,
             "max_position_embeddings": 8192, "initializer_range": 0.2}  # fmt: skip
    if name == "tiny-gpt2":
        config = GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=512,
                            initializer_range=0.2, **ids)  # fmt: skip
    elif name == "tiny-opt":
        config = OPTConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=64,
                           ffn_dim=256, word_embed_proj_dim=64, max_position_embeddings=512,
                           do_layer_norm_before=True, init_std=0.2, **ids)  # fmt: skip
    elif name == "tiny-mistral":
        config = MistralConfig(num_hidden_layers=2, **shape, **ids)
    elif name == "tiny-gemma3":
        config = Gemma3TextConfig(num_hidden_layers=4, layer_types=["sliding_attention",
                                  "full_attention"] * 2, query_pre_attn_scalar=4,
                                  tie_word_embeddings=False, **shape, **ids)  # fmt: skip
    else:
        raise ModelLoadError(f"no offline model {name!r}; there are {OFFLINE_MODELS}")
    config.name_or_path = name
    # Saved in config.json, so that a folder written by save_pretrained() loads back with the
    # right tokenizer (AutoTokenizer knows nothing of the byte tokenizer).
    config.pagedlearn_tokenizer = "byte"
    return config


def build(name: str) -> PreTrainedModel:
    """The offline model ``name`` (one of :data:`OFFLINE_MODELS` or :data:`GPT2_SIZE_RANDOM`),
    freshly built with the fixed seed."""
    import transformers

    if name == GPT2_SIZE_RANDOM:  # GPT2Config()'s defaults are GPT-2 small's shape
        config = transformers.GPT2Config(bos_token_id=256, eos_token_id=256, pad_token_id=257)
        config.name_or_path = name
    else:
        config = tiny_config(name)
    cls = getattr(transformers, _CLASSES.get(name, "GPT2LMHeadModel"))
    # A private RNG stream: the weights are the same on every load, and the caller's torch RNG
    # (their sampling seed, say) is left exactly where it was. devices=[]: CPU only, CUDA untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        return cls(config)
