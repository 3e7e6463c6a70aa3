import pytest
import torch
import torch.nn.functional as F

from laminae.primitives import ConfigError, DeviceError, DTypeError, ShapeError
from laminae.primitives.hrm_refinement import HRMRefinementBlock, HRMRefinementOutput, hrm_refinement_reference

from .._fixtures import load_fixture


def _randomised(block: HRMRefinementBlock, seed: int = 0) -> HRMRefinementBlock:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return block


def _split_form(x, norm_w, down_w, up_w, gate, eps):
    """The concat-free algebra the kernels use: the anchor half of ``down`` once."""
    d = x.shape[-1]
    anchor = x @ down_w[:, d:].t()
    h, out = x, []
    for t in range(gate.shape[0]):
        n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_w
        h = h + torch.tanh(gate[t]) * (F.silu(n @ down_w[:, :d].t() + anchor) @ up_w.t())
        out.append(h)
    return out


def test_identity_at_init():
    block = HRMRefinementBlock(12, 5, 3, backend="reference")
    x = torch.randn(2, 4, 12)
    h, states = block(x)
    assert torch.equal(h, x) and len(states) == 3 and all(torch.equal(s, x) for s in states)


def test_gradient_reaches_up_at_init():
    """The seed's dead-module fix: with up = 0 but gate = gate_init ≠ 0, up gets a gradient."""
    block = HRMRefinementBlock(8, 4, 2, backend="reference")
    block(torch.randn(3, 8)).output.pow(2).sum().backward()
    assert block.up.weight.grad.abs().sum() > 0
    assert torch.all(block.gate.grad == 0)  # ∝ update = 0 at init, as the seed notes


def test_init_and_parameter_names_match_seed():
    block = HRMRefinementBlock(16, 6, 3, gate_init=0.5)
    assert set(block.state_dict()) == {"norm.weight", "down.weight", "up.weight", "gate"}
    assert block.down.weight.shape == (6, 32) and block.up.weight.shape == (16, 6)
    assert torch.equal(block.norm.weight, torch.ones(16)) and torch.equal(block.gate, torch.full((3,), 0.5))
    assert torch.equal(block.up.weight, torch.zeros(16, 6))
    assert 0.015 < float(block.down.weight.detach().std()) < 0.025
    assert sum(p.numel() for p in block.parameters()) == 16 + 6 * 32 + 16 * 6 + 3


def test_seed_checkpoint_loads_strict():
    config, weights, _, _ = load_fixture("spikewhale_on")
    prefix = "model.hrm_refine."
    state = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
    block = HRMRefinementBlock(config["hidden_size"], config["hrm_refine_dim"], config["hrm_refine_steps"],
                               config["rms_norm_eps"], gate_init=config["hrm_gate_init"])
    block.load_state_dict(state, strict=True)
    x = torch.randn(2, 5, config["hidden_size"])
    h, states = block(x)
    expected = _split_form(x, *(state[k] for k in ("norm.weight", "down.weight", "up.weight", "gate")),
                           config["rms_norm_eps"])
    assert len(states) == config["hrm_refine_steps"]
    for a, b in zip(states, expected):
        torch.testing.assert_close(a, b)
    assert not torch.equal(h, x)  # the fixture's perturbed weights make the block act


