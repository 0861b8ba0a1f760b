"""The load test over HTTP (loadtest/http.py): its mix against pagedlearn's own server, the SSE
reading on canned streams, the errors a user meets first, and the /metrics reader."""

import asyncio
import dataclasses
import json
import math
import socket
import time
from types import SimpleNamespace

import httpx
import pytest

from pagedlearn.engine.sampling_params import SamplingParams
from pagedlearn.loadtest.http import (
    HTTPLoadTestError,
    _Run,
    cli,
    request_body,
    root_url,
    run_http_loadtest,
    salt_of,
)
from pagedlearn.loadtest.http_report import JSON_KEYS
from pagedlearn.loadtest.http_stream import sse_lines
from pagedlearn.loadtest.in_process import LoadTestOptionError
from pagedlearn.loadtest.mix import MIN_REQUESTS, RequestSpec, build_mix
from pagedlearn.loadtest.server_metrics import MetricsPageError, parse_metrics

KEY = "sk-test-loadtest"


@pytest.fixture(scope="module")
def server():
    from pagedlearn.serve import serve

    # The load test's default pool (two full contexts, a quarter of it to swap to): the squeeze
    # preempts, as in-process.
    with serve("tiny-gpt2", port=0, api_key=KEY, num_blocks=64, preemption_mode="swap",
               swap_blocks=16) as srv:  # fmt: skip
        yield srv


@pytest.fixture(scope="module")
def report(server):
    start = time.perf_counter()
    r = run_http_loadtest(
        server.url, api_key=KEY, num_requests=MIN_REQUESTS, rate=math.inf, timeout=30.0
    )
    r.test_time = time.perf_counter() - start
    return r


def test_the_mix_runs_against_pagedlearns_server(report, server):
    print(report.summary())
    assert report.ok and report.complete, report.summary()
    c = report.counts
    assert c["sent"] == MIN_REQUESTS and c["lost"] == c["timeout"] == c["error"] == 0
    assert c["rejected"] == 1 and c["cancelled"] > 0 and c["stopped"] > 0 and c["length"] > 0
    assert report.config["server_metrics"] == "pagedlearn"
    assert report.config["block_size"] == 16 and report.config["num_gpu_blocks"] == 64
    assert report.config["max_model_len"] == 512  # from the model card
    for name in ("ttft", "itl", "e2e"):
        d = report.latency[name]
        assert d["count"] > 0 and 0 < d["p50"] <= d["p90"] <= d["p99"]
    t, wall = report.throughput, report.wall_time
    assert t["output_tokens"] > 0 and t["requests_per_s"] > 0
    assert t["answered"] == c["stopped"] + c["length"] + c["cancelled"]
    # each derived number beside its rule
    assert f"{t['output_tokens']:,} output tokens / {wall:.2f} s wall = " in report.summary()
    assert f"{t['answered']} answered (finished or cancelled) / {wall:.2f} s = " in report.summary()
    assert report.config["squeeze_requests"] == 8 and report.config["squeeze_tokens"] <= 512
    phases = report.prefix_cache["phases"]
    assert report.prefix_cache["source"] == "usage"  # pagedlearn's usage has cached_tokens
    assert phases["cold"]["hit_tokens"] == phases["version"]["hit_tokens"] == 0
    assert phases["warm"]["hit_tokens"] > 0
    assert report.server["preemptions"] > 0 and report.server["peak_kv_usage"] > 0
    assert report.test_time < 60


def test_cancelled_streams_were_aborted_and_every_block_came_back(report, server):
    names = {ch.name: ch for ch in report.checks}
    assert names["every block came back"].ok
    assert names["the server aborted every cancelled stream"].ok
    # The engine's own view, read on its thread: idle, nothing held, the aborts counted.
    idle, used, aborts = server.call(
        lambda e: (
            not e.has_unfinished_requests(),
            e.stats().used_blocks,
            e.metrics.finished_by_reason.get("abort", 0),
        )
    )
    assert idle and used == 0 and aborts >= report.counts["cancelled"] > 0


