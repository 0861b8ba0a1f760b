"""Load the model that pagedlearn runs on its paged KV cache: ``load(name) -> LoadedModel``.

``load`` takes, in the order it checks them:

- a ready ``transformers.PreTrainedModel`` -- used as it is (put in eval mode, in place).
- ``"tiny-gpt2"`` / ``"tiny-opt"`` -- the *offline models*: a 2-layer GPT-2 or OPT with random
  weights and the :class:`~pagedlearn.models.tokenizer.ByteTokenizer`. They need no download, build
  in milliseconds, and are the same bits every time (fixed seed). Their text is random, but the
  attention they run is the real thing, so every lab and test works on a machine without a network.
- ``"tiny-mistral"`` / ``"tiny-gemma3"`` -- offline models of the same kind whose layers see only
  a sliding window of the last 24 tokens: every layer (Mistral), or every other layer (Gemma 3's
  architecture, alternating sliding and full attention). See :func:`tiny_config` and
  :mod:`.layer_windows`.
- ``"gpt2-size-random"`` -- GPT-2 small's architecture (124M parameters, 12 layers) with random
  weights (seeded) and the byte tokenizer: the real model's size and compute, offline, for
  benchmarks and timings (its text is random too).
- ``"auto"`` -- the real ``gpt2`` if it is already in the local Hugging Face cache, else
  ``tiny-gpt2`` with a one-line notice (and ``offline_stand_in=True``). It never downloads.
- a local folder written by ``save_pretrained()``.
- a hub name (``"gpt2"``, ``"facebook/opt-125m"``, ``"mistralai/Mistral-7B-v0.1"``,
  ``"google/gemma-3-1b-it"``): from the local cache if it is there, else
  downloaded. Without a network this fails within seconds instead of hanging (hub.py asks the
  hub first), and the message points to the offline models.

Only decoder-only causal LMs are accepted: PagedAttention caches the K/V of the past tokens of a
model that generates one token at a time, as GPT-2 and OPT do (an encoder-decoder such as T5 would
need a second, cross-attention cache). A model whose attention pagedlearn does not compute (sinks,
softcapping, chunked or linear attention: :func:`~.layer_windows.check_supported`) and a
multimodal one (Gemma-3-4B and larger read images: use a text-only checkpoint) are refused before
any weight is read.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pagedlearn.errors import PagedLearnError
from pagedlearn.models import hub
from pagedlearn.models.layer_windows import check_supported
from pagedlearn.models.tokenizer import ByteTokenizer

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

OFFLINE_MODELS = ("tiny-gpt2", "tiny-opt", "tiny-mistral", "tiny-gemma3")
GPT2_SIZE_RANDOM = "gpt2-size-random"  # GPT-2 small's shape, random weights: for timings
TINY_SEED = 0
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DECODERS_ONLY = "pagedlearn runs decoder-only causal language models (GPT-2, OPT, ...)"
_OFFLINE_HINT = (
    "To run without a network, use an offline model ('tiny-gpt2', 'tiny-opt', or with sliding-"
    "window layers 'tiny-mistral', 'tiny-gemma3': random weights, random text, real paged "
    "attention): load('tiny-gpt2') in Python, or --model tiny-gpt2 on the command line."
)


class ModelLoadError(PagedLearnError, OSError):
    """A model could not be loaded: not cached and no network, an unknown name, not a causal LM,
    a bad ``dtype``, ... Also an ``OSError``, as the errors of ``from_pretrained`` are."""


class _NotCached(Exception):
    """Internal: the local cache has no (complete) copy; the caller goes on to the hub."""


@dataclass
class LoadedModel:
    """A model ready for pagedlearn (eval mode, no gradients) and the tokenizer that fits it."""

    model: PreTrainedModel = field(repr=False)
    tokenizer: Any = field(repr=False)  # encode(text) -> ids, decode(ids) -> text, eos_token_id
    name: str  # "tiny-gpt2", "gpt2", a folder, ... (what tells models apart, e.g. in cache keys)
    offline_stand_in: bool = False  # True when "auto" fell back to tiny-gpt2


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


def load(model: Any, tokenizer: Any = None, dtype: Any = None) -> LoadedModel:
    """Load ``model`` (see the module docstring for the forms it takes) on the CPU.

    ``tokenizer`` overrides the one found with the model. ``dtype`` is None (as stored; the offline
    models are float32), a floating ``torch.dtype``, or "float32" / "float16" / "bfloat16".
    A ``PreTrainedModel`` is changed in place (eval mode, no gradients, dtype), on its device.
    """
    dtype = _resolve_dtype(dtype)
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        _check_causal_lm(model.config, type(model).__name__, type(model))
        tok = tokenizer if tokenizer is not None else _tokenizer_of(model)
        return _ready(model, tok, model.config.name_or_path or type(model).__name__, dtype)
    if not isinstance(model, (str, os.PathLike)) or not os.fspath(model).strip():
        raise ModelLoadError(
            "load() takes 'tiny-gpt2', 'tiny-opt', 'auto', the other offline models "
            f"('tiny-mistral', 'tiny-gemma3', {GPT2_SIZE_RANDOM!r}), a hub model name such as "
            "'gpt2' or 'google/gemma-3-1b-it', a folder written by save_pretrained(), or a "
            f"transformers PreTrainedModel; got {type(model).__name__} {model!r}"
        )
    name = os.fspath(model)
    if name in OFFLINE_MODELS or name == GPT2_SIZE_RANDOM:
        return _load_offline(name, tokenizer, dtype)
    if name == "auto":
        return _load_auto(tokenizer, dtype)
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        return _pretrained(path, name, tokenizer, dtype, stage="folder")
    if os.path.exists(path) or name.startswith((".", "/", "~", "\\")):  # hub names never do
        raise ModelLoadError(f"{name!r} is not a folder; give the folder save_pretrained() wrote")
    return _load_hub(name, tokenizer, dtype)


def _load_offline(name: str, tokenizer: Any, dtype: torch.dtype | None) -> LoadedModel:
    import transformers

    if name == GPT2_SIZE_RANDOM:  # GPT2Config()'s defaults are GPT-2 small's shape
        config = transformers.GPT2Config(bos_token_id=256, eos_token_id=256, pad_token_id=257)
        config.name_or_path = name
    else:
        config = tiny_config(name)
    classes = {"tiny-opt": "OPTForCausalLM", "tiny-mistral": "MistralForCausalLM",
               "tiny-gemma3": "Gemma3ForCausalLM"}  # fmt: skip
    cls = getattr(transformers, classes.get(name, "GPT2LMHeadModel"))
    # A private RNG stream: the weights are the same on every load, and the caller's torch RNG
    # (their sampling seed, say) is left exactly where it was. devices=[]: CPU only, CUDA untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        model = cls(config)
    return _ready(model, tokenizer if tokenizer is not None else ByteTokenizer(), name, dtype)


def _load_auto(tokenizer: Any, dtype: torch.dtype | None) -> LoadedModel:
    if hub.in_cache("gpt2"):
        try:
            return _pretrained("gpt2", "gpt2", tokenizer, dtype, stage="cache")
        except _NotCached:  # only partly downloaded
            pass
    print(
        "pagedlearn: 'gpt2' is not in the local Hugging Face cache, so 'auto' runs the offline "
        "model 'tiny-gpt2' (random weights: the outputs are random text).",
        file=sys.stderr,
    )
    # The byte tokenizer, not a `tokenizer` that was given: that one was meant for the real gpt2.
    loaded = _load_offline("tiny-gpt2", None, dtype)
    loaded.offline_stand_in = True
    return loaded


def _load_hub(name: str, tokenizer: Any, dtype: torch.dtype | None) -> LoadedModel:
    from huggingface_hub import constants
    from huggingface_hub.errors import HFValidationError

    # 1. The local cache: milliseconds. Most runs after the first end here.
    try:
        cached = hub.in_cache(name)
    except HFValidationError as e:
        msg = f"{name!r} is neither a local folder nor a valid hub model name ({e})"
        raise ModelLoadError(msg) from e
    if cached:
        try:
            return _pretrained(name, name, tokenizer, dtype, stage="cache")
        except _NotCached:  # only partly downloaded
            pass
    # 2. Not cached. Ask whether the hub can be reached *before* from_pretrained does, which
    # would retry for half a minute without a network (see hub.py). A lab should fail at once.
    why = hub.why_unreachable()
    if why is None:
        return _pretrained(name, name, tokenizer, dtype, stage="hub")
    raise ModelLoadError(
        f"{name!r} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and the hub "
        f"({constants.ENDPOINT}) could not be reached: {why}. {_OFFLINE_HINT} Or download the "
        f"model once where there is a network (`hf download {name}`) and copy the cache folder."
    )


def _pretrained(source: str, name: str, tokenizer: Any, dtype, stage: str) -> LoadedModel:
    """from_pretrained of the config (to reject a non-causal model before reading its weights),
    the weights and the tokenizer; ``stage`` is "folder", "cache" (local files only) or "hub".

    What transformers raises becomes a ModelLoadError naming ``name`` -- or _NotCached when the
    cache lacks files, so that the caller can go on to the hub."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    local, step = stage != "hub", "config"
    try:
        config = AutoConfig.from_pretrained(source, local_files_only=local)
        _check_causal_lm(config, repr(name))
        step = "weights"
        model = AutoModelForCausalLM.from_pretrained(
            source, config=config, dtype=dtype or "auto", local_files_only=local
        )
        step = "tokenizer"
        if tokenizer is None and getattr(config, "pagedlearn_tokenizer", None) == "byte":
            tokenizer = ByteTokenizer()
        elif tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local)
    except ModelLoadError:
        raise
    except Exception as e:  # from_pretrained raises OSError, ValueError, ImportError, ...
        missing = hub.missing_from_cache(e)
        if missing and stage == "cache":
            raise _NotCached from e
        if missing and stage == "hub":
            msg = f"{name!r} is not in the local Hugging Face cache and the hub did not serve it: "
            raise ModelLoadError(msg + str(e).splitlines()[0] + " " + _OFFLINE_HINT) from e
        hint = "; pass one: load(..., tokenizer=...)" if step == "tokenizer" else ""
        raise ModelLoadError(f"could not load the {step} of {name!r}: {e}{hint}") from e
    return _ready(model, tokenizer, name, dtype)


