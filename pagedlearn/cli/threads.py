"""How many threads torch's CPU operations use: what this process may really use, not a thread
per core of the machine.

Why it matters. torch runs each CPU operation on a pool of OpenMP threads, by default one per
core it finds (it does not look at the cgroup's CPU quota, nor at what other processes run).
The threads meet at the end of every operation; when another process holds one of the cores,
the whole operation waits for the thread that is not running. An engine step is hundreds of
small operations, so on a busy machine it pays that wait hundreds of times: on two cores at
load average 3.2 (issue 33), the demo's requests took 1.4-3.7 s end to end with torch's default
(two threads) and 44-47 ms with one thread.

The rule (:func:`choose`; the first that applies decides):

1. ``PAGEDLEARN_NUM_THREADS=N``: N threads. The one override, for every process pagedlearn
   starts too.
2. ``OMP_NUM_THREADS=N`` set (a valid count): kept. torch reads it itself; it is the standard
   variable a cluster or a course image sets.
3. torch imported before pagedlearn with no more threads than rule 4 allows (a
   ``torch.set_num_threads(k)`` of yours): kept. pagedlearn cannot tell your count from torch's
   default, so it only ever lowers what it finds; to raise it, use rule 1, or call
   ``torch.set_num_threads`` after ``import pagedlearn`` (pagedlearn sets the count once).
4. Otherwise: the CPUs this process may use (:func:`usable_cpus`: its CPU affinity and its
   cgroup's CPU quota, as a container or a Slurm job limits them), less the share of the
   machine's 1-minute load average that falls on them (:func:`rule`), at most :data:`CAP`, at
   least 1. So 1 thread on a two-core machine that others keep busy, 2 on the same machine
   idle, 4 on an idle 16-core GPU box.

Why a cap. The count is chosen once, when the process starts, but the load on a shared machine
changes after that: on a JupyterHub node, ten kernels started while the node was quiet would
each keep 16 threads once they all run. Four threads each bounds that, and should cost little:
the course's models (hidden size 64-768, a few to a few hundred tokens a step) run small
operations, which gain little from more threads (the load test and the paper's latency
simulation run one thread for that reason), and on a GPU box the model runs on the GPU. Four is
a judgement, not a measurement (only two-core machines measured this rule); raise it with
``PAGEDLEARN_NUM_THREADS``.

Where it applies. ``import pagedlearn`` calls :func:`apply` once: with torch not yet imported
it sets ``OMP_NUM_THREADS`` (torch reads it when it is imported); with torch imported it calls
``torch.set_num_threads``. Either way ``OMP_NUM_THREADS`` then holds the count, so every process
started from this one follows it: a server's engine thread (threads share the count), the
tensor-parallel workers (the executor splits it between them), the chapters' kernels (their
``setup()`` imports pagedlearn first). The lab grader's sandbox builds its worker's environment
from nothing (one thread: the checks run tiny shapes) and passes ``PAGEDLEARN_NUM_THREADS``
through. vLLM does the same for its workers (``set_multiprocessing_worker_envs`` in
``vllm/v1/executor/multiproc_executor.py``: a user's ``OMP_NUM_THREADS`` is kept; else it sets
one before the workers start). ``OMP_NUM_THREADS`` also limits other OpenMP libraries the
process loads later (NumPy's BLAS), which on a shared machine is wanted too.

This module imports only the standard library: ``import pagedlearn`` stays instant, with or
without torch. It lives in ``cli/`` with the other set-up of a process (``notebook.py``), which a
first reading skips; ``engine/`` would import torch with it.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from pagedlearn.errors import PagedLearnError

ENV = "PAGEDLEARN_NUM_THREADS"
CAP = 4  # see "Why a cap" above
MAX_THREADS = 1024  # a bigger PAGEDLEARN_NUM_THREADS is a typo


@dataclass(frozen=True)
class ThreadChoice:
    """What :func:`choose` decided, and why (:func:`describe` says it in one line)."""

    count: int  # torch's intra-op threads
    source: str  # "PAGEDLEARN_NUM_THREADS", "OMP_NUM_THREADS", "torch.set_num_threads", "rule"
    usable: int  # CPUs this process may use (affinity, cgroup quota)
    load: float | None  # the 1-minute load average when chosen (None: the platform has none)


chosen: ThreadChoice | None = None  # what apply() decided in this process


def usable_cpus(affinity: int | None = None, quota: float | None = None) -> int:
    """The CPUs this process may use: those its affinity allows (``taskset``, a Slurm job,
    ``docker --cpuset-cpus``), no more than its cgroup's quota lets it keep busy (``docker
    --cpus=1.5`` allows 1.5: rounded up, 2), and at least 1. ``os.cpu_count()`` counts the
    machine's CPUs, whoever may use them.

    >>> usable_cpus(affinity=16, quota=1.5)
    2
    """
    if affinity is None:
        affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        affinity = affinity or os.cpu_count() or 1
    if quota is None:
        quota = cgroup_cpu_quota()
    return max(1, min(affinity, math.ceil(quota) if quota else affinity))


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup", own: str = "/proc/self/cgroup") -> float | None:
    """The CPUs this process's cgroup may keep busy (quota / period; ``None``: no quota), the
    smallest along its cgroup's path: cgroup v2's ``cpu.max`` (``"150000 100000"``, or ``"max
    100000"``), v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1: none)."""
    found = []
    for folder in _cgroup_folders(Path(root), Path(own)):
        try:
            if (folder / "cpu.max").is_file():
                quota, period = (folder / "cpu.max").read_text().split()[:2]
            else:
                quota = (folder / "cpu.cfs_quota_us").read_text().strip()
                period = (folder / "cpu.cfs_period_us").read_text().strip()
            if quota not in ("max", "-1") and int(period) > 0:
                found.append(int(quota) / int(period))
        except (OSError, ValueError):  # not there, or not a number: no quota found here
            continue
    return min(found, default=None)


def _cgroup_folders(root: Path, own: Path) -> list[Path]:
    """The folders that may hold this process's CPU quota: its cgroup's and each parent's (a
    parent's quota limits it too), under the v2 hierarchy and v1's ``cpu`` controller."""
    paths = ["/"]
    try:  # lines "id:controllers:path"; v2's is "0::path", v1's cpu one names "cpu"
        for line in own.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "" or "cpu" in controllers.split(","):
                paths.append(path)
    except (OSError, ValueError):
        pass
    mounts = [root, root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu"]
    folders = []
    for path in paths:
        parts = Path(path).parts[1:]
        for mount in mounts:
            folders += [mount.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
    return list(dict.fromkeys(folders))  # each once, the deepest first


def load_per_cpu(load: float | None, machine_cpus: int, usable: int) -> float:
    """The 1-minute load average ``load`` spread evenly over the machine's CPUs: the busy part of
    each CPU, ours included. In a container the load average is the *host's* (Linux does not
    scope it), so it is divided by the host's ``machine_cpus``, never by the ``usable`` CPUs
    alone: a 2-CPU container on a 64-CPU host at load 40 is not 20 times overloaded. Both the
    thread rule and the labs' time limits (labs/runner.py) read the load through this.

    >>> load_per_cpu(3.0, 2, 2), load_per_cpu(40.0, 64, 2), load_per_cpu(None, 2, 2)
    (1.5, 0.625, 0.0)
    """
    return (load or 0.0) / max(machine_cpus, usable)


def rule(usable: int, load: float | None, machine_cpus: int) -> int:
    """Rule 4: the threads for ``usable`` CPUs when the machine's 1-minute load average is
    ``load`` over its ``machine_cpus`` CPUs. The load is spread evenly: the part of it on our
    CPUs is ``load * usable / machine_cpus``; a CPU counts as free when at least half of it is
    idle; then at most :data:`CAP`, at least 1.

    >>> rule(2, 3.4, 2)  # two cores, others' jobs: one thread
    1
    >>> rule(2, 0.2, 2)  # the same machine idle
    2
    >>> rule(16, 0.3, 16), rule(16, 13.0, 16)  # a GPU box idle, then busy
    (4, 3)
    >>> rule(2, 40.0, 64)  # a 2-CPU container on a 64-CPU host at load 40
    1
    """
    busy = load_per_cpu(load, machine_cpus, usable) * usable
    free = math.floor(usable - busy + 0.5)
    return max(1, min(free, CAP))


ASK = -1  # choose()'s default for load and torch_threads: read them (None is a value there)


def choose(
    environ=None,
    usable: int | None = None,
    load: float | None = ASK,
    machine_cpus: int | None = None,
    torch_threads: int | None = ASK,
) -> ThreadChoice:
    """Decide the count (rules 1-4 of the module docstring). Each argument left out is read
    from this process and machine: ``environ`` (``os.environ``), ``usable``
    (:func:`usable_cpus`), ``load`` (``os.getloadavg()[0]``; ``None``: unknown), ``machine_cpus``
    (``os.cpu_count()``), ``torch_threads`` (``torch.get_num_threads()`` if torch is imported,
    else ``None``). A bad ``PAGEDLEARN_NUM_THREADS`` raises :class:`PagedLearnError`."""
    environ = os.environ if environ is None else environ
    usable = usable_cpus() if usable is None else usable
    if load == ASK:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    machine_cpus = machine_cpus or os.cpu_count() or usable
    if torch_threads == ASK:
        torch = sys.modules.get("torch")
        torch_threads = torch.get_num_threads() if hasattr(torch, "get_num_threads") else None

    if ENV in environ:
        n = _count(environ[ENV])
        if n is None or n > MAX_THREADS:
            ours = rule(usable, load, machine_cpus)
            raise PagedLearnError(
                f"{ENV} must be a whole number of threads from 1 to {MAX_THREADS}, got "
                f"{environ[ENV]!r} (unset it and pagedlearn chooses: {ours} here)"
            )
        return ThreadChoice(n, ENV, usable, load)
    n = _count(environ.get("OMP_NUM_THREADS", ""))
    if n is not None:
        return ThreadChoice(n, "OMP_NUM_THREADS", usable, load)
    ours = rule(usable, load, machine_cpus)
    if torch_threads is not None and torch_threads <= ours:
        return ThreadChoice(torch_threads, "torch.set_num_threads", usable, load)
    return ThreadChoice(ours, "rule", usable, load)


def _count(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.isdigit() and int(text) >= 1 else None


def apply(environ=None) -> ThreadChoice:
    """Choose the count and make it torch's, in this process and the ones it starts (see the
    module docstring: ``OMP_NUM_THREADS``, and ``torch.set_num_threads`` if torch is imported).
    ``import pagedlearn`` calls it once; the decision is kept in :data:`chosen`."""
    global chosen
    environ = os.environ if environ is None else environ
    choice = choose(environ)
    environ["OMP_NUM_THREADS"] = str(choice.count)
    if ENV in environ and "MKL_NUM_THREADS" in environ:  # torch reads MKL's after OMP's
        environ["MKL_NUM_THREADS"] = str(choice.count)
    torch = sys.modules.get("torch")
    if hasattr(torch, "set_num_threads") and torch.get_num_threads() != choice.count:
        torch.set_num_threads(choice.count)
    chosen = choice
    return choice


def describe(choice: ThreadChoice | None = None) -> str:
    """One line for a program's setup lines: the count torch runs and where it came from, e.g.
    ``torch threads: 1 (2 CPUs usable, load 3.40: pagedlearn's rule, at most 4;
    PAGEDLEARN_NUM_THREADS to change)``."""
    choice = choice or chosen or choose()
    torch = sys.modules.get("torch")
    count = torch.get_num_threads() if hasattr(torch, "get_num_threads") else choice.count
    load = "load unknown" if choice.load is None else f"load {choice.load:.2f}"
    why = {
        ENV: f"{ENV}={choice.count}",
        "OMP_NUM_THREADS": f"OMP_NUM_THREADS={choice.count}; {ENV} to change",
        "torch.set_num_threads": f"torch's count before pagedlearn was imported; {ENV} to change",
        "rule": f"pagedlearn's rule, at most {CAP}; {ENV} to change",
    }[choice.source]
    if count != choice.count:  # set since; MKL_NUM_THREADS; torch caps OMP_NUM_THREADS at cores
        why = f"pagedlearn chose {choice.count}, {why}, and torch runs {count}"
    return f"torch threads: {count} ({choice.usable} CPUs usable, {load}: {why})"