def test_a_pool_that_never_ran_short_says_what_bounds_the_squeeze(report):
    from pagedlearn.loadtest.http_report import _checks

    quiet = dataclasses.replace(report, server={**report.server, "preemptions": 0.0})
    hint = next(c.hint for c in _checks(quiet, None) if c.name == "a preemption happened")
    tokens = report.config["squeeze_tokens"]
    assert f"the squeeze sent 8 requests of up to {tokens:,} tokens at once" in hint
    assert "--num-requests / 10" in hint and "--max-model-len caps it" in hint


def test_a_rerun_starts_cold_and_the_json_holds_every_number(report, server, tmp_path, capsys):
    path = tmp_path / "r.json"
    args = _args(server.url + "/v1/", api_key=KEY, json=str(path))
    assert cli(args) == 0
    out = capsys.readouterr().out
    assert "[OK] nothing was hit in the cold pass" in out and "TTFT" in out
    d = json.loads(path.read_text())
    assert set(d) == set(JSON_KEYS) and d["ok"] is True
    assert d["config"]["run_id"] != report.config["run_id"]  # a new salt prefix: cold again
    assert len(d["requests"]) == MIN_REQUESTS and d["config"]["rate"] == "inf"


def test_api_key(server, capsys, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert cli(_args(server.url)) == 1  # it started and cannot go on (__main__'s rule)
    err = capsys.readouterr().err
    assert f"{server.url}/v1/models answered 401" in err and "wants an API key" in err
    with pytest.raises(HTTPLoadTestError, match="refused the API key"):
        run_http_loadtest(server.url, api_key="wrong", num_requests=MIN_REQUESTS)
    with pytest.raises(HTTPLoadTestError, match="does not serve 'nope'; it serves tiny-gpt2"):
        run_http_loadtest(server.url, api_key=KEY, model="nope")


def test_an_unreachable_endpoint_says_so(capsys):
    with socket.socket() as s:  # a port nobody listens on once it is closed
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(HTTPLoadTestError, match=f"cannot reach {url}/v1/models: Connect"):
        run_http_loadtest(url, timeout=5.0)
    assert cli(_args(url)) == 1
    assert f"cannot reach {url}/v1/models" in capsys.readouterr().err
    for bad, option in (("localhost:8000", "endpoint"), ("http://x", "timeout")):
        with pytest.raises(LoadTestOptionError) as e:
            run_http_loadtest(bad, timeout=0.0)
        assert e.value.option == option


def test_each_request_becomes_a_completions_body():
    specs = build_mix(MIN_REQUESTS, 0, math.inf, 512, 16, 64, 16)
    assert root_url("http://h:1/v1") == root_url("http://h:1/") == "http://h:1"
    stop = next(s for s in specs if s.params.stop_token_ids)
    body = request_body(stop, "m", "salt")
    assert body["prompt"] == list(stop.prompt_token_ids) and body["stream"] is True
    assert body["stop_token_ids"] == list(stop.params.stop_token_ids)
    assert body["stream_options"] == {"include_usage": True} and body["cache_salt"] == "salt"
    assert body["seed"] == stop.params.seed and body["n"] == stop.params.n
    length = next(s for s in specs if s.params.ignore_eos)
    assert request_body(length, "m", "s")["ignore_eos"] is True
    # Tenants get salts of their own; cold and warm share one, the version pass has a new one.
    tenants = [(None, None), ("tenant-a", None), (None, "adapter-x")]
    assert len({salt_of("r", "mix", *t) for t in tenants}) == 3
    assert salt_of("r", "cold", None, None) == salt_of("r", "warm", None, None)
    assert salt_of("r", "version", None, None) != salt_of("r", "warm", None, None)
    assert salt_of("r", "mix", None, None) != salt_of("r", "cold", None, None)


def _sse(*chunks) -> bytes:
    return b"".join(
        b"data: " + (c if isinstance(c, bytes) else json.dumps(c).encode()) + b"\n\n"
        for c in chunks
    )


def _token(text="a", reason=None, index=0):
    return {"choices": [{"index": index, "text": text, "finish_reason": reason}]}


USAGE = {"choices": [], "usage": {"completion_tokens": 7, "prompt_tokens_details":
                                  {"cached_tokens": 16}}}  # fmt: skip
CANNED = {
    "length": (200, _sse(_token(), _token(), _token("", "length"), USAGE, b"[DONE]")),
    "cut": (200, _sse(_token(), _token())),
    "error": (200, _sse(_token(), {"error": {"message": "boom", "code": 500}})),
    "refused": (400, json.dumps({"error": {"message": "too long", "code": 400}}).encode()),
    "broken": (500, b"Internal Server Error"),
    "cancel": (200, _sse(*[_token()] * 5, _token("b", "length"), b"[DONE]")),
}


@pytest.mark.parametrize(
    "case, outcome, tokens, error",
    [("length", "length", 7, None), ("cut", "error", 2, "before every sample ended"),
     ("error", "error", 0, "boom"), ("refused", "rejected", 0, "too long"),
     ("broken", "error", 0, "Internal Server Error"), ("cancel", "cancelled", 2, None)],
)  # fmt: skip
def test_reading_a_stream(case, outcome, tokens, error):
    def answer(request):
        status, content = CANNED[case]
        return httpx.Response(status, content=content)

    params = SamplingParams(max_tokens=8, ignore_eos=True)
    cancel_after = 2 if case == "cancel" else None
    spec = RequestSpec("r-0", "mix", (1, 2, 3), params, cancel_after=cancel_after)

    async def go():
        transport = httpx.MockTransport(answer)
        async with httpx.AsyncClient(transport=transport, base_url="http://canned") as client:
            run = _Run(client, [spec], "run", "m", 5.0, metrics=False)
            await run.send(spec, time.perf_counter())
            return run.records["r-0"]

    rec = asyncio.run(go())
    assert rec["outcome"] == outcome and rec["output_tokens"] == tokens
    assert (rec["error"] is None) if error is None else error in rec["error"]
    if case == "length":  # usage's numbers win over the chunks counted
        assert rec["cached_tokens"] == 16 and rec["ttft"] > 0 and len(rec["itl"]) == 1
        assert rec["e2e"] >= rec["ttft"] and rec["finish_reasons"] == ["length"]


def _run_canned(answer, specs):
    """Run ``specs`` (all of the mix phase) against ``answer(request) -> httpx.Response``."""

    async def go():
        transport = httpx.MockTransport(answer)
        async with httpx.AsyncClient(transport=transport, base_url="http://canned") as client:
            run = _Run(client, specs, "run", "m", 5.0, metrics=False)
            await asyncio.wait_for(run.phases_in_order(), 10.0)
            return run.records

    return asyncio.run(go())


def _spec(rid, prompt=(1, 2, 3)):
    return RequestSpec(rid, "mix", prompt, SamplingParams(max_tokens=8, ignore_eos=True))


def test_sse_lines_end_only_at_cr_or_lf():
    # U+2028, U+2029 and U+0085 are line ends to str.splitlines (httpx's aiter_lines), not to
    # SSE; a server may send them unescaped. Cut the body into 5-byte pieces: some end inside a
    # character's bytes, one between the CR and the LF of a CRLF.
    text = "a\u2028b\u0085c\u2029"
    line = json.dumps(_token(text), ensure_ascii=False).encode()
    body = b"data: " + line + b"\r\n\r\n" + b"data: " + json.dumps(_token("d", "length")).encode()
    body += b"\r\rdata: [DONE]"  # CR alone ends a line too; the last line has no end at all
    pieces = [body[i : i + 5] for i in range(0, len(body), 5)]
    assert any(p.endswith(b"\r") for p in pieces)

    def stream(request):
        async def chunks():
            for p in pieces:
                yield p

        return httpx.Response(200, content=chunks())

    async def lines():
        transport = httpx.MockTransport(stream)
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://canned") as client,
            client.stream("POST", "/v1/completions") as response,
        ):
            return [x async for x in sse_lines(response)]

    got = asyncio.run(lines())
    assert len(got) == 5 and got[1] == got[3] == b"" and got[4] == b"data: [DONE]"
    assert json.loads(got[0][len(b"data: ") :])["choices"][0]["text"] == text
    rec = _run_canned(stream, [_spec("r-0")])["r-0"]
    assert rec["outcome"] == "length" and rec["error"] is None and rec["output_tokens"] == 2


