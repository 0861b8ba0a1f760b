"""Part 3 of bench_serve.py: does a server's memory stay flat over thousands of requests?

A server that leaks a little per request -- a dict entry per request id never deleted, a
finished request's output kept, the task of a closed stream never collected -- looks healthy for
minutes and runs out of memory after days. The test: send many short requests and read the
server process's resident set size (``VmRSS`` in ``/proc/<pid>/status``: its pages in RAM)
after a warm-up and after each mark. A leak shows as growth per 1,000 requests that does not
fall to about zero once the warm-up's one-off allocations (lazy imports, caches, allocator
pools) are behind it.

The traffic is the kind that leaks, not the kind that is slow: every request is short (a
completion: 2 to 6 random token ids from ``random.Random(index)``; a chat: 6 random characters;
``max_tokens`` 4, 16 for the stream to close), and request ``i`` is of kind ``KINDS[i % 20]``:
8 plain and 8 streamed completions, a chat, a streamed chat, a stream closed after its first
chunk (the server must notice the disconnect and abort the request: a path that easily forgets
to free) and a bad body (one of :data:`BAD_BODIES`: it must get a 400 and leave nothing
behind). ``concurrency`` workers take the next index from one shared iterator, so the requests
overlap as a server's clients do. Each answer is checked -- a 400 for a bad body, a 200 with
choices for the rest, a stream with no ``error`` that ends with ``data: [DONE]`` (a closed
stream: any chunk) -- and counted by kind and verdict. After the run it prints what /metrics
says: blocks held and requests running (both 0 when nothing leaked in the engine). It prints,
and asserts nothing.

Import it as bench_serve.py does, from the benchmarks folder (not a package: a script's own
folder is on ``sys.path``): ``from serve_traffic import memory, print_memory``.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections import Counter
from pathlib import Path

import httpx

from pagedlearn.loadtest.server_metrics import scrape

# The requests cycle through these 20 kinds: mostly plain completions, a few of the rest.
KINDS = ("bad", "cancel", "chat", "chat-stream") + ("stream",) * 8 + ("plain",) * 8
BAD_BODIES = ({"max_tokens": -1}, {"temperature": -0.5}, {"n": 0}, {"top_p": 2.0})


def rss_mib(pid: int) -> float:
    """The resident set size of process ``pid`` in MiB (Linux: ``VmRSS`` of /proc/<pid>/status)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) / 1024


async def short_requests(
    url: str, model: str, first: int, last: int, concurrency: int, answered=None
) -> Counter:
    """Part 3's requests ``first .. last - 1``, ``concurrency`` at a time; counts of (kind,
    verdict). ``answered`` (or None): called with no argument after each answer."""
    counts: Counter = Counter()
    todo = iter(range(first, last))  # shared: each worker takes the next index
    async with httpx.AsyncClient(base_url=url, timeout=60.0) as client:

        async def worker() -> None:
            for i in todo:
                kind, fine, status = await one_request(client, model, i)
                counts[(kind, "ok" if fine else f"unexpected {status}")] += 1
                if answered is not None:
                    answered()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return counts


