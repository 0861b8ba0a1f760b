"""The engine's parts one by one: KV tensors, sizing, the HF attention plug-in, the sampler, the
planning of a running request's next tokens."""

from __future__ import annotations

import pytest
import torch
from engine_cases import PROMPTS, assert_pool_clean, greedy, make_llm

from pagedlearn import SamplingParams
from pagedlearn.attention.kv_cache import KVCache, KVCacheSpec
from pagedlearn.core.kv_cache_manager import KVCacheManager
from pagedlearn.engine.queue_changes import queue_changes
from pagedlearn.engine.request import Request, RequestMetrics
from pagedlearn.engine.sampler import Sampler
from pagedlearn.engine.scheduler_output import SchedulerOutput
from pagedlearn.errors import PagedLearnError
from pagedlearn.models import load
from pagedlearn.models.runner import kv_cache_spec, max_model_len


def test_bytes_per_token_is_the_papers_formula():
    # GPT-2 small in fp16: 4 * L * H * D = 4 * 12 * 768 = 36,864 bytes per token.
    spec = KVCacheSpec(num_layers=12, num_kv_heads=12, head_dim=64, dtype=torch.float16)
    assert spec.bytes_per_token == 4 * 12 * 768 == 36_864
    assert "36,864 B per token" in spec.formula()
    assert spec.num_blocks_for(36_864 * 16 * 10 + 5, block_size=16) == 10


def test_kv_spec_and_length_come_from_the_config():
    gpt2, opt = load("tiny-gpt2").model, load("tiny-opt").model
    assert kv_cache_spec(gpt2) == KVCacheSpec(2, 4, 16, torch.float32)
    assert kv_cache_spec(opt) == KVCacheSpec(2, 4, 16, torch.float32)
    assert max_model_len(gpt2) == max_model_len(opt) == 512


def test_kv_cache_copies_and_swaps_every_layer():
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32)
    cache = KVCache(spec, num_blocks=4, block_size=2, num_cpu_blocks=2)
    cache.slab[:, :, 1] = torch.arange(2 * 3 * 2 * 2 * 4, dtype=torch.float32).view(2, 3, 2, 2, 4)
    block1 = cache.slab[:, :, 1].clone()
    cache.copy_blocks([(1, 3)])
    assert torch.equal(cache.slab[:, :, 3], block1)
    cache.swap_out([(1, 0)])
    cache.slab[:, :, 1] = 0
    cache.swap_in([(0, 2)])
    assert torch.equal(cache.slab[:, :, 2], block1) and not cache.slab[:, :, 1].any()
    with pytest.raises(PagedLearnError, match="no CPU swap pool"):
        KVCache(spec, 4, 2).swap_out([(0, 0)])


def test_kv_cache_memory_sizes_the_pool():
    llm = make_llm(num_blocks=None, kv_cache_memory=1024 * 4 * 100 + 7)  # 1,024 B per token
    assert llm.engine.kv.allocator.num_blocks == 100
    with pytest.raises(PagedLearnError, match="num_blocks"):
        make_llm(num_blocks=None, kv_cache_memory=100)


def test_attention_without_metadata_says_how_to_run_it():
    llm = make_llm()
    with pytest.raises(PagedLearnError, match="paged_metadata"):
        llm.engine.model(torch.tensor([[1, 2, 3]], device=llm.device))


def test_auto_backend_is_the_reference_on_a_cpu():
    assert make_llm(device="cpu").attention_backend == "torch"


def test_sampler_top_k_top_p_and_seed():
    logprobs = torch.log_softmax(torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0]), dim=-1)
    s = Sampler()
    gen = torch.Generator().manual_seed(0)
    top1 = SamplingParams(temperature=1.0, top_k=1)
    assert {t for t, _ in s.sample(logprobs, top1, 50, gen)} == {0}
    top_p = SamplingParams(temperature=1.0, top_p=0.7)  # p(0) = 0.64 < 0.7: tokens 0 and 1
    assert {t for t, _ in s.sample(logprobs, top_p, 200, gen)} == {0, 1}
    a = s.sample(logprobs, SamplingParams(temperature=1.0), 20, torch.Generator().manual_seed(3))
    b = s.sample(logprobs, SamplingParams(temperature=1.0), 20, torch.Generator().manual_seed(3))
    assert a == b
    ((tok, lp),) = s.sample(logprobs, SamplingParams(), 1)
    assert tok == 0 and lp == pytest.approx(float(logprobs[0]))


