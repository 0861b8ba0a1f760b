"""The driver's side of tensor parallelism: start N workers, send each step, gather the answer.

::

    driver process (LLM, LLMEngine)                   worker processes (worker.py)
    Scheduler + KVCacheManager: ONE block table
      │ prepare_inputs(scheduled) -> StepInputs        rank 0: heads 0 .. H/N-1    ┐ all-reduce
      ├──── the same pickled bytes to every worker ──> rank 1: heads H/N .. 2H/N-1 ┤ twice per
      │     (token ids, positions, slots, tables)      ...                         ┘ layer
      <──── logits (S, vocab) from rank 0 ──────────── every rank computes the same logits
      sample, append, fork, free: on the driver only

This is the paper's section 4.6 (and vLLM's ``MultiprocExecutor``): the scheduler and the block
manager live once, in the driver; a step's input is the only thing the workers need, because
every worker stores *its* heads of every token at the *same* block id. The block pool needs no
synchronisation between workers: no worker ever allocates.

:class:`TensorParallelExecutor` stands where the single-process ``ModelRunner`` stands (the
engine calls ``execute(scheduled)``), and :class:`ShardedKVCache` where ``KVCache`` stands
(swap-outs, swap-ins and copy-on-write copies go to every worker, in the order the engine
makes them, each applied everywhere before the engine goes on).

Transport: the step goes to the workers through one ``multiprocessing`` pipe each (pickled
once, sent N times), as vLLM's V1 executor sends its ``SchedulerOutput`` through a message
queue; the tensors the workers exchange mid-forward go through ``torch.distributed``. The
workers start once, from a fresh interpreter (``forkserver``, or ``spawn`` where there is no
fork server), never by forking the driver: safe with CUDA and threads. Like every process that
``multiprocessing`` starts that way, a worker imports the driver's main module first, so a
script must build its ``LLM`` under ``if __name__ == "__main__":`` (as with vLLM when it
spawns its workers, which it does once CUDA is initialized).

What can go wrong, and what then: a worker that dies (its process sentinel fires), raises in a
step, a copy or a swap, or does not answer within ``step_timeout`` seconds (``start_timeout``
while starting) raises :class:`~pagedlearn.errors.WorkerError` naming it; every worker is then
stopped and the engine refuses more work. (A ``collective_rpc`` function that raises only
raises a ``PagedLearnError``; the workers go on.) ``shutdown()``,
garbage collection and interpreter exit stop the workers (``weakref.finalize``); a worker
whose driver dies exits when its pipe closes.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import threading
import time
import weakref
from multiprocessing.connection import wait

import torch

from pagedlearn.attention.kv_cache import KVCacheSpec
from pagedlearn.cli import threads as threads_module
from pagedlearn.errors import PagedLearnError, WorkerError, held_interrupts
from pagedlearn.models.runner import SequenceInput, prepare_inputs
from pagedlearn.parallel.worker import WorkerConfig, worker_main


class TensorParallelExecutor:
    """N worker processes holding 1/N of ``model`` each; :meth:`execute` runs one step on all.

    ``model``: the whole model, on the CPU (each worker gets a copy and keeps its share).
    ``device``: "cpu" (gloo), or "cuda" (NCCL; worker ``r`` on ``cuda:r``)."""

    start_timeout = 300.0  # seconds for a worker to import torch, get the model, shard it
    step_timeout = 300.0  # seconds for a step (or a copy, or an rpc) on every worker

    def __init__(
        self,
        model,
        size: int,
        spec: KVCacheSpec,
        *,
        num_blocks: int,
        block_size: int,
        swap_blocks: int,
        backend: str,
        device: str = "cpu",
    ) -> None:
        from pagedlearn.parallel.sharding import check_tensor_parallel

        check_tensor_parallel(model, size)
        dev = torch.device(device)
        if dev.type not in ("cpu", "cuda") or dev.index is not None:
            raise PagedLearnError(
                f"tensor parallelism runs its workers on device='cpu' (gloo) or device='cuda' "
                f"(NCCL, worker r on cuda:r), got {device!r}"
            )
        if dev.type == "cuda" and torch.cuda.device_count() < size:
            raise PagedLearnError(
                f"tensor_parallel_size={size} on CUDA needs {size} GPUs (one per worker), "
                f"this machine has {torch.cuda.device_count()}; use device='cpu' or fewer workers"
            )
        self.size, self.spec, self.backend = size, spec, backend
        self.num_groups = len(spec.groups)
        self.dead: str | None = None  # why the workers cannot be used any more
        # The last message's: send; per rank received, busy, and all_reduce (the seconds of
        # busy spent in all-reduces: worker.AllReduceClock).
        self.last_timings: dict = {}
        self._outstanding: set[int] = set()  # ranks whose answer a Ctrl-C left unread
        self._pending = ""  # the kind of message those answers belong to
        self._busy = threading.Lock()  # one message at a time: the pipes carry no request ids
        ctx = _context()
        rendezvous = f"tcp://127.0.0.1:{_free_port()}"  # rank 0 hosts the store there
        # The CPU threads pagedlearn chose for this machine when it was imported (cli/threads.py),
        # shared by the workers: N workers together use what one process would.
        threads = threads_module.chosen.count  # (set by `import pagedlearn`, which ran first)
        self.procs, self.conns = [], []
        for rank in range(size):
            cfg = WorkerConfig(
                rank, size, rendezvous, f"cuda:{rank}" if dev.type == "cuda" else "cpu",
                num_blocks, block_size, swap_blocks, backend, self.step_timeout,
                max(1, threads // size),
            )  # fmt: skip
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(cfg, theirs), daemon=True,
                               name=f"pagedlearn-tp-worker-{rank}")  # fmt: skip
            proc.start()
            theirs.close()  # the worker's end lives in the worker: EOF here means it is gone
            self.procs.append(proc)
            self.conns.append(mine)
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.conns)
        try:
            payload = pickle.dumps(model, protocol=pickle.HIGHEST_PROTOCOL)
            self._outstanding, self._pending = set(range(size)), "start"
            for conn in self.conns:
                with contextlib.suppress(OSError):  # died already: _collect says how
                    conn.send_bytes(payload)
            self.workers = self._collect("start", self.start_timeout)  # each one's describe()
        except BaseException:
            self.shutdown()
            raise
        self.pids = [p.pid for p in self.procs]

    # --- what the engine calls ------------------------------------------------------------------
    def execute(self, seqs: list[SequenceInput]) -> torch.Tensor:
        """One forward pass on every worker; returns rank 0's logits ``(S, vocab)``."""
        return torch.from_numpy(self.call("step", prepare_inputs(seqs, self.num_groups))[0])

    def call(self, kind: str, payload=None) -> list:
        """Send one message to every worker (pickled once) and return their answers, by rank.
        Raises :class:`WorkerError` (and stops every worker) if any dies, fails or is late.

        Ctrl-C is held while a message is written and while an answer is read (a half-written
        message would leave the workers out of step); it may land while the driver waits, and
        the answers it left unread are read before the next message goes out."""
        if not self._busy.acquire(blocking=False):
            raise PagedLearnError(
                "two threads used the tensor-parallel workers at once: step the engine and call "
                "collective_rpc from one thread (a server's: srv.call(fn))"
            )
        try:
            if self.dead:
                raise WorkerError(f"the tensor-parallel workers are stopped: {self.dead}")
            if self._outstanding:  # a Ctrl-C interrupted the last wait: its answers come first
                self._collect(self._pending, self.step_timeout)
            t0 = time.monotonic()
            try:
                message = pickle.dumps((kind, payload, t0), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:  # nothing was sent: the workers are as they were
                raise PagedLearnError(
                    f"cannot send {kind!r} to the workers: {e!r} (a function for collective_rpc "
                    "must be importable by name: define it in a module, not in a notebook cell "
                    "or under `if __name__ == '__main__':`)"
                ) from e
            with held_interrupts():  # every worker gets it, or none
                self._outstanding, self._pending = set(range(self.size)), kind
                for conn in self.conns:
                    with contextlib.suppress(OSError):  # a closed pipe: its sentinel says how
                        conn.send_bytes(message)
            t1 = time.monotonic()
            results = self._collect(kind, self.step_timeout)
            self.last_timings["send"] = t1 - t0  # pickling once + writing N pipes
            return results
        finally:
            self._busy.release()

    # --- waiting for answers --------------------------------------------------------------------
    def _collect(self, what: str, timeout: float) -> list:
        results: list = [None] * self.size
        received, busy, reducing, errors = {}, {}, {}, []
        deadline = time.monotonic() + timeout
        while self._outstanding:
            waiting = {self.conns[r]: r for r in self._outstanding}
            sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
            ready = wait([*waiting, *sentinels], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                ranks = sorted(self._outstanding)
                self._fail(f"worker(s) {ranks} did not answer {what!r} within {timeout:.0f} s")
            for obj in ready:
                if obj in waiting:
                    rank = waiting[obj]
                    try:
                        with held_interrupts():  # half-read, the pipe would be out of step
                            answer = pickle.loads(obj.recv_bytes())
                    except (EOFError, OSError):
                        continue  # its sentinel tells how it ended, on this pass or the next
                    self._outstanding.discard(rank)
                    if answer[0] == "error":
                        errors.append((rank, answer[1]))
                        continue
                    results[rank] = answer[1]
                    received[rank] = answer[2].get("received")
                    busy[rank] = answer[2].get("busy")
                    reducing[rank] = answer[2].get("all_reduce")
            if errors and what != "rpc":  # the others may wait for it in a collective: now
                # A peer that died makes the others' collectives fail ("connection reset"): if
                # one did, its death is the cause to report.
                dead = wait([p.sentinel for p in self.procs], timeout=0.5)
                if dead:
                    self._died(sentinels[dead[0]], what)
                rank, text = errors[0]
                self._fail(f"{self._name(rank)} raised while working on {what!r}:\n{text}")
            for obj in ready:
                rank = sentinels.get(obj)
                if rank in self._outstanding:  # exited with its answer still due
                    self._died(rank, what)
        self.last_timings = {"received": received, "busy": busy, "all_reduce": reducing}
        if errors:  # an rpc: the user's function raised; the workers are fine
            rank, text = errors[0]
            raise PagedLearnError(f"collective_rpc failed on {self._name(rank)}:\n{text}")
        return results

    def _died(self, rank: int, what: str):
        self.procs[rank].join(1.0)
        how = _how(self.procs[rank].exitcode, what)
        self._fail(f"{self._name(rank)} died {how} while working on {what!r}")

    def _name(self, rank: int) -> str:
        return f"tensor-parallel worker {rank} (pid {self.procs[rank].pid})"

    def _fail(self, why: str):
        self.dead = why
        self._outstanding = set()
        self.shutdown(grace=0.5)  # they may be stuck in a collective: do not wait long
        raise WorkerError(why + "; every worker is stopped: build a new LLM")

    # --- the end --------------------------------------------------------------------------------
    def shutdown(self, grace: float = 5.0) -> None:
        """Stop every worker (idempotent), giving them ``grace`` seconds to leave the process
        group before they are terminated; afterwards :meth:`call` raises. (The fork server the
        workers were started from stays, to start the next ones fast; it exits with this
        process.)"""
        self.dead = self.dead or "shut down"
        if stop := self._finalizer.detach():  # (self, _stop_workers, args, kwargs) the first time
            _, fn, args, _ = stop
            fn(*args, grace=grace)

    @property
    def alive(self) -> bool:
        return self._finalizer.alive


# What a worker imports before it can do anything: a fork server imports them once, then forks
# every worker from it (a second LLM's workers skip those imports). Llama's: SmolLM2's.
PRELOAD = ["pagedlearn.parallel.worker", "transformers.models.gpt2.modeling_gpt2",
           "transformers.models.opt.modeling_opt",
           "transformers.models.llama.modeling_llama"]  # fmt: skip


# What the workers read from the environment when they start. A fork server keeps the one it
# was started with, so when these change (TRITON_INTERPRET set in a notebook, say), new workers
# are spawned from a fresh interpreter instead.
WORKER_ENV = ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")
_fork_server_env: dict | None = None


def _context():
    """``forkserver`` where the platform has it (Linux, macOS), else ``spawn``. Both start the
    workers from a fresh interpreter, never by forking this process: forking a process that has
    started threads (torch's, a server's) or CUDA can deadlock the child or break its GPU."""
    import multiprocessing

    global _fork_server_env
    env = {k: os.environ.get(k) for k in WORKER_ENV}
    if "forkserver" in multiprocessing.get_all_start_methods():
        if _fork_server_env is None:
            _fork_server_env = env
        if env == _fork_server_env:
            ctx = torch.multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)  # no effect once its server runs; harmless
            return ctx
    return torch.multiprocessing.get_context("spawn")


def _how(exitcode: int | None, what: str) -> str:
    if exitcode is None:
        return "(still running, not answering)"
    if exitcode < 0:
        return f"(killed by {signal.Signals(-exitcode).name})"
    if what != "start":
        return f"(exit code {exitcode})"
    return f"(exit code {exitcode}; if this is a script, build the LLM under " \
           "`if __name__ == '__main__':` -- the workers import the main module)"  # fmt: skip


def _free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the workers' rendezvous; nothing is left on disk)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_workers(procs, conns, grace: float = 5.0) -> None:
    """Ask every worker to stop, wait ``grace`` seconds, then terminate and kill what is left
    (that part even if a Ctrl-C cuts the wait short). Module-level, holding no reference to
    the executor, so that ``weakref.finalize`` can run it at garbage collection and at
    interpreter exit."""
    try:
        message = pickle.dumps(("stop", None, time.monotonic()))
        with held_interrupts():
            for conn in conns:
                with contextlib.suppress(OSError):  # a worker already gone
                    conn.send_bytes(message)
        deadline = time.monotonic() + grace
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        with held_interrupts():
            for p in procs:
                if p.is_alive():
                    p.terminate()
                    p.join(1.0)
                if p.is_alive():
                    p.kill()
                    p.join(1.0)
            for conn in conns:
                conn.close()
