"""``python -m pagedlearn loadtest``: drive the engine with the mix that exposes what paging does.

One run sends the requests of loadtest/mix.py to one engine, phase by phase: a Poisson mix, a
squeeze, and a cold, a warm and a new-version pass over shared prompts. The driver
(loadtest/driver.py) adds each request at its arrival time, steps the engine, cancels requests
mid-way, checks the pool's invariants after every step and audits the block trace for
cross-tenant cache hits (loadtest/checks.py). Between phases the engine runs dry; before the
cold pass its prefix cache is reset, before the version pass its ``model_version`` changes (it
is put back at the end).

The pool is squeezed on purpose: by default it holds two full-context sequences, and the swap
pool a quarter of that, so a preemption swaps while the swap pool has room and falls back to
recompute when it is full -- both modes in one run (``Scheduler._preempt``).

``run_loadtest`` returns a :class:`~pagedlearn.loadtest.report.LoadTestReport` (the numbers,
the checks, per-step and per-request series); the command prints its summary, writes every
number with ``--json`` (and the engine's Prometheus page with ``--prometheus``), and exits 1
if a *correctness* check failed (``report.ok``: something was lost, leaked, broken or shared
across tenants). A *coverage* check that missed -- the pool never ran short, the warm pass hit
nothing -- prints ``[--] not exercised`` with a hint and leaves the exit code at 0: the options
asked for a run that could not show it (``report.complete`` says whether everything was).

Rules worth knowing:

- Every option is checked before the model loads (:func:`check_options`; for the offline
  models the context too: :func:`check_context`), so that a usage error costs nothing.
- At the default rate the arrivals set the pace: the throughput says how fast requests came,
  not how fast the engine can go (``rate=inf`` measures the engine). A rate whose arrivals
  would span more than :data:`MAX_ARRIVAL_SPAN` seconds is refused.
- A request the engine never finishes does not hang the run: each phase has a bound on its
  steps (loadtest_driver.step_bound); past it what is left is aborted and reported "stuck".

A few seconds on ``tiny-gpt2``; ``--model gpt2`` for users with network.

>>> check_options(200, 40.0, 0, 16, None, None)  # the defaults: fine
>>> try:
...     check_options(200, 0.01, 0, 16, None, None)
... except LoadTestOptionError as e:
...     print(f"--{e.option}: {str(e).split(': ')[0]}")
--rate: at a rate of 0.01 requests/s, 200 requests arrive over about 20000 s, more than 3600 s
"""

from __future__ import annotations

import importlib
import os
import time
from types import SimpleNamespace

import torch

from pagedlearn.errors import PagedLearnError
from pagedlearn.loadtest.driver import Driver
from pagedlearn.loadtest.mix import (
    DEFAULT_NUM_REQUESTS,
    DEFAULT_RATE,
    PHASES,
    build_mix,
    default_pool,
    min_context,
    split_counts,
    too_short,
)
from pagedlearn.loadtest.report import LoadTestReport, build_report

MAX_ARRIVAL_SPAN = 3600.0  # seconds: num_requests / rate above this is refused (an hour)


