"""Every lab blanks what ``LLM`` runs: the code a student writes is the code the engine executes.

A lab names the functions and methods a student writes (``LAB.exercises[...].targets``, read
from the labs themselves, so a new lab is covered without touching this file). For each target
we put a counting spy where the engine looks it up, run ``LLM.generate`` on tiny-gpt2 with the
settings that reach it (prefix caching, parallel sampling, a pool small enough to preempt and
evict, the ``"reference"`` and ``"triton"`` attention backends), and assert that the engine called
it -- on an object of exactly the lab's class, not on a subclass or a twin with the same rules.

A target the engine does not run must say so in :data:`NOT_RUN_BY_THE_ENGINE`, with the reason;
an entry there that the engine does run fails too, so the list cannot go stale.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
from collections import Counter
from dataclasses import dataclass

import pytest

from pagedlearn import LLM, KVCacheManager, SamplingParams
from pagedlearn.core.block_allocator import BlockAllocator
from pagedlearn.core.block_table import BlockTable
from pagedlearn.core.prefix_cache import PrefixCache
from pagedlearn.engine.scheduler import Scheduler
from pagedlearn.labs import all_labs

# Lab targets that no LLM runs, and why. Each is a finding: the student writes something that the
# engine does not execute (the lab still grades it against the package's own tests).
NOT_RUN_BY_THE_ENGINE = {
    "attention:paged_attention_ref": "the reference backend decodes with paged_attention_batched "
    "(all sequences in one masked gather), which is checked against paged_attention_ref",
    "attention:paged_attention_online_softmax_ref": "the kernel's loop written in PyTorch, to "
    "read before kernels/decode_attention.py; the engine runs the kernel itself",
}

# The engine's reference backend builds its ops once (functools.cache) from what
# pagedlearn.attention exports: a spy must be in place before they are built.
_OPS_CACHES = ("pagedlearn.models.paged_attention._ops",)


@dataclass(frozen=True)
class Target:
    lab: str
    qualname: str  # "func" or "Class.method", as the lab names it
    module: str  # where it is defined

    @property
    def key(self) -> str:
        return f"{self.lab}:{self.qualname}"

    @property
    def owner(self):
        """The class of a method target, else None."""
        top, _, method = self.qualname.partition(".")
        return getattr(importlib.import_module(self.module), top) if method else None


def _module_of(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def lab_targets() -> list[Target]:
    out = []
    for lab in all_labs():
        for ex in lab.exercises:
            for qualname in ex.targets:
                top = qualname.split(".")[0]
                homes = [
                    m for m in map(_module_of, lab.files) if top in vars(importlib.import_module(m))
                ]
                assert homes, f"lab {lab.id}: {top} is defined in none of {lab.files}"
                out.append(Target(lab.id, qualname, homes[0]))
    return out


TARGETS = lab_targets()


def _clear_ops_caches() -> None:
    for dotted in _OPS_CACHES:
        mod, _, name = dotted.rpartition(".")
        getattr(importlib.import_module(mod), name).cache_clear()


@pytest.fixture
def spies(monkeypatch):
    """Put a counting spy on every lab target; yields ``calls``: target key -> Counter of the
    classes of ``self`` (methods) or ``{None: n}`` (functions)."""
    calls: dict[str, Counter] = {t.key: Counter() for t in TARGETS}
    for t in TARGETS:
        owner = t.owner
        if owner is not None:
            name = t.qualname.split(".", 1)[1]
            orig = inspect.getattr_static(owner, name)
            assert inspect.isfunction(orig), f"{t.key} is not a plain method"

            def spy(self, *a, _orig=orig, _seen=calls[t.key], **kw):
                _seen[type(self)] += 1
                return _orig(self, *a, **kw)

            monkeypatch.setattr(owner, name, functools.wraps(orig)(spy))
            continue
        orig = getattr(importlib.import_module(t.module), t.qualname)

        def spy(*a, _orig=orig, _seen=calls[t.key], **kw):
            _seen[None] += 1
            return _orig(*a, **kw)

        # Wherever the package holds the function (``from x import f`` binds it in the caller's
        # module too), and with it the kernel's scope, which looks its helpers up by name.
        for mod in list(sys.modules.values()):
            name = getattr(mod, "__name__", "") or ""
            if not name.startswith(("pagedlearn", "kernels")):
                continue
            for attr, value in list(vars(mod).items()):
                if value is orig:
                    monkeypatch.setattr(mod, attr, spy)
    _clear_ops_caches()
    yield calls
    _clear_ops_caches()


SYSTEM = list(b"You are a helpful assistant. ")  # 29 tokens: 7 full blocks of 4, shared


def _drive(llm: LLM) -> None:
    """A batch that reaches every part: shared prefixes (hits), n=2 (fork, copy-on-write), a pool
    too small for all of it (preemption by recompute), and later prompts that evict cached
    blocks."""
    params = SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=0, ignore_eos=True)
    prompts = [SYSTEM + list(s) for s in (b"Hi", b"Name a colour.", b"Count to three")]
    llm.generate(prompts, params, use_tqdm=False)
    llm.generate([list(b"Something else entirely, to evict.")], params, use_tqdm=False)


def _tiny(**kw) -> LLM:
    return LLM("tiny-gpt2", block_size=4, enable_prefix_caching=True, verbose=False, **kw)


def test_every_lab_names_targets_this_test_reaches():
    """The labs' metadata is what the other tests read: every lab has targets, each found."""
    assert {t.lab for t in TARGETS} == {lab.id for lab in all_labs()}
    unknown = set(NOT_RUN_BY_THE_ENGINE) - {t.key for t in TARGETS}
    assert not unknown, f"NOT_RUN_BY_THE_ENGINE names targets no lab has: {sorted(unknown)}"


