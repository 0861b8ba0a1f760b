"""One request of the HTTP load test (loadtest/http.py): its JSON body, its SSE stream read chunk
by chunk, and the record that says what a client saw -- outcome, tokens, TTFT, ITL, E2E.

**The request** is ``POST /v1/completions`` with ``prompt`` = the RequestSpec's token ids (a list
of ints: OpenAI and vLLM accept it; the mix's ids are below 256, valid in every GPT-2-style
vocabulary), ``stream: true`` with ``stream_options: {"include_usage": true}``, ``max_tokens``,
``temperature`` / ``top_p`` / ``top_k`` / ``seed`` / ``n`` and the ``stop`` strings of its
SamplingParams, and vLLM's extensions ``ignore_eos``, ``stop_token_ids``, ``cache_salt``.

**The stream** is Server-Sent Events: one ``data: {json}`` line per chunk, a blank line after
each, ``data: [DONE]`` last. A chunk carries a piece of one sample's text (``index``: which of
the ``n``); the last piece of a sample has its ``finish_reason``; with ``include_usage`` a last
chunk with no choices brings the token counts (pagedlearn's server, max_tokens=2; each chunk's
``id``, ``object``, ``created``, ``model`` and ``logprobs`` left out)::

    data: {"choices": [{"index": 0, "text": "$", "finish_reason": null}]}

    data: {"choices": [{"index": 0, "text": "7", "finish_reason": "length"}]}

    data: {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2,
           "total_tokens": 4, "prompt_tokens_details": {"cached_tokens": 0}}}

    data: [DONE]

SSE ends a line at CR, LF or CRLF and nowhere else, so :func:`sse_lines` splits the bytes
itself: httpx's ``aiter_lines`` uses ``str.splitlines``, which also splits at U+2028, U+2029
and U+0085 -- characters a chunk's JSON may hold unescaped (vLLM's pydantic and pagedlearn's
``json.dumps(ensure_ascii=False)`` leave them be; a random model's bytes C2 85 are U+0085), and
a chunk cut there would read as a bad one.

**Times** are the client's, per request, from its send (``perf_counter``): TTFT to the first
chunk that brings tokens, ITL the gaps between such chunks, E2E to the last chunk. A chunk
brings a token unless it is a bare end marker (no text, a finish reason). Output tokens: the
usage chunk's ``completion_tokens``, else the chunks counted. vLLM and pagedlearn send a chunk
per step's new tokens (its text "" while a character's bytes are incomplete); a server that held
such chunks back would show fewer, longer gaps, and its cancels would come a few tokens late.

**A cancel** closes its stream after ``cancel_after`` tokens of sample 0: leaving httpx's
``stream`` block closes the connection, and the server must notice the disconnect and abort the
request, so that its blocks come back (the report reads /metrics after the run to see that).

**The outcome** a record ends with: "stopped" / "length" (every sample ended, "stopped" if one
met a stop), "cancelled", "rejected" (a 4xx: the over-long prompt must get one, and no other
request may: the report checks it), "error" (a 5xx, an ``error`` in the stream, a chunk that is
not JSON or not of this shape, a stream that ends before every sample finished, an unknown
finish reason, an httpx error -- any exception: one bad reply fails its request, not the run),
"timeout" (not done within ``timeout`` seconds) or "lost" (the run's bound passed before
it ended).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time


def request_body(spec, model: str, salt: str) -> dict:
    """The JSON of ``POST /v1/completions`` for one RequestSpec (loadtest/mix.py)."""
    p = spec.params
    body = {"model": model, "prompt": list(spec.prompt_token_ids), "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": p.max_tokens,
            "temperature": p.temperature, "top_p": p.top_p, "n": p.n,
            "cache_salt": salt}  # fmt: skip
    if p.top_k > 0:
        body["top_k"] = p.top_k
    if p.seed is not None:
        body["seed"] = p.seed
    if p.stop:
        body["stop"] = list(p.stop)
    if p.stop_token_ids:
        body["stop_token_ids"] = list(p.stop_token_ids)
    if p.ignore_eos:
        body["ignore_eos"] = True
    return body


def new_record(spec, salt: str) -> dict:
    """A request's record before it is sent: "lost" until something answers."""
    return {"id": spec.request_id, "phase": spec.phase, "kinds": sorted(spec.kinds),
            "salt": salt, "prompt_tokens": len(spec.prompt_token_ids), "n": spec.params.n,
            "max_tokens": spec.params.max_tokens, "cancel_after": spec.cancel_after,
            "expect_reject": spec.expect_reject, "outcome": "lost", "status": None,
            "error": None, "finish_reasons": [], "samples": 0, "output_tokens": 0,
            "cached_tokens": None, "sent": None, "end": None, "ttft": None, "itl": [],
            "e2e": None}  # fmt: skip


async def send_request(
    client, spec, body: dict, rec: dict, run_start: float, timeout: float
) -> None:
    """Send ``body`` now and read its stream into ``rec``, within ``timeout`` seconds; times
    in ``rec`` ("sent", "end") count from ``run_start``, TTFT and E2E from the send."""
    import httpx

    t0 = time.perf_counter()
    rec["sent"] = t0 - run_start
    try:
        await asyncio.wait_for(read_stream(client, spec, body, rec, t0, run_start), timeout)
    except asyncio.TimeoutError:
        rec.update(outcome="timeout", error=f"not done within {timeout:g} s")
    except httpx.HTTPError as e:
        rec.update(outcome="error", error=f"{type(e).__name__}: {e}")
    except Exception as e:  # a reply of an unexpected shape: this request's error, not the run's
        rec.update(outcome="error", error=f"a bad reply ({type(e).__name__}: {e})")
    if rec["end"] is None:
        rec["end"] = time.perf_counter() - run_start