@pytest.mark.parametrize("steps", [1, 3])
def test_concat_free_split_equals_seed_concat(steps):
    block = _randomised(HRMRefinementBlock(10, 4, steps, backend="reference"))
    x = torch.randn(3, 7, 10)
    _, states = block(x)
    p = block.state_dict()
    for a, b in zip(states, _split_form(x, p["norm.weight"], p["down.weight"], p["up.weight"], p["gate"], 1e-6)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("steps", [1, 3])
def test_gradcheck_reference_float64(steps):
    torch.manual_seed(1)
    d, r = 5, 3
    args = (torch.randn(4, d, dtype=torch.float64, requires_grad=True),
            (1 + 0.2 * torch.randn(d, dtype=torch.float64)).requires_grad_(),
            (0.4 * torch.randn(r, 2 * d, dtype=torch.float64)).requires_grad_(),
            (0.4 * torch.randn(d, r, dtype=torch.float64)).requires_grad_(),
            torch.randn(steps, dtype=torch.float64, requires_grad=True))
    assert torch.autograd.gradcheck(lambda *a: hrm_refinement_reference(*a, upcast=False), args)


def test_rows_are_independent_and_padding_cannot_leak():
    block = _randomised(HRMRefinementBlock(8, 3, 2, backend="reference"))
    x = torch.randn(2, 6, 8)
    y = block(x).output
    x2 = x.clone()
    x2[1, 4] = float("nan")  # a padded position holding garbage
    y2 = block(x2).output
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[1, 4] = False
    torch.testing.assert_close(y2[keep], y[keep])


def test_returns_output_and_states_always_the_last_state_is_the_output():
    block = _randomised(HRMRefinementBlock(6, 2, 4, backend="reference"))
    out = block(torch.randn(5, 6))
    assert isinstance(out, HRMRefinementOutput) and out._fields == ("output", "states")
    assert out.states.shape == (4, 5, 6) and torch.equal(out.states[-1], out.output)


def test_upcast_false_is_same_dtype_baseline():
    block = _randomised(HRMRefinementBlock(16, 4, 2, backend="reference")).to(torch.bfloat16)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    args = (block.norm.weight, block.down.weight, block.up.weight, block.gate)
    truth = hrm_refinement_reference(x, *args)
    base = hrm_refinement_reference(x, *args, upcast=False)
    assert truth.dtype == base.dtype == torch.bfloat16
    torch.testing.assert_close(truth.float(), base.float(), atol=0.1, rtol=0.05)


def test_runs_under_cpu_autocast():
    block = _randomised(HRMRefinementBlock(16, 4, 2, backend="reference"))
    x = torch.randn(2, 3, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = block(x).output
    h.float().sum().backward()
    assert h.shape == x.shape and x.grad is not None
    # the cast policy: the block's own math runs with autocast off, in x's dtype
    torch.testing.assert_close(h, block(x).output, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(steps=0), "steps"),
        (dict(refine_dim=0), "refine_dim"),
        (dict(hidden_size=-2), "hidden_size"),
        (dict(eps=0.0), "eps"),
        (dict(gate_init=0.0), "gate_init"),
        (dict(gate_init=float("nan")), "gate_init"),
        (dict(backend="cuda"), "backend"),
    ],
)
def test_bad_config_raises(kwargs, match):
    args = dict(hidden_size=8, refine_dim=4, steps=2) | kwargs
    with pytest.raises(ConfigError, match=match):
        HRMRefinementBlock(**args)


def test_bad_inputs_raise():
    block = HRMRefinementBlock(8, 4, 2)
    with pytest.raises(ShapeError, match="hidden_size=8"):
        block(torch.randn(2, 7))
    with pytest.raises(ShapeError, match="hidden_size=8"):
        block(torch.tensor(1.0))
    with pytest.raises(ShapeError, match="at least one token"):
        block(torch.randn(0, 8))
    with pytest.raises(DTypeError, match="bfloat16"):
        block(torch.randn(2, 8, dtype=torch.bfloat16))
    with pytest.raises(DTypeError, match="x"):
        block(torch.ones(2, 8, dtype=torch.int64))
    with pytest.raises(DeviceError, match="meta"):
        block(torch.randn(2, 8, device="meta"))
    with pytest.raises(TypeError):
        block([[0.0] * 8])


def test_token_by_token_equals_full_sequence():
    """Decoding needs no state: the block applied to each new token alone gives the full forward."""
    block = _randomised(HRMRefinementBlock(16, 4, 2, backend="reference"))
    x = torch.randn(2, 9, 16)
    steps = torch.cat([block(x[:, t:t + 1]).output for t in range(9)], dim=1)
    torch.testing.assert_close(steps, block(x).output)
