"""``python -m pagedlearn loadtest --endpoint URL``: the load test's mix, sent over HTTP to any
OpenAI-compatible server (pagedlearn's, vLLM's, SGLang's).

The in-process load test (loadtest/in_process.py) steps an engine it holds. This one has only what
every client has -- a URL, maybe an API key -- and measures what a client sees::

    build_mix() ──> one asyncio task per request, asleep until its Poisson arrival
        │               │ POST /v1/completions {"stream": true, ...}
        │               ▼
        │           SSE "data: {...}" chunks ──> TTFT, ITL, E2E (the client's clock), tokens
        │               └──> "cancel": close the stream after k tokens
        └── phase by phase; GET /metrics before and after each, and 4 times a second for the peak

How the mix maps onto HTTP (the choices, so that a reader can judge the numbers). One request --
its JSON body, its SSE stream, how TTFT / ITL / E2E are read off it, what a cancel does, the
outcome its record ends with -- is loadtest/http_stream.py; this module runs the mix:

- **Tenants and the cold / warm / version passes are cache salts.** OpenAI's API cannot reset
  a server's prefix cache or change its model version (vLLM's ``POST /reset_prefix_cache``
  exists only with ``VLLM_SERVER_DEV_MODE=1``), so every request carries the salt
  ``<run id>-<epoch>-<tenant>``. The run id is random: a rerun against the same server starts
  cold. Each tenant gets a salt of its own -- the one without a salt, and the one with an adapter
  too (a salt stands in for a LoRA the server may not have). The epoch is "mix" for the mix and
  the squeeze, "pass" for the cold and the warm pass, and "version" for the version pass: a new
  salt stands in for a new model version, whose requests no old block may serve. So cold and
  version must hit nothing, warm must hit. Hits are read from each response's
  ``usage.prompt_tokens_details.cached_tokens`` when all of a phase's responses have it, else
  from the change of the /metrics prefix-cache counters over the phase.
- **The over-long prompt** must come back 4xx; any other 4xx, a 5xx, an ``error`` in the stream,
  a stream that ends before every sample finished or a reply of another shape is an error (of
  that request: the run goes on).
- **Phases** run in order, each drains (every stream ended) before the next, as in-process.
- **The squeeze is sized to the pool the server reports** (``num_gpu_blocks``; else two full
  contexts): a burst meant to want about twice the pool. Against a large pool (vLLM on a big
  GPU: tens of thousands of blocks) each of its requests is nearly ``max_model_len`` tokens long
  -- 20 of 32,768 tokens, say: about 650,000 tokens at once. What bounds it is its count
  (``num_requests // 10``, at least 8) times the context; ``--max-model-len`` caps the context
  the mix is built for (no more than the server's, or its near-limit prompts come back 4xx).

**Comparing two servers** (the same seed, ``num_requests`` and rate, one report each): the mix
phase depends on the options, the context and the block size, not on the pool: it is the same
for any pool. The squeeze is sized to the pool each server reports (GPU blocks, and swap blocks
where /metrics says), and the passes after it draw from the same seeded stream, so they change
with it: two servers get identical requests only with the same pool -- vLLM's
``--num-gpu-blocks-override N``, pagedlearn's ``--num-blocks N``.

Bounded: a request may take ``timeout`` seconds (then it is "timed out"), the run as long as
its arrivals plus a timeout per phase; the polls keep :data:`MAX_SAMPLES` samples at most. The
pool's shape comes from ``cache_config_info`` when /metrics has it (the block size, and the GPU
pool the squeeze is sized to), the context from the model card (``max_model_len``: vLLM's and
pagedlearn's ``GET /v1/models`` give it). With other clients on the server, the /metrics
numbers are the server's (theirs included); the client-side numbers are this run's alone.

>>> root_url("http://127.0.0.1:8000/v1/"), salt_of("3f2a", "warm", None, "adapter-x")
('http://127.0.0.1:8000', '3f2a-pass-default-adapter-x')
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import sys
import time
from collections import Counter

from pagedlearn.errors import PagedLearnError
from pagedlearn.loadtest.http_report import HTTPLoadTestReport, build_http_report
from pagedlearn.loadtest.http_stream import error_message, new_record, request_body, send_request
from pagedlearn.loadtest.in_process import (
    LoadTestOptionError,
    check_options,
    check_progress,
    phase_progress,
)
from pagedlearn.loadtest.mix import PHASES, build_mix, default_pool, min_context, too_short
from pagedlearn.loadtest.server_metrics import delta, scrape

POLL_INTERVAL = 0.25  # seconds between /metrics polls during the run (the peak KV usage)
MAX_SAMPLES = 2400  # polls kept in the report's series (10 minutes at 4 a second)
IDLE_WAIT = 5.0  # seconds the server may take after the run to finish its aborts
EPOCHS = {"cold": "pass", "warm": "pass", "version": "version"}  # the other phases: "mix"


class HTTPLoadTestError(PagedLearnError):
    """The server cannot be reached, or its ``GET /v1/models`` is of no use: the message names
    the URL and what went wrong (the command exits 1)."""


def root_url(endpoint: str) -> str:
    """The server's root URL from what a user gives: a trailing "/" or "/v1" is dropped."""
    if not isinstance(endpoint, str) or not endpoint.startswith(("http://", "https://")):
        raise LoadTestOptionError(
            "endpoint", f"the endpoint is a URL such as http://127.0.0.1:8000, got {endpoint!r}"
        )
    root = endpoint.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def salt_of(run_id: str, phase: str, salt: str | None, adapter: str | None) -> str:
    """A request's cache salt: run, epoch and tenant (see the module docstring)."""
    return f"{run_id}-{EPOCHS.get(phase, 'mix')}-{salt or 'default'}-{adapter or 'base'}"


