"""One request's outputs on the asyncio side: :class:`RequestStream` (``async for out in it``).

The engine thread (engine_loop.py) produces outputs; an HTTP handler on uvicorn's event loop
reads them. Between the two threads sits this small mailbox, touched only on the event loop: the
engine thread never calls it directly, it asks the loop to (``loop.call_soon_threadsafe``).

It holds one output, not a queue of them: vLLM's ``RequestOutputCollector``
(``v1/engine/output_processor.py``) is this mailbox. A pagedlearn ``RequestOutput`` is
cumulative -- its token ids are all the tokens so far -- so the newest one says everything the
older ones did and simply replaces what was not read yet; vLLM's server asks for *delta* outputs
(``RequestOutputKind.DELTA``: only the new tokens) and its collector merges those instead. Either
way a reader slower than the engine reads several tokens at once, never loses one, and a reader
that stops reading costs one output, not a growing queue.

>>> import asyncio
>>> async def demo():
...     s = RequestStream("r1", on_cancel=print)
...     s.put("1 token")          # (the engine loop's calls; RequestOutputs there)
...     s.put("2 tokens")         # replaces the first: nobody read it yet
...     first = await s.__anext__()
...     s.cancel()                # the reader leaves: on_cancel aborts the request
...     return first
>>> asyncio.run(demo())
r1
'2 tokens'
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pagedlearn.engine.request import RequestOutput


class RequestStream:
    """The outputs of one request, read on the event loop that made it.

    Iteration ends after the finished output, or raises the error the engine loop failed it
    with (``EngineDeadError``, ...). ``cancel()``: the reader is gone -- ``on_cancel(request_id)``
    aborts the request, unless its finished output was read."""

    def __init__(self, request_id: str, on_cancel: Callable[[str], None]) -> None:
        self.request_id = request_id
        self.loop = asyncio.get_running_loop()  # where put() and fail() must run
        self._on_cancel = on_cancel
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self.finished = False  # the finished output was read, it failed, or it was cancelled

    # --- the engine loop's side (on the event loop, by call_soon_threadsafe) -------------------
    def put(self, out: RequestOutput) -> None:
        self._latest = out  # cumulative: the newest replaces what was not read yet
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    # --- the reader's side ----------------------------------------------------------------------
    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while self._latest is None and self._error is None:
            await self._ready.wait()
            self._ready.clear()
        out, self._latest = self._latest, None
        if out is None:  # failed, and every output before the failure was read
            self.finished = True
            raise self._error
        self.finished = getattr(out, "finished", False)
        return out

    def cancel(self) -> None:
        """The reader is gone: abort the request, unless it ended already (idempotent)."""
        if not self.finished:
            self.finished = True
            self._on_cancel(self.request_id)
