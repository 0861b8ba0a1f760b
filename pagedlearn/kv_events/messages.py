"""The wire format of vLLM's KV-cache events: three events, one batch, msgpack.

A serving engine with prefix caching tells the world what its cache holds with three events:

* ``BlockStored``: full blocks were cached. ``block_hashes`` are their hashes in prompt order, a
  chain: each block's hash covers its parent's hash and its own tokens, so ``parent_block_hash``
  (the hash of the block before the first one, ``None`` at the start of a prompt) plus the hashes
  make a path in a tree of prefixes. ``token_ids`` are the blocks' tokens, ``block_size`` per
  block, concatenated. ``medium`` says where the blocks live (``"GPU"``, ``"CPU"``, ...),
  ``group_idx`` which KV-cache group (a model that mixes full and sliding-window layers has one
  block table per group), ``kv_cache_spec_kind`` / ``kv_cache_spec_sliding_window`` what kind.
  ``lora_id`` / ``lora_name`` / ``extra_keys`` say what else went into the hash.
* ``BlockRemoved``: cached blocks were evicted (their hashes are gone).
* ``AllBlocksCleared``: the whole prefix cache was reset.

A :class:`KVEventBatch` carries the events of one engine step, a timestamp ``ts`` (seconds since
the epoch) and the data-parallel rank of the engine that sent it.

**Block hashes** (``ExternalBlockHash`` in vLLM): vLLM hashes a block into 32 bytes (SHA-256) but
by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) sends the *lower 64 bits* as an unsigned
integer, ``int.from_bytes(digest, "big") & (2**64 - 1)``, i.e. the last 8 bytes read big-endian;
with ``=0`` it sends the 32 bytes as msgpack ``bin``. Both decode here (``int | bytes``).

**Two shapes on the wire.** msgspec encodes a ``Struct`` as a map (field name -> value) or, with
``array_like=True``, as an array of the values in field order; a tagged struct puts its class
name under ``"type"`` (map) or first (array). vLLM has used both:

* *arrays* (vLLM up to about 0.2x, ``array_like=True`` on the batch and the events, as vLLM's own
  ``examples/online_serving/kv_events_subscriber.py`` declared them): a batch ``[ts, events,
  rank?]``, an event ``["BlockStored", hashes, parent, tokens, block_size, lora_id, medium, ...]``
  (older releases stop after ``lora_id`` or ``medium``);
* *maps* (vllm-project/vllm#42892 dropped ``array_like`` on the events; a vLLM 0.26 publisher
  sends the batch still as an array, events as maps tagged ``"type"`` -- seen in volcano-sh/kthena
  #1535; issue 34 reports the same from vLLM 0.33). vLLM's main branch also declares the batch
  without ``array_like``, so a batch may come as a map ``{"ts", "events",
  "data_parallel_rank"}``.

:func:`decode_batch` reads all of these; :func:`encode_batch` writes the 0.33 shape. Fields we
do not know in a map event are ignored (a newer vLLM adds fields), fields missing from an older
event get ``None``; an event *type* we do not know is an error naming it (skipping it silently
would leave a picture of the cache that is wrong without saying so).

**Worked example.** One batch at ``ts=1.5`` from data-parallel rank 0 with one ``BlockStored``
of one 4-token block::

    >>> import textwrap
    >>> stored = BlockStored([101], None, [1, 2, 3, 4], 4, None, "GPU", None)
    >>> print(textwrap.fill(encode_batch(KVEventBatch(1.5, [stored], 0)).hex(" "), 78))
    93 cb 3f f8 00 00 00 00 00 00 91 88 a4 74 79 70 65 ab 42 6c 6f 63 6b 53 74 6f
    72 65 64 ac 62 6c 6f 63 6b 5f 68 61 73 68 65 73 91 65 b1 70 61 72 65 6e 74 5f
    62 6c 6f 63 6b 5f 68 61 73 68 c0 a9 74 6f 6b 65 6e 5f 69 64 73 94 01 02 03 04
    aa 62 6c 6f 63 6b 5f 73 69 7a 65 04 a7 6c 6f 72 61 5f 69 64 c0 a6 6d 65 64 69
    75 6d a3 47 50 55 a9 6c 6f 72 61 5f 6e 61 6d 65 c0 00

Read it: ``93`` an array of 3, ``cb 3f f8 ...`` the float 1.5, ``91`` an array of 1 event,
``88`` a map of 8 pairs: ``a4 "type"`` -> ``ab "BlockStored"``, ``ac "block_hashes"`` -> ``91
65`` ([101]), ``b1 "parent_block_hash"`` -> ``c0`` (nil), ``a9 "token_ids"`` -> ``94 01 02 03
04``, ``aa "block_size"`` -> ``04``, then ``lora_id`` nil, ``medium`` "GPU", ``lora_name`` nil;
the optional fields left at ``None`` are not written. The last ``00`` is the rank (vLLM's
publisher always fills it in; a batch of two elements decodes with the rank ``None``).

**Caps** (a stream is untrusted input; each check runs before the data it guards is used):
a payload of at most :data:`MAX_PAYLOAD_BYTES`, a batch of at most :data:`MAX_EVENTS`, an event
of at most :data:`MAX_TOKENS` token ids and :data:`MAX_HASHES` block hashes. A
:class:`~pagedlearn.errors.KVEventsError` says which cap, or which field, with its path.
"""

from __future__ import annotations

from typing import Any

