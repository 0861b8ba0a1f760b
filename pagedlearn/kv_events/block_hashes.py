"""A new prompt's block hashes, computed the way vLLM computes them -- and what the stream hides.

vLLM names a cached block by a chained hash (vLLM's ``vllm/v1/core/kv_cache_utils.py``,
``hash_block_tokens``; the design note https://docs.vllm.ai/en/latest/design/prefix_caching/)::

    digest[0] = H((NONE_HASH,     tuple(tokens[0:B]),  extra_keys[0]))
    digest[j] = H((digest[j - 1], tuple(tokens[jB:(j+1)B]), extra_keys[j]))

``H`` is the server's ``--prefix-caching-hash-algo`` (``vllm/utils/hashing.py``):

- ``sha256`` (vLLM's default, ``vllm/config/cache.py``): ``pickle.dumps(x, HIGHEST_PROTOCOL)``,
  then SHA-256 -- exact here with the standard library (on the server's Python version: pickle's
  bytes may change between Python versions, vLLM's docs warn);
- ``sha256_cbor``: ``cbor2.dumps(x, canonical=True)``, then SHA-256 -- exact here
  (:func:`canonical_cbor`, no cbor2 needed);
- ``sha256_msgpack`` (vLLM PR #43789, in versions that have it): msgspec's msgpack, SHA-256;
- ``xxhash`` / ``xxhash_cbor``: pickle / canonical CBOR, then xxHash3-128 -- only where the
  ``xxhash`` package is installed (pagedlearn does not depend on it).

``NONE_HASH`` (``init_none_hash``): ``H(PYTHONHASHSEED)`` -- the variable's *text*, e.g.
``H("0")`` -- when the server ran with PYTHONHASHSEED set, else **32 random bytes** drawn when
the server started: then no one outside that process can compute any of its hashes.
``extra_keys[j]`` is None, or a tuple: the LoRA name (every block), multimodal ``(identifier,
offset)`` pairs (blocks an image touches), the ``cache_salt`` (block 0 only), a hash of prompt
embeddings. (A recent vLLM, PR #33304, sends each *stored* block's extra keys in its
``BlockStored``; a new prompt's are still the client's to know.)

On the wire (``maybe_convert_block_hash``): with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`` (the
default) a block hash is ``int.from_bytes(digest, "big") & (2**64 - 1)`` -- the digest's last 8
bytes --, else the digest's bytes.

**What the stream alone cannot tell** (:data:`UNKNOWABLE`): which algorithm the server uses (no
event carries it), NONE_HASH unless PYTHONHASHSEED was set and you know it, the extra keys of a
prompt (LoRA, images, salt), and the full digests: only 64 bits of each reach the wire, so a
prompt's hashes must be computed from the root -- they cannot be chained from a stored block's
int. Where they cannot be known, :meth:`KVCacheState.hit_opportunities` also matches a prompt by
the *tokens* the events carry, which needs none of this.

pagedlearn's own hash (``core/prefix_cache.py``: SHA-256 over the parent digest, the tokens packed
as little-endian int64 and ``repr`` of the extra keys, from a fixed ``ROOT_HASH``) is known but for
the served model's id, which enters every hash and is not in the events: :class:`PagedLearnHasher`
computes it as pagedlearn's publisher puts it on the wire.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any

from pagedlearn.errors import PagedLearnError
from pagedlearn.kv_events import check_positive_ints

ALGORITHMS = ("sha256", "sha256_cbor", "sha256_msgpack", "xxhash", "xxhash_cbor")
DEFAULT_ALGORITHM = "sha256"  # vllm/config/cache.py: prefix_caching_hash_algo = "sha256"
INT_HASH_MASK = (1 << 64) - 1  # maybe_convert_block_hash keeps the low 64 bits
HASH_FORMATS = ("int", "bytes")  # a hash on the wire: the low 64 bits, or the whole digest

UNKNOWABLE = (
    "hashes: the stream does not say which hash algorithm the server uses (vLLM's default is "
    "sha256); vLLM's root seed NONE_HASH is random unless the server ran with PYTHONHASHSEED "
    "set (then it is H(that text)); a prompt's extra keys (LoRA name, images, cache_salt) are "
    "not in it; and only 64 bits of each digest are on the wire. A prompt's vLLM hashes are "
    "therefore a guess unless you give all four; the match by tokens needs none of them."
)


class BlockHashError(PagedLearnError, ValueError):
    """A block hash that cannot be computed as asked: an unknown algorithm, a missing library,
    an unknown root seed, a value the serialisation cannot encode. The message says which."""


# --- canonical CBOR (RFC 8949 section 4.2), as cbor2.dumps(x, canonical=True) writes it ---------
def canonical_cbor(value: Any) -> bytes:
    """The canonical CBOR bytes of ``value``: None, bools, ints, bytes, str, tuples and lists
    (what a block-hash tuple holds); each length or int in its shortest head.

    >>> canonical_cbor((b"\\x01", (1, 24), None)).hex()
    '83410182011818f6'
    """
    out = bytearray()
    _cbor(value, out)
    return bytes(out)


def _head(major: int, n: int, out: bytearray) -> None:
    if n < 24:
        out.append(major << 5 | n)
    else:
        for extra, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
            if n < 1 << (8 * size):
                out.append(major << 5 | extra)
                out += n.to_bytes(size, "big")
                return


def _cbor(value: Any, out: bytearray) -> None:
    if value is None:
        out.append(0xF6)
    elif value is True or value is False:
        out.append(0xF5 if value else 0xF4)
    elif isinstance(value, int):
        major, n = (0, value) if value >= 0 else (1, -1 - value)
        if n > INT_HASH_MASK:  # a bignum: tag 2 (or 3) over its big-endian bytes
            out.append(0xC2 + major)
            _cbor(n.to_bytes((n.bit_length() + 7) // 8, "big"), out)
        else:
            _head(major, n, out)
    elif isinstance(value, (bytes, bytearray)):
        _head(2, len(value), out)
        out += value
    elif isinstance(value, str):
        data = value.encode("utf-8")
        _head(3, len(data), out)
        out += data
    elif isinstance(value, (tuple, list)):
        _head(4, len(value), out)
        for item in value:
            _cbor(item, out)
    else:  # floats, dicts, objects: never in a block-hash tuple, so not guessed at here
        raise BlockHashError(f"canonical_cbor: cannot encode a {type(value).__name__}")


# --- vLLM's hash functions ------------------------------------------------------------------------
def _xxh3_128(data: bytes) -> bytes:
    try:
        import xxhash
    except ImportError:
        raise BlockHashError(
            "the xxhash algorithms need the xxhash package (pip install xxhash), which is not "
            "installed here; pagedlearn does not depend on it"
        ) from None
    return xxhash.xxh3_128_digest(data)


def _msgpack(value: Any) -> bytes:
    try:
        import msgspec
    except ImportError:
        why = "sha256_msgpack needs msgspec: pip install 'pagedlearn[kv-events]'"
        raise BlockHashError(why) from None
    return msgspec.msgpack.encode(value)


def _pickle(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {
    "sha256": lambda x: hashlib.sha256(_pickle(x)).digest(),
    "sha256_cbor": lambda x: hashlib.sha256(canonical_cbor(x)).digest(),
    "sha256_msgpack": lambda x: hashlib.sha256(_msgpack(x)).digest(),
    "xxhash": lambda x: _xxh3_128(_pickle(x)),
    "xxhash_cbor": lambda x: _xxh3_128(canonical_cbor(x)),
}


def hash_function(algorithm: str) -> Callable[[Any], bytes]:
    """vLLM's ``get_hash_fn_by_name``: object -> digest bytes."""
    if algorithm not in _FUNCTIONS:
        raise BlockHashError(
            f"unknown hash algorithm {algorithm!r}; vLLM's are: {', '.join(ALGORITHMS)}"
        )
    return _FUNCTIONS[algorithm]


