"""What the transformers integration reads (every mask form), what it refuses (with a
named error), how it decodes past what the transformers cache holds, and its packaging."""
from __future__ import annotations

import gc
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.masking_utils import (AttentionMaskInterface, chunked_causal_mask_function,  # noqa: E402
                                        eager_mask, flash_attention_mask, sdpa_mask,
                                        sliding_window_causal_mask_function)

from laminae.integrations import _hf_cores  # noqa: E402
from laminae.integrations._hf_masks import keep_mask_from_hf  # noqa: E402
from laminae.integrations.transformers import convert  # noqa: E402
from laminae.primitives import BackendUnavailableError, ConfigError, DTypeError, ShapeError, set_backend  # noqa: E402

from ._tiny_hf import (DEVICE, gqa_twin, greedy, run_gqa, run_hf_attention, tiny_config, tiny_model,  # noqa: E402
                       token_ids)

PADDING = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [1, 1, 1, 0, 1]], dtype=torch.bool)


# ----------------------------------------------------------------------------
# Mask forms
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["sdpa", "eager", "flash"])
@pytest.mark.parametrize("q_len", [5, 1])
def test_every_mask_form_reads_as_the_padding_keep_mask(form, q_len):
    sizes = dict(batch_size=3, q_length=q_len, kv_length=5, q_offset=5 - q_len, attention_mask=PADDING)
    make = {"sdpa": sdpa_mask, "eager": eager_mask, "flash": flash_attention_mask}[form]
    mask = make(**sizes, allow_is_causal_skip=False)
    assert torch.equal(keep_mask_from_hf(mask, 3, q_len, 5, torch.device("cpu")), PADDING)
    # without padding: plain causal, whatever the form (None included)
    plain = make(**{**sizes, "attention_mask": torch.ones(3, 5, dtype=torch.bool)})
    assert keep_mask_from_hf(plain, 3, q_len, 5, torch.device("cpu")) is None


@pytest.mark.parametrize("form", ["eager", "flash"])
def test_a_model_runs_the_same_whatever_mask_form_it_is_handed(form):
    model = tiny_model("llama", "derf", layers=1).eval()
    ids, padding = token_ids(3, 5), PADDING.long().to(DEVICE)
    with torch.no_grad():
        expected = model(ids, attention_mask=padding).logits
        AttentionMaskInterface.register("laminae_derf", eager_mask if form == "eager" else flash_attention_mask)
        try:
            got = model(ids, attention_mask=padding).logits
        finally:
            AttentionMaskInterface.register("laminae_derf", sdpa_mask)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_mask_patterns_a_keep_mask_cannot_express_are_refused():
    cpu = torch.device("cpu")
    window = sdpa_mask(batch_size=3, q_length=5, kv_length=5, mask_function=sliding_window_causal_mask_function(2),
                       attention_mask=PADDING, allow_is_causal_skip=False)
    with pytest.raises(ConfigError, match="sliding window"):
        keep_mask_from_hf(window, 3, 5, 5, cpu)
    chunked = sdpa_mask(batch_size=3, q_length=5, kv_length=5, attention_mask=PADDING, allow_is_causal_skip=False,
                        mask_function=chunked_causal_mask_function(2, torch.zeros(3, dtype=torch.long)))
    with pytest.raises(ConfigError, match="chunked"):
        keep_mask_from_hf(chunked, 3, 5, 5, cpu)
    with pytest.raises(ConfigError, match="later key"):
        keep_mask_from_hf(torch.ones(3, 1, 5, 5, dtype=torch.bool), 3, 5, 5, cpu)
    per_head = sdpa_mask(batch_size=3, q_length=5, kv_length=5, attention_mask=PADDING,
                         allow_is_causal_skip=False).repeat(1, 2, 1, 1)
    per_head[0, 1, 4, 0] = False
    with pytest.raises(ConfigError, match="between heads"):
        keep_mask_from_hf(per_head, 3, 5, 5, cpu)
    bias = torch.zeros(3, 1, 5, 5)
    bias[..., 0] = -1.5    # an ALiBi-like bias, not a mask
    with pytest.raises(ConfigError, match="bias"):
        keep_mask_from_hf(bias, 3, 5, 5, cpu)
    with pytest.raises(ConfigError, match="StaticCache"):
        keep_mask_from_hf(None, 3, 2, 5, cpu)
    with pytest.raises(DTypeError):
        keep_mask_from_hf(torch.zeros(3, 5), 3, 5, 5, cpu)
    with pytest.raises(ShapeError):
        keep_mask_from_hf(torch.ones(3, 1, 5, 4, dtype=torch.bool), 3, 5, 5, cpu)


