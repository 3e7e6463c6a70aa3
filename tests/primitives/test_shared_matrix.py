import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from laminae.primitives import ConfigError, DeviceError, DTypeError, ShapeError
from laminae.primitives.shared_matrix import (MATRICES, ElasticTiers, Readout, SharedMatrix, extract_tier,
                                              save_subnetwork, shared_matrix_block, shared_matrix_reference,
                                              tier_parameter_count)

from .._fixtures import load_fixture
from ._elastic_model import ElasticDecoder, dense_logits

MODEL_KEYS = ("vocab_size", "num_hidden_layers", "max_position_embeddings", "rope_theta", "rope_precision",
              "rms_norm_eps")


def _split(out_features=12, in_features=10, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(out_features, in_features, generator=gen, dtype=dtype),
            torch.randn(out_features, in_features, generator=gen, dtype=dtype))


def _model_config(config):
    return {k: config[k] for k in MODEL_KEYS} | {"tokenizer": config.get("tokenizer", "EleutherAI/gpt-neox-20b")}


# ---------------------------------------------------------------- block rule (spec §3.1, invariant 1)

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_at_ratio_one_is_init_plus_delta_bitwise(dtype):
    init, delta = _split(dtype=dtype)
    assert torch.equal(shared_matrix_block(init, delta, 7, 5, 1.0), init[:7, :5] + delta[:7, :5])


def test_unsplit_block_is_the_plain_slice():
    w, _ = _split()
    assert torch.equal(shared_matrix_block(w, None, 3, 4), w[:3, :4])
    m = SharedMatrix(12, 10, split=False)
    with torch.no_grad():
        m.weight.copy_(w)
    assert torch.equal(m.block(3, 4), w[:3, :4])


def test_block_multipliers_and_bf16_roundings_match_the_seed_expression():
    init, delta = _split(dtype=torch.bfloat16)
    r = 7.0
    seed = r ** -0.5 * init[:9, :6] + r ** -1.0 * delta[:9, :6]   # the seed's expression, bf16 throughout
    assert torch.equal(shared_matrix_block(init, delta, 9, 6, r), seed)
    exact = (init.double() * r ** -0.5 + delta.double() / r)[:9, :6]
    assert (shared_matrix_block(init, delta, 9, 6, r).double() - exact).abs().max() < 3e-2


def test_readout_scale_and_output_divisor():
    init, delta = _split()
    x = torch.randn(3, 10)
    scale = torch.tensor([0.5])
    y = shared_matrix_reference(x, init, delta, scale, rows=12, cols=10, ratio=4.0, output_divisor=2.0)
    expected = F.linear(x, (0.5 * init + 0.25 * delta) * 0.5) / 2.0
    torch.testing.assert_close(y, expected)


def test_upcast_gives_the_fp32_truth_in_the_input_dtype():
    init, delta = _split(40, 30, dtype=torch.bfloat16)
    x = torch.randn(5, 30).bfloat16()
    args = dict(rows=40, cols=30, ratio=3.0, output_divisor=3.0)
    truth = shared_matrix_reference(x, init, delta, upcast=True, **args)
    fp32 = shared_matrix_reference(x.float(), init.float(), delta.float(), **args)
    assert truth.dtype == torch.bfloat16
    assert torch.equal(truth, fp32.bfloat16())
    same_dtype = shared_matrix_reference(x, init, delta, **args)
    assert (same_dtype.float() - fp32).abs().max() >= (truth.float() - fp32).abs().max()


# ---------------------------------------------------------------- gradients (spec §4, invariant 3, 4)

