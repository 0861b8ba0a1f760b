"""Request streams for the simulations: ShareGPT-like, Alpaca-like, and a mixed "home server".

The paper (Figure 11) gives only the *means* of its two datasets' lengths:

=========  ============  =============
dataset    mean input    mean output
=========  ============  =============
ShareGPT   161.31        337.99
Alpaca      19.31         58.45
=========  ============  =============

Everything else about the distributions is our choice, made before running any experiment and
stated here so that it can be argued with:

- **Family: log-normal**, input and output drawn independently. Lengths are positive and
  right-skewed with a long tail (a few very long conversations), which is the shape of the
  paper's Figure 11 histograms, and a log-normal is the simplest family with that shape.
- **Spread: sigma = 1.0 for ShareGPT, 0.7 for Alpaca** (sigma of the underlying normal). The
  paper says ShareGPT's lengths have "higher variance" than Alpaca's; sigma 1.0 puts ShareGPT's
  90th percentile output near 3x its median, sigma 0.7 puts Alpaca's near 2.5x. We do not tune
  these to match the paper's results; ``spread`` scales both, and the experiments sweep it.
- **Context limit: 2048 tokens** (OPT's maximum, and the Max baseline's reservation): a prompt
  is cut to 2047 tokens and the output to what then fits. Each mean is matched *after* this cut
  and rounding, by adjusting the log-normal's location on a large fixed sample.

A request's ``max_tokens`` is the most it may generate. For the paper's workloads that is
whatever fits in 2048 tokens (so Max reserves exactly 2048); in the home-server stream it is a
per-request limit, and a request either stops early (EOS) or runs into it.
"""

import math
import random
from dataclasses import dataclass, field

MAX_CONTEXT = 2048
PAPER_MEANS = {"sharegpt": (161.31, 337.99), "alpaca": (19.31, 58.45)}  # Figure 11
SIGMAS = {"sharegpt": (1.0, 1.0), "alpaca": (0.7, 0.7)}  # our prior choice, see above


@dataclass
class Request:
    """One request: when it arrives, how long its prompt is, and how much it will generate."""

    request_id: int
    arrival: float  # seconds
    prompt_len: int
    output_len: int  # tokens it really generates before EOS (unknown to the server, but Oracle)
    max_tokens: int  # the limit it was sent with; output_len <= max_tokens
    prefix_id: int | None = None  # a shared system prompt, if any
    prefix_len: int = 0  # how many of the prompt's first tokens are that shared prompt
    tags: dict = field(default_factory=dict)
    # Token ids, only where the content matters (prefix caching): None means "any".
    prompt_tokens: list | None = None
    output_tokens: list | None = None
    after: int | None = None  # a request that must finish first (the previous turn of a chat)

    @property
    def final_len(self) -> int:
        return self.prompt_len + self.output_len


def _lognormal_lengths(rng, mean, sigma, n, caps, minimum=1):
    """``n`` integer lengths, log-normal, length ``i`` clipped to [minimum, caps[i]] (or to
    ``caps`` if it is a number), with mean ``mean`` after clipping."""
    caps = [caps] * n if isinstance(caps, int) else caps
    mu = math.log(mean) - sigma**2 / 2  # the unclipped log-normal has exactly this mean
    draws = [rng.gauss(0.0, 1.0) for _ in range(n)]
    for _ in range(30):  # clipping and rounding move the mean; correct the location
        raw = [round(math.exp(mu + sigma * z)) for z in draws]
        lengths = [min(cap, max(minimum, x)) for x, cap in zip(raw, caps, strict=True)]
        achieved = sum(lengths) / n
        if abs(achieved - mean) < 1e-3 * mean:
            break
        mu += math.log(mean / achieved)
    return lengths


def paper_workload(
    name: str, num_requests: int, rate: float | None = None, spread: float = 1.0, seed: int = 0
) -> list[Request]:
    """ShareGPT-like or Alpaca-like requests (``name``: "sharegpt" or "alpaca").

    ``rate``: Poisson arrivals at this many requests per second; ``None`` means all arrive at
    time 0 (a saturated server, always a queue). ``spread`` multiplies both sigmas.
    """
    if name not in PAPER_MEANS:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(PAPER_MEANS)}")
    if not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"num_requests must be a positive int, got {num_requests!r}")
    if rate is not None and not rate > 0:
        raise ValueError(f"rate must be positive (requests per second) or None, got {rate!r}")
    if not spread > 0:
        raise ValueError(f"spread must be positive, got {spread!r}")
    rng = random.Random(seed)
    (mean_in, mean_out), (sigma_in, sigma_out) = PAPER_MEANS[name], SIGMAS[name]
    # Draw the means on a large fixed sample so that every num_requests gets the same calibration.
    sample = max(num_requests, 20_000)
    prompts = _lognormal_lengths(rng, mean_in, sigma_in * spread, sample, MAX_CONTEXT - 1)
    caps = [MAX_CONTEXT - p for p in prompts]  # prompt + output must fit the context
    outputs = _lognormal_lengths(rng, mean_out, sigma_out * spread, sample, caps)
    requests, now = [], 0.0
    for i in range(num_requests):
        if rate is not None:
            now += rng.expovariate(rate)
        prompt, output = prompts[i], outputs[i]
        requests.append(Request(i, now, prompt, output, MAX_CONTEXT - prompt))
    return requests