def test_outputs_carry_metrics_text_and_logprobs():
    llm = make_llm()
    out = llm.generate("Hi there", greedy(5), use_tqdm=False)[0]
    c = out.outputs[0]
    assert out.prompt == "Hi there" and out.prompt_token_ids == list(b"Hi there")
    assert len(c.token_ids) == 5 and c.cumulative_logprob < 0
    assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
    m = out.metrics
    assert 0 < m.ttft <= m.e2e and m.mean_itl > 0 and len(m.token_times) == 5
    assert_pool_clean(llm)


def test_the_packed_batch_tells_transformers_it_holds_no_padding(monkeypatch):
    # A random model samples its pad id (257) like any other; without an attention mask GPT-2 then
    # warns "We strongly recommend passing in an attention_mask" (loadtest and serve showed it).
    from transformers import PreTrainedModel

    pad = load("tiny-gpt2").model.config.pad_token_id  # what transformers' guess looks for
    assert pad == 257
    masks = []

    def spy(self, input_ids, attention_mask):
        masks.append((input_ids[0, [0, -1]].tolist(), attention_mask))

    monkeypatch.setattr(PreTrainedModel, "warn_if_padding_and_no_attention_mask", spy)
    llm = make_llm()
    llm.generate({"prompt_token_ids": [pad, 72, 105, pad]}, greedy(3), use_tqdm=False)
    assert masks and masks[0][0] == [pad, pad]  # the prefill: the pad id first and last
    assert all(m is not None and bool(m.all()) for _, m in masks)


def test_stats_after_each_step_add_up():
    llm = make_llm(num_blocks=20)
    seen = []
    llm.engine.subscribe_stats(seen.append)
    llm.generate(PROMPTS, greedy(10), use_tqdm=False)
    for s in seen:
        assert s.used_blocks + s.free_blocks == s.num_blocks == 20
        assert s.bookkeeping_time >= 0 and s.forward_time <= s.step_time
        assert s.num_prefill_seqs + s.num_decode_seqs <= s.num_batched_tokens
    assert seen[-1].num_finished == 4 and [s.step for s in seen] == list(range(1, len(seen) + 1))


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_queue_changes_read_the_policy_back_from_a_recording(mode):
    # A pool too small for all four: "b" (three samples) is preempted as one group and comes back
    # before the later arrivals "c" and "d" are admitted.
    llm = make_llm(num_blocks=16, preemption_mode=mode)
    engine = llm.engine
    log = engine.record()
    arrival = ["a", "b", "c", "d"]
    engine.add_request("a", PROMPTS[1], greedy(12))
    engine.add_request("b", PROMPTS[0], SamplingParams(n=3, max_tokens=12, ignore_eos=True, seed=0))
    engine.add_request("c", PROMPTS[3], greedy(12))
    engine.add_request("d", PROMPTS[2], greedy(12))
    while engine.has_unfinished_requests():
        engine.step()
    changes = queue_changes(log)
    frames = [e.info for e in log.events if e.kind == "step"]
    assert (
        [c.step for c in changes] == [f["step"] for f in frames] == list(range(1, len(frames) + 1))
    )
    for c, f in zip(changes, frames, strict=True):
        assert (len(c.running), len(c.swapped), len(c.waiting)) == (
            f["stats"]["num_running"],
            f["stats"]["num_swapped"],
            f["stats"]["num_waiting"],
        )
        assert not (c.admitted and c.swapped), "admitted while a request was swapped out"
        for p in c.preempted:  # the youngest go first
            assert all(arrival.index(p) > arrival.index(r) for r in c.running)
    first_admitted = list(dict.fromkeys(r for c in changes for r in c.admitted))
    assert first_admitted == arrival  # first come, first served
    preempted = [r for c in changes for r in c.preempted]
    assert "b" in preempted
    back = [r for c in changes for r in (c.swapped_in if mode == "swap" else c.admitted)]
    assert back.count("b") == (preempted.count("b") + (mode == "recompute"))
    b_back = max(c.step for c in changes if "b" in c.swapped_in + c.admitted)
    assert b_back <= min(c.step for c in changes if "c" in c.admitted)  # earlier arrival first
    groups = [e.seqs for e in log.events if e.kind == "preempt" and e.seqs[0].startswith("b.")]
    assert groups and all(set(g) == {"b.0", "b.1", "b.2"} for g in groups)  # all or nothing
    assert sorted(r for c in changes for r in c.finished) == arrival