def none_hash(algorithm: str, python_hash_seed: str | None) -> bytes:
    """vLLM's root seed: ``H(PYTHONHASHSEED's text)``. Without it the server drew 32 random
    bytes, which no event carries: refused with the reason."""
    if python_hash_seed is None:
        raise BlockHashError(
            "vLLM's root hash NONE_HASH is 32 random bytes unless the server ran with "
            "PYTHONHASHSEED set; give python_hash_seed (the variable's text, e.g. '0') or root"
        )
    return hash_function(algorithm)(str(python_hash_seed))


def to_external(digest: bytes, int_hashes: bool = True) -> int | bytes:
    """A digest as the events carry it: its low 64 bits as an int (vLLM's default,
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``), or the bytes themselves."""
    return int.from_bytes(digest, "big") & INT_HASH_MASK if int_hashes else bytes(digest)


class VLLMHasher:
    """A prompt's block hashes as a vLLM server computes them: ``hasher(token_ids)`` -> one
    external hash per full block (an int, or bytes with ``int_hashes=False``).

    ``algorithm``: the server's ``--prefix-caching-hash-algo``. ``python_hash_seed``: the
    server's PYTHONHASHSEED (text); or ``root``: NONE_HASH's bytes themselves. ``lora_name``,
    ``cache_salt``: the request's, as vLLM puts them into the extra keys (the LoRA name in every
    block, the salt in block 0). Multimodal prompts are not covered (their keys are the images'
    identifiers and positions). Every one of these is invisible in the stream (:data:`UNKNOWABLE`).

    >>> h = VLLMHasher(2, "sha256_cbor", python_hash_seed="0")
    >>> hashes = h([1, 2, 3, 4, 5])  # two full blocks; [5] has none
    >>> len(hashes), all(0 <= x < 2**64 for x in hashes)
    (2, True)
    """

    def __init__(
        self,
        block_size: int,
        algorithm: str = DEFAULT_ALGORITHM,
        *,
        python_hash_seed: str | None = None,
        root: bytes | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        int_hashes: bool = True,
    ) -> None:
        check_positive_ints(BlockHashError, block_size=block_size)
        self.fn = hash_function(algorithm)
        if root is not None and python_hash_seed is not None:
            raise BlockHashError("give python_hash_seed or root, not both")
        self.root = bytes(root) if root is not None else none_hash(algorithm, python_hash_seed)
        self.block_size, self.algorithm, self.int_hashes = block_size, algorithm, int_hashes
        self.lora_name, self.cache_salt = lora_name, cache_salt

    def extra_keys(self, j: int) -> tuple | None:
        """Block ``j``'s extra keys, in vLLM's order: LoRA name, (images), salt on block 0."""
        keys = [self.lora_name] if self.lora_name else []
        keys += [self.cache_salt] if j == 0 and self.cache_salt else []
        return tuple(keys) or None

    def digests(self, token_ids: Sequence[int]) -> list[bytes]:
        """The full digests, one per full block (what the server keeps; the wire has less)."""
        out, parent, size = [], self.root, self.block_size
        for j in range(len(token_ids) // size):
            block = tuple(int(t) for t in token_ids[j * size : (j + 1) * size])
            parent = self.fn((parent, block, self.extra_keys(j)))
            out.append(parent)
        return out

    def __call__(self, token_ids: Sequence[int]) -> list[int | bytes]:
        return [to_external(d, self.int_hashes) for d in self.digests(token_ids)]

    def describe(self) -> str:
        return f"vLLM {self.algorithm}, root {self.root[:4].hex()}..., block_size {self.block_size}"


class PagedLearnHasher:
    """pagedlearn's own block hashes (``core/prefix_cache.hash_blocks``), as its publisher puts
    them on the wire (``kv_events/from_trace.wire_hash``): the digest's low 64 bits as an int
    (``hash_format="int"``, its default) or the 32 bytes (``"bytes"``). Everything is known here
    but ``model_id``, which enters every hash and is not in the events: the serving engine's
    ``kv.model_id`` (the model's name, ``(name, version)`` once a version is set).
    ``adapter_id`` and ``cache_salt`` are the request's."""

    algorithm = "pagedlearn"

    def __init__(
        self,
        block_size: int,
        model_id=None,
        *,
        adapter_id=None,
        cache_salt=None,
        hash_format: str = "int",
    ) -> None:
        from pagedlearn.core.prefix_cache import make_extra_keys

        check_positive_ints(BlockHashError, block_size=block_size)
        if hash_format not in HASH_FORMATS:
            raise BlockHashError(f"hash_format must be 'int' or 'bytes', got {hash_format!r}")
        self.block_size, self.model_id, self.hash_format = block_size, model_id, hash_format
        self.extra = make_extra_keys(model_id, adapter_id, cache_salt)

    def digests(self, token_ids: Sequence[int]) -> list[bytes]:
        from pagedlearn.core.prefix_cache import hash_blocks

        return hash_blocks([int(t) for t in token_ids], self.block_size, self.extra)

    def __call__(self, token_ids: Sequence[int]) -> list[int | bytes]:
        return [to_external(d, self.hash_format == "int") for d in self.digests(token_ids)]

    def describe(self) -> str:
        return f"pagedlearn sha256, model_id {self.model_id!r}, block_size {self.block_size}"


def make_hasher(algorithm: str, block_size: int, **options) -> VLLMHasher | PagedLearnHasher:
    """``"pagedlearn"`` or one of vLLM's :data:`ALGORITHMS`, with that hasher's options."""
    if algorithm == "pagedlearn":
        return PagedLearnHasher(block_size, **options)
    return VLLMHasher(block_size, algorithm, **options)
