"""vLLM's KV-cache event stream on the wire: messages, publisher -> subscriber over real ZeroMQ
sockets on 127.0.0.1 (any free port), replay, bad input, recording."""

import time

import msgspec
import pytest
import zmq
from helpers import wait_until

from pagedlearn.errors import KVEventsError
from pagedlearn.kv_events.messages import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from pagedlearn.kv_events.publisher import KVEventPublisher
from pagedlearn.kv_events.recording import Recorder, read_recording
from pagedlearn.kv_events.subscriber import KVEventSubscriber

ANY = "tcp://127.0.0.1:*"  # bound on a free port
enc = msgspec.msgpack.encode


def stored(h=101, parent=None, tokens=(1, 2, 3, 4)):
    return BlockStored([h], parent, list(tokens), len(tokens), None, "GPU", None, group_idx=0)


def batch(*events, rank=0):
    return KVEventBatch(1.5, list(events), rank)


# --- messages ----------------------------------------------------------------------------------
def test_round_trip_and_the_wire_shape_of_vllm_0_33():
    b = batch(stored(), BlockRemoved([7, b"\x01" * 32], "GPU", group_idx=1), AllBlocksCleared())
    payload = encode_batch(b)
    assert decode_batch(payload) == b
    raw = msgspec.msgpack.decode(payload)  # an array [ts, events, rank], events tagged maps
    assert raw[0] == 1.5 and raw[2] == 0
    assert raw[1][0]["type"] == "BlockStored" and raw[1][0]["medium"] == "GPU"
    assert "kv_cache_spec_sliding_window" not in raw[1][0]  # None optional fields: not written
    assert raw[1][2] == {"type": "AllBlocksCleared"}


def test_decodes_the_older_array_shape_and_a_map_batch():
    old = enc([2.0, [["BlockStored", [5, 6], 4, [1, 2, 3, 4], 2, None],  # (before medium)
                     ["BlockRemoved", [5], "GPU", 0, "a field from the future"],
                     ["AllBlocksCleared"]]])  # fmt: skip
    b = decode_batch(old)
    assert b.data_parallel_rank is None and b.ts == 2.0
    assert b.events[0] == BlockStored([5, 6], 4, [1, 2, 3, 4], 2, None, None, None)
    assert b.events[1] == BlockRemoved([5], "GPU", 0)
    assert b.events[2] == AllBlocksCleared()
    new = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
           "token_ids": [9], "block_size": 1, "medium": "CPU", "session_id": "ignored"}  # fmt: skip
    b = decode_batch(enc({"ts": 3, "events": [new], "data_parallel_rank": 2}))
    assert b.data_parallel_rank == 2 and b.events[0].medium == "CPU" and b.events[0].lora_id is None


@pytest.mark.parametrize(
    "payload, says",
    [
        (b"\xc1", "not valid msgpack"),
        (b"\x92\x01", "not valid msgpack"),  # truncated
        (enc([1.0, [{"type": "BlockMoved"}]]), "unknown event type 'BlockMoved'"),
        (enc([1.0, [["Nope"]]]), "unknown event type 'Nope'"),
        (enc([1.0, [{"type": "BlockRemoved", "block_hashes": [1.5], "medium": None}]]),
         "got `float` - at `$.block_hashes[0]`"),
        (enc([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                     "token_ids": ["a"], "block_size": 1}]]), "at `$.token_ids[0]`"),
        (enc([1.0, [{"type": "BlockRemoved"}]]), "missing required field `block_hashes`"),
        (enc([True, []]), "ts is a number"),
        (enc([1.0, [], "rank"]), "data_parallel_rank is an int"),
        (enc({"events": []}), "a batch is [ts, events, rank?]"),
        (enc([1.0, [[]]]), "an event is a map or an array"),
        (enc([1.0, [AllBlocksCleared()] * 100_001]), "over the cap of 100,000"),
        (enc([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                     "token_ids": [0] * ((1 << 20) + 1), "block_size": 1}]]), "token_ids is over"),
        (b"\x90" * (16 * 1024 * 1024 + 1), "over the cap"),
        (b"\x91" * 100_000, "not valid msgpack"),  # nested too deep
    ],
)  # fmt: skip
def test_bad_payloads_say_what_is_wrong(payload, says):
    with pytest.raises(KVEventsError) as e:
        decode_batch(payload)
    assert says in str(e.value)