def _check_causal_lm(config: PretrainedConfig, what: str, cls: type | None = None) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as LMS
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES as BASES

    kind = f"{what} (model type {config.model_type!r})"
    if getattr(config, "is_encoder_decoder", False):
        raise ModelLoadError(f"{kind} is an encoder-decoder model; {_DECODERS_ONLY}")
    causal = set(LMS.values())
    if cls is not None:  # an instance: its class must be (or derive from) a causal LM class
        if not any(c.__name__ in causal for c in cls.__mro__):
            msg = f"{kind} has no causal LM head (it gives no next-token logits); {_DECODERS_ONLY}"
            raise ModelLoadError(msg + "; load it with AutoModelForCausalLM")
    elif config.model_type not in LMS:
        raise ModelLoadError(f"{kind} is not a causal language model; {_DECODERS_ONLY}")
    # A checkpoint saved as a classifier or masked LM (bert-base-uncased is a BertForMaskedLM)
    # holds weights for another head; a bare base model is fine (the LM head is tied to it).
    base = {n for v in BASES.values() for n in ((v,) if isinstance(v, str) else v)}
    archs = getattr(config, "architectures", None) or []
    if cls is None and archs and not any(a in causal or a in base for a in archs):
        raise ModelLoadError(f"{kind} was saved as a {archs[0]}; {_DECODERS_ONLY}")
    # Image-and-text models (AutoModelForCausalLM gives Gemma3ForConditionalGeneration for
    # google/gemma-3-4b-it) keep their decoder's shape in config.text_config, and their text
    # decoder class does not find its weights in such a checkpoint (it would run random ones).
    if getattr(config, "text_config", None) is not None:
        hint = ("; for Gemma 3 take a text-only checkpoint (model type 'gemma3_text'), such as "
                "'google/gemma-3-1b-it' or 'google/gemma-3-1b-pt'" if config.model_type == "gemma3"
                else "")  # fmt: skip
        msg = f"{kind} is a multimodal model (its text decoder's settings are in text_config)"
        raise ModelLoadError(f"{msg}; pagedlearn runs text-only decoders{hint}")
    try:
        check_supported(config)
    except PagedLearnError as e:
        raise ModelLoadError(f"{what} cannot run on pagedlearn's paged attention: {e}") from e


