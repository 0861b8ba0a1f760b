"""The load test's verdicts: one :class:`Check` per line of ``[OK]`` / ``[FAIL]`` / ``[--]``.

:func:`verdicts` reads a finished run -- the driver's records (loadtest/driver.py), the report's
numbers (loadtest/report.py), the pool at the end -- and says what held. A check is of one of
two kinds:

- **correctness** (``[OK]`` / ``[FAIL]``): what must hold whatever the options. Nothing lost
  (every request finished, was cancelled, or was refused on purpose; none failed or stuck),
  every block back, the invariants after every step, no cross-tenant hit (the trace audit,
  loadtest_checks.TenantAudit), and nothing served from the cache after a reset or a new model
  version -- the cold and the version pass send each (system prompt, tenant) once, so they
  have nothing of their own to hit: exactly 0 prompt tokens at admission.
- **coverage** (``[OK]`` / ``[--] not exercised``, with a hint): what the run must have shown for
  the correctness checks to mean much -- both preemption modes, a warm pass that hit, hits
  within a tenant (the isolation check judged real hits), every kind of the mix observed in
  the outputs. A pool of 1,000 blocks never preempts: that is the options, not the engine, so a
  miss says what would exercise it and does not fail the run.

``report.ok``: every correctness check passed (the command's exit code); ``report.complete``:
every check did.

>>> Check("every block came back", True, "GPU used 0").line()
'  [OK] every block came back: GPU used 0'
>>> Check("the warm pass hit the cache", False, "0 tokens", COVERAGE, "caching is off").line()
'  [--] not exercised: the warm pass hit the cache: 0 tokens (caching is off)'
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedlearn.loadtest.mix import default_pool

MAX_LISTED = 10  # request ids named in a detail; the rest are counted


def percent(x: float | None) -> str:
    """``0.25`` -> ``"25.0%"``; None or NaN (nothing to divide) -> ``"n/a"``."""
    return "n/a" if x is None or math.isnan(x) else f"{100 * x:.1f}%"


CORRECTNESS, COVERAGE = "correctness", "coverage"


@dataclass(frozen=True)
class Check:
    """One verdict: ``name`` says what must hold, ``detail`` the numbers behind it; ``kind``
    :data:`CORRECTNESS` (a failure is the engine's) or :data:`COVERAGE` (a miss is the run's:
    ``hint`` says why and what would exercise it)."""

    name: str
    ok: bool
    detail: str
    kind: str = CORRECTNESS
    hint: str = ""

    def line(self) -> str:
        if self.ok or self.kind == CORRECTNESS:
            return f"  [{'OK' if self.ok else 'FAIL'}] {self.name}: {self.detail}"
        hint = f" ({self.hint})" if self.hint else ""
        return f"  [--] not exercised: {self.name}: {self.detail}{hint}"

    def as_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "ok": self.ok, "detail": self.detail,
                "hint": self.hint}  # fmt: skip


def verdicts(driver, report, end, kv) -> list[Check]:
    """The checks of a finished run, correctness first, from what the driver kept
    (loadtest_driver.Driver), the report's numbers and records (loadtest/report.py), the
    engine's stats at the end (``end``) and its manager (``kv``)."""
    cnt, pool, pc = report.counts, report.pool, report.prefix_cache
    expected = {rid for rid, s in driver.specs.items() if s.expect_reject}
    held = kv.sequences() + kv.swapped_sequences()
    by_outcome: dict[str, list[str]] = {}
    cached = {"cold": 0, "warm": 0, "version": 0}  # prompt tokens hit at first admission
    for r in report.requests:
        by_outcome.setdefault(r["outcome"], []).append(r["id"])
        if r["phase"] in cached:
            cached[r["phase"]] += r["num_cached_tokens"]
    named = [f"{k}: {_ids(by_outcome[k])}" for k in ("stuck", "lost", "failed") if k in by_outcome]
    if set(by_outcome.get("rejected", [])) != expected:
        named.append(f"rejected {_ids(by_outcome.get('rejected', []))}, meant {_ids(expected)}")
    rates = pc["phase_hit_rate"]
    first_violation = f"; first: {pc['violations'][0]}" if pc["violations"] else ""
    correctness = [
        Check(
            "every request finished or was cancelled",
            not named,
            f"{cnt['sent']} sent: {cnt['finished']} finished ({cnt['stopped_early']} stopped "
            f"early, {cnt['to_max_tokens']} ran to max_tokens), {cnt['cancelled']} cancelled, "
            f"{cnt['rejected']} rejected ({len(expected)} on purpose), {cnt['failed']} failed, "
            f"{cnt['lost']} lost, {cnt['stuck']} stuck" + "".join(f"; {x}" for x in named),
        ),
        Check(
            "every block came back",
            end.used_blocks == 0
            and end.cpu_used_blocks == 0
            and not held
            and end.free_blocks == end.num_blocks,
            f"GPU used {end.used_blocks}, free {end.free_blocks} of {end.num_blocks} (cached "
            f"{end.cached_blocks}); swap pool used {end.cpu_used_blocks}; sequences left "
            f"{len(held)}",
        ),
        Check(
            "the invariants held after every step",
            not driver.invariant_errors and driver.invariant_checks >= pool["steps"] > 0,
            f"checked {driver.invariant_checks} times (every step and cancel), "
            f"{len(driver.invariant_errors)} broken"
            + (f"; first: {driver.invariant_errors[0]}" if driver.invariant_errors else ""),
        ),
        Check(
            "no request hit another tenant's cache entry",
            pc["cross_tenant_hit_blocks"] == 0,
            f"{pc['cross_tenant_hit_blocks']} blocks shared across tenants (trace audit)"
            + first_violation,
        ),
        Check(
            "nothing was hit after a reset or a new model version",
            cached["cold"] == 0 and cached["version"] == 0,
            f"prompt tokens served from the cache at admission: cold pass {cached['cold']}, "
            f"new model version {cached['version']} (hit rates, re-admissions included: "
            f"{percent(rates['cold'])}, {percent(rates['version'])})",
        ),
    ]
    return correctness + _coverage(driver, report, cached["warm"])