# --- publisher -> subscriber -----------------------------------------------------------------
@pytest.fixture
def pub():
    with KVEventPublisher(ANY, ANY, buffer_steps=1000) as p:
        yield p


def test_live_stream_in_order_with_status(pub):
    with KVEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:
        assert not sub.bound  # a concrete address: connected to
        wait_until(lambda: sub.status()["state"].startswith("waiting"), "the thread")
        for i in range(20):
            pub.publish(batch(stored(h=i)))
        wait_until(lambda: sub.status()["last_seq"] == 19, "20 batches")
        got = [sub.get(timeout=5) for _ in range(20)]
        assert [s for s, _ in got] == list(range(20))
        assert [b.events[0].block_hashes for _, b in got] == [[i] for i in range(20)]
        st = sub.status()
        assert st["decoded"] == 20 and st["malformed"] == st["dropped"] == st["missed"] == 0
        assert st["state"].startswith("live") and st["last_message_time"] is not None
    assert sub.status()["state"] == "closed"
    sub.close()  # idempotent
    assert pub.status()["published"] == 20 and pub.status()["dropped"] == 0


def test_a_late_subscriber_catches_up_from_the_replay_buffer(pub):
    for i in range(5):
        pub.publish(batch(stored(h=i)))
    wait_until(lambda: pub.status()["published"] == 5, "publishing")
    with KVEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:  # catch_up: from 0
        wait_until(lambda: sub.status()["last_seq"] == 4, "the replay")
        assert [s for s, _ in sub.poll()] == [0, 1, 2, 3, 4]
        assert sub.status()["replayed"] == 5
        pub.publish(batch(AllBlocksCleared()))  # and then live
        assert sub.get(timeout=10)[0] == 5
        assert sub.status()["missed"] == 0 and pub.status()["replay_requests"] >= 1


def test_what_the_replay_buffer_no_longer_holds_is_reported_as_lost():
    with KVEventPublisher(ANY, ANY, buffer_steps=3) as pub:
        for i in range(6):
            pub.publish(batch(stored(h=i)))
        wait_until(lambda: pub.status()["published"] == 6, "publishing")
        with KVEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:
            wait_until(lambda: sub.status()["last_seq"] == 5, "the replay")
            st = sub.status()
            assert [s for s, _ in sub.poll()] == [3, 4, 5]
            assert st["missed"] == 3 and st["replayed"] == 3
            assert "batches 0..2 lost (not in the replay buffer)" in st["problems"]


