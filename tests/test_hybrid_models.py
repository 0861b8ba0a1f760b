"""Models with sliding-window layers: the offline tiny-mistral / tiny-gemma3, reading each layer's
window from a config (layer_windows), refusing what the paged attention does not compute
(check_supported), and real models' configs on the meta device. All offline."""

import copy
import time

import pytest
import torch
from transformers import (
    Cohere2Config,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    GPT2Config,
    GptOssConfig,
    Llama4TextConfig,
    MistralConfig,
    MixtralConfig,
    OPTConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3NextConfig,
    SiglipVisionConfig,
)

from pagedlearn import PagedLearnError
from pagedlearn.models import ByteTokenizer, ModelLoadError, load
from pagedlearn.models.layer_windows import check_supported, layer_windows
from pagedlearn.models.reference_configs import meta_model, reference_configs
from pagedlearn.models.runner import kv_cache_spec

HYBRID = ["tiny-mistral", "tiny-gemma3"]
WINDOWS = {"tiny-mistral": [24, 24], "tiny-gemma3": [24, None, 24, None]}


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def without_window(model):
    """The same weights with a window longer than any sequence here: full attention."""
    config = copy.deepcopy(model.config)
    config.sliding_window = 10**6
    other = type(model)(config).eval()
    other.load_state_dict(model.state_dict())
    return other


def greedy(model, prompt, n, **kw):
    x = torch.tensor([prompt])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                         min_new_tokens=n, **kw)  # fmt: skip
    return out


# ---- the offline models ----


@pytest.mark.parametrize("name", HYBRID)
def test_hybrid_tiny_models_load_offline_with_the_shape_they_promise(name):
    load(name)
    start = time.perf_counter()
    lm = load(name)
    assert time.perf_counter() - start < 1.0
    model, c = lm.model, lm.model.config
    assert isinstance(lm.tokenizer, ByteTokenizer) and lm.name == name and not model.training
    assert model.dtype == torch.float32 and not any(p.requires_grad for p in model.parameters())
    assert (c.vocab_size, c.bos_token_id, c.eos_token_id, c.pad_token_id) == (258, 256, 256, 257)
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        64,
        4,
        2,
        16,
    )
    assert (c.sliding_window, c.max_position_embeddings) == (24, 8192)
    assert c.pagedlearn_tokenizer == "byte" and c.initializer_range == 0.2
    kind = {"tiny-mistral": ("mistral", "MistralForCausalLM", 2),
            "tiny-gemma3": ("gemma3_text", "Gemma3ForCausalLM", 4)}[name]  # fmt: skip
    assert (c.model_type, type(model).__name__, c.num_hidden_layers) == kind
    assert kv_cache_spec(model).num_layers == c.num_hidden_layers


@pytest.mark.parametrize("name", HYBRID)
def test_hybrid_tiny_models_are_the_same_bits_every_time_and_leave_the_global_rng_alone(name):
    torch.manual_seed(5)
    state = torch.get_rng_state()
    a = load(name).model
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(6)
    assert same_weights(a, load(name).model)


@pytest.mark.parametrize("name", HYBRID)
def test_layer_windows_of_the_tiny_models_are_what_transformers_runs(name):
    model = load(name).model
    assert layer_windows(model.config) == WINDOWS[name]
    attn = [layer.self_attn for layer in model.model.layers]
    if name == "tiny-gemma3":  # each layer keeps the window it passes to the attention function
        assert [a.sliding_window for a in attn] == WINDOWS[name]
        # Gemma scales by query_pre_attn_scalar**-0.5, not head_dim**-0.5: the engine must use
        # the `scaling` transformers passes.
        assert {a.scaling for a in attn} == {0.5} and 16**-0.5 == 0.25
    else:  # Mistral passes config.sliding_window in every layer
        assert {a.scaling for a in attn} == {0.25}


def test_tiny_mistral_sees_exactly_the_window_rule_p_minus_w_exclusive():
    # With 2 sliding layers of W = 24, the last position p reads layer-1 outputs at p-23 .. p,
    # which read tokens p-46 .. p. So token p-46 changes the last logits and token p-47 cannot.
    # An off-by-one window ([p - W, p]) would let p-47 and p-48 in.
    model = load("tiny-mistral").model
    ids = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(3))
    p = ids.shape[1] - 1

    def last_logits(pos_to_change=None):
        x = ids.clone()
        if pos_to_change is not None:
            x[0, pos_to_change] = (x[0, pos_to_change] + 1) % 256
        with torch.no_grad():
            return model(x).logits[0, -1]

    base = last_logits()
    assert not torch.allclose(base, last_logits(p - 46), atol=1e-4)
    for outside in (p - 47, p - 48, 0):
        assert torch.allclose(base, last_logits(outside), atol=1e-6)