def run_http_loadtest(
    endpoint: str,
    *,
    api_key: str | None = None,
    model: str | None = None,
    num_requests: int = 200,
    rate: float = 40.0,
    seed: int = 0,
    block_size: int | None = None,
    max_model_len: int | None = None,
    timeout: float = 60.0,
    progress=None,
) -> HTTPLoadTestReport:
    """Send the load test's mix to the server at ``endpoint`` (``http://host:port``, a trailing
    ``/v1`` is fine) and return its report (``report.ok``: every correctness check passed).

    ``model``: None for the first ``GET /v1/models`` lists; ``max_model_len``: None for the
    model card's; ``block_size``: None for /metrics' ``cache_config_info``, else 16; ``timeout``:
    seconds per request; ``progress``: None, or called as ``progress(phase, done, total)`` when
    a phase starts (``done`` 0) and each time one of its ``total`` requests ends, however it
    ended (the command passes :func:`phase_progress`: lines on stderr). Raises
    :class:`HTTPLoadTestError` when the server cannot be reached or ``/v1/models`` is of no use,
    :class:`~pagedlearn.loadtest.in_process.LoadTestOptionError` for a bad option (before sending
    anything)."""
    root = root_url(endpoint)
    check_options(num_requests, rate, seed, 16 if block_size is None else block_size, None, None)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < 1e6:
        raise LoadTestOptionError("timeout", f"timeout must be seconds > 0, got {timeout!r}")
    if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 1):
        raise LoadTestOptionError(
            "max_model_len", f"max_model_len must be None or an int >= 1, got {max_model_len!r}"
        )
    check_progress(progress)
    args = (root, api_key, model, num_requests, rate, seed, block_size, max_model_len, timeout,
            progress)  # fmt: skip
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_run(*args))
    import concurrent.futures  # a notebook's loop runs in this thread: run ours in another

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, _run(*args)).result()