@pytest.fixture
def raw_pub():
    """A bare PUB socket: a publisher that says whatever the test wants."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    sock.bind(ANY)
    yield sock
    sock.close(linger=0)
    ctx.term()


def _sync(raw_pub, sub):
    """Send seq 0 until it arrives (the subscription takes a moment to reach the PUB)."""
    good = encode_batch(batch(AllBlocksCleared()))
    while sub.status()["received"] == 0:
        raw_pub.send_multipart([b"", (0).to_bytes(8, "big"), good])
        time.sleep(0.01)
    return good


def test_a_gap_in_the_live_stream_is_filled_from_the_replay_socket(raw_pub):
    """A publisher that skips seq 1..4 (as a full ZeroMQ queue would drop them); its replay
    socket (answered here, by hand) still holds 3 and 4: 1 and 2 are reported lost."""
    ctx = raw_pub.context
    router = ctx.socket(zmq.ROUTER)
    router.bind(ANY)
    try:
        endpoint = raw_pub.getsockopt_string(zmq.LAST_ENDPOINT)
        replay_at = router.getsockopt_string(zmq.LAST_ENDPOINT)
        sub = KVEventSubscriber(endpoint, replay_at, catch_up=False, replay_timeout=20)
        with sub:
            good = _sync(raw_pub, sub)
            raw_pub.send_multipart([b"", (5).to_bytes(8, "big"), good])
            assert router.poll(20_000), "no replay request"
            who, empty, first = router.recv_multipart()  # vLLM's request: [id, b"", seq]
            assert empty == b"" and int.from_bytes(first, "big") == 1
            for seq in (3, 4):
                router.send_multipart([who, b"", seq.to_bytes(8, "big"), good])
            router.send_multipart([who, b"", b"\xff" * 8, b""])  # the end marker
            wait_until(lambda: sub.status()["last_seq"] == 5, "seq 5")
            st = sub.status()
            assert [s for s, _ in sub.poll()] == [0, 3, 4, 5]
            assert (st["gaps"], st["missed"], st["replayed"]) == (1, 2, 2)
            assert "batches 1..2 lost (not in the replay buffer)" in st["problems"]
    finally:
        router.close(linger=0)


def test_bad_messages_gaps_and_disorder_are_counted_and_the_stream_goes_on(raw_pub):
    endpoint = raw_pub.getsockopt_string(zmq.LAST_ENDPOINT)
    with KVEventSubscriber(endpoint, keep_errors=50) as sub:
        good = _sync(raw_pub, sub)
        wait_until(lambda: sub.status()["decoded"] == 1, "seq 0")
        base = sub.status()
        send = raw_pub.send_multipart
        send([b"", (1).to_bytes(8, "big"), b"\xc1"])  # not msgpack
        send([b"", (2).to_bytes(8, "big"), enc([1.0, [{"type": "Bogus"}]])])  # unknown type
        send([b"", (3).to_bytes(4, "big"), good])  # a 4-byte seq: seq 3 is lost
        send([b"", good])  # two frames
        send([b"", (4).to_bytes(8, "big"), good])  # a gap: 3
        send([b"", (9).to_bytes(8, "big"), good])  # a gap: 5..8, no replay endpoint
        send([b"", (9).to_bytes(8, "big"), good])  # a duplicate
        send([b"", (7).to_bytes(8, "big"), good])  # out of order
        send([b"", (10).to_bytes(8, "big"), good])
        send([b"", (0).to_bytes(8, "big"), good])  # seq 0 again: a copy, out of order
        send([b"", (0).to_bytes(8, "big"), encode_batch(batch())])  # a restarted publisher
        wait_until(lambda: sub.status()["received"] - base["received"] == 11, "11 messages")
        st = sub.status()
        keys = ("malformed", "duplicates", "out_of_order", "gaps", "missed", "decoded", "restarts")
        delta = {k: st[k] - base[k] for k in keys}
        assert delta == {"malformed": 4, "duplicates": 1, "out_of_order": 2, "gaps": 2,
                         "missed": 5, "decoded": 4, "restarts": 1}  # fmt: skip
        assert [s for s, _ in sub.poll()] == [0, 4, 9, 10, 0] and st["last_seq"] == 0
        text = "\n".join(st["problems"])
        lost = ("batches 3..3 lost", "batches 5..8 lost (no replay endpoint)")
        for says in (
            "not valid msgpack",
            "unknown event type 'Bogus'",
            "3 frames",
            *lost,
            "restarted",
        ):
            assert says in text


def test_a_publisher_that_vanishes_shows_in_the_status():
    with KVEventPublisher(ANY) as pub, KVEventSubscriber(pub.endpoint, silence_timeout=0.3) as sub:
        while sub.status()["received"] == 0:  # (slow joiner)
            pub.publish(batch(AllBlocksCleared()))
            time.sleep(0.02)
        pub.close()
        wait_until(lambda: sub.status()["state"].startswith("no batch for"), "silence")
        assert "idle, or gone" in sub.status()["state"]


def test_a_flood_is_bounded_and_counted(pub):
    n, room = 3000, 50
    with KVEventSubscriber(pub.endpoint, pub.replay_endpoint, max_queue=room) as sub:
        wait_until(lambda: sub.status()["state"].startswith("waiting"), "the thread")
        for i in range(n):  # nobody reads: the queue fills, then batches are dropped
            while not pub.publish(batch(stored(h=i))):  # (the publisher's own queue: never
                time.sleep(0.001)  # blocks the caller; a full one says False)
        wait_until(lambda: sub.status()["last_seq"] == n - 1, "the last batch")
        st = sub.status()
        assert st["queued"] == room and st["dropped"] == st["decoded"] - room
        assert st["decoded"] + st["missed"] == n and st["malformed"] == 0
        seqs = [s for s, _ in sub.poll()]
        assert seqs == sorted(seqs) and len(seqs) == room and sub.status()["queued"] == 0


def test_the_publisher_never_blocks_its_caller_and_counts_what_it_drops():
    with KVEventPublisher(ANY, max_queue=1) as pub:
        pub._stop.set()  # (the socket thread stops taking from the queue)
        pub._thread.join(5)
        results = [pub.publish(batch(AllBlocksCleared())) for _ in range(5)]
        assert results.count(False) == pub.status()["dropped"] >= 4
    with pytest.raises(KVEventsError, match="closed"):
        pub.publish(batch())
    pub.close()  # idempotent


def test_bad_arguments_and_ports_in_use():
    with pytest.raises(KVEventsError, match="buffer_steps"):
        KVEventPublisher(ANY, buffer_steps=0)
    with pytest.raises(KVEventsError, match="hash_format"):
        KVEventPublisher(ANY, hash_format="hex")
    with KVEventPublisher(ANY) as pub, pytest.raises(KVEventsError, match="cannot open"):
        KVEventPublisher(pub.endpoint, bind=True)
    with pytest.raises(KVEventsError, match="max_queue"):
        KVEventSubscriber("tcp://127.0.0.1:5557", max_queue=-1)


# --- recording ---------------------------------------------------------------------------------
def test_a_recorded_stream_reads_back_as_the_same_batches(pub, tmp_path):
    path = tmp_path / "run.jsonl"
    with KVEventSubscriber(pub.endpoint, pub.replay_endpoint, record=path) as sub:
        sent = [batch(stored(h=i)) for i in range(4)] + [batch(AllBlocksCleared())]
        for b in sent:
            pub.publish(b)
        wait_until(lambda: sub.status()["last_seq"] == 4, "5 batches")
        live = sub.poll()
    rec = read_recording(path)
    assert rec.header["endpoint"] == pub.endpoint and len(rec) == 5
    assert list(rec.batches()) == live and [b for _, b in live] == sent
    assert all(t > 0 for _, t, _ in rec.timed()) and rec.errors == []


def test_a_malformed_batch_stays_in_the_recording_and_is_skipped_on_reading(tmp_path):
    path = tmp_path / "r.jsonl"
    with Recorder(path) as r:
        r.write(0, b"\xc1")
        r.write(3, encode_batch(batch(AllBlocksCleared())))
    rec = read_recording(path)
    assert [s for s, _ in rec.batches()] == [3] and "not valid msgpack" in rec.errors[0]


@pytest.mark.parametrize(
    "lines, says",
    [
        (["hello"], "line 1: not JSON"),
        (['{"format": "other"}'], "not a pagedlearn KV-event recording"),
        (['{"format": "pagedlearn-kv-events", "version": 9}'], "version 9"),
        (["H", '{"seq": -1, "t": 1, "payload": ""}'], "line 2: seq is -1"),
        (["H", '{"seq": 1, "t": 1, "payload": ""}', '{"seq": 1, "t": 1, "payload": ""}'],
         "line 3: seq 1 after 1"),
        (["H", '{"seq": 1, "t": "now", "payload": ""}'], "t is 'now'"),
        (["H", '{"seq": 1, "t": 1, "payload": "@@"}'], "not base64"),
        (["H", "[1]"], "line 2: a JSON object, not list"),
    ],
)  # fmt: skip
def test_a_bad_recording_says_which_line(tmp_path, lines, says):
    header = '{"format": "pagedlearn-kv-events", "version": 1}'
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(header if x == "H" else x for x in lines) + "\n")
    with pytest.raises(KVEventsError) as e:
        read_recording(path)
    assert says in str(e.value)
    with pytest.raises(KVEventsError, match="over the cap"):
        read_recording(path, max_file_bytes=1)
    with pytest.raises(KVEventsError, match="cannot read"):
        read_recording(tmp_path / "missing.jsonl")


# --- the extra ---------------------------------------------------------------------------------
def test_importing_the_package_needs_no_zmq_and_a_missing_extra_says_how_to_install(monkeypatch):
    import subprocess
    import sys

    code = "import sys, pagedlearn.kv_events; assert 'zmq' not in sys.modules, 'zmq imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
    monkeypatch.setitem(sys.modules, "zmq", None)  # as if pyzmq were not installed
    hint = 'pip install -e ".[kv-events]"'
    with pytest.raises(
        KVEventsError, match="'zmq'.*" + hint.replace("[", r"\[").replace(".", r"\.")
    ):
        KVEventPublisher(ANY)
    with pytest.raises(KVEventsError, match="kv-events"):
        KVEventSubscriber("tcp://127.0.0.1:5557")
    from pagedlearn.serve import serve

    with pytest.raises(KVEventsError, match="kv-events"):  # before a model is loaded
        serve("no-such-model", port=0, kv_events_endpoint=ANY)
