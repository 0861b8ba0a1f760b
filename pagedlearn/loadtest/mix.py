"""The load test's requests: a seeded mix that exposes what paging does, in five phases.

``python -m pagedlearn loadtest`` (loadtest/in_process.py drives it) sends every request built
here. Each one is a :class:`RequestSpec`: token ids (the offline models' byte tokenizer takes any
id below 256), sampling parameters, a *tenant* (cache salt, adapter), the phase it belongs to, its
arrival time within the phase, and what it is meant to exercise (``kinds``). Everything comes
from one ``random.Random(seed)``: the same seed gives the same requests.

The phases, in order (the engine runs each until it is idle before the next starts):

======== ==============================================================================
mix      the Poisson stream (``rate`` requests/s; ``inf``: all at once). Cycles through
         :data:`TEMPLATES`: short prompts and prompts near the context limit, prompts that
         share a "system prompt" with others (several tenants send the same ones) or share
         nothing, ``n > 1`` samples of one prompt, requests that stop early (stop tokens,
         stop strings, EOS), run to ``max_tokens``, or are cancelled after a few tokens; one
         prompt longer than the context, rejected at the door on purpose.
squeeze  a burst (all at once, whatever the rate) of growing requests that want about twice
         the pool: preemptions happen, by swap while the swap pool has room, by recompute
         when it is full (:meth:`_Maker.squeeze` sizes them to both pools).
cold     after ``reset_prefix_cache()``: one request per (system prompt, tenant) pair.
         No two of them may share a block, so the pass hits nothing.
warm     the same prompts again: their full blocks are all in the cache now.
version  the same prompts after the engine's ``model_version`` changed: a new model's KV
         must not be served from the old one's blocks, so the pass hits nothing again.
======== ==============================================================================

>>> mix = build_mix(40, seed=0, rate=10.0, max_model_len=512, block_size=16, num_blocks=64,
...                 swap_blocks=16)
>>> len(mix), sorted({s.phase for s in mix}) == sorted(PHASES)
(40, True)
>>> [s.request_id for s in mix if s.expect_reject]
['mix-0']
>>> build_mix(40, 0, 10.0, 512, 16, 64, 16) == mix  # seeded: the same requests every time
True
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass, field, replace

from pagedlearn.errors import PagedLearnError

PHASES = ("mix", "squeeze", "cold", "warm", "version")
DEFAULT_NUM_REQUESTS = 200
DEFAULT_RATE = 40.0  # requests per second (the mix and the passes; the squeeze is a burst)

# The mix phase cycles through these (prompt, ending, samples); each kind appears in a cycle.
#   prompt: "short" (under two blocks), "near-limit" (max_model_len - max_tokens - < 1 block),
#           "shared-prefix" (a system prompt of SYSTEM_BLOCKS full blocks, then its own tokens)
#   ending: "stop" (stop tokens / strings / EOS end it early), "length" (ignore_eos: it runs
#           to max_tokens), "cancel" (aborted after a few tokens)
TEMPLATES = (
    ("short", "length", 1),
    ("shared-prefix", "stop", 1),
    ("near-limit", "length", 1),
    ("shared-prefix", "length", 3),  # parallel sampling from a common prefix
    ("short", "stop", 1),
    ("shared-prefix", "cancel", 1),
    ("short", "cancel", 1),
    ("shared-prefix", "length", 1),
    ("near-limit", "stop", 1),
    ("short", "length", 2),
    ("shared-prefix", "stop", 2),
    ("shared-prefix", "length", 1),
)
NUM_SYSTEM_PROMPTS = 2
SYSTEM_BLOCKS = 4  # a system prompt fills this many blocks
# Tenants: (cache salt, adapter). Several of them send the same system prompts, so a cache
# that leaked across tenants would show up as a hit (loadtest_checks.TenantAudit).
TENANTS = ((None, None), ("tenant-a", None), ("tenant-b", None), (None, "adapter-x"))
# Stop tokens: a quarter of the bytes, so that a sampled request stops within a few tokens.
STOP_TOKEN_IDS = tuple(range(64, 128))
STOP_STRINGS = tuple(string.ascii_letters + string.digits)  # the same, as stop strings
MIN_SQUEEZE, MIN_PASS = 8, 2  # 8: more than the default pool runs at once
MIN_REQUESTS = len(TEMPLATES) + 1 + MIN_SQUEEZE + 3 * MIN_PASS  # +1: the rejected one


@dataclass(frozen=True)
class RequestSpec:
    """One request of the load test, before it is sent."""

    request_id: str
    phase: str
    prompt_token_ids: tuple[int, ...]
    params: object  # SamplingParams
    salt: str | None = None
    adapter: str | None = None
    arrival: float = 0.0  # seconds after its phase starts
    kinds: frozenset[str] = field(default_factory=frozenset)
    cancel_after: int | None = None  # abort once it has this many output tokens
    expect_reject: bool = False  # too long for the model: add_request must refuse it
    system_prompt: int | None = None  # which shared system prompt it starts with


def split_counts(num_requests: int) -> dict[str, int]:
    """How many requests each phase gets (the cold, warm and version passes: the same number).

    >>> split_counts(200)  # the default
    {'mix': 156, 'squeeze': 20, 'cold': 8, 'warm': 8, 'version': 8}
    """
    if not isinstance(num_requests, int) or num_requests < MIN_REQUESTS:
        raise PagedLearnError(
            f"num_requests must be an int >= {MIN_REQUESTS} (one of each kind of the mix, a "
            f"squeeze of {MIN_SQUEEZE} and three passes of {MIN_PASS}), got {num_requests!r}"
        )
    combos = NUM_SYSTEM_PROMPTS * len(TENANTS)
    squeeze = max(MIN_SQUEEZE, num_requests // 10)
    passes = min(combos, max(MIN_PASS, num_requests // 16))
    mix = num_requests - squeeze - 3 * passes
    return {"mix": mix, "squeeze": squeeze, "cold": passes, "warm": passes, "version": passes}


def default_pool(max_model_len: int, block_size: int, num_blocks: int | None = None):
    """``(num_blocks, swap_blocks)``: unless given, two full-context sequences; and a quarter
    of that in the swap pool.

    >>> default_pool(512, 16), default_pool(512, 16, num_blocks=100)
    ((64, 16), (100, 25))
    """
    if num_blocks is None:
        num_blocks = 2 * -(-max_model_len // block_size)
    return num_blocks, max(1, num_blocks // 4)


def min_context(block_size: int) -> int:
    """The shortest context (tokens) the mix runs in with blocks of ``block_size`` tokens: a
    shared system prompt of :data:`SYSTEM_BLOCKS` blocks, a suffix of up to a block, a block's
    slack, and 32 tokens of output.

    >>> min_context(16), min_context(64), min_context(128)  # the offline models have 512
    (128, 416, 800)
    """
    return (SYSTEM_BLOCKS + 2) * block_size + 2 * 16


def too_short(max_model_len: int, block_size: int) -> str:
    """Why a context of ``max_model_len`` tokens cannot hold the mix at this block size."""
    return (
        f"a context of {max_model_len} tokens is too short for the mix with blocks of "
        f"{block_size} tokens: a shared system prompt of {SYSTEM_BLOCKS} blocks, its suffix "
        f"and output need {min_context(block_size)}; the largest block size that fits is "
        f"{(max_model_len - 32) // (SYSTEM_BLOCKS + 2)}"
    )


def poisson_arrivals(rng: random.Random, count: int, rate: float) -> list[float]:
    """``count`` arrival times of a Poisson process of ``rate`` per second (exponential gaps,
    the first one included); all 0.0 for ``rate = inf`` (everything at once)."""
    if rate == float("inf"):
        return [0.0] * count
    t, times = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        times.append(t)
    return times


def build_mix(
    num_requests: int,
    seed: int,
    rate: float,
    max_model_len: int,
    block_size: int,
    num_blocks: int,
    swap_blocks: int,
) -> list[RequestSpec]:
    """Every request of a run, phase by phase (see the module docstring); the squeeze is sized
    to the pool (``num_blocks``) and the swap pool (``swap_blocks``)."""
    if not rate > 0:  # also refuses NaN
        raise PagedLearnError(f"rate must be > 0 requests/s (or inf: all at once), got {rate!r}")
    if max_model_len < min_context(block_size):
        raise PagedLearnError(too_short(max_model_len, block_size))
    counts = split_counts(num_requests)
    rng = random.Random(seed)
    systems = [_tokens(rng, SYSTEM_BLOCKS * block_size) for _ in range(NUM_SYSTEM_PROMPTS)]
    maker = _Maker(rng, block_size, max_model_len, systems)
    specs = maker.mix(counts["mix"], poisson_arrivals(rng, counts["mix"], rate))
    specs += maker.squeeze(counts["squeeze"], num_blocks, swap_blocks)
    passes = maker.prefix_pass(counts["cold"])
    for phase in ("cold", "warm", "version"):  # the same prompts, three times
        arrivals = poisson_arrivals(rng, len(passes), rate)
        specs += [
            replace(s, request_id=f"{phase}-{i}", phase=phase, arrival=t)
            for i, (s, t) in enumerate(zip(passes, arrivals, strict=True))
        ]
    return specs


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    """``n`` random bytes: random prompts share no block by chance."""
    return tuple(rng.randrange(256) for _ in range(n))


class _Maker:
    """Builds the specs of each phase from one RNG (the order of the draws is part of the seed's
    meaning: change it and a seed gives other requests)."""

    def __init__(self, rng, block_size, max_model_len, systems) -> None:
        self.rng, self.bs, self.max_len, self.systems = rng, block_size, max_model_len, systems
        self.num_shared = 0

    def params(self, ending: str, n: int, max_tokens: int):
        from pagedlearn.engine.sampling_params import SamplingParams

        seed = self.rng.randrange(2**31)
        if ending == "stop":  # sampled, so that a stop comes within a few tokens
            stops = {"stop": STOP_STRINGS} if seed % 2 else {"stop_token_ids": STOP_TOKEN_IDS}
            return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, n=n, **stops)
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0, seed=seed, n=n, ignore_eos=True
        )

    def mix(self, count: int, arrivals: list[float]) -> list[RequestSpec]:
        rng, bs = self.rng, self.bs
        # One prompt longer than the context: the door must refuse it (counted apart).
        too_long = _tokens(rng, self.max_len + 1)
        specs = [
            RequestSpec(
                "mix-0",
                "mix",
                too_long,
                self.params("length", 1, 4),
                arrival=arrivals[0],
                kinds=frozenset({"rejected"}),
                expect_reject=True,
            )
        ]
        for i in range(1, count):
            prompt, ending, n = TEMPLATES[(i - 1) % len(TEMPLATES)]
            max_tokens = 16 if prompt == "near-limit" else rng.randint(8, 32)
            cancel_after = None
            if ending == "cancel":
                max_tokens, cancel_after = 48, rng.randint(2, 12)
            salt = adapter = system = None
            if prompt == "short":
                # 2 .. 2 blocks - 1 tokens (one token with blocks of one: the draw stays
                # the same for every other block size, so that a seed keeps its requests)
                tokens = _tokens(rng, rng.randint(min(2, 2 * bs - 1), 2 * bs - 1))
            elif prompt == "near-limit":
                tokens = _tokens(rng, self.max_len - max_tokens - rng.randrange(bs))
            else:  # two in a row per (system prompt, tenant): same-tenant sharing; then the
                # next tenant sends the same system prompt: what must not be shared
                pair, self.num_shared = self.num_shared // 2, self.num_shared + 1
                salt, adapter = TENANTS[pair % len(TENANTS)]
                system = pair // len(TENANTS) % NUM_SYSTEM_PROMPTS
                tokens = self.systems[system] + _tokens(rng, rng.randint(1, bs))
            kinds = {"unique" if system is None else "shared", ending}
            if system is None:
                kinds.add(prompt)  # "short" or "near-limit"
            if n > 1:
                kinds.add("parallel")
            specs.append(
                RequestSpec(
                    f"mix-{i}",
                    "mix",
                    tokens,
                    self.params(ending, n, max_tokens),
                    salt,
                    adapter,
                    arrivals[i],
                    frozenset(kinds),
                    cancel_after,
                    system_prompt=system,
                )
            )
        return specs

    def squeeze(self, count: int, num_blocks: int, swap_blocks: int) -> list[RequestSpec]:
        """``count`` requests of one shape, all at once: a prompt of just over half the swap
        pool, growing to all of it. So a preempted one fits in the empty swap pool, a second
        one preempted while the first is still out does not (it is recomputed), and the
        requests that fit in the pool at once (``num_blocks / prompt``) want about
        ``num_blocks / prompt x swap_blocks`` blocks: 7 x 16 = 112 of the default 64."""
        rng, bs = self.rng, self.bs
        ctx = self.max_len // bs - 1  # whole blocks, with room for a partial one
        prompt = min(swap_blocks // 2 + 1, ctx - 1)
        output = max(1, min(swap_blocks, ctx) - prompt)
        specs = []
        for i in range(count):
            tokens = _tokens(rng, prompt * bs - rng.randrange(bs))
            params = self.params("length", 1, output * bs)
            kinds = frozenset({"squeeze", "unique", "length"})
            specs.append(RequestSpec(f"squeeze-{i}", "squeeze", tokens, params, kinds=kinds))
        return specs

    def prefix_pass(self, count: int) -> list[RequestSpec]:
        """One request per (system prompt, tenant) pair: the first pairs share a system prompt
        across tenants. Names and arrivals are set per pass by the caller."""
        specs = []
        pairs = [(s, t) for s in range(NUM_SYSTEM_PROMPTS) for t in TENANTS][:count]
        for system, (salt, adapter) in pairs:
            tokens = self.systems[system] + _tokens(self.rng, self.rng.randint(1, self.bs))
            params = self.params("length", 1, 4)
            kinds = frozenset({"shared", "length"})
            specs.append(
                RequestSpec(
                    "", "", tokens, params, salt, adapter, kinds=kinds, system_prompt=system
                )
            )
        return specs