@pytest.mark.parametrize("variant", ["split", "unsplit", "scale+divisor", "mask"])
def test_gradcheck_reference_float64(variant):
    init, delta = (t.double() for t in _split(6, 5))
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    args = dict(rows=5, cols=4, ratio=3.0)
    init.requires_grad_(True)
    delta.requires_grad_(True)
    scale = torch.tensor([0.7], dtype=torch.float64, requires_grad=True)
    if variant == "unsplit":
        fn = lambda x, w: shared_matrix_reference(x, w, rows=5, cols=4)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (x, init))
        return
    if variant == "split":
        fn = lambda x, w, d: shared_matrix_reference(x, w, d, **args)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (x, init, delta))
        return
    if variant == "scale+divisor":
        fn = lambda x, w, d, s: shared_matrix_reference(x, w, d, s, output_divisor=1.5, **args)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (x, init, delta, scale))
        return
    keep = torch.tensor([[1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    fn = lambda x, w, d: shared_matrix_reference(x, w, d, attention_mask=keep, **args)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, init, delta))


def test_delta_gradient_is_zero_outside_the_block_and_b_times_g_inside():
    m = SharedMatrix(12, 10, base_fan_in=4)
    x = torch.randn(2, 5, 6)
    dy = torch.randn(2, 5, 7)
    m(x, rows=7, ratio=2.5).backward(dy)
    g = m.delta.grad
    assert torch.count_nonzero(g[7:]) == 0 and torch.count_nonzero(g[:, 6:]) == 0
    torch.testing.assert_close(g[:7, :6], dy.reshape(-1, 7).t() @ x.reshape(-1, 6) / 2.5)
    assert m.init.grad is None and not m.init.requires_grad


def test_trainable_init_gradient_is_sqrt_r_times_delta_gradient():
    m = SharedMatrix(12, 10, init_trainable=True, base_fan_in=4)
    m(torch.randn(4, 6), rows=7, ratio=2.5).sum().backward()
    torch.testing.assert_close(m.init.grad, 2.5 ** 0.5 * m.delta.grad)
    assert set(SharedMatrix(3, 2).state_dict()) == set(m.state_dict()) == {"init", "delta"}


def test_readout_logit_scale_gradient_matches_autograd_of_the_seed_expression():
    r = Readout(20, 8, split=True, num_scales=3, base_fan_in=2)
    with torch.no_grad():
        r.delta.normal_()
        r.logit_scale.copy_(torch.tensor([0.5, 1.5, 2.0]))
    h = torch.randn(2, 3, 6)
    logits = r(h, ratio=3.0, scale_index=1)
    assert logits.dtype == torch.float32 and logits.shape == (2, 3, 20)
    logits.square().sum().backward()
    alpha = r.logit_scale.detach()[1].clone().requires_grad_(True)
    w = (3.0 ** -0.5 * r.init[:, :6] + r.delta.detach()[:, :6] / 3.0)
    F.linear(h, w * alpha).square().sum().backward()
    torch.testing.assert_close(r.logit_scale.grad[1], alpha.grad)
    assert r.logit_scale.grad[0] == 0 and r.logit_scale.grad[2] == 0


def test_summed_two_tier_gradients_equal_the_single_tier_gradients():
    m = SharedMatrix(16, 16, base_fan_in=8)
    x = torch.randn(3, 16)
    grads = []
    for tiers in ([(8, 1.0)], [(16, 2.0)], [(8, 1.0), (16, 2.0)]):
        m.zero_grad()
        sum(m(x[:, :n], rows=n, ratio=r).square().sum() for n, r in tiers).backward()
        grads.append(m.delta.grad.clone())
    torch.testing.assert_close(grads[2], grads[0] + grads[1])


def test_padded_rows_read_as_zero_even_when_nan():
    init, delta = _split()
    x = torch.randn(2, 4, 10, requires_grad=True)
    keep = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])
    poisoned = x.detach().clone()
    poisoned[keep == 0] = float("nan")
    poisoned.requires_grad_(True)
    d = delta.clone().requires_grad_(True)
    y = shared_matrix_reference(poisoned, init, d, attention_mask=keep, rows=12, cols=10, ratio=2.0)
    assert torch.isfinite(y).all() and (y[keep == 0] == 0).all()
    y.sum().backward()
    assert torch.isfinite(d.grad).all() and (poisoned.grad[keep == 0] == 0).all()
    clean = shared_matrix_reference(x, init, delta, attention_mask=keep, rows=12, cols=10, ratio=2.0)
    torch.testing.assert_close(y[keep == 1], clean[keep == 1])


# ---------------------------------------------------------------- tier isolation (invariant 5)