async def model_card(client, root: str, model: str | None) -> dict:
    """The card of ``model`` (None: the first) from ``GET /v1/models``."""
    import httpx

    url = root + "/v1/models"
    try:
        response = await client.get("/v1/models")
    except httpx.HTTPError as e:
        raise HTTPLoadTestError(f"cannot reach {url}: {type(e).__name__}: {e}") from None
    status, why = response.status_code, error_message(response)
    if status in (401, 403):
        has_key = "Authorization" in client.headers
        raise HTTPLoadTestError(
            f"GET {url} answered {status} ({why}): "
            + ("the server refused the API key" if has_key else "the server wants an API key")
            + ": give --api-key (or set OPENAI_API_KEY)"
        )
    if status != 200:
        raise HTTPLoadTestError(f"GET {url} answered {status}: {why}")
    try:
        cards = response.json()["data"]
        ids = [c["id"] for c in cards]
    except (ValueError, KeyError, TypeError):
        raise HTTPLoadTestError(
            f"GET {url} did not answer an OpenAI model list ({{'data': [{{'id': ...}}]}}): "
            f"{response.text[:200]!r}"
        ) from None
    if not ids:
        raise HTTPLoadTestError(f"GET {url} lists no model")
    if model is None:
        return cards[0]
    if model not in ids:
        raise HTTPLoadTestError(f"{url} does not serve {model!r}; it serves {', '.join(ids)}")
    return cards[ids.index(model)]


async def _run(
    root, api_key, model, num_requests, rate, seed, block_size, max_model_len, timeout, progress
) -> HTTPLoadTestReport:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    # httpx's own timeout a little longer: a request's bound is Run.send's (then "timed out")
    async with httpx.AsyncClient(
        base_url=root, headers=headers, timeout=timeout + 5.0, limits=limits
    ) as client:
        card = await model_card(client, root, model)
        first = await scrape(client)
        info = first or {}
        bs = block_size or info.get("block_size") or 16
        max_len = max_model_len or card.get("max_model_len")
        if not isinstance(max_len, int) or max_len < 1:
            raise HTTPLoadTestError(
                f"the card of {card['id']!r} at {root}/v1/models has no max_model_len: give "
                "max_model_len="
            )
        if max_len < min_context(bs):
            raise LoadTestOptionError("max_model_len", too_short(max_len, bs))
        num_blocks, swap = default_pool(max_len, bs, info.get("num_gpu_blocks"))
        swap = info.get("num_cpu_blocks") or swap
        specs = build_mix(num_requests, seed, rate, max_len, bs, num_blocks, swap)
        squeeze = [s for s in specs if s.phase == "squeeze"]
        run_id = secrets.token_hex(4)
        source = (
            "argument" if block_size else "cache_config_info" if info.get("block_size") else None
        )
        config = {"endpoint": root, "model": card["id"], "owned_by": card.get("owned_by"),
                  "server_metrics": info.get("source"), "num_requests": num_requests,
                  "rate": rate, "seed": seed, "block_size": bs,
                  "block_size_from": source or "default", "max_model_len": max_len,
                  "num_gpu_blocks": info.get("num_gpu_blocks"),
                  "num_cpu_blocks": info.get("num_cpu_blocks"), "squeeze_pool": num_blocks,
                  "squeeze_requests": len(squeeze), "squeeze_tokens": max(
                      len(s.prompt_token_ids) + s.params.max_tokens for s in squeeze),
                  "timeout": timeout, "run_id": run_id}  # fmt: skip
        run = _Run(client, specs, run_id, card["id"], timeout, first is not None, progress)
        bound = sum(max(s.arrival for s in specs if s.phase == p) for p in PHASES)
        bound += len(PHASES) * (timeout + 5.0)  # every request ends by its arrival + timeout
        poller = asyncio.create_task(run.poll()) if first else None
        try:
            await asyncio.wait_for(run.phases_in_order(), bound)
        except asyncio.TimeoutError:
            run.error = f"the run's bound of {bound:.0f} s passed; what was left is lost"
        finally:
            run.wall = time.perf_counter() - run.start
            if poller:
                poller.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await poller
        last, waited = await run.settle() if first else (None, 0.0)
    server = {"before": first, "after": last, "settle_time": waited, **run.peak}
    return build_http_report(
        config, run.records, run.phases, server, run.samples, run.wall, run.error
    )