def test_a_bad_reply_fails_its_request_and_the_run_goes_on():
    usage = lambda u: {"choices": [], "usage": u}  # noqa: E731
    replies = {  # prompt's first id -> body
        1: _sse(_token(), _token("b", "length"), b"[DONE]"),  # a good one
        2: _sse(_token(), _token("b", "length"), usage(5), b"[DONE]"),
        3: _sse(_token(), _token("b", "length"), usage({"completion_tokens": "7"}), b"[DONE]"),
        4: _sse(_token(), _token("b", "length"),
                usage({"prompt_tokens_details": 3, "completion_tokens": 2}), b"[DONE]"),
        5: _sse(b"<html>not json</html>"),
        6: _sse(b"[1, 2]"),  # JSON, not a chunk
        7: b"<html>Bad Gateway</html>",  # not SSE at all
    }  # fmt: skip

    def answer(request):
        first = json.loads(request.content)["prompt"][0]
        return httpx.Response(200, content=replies[first])

    records = _run_canned(answer, [_spec(f"r-{i}", (i, 9)) for i in replies])
    assert records["r-1"]["outcome"] == "length" and records["r-1"]["error"] is None
    errors = {i: records[f"r-{i}"]["error"] for i in replies if i != 1}
    assert all(records[f"r-{i}"]["outcome"] == "error" for i in errors), records
    assert "a bad chunk (usage is 5, not an object)" in errors[2]
    assert "ValueError: usage's completion_tokens is '7', not a count of tokens" in errors[3]
    assert "usage has 3 where an object with cached_tokens belongs" in errors[4]
    assert "a bad chunk (" in errors[5] and "<html>not json" in errors[5]
    assert "a bad chunk (" in errors[6]
    assert "0 of 1 samples began" in errors[7]