@pytest.mark.parametrize("name", HYBRID)
def test_greedy_generate_on_a_prompt_longer_than_the_window(name):
    # What the engine is compared against: transformers' generate() with its own (sliding) cache
    # must give the tokens a full recomputation gives, and the window must change them.
    model = load(name).model
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    out = greedy(model, prompt, 40)[0].tolist()
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(40):
            logits = model(torch.tensor([seq])).logits[0, -1]
            logits[256] = -float("inf")  # min_new_tokens keeps eos out of generate()'s choice
            seq.append(int(logits.argmax()))
    assert out == seq and len(out) == 80 > 24
    assert greedy(without_window(model), prompt, 40)[0].tolist() != out


@pytest.mark.parametrize(("name", "random_median", "generated_median"),
                         [("tiny-mistral", 0.38, 0.39), ("tiny-gemma3", 0.32, 0.38)])  # fmt: skip
def test_hybrid_tiny_models_have_the_logit_gaps_tiny_config_reports(
    name, random_median, generated_median
):
    model = load(name).model
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    top2 = logits.topk(2, dim=-1).values
    assert logits.std() > 1.4
    assert (top2[..., 0] - top2[..., 1]).median() == pytest.approx(random_median, abs=0.01)
    # Along a greedy generation (shorter than the docstring's 4,096 tokens): the gaps against the
    # float noise between two of transformers' own attention implementations.
    prompt = torch.randint(0, 256, (50,), generator=torch.Generator().manual_seed(3)).tolist()
    seq = greedy(model, prompt, 300)
    raw = {}
    for impl in ("eager", "sdpa"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            raw[impl] = model(seq).logits[0, 49:-1]
    noise = (raw["eager"] - raw["sdpa"]).abs().max()
    top2 = raw["sdpa"].topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    assert abs(gaps.median() - generated_median) < 0.1
    assert noise < 1e-4 and gaps.min() > 10 * noise


def test_hybrid_tiny_models_round_trip_through_a_folder(tmp_path):
    for name in HYBRID:
        original = load(name).model
        original.save_pretrained(tmp_path / name)
        lm = load(str(tmp_path / name))
        assert isinstance(lm.tokenizer, ByteTokenizer) and same_weights(original, lm.model)
        assert layer_windows(lm.model.config) == WINDOWS[name]


# ---- layer_windows and check_supported on every family ----


def test_layer_windows_per_family():
    def small(cls, **kw):
        return cls(num_hidden_layers=kw.pop("num_hidden_layers", 4), **kw)

    assert layer_windows(GPT2Config(n_layer=3)) == [None] * 3
    assert layer_windows(small(OPTConfig)) == [None] * 4
    # Mistral: one window for every layer, or none; layer_types do not change that.
    assert layer_windows(small(MistralConfig)) == [4096] * 4
    assert layer_windows(small(MistralConfig, sliding_window=None)) == [None] * 4
    alternating = ["sliding_attention", "full_attention"] * 2
    assert layer_windows(small(MistralConfig, layer_types=alternating)) == [4096] * 4
    assert layer_windows(small(MixtralConfig, sliding_window=64)) == [64] * 4
    # Qwen2 / Qwen3: full unless use_sliding_window; then the layers from max_window_layers on.
    for cls in (Qwen2Config, Qwen3Config):
        assert layer_windows(small(cls)) == [None] * 4
        on = small(cls, use_sliding_window=True, sliding_window=32, max_window_layers=1)
        assert layer_windows(on) == [None, 32, 32, 32]
    # Qwen2-MoE: even layers below max_window_layers.
    moe = small(Qwen2MoeConfig, use_sliding_window=True, sliding_window=32, max_window_layers=3)
    assert layer_windows(moe) == [32, None, 32, None]
    # Gemma 2 alternates (with its softcapping off), Gemma 3 five to one, Cohere2 three to one.
    assert layer_windows(small(Gemma2Config, attn_logit_softcapping=None, sliding_window=8)) == [
        8, None, 8, None
    ]  # fmt: skip
    gemma3 = layer_windows(Gemma3TextConfig(num_hidden_layers=12, sliding_window=512))
    assert gemma3 == ([512] * 5 + [None]) * 2
    assert (
        layer_windows(small(Cohere2Config, num_hidden_layers=8, sliding_window=16))
        == ([16] * 3 + [None]) * 2
    )


@pytest.mark.parametrize(
    ("config", "words"),
    [
        (GptOssConfig(num_hidden_layers=2), ["'gpt_oss'", "attention sinks", "s_aux"]),
        (Gemma2Config(num_hidden_layers=2), ["'gemma2'", "attn_logit_softcapping=50.0"]),
        (Llama4TextConfig(num_hidden_layers=4), ["'llama4_text'", "'chunked_attention'"]),
        (Qwen3NextConfig(num_hidden_layers=4), ["'qwen3_next'", "'linear_attention'"]),
        (Gemma3TextConfig(use_bidirectional_attention=True), ["'gemma3_text'", "bidirectional"]),
    ],
    ids=["sinks", "softcap", "chunked", "linear", "bidirectional"],
)
def test_check_supported_refuses_what_the_paged_attention_does_not_compute(config, words):
    for call in (check_supported, layer_windows):
        with pytest.raises(PagedLearnError) as info:
            call(config)
        assert all(w in str(info.value) for w in words), str(info.value)


def test_layer_windows_refuses_a_config_that_contradicts_itself():
    no_window = Gemma3TextConfig(num_hidden_layers=2, layer_types=["sliding_attention"] * 2)
    no_window.sliding_window = None
    with pytest.raises(PagedLearnError, match="layer 0 is a sliding-window layer, but sliding_w"):
        layer_windows(no_window)
    short = Gemma3TextConfig(num_hidden_layers=2)
    short.layer_types = ["full_attention"]
    with pytest.raises(PagedLearnError, match="layer_types has 1 entries for 2 layers"):
        layer_windows(short)


def test_load_refuses_unsupported_and_multimodal_models_before_reading_weights(tmp_path):
    tiny = {"vocab_size": 258, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 16, "num_hidden_layers": 2}  # fmt: skip
    with pytest.raises(ModelLoadError, match="cannot run on pagedlearn's paged attention: model"):
        load(Gemma2ForCausalLM(Gemma2Config(**tiny)), tokenizer=ByteTokenizer())
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
    mm = Gemma3Config(text_config=Gemma3TextConfig(**tiny).to_dict(),
                      vision_config=vision.to_dict(), mm_tokens_per_image=4,
                      image_token_index=255, boi_token_index=253, eoi_token_index=254)  # fmt: skip
    model = Gemma3ForConditionalGeneration(mm)
    with pytest.raises(ModelLoadError, match=r"multimodal model .*'google/gemma-3-1b-it'"):
        load(model, tokenizer=ByteTokenizer())
    model.save_pretrained(tmp_path / "mm")
    with pytest.raises(ModelLoadError, match=r"model type 'gemma3'.* is a multimodal model"):
        load(str(tmp_path / "mm"), tokenizer=ByteTokenizer())


# ---- real models' configs, on the meta device ----


def test_reference_configs_build_on_the_meta_device_quickly():
    start = time.perf_counter()
    configs = reference_configs()
    models = {name: meta_model(c) for name, c in configs.items()}
    assert time.perf_counter() - start < 5.0
    specs = {name: kv_cache_spec(m) for name, m in models.items()}
    shapes = {name: (s.num_layers, s.num_kv_heads, s.head_dim) for name, s in specs.items()}
    assert shapes == {
        "gpt2": (12, 12, 64),
        "mistralai/Mistral-7B-v0.1": (32, 8, 128),
        "google/gemma-3-1b-it": (26, 1, 256),
        "google/gemma-3-4b-it": (34, 4, 256),
    }
    for name, m in models.items():
        assert m.device.type == "meta" and m.dtype == specs[name].dtype == torch.bfloat16
        assert all(p.is_meta for p in m.parameters())
    params = {n: sum(p.numel() for p in m.parameters()) for n, m in models.items()}
    assert params["gpt2"] == 124_439_808  # GPT-2 small, 124M
    assert params["google/gemma-3-1b-it"] == 999_885_952  # as keras-hub publishes it
    assert round(params["mistralai/Mistral-7B-v0.1"] / 1e9, 2) == 7.24  # "7B"

    windows = {name: layer_windows(c) for name, c in configs.items()}
    assert windows["gpt2"] == [None] * 12
    assert windows["mistralai/Mistral-7B-v0.1"] == [4096] * 32
    for name, w, n in (("google/gemma-3-1b-it", 512, 26), ("google/gemma-3-4b-it", 1024, 34)):
        assert windows[name] == [None if (i + 1) % 6 == 0 else w for i in range(n)]


def test_layer_kinds_set_on_the_instance_only_are_read_and_refused():
    """Falcon-H1, Nemotron-H and RecurrentGemma set layer_types in __init__ only: their
    'hybrid', 'linear_attention', 'moe' layers must be refused, not read as full attention
    (found in review: they generated other tokens than transformers, silently)."""
    import transformers

    for name in ("FalconH1Config", "NemotronHConfig", "RecurrentGemmaConfig"):
        with pytest.raises(PagedLearnError, match="pagedlearn's paged attention implements only"):
            layer_windows(getattr(transformers, name)())


def test_a_stray_sliding_window_in_a_config_that_does_not_declare_it_changes_nothing():
    from transformers import LlamaConfig

    # Llama's attention passes no window and masks causally: a stray key must not slide.
    assert layer_windows(LlamaConfig(num_hidden_layers=2, sliding_window=8)) == [None, None]


def test_a_model_without_attention_heads_is_refused_by_name():
    import transformers

    from pagedlearn import LLM
    from pagedlearn.models import ByteTokenizer, load

    config = transformers.RwkvConfig(vocab_size=258, hidden_size=32, num_hidden_layers=2,
                                     attention_hidden_size=32, intermediate_size=64)  # fmt: skip
    model = load(transformers.RwkvForCausalLM(config), tokenizer=ByteTokenizer())
    with pytest.raises(PagedLearnError, match="pagedlearn pages the keys and values"):
        LLM(model, num_blocks=8, block_size=4, verbose=False)