def test_the_engine_is_built_of_the_labs_classes():
    """The manager, its allocator and prefix cache, and the scheduler: the labs' classes."""
    llm = _tiny(num_blocks=32)
    llm.generate([[*SYSTEM, 1, 2]], SamplingParams(max_tokens=2), use_tqdm=False)
    kv = llm.engine.kv
    assert type(kv) is KVCacheManager
    assert type(kv.allocator) is BlockAllocator, f"the manager runs {type(kv.allocator)}"
    assert type(kv.prefix_cache) is PrefixCache, f"the manager runs {type(kv.prefix_cache)}"
    assert type(llm.engine.scheduler) is Scheduler
    # Every class a lab blanks is one of these, or the block table (checked by its spies below:
    # each of its methods must run on a BlockTable exactly).
    classes = {t.owner for t in TARGETS if t.owner is not None}
    checked = {KVCacheManager, BlockAllocator, PrefixCache, Scheduler, BlockTable}
    assert classes <= checked, f"a lab blanks {classes - checked}: say where the engine holds it"


def _assert_ran(calls: dict[str, Counter], targets: list[Target]) -> None:
    """Each target ran, and only ever on the lab's own class; one message lists every miss."""
    problems = []
    for t in targets:
        seen = calls[t.key]
        if t.key in NOT_RUN_BY_THE_ENGINE:
            if seen:
                problems.append(
                    f"{t.key}: the engine runs it now, unlist it in NOT_RUN_BY_THE_ENGINE"
                )
        elif not seen:
            problems.append(f"{t.key}: never called")
        elif t.owner is not None and set(seen) != {t.owner}:
            others = ", ".join(sorted(c.__qualname__ for c in set(seen) - {t.owner}))
            problems.append(f"{t.key}: also called on {others}, not only on the lab's class")
    assert not problems, "what the labs blank is not what LLM ran:\n" + "\n".join(problems)


def test_the_memory_and_scheduler_labs_run_in_the_engine(spies):
    """Labs allocator, cow, prefix, scheduler and attention, on the reference backend."""
    llm = _tiny(num_blocks=12, attention_backend="reference", preemption_mode="recompute")
    _drive(llm)
    stats = llm.engine.stats()  # the batch must reach what it is for, or a miss below misleads
    assert stats.preemptions_recompute > 0, "the batch no longer preempts: shrink the pool"
    assert stats.evictions > 0, "the batch no longer evicts a cached block: shrink the pool"
    _assert_ran(spies, [t for t in TARGETS if t.lab != "kernel"])


def test_the_kernel_lab_runs_in_the_engine(spies):
    """Lab kernel: the Triton decode kernel's helpers, in the interpreter on a CPU."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("a Python spy cannot be compiled for a GPU: this runs in the interpreter")
    llm = _tiny(num_blocks=16, attention_backend="triton", device="cpu")
    llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    _assert_ran(spies, [t for t in TARGETS if t.lab == "kernel"])
