"""A tensor-parallel worker: one process, 1/N of every layer, its own KV slab, the driver's ints.

The driver (executor.py) starts N of these with :func:`worker_main`. Each one::

    receive the model
    join the process group (torch.distributed: gloo on CPUs, NCCL on GPUs)
    keep its share of every layer (sharding.py)
    allocate its KV slab: all num_blocks blocks, but only num_kv_heads / N heads
    loop: receive a message, do it, answer
        "step"     StepInputs -> write K/V at the slots, attend through the block tables, and
                   (rank 0 only) answer the logits; the all-reduces inside the forward are the
                   workers' only talk to each other
        "swap_out" / "swap_in" / "copy"    (src, dst) block pairs: the same block ids on every
                   worker, each moving its own heads
        "rpc"      run a function on this worker (``LLM.collective_rpc``)
        "stop"     leave the process group and exit

Nothing here decides anything: no scheduler, no block manager. A worker never learns which
sequence a block belongs to; it trusts the block ids it is sent, as a GPU worker trusts vLLM's
scheduler. That is why one block table serves every worker without any synchronisation beyond
the step's input (paper section 4.6).

A worker ignores Ctrl-C (a terminal sends it to the whole process group; the driver decides),
and exits when its pipe to the driver closes, so a driver that dies leaves no worker behind.
"""

from __future__ import annotations

import os
import pickle
import signal
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch

from pagedlearn.attention.kv_cache import KVCache
from pagedlearn.models.runner import ModelRunner, kv_cache_spec


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker needs to start (pickled into the new process)."""

    rank: int
    world_size: int
    init_method: str  # "file://..." : the rendezvous of torch.distributed.init_process_group
    device: str  # "cpu", or "cuda:<rank>"
    num_blocks: int
    block_size: int
    swap_blocks: int
    attention_backend: str
    timeout_s: float  # how long a collective may wait for a peer before it raises
    num_threads: int  # torch's intra-op threads on a CPU: pagedlearn's count split between workers


class Worker:
    """One rank's share: its sharded ``model``, its ``kv_cache`` (``num_kv_heads / N`` heads of
    every block) and the ``runner`` that runs a step over them. ``LLM.collective_rpc(fn)``
    calls ``fn(worker)`` on each; with ``tensor_parallel_size=1`` the one in-process worker is
    the whole model and the whole cache."""

    def __init__(self, rank: int, world_size: int, model, kv_cache: KVCache, runner) -> None:
        self.rank, self.world_size = rank, world_size
        self.model, self.kv_cache, self.runner = model, kv_cache, runner

    @property
    def head_ids(self) -> list[int]:
        """The model's KV heads this worker holds (the cache's head axis, in order)."""
        h = self.kv_cache.spec.num_kv_heads
        return list(range(self.rank * h, (self.rank + 1) * h))

    def describe(self) -> dict:
        """What the driver prints and the chapter shows: who holds what, in bytes."""
        weights = sum(_local(p).numel() * p.element_size() for p in self.model.parameters())
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "device": str(self.kv_cache.device),
            "kv_heads": self.head_ids,
            "kv_bytes": self.kv_cache.nbytes,
            "weight_bytes": weights,
        }

    def block_usage(self, layer: int = 0) -> torch.Tensor:
        """``(num_blocks, kv_heads)``: the mean |key| of each block's slots, per head, in
        ``layer``; 0 for a block never written. What the live view draws per worker."""
        k = self.kv_cache.key_cache(layer)  # (num_blocks, block_size, kv_heads, head_dim)
        return k.abs().float().mean(dim=(1, 3)).cpu()

    def time_all_reduce(self, num_tokens: int, iters: int = 20) -> float:
        """Seconds one all-reduce of a ``(num_tokens, hidden)`` activation takes among the
        workers (the median of ``iters``): what each layer pays twice. 0.0 with one worker."""
        if self.world_size == 1:
            return 0.0
        import torch.distributed as dist

        hidden = self.model.config.hidden_size
        cache = self.kv_cache
        x = torch.ones(num_tokens, hidden, dtype=cache.spec.dtype, device=cache.device)
        dist.barrier()  # start together, or the first one measures the others' lateness
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            dist.all_reduce(x)
            if x.is_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    def handle(self, kind: str, payload):
        if kind == "step":
            logits = self.runner.run(payload)  # (S, vocab) float32, the same on every rank
            if self.rank == 0:  # rank 0 answers for all (.cpu() waits for the GPU)
                return logits.cpu().numpy()
            if logits.is_cuda:  # the others answer when done, so that "busy" is the work
                torch.cuda.synchronize(logits.device)
            return None
        if kind == "swap_out":
            return self.kv_cache.swap_out(payload)
        if kind == "swap_in":
            return self.kv_cache.swap_in(payload)
        if kind == "copy":
            return self.kv_cache.copy_blocks(payload)
        if kind == "rpc":
            fn, args, kwargs = payload
            method = getattr(self, fn) if isinstance(fn, str) else None
            return method(*args, **kwargs) if method else fn(self, *args, **kwargs)
        raise ValueError(f"unknown message {kind!r}")


class AllReduceClock:
    """The seconds this worker spends inside ``torch.distributed.all_reduce`` -- the calls the
    row-parallel layers make in the forward -- and how many, since the last :meth:`reset`.
    Timed alone (:meth:`Worker.time_all_reduce`), an all-reduce of both workers arriving
    together is faster than one in a step, where the first to arrive waits for the other: this
    clock measures the latter. On a GPU, NCCL's all-reduce returns once queued: it times the
    launch (use a profiler there)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.seconds, self.count = 0.0, 0
        real = dist.all_reduce

        def timed(*args, **kwargs):  # transformers calls dist.all_reduce: this, in a worker
            t0 = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.count += 1

        dist.all_reduce = timed

    def reset(self) -> None:
        self.seconds, self.count = 0.0, 0


