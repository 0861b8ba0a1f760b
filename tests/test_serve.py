"""The OpenAI-compatible server (pagedlearn.serve) over real HTTP, with the real ``openai`` client.

One server on tiny-gpt2 for the module; every answer is checked against ``LLM.generate`` run on
an LLM built with the same options (same seeded weights), so the server adds nothing and loses
nothing: the same tokens, the same text, streamed or not. Then what only a server has: many
clients at once, clients that leave mid-stream, usage with cached tokens, /metrics.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
parser = pytest.importorskip("prometheus_client.parser")

from helpers import wait_until  # noqa: E402

from pagedlearn import LLM, SamplingParams  # noqa: E402
from pagedlearn.serve import serve  # noqa: E402
from pagedlearn.serve.chat import plain_template  # noqa: E402

OPTS = {"block_size": 16, "num_blocks": 256}  # enough for every test's requests at once
TIMEOUT = 30.0
LONG = "The quick brown fox jumps over the lazy dog. " * 3  # 135 tokens: 8 full blocks


@pytest.fixture(scope="module")
def srv():
    with serve("tiny-gpt2", port=0, verbose=False, **OPTS) as s:
        yield s


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-gpt2", verbose=False, **OPTS)


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=TIMEOUT)


def generate(llm, prompt, **kw) -> list:
    """``LLM.generate``'s outputs (one per sample) for one prompt."""
    return llm.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0].outputs


def pool_state(engine) -> dict:
    """What must be empty between tests (run on the engine thread, through srv.call)."""
    return {
        "requests": len(engine.requests),
        "work": engine.has_unfinished_requests(),
        "used_blocks": engine.kv.stats()["used_blocks"],
        "sequences": len(engine.kv.sequences()),
    }


CLEAN = {"requests": 0, "work": False, "used_blocks": 0, "sequences": 0}


def stream_texts(chunks) -> dict[int, str]:
    """Each choice's text, put back together from a stream's deltas (completions or chat)."""
    texts: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
    return texts