# --- Sampler.greedy: numpy, against its torch reference -------------------------------------------
@pytest.mark.parametrize("rows", [0, 1, 7, 64])
def test_greedy_matches_the_torch_reference(rows):
    g = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, 50, generator=g)
    logits[:, 10] = logits[:, 3] = 10.0  # above any randn: a tie, the lowest id wins
    logits[:, 20:30] = float("-inf")
    if rows > 1:
        logits[1] = 0.0  # a row of equal values: id 0
    logprobs = Sampler().logprobs(logits)
    best_lp, best_tok = logprobs.max(dim=-1)  # torch: (S,), (S,); ties to the lowest id
    assert Sampler().greedy(logprobs) == list(zip(best_tok.tolist(), best_lp.tolist(), strict=True))
    assert all(tok == 3 for tok, _ in Sampler().greedy(logprobs)[2:])


# --- SchedulerOutput.add_next_tokens: the one planner of a running request's tokens ---------------
def _decoding_state(block_size: int):
    """A manager with requests in the middle of decoding: sequences at and off block boundaries,
    forks sharing a partly filled last block (copy-on-write), a request with kv_dropped marks,
    prefix caching on; each sequence holds one token more than the manager (the newest sample)."""
    kv = KVCacheManager(num_blocks=256, block_size=block_size, enable_prefix_caching=True)
    reqs = []
    for i, (n_prompt, n_forks) in enumerate([(3, 0), (4, 0), (8, 2), (5, 1), (1, 0), (7, 0)]):
        prompt = [(7 * i + j) % 250 + 1 for j in range(n_prompt)]
        req = Request(f"r{i}", None, prompt, SamplingParams(n=n_forks + 1), RequestMetrics(0.0), i)
        first = req.new_sequence(list(prompt))
        kv.add_sequence(first.seq_id, prompt)
        req.seqs = [first]
        for _ in range(n_forks):
            child = req.new_sequence(list(prompt))
            kv.fork(first.seq_id, child.seq_id)
            req.seqs.append(child)
        for k, seq in enumerate(req.seqs):
            seq.token_ids.append(200 + k)  # sampled last step, no KV yet
        reqs.append(req)
    reqs[5].kv_dropped = {reqs[5].seqs[0].seq_id: 9}  # re-admitted: its next token is recomputed
    return kv, reqs


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_add_next_tokens_plans_each_token_at_the_slot_the_manager_gives_it(block_size):
    """The planned slots (for one KV-cache group, those ``append_token`` returned) are the
    manager's ``slots`` of the new tokens, across block boundaries and copy-on-write; a decode
    is a chunk of one, a longer chunk plans its tokens the same way."""
    kv, reqs = _decoding_state(block_size)
    out = SchedulerOutput()
    for step in range(3):  # three steps: boundaries move, copies happen once
        planned = len(out.scheduled)
        for req in reqs:
            out.add_next_tokens(kv, req, chunk=3 if step == 2 else 1)
        for s in out.scheduled[planned:]:
            assert s.slots == kv.slot_mappings(s.seq.seq_id, s.start_pos)
            assert s.block_tables == kv.block_tables(s.seq.seq_id)
            assert s.start_pos + len(s.new_tokens) == kv.num_tokens(s.seq.seq_id)
            assert s.samples == (kv.num_tokens(s.seq.seq_id) == len(s.seq.token_ids))
        for req in reqs:
            for seq in req.seqs:
                seq.token_ids += [99] * (1 if step < 1 else 3)
    assert [r.request_id for r in out.touched] == [r.request_id for r in reqs] * 3
    assert out.recomputed_tokens == 2  # positions 7 and 8 are below the mark at 9
    assert reqs[5].kv_dropped == {}
    assert (kv.pop_copies() != []) == (block_size > 1)  # copy-on-write happened
    kv.check_invariants()