def test_entries_outside_the_tier_never_change_its_logits():
    config, weights, inputs, _ = load_fixture("elastic_fully")
    model = ElasticDecoder(config)
    model.load_state_dict(weights, strict=True)
    ids = inputs["input_ids"]
    before = model(ids, "medium")
    n, h = model.tiers.width("medium"), model.tiers.intermediate_size("medium")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("init", "delta", "lm_head.weight")):
                rows = p.shape[0] if "lm_head" in name else (h if "mlp.gate" in name or "mlp.up" in name else n)
                cols = h if "down_proj" in name else n
                p[rows:].normal_()
                p[:, cols:].normal_()
            elif name == "embed_tokens.weight":
                p[:, n:].normal_()
            elif p.dim() == 1 and "logit_scale" not in name:
                p[n:].normal_()
            elif "logit_scale" in name:
                p[0] = 9.0
    assert torch.equal(model(ids, "medium"), before)


# ---------------------------------------------------------------- seed parity (fixtures of seed 003)

@pytest.mark.parametrize("fixture", ["elastic_fully", "elastic_matformer"])
def test_seed_checkpoint_reproduces_seed_logits_loss_and_gradients(fixture):
    config, weights, inputs, expected = load_fixture(fixture)
    model = ElasticDecoder(config)
    model.load_state_dict(weights, strict=True)
    for tier in model.tiers.tiers:
        logits = model(inputs["input_ids"], tier)
        loss = F.cross_entropy(logits.flatten(0, 1), inputs["labels"].flatten(), ignore_index=-100)
        torch.testing.assert_close(logits, expected[f"logits.{tier}"], atol=1e-4, rtol=0)
        torch.testing.assert_close(loss.reshape(-1), expected[f"loss.{tier}"].reshape(-1), atol=1e-4, rtol=0)
        if f"grad.{tier}.embed_tokens.weight" not in expected:
            continue
        model.zero_grad()
        loss.backward()
        names = {k.split(".", 2)[2] for k in expected if k.startswith(f"grad.{tier}.")}
        got = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
        assert names <= set(got)
        for k in names:
            torch.testing.assert_close(got[k], expected[f"grad.{tier}.{k}"], atol=1e-4, rtol=1e-3, msg=k)


def test_readout_and_shared_matrix_load_the_seed_state_dicts_strictly():
    config, weights, _, _ = load_fixture("elastic_fully")
    tiers = ElasticTiers.from_seed_config(config)
    readout = tiers.shared_matrix("lm_head", vocab_size=config["vocab_size"])
    readout.load_state_dict({k[len("lm_head."):]: v for k, v in weights.items() if k.startswith("lm_head.")})
    q = tiers.shared_matrix("attn.q_proj")
    q.load_state_dict({k.rsplit(".", 1)[1]: v for k, v in weights.items() if k.startswith("layers.0.attn.q_proj.")})
    assert set(readout.state_dict()) == {"init", "delta", "logit_scale"}
    config, weights, _, _ = load_fixture("elastic_matformer")
    tiers = ElasticTiers.from_seed_config(config)
    readout = tiers.shared_matrix("lm_head", vocab_size=config["vocab_size"])
    readout.load_state_dict({k[len("lm_head."):]: v for k, v in weights.items() if k.startswith("lm_head.")})
    assert set(readout.state_dict()) == {"weight", "logit_scale"}
    with pytest.raises(RuntimeError, match="Missing key"):  # split layout differing from split_matrices
        SharedMatrix(64, 64, split=True).load_state_dict({"weight": torch.zeros(64, 64)})


# ---------------------------------------------------------------- extract / save_subnetwork (spec §6, invariant 6)

