"""``serve --kv-events-endpoint``: the server publishes its engine's KV-cache events."""

import json
import time
import urllib.request

import pytest

from pagedlearn.kv_events.messages import BlockStored
from pagedlearn.kv_events.subscriber import KVEventSubscriber

pytest.importorskip("fastapi")  # the [serve] extra (dev installs it)


def test_serve_publishes_kv_events_and_stops_them():
    from pagedlearn.serve import serve

    srv = serve(
        "tiny-gpt2", port=0, block_size=4, num_blocks=16, verbose=False,
        kv_events_endpoint="tcp://127.0.0.1:*", kv_events_replay_endpoint="tcp://127.0.0.1:*",
    )  # fmt: skip
    with srv:
        pub = srv.kv_events
        assert pub is not None and pub.endpoint.startswith("tcp://127.0.0.1:")
        with KVEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:
            body = {"model": srv.model_name, "prompt": [5, 6, 7, 8, 9, 10, 11, 12, 13],
                    "max_tokens": 2}  # fmt: skip
            request = urllib.request.Request(
                srv.base_url + "/completions", json.dumps(body).encode(),
                {"Content-Type": "application/json"},
            )  # fmt: skip
            with urllib.request.urlopen(request, timeout=30) as r:
                assert r.status == 200
            deadline = time.monotonic() + 20
            stored = []
            while not stored:  # (a late subscriber catches up from the replay socket)
                assert time.monotonic() < deadline, sub.status()
                stored = [e for _, b in sub.poll() for e in b.events if isinstance(e, BlockStored)]
                time.sleep(0.01)
            assert stored[0].token_ids[:8] == [5, 6, 7, 8, 9, 10, 11, 12]
    assert pub.status()["published"] >= 1 and pub._closed  # stop() closed it


def test_serve_help_documents_the_flags(capsys):
    from pagedlearn.__main__ import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--kv-events-endpoint", "--kv-events-replay-endpoint", "--kv-events-topic"):
        assert flag in out
    assert 'pip install -e ".[kv-events]"' in " ".join(out.split())


def test_a_bad_events_address_fails_before_a_model_is_loaded(monkeypatch):
    import pagedlearn.serve as serving
    from pagedlearn.errors import KVEventsError

    monkeypatch.setattr(serving, "_load", lambda *a: pytest.fail("the model was loaded"))
    with pytest.raises(KVEventsError, match=r"an endpoint looks like tcp://HOST:PORT"):
        serving.serve("tiny-gpt2", port=0, kv_events_endpoint="foo", verbose=False)