def _local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's own shard (a DTensor's local tensor), or the parameter if replicated."""
    return p.to_local() if hasattr(p, "to_local") else p


def _start(cfg: WorkerConfig, model) -> Worker:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pagedlearn.parallel.sharding import shard_model

    dev = torch.device(cfg.device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(cfg.num_threads)
    dist.init_process_group(
        "nccl" if dev.type == "cuda" else "gloo",
        init_method=cfg.init_method,
        rank=cfg.rank,
        world_size=cfg.world_size,
        timeout=timedelta(seconds=cfg.timeout_s),
    )
    mesh = init_device_mesh(dev.type, (cfg.world_size,))
    clock = AllReduceClock()
    spec = kv_cache_spec(model)  # the whole model's: read before the heads are split
    # Shard first, on the CPU: each planned weight goes to the device one at a time and only
    # this rank's slice stays there (torch's distribute_tensor); then the rest, which every
    # rank holds whole. So a GPU never holds the whole model.
    shard_model(model, mesh)  # keeps this rank's columns / rows; all-reduce after the row halves
    _move_whole_parts(model, dev)
    spec = spec.split_heads(cfg.world_size)
    cache = KVCache(spec, cfg.num_blocks, cfg.block_size, dev, cfg.swap_blocks)
    runner = ModelRunner(model, cache, cfg.attention_backend)
    worker = Worker(cfg.rank, cfg.world_size, model, cache, runner)
    worker.all_reduce_clock = clock
    return worker


def _move_whole_parts(model, dev: torch.device) -> None:
    """Move the parameters and buffers that are not shards (embeddings, norms, row-wise biases)
    to ``dev``, keeping tied ones tied (GPT-2's, OPT's and SmolLM2's LM head is the token
    embedding)."""
    moved: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or hasattr(p, "to_local"):  # a DTensor shard: already on the device
                continue
            if id(p) not in moved:
                moved[id(p)] = torch.nn.Parameter(p.data.to(dev), requires_grad=p.requires_grad)
            module._parameters[name] = moved[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = b.to(dev)


def _send(conn, *message) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def worker_main(cfg: WorkerConfig, conn) -> None:
    """The process's entry point: start, answer "ready" (or why not), then serve messages.

    Every answer is ``("ok", result, timings)`` or ``("error", traceback text)``; ``timings``
    says how long the message took to arrive (``received``: the driver's clock at sending to
    this worker's at receiving, one monotonic clock on one machine), to handle (``busy``), and
    how much of that was spent in all-reduces (``all_reduce`` seconds, ``all_reduces`` calls:
    :class:`AllReduceClock`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    try:
        model = pickle.loads(conn.recv_bytes())  # the driver's model: every rank the same weights
        worker = _start(cfg, model)
        _send(conn, "ok", worker.describe(), {})
    except BaseException:
        _send(conn, "error", traceback.format_exc())
        return
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):  # the driver is gone: so are we, at once (peers may be
            os._exit(0)  # waiting in a collective that will never complete)
        try:
            kind, payload, sent_at = pickle.loads(message)
        except BaseException:  # e.g. an rpc's function this process cannot import
            _send(conn, "error", traceback.format_exc())
            continue
        t0 = time.monotonic()
        if kind == "stop":
            _stop(conn)
            return
        clock = worker.all_reduce_clock
        clock.reset()
        try:
            result = worker.handle(kind, payload)
            timings = {"received": t0 - sent_at, "busy": time.monotonic() - t0,
                       "all_reduce": clock.seconds, "all_reduces": clock.count}  # fmt: skip
            answer = pickle.dumps(("ok", result, timings), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException:  # it raised, or its result cannot be pickled
            _send(conn, "error", traceback.format_exc())
            continue
        conn.send_bytes(answer)


def _stop(conn) -> None:
    import torch.distributed as dist

    try:  # every rank reaches the barrier before any tears the group down (gloo aborts if not)
        dist.barrier()
        dist.destroy_process_group()
        _send(conn, "ok", None, {})
    except BaseException:
        _send(conn, "error", traceback.format_exc())
    conn.close()
