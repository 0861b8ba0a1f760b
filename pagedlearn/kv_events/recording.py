"""A KV-cache event stream saved to a file, and read back: a recorded vLLM for a reading group.

``KVEventSubscriber(..., record="run.kvev.jsonl")`` (or ``kv-events --record FILE``) writes every
batch it delivers, raw, as it came off the wire; :func:`read_recording` gives the same ``(seq,
batch)`` sequence back, with the time each one came, and no server.

**The format: JSON Lines** (one JSON object per line, UTF-8), so that ``head`` shows what it is
and a truncated file still reads up to its last whole line. The first line is the header, every
other line one batch::

    {"format": "pagedlearn-kv-events", "version": 1, "endpoint": "tcp://127.0.0.1:5557",
     "topic": "", "started": 1767225600.0}
    {"seq": 0, "t": 1767225601.25, "payload": "k8tB2mL..."}

``seq`` is the publisher's sequence number (increasing; a gap is a batch the stream lost),
``t`` the time it was received (seconds since the epoch), ``payload`` the msgpack bytes exactly
as sent, in base64: the file keeps what vLLM said, not what this version of pagedlearn made of
it, so a malformed batch stays malformed and a newer decoder can read an old recording.

A recording comes from someone else: :func:`read_recording` checks the file's size
(:data:`MAX_RECORDING_BYTES`), each line's (a payload of at most ``max_bytes`` decoded), the
header, and every field, and raises :class:`~pagedlearn.errors.KVEventsError` naming the line.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pagedlearn.errors import KVEventsError
from pagedlearn.kv_events.messages import MAX_PAYLOAD_BYTES, KVEventBatch, decode_batch

FORMAT, VERSION = "pagedlearn-kv-events", 1
MAX_RECORDING_BYTES = 1 << 30  # 1 GiB: a long afternoon of a busy server
MAX_RECORDS = 1_000_000


class Record(NamedTuple):
    seq: int
    t: float  # when it was received, seconds since the epoch
    payload: bytes  # the msgpack payload, as sent


class Recorder:
    """Writes a recording (the module's format). ``write`` after ``max_file_bytes`` is refused
    quietly: ``full`` turns True and ``skipped`` counts what was not written."""

    def __init__(
        self,
        path,
        *,
        endpoint: str = "",
        topic: str = "",
        max_file_bytes: int = MAX_RECORDING_BYTES,
    ) -> None:
        self.path, self.max_file_bytes = os.fspath(path), max_file_bytes
        try:
            self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 (closed in close)
        except OSError as e:
            raise KVEventsError(f"cannot write the recording {self.path}: {e.strerror}") from None
        header = {"format": FORMAT, "version": VERSION, "endpoint": endpoint, "topic": topic}
        self._size = self._file.write(json.dumps({**header, "started": time.time()}) + "\n")
        self.written, self.skipped, self.full = 0, 0, False

    def write(self, seq: int, payload: bytes, t: float | None = None) -> None:
        line = json.dumps(
            {"seq": seq, "t": time.time() if t is None else t,
             "payload": base64.b64encode(payload).decode("ascii")}
        ) + "\n"  # fmt: skip
        if self._file.closed or self._size + len(line) > self.max_file_bytes:
            self.full, self.skipped = True, self.skipped + 1
            return
        self._file.write(line)
        self._file.flush()  # a reader (tail -f, a second notebook) sees each batch at once
        self._size += len(line)
        self.written += 1

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class Recording:
    """A recording read back: its ``header`` and ``records`` (:class:`Record`, in order)."""

    header: dict[str, Any]
    records: list[Record]
    errors: list[str] = field(default_factory=list)  # batches that did not decode (batches())

    def timed(
        self, max_bytes: int = MAX_PAYLOAD_BYTES
    ) -> Iterator[tuple[int, float, KVEventBatch]]:
        """``(seq, received at, batch)`` of each record that decodes; one that does not is
        skipped and its error added to ``errors`` (as a live subscriber does)."""
        for r in self.records:
            try:
                yield r.seq, r.t, decode_batch(r.payload, max_bytes=max_bytes)
            except KVEventsError as e:
                self.errors.append(f"batch {r.seq}: {e}")

    def batches(self) -> Iterator[tuple[int, KVEventBatch]]:
        """``(seq, batch)``: what a :class:`KVEventSubscriber` delivered while recording."""
        for seq, _, batch in self.timed():
            yield seq, batch

    def __len__(self) -> int:
        return len(self.records)


def read_recording(
    path,
    *,
    max_file_bytes: int = MAX_RECORDING_BYTES,
    max_records: int = MAX_RECORDS,
    max_bytes: int = MAX_PAYLOAD_BYTES,
) -> Recording:
    """Read and check a recording; raises :class:`KVEventsError` naming the first bad line."""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        if size > max_file_bytes:
            raise KVEventsError(f"{path}: {size:,} bytes is over the cap of {max_file_bytes:,}")
        with open(path, encoding="utf-8", errors="strict") as f:
            return _parse(f, path, max_records, max_bytes)
    except OSError as e:
        raise KVEventsError(f"cannot read the recording {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise KVEventsError(f"{path}: not a recording (not UTF-8 text)") from None


def _parse(f, path: str, max_records: int, max_bytes: int) -> Recording:
    max_line = 4 * (max_bytes // 3 + 1) + 200  # base64 of max_bytes, and the JSON around it
    header = _line(f.readline(max_line + 1), 1, path, max_line)
    if header is None or header.get("format") != FORMAT:
        raise KVEventsError(f"{path}, line 1: not a pagedlearn KV-event recording (no header "
                            f'with "format": "{FORMAT}")')  # fmt: skip
    if not isinstance(header.get("version"), int) or header["version"] > VERSION:
        raise KVEventsError(f"{path}, line 1: version {header.get('version')!r}; this pagedlearn "
                            f"reads version {VERSION}")  # fmt: skip
    records: list[Record] = []
    number = 1
    while line := f.readline(max_line + 1):
        number += 1
        if len(records) >= max_records:
            raise KVEventsError(f"{path}: more than {max_records:,} batches (the cap)")
        d = _line(line, number, path, max_line)
        if d is None:  # a blank line (a file edited by hand): nothing
            continue
        records.append(_record(d, f"{path}, line {number}", records, max_bytes))
    return Recording(header, records)


def _line(line: str, number: int, path: str, max_line: int) -> dict | None:
    if len(line) > max_line:
        raise KVEventsError(f"{path}, line {number}: longer than {max_line:,} characters")
    if not line.strip():
        return None
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise KVEventsError(f"{path}, line {number}: not JSON ({e.msg})") from None
    if not isinstance(d, dict):
        raise KVEventsError(f"{path}, line {number}: a JSON object, not {type(d).__name__}")
    return d


def _record(d: dict, where: str, before: list[Record], max_bytes: int) -> Record:
    seq, t, payload = d.get("seq"), d.get("t"), d.get("payload")
    if type(seq) is not int or seq < 0:
        raise KVEventsError(f"{where}: seq is {seq!r}, not a non-negative int")
    if before and seq <= before[-1].seq:
        raise KVEventsError(f"{where}: seq {seq} after {before[-1].seq}: a recording is in order")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        raise KVEventsError(f"{where}: t is {t!r}, not a time in seconds")
    if not isinstance(payload, str):
        raise KVEventsError(f"{where}: payload is {type(payload).__name__}, not base64 text")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise KVEventsError(f"{where}: payload is not base64 ({e})") from None
    if len(raw) > max_bytes:
        raise KVEventsError(
            f"{where}: a payload of {len(raw):,} bytes, over the cap of {max_bytes:,}"
        )
    return Record(seq, float(t), raw)
