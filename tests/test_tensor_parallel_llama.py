"""Tensor parallelism on the Llama architecture (pagedlearn/parallel/sharding.py, LLAMA_LIKE).

Grouped-query attention is what is new over GPT-2 and OPT: worker r holds KV heads r*K/N .. and
the query heads that read them. A tiny seeded Llama (and Qwen2, whose q/k/v have biases) with 6
query heads over 3 KV heads runs on 3 workers and gives the tokens of one process and of
transformers' own generate(); tiny-mistral runs on 2, past its sliding window. SmolLM2-135M
(9 query heads over 3 KV heads) is refused on 2 workers before anything starts, and on 3 gives
the tokens of one process (marked slow: three processes each unpickle the 540 MB model).
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from test_tensor_parallel import slab, tokens

from pagedlearn import LLM, PagedLearnError, SamplingParams
from pagedlearn.models import ByteTokenizer

# The tiny models' tests on the xdist worker of test_tensor_parallel.py: one fork server starts
# the workers of both. (A test's groups add up -- two make a third group, "smollm2_tensor_parallel"
# -- so each test names one, not the module.)
ON_THE_TP_WORKER = pytest.mark.xdist_group("tensor_parallel")

PROMPTS = ["Hello world, this is", "The paged attention kernel", "abc"]


def tiny(kind: str):
    """A 2-layer Llama (or Qwen2) with 6 query heads over 3 KV heads, seeded: the same weights
    on every call, the caller's RNG untouched."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[kind]
    config = config_cls(
        vocab_size=258, hidden_size=96, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=3, head_dim=16, intermediate_size=192, max_position_embeddings=512,
        initializer_range=0.2, bos_token_id=None, eos_token_id=256, pad_token_id=257,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return model_cls(config).eval()


def build(model, tp: int, **kw) -> LLM:
    kw = {"num_blocks": 40, "block_size": 4, "verbose": False, "device": "cpu", **kw}
    llm = LLM(model, tensor_parallel_size=tp, **kw)
    if tp > 1:
        llm.engine.runner.step_timeout = 60.0  # a hung worker fails a test, not the suite
    return llm


@ON_THE_TP_WORKER
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_gqa_on_three_workers_matches_one_process_and_transformers(kind):
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=3)
    one = build(tiny(kind), 1, tokenizer=ByteTokenizer())
    three = build(tiny(kind), 3, tokenizer=ByteTokenizer())
    try:
        described = three.collective_rpc("describe")
        assert [d["kv_heads"] for d in described] == [[0], [1], [2]]  # one KV head each
        outs = [llm.generate(PROMPTS, params, use_tqdm=False) for llm in (one, three)]
        assert tokens(outs[0]) == tokens(outs[1])
        for a, b in zip(*outs, strict=True):
            for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
                assert x.keys() == y.keys()
                assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
        torch.testing.assert_close(slab(three), slab(one), atol=1e-5, rtol=1e-5)
    finally:
        three.shutdown()
    ref = tiny(kind)
    for prompt, out in zip(PROMPTS, outs[1], strict=True):
        ids = torch.tensor([ByteTokenizer().encode(prompt)])
        want = ref.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=257)
        assert list(out.outputs[0].token_ids) == want[0, ids.shape[1] :].tolist()


@ON_THE_TP_WORKER
def test_tiny_mistral_on_two_workers_past_its_sliding_window():
    # 24-token window: a 20-token prompt and 20 new tokens reach past it on every layer.
    params = SamplingParams(max_tokens=20, temperature=0)
    prompts = ["a prompt of twenty tk", "Hello world, this is"]
    one, two = build("tiny-mistral", 1), build("tiny-mistral", 2)
    try:
        outs = [llm.generate(prompts, params, use_tqdm=False) for llm in (one, two)]
        assert tokens(outs[0]) == tokens(outs[1])
        assert all(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) > 24 for o in outs[1])
        torch.testing.assert_close(slab(two), slab(one), atol=1e-5, rtol=1e-5)
    finally:
        two.shutdown()


# --- SmolLM2-135M-Instruct: 30 layers, 9 query heads over 3 KV heads ---------------------------
# The conftest's session fixture `smollm2` (one load per test process); on its xdist group, so
# that the worker that already holds the model runs these.


@pytest.mark.xdist_group("smollm2")
def test_smollm2_on_two_workers_is_refused_before_anything_starts(smollm2, monkeypatch):
    from pagedlearn.engine.engine_args import EngineArgs

    def sized(*args):
        raise AssertionError("the KV cache was sized before the worker count was checked")

    monkeypatch.setattr(EngineArgs, "sizes", sized)
    before = set(multiprocessing.active_children())
    why = r"size=2 must divide the model's KV heads \(3; its 9 query heads share them, 3 per"
    with pytest.raises(PagedLearnError, match=rf"{why} KV head\).*try one of \[1, 3\]"):
        build(smollm2, 2)
    assert set(multiprocessing.active_children()) == before


@pytest.mark.slow  # 35-61 s on 2 shared cores: 3 workers each unpickle and cut the 540 MB model
@pytest.mark.xdist_group("smollm2")
def test_smollm2_on_three_workers_answers_as_one_process(smollm2):
    from pagedlearn.serve.chat import chat_prompt_ids

    question = [{"role": "user", "content": "What is the capital of France?"}]
    ids = chat_prompt_ids(smollm2.tokenizer, question)
    params = SamplingParams(max_tokens=8, temperature=0)
    one = build(smollm2, 1, block_size=16, num_blocks=16)
    three = build(smollm2, 3, block_size=16, num_blocks=16)  # each worker gets a copy, cuts it
    try:
        described = three.collective_rpc("describe")
        assert [d["kv_heads"] for d in described] == [[0], [1], [2]]
        outs = [llm.generate([ids], params, use_tqdm=False)[0].outputs[0] for llm in (one, three)]
    finally:
        three.shutdown()
    assert outs[0].token_ids == outs[1].token_ids
    assert "Paris" in outs[1].text