class LoadTestOptionError(PagedLearnError, ValueError):
    """An argument the load test cannot run with; ``option`` names it (``"num_blocks"``), so
    that the command line reports it as ``--num-blocks`` with exit code 2."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


def check_options(num_requests, rate, seed, block_size, num_blocks, swap_blocks) -> None:
    """Raise :class:`LoadTestOptionError` for an argument no model could run with (a rate
    whose arrivals span more than :data:`MAX_ARRIVAL_SPAN` seconds, say)."""
    try:
        split_counts(num_requests)
    except PagedLearnError as e:
        raise LoadTestOptionError("num_requests", str(e)) from None
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
        raise LoadTestOptionError(
            "rate", f"rate must be > 0 requests/s, or inf (all at once), got {rate!r}"
        )
    if num_requests / rate > MAX_ARRIVAL_SPAN:  # the mix and the passes arrive at this rate
        raise LoadTestOptionError(
            "rate",
            f"at a rate of {rate:g} requests/s, {num_requests} requests arrive over about "
            f"{num_requests / rate:.0f} s, more than {MAX_ARRIVAL_SPAN:.0f} s: raise the rate "
            "or send fewer requests",
        )
    for name, value in (("seed", seed), ("block_size", block_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (name != "seed"):
            raise LoadTestOptionError(name, f"{name} must be an int >= {int(name != 'seed')}")
    for name, value in (("num_blocks", num_blocks), ("swap_blocks", swap_blocks)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise LoadTestOptionError(name, f"{name} must be None or an int >= 1, got {value!r}")


def check_progress(progress) -> None:
    """Raise :class:`LoadTestOptionError` unless ``progress`` is None or a callable taking
    ``(phase, done, total)`` (both load tests' ``progress`` argument)."""
    if progress is not None and not callable(progress):
        raise LoadTestOptionError(
            "progress", f"progress must be None or progress(phase, done, total), got {progress!r}"
        )


def check_context(max_len: int, block_size: int, num_blocks: int | None, model: str) -> None:
    """Raise :class:`LoadTestOptionError` when ``model``'s context of ``max_len`` tokens cannot
    hold the mix with this block size, or the pool (``num_blocks``; None: the default) cannot
    hold its near-limit prompts.

    >>> check_context(512, 16, None, "tiny-gpt2")  # the defaults
    >>> for block_size, num_blocks in ((128, None), (16, 32)):
    ...     try:
    ...         check_context(512, block_size, num_blocks, "tiny-gpt2")
    ...     except LoadTestOptionError as e:
    ...         print(f"{e.option}: ...{str(e)[str(e).rindex(' need'):]}")
    block_size: ... need 800; the largest block size that fits is 80
    num_blocks: ... need 33 blocks of 16 tokens, more than 32
    """
    if max_len < min_context(block_size):
        raise LoadTestOptionError("block_size", too_short(max_len, block_size))
    num_blocks, _ = default_pool(max_len, block_size, num_blocks)
    need = -(-max_len // block_size) + 1  # a near-limit request, and the watermark's block
    if num_blocks < need:
        raise LoadTestOptionError(
            "num_blocks",
            f"the mix has prompts near {model}'s context of {max_len} "
            f"tokens: they need {need} blocks of {block_size} tokens, more than {num_blocks}",
        )


def preflight(llm_or_model, num_requests, rate, seed, block_size, num_blocks, swap_blocks,
              prometheus) -> None:  # fmt: skip
    """Every check that needs no model: the options, the context of an offline model (from
    its config alone), and ``prometheus_client`` when ``prometheus`` asks for its page.
    :func:`run_loadtest` runs it first; the command, before it says it is loading."""
    check_options(num_requests, rate, seed, block_size, num_blocks, swap_blocks)
    from pagedlearn.models.offline import OFFLINE_MODELS, tiny_config
    from pagedlearn.models.runner import max_model_len

    if isinstance(llm_or_model, str) and llm_or_model in OFFLINE_MODELS:
        config = tiny_config(llm_or_model)  # no weights: milliseconds
        max_len = max_model_len(SimpleNamespace(config=config))
        check_context(max_len, block_size, num_blocks, llm_or_model)
    if prometheus is not None:
        try:  # not after the model loaded and the run went by
            importlib.import_module("prometheus_client")
        except ImportError as e:
            from pagedlearn.engine.prometheus import MetricsUnavailableError

            raise MetricsUnavailableError(
                'the Prometheus export needs prometheus_client: pip install "pagedlearn[metrics]"'
            ) from e


def run_loadtest(
    llm_or_model="tiny-gpt2",
    num_requests: int = DEFAULT_NUM_REQUESTS,
    rate: float = DEFAULT_RATE,
    seed: int = 0,
    *,
    block_size: int = 16,
    num_blocks: int | None = None,
    swap_blocks: int | None = None,
    prometheus: str | os.PathLike | None = None,
    verbose: bool = False,
    progress=None,
) -> LoadTestReport:
    """Run the load test; returns its report (``report.ok``: every correctness check passed;
    ``report.complete``: every coverage check too).

    ``llm_or_model``: a model name for :class:`~pagedlearn.LLM` (built here with prefix caching,
    swap preemption and the pool of :func:`default_pool` unless ``num_blocks`` / ``swap_blocks``
    say otherwise), or an idle ``LLM`` to drive as it is (then ``block_size``, ``num_blocks``
    and ``swap_blocks`` must stay at their defaults). Its prefix cache is reset during the run.
    ``rate``: requests per second of the Poisson arrivals (``float("inf")``: all at once).
    ``prometheus``: a file to write the engine's Prometheus page to after the run
    (:func:`~pagedlearn.engine.prometheus.prometheus_text`); ``verbose``: a line per phase;
    ``progress``: None, or called as ``progress(phase, done, total)`` when a phase starts
    (``done`` 0) and each time one of its ``total`` requests ends (the command passes
    :func:`phase_progress`: lines on stderr).
    A bad option raises :class:`LoadTestOptionError` before any model loads (see
    :func:`preflight`).
    """
    args = (num_requests, rate, seed, block_size, num_blocks, swap_blocks, prometheus)
    preflight(llm_or_model, *args)
    check_progress(progress)
    t_load = time.perf_counter()
    llm = _llm(llm_or_model, block_size, num_blocks, swap_blocks)
    engine = llm.engine
    if engine.has_unfinished_requests():
        raise PagedLearnError("run_loadtest needs an idle engine; this one has requests queued")
    kv = engine.kv
    check_context(engine.max_model_len, kv.block_size, kv.allocator.num_blocks, llm.model_name)
    config = {
        "model": llm.model_name,
        "num_requests": num_requests,
        "rate": rate,
        "seed": seed,
        "block_size": kv.block_size,
        "num_blocks": kv.allocator.num_blocks,
        "swap_blocks": kv.cpu_allocator.num_blocks if kv.cpu_allocator else 0,
        "preemption_mode": engine.scheduler.preemption_mode,
        "enable_prefix_caching": bool(getattr(kv, "enable_prefix_caching", False)),
        "max_model_len": engine.max_model_len,
        "load_time": time.perf_counter() - t_load,
    }
    specs = build_mix(
        num_requests,
        seed,
        rate,
        engine.max_model_len,
        kv.block_size,
        config["num_blocks"],
        max(config["swap_blocks"], 1),
    )
    driver = Driver(engine, progress)
    version_before = engine.model_version
    threads = torch.get_num_threads()
    # On a CPU, one torch thread (as sim/serving_latency.py times): the offline models' ops are
    # too small to gain from more, and on a busy machine torch's threads waiting for each other
    # made a run ten times slower. Put back afterwards.
    config["torch_threads"] = 1 if llm.device.type == "cpu" else threads
    torch.set_num_threads(config["torch_threads"])
    try:
        for phase in PHASES:
            if phase == "cold":
                engine.reset_prefix_cache()  # idle: every request of the earlier phases is done
            if phase == "version":
                engine.model_version = f"{version_before}+loadtest"  # new weights, say
            driver.run_phase(phase, [s for s in specs if s.phase == phase])
            if verbose:
                p = driver.phases[phase]
                print(f"  {phase:<8} {p['requests']:>4} requests in {p['wall_time']:.2f} s",
                      flush=True)  # fmt: skip
    finally:
        torch.set_num_threads(threads)
        driver.close()
        if not engine.has_unfinished_requests():
            engine.model_version = version_before
    report = build_report(driver, config)
    if prometheus is not None:
        from pagedlearn.engine.prometheus import prometheus_text

        with open(prometheus, "w") as f:
            f.write(prometheus_text(engine, llm.model_name))
        report.prometheus = os.fspath(prometheus)
    return report


def _llm(llm_or_model, block_size, num_blocks, swap_blocks):
    from pagedlearn import LLM
    from pagedlearn.models import LoadedModel, load

    if isinstance(llm_or_model, LLM):
        if (block_size, num_blocks, swap_blocks) != (16, None, None):
            raise LoadTestOptionError(
                "num_blocks",
                "give block_size / num_blocks / swap_blocks with a model name, "
                "not with an LLM: its pool is already built",
            )
        return llm_or_model
    loaded = llm_or_model if isinstance(llm_or_model, LoadedModel) else load(llm_or_model)
    from pagedlearn.models.runner import max_model_len

    max_len = max_model_len(loaded.model)
    check_context(max_len, block_size, num_blocks, loaded.name)  # a hub model: known only now
    num_blocks, auto_swap = default_pool(max_len, block_size, num_blocks)
    swap_blocks = auto_swap if swap_blocks is None else swap_blocks
    return LLM(
        loaded,
        block_size=block_size,
        num_blocks=num_blocks,
        preemption_mode="swap",
        swap_blocks=swap_blocks,
        verbose=False,
    )


def phase_progress(file=None, every: float = 5.0):
    """A ``progress`` for :func:`run_loadtest` and the HTTP load test's ``run_http_loadtest``
    that prints on stderr (``file``): a line as each phase starts (a phase whose requests all
    run at once, as the squeeze does, may end none of them for minutes: the line says what is
    running meanwhile), then its requests ended so far with the time they took and the time
    left at that rate (:class:`~pagedlearn.progress.Progress`: a bar on a terminal, else a line
    at most every ``every`` seconds, and one when the phase's last request ends)."""
    from pagedlearn.progress import Progress

    bar: Progress | None = None  # the running phase's (one phase runs at a time)

    def progress(phase: str, done: int, total: int) -> None:
        nonlocal bar
        if done == 0:
            if bar is not None:
                bar.close()
            bar = Progress(f"loadtest {phase} phase", total, "requests", file, every)
            bar.note(f"loadtest: the {phase} phase starts: {total} requests")
        bar.set(done)
        if done >= total:
            bar.close()
            bar = None

    return progress


def cli(args) -> int:
    """``python -m pagedlearn loadtest`` once its options parsed: run, print the summary, write
    ``--json``; 0 if every correctness check passed (coverage misses print ``[--]`` and do not
    count), else 1. A :class:`LoadTestOptionError` (the pool is too small for the model's
    context, say) is left to the caller: a usage error, raised before the model loads."""
    import json

    args_ = (args.num_requests, args.rate, args.seed, args.block_size, args.num_blocks,
             args.swap_blocks, args.prometheus)  # fmt: skip
    preflight(args.model, *args_)  # before "loading": a usage error costs nothing
    print(f"pagedlearn load test: loading {args.model} ...", flush=True)
    report = run_loadtest(
        args.model,
        args.num_requests,
        args.rate,
        args.seed,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        swap_blocks=args.swap_blocks,
        prometheus=args.prometheus,
        verbose=True,
        progress=phase_progress(),
    )
    print(report.summary())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.as_dict(), f, indent=1)
        print(f"every number: {args.json}")
    if report.prometheus:
        print(f"the engine's Prometheus page: {report.prometheus}")
    return 0 if report.ok else 1