def _tokenizer_of(model: PreTrainedModel) -> Any:
    """The tokenizer of a model given as an instance, found from the name in its config."""
    from transformers import AutoTokenizer

    if getattr(model.config, "pagedlearn_tokenizer", None) == "byte":
        return ByteTokenizer()
    try:
        return AutoTokenizer.from_pretrained(model.config.name_or_path, local_files_only=True)
    except Exception as e:  # no name in the config, not cached, no tokenizer files, ...
        msg = f"found no tokenizer for this {type(model).__name__} ({type(e).__name__}: {e})"
        raise ModelLoadError(msg + "; pass one: load(model, tokenizer=...)") from e


def _ready(model: PreTrainedModel, tokenizer: Any, name: str, dtype) -> LoadedModel:
    """Eval mode (no dropout), no gradients, the asked dtype, and a tokenizer that fits."""
    _check_tokenizer(tokenizer, model.config.vocab_size, name)
    model.eval().requires_grad_(False)
    if dtype is not None:
        model.to(dtype)
    gen = model.generation_config
    if gen.pad_token_id is None and gen.eos_token_id is not None:
        gen.pad_token_id = gen.eos_token_id  # what generate() would do anyway, minus its warning
    return LoadedModel(model, tokenizer, name)


def _check_tokenizer(tokenizer: Any, vocab_size: int, name: str) -> None:
    # transformers 5 answers AutoTokenizer on a folder without tokenizer files with an *empty*
    # tokenizer that encodes everything to []; and a GPT-2 tokenizer on tiny-gpt2 gives ids past
    # its 258 embeddings. Both would fail much later, far from the cause; catch them here.
    if not all(hasattr(tokenizer, a) for a in ("encode", "decode", "eos_token_id")):
        msg = f"a tokenizer needs encode(), decode() and eos_token_id; got {tokenizer!r}"
        raise ModelLoadError(msg)
    ids = list(tokenizer.encode("Hello, world!"))
    if not ids:
        msg = f"the tokenizer for {name!r} encodes text to nothing (no tokenizer files there?)"
        raise ModelLoadError(msg + "; pass one: load(..., tokenizer=...)")
    if max(ids) >= vocab_size:
        msg = f"the tokenizer for {name!r} gives token id {max(ids)}, but the model has only "
        raise ModelLoadError(msg + f"{vocab_size} token embeddings: they do not belong together")


def _resolve_dtype(dtype: Any) -> torch.dtype | None:
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    msg = f"dtype must be None (as stored), a floating torch.dtype, or one of {list(_DTYPES)}"
    raise ModelLoadError(f"{msg}; got {dtype!r}")