# --- the same answers as LLM.generate ------------------------------------------------------------
@pytest.mark.parametrize("prompt", ["Hello world", [72, 101, 108, 108, 111]])
def test_completion_matches_generate(srv, llm, client, prompt):
    want = generate(llm, prompt, max_tokens=24, temperature=0, ignore_eos=True)[0]
    args = dict(model=srv.model_name, prompt=prompt, max_tokens=24, temperature=0)
    r = client.completions.create(**args, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == len(want.token_ids) == 24
    assert r.usage.prompt_tokens == 5 if isinstance(prompt, list) else len(prompt.encode())
    chunks = list(client.completions.create(**args, stream=True, extra_body={"ignore_eos": True}))
    assert stream_texts(chunks) == {0: want.text}
    assert chunks[-1].choices[0].finish_reason == "length"
    assert srv.call(pool_state) == CLEAN


def test_chat_matches_generate(srv, llm, client):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    want = generate(llm, plain_template(messages), max_tokens=16, temperature=0)[0]
    args = dict(model=srv.model_name, messages=messages, max_tokens=16, temperature=0)
    r = client.chat.completions.create(**args)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.completion_tokens == len(want.token_ids)
    chunks = list(client.chat.completions.create(**args, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert stream_texts(chunks) == {0: want.text}
    assert chunks[-1].choices[0].finish_reason == want.finish_reason
    # max_completion_tokens (OpenAI's newer name) wins over max_tokens
    r = client.chat.completions.create(**{**args, "max_tokens": 4}, max_completion_tokens=6)
    assert r.usage.completion_tokens == min(6, len(want.token_ids))


def test_n_samples_with_a_seed(srv, llm, client):
    kw = dict(max_tokens=12, temperature=1.0, seed=7, n=3)
    want = [c.text for c in generate(llm, "Once upon", ignore_eos=True, **kw)]
    assert len(set(want)) > 1  # the samples differ: a seed does not make them equal
    args = dict(model=srv.model_name, prompt="Once upon", extra_body={"ignore_eos": True}, **kw)
    r = client.completions.create(**args)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == want
    assert r.usage.completion_tokens == 3 * 12
    chunks = list(client.completions.create(**args, stream=True))
    assert stream_texts(chunks) == dict(enumerate(want))
    assert client.completions.create(**args).choices[1].text == want[1]  # reproducible


def test_stop_strings(srv, llm, client):
    free = generate(llm, "Hello", max_tokens=40, temperature=0, ignore_eos=True)[0].text
    # a character of the greedy text that first appears a few characters in: it stops there
    at = next(i for i in range(3, len(free)) if free[i].isalnum() and free[i] not in free[:i])
    stop = free[at]
    want = generate(llm, "Hello", max_tokens=40, temperature=0, ignore_eos=True, stop=[stop])[0]
    assert want.finish_reason == "stop" and want.text == free[:at]
    args = dict(model=srv.model_name, prompt="Hello", max_tokens=40, temperature=0, stop=[stop])
    r = client.completions.create(**args, extra_body={"ignore_eos": True})
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(**args, stream=True, extra_body={"ignore_eos": True}))
    assert stream_texts(chunks) == {0: want.text}  # the stop string never went out
    body = {"ignore_eos": True, "include_stop_str_in_output": True}
    r = client.completions.create(**args, extra_body=body)
    assert r.choices[0].text == free[: at + 1]


def test_logprobs(srv, llm, client):
    k = 3
    want = generate(llm, "Hello", max_tokens=8, temperature=0, ignore_eos=True, logprobs=k)[0]
    args = dict(model=srv.model_name, prompt="Hello", max_tokens=8, temperature=0)
    r = client.completions.create(**args, logprobs=k, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert all(1 <= len(top) <= k + 1 for top in lp.top_logprobs)  # k most likely + sampled
    own = [d[t].logprob for t, d in zip(want.token_ids, want.logprobs, strict=True)]
    assert lp.token_logprobs == pytest.approx(own, abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    chunks = list(client.completions.create(**args, logprobs=k, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert [x for s in streamed for x in s.token_logprobs] == pytest.approx(lp.token_logprobs)
    assert [x for s in streamed for x in s.text_offset] == lp.text_offset
    # chat: a bool, and top_logprobs entries per token
    messages = [{"role": "user", "content": "Hello"}]
    r = client.chat.completions.create(
        model=srv.model_name, messages=messages, max_tokens=8, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode())
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    r = client.chat.completions.create(model=srv.model_name, messages=messages, max_tokens=4)
    assert r.choices[0].logprobs is None


def test_top_logprobs_show_the_most_likely_of_tokens_that_decode_alike(srv, client):
    # Greedy: the sampled token is the most likely, so its value is the one its text shows. The
    # byte tokenizer decodes every byte >= 0x80 to U+FFFD: among 20 candidates several do.
    args = dict(model=srv.model_name, prompt="Hello", max_tokens=24, temperature=0)
    lp = client.completions.create(**args, logprobs=20).choices[0].logprobs
    assert any(t == "\ufffd" for t in lp.tokens)  # (else this test shows nothing)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == pytest.approx(value)
        assert max(top.values()) == pytest.approx(value)


def test_a_tiny_temperature_is_greedy(srv, client):
    args = dict(model=srv.model_name, prompt="Hello", max_tokens=8, extra_body={"ignore_eos": True})
    greedy = client.completions.create(**args, temperature=0).choices[0].text
    for t in (1e-6, 1e-40, 5e-324):  # logits / t would overflow: NaN probabilities
        assert client.completions.create(**args, temperature=t).choices[0].text == greedy


def test_unicode_line_separators_in_text_do_not_split_sse_lines(srv):
    """httpx's iter_lines splits with str.splitlines, which also ends a line at U+2028, U+2029
    and U+0085: the server's JSON escapes them. (The tokenizer is made to write them: every
    printable ASCII character of the output's text becomes one of the three.)"""
    tok = srv.engine.tokenizer
    breaks = "\u2028\u2029\x85"
    table = {c: breaks[c % 3] for c in range(32, 127)}
    real = type(tok).decode
    body = {"prompt": "Hello", "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    url = srv.base_url + "/completions"
    tok.decode = lambda ids, **kw: real(tok, ids, **kw).translate(table)
    try:
        with httpx.Client(timeout=TIMEOUT) as http:
            want = http.post(url, json=body).json()["choices"][0]["text"]
            with http.stream("POST", url, json={**body, "stream": True}) as r:
                lines = [x for x in r.iter_lines() if x]
    finally:
        del tok.decode
    assert set(breaks) <= set(want)
    assert lines[-1] == "data: [DONE]" and all(x.startswith("data: {") for x in lines[:-1])
    chunks = [json.loads(x.removeprefix("data: ")) for x in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == want


def test_a_stream_decodes_each_token_about_once():
    """Incremental detokenization: a stream of N one-token outputs decodes O(N) tokens in all,
    not the whole output again for every chunk (N^2 / 2); its deltas add up to the text, cut
    before the stop string, whose start was held back."""
    from pagedlearn.engine.request import CompletionOutput, RequestOutput
    from pagedlearn.models.tokenizer import ByteTokenizer
    from pagedlearn.serve.responses import Reply

    tok, decoded = ByteTokenizer(), []

    def decode(ids):
        decoded.append(len(ids))
        return tok.decode(ids, skip_special_tokens=True)

    want = "naïve café, 日本語 ✓ " * 20  # multi-byte characters: split across tokens
    ids = list((want + "STOP here").encode())
    reply, sent = Reply("completion", "m", tok), []
    for n in range(1, len(ids) + 1):  # the engine's outputs, one token more each
        done = "stop" if "STOP" in tok.decode(ids[:n]) else None
        c = CompletionOutput(0, ids[:n], 0.0, done, detokenize=decode, stop=("STOP",))
        out = RequestOutput("r", None, [1], [c], done is not None, None)
        sent += [ch["choices"][0]["text"] for ch in reply.chunks(out)]
        if done:
            break
    assert len(sent) == n and "".join(sent) == want == c.text
    assert sum(decoded) < 10 * n  # (measured: ~6 n; the whole output each time: n * n / 2)
    assert "\ufffd" not in "".join(sent)  # a character goes out whole, never as U+FFFD


def test_usage_counts_cached_tokens_and_cache_salt_keeps_tenants_apart(srv, client):
    def cached(prompt, salt=None) -> int:
        extra = {"cache_salt": salt} if salt else None
        r = client.completions.create(
            model=srv.model_name, prompt=prompt, max_tokens=2, temperature=0, extra_body=extra
        )
        assert r.usage.prompt_tokens == len(prompt.encode())
        return r.usage.prompt_tokens_details.cached_tokens

    prompt = "usage " + LONG
    assert cached(prompt) == 0
    assert cached(prompt) == 16 * (len(prompt.encode()) // 16)  # every full block, from the cache
    assert cached(prompt, "tenant-a") == 0  # another tenant's blocks are not shared
    assert cached(prompt, "tenant-a") > 0
    assert cached(prompt, "tenant-b") == 0


def test_more_samples_than_a_step_runs_are_refused(srv):
    body = {"prompt": "x", "max_tokens": 2, "n": 65, "temperature": 1}  # max_num_seqs: 64
    r = httpx.post(srv.base_url + "/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert "max_num_seqs" in r.json()["error"]["message"]


# --- what only a server has ----------------------------------------------------------------------
def test_32_concurrent_streams_finish_and_give_every_block_back(srv, llm):
    prompts = [f"Client {i}: " + "x" * (i % 7) for i in range(32)]
    want = [generate(llm, p, max_tokens=16, temperature=0)[0].text for p in prompts]

    async def one(client, prompt) -> str:
        stream = await client.completions.create(
            model=srv.model_name, prompt=prompt, max_tokens=16, temperature=0, stream=True
        )
        return stream_texts([c async for c in stream])[0]

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=srv.base_url, api_key="none", max_retries=0, timeout=TIMEOUT
        ) as client:
            return await asyncio.wait_for(
                asyncio.gather(*(one(client, p) for p in prompts)), TIMEOUT
            )

    assert asyncio.run(main()) == want
    assert wait_until(lambda: srv.call(pool_state) == CLEAN, "a clean pool", 5.0)


def slow_steps(srv, seconds: float):
    """Make every engine step take a little longer (a stats subscriber, on the engine thread),
    so that a long request is still running when the test's client leaves."""
    return srv.call(lambda e: e.subscribe_stats(lambda stats: time.sleep(seconds)))


def aborted(engine) -> int:
    return engine.metrics.finished_by_reason.get("abort", 0)


def test_a_client_that_leaves_mid_stream_has_its_request_aborted(srv):
    before = srv.call(aborted)
    unsubscribe = slow_steps(srv, 0.005)
    try:
        body = {"model": srv.model_name, "prompt": "Hi", "max_tokens": 400, "stream": True}
        body["ignore_eos"] = True
        url = srv.base_url + "/completions"
        with httpx.Client(timeout=TIMEOUT) as http, http.stream("POST", url, json=body) as r:
            assert r.status_code == 200
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    break
        # the connection is closed here, ~3 tokens into 400
        assert wait_until(lambda: srv.call(pool_state) == CLEAN, "a clean pool", 5.0)
        assert srv.call(aborted) == before + 1
    finally:
        srv.call(lambda e: unsubscribe())


def test_a_client_that_times_out_on_a_plain_request_has_it_aborted(srv):
    before = srv.call(aborted)
    unsubscribe = slow_steps(srv, 0.005)
    try:
        body = {"model": srv.model_name, "prompt": "Hi", "max_tokens": 400, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout), httpx.Client(timeout=0.3) as http:
            http.post(srv.base_url + "/completions", json=body)
        assert wait_until(lambda: srv.call(pool_state) == CLEAN, "a clean pool", 5.0)
        assert srv.call(aborted) == before + 1
    finally:
        srv.call(lambda e: unsubscribe())


def test_stream_include_usage(srv, client):
    chunks = list(
        client.completions.create(
            model=srv.model_name, prompt="Hello", max_tokens=5, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 5
    assert last.usage.total_tokens == 5 + len(b"Hello")
    assert all(c.usage is None for c in chunks[:-1])


def test_models_health_and_metrics(srv, client):
    # One request of its own: under pytest-xdist this test may run before any other of the file.
    client.completions.create(model=srv.model_name, prompt="Hi", max_tokens=2, temperature=0)
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny-gpt2"] and models[0].owned_by == "pagedlearn"
    assert models[0].model_extra["max_model_len"] == srv.engine.max_model_len
    with httpx.Client(timeout=TIMEOUT) as http:
        assert http.get(srv.url + "/health").status_code == 200
        page = http.get(srv.url + "/metrics")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in parser.text_string_to_metric_families(page.text)}
    (info,) = fams["pagedlearn_cache_config_info"].samples
    assert info.labels["block_size"] == "16" and info.labels["num_gpu_blocks"] == "256"
    assert info.labels["model_name"] == "tiny-gpt2"
    for name in ("kv_cache_usage_perc", "prefix_cache_queries", "prefix_cache_hits"):
        assert "pagedlearn_" + name in fams
    states = {
        (s.labels["pool"], s.labels["state"]) for s in fams["pagedlearn_kv_cache_blocks"].samples
    }
    assert ("gpu", "used") in states
    assert fams["pagedlearn_request_success"].samples  # the request above, counted


# --- the engine loop and the handle, without HTTP -------------------------------------------------
def test_engine_loop_generate_streams_coalesces_and_aborts_when_left(llm):
    from pagedlearn.engine.admission import RequestRejectedError
    from pagedlearn.serve.engine_loop import EngineDeadError, EngineLoop

    loop = EngineLoop(llm.engine).start()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    async def main():
        streamed = [o async for o in loop.generate("a", [72, 105], params)]
        final = [o async for o in loop.generate("b", [72, 105], params, stream=False)]
        with pytest.raises(RequestRejectedError, match="empty prompt"):  # before any output
            async for _ in loop.generate("c", [], params):
                pass
        long = SamplingParams(max_tokens=400, ignore_eos=True)
        left = loop.generate("d", [72], long)
        await left.__anext__()
        await left.aclose()  # the reader leaves: the request is aborted on the engine thread
        return streamed, final

    try:
        before = loop.call(aborted).result(TIMEOUT)
        streamed, final = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
        counts = [len(o.outputs[0].token_ids) for o in streamed]
        assert counts == sorted(set(counts)) and counts[-1] == 8  # (a slow reader: coalesced)
        assert [o.finished for o in streamed] == [False] * (len(streamed) - 1) + [True]
        assert (
            len(final) == 1 and final[0].outputs[0].token_ids == streamed[-1].outputs[0].token_ids
        )
        assert wait_until(
            lambda: loop.call(pool_state).result(TIMEOUT) == CLEAN, "a clean pool", 5.0
        )
        assert loop.call(aborted).result(TIMEOUT) == before + 1
    finally:
        loop.stop()
        loop.stop()  # idempotent
    with pytest.raises(EngineDeadError):
        loop.call(pool_state).result(TIMEOUT)
    assert pool_state(llm.engine) == CLEAN


def test_serving_an_llm_then_stopping_aborts_what_runs(llm):
    srv = serve(llm, port=0)
    assert srv.llm is llm and srv.model_name == "tiny-gpt2"
    unsubscribe = slow_steps(srv, 0.005)
    body = {"prompt": "Hi", "max_tokens": 400, "stream": True, "ignore_eos": True}
    url = srv.base_url + "/completions"
    try:
        with httpx.Client(timeout=TIMEOUT) as http, http.stream("POST", url, json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line).startswith("data: ")
            srv.stop()  # mid-stream: the client gets an error event, then [DONE]
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2].removeprefix("data: "))["error"]["code"] == 503
    finally:
        srv.stop()  # idempotent
        unsubscribe()  # (the engine thread is gone: the engine is the test's again)
    assert pool_state(llm.engine) == CLEAN
    assert llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
    with pytest.raises(httpx.ConnectError), httpx.Client(timeout=TIMEOUT) as http:
        http.get(srv.url + "/health")


def test_chat_uses_the_tokenizers_template_when_it_has_one():
    from pagedlearn.models.tokenizer import ByteTokenizer
    from pagedlearn.serve.chat import chat_prompt_ids
    from pagedlearn.serve.protocol import ProtocolError

    class TemplateTokenizer(ByteTokenizer):  # Hugging Face's two members, on the byte tokenizer
        chat_template = "<|role|>content ... <|assistant|>"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert tokenize is False and add_generation_prompt is True
            if messages[0]["role"] != "user":
                raise ValueError("Conversation roles must alternate user/assistant/...")
            return "".join(f"<|{m['role']}|>{m['content']}" for m in messages) + "<|assistant|>"

        def encode(self, text, add_special_tokens=True):
            assert add_special_tokens is False  # the template wrote its special tokens itself
            return super().encode(text)

    tok = TemplateTokenizer()
    assert chat_prompt_ids(tok, [{"role": "user", "content": "Hi"}]) == list(
        b"<|user|>Hi<|assistant|>"
    )
    with pytest.raises(ProtocolError, match="roles must alternate") as e:
        chat_prompt_ids(tok, [{"role": "assistant", "content": "Hi"}])
    assert e.value.param == "messages" and e.value.status == 400
    assert chat_prompt_ids(ByteTokenizer(), [{"role": "user", "content": "Hi"}]) == list(
        b"user: Hi\nassistant:"
    )
