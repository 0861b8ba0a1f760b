"""pagedlearn's engine publishing its prefix cache in vLLM's format, followed by the subscriber
over real ZeroMQ sockets: what the stream says equals what the manager holds."""

import time

import pytest
from helpers import wait_until

from pagedlearn import LLM, SamplingParams
from pagedlearn.errors import KVEventsError
from pagedlearn.kv_events.block_hashes import to_external
from pagedlearn.kv_events.from_trace import cached_blocks
from pagedlearn.kv_events.messages import AllBlocksCleared, BlockRemoved, BlockStored
from pagedlearn.kv_events.publisher import publish_kv_events
from pagedlearn.kv_events.subscriber import KVEventSubscriber
from pagedlearn.trace.events import EventLog

ANY = "tcp://127.0.0.1:*"
BS = 4


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-gpt2", block_size=BS, num_blocks=8, enable_prefix_caching=True, verbose=False)


def drain(pub, sub) -> list:
    """Every batch the engine made so far, as the subscriber got them."""
    wait_until(lambda: pub.status()["published"] == pub.status()["accepted"], "sending")
    n = pub.status()["published"]
    wait_until(lambda: sub.status()["last_seq"] == n - 1, f"batch {n - 1}")
    return [b for _, b in sub.poll()]


def follow(batches, cache: dict) -> None:
    """The cache the events describe: wire hash -> (parent wire hash, tokens)."""
    for b in batches:
        for e in b.events:
            if isinstance(e, BlockStored):
                parent = e.parent_block_hash
                for i, h in enumerate(e.block_hashes):
                    cache[h] = (parent, tuple(e.token_ids[i * BS : (i + 1) * BS]))
                    parent = h
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    del cache[h]  # (KeyError: removed a block never stored)
            elif isinstance(e, AllBlocksCleared):
                cache.clear()


def test_the_stream_follows_the_managers_prefix_cache_block_by_block(llm):
    kv = llm.engine.kv
    llm.reset_prefix_cache()
    prefix = list(range(100, 108))  # two shared blocks
    prompts = [[*prefix, 1, 2, 3, 4, 5], [*prefix, 6, 7, 8, 9, 10], [*prefix, 11, 12]]
    params = SamplingParams(max_tokens=4, temperature=0)
    log = EventLog(kv.trace)  # the manager's own record, to compare with
    pub = publish_kv_events(llm, ANY, ANY)
    with pub, KVEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:
        cache: dict = {}
        llm.generate(prompts[:1], params, use_tqdm=False)
        first = drain(pub, sub)
        follow(first, cache)
        assert cache == cached_blocks(kv)
        stored = [e for b in first for e in b.events if isinstance(e, BlockStored)]
        assert stored[0].parent_block_hash is None and stored[0].block_size == BS
        assert stored[0].token_ids[: 3 * BS] == prompts[0][: 3 * BS]  # the prompt's full blocks
        assert len(stored[0].block_hashes) >= 3  # one event for the prompt's chain
        assert (stored[0].medium, stored[0].group_idx) == ("GPU", 0)
        assert stored[0].kv_cache_spec_kind == "full_attention"
        shared = stored[0].block_hashes[1]  # the hash of the prefix's second block
        seen = len(log.events)

        llm.generate(prompts[1:], params, use_tqdm=False)  # shares 2 blocks
        llm.generate([list(range(30, 55))], params, use_tqdm=False)  # 8 blocks: evicts all
        more = drain(pub, sub)
        follow(more, cache)
        assert cache == cached_blocks(kv)
        later = [e for b in more for e in b.events if isinstance(e, BlockStored)]
        assert any(e.parent_block_hash == shared for e in later)  # chained on the shared prefix
        removals = [e for b in more for e in b.events if isinstance(e, BlockRemoved)]
        removed = [h for e in removals for h in e.block_hashes]
        evicted = [e.info["hash"] for e in log.events[seen:] if e.kind == "evict"]
        assert removed and removed == [to_external(bytes.fromhex(h)) for h in evicted]

        llm.reset_prefix_cache()
        cleared = drain(pub, sub)
        assert cleared[-1].events == [AllBlocksCleared()] and cache_after(cleared, cache) == {}
        st = sub.status()
        assert st["malformed"] == st["missed"] == st["dropped"] == 0
    assert kv.trace.listening  # (the log)
    log.close()
    assert not kv.trace.listening  # closing the publisher unsubscribed it


def cache_after(batches, cache):
    follow(batches, cache)
    return cache


def test_bytes_hashes_are_the_whole_digest(llm):
    llm.reset_prefix_cache()
    pub = publish_kv_events(llm, ANY, hash_format="bytes")
    with pub, KVEventSubscriber(pub.endpoint) as sub:
        while sub.status()["received"] == 0:  # (the PUB drops what it sends before we join)
            llm.generate([list(range(200, 209))], SamplingParams(max_tokens=1), use_tqdm=False)
            llm.reset_prefix_cache()
            time.sleep(0.01)
        wait_until(lambda: sub.status()["queued"] > 0, "a batch")
        events = [e for _, b in sub.poll() for e in b.events if isinstance(e, BlockStored)]
        hashes = {h for e in events for h in e.block_hashes}
        assert hashes and all(isinstance(h, bytes) and len(h) == 32 for h in hashes)


def test_publish_kv_events_says_what_it_needs():
    with pytest.raises(KVEventsError, match="needs an LLM or LLMEngine"):
        publish_kv_events(object(), ANY)


def test_a_hybrid_models_groups_go_out_as_group_idx_with_their_kind():
    from pagedlearn.kv_events.from_trace import TraceToEvents

    llm = LLM("tiny-gemma3", block_size=BS, num_blocks=40, verbose=False)
    kv, batches = llm.engine.kv, []
    assert [g.sliding_window for g in kv.groups] == [None, 24]  # full first, then the window
    unsubscribe = kv.trace.subscribe(TraceToEvents(BS, batches.append, groups=kv.groups))
    llm.generate([list(range(100, 130))], SamplingParams(max_tokens=1), use_tqdm=False)
    unsubscribe()
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    kinds = {(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in stored}
    assert kinds == {(0, "full_attention", None), (1, "sliding_window", 24)}
    by_group = {g: [h for e in stored if e.group_idx == g for h in e.block_hashes] for g in (0, 1)}
    assert len(by_group[0]) == len(by_group[1]) == 30 // BS  # each group caches its own blocks
    assert not set(by_group[0]) & set(by_group[1])  # the group's name is in the hash