def home_server_workload(num_requests: int, rate: float | None = None, seed: int = 0):
    """A mixed stream a small self-hosted server sees (our own mix, not from the paper):

    - 70% short chats: prompt ~ log-normal(mean 60), ``max_tokens`` 512;
    - 20% long documents (summarise, ask about a file): prompt ~ uniform 800-1500, ``max_tokens``
      256;
    - 10% code generation that runs to its limit: prompt ~ 200, ``max_tokens`` 1024;
    - chats and documents stop at EOS early (output uniform in 10-90% of ``max_tokens``) 80% of
      the time, otherwise they run to ``max_tokens``;
    - every chat starts with one of 3 system prompts of 100 tokens (``prefix_id``), so prefix
      caching has something to share.
    """
    rng = random.Random(seed)
    requests, now = [], 0.0
    chat_prompts = _lognormal_lengths(rng, 60.0, 0.8, max(num_requests, 1000), 900)
    for i in range(num_requests):
        if rate is not None:
            now += rng.expovariate(rate)
        kind = rng.choices(["chat", "document", "code"], weights=[70, 20, 10])[0]
        if kind == "chat":
            prefix_id, prefix_len = rng.randrange(3), 100
            prompt, max_tokens = prefix_len + chat_prompts[i], 512
        elif kind == "document":
            prefix_id, prefix_len = None, 0
            prompt, max_tokens = rng.randint(800, 1500), 256
        else:
            prefix_id, prefix_len = None, 0
            prompt, max_tokens = 200, 1024
        runs_to_limit = kind == "code" or rng.random() < 0.2
        output = max_tokens if runs_to_limit else max(1, round(max_tokens * rng.uniform(0.1, 0.9)))
        requests.append(
            Request(i, now, prompt, output, max_tokens, prefix_id, prefix_len, {"kind": kind})
        )
    return requests


def mean_lengths(requests) -> tuple[float, float]:
    """(mean prompt length, mean output length) of a stream."""
    n = len(requests)
    return sum(r.prompt_len for r in requests) / n, sum(r.output_len for r in requests) / n


VOCAB = 50_000


def attach_tokens(requests, seed: int = 0) -> list[Request]:
    """Give each request token ids: its shared system prompt's (the same for every request with
    that ``prefix_id``), then tokens of its own, so that only real sharing can hit the cache."""
    rng = random.Random(seed)
    system = {}
    for req in requests:
        shared = []
        if req.prefix_id is not None:
            if req.prefix_id not in system:
                system[req.prefix_id] = [rng.randrange(1, VOCAB) for _ in range(req.prefix_len)]
            shared = system[req.prefix_id][: req.prefix_len]
        own = [rng.randrange(1, VOCAB) for _ in range(req.prompt_len - len(shared))]
        req.prompt_tokens = shared + own
        req.output_tokens = [rng.randrange(1, VOCAB) for _ in range(req.output_len)]
    return requests


def multi_turn_workload(num_conversations: int, turns: int = 4, seed: int = 0) -> list[Request]:
    """Chats of several turns: turn ``t + 1``'s prompt is the whole conversation so far (its own
    system prompt, every earlier message and reply) plus a new message, as chat APIs send it.

    Requests are ordered turn by turn across conversations (everyone's first turn, then everyone's
    second, ...), and each turn waits for the previous one to finish (``after``): nobody answers
    a reply before reading it. Messages ~ log-normal(mean 50), replies ~ log-normal(mean 150),
    system prompts 200 tokens, one per conversation.
    """
    rng = random.Random(seed)
    n = num_conversations * turns
    messages = _lognormal_lengths(rng, 50.0, 0.8, max(n, 1000), 400)
    replies = _lognormal_lengths(rng, 150.0, 0.8, max(n, 1000), 600)
    history = [[rng.randrange(1, VOCAB) for _ in range(200)] for _ in range(num_conversations)]
    requests, last = [], [None] * num_conversations
    for turn in range(turns):
        for conv in range(num_conversations):
            i = len(requests)
            prompt = history[conv] + [rng.randrange(1, VOCAB) for _ in range(messages[i])]
            reply = [rng.randrange(1, VOCAB) for _ in range(replies[i])]
            req = Request(i, 0.0, len(prompt), len(reply), MAX_CONTEXT * 4, conv, 0,
                          {"turn": turn}, prompt, reply, after=last[conv])  # fmt: skip
            requests.append(req)
            history[conv], last[conv] = prompt + reply, i
    return requests