class _Run:
    """One run's state: the records (one dict per request, filled in as its stream goes), the
    phases' numbers, the /metrics samples."""

    def __init__(self, client, specs, run_id, model, timeout, metrics: bool, progress=None):
        self.client, self.specs, self.timeout, self.metrics = client, specs, timeout, metrics
        self.progress, self.ended = progress, 0  # the requests of this phase that ended
        self.sizes = Counter(s.phase for s in specs)  # phase -> its requests
        self.salts = {s.request_id: salt_of(run_id, s.phase, s.salt, s.adapter) for s in specs}
        self.bodies = {
            s.request_id: request_body(s, model, self.salts[s.request_id]) for s in specs
        }
        self.records = {s.request_id: new_record(s, self.salts[s.request_id]) for s in specs}
        self.phases: dict[str, dict] = {}
        self.samples: dict[str, list] = {"t": [], "kv_usage": [], "used_blocks": [], "running": []}
        self.peak = {"peak_kv_usage": None, "peak_used_blocks": None}
        self.error: str | None = None
        self.start = time.perf_counter()
        self.wall = 0.0

    async def phases_in_order(self) -> None:
        for phase in PHASES:
            specs = [s for s in self.specs if s.phase == phase]
            before = await self.scrape()
            start = time.perf_counter()
            self.ended = 0
            if self.progress is not None:
                self.progress(phase, 0, len(specs))
            await asyncio.gather(*(self.send(s, start) for s in specs))
            wall = time.perf_counter() - start
            after = await self.scrape()
            self.phases[phase] = {
                "requests": len(specs),
                "wall_time": wall,
                **{
                    k: delta(before, after, k)
                    for k in ("prefix_queries", "prefix_hits", "preemptions")
                },
            }

    async def send(self, spec, phase_start: float) -> None:
        """Wait for the request's arrival, then send it (loadtest/http_stream.py)."""
        await asyncio.sleep(max(0.0, phase_start + spec.arrival - time.perf_counter()))
        rid = spec.request_id
        await send_request(
            self.client, spec, self.bodies[rid], self.records[rid], self.start, self.timeout
        )
        self.ended += 1  # one event loop: no other task runs between these two lines
        if self.progress is not None:
            self.progress(spec.phase, self.ended, self.sizes[spec.phase])

    async def scrape(self) -> dict | None:
        m = await scrape(self.client) if self.metrics else None
        if m:
            self.sample(m)
        return m

    def sample(self, m: dict) -> None:
        for key, peak in (("kv_usage", "peak_kv_usage"), ("used_blocks", "peak_used_blocks")):
            if m[key] is not None:
                self.peak[peak] = max(m[key], self.peak[peak] or 0)
        if len(self.samples["t"]) < MAX_SAMPLES:
            self.samples["t"].append(time.perf_counter() - self.start)
            for key in ("kv_usage", "used_blocks", "running"):
                self.samples[key].append(m[key])

    async def poll(self) -> None:
        while True:
            await self.scrape()
            await asyncio.sleep(POLL_INTERVAL)

    async def settle(self) -> tuple[dict | None, float]:
        """/metrics once the server is idle (no request running or waiting, no block held),
        or after :data:`IDLE_WAIT` seconds; and the seconds it took."""
        start, m = time.perf_counter(), None
        while True:
            m = await self.scrape() or m
            idle = m is not None and all(
                not m[k] for k in ("running", "waiting", "used_blocks", "cpu_used_blocks")
            )
            if idle or time.perf_counter() - start > IDLE_WAIT:
                return m, time.perf_counter() - start
            await asyncio.sleep(0.05)


def cli(args) -> int:
    """``python -m pagedlearn loadtest --endpoint URL``: run, print the summary, write
    ``--json``; 0 if every correctness check passed, 1 if one failed or the run could not go on
    (the server cannot be reached, its ``/v1/models`` is of no use: the message says). A
    :class:`~pagedlearn.loadtest.in_process.LoadTestOptionError` reaches the caller, which reports
    it as a usage error (exit 2), as for the in-process load test."""
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or None
    print(f"pagedlearn load test over HTTP: {args.endpoint} ...", flush=True)
    try:
        report = run_http_loadtest(
            args.endpoint,
            api_key=api_key,
            model=args.model,
            num_requests=args.num_requests,
            rate=args.rate,
            seed=args.seed,
            max_model_len=getattr(args, "max_model_len", None),
            timeout=args.timeout,
            progress=phase_progress(),
        )
    except HTTPLoadTestError as e:
        print(f"loadtest stopped: {e}", file=sys.stderr)
        return 1
    print(report.summary())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.as_dict(), f, indent=1)
        print(f"every number: {args.json}")
    return 0 if report.ok else 1