def _coverage(driver, report, warm_hits: int) -> list[Check]:
    cnt, pool, pc, c = report.counts, report.pool, report.prefix_cache, report.config
    swaps, recomputes = pool["preemptions_swap"], pool["preemptions_recompute"]
    kinds = cnt["kinds"]
    missing = [k for k, n in kinds.items() if not n]
    missing += [k for k in ("stopped_early", "to_max_tokens", "cancelled") if not cnt[k]]
    missing += ["several tenants"] * (cnt["tenants"] < 2)
    missing += ["two model versions"] * (cnt["model_versions"] < 2)
    caching_off = "" if c["enable_prefix_caching"] else "prefix caching is off: nothing is cached"
    warm = [s for s in driver.specs.values() if s.phase == "warm"]
    return [
        Check(
            "preemptions by swap and by recompute",
            swaps > 0 and recomputes > 0,
            f"swap {swaps}, recompute {recomputes}",
            COVERAGE,
            _preemption_hint(c, swaps, recomputes),
        ),
        Check(
            "the warm pass hit the cache",
            warm_hits > 0,
            f"{warm_hits} prompt tokens served from the cache at admission (hit rate "
            f"{percent(pc['phase_hit_rate'].get('warm'))})",
            COVERAGE,
            caching_off or _warm_hint(c, warm),
        ),
        Check(
            "cache hits within a tenant",
            pc["same_tenant_hit_blocks"] > 0 and cnt["shared_across_tenants"] > 0,
            f"{pc['same_tenant_hit_blocks']} blocks hit within a tenant (trace audit), on "
            f"{cnt['shared_across_tenants']} prompts sent by several tenants",
            COVERAGE,
            caching_off
            or "the shared prompts were evicted before their tenant sent them "
            "again: try a larger --num-blocks",
        ),
        Check(
            "the whole mix happened",
            not missing,
            ("missing: " + ", ".join(missing) + "; " if missing else "")
            + "sent: "
            + ", ".join(f"{k} {n}" for k, n in kinds.items() if k != "parallel")
            + f"; observed: parallel {kinds['parallel']} (outputs of n > 1 samples), stopped "
            f"early {cnt['stopped_early']}, ran to max_tokens {cnt['to_max_tokens']}, "
            f"cancelled {cnt['cancelled']}; served: tenants {cnt['tenants']}, model versions "
            f"{cnt['model_versions']}",
            COVERAGE,
            "try a larger --num-requests",
        ),
    ]


def _preemption_hint(c: dict, swaps: int, recomputes: int) -> str:
    """Why a mode of preemption did not happen, and the option that would make it happen (the
    squeeze is sized to the swap pool: loadtest_mix._Maker.squeeze)."""
    pool, swap = c["num_blocks"], c["swap_blocks"]
    default, quarter = default_pool(c["max_model_len"], c["block_size"])[0], max(1, pool // 4)
    if not swaps and c["preemption_mode"] != "swap":
        return f"the engine preempts by {c['preemption_mode']} only (preemption_mode)"
    if not swaps and not swap:
        return "the engine has no swap pool: give it --swap-blocks"
    if not swaps and not recomputes:
        if pool > default:
            return f"a pool of {pool} blocks never ran short: try --num-blocks {default}"
        if swap != quarter:
            return f"the squeeze never filled the pool of {pool}: try --swap-blocks {quarter}"
        return f"the squeeze never filled the pool of {pool}: try --num-blocks {pool // 2}"
    if not recomputes:
        smaller = quarter if swap > quarter else max(1, swap // 2)
        return f"the swap pool of {swap} blocks never filled: try --swap-blocks {smaller}"
    return f"no preempted request fit in the swap pool of {swap}: try --swap-blocks {2 * swap}"


def _warm_hint(c: dict, warm: list) -> str:
    bs = c["block_size"]
    need = sum(-(-(len(s.prompt_token_ids) + s.params.max_tokens) // bs) for s in warm)
    if c["num_blocks"] < need:
        return (
            f"a pool of {c['num_blocks']} blocks cannot keep the pass's {len(warm)} prompts "
            f"({need} blocks) cached from one pass to the next: try --num-blocks {need}"
        )
    return "their blocks were evicted between the passes"


def _ids(ids) -> str:
    ids = sorted(ids)
    more = f" and {len(ids) - MAX_LISTED} more" if len(ids) > MAX_LISTED else ""
    return ", ".join(ids[:MAX_LISTED]) + more