def test_packed_sequences_and_static_caches_are_refused():
    model = tiny_model("llama", "derf", layers=1).eval()
    ids = token_ids(1, 6)
    with pytest.raises(ConfigError, match="packed"):
        model(ids, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]], device=DEVICE), use_cache=False)
    with pytest.raises(ConfigError, match="StaticCache"):
        model.generate(ids, max_new_tokens=2, do_sample=False, cache_implementation="static")


# ----------------------------------------------------------------------------
# Refusals at convert and at the call
# ----------------------------------------------------------------------------


def test_convert_refuses_what_the_cores_cannot_honour():
    mistral = transformers.MistralConfig(**{**tiny_config("llama").to_dict(), "sliding_window": 4})
    with pytest.raises(ConfigError, match="sliding_window"):
        convert(transformers.MistralForCausalLM(mistral), "derf")
    config = tiny_config("llama")
    config.attention_dropout = 0.1
    with pytest.raises(ConfigError, match="dropout"):
        convert(transformers.LlamaForCausalLM(config), "derf")
    model = transformers.LlamaForCausalLM(tiny_config("llama"))
    with pytest.raises(ConfigError, match="core"):
        convert(model, "flash")
    with pytest.raises(ConfigError, match="unknown option"):
        convert(model, "elo", context_gate=True)
    with pytest.raises(ConfigError, match="gate_init_bias"):
        convert(model, "derf", gate_init_bias=1.0)
    with pytest.raises(TypeError):
        convert(torch.nn.Linear(2, 2), "derf")
    model.model.layers[1].self_attn.v_proj = torch.nn.Linear(32, 12, bias=False)
    with pytest.raises(ShapeError, match="head dim"):
        convert(model, "derf")
    assert not any(".laminae_" in n for n, _ in model.named_parameters())   # a refusal changes nothing
    converted = tiny_model("llama", "derf", layers=1)
    with pytest.raises(ConfigError, match="already converted"):
        convert(converted, "elo")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64))
    with pytest.raises(ConfigError, match="no attention module"):   # one fused c_attn projection
        convert(gpt2, "derf")


def test_calls_the_cores_cannot_honour_are_refused():
    model = tiny_model("llama", "derf", layers=1).eval()
    ids = token_ids(1, 4)
    with pytest.raises(ConfigError, match="output_attentions"):
        model(ids, output_attentions=True)
    lengths = torch.tensor([0, 2, 4], dtype=torch.int32, device=DEVICE)
    for name, value, what in (("cu_seq_lens_q", lengths, "packed"), ("cu_seq_lens_k", lengths, "packed"),
                              ("softcap", 30.0, "soft-capping"), ("s_aux", torch.zeros(4), "sinks"),
                              ("sliding_window", 2, "sliding window"), ("is_causal", False, "non-causal")):
        with pytest.raises(ConfigError, match=what):
            model(ids, **{name: value})
    model.set_attn_implementation("laminae_elo")
    with pytest.raises(ConfigError, match="converted to 'derf'"):
        model(ids)


def test_an_unsupported_transformers_version_is_one_clear_error(monkeypatch):
    model = transformers.LlamaForCausalLM(tiny_config("llama"))
    for version in ("4.57.1", "5.23.0", "6.0.0"):
        monkeypatch.setattr(transformers, "__version__", version)
        with pytest.raises(BackendUnavailableError, match=f"transformers {version} is installed"):
            convert(model, "derf")


# ----------------------------------------------------------------------------
# Options that change the math, and the backend switch
# ----------------------------------------------------------------------------


