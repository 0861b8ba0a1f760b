"""``python -m pagedlearn kv-events`` (cli/kv_events.py): a recording read back with no server, a
live stream from pagedlearn's own publisher (recorded on the way), and bad options."""

import sys
import time

import pytest

pytest.importorskip("msgspec")
pytest.importorskip("zmq")

from pagedlearn.__main__ import main
from pagedlearn.kv_events.block_hashes import VLLMHasher
from pagedlearn.kv_events.messages import BlockRemoved, BlockStored, KVEventBatch, encode_batch
from pagedlearn.kv_events.recording import Recorder

PNG = b"\x89PNG"
HASHER = VLLMHasher(2, "sha256_cbor", python_hash_seed="0")  # as a vLLM server would hash
PROMPT_A, PROMPT_B = [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8]


def vllm_like_batches():
    """Two prompts sharing two blocks, hashed as vLLM with sha256_cbor and PYTHONHASHSEED=0."""
    a, b = HASHER(PROMPT_A), HASHER(PROMPT_B)
    return [
        KVEventBatch(1.0, [BlockStored(a, None, PROMPT_A, 2, None, "GPU", None)], 0),
        KVEventBatch(2.0, [BlockStored(b[2:], b[1], PROMPT_B[4:], 2, None, "GPU", None)], 0),
        KVEventBatch(3.0, [BlockRemoved([12345], "GPU")], 0),  # never stored: counted
    ]


@pytest.fixture
def recording(tmp_path):
    path = tmp_path / "run.kvev.jsonl"
    with Recorder(path, endpoint="tcp://vllm:5557") as rec:
        for seq, batch in enumerate(vllm_like_batches()):
            rec.write(seq, encode_batch(batch), t=100.0 + seq)
        rec.write(4, b"\xc1", t=104.0)  # not msgpack; and seq 3 is missing
    return path


def test_a_recording_is_summarized_drawn_and_matched_against_a_new_prompt(
    recording, tmp_path, capsys
):
    tree, timeline = tmp_path / "tree.png", tmp_path / "timeline.png"
    argv = ["kv-events", "--from", str(recording), "--png", str(tree), "--timeline-png",
            str(timeline), "--tokens", "1,2,3,4,7,9,0", "--hash-algo", "sha256_cbor",
            "--python-hash-seed", "0"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "4 batches from tcp://vllm:5557, 1 malformed, 1 missing from the sequence" in out
    assert "batch 4: payload is not valid msgpack" in out
    assert "cached now: 4 blocks (8 tokens)  GPU: 4" in out
    assert "2 x    2 blocks" in out and "[1 2 3 4]" in out  # the shared prefix, its start
    assert "problems: unknown_removed 1" in out
    assert "PYTHONHASHSEED" in out  # what the stream cannot say is said
    assert "cached now: 2 by tokens, 2 by hash (vLLM sha256_cbor" in out
    assert "-> 2 blocks (4 tokens) reusable, 3 to compute" in out
    assert tree.read_bytes()[:4] == PNG and timeline.read_bytes()[:4] == PNG


def test_a_wrong_seed_matches_by_tokens_but_not_by_hash(recording, capsys):
    argv = ["kv-events", "--from", str(recording), "--tokens", "1 2 3 4 5",
            "--hash-algo", "sha256_cbor", "--python-hash-seed", "1"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "2 by tokens, 0 by hash" in out and "root seed or the extra keys" in out


def test_a_live_stream_is_followed_recorded_and_read_back(tmp_path, capsys):
    from pagedlearn.kv_events.publisher import KVEventPublisher

    rec = tmp_path / "live.kvev.jsonl"
    with KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
        for batch in vllm_like_batches():
            pub.publish(batch)  # nobody listens yet: the replay socket keeps them
        deadline = time.monotonic() + 10
        while pub.status()["published"] < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        argv = ["kv-events", "--endpoint", pub.endpoint, "--replay-endpoint",
                pub.replay_endpoint, "--duration", "1.5", "--interval", "0.5",
                "--record", str(rec)]  # fmt: skip
        assert main(argv) == 0
    live = capsys.readouterr().out
    assert f"following {pub.endpoint} (connected)" in live
    assert "replayed 3" in live and "cached now: 4 blocks" in live
    assert main(["kv-events", "--from", str(rec)]) == 0
    again = capsys.readouterr().out
    assert "3 batches" in again and "cached now: 4 blocks (8 tokens)" in again


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "give --endpoint ENDPOINT (a live stream) or --from RECORDING"),
        (["--endpoint", "tcp://h:1", "--from", "x"], "one of them"),
        (["--from", "{rec}", "--record", "out"], "argument --record: only with --endpoint"),
        (["--from", "{rec}", "--duration", "0"], "argument --duration: must be seconds > 0"),
        (["--from", "nowhere.jsonl"], "argument --from: nowhere.jsonl is not a file"),
        (["--from", "{rec}", "--tokens", "1,x"], "argument --tokens: token ids are integers"),
        (["--from", "{rec}", "--tokens", "1", "--hash-algo", "sha256"], "PYTHONHASHSEED set"),
        (["--from", "{rec}", "--hash-algo", "pagedlearn"], "only with --tokens or --prompt"),
        (["--from", "{rec}", "--prompt", "hi"], "argument --prompt: needs --tokenizer"),
        (["--from", "{rec}", "--png", "{dir}"], "is a directory; give a file name"),
    ],
)
def test_bad_options_end_with_one_line_and_exit_2(argv, message, recording, capsys):
    argv = [a.format(rec=recording, dir=recording.parent) for a in argv]
    with pytest.raises(SystemExit) as exit_:
        main(["kv-events", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("error:") == 1


def test_a_missing_extra_and_a_bad_recording_say_so_in_one_line(
    recording, tmp_path, monkeypatch, capsys
):
    not_one = tmp_path / "notes.txt"
    not_one.write_text("hello\n")
    assert main(["kv-events", "--from", str(not_one)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("kv-events stopped:") and "line 1: not JSON" in err
    monkeypatch.setitem(sys.modules, "zmq", None)  # as if pyzmq were not installed
    assert main(["kv-events", "--endpoint", "tcp://127.0.0.1:5557"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and 'pip install -e ".[kv-events]"' in err