async def one_request(client, model: str, i: int) -> tuple[str, bool, int]:
    """Request ``i``: its kind, whether its answer was the expected one, its HTTP status."""
    rng, kind = random.Random(i), KINDS[i % len(KINDS)]
    prompt = [rng.randrange(256) for _ in range(rng.randint(2, 6))]
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 1.0, "seed": i}
    path = "/v1/completions"
    if kind.startswith("chat"):
        path, text = "/v1/chat/completions", "".join(rng.choice("abcdefgh ") for _ in range(6))
        body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    if kind == "bad":
        body.update(BAD_BODIES[i // len(KINDS) % len(BAD_BODIES)])
        r = await client.post(path, json=body)
        return kind, r.status_code == 400, r.status_code
    if kind == "plain" or kind == "chat":
        r = await client.post(path, json=body)
        return kind, r.status_code == 200 and "choices" in r.json(), r.status_code
    body.update(stream=True, max_tokens=16 if kind == "cancel" else 4)
    async with client.stream("POST", path, json=body) as r:
        lines = []
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                lines.append(line)
                if kind == "cancel":
                    break  # leaving the block closes the connection: the server must abort
    fine = bool(lines) and (kind == "cancel" or lines[-1] == "data: [DONE]")
    return (
        kind,
        r.status_code == 200 and fine and not any('"error"' in x for x in lines),
        r.status_code,
    )


def memory(
    url: str,
    model: str,
    pid: int,
    marks: list[int],
    warmup: int,
    concurrency: int,
    progress=None,
) -> dict:
    """Part 3 against the server at ``url`` (process ``pid``, serving ``model``): RSS after the
    warm-up and after each mark (requests counted after the warm-up).

    ``progress`` (or None): called as ``progress(done, total)`` -- requests counted so far, of
    ``marks[-1]`` -- with 0 once the warm-up is over (the work to estimate starts then), after
    each counted answer, and after each mark once its RSS is read. bench_serve.py passes
    ``Progress.set``, which prints at most a line per ``every`` seconds."""
    total, answered = marks[-1], 0

    def one_more() -> None:  # after each counted answer (the workers share one event loop)
        nonlocal answered
        answered += 1
        progress(answered, total)

    def send(a: int, b: int, count: bool) -> Counter:
        hook = one_more if count and progress is not None else None
        return asyncio.run(short_requests(url, model, a, b, concurrency, hook))

    counts = send(0, warmup, False)  # the warm-up: requests 0 .. warmup - 1; then the counted
    points, done = [{"requests": 0, "rss_mib": rss_mib(pid), "seconds": 0.0}], 0
    if progress is not None:
        progress(0, total)
    for mark in marks:
        t0 = time.perf_counter()
        counts += send(warmup + done, warmup + mark, True)
        points.append({"requests": mark, "rss_mib": rss_mib(pid),
                       "seconds": time.perf_counter() - t0})  # fmt: skip
        done = mark
        if progress is not None:
            progress(mark, total)
    first, last = points[1], points[-1]
    growth = (last["rss_mib"] - first["rss_mib"]) / ((last["requests"] - first["requests"]) / 1000)

    async def after() -> dict | None:
        async with httpx.AsyncClient(base_url=url, timeout=10.0) as client:
            return await scrape(client)

    m = asyncio.run(after()) or {}
    return {"warmup": warmup, "concurrency": concurrency, "points": points, "growth": growth,
            "answers": {f"{k} {v}": n for (k, v), n in sorted(counts.items())},
            "unexpected": sum(n for (k, v), n in counts.items() if v != "ok"),
            "used_blocks_after": m.get("used_blocks"),
            "running_after": m.get("running")}  # fmt: skip


def print_memory(m: dict, model: str, pid: int) -> None:
    print(f"\nserver memory, {model}: VmRSS of pid {pid} (/proc/{pid}/status); short requests "
          f"(kinds: {', '.join(sorted(set(KINDS)))}), {m['concurrency']} at once, after a "
          f"warm-up of {m['warmup']}")  # fmt: skip
    prev = None
    for p in m["points"]:
        when = f"after {p['requests']:,} requests" if p["requests"] else "after the warm-up"
        took = f"  ({p['seconds']:.1f} s for these" if p["requests"] else ""
        if prev and prev["requests"]:
            per = (p["rss_mib"] - prev["rss_mib"]) / (p["requests"] - prev["requests"]) * 1000
            took += f"; {per:+.3f} MiB per 1,000 since the mark before"
        print(f"  {when:<24} {p['rss_mib']:9.2f} MiB{took + ')' if took else ''}")
        prev = p
    first, last = m["points"][1], m["points"][-1]
    print(
        f"  growth = ({last['rss_mib']:.2f} - {first['rss_mib']:.2f}) MiB / "
        f"({last['requests']:,} - {first['requests']:,}) requests x 1,000 = {m['growth']:.3f} MiB "
        "per 1,000 requests"
    )
    answers = ", ".join(f"{k} {n:,}" for k, n in m["answers"].items())
    print(f"  answers: {answers}; unexpected: {m['unexpected']}")
    held, running = (
        m[k] if m[k] is None else int(m[k]) for k in ("used_blocks_after", "running_after")
    )
    print(f"  after the run (/metrics): {held} blocks held, {running} requests running")