def test_a_module_scaling_other_than_one_over_root_d_is_honoured():
    model = tiny_model("llama", "derf", layers=1).eval()
    attn = model.model.layers[0].self_attn
    gqa = gqa_twin(attn, model.config, "derf", "reference")
    attn.scaling = 0.2
    with torch.no_grad():
        gqa.q_proj.weight.mul_(0.2 * attn.head_dim ** 0.5)   # RoPE is linear: scaling q before it is the same
    x, positions = torch.randn(1, 4, 32, device=DEVICE), torch.arange(4, device=DEVICE)[None]
    with torch.no_grad():
        torch.testing.assert_close(run_hf_attention(model, attn, x, positions, None),
                                   run_gqa(gqa, x, positions, None), rtol=1e-5, atol=1e-6)


def test_backend_is_the_cores_own_and_set_backend_reaches_it():
    model = tiny_model("llama", "affine", backend="reference")
    cores = [layer.self_attn.laminae_core for layer in model.model.layers]
    assert {c.backend for c in cores} == {"reference"}
    set_backend(model, "triton")
    assert {c.backend for c in cores} == {"triton"}


def test_core_parameters_take_the_model_dtype_and_device():
    model = transformers.LlamaForCausalLM(tiny_config("llama")).to(device=DEVICE, dtype=torch.bfloat16)
    convert(model, "affine")
    core = model.model.layers[0].self_attn.laminae_core
    assert core.alpha_proj.weight.dtype == torch.bfloat16 and core.alpha_proj.weight.device.type == DEVICE.type
    assert core.alpha_ma.dtype == torch.float32   # the running mean stays fp32
    with torch.no_grad():
        assert torch.isfinite(model(token_ids(1, 4)).logits).all()


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_other_families_decode_like_full_forwards(family):
    shared = tiny_config("llama").to_dict()
    config = (transformers.MistralConfig(**{**shared, "sliding_window": None}) if family == "mistral"
              else transformers.Qwen2Config(**shared))
    cls = transformers.MistralForCausalLM if family == "mistral" else transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    model = convert(cls(config).to(DEVICE), "elo").eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.laminae_core.elo_gain.fill_(1.0)
    ids = token_ids(2, 5, seed=6)
    out = model.generate(ids, max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True)
    tokens, logits = greedy(model, ids, torch.ones_like(ids), 3)
    assert torch.equal(out.sequences, tokens)
    assert max((a - b).abs().max().item() for a, b in zip(out.logits, logits)) <= 1e-5


# ----------------------------------------------------------------------------
# Decoding state beyond the transformers cache
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("core", ["derf", "affine", "xsa", "lucid"])
def test_beam_search_reorders_the_cache_and_stateless_or_rebuilt_cores_follow(core):
    model = tiny_model("llama", core).eval()
    ids = token_ids(1, 4, seed=5)
    kw = dict(max_new_tokens=4, do_sample=False, num_beams=3, num_return_sequences=3)
    cached = model.generate(ids, **kw)
    assert torch.equal(cached, model.generate(ids, use_cache=False, **kw))


def test_elo_refuses_a_cache_whose_ratings_it_did_not_compute():
    model = tiny_model("llama", "elo").eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.laminae_core.elo_gain.fill_(1.0)
    ids = token_ids(1, 4, seed=5)
    with pytest.raises(ConfigError, match="reordered"):
        model.generate(ids, max_new_tokens=4, do_sample=False, num_beams=3)


def test_side_caches_live_as_long_as_the_transformers_cache():
    model = tiny_model("llama", "elo").eval()
    model.generate(token_ids(1, 4), max_new_tokens=2, do_sample=False)
    gc.collect()
    assert len(_hf_cores._SIDE) == 0


# ----------------------------------------------------------------------------
# Packaging
# ----------------------------------------------------------------------------


def test_the_extra_pins_the_supported_range_and_it_is_installed():
    from importlib.metadata import requires

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    from laminae.integrations.transformers import SUPPORTED_TRANSFORMERS

    extra = [Requirement(r) for r in requires("laminae") if r.startswith("transformers")]
    assert [r.specifier for r in extra] == [SpecifierSet(SUPPORTED_TRANSFORMERS)]
    assert SpecifierSet(SUPPORTED_TRANSFORMERS).contains(transformers.__version__)


def test_importing_laminae_never_imports_transformers():
    code = ("import sys, laminae, laminae.primitives, laminae.triton_ops, laminae.recipes, laminae.integrations; "
            "assert 'transformers' not in sys.modules, 'imported transformers'")
    subprocess.run([sys.executable, "-c", code], check=True)