from pagedlearn.errors import KVEventsError
from pagedlearn.kv_events import import_extra

msgspec = import_extra("msgspec")

MAX_PAYLOAD_BYTES = 16 * 1024 * 1024  # one msgpack payload: a big step of a big server fits
MAX_EVENTS = 100_000  # events in one batch
MAX_TOKENS = 1 << 20  # token ids in one BlockStored (a 1M-token prompt stored at once)
MAX_HASHES = 1 << 16  # block hashes in one event (64k blocks: 1M tokens at block size 16)

BlockHash = int | bytes  # vLLM's ExternalBlockHash: lower 64 bits, or the 32-byte digest


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True):
    """Base of the three events: a map tagged ``"type"`` with the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]  # [n blocks], prompt order, each chained on the one before
    parent_block_hash: BlockHash | None  # the block before the first, None at a prompt's start
    token_ids: list[int]  # [n * block_size]
    block_size: int
    lora_id: int | None  # vLLM's old name for the adapter; always written, like vLLM
    medium: str | None  # "GPU", "CPU", ... (None: the sender does not say)
    lora_name: str | None
    extra_keys: list[Any] | None = None  # per block, what else went into its hash (vLLM)
    group_idx: int | None = None  # the KV-cache group (hybrid models have several)
    kv_cache_spec_kind: str | None = None  # e.g. "full_attention", "sliding_window"
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared
EVENT_TYPES: dict[str, type] = {
    c.__name__: c for c in (BlockStored, BlockRemoved, AllBlocksCleared)
}
# Fields an older vLLM may not send although ours have no default: they decode as None.
_NULLABLE = ("lora_id", "medium", "lora_name")


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    """The events of one step: on the wire ``[ts, events]`` or ``[ts, events, rank]``."""

    ts: float  # seconds since the epoch, when the sender built the batch
    events: list[Event]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload of ``batch``, in the shape vLLM 0.33 sends (see the module)."""
    if not isinstance(batch, KVEventBatch):
        raise KVEventsError(f"encode_batch needs a KVEventBatch, got {type(batch).__name__}")
    return _encoder.encode(batch)


def decode_batch(payload: bytes, *, max_bytes: int = MAX_PAYLOAD_BYTES) -> KVEventBatch:
    """Decode one payload (any shape of the module docstring) or raise :class:`KVEventsError`
    saying what is wrong: not msgpack, over a cap, not a batch, an unknown event type, a field
    of the wrong type (with its path, e.g. ``$.events[0].token_ids[3]``)."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise KVEventsError(f"a payload is bytes, got {type(payload).__name__}")
    if len(payload) > max_bytes:
        raise KVEventsError(f"payload of {len(payload):,} bytes is over the cap of {max_bytes:,}")
    try:
        raw = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise KVEventsError(f"payload is not valid msgpack: {exc}") from None
    ts, events, rank = _batch_fields(raw)
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise KVEventsError(f"a batch's ts is a number, got {type(ts).__name__}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise KVEventsError(f"a batch's data_parallel_rank is an int, got {type(rank).__name__}")
    return KVEventBatch(float(ts), [_event(e, i) for i, e in enumerate(events)], rank)


def _batch_fields(raw: Any) -> tuple[Any, list, Any]:
    """``(ts, events, rank)`` from a batch in either shape, its size checked."""
    if isinstance(raw, list) and len(raw) >= 2:  # [ts, events, rank?, a newer sender's more]
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict) and "ts" in raw and "events" in raw:
        ts, events, rank = raw["ts"], raw["events"], raw.get("data_parallel_rank")
    else:
        what = f"array of {len(raw)}" if isinstance(raw, list) else type(raw).__name__
        raise KVEventsError(
            f"a batch is [ts, events, rank?] or a map with ts and events; got {what}"
        )
    if not isinstance(events, list):
        raise KVEventsError(f"a batch's events are an array, got {type(events).__name__}")
    if len(events) > MAX_EVENTS:
        raise KVEventsError(f"batch of {len(events):,} events is over the cap of {MAX_EVENTS:,}")
    return ts, events, rank


def _event(raw: Any, index: int) -> Event:
    """One event from a map tagged ``"type"`` or an array with the tag first."""
    where = f"event {index}"
    if isinstance(raw, dict):
        tag, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw:
        tag, fields = raw[0], None
    else:
        raise KVEventsError(f"{where}: an event is a map or an array, got {type(raw).__name__}")
    cls = EVENT_TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        known = ", ".join(EVENT_TYPES)
        raise KVEventsError(f"{where}: unknown event type {tag!r} (known: {known})")
    if fields is None:  # array_like: the values in field order after the tag; extra: ignored
        fields = dict(zip(cls.__struct_fields__, raw[1:], strict=False))
    fields = {k: v for k, v in fields.items() if k != "type"}
    for name in _NULLABLE:
        if name in cls.__struct_fields__:
            fields.setdefault(name, None)
    for name, cap in (("token_ids", MAX_TOKENS), ("block_hashes", MAX_HASHES)):
        value = fields.get(name)
        if isinstance(value, list) and len(value) > cap:
            raise KVEventsError(
                f"{where} ({tag}): {len(value):,} {name} is over the cap of {cap:,}"
            )
    try:
        return msgspec.convert(fields, cls)
    except msgspec.ValidationError as exc:
        raise KVEventsError(f"{where} ({tag}): {exc}") from None