async def read_stream(client, spec, body: dict, rec: dict, t0: float, run_start: float) -> None:
    """Read one response's SSE stream into ``rec`` (see the module docstring)."""
    tokens: dict[int, int] = {}  # choice index -> chunks that brought tokens
    reasons: dict[int, str | None] = {}
    times: list[float] = []  # when chunks that brought tokens came
    usage, last = None, None
    # aclosing: a cancel leaves the loop early, and the line reader must close before the stream
    async with (
        client.stream("POST", "/v1/completions", json=body) as response,
        contextlib.aclosing(sse_lines(response)) as lines,
    ):
        rec["status"] = response.status_code
        if response.status_code != 200:
            await response.aread()
            refused = 400 <= response.status_code < 500
            outcome = "rejected" if refused else "error"
            rec.update(outcome=outcome, error=error_message(response))
            return
        async for line in lines:
            if not line.startswith(b"data:"):  # blank separators, SSE comments
                continue
            data = line[len(b"data:") :].strip()
            if data == b"[DONE]":
                break
            now = time.perf_counter()
            try:
                chunk = json.loads(data.decode("utf-8"))
                choices = [(int(c.get("index", 0)), c) for c in chunk.get("choices") or ()]
                # how vLLM fails a stream that has begun (older ones: {"object": "error"})
                failed = chunk.get("error") or (chunk.get("object") == "error" and chunk)
                if not isinstance(chunk.get("usage"), (dict, type(None))):
                    raise TypeError(f"usage is {chunk['usage']!r}, not an object")
            except (ValueError, TypeError, AttributeError) as e:
                text = data[:200].decode("utf-8", "replace")
                rec.update(outcome="error", error=f"a bad chunk ({e}): {text}")
                return
            if failed:
                rec.update(outcome="error", error=f"an error in the stream: {failed}")
                return
            usage = chunk.get("usage") or usage
            brought = False
            for i, c in choices:
                reason = c.get("finish_reason")
                # a token, unless it is a bare end marker (no text, a finish reason)
                tokens[i] = tokens.get(i, 0) + (bool(c.get("text")) or reason is None)
                brought |= bool(c.get("text")) or reason is None
                reasons[i] = reason
            if choices:
                last = now
            if brought:
                times.append(now)
            cancel = spec.cancel_after and tokens.get(0, 0) >= spec.cancel_after
            if cancel and not reasons.get(0):
                rec["outcome"] = "cancelled"  # leaving the block closes the connection
                break
    rec["samples"], rec["finish_reasons"] = len(reasons), [reasons[i] for i in sorted(reasons)]
    rec["output_tokens"] = sum(tokens.values())
    if usage and rec["outcome"] != "cancelled":
        rec["output_tokens"] = _count(usage, "completion_tokens", rec["output_tokens"])
        rec["cached_tokens"] = _count(usage.get("prompt_tokens_details") or {}, "cached_tokens")
    rec["ttft"] = times[0] - t0 if times else None
    rec["itl"] = [b - a for a, b in itertools.pairwise(times)]
    rec["end"] = None if last is None else last - run_start
    if rec["outcome"] == "cancelled":
        return
    ended = list(reasons.values())
    if len(ended) < spec.params.n or None in ended:
        why = f"{len(ended)} of {spec.params.n} samples began; finish reasons {ended}"
        rec.update(outcome="error", error=f"the stream ended before every sample ended ({why})")
    elif set(ended) - {"stop", "length"}:
        rec.update(outcome="error", error=f"finish reasons {ended}")
    else:
        rec["outcome"] = "stopped" if "stop" in ended else "length"
        rec["e2e"] = last - t0


async def sse_lines(response):
    """The lines of an SSE stream as bytes, ends cut off: split at CR, LF or CRLF only (for bytes,
    ``bytes.splitlines`` splits there and nowhere else). A piece of the body may end mid-line, or
    between the CR and the LF of a CRLF: what is not yet ended by LF waits for the next piece."""
    rest = b""
    async for piece in response.aiter_bytes():
        lines = (rest + piece).splitlines(keepends=True)
        rest = lines.pop() if lines and not lines[-1].endswith(b"\n") else b""
        for line in lines:
            yield line.rstrip(b"\r\n")
    for line in rest.splitlines():  # the body's last line, if nothing ended it
        yield line


def _count(d: dict, key: str, default: int | None = None) -> int | None:
    """``d[key]``, a count of tokens (an int >= 0); ``default`` when absent or null. A reply of
    another shape raises ValueError, which fails this request (:func:`send_request`)."""
    if not isinstance(d, dict):
        raise ValueError(f"usage has {d!r} where an object with {key} belongs")
    x = d.get(key)
    if x is None:
        return default
    if isinstance(x, bool) or not isinstance(x, int) or x < 0:
        raise ValueError(f"usage's {key} is {x!r}, not a count of tokens")
    return x


def error_message(response) -> str:
    """The ``error.message`` of an OpenAI-style error body, else the start of the body."""
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200] or response.reason_phrase