VLLM_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-0.6B"} 2.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-0.6B"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-0.6B"} 0.5
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 4096.0
vllm:prefix_cache_queries_total{engine="1",model_name="Qwen/Qwen3-0.6B"} 1024.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="Qwen/Qwen3-0.6B"} 1.75e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 2048.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 3.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="Qwen/Qwen3-0.6B"} 9.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="Qwen/Qwen3-0.6B"} 4.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",\
engine="0",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="100"} 1.0
"""


def test_metrics_parser_reads_vllms_names():
    m = parse_metrics(VLLM_PAGE)
    assert m["source"] == "vllm"
    assert m["kv_usage"] == 0.5  # the fuller of the two engines
    assert (m["prefix_queries"], m["prefix_hits"]) == (5120.0, 2048.0)  # summed, no _created
    assert (m["preemptions"], m["running"], m["aborts"]) == (3.0, 3.0, 4.0)
    assert (m["block_size"], m["num_gpu_blocks"], m["num_cpu_blocks"]) == (16, 100, None)
    assert m["waiting"] is None and m["used_blocks"] is None  # not on this page
    old = parse_metrics('vllm:gpu_cache_usage_perc{model_name="m"} 0.75\n')  # vLLM < 0.10
    assert old["kv_usage"] == 0.75
    sglang = parse_metrics('sglang:token_usage{model_name="m"} 0.5\n')
    assert sglang["source"] is None and sglang["kv_usage"] is None
    with pytest.raises(MetricsPageError, match="Prometheus"):
        parse_metrics("<html>not a metrics page</html>\n")


def test_metrics_parser_reads_pagedlearns_page():
    from pagedlearn import LLM
    from pagedlearn.engine.prometheus import prometheus_text

    llm = LLM("tiny-gpt2", num_blocks=8, verbose=False)
    llm.generate([list(range(40))] * 2, SamplingParams(max_tokens=2))
    m = parse_metrics(prometheus_text(llm.engine))
    assert m["source"] == "pagedlearn"
    assert (m["block_size"], m["num_gpu_blocks"], m["num_cpu_blocks"]) == (16, 8, 0)
    assert m["prefix_queries"] > 0 and m["prefix_hits"] > 0  # the second prompt hit the first
    assert m["used_blocks"] == m["running"] == m["preemptions"] == m["aborts"] == 0
    assert 0 <= m["kv_usage"] <= 1


def _args(endpoint, **kw):
    args = {"endpoint": endpoint, "api_key": None, "model": None, "num_requests": MIN_REQUESTS,
            "rate": math.inf, "seed": 0, "json": None, "timeout": 30.0}  # fmt: skip
    return SimpleNamespace(**{**args, **kw})