@pytest.mark.parametrize("fixture", ["elastic_fully", "elastic_matformer"])
def test_extracted_tier_loads_into_a_dense_decoder_with_the_same_logits(fixture, tmp_path):
    config, weights, inputs, _ = load_fixture(fixture)
    model = ElasticDecoder(config)
    model.load_state_dict(weights, strict=True)
    tiers = model.tiers
    for tier in tiers.tiers:
        state = extract_tier(model, tiers, tier)
        n, h = tiers.width(tier), tiers.intermediate_size(tier)
        assert list(state)[:4] == ["embed_tokens.weight", "layers.0.attn_norm.weight",
                                   "layers.0.attn.q_proj.weight", "layers.0.attn.k_proj.weight"]
        assert list(state)[-2:] == ["norm.weight", "lm_head.weight"]
        assert state["layers.1.mlp.down_proj.weight"].shape == (n, h)
        assert state["lm_head.weight"].shape == (config["vocab_size"], n)
        assert all(t.is_contiguous() and not t.requires_grad for t in state.values())
        count = tier_parameter_count(tiers, tier, vocab_size=config["vocab_size"],
                                     num_layers=config["num_hidden_layers"])
        assert sum(t.numel() for t in state.values()) == count
        save_subnetwork(model, tiers, tier, tmp_path / tier, _model_config(config))
        dense_config = json.loads((tmp_path / tier / "config.json").read_text())
        assert dense_config["hidden_size"] == n and dense_config["num_attention_heads"] == n // tiers.head_dim
        assert dense_config["torch_dtype"] == "float32"
        loaded = load_file(str(tmp_path / tier / "model.safetensors"))
        assert set(loaded) == set(state)
        dense = dense_logits(loaded, dense_config, inputs["input_ids"])
        torch.testing.assert_close(dense, model(inputs["input_ids"], tier), atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- tier rules (spec §2.3, invariants 7, 9)

def test_tier_rules_fully_elastic_and_matformer():
    t = ElasticTiers()
    assert t.resolve(None) == "max" and t.fan_in_ratio("attn.q_proj", None) == 10.0
    assert t.width("low") == 384 and t.intermediate_size("low") == 1536 and t.num_heads("low") == 6
    assert t.block_shape("mlp.down_proj", "high") == (512, 2048) and t.logit_scale_index("extra") == 3
    m = ElasticTiers(variant="matformer", hidden_size=64, head_dim=16, base_width=None, mlp_base_width=32,
                     widths=(1, 2, 4), tiers=("low", "medium", "max"), mlp_output_divisor=0.5,
                     split_matrices=MATRICES[:-1])
    assert [m.fan_in_ratio(k, "medium") for k in MATRICES] == [1.0] * 7 + [2.0, 1.0]
    assert m.width("low") == 64 and m.num_logit_scales == 1 and m.logit_scale_index("max") == 0
    assert m.output_divisor("mlp.down_proj") == 0.5 and m.output_divisor("attn.o_proj") == 1.0


@pytest.mark.parametrize("kwargs, match", [
    (dict(variant="dense"), "variant"),
    (dict(widths=(6, 6, 8, 9, 10)), "strictly increasing"),
    (dict(widths=(0, 7, 8, 9, 10)), "strictly increasing"),
    (dict(tiers=("a", "b")), "tiers"),
    (dict(split_matrices=MATRICES + ("attn.x_proj",)), "unknown"),
    (dict(split_matrices=MATRICES[:-1]), "every matrix split"),
    (dict(base_width=None), "base_width"),
    (dict(base_width=32), "base_width"),
    (dict(head_dim=48), "whole heads"),
    (dict(variant="matformer", split_matrices=MATRICES[:-2]), "mlp.down_proj split"),
    (dict(variant="matformer", split_matrices=MATRICES), "lm_head whole"),
    (dict(variant="matformer", split_matrices=MATRICES[:-1], head_dim=48), "divide"),
    (dict(mlp_output_divisor=0.0), "mlp_output_divisor"),
])
def test_tier_config_validation(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ElasticTiers(**kwargs)


def test_unknown_tier_and_matrix_raise():
    with pytest.raises(ConfigError, match="unknown tier 'huge'.*low"):
        ElasticTiers().width("huge")
    with pytest.raises(ConfigError, match="unknown matrix"):
        ElasticTiers().fan_in_ratio("mlp.w1", "low")


# ---------------------------------------------------------------- modules, init, autocast

def test_from_scratch_init_follows_the_base_fan_in():
    torch.manual_seed(0)
    m = SharedMatrix(512, 640, base_fan_in=64)
    assert torch.count_nonzero(m.delta) == 0
    assert abs(float(m.init.std()) - 64 ** -0.5) < 0.01
    assert torch.count_nonzero(SharedMatrix(4, 4).init) == 0  # seed: zeros, weights are loaded
    assert abs(float(SharedMatrix(512, 640, split=False, base_fan_in=1).weight.detach().std()) - 640 ** -0.5) < 0.01
    assert "split=True" in repr(m) and "num_scales=2" in repr(Readout(8, 4, num_scales=2))


def test_module_under_cpu_autocast_matches_bf16_reference():
    m = SharedMatrix(24, 16, base_fan_in=4)
    with torch.no_grad():
        m.delta.normal_()
    x = torch.randn(2, 3, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x, rows=20, ratio=2.0)
        logits = Readout(24, 16, base_fan_in=4)(x, ratio=2.0)
    assert y.dtype == torch.bfloat16 and logits.dtype == torch.float32
    expected = F.linear(x.bfloat16(), m.block(20, 16, 2.0).bfloat16())
    torch.testing.assert_close(y, expected)
    y.float().sum().backward()
    assert m.delta.grad is not None and m.delta.grad.dtype == torch.float32


# ---------------------------------------------------------------- named errors

def test_bad_inputs_raise_named_errors():
    init, delta = _split()
    x = torch.randn(3, 10)
    call = lambda **kw: shared_matrix_reference(**(dict(x=x, weight=init, delta=delta, rows=12, cols=10)  # noqa: E731
                                                   | kw))
    with pytest.raises(ShapeError, match="`weight` must have 2 dimensions"):
        call(weight=init[0])
    with pytest.raises(ShapeError, match="`rows` must be <= out_features = 12.*got 13"):
        call(rows=13)
    with pytest.raises(ShapeError, match="`cols` must be <= in_features = 10"):
        call(cols=11, x=torch.randn(3, 11))
    with pytest.raises(ConfigError, match="`rows` must be a positive int"):
        call(rows=0)
    with pytest.raises(ShapeError, match="last dim cols = 8"):
        call(cols=8)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="ratio"):
            call(ratio=bad)
    with pytest.raises(ConfigError, match="unsplit.*ratio"):
        call(delta=None, ratio=2.0)
    with pytest.raises(ShapeError, match="`delta`"):
        call(delta=delta[:, :5])
    with pytest.raises(DTypeError, match="`delta`"):
        call(delta=delta.double())
    with pytest.raises(DeviceError, match="`delta`"):
        call(delta=torch.empty(12, 10, device="meta"))
    with pytest.raises(DeviceError, match="`x`"):
        call(x=torch.empty(3, 10, device="meta"))
    with pytest.raises(ShapeError, match="`scale` must have exactly one element"):
        call(scale=torch.ones(2))
    with pytest.raises(ConfigError, match="output_divisor"):
        call(output_divisor=0.0)
    with pytest.raises(ShapeError, match="attention_mask"):
        call(attention_mask=torch.ones(3, dtype=torch.bool))
    x3 = torch.randn(2, 3, 10)
    with pytest.raises(ShapeError, match="`attention_mask` has size"):
        call(x=x3, attention_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(DTypeError, match="additive"):
        call(x=x3, attention_mask=torch.zeros(2, 3).masked_fill(torch.eye(2, 3).bool(), float("-inf")))


def test_module_errors():
    m = SharedMatrix(12, 10)
    with pytest.raises(DTypeError, match="`x` has dtype bfloat16 but the module's parameters are float32"):
        m(torch.randn(2, 10, dtype=torch.bfloat16))
    with pytest.raises(TypeError):                   # rows, ratio, scale_index are keyword-only
        m(torch.randn(2, 10), None, 12)
    with pytest.raises(TypeError):
        Readout(8, 4)(torch.randn(1, 4), None, 1.0)
    with pytest.raises(ShapeError, match="0-dim"):
        m(torch.tensor(1.0))
    with pytest.raises(ConfigError, match="unsplit SharedMatrix"):
        SharedMatrix(4, 4, split=False).block(2, 2, 3.0)
    with pytest.raises(ConfigError, match="scale_index"):
        Readout(8, 4, num_scales=2)(torch.randn(1, 4), ratio=1.0, scale_index=2)
    with pytest.raises(ConfigError, match="out_features"):
        SharedMatrix(0, 4)
    with pytest.raises(ConfigError, match="backend"):
        SharedMatrix(4, 4, backend="cuda")
    with pytest.raises(ConfigError, match="vocab_size"):
        ElasticTiers().shared_matrix("lm_head")
    with pytest.raises(ConfigError, match="model keys"):
        ElasticTiers().subnetwork_config("low", vocab_size=8)
