import copy
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from laminae.primitives import BackendUnavailableError, DTypeError, ShapeError
from laminae.primitives.derf import (
    DERFAttention,
    DERFContextGate,
    derf_attention_reference,
    derf_context_gate_reference,
)
from laminae.triton_ops.derf import (
    derf_attention,
    derf_attention_op,
    derf_context_gate,
    derf_context_gate_op,
    static_cases,
)
from laminae.triton_ops.testing import parity_float64

from .._decoding import prefill_then_decode
from .._helpers import DEVICE, assert_parity, keep_mask, scales, seeds
from .test_launch_configurations import _check

ATTN_GRADS = ["q", "k", "v", "derf_alpha", "derf_bias", "derf_gamma"]
GATE_GRADS = ["retrieved", "logits", "alpha", "bias", "gamma"]


def _attn_inputs(B, S, extra, H, Hkv, D, masked, scale, alpha_scale, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    N = S + extra
    # scores q·k/√D and values both of size ~scale (q, k of size √scale). Scores of
    # size scale² with |α| = 4 put whole rows so deep in the erf tail (|z| ~ 60)
    # that a last-bit change of a score moves the output past the fp32 tolerance,
    # in the reference as much as in the kernel.
    inp = {
        "q": (torch.randn(B, S, H, D, generator=gen) * scale**0.5).to(DEVICE, dtype),
        "k": (torch.randn(B, N, Hkv, D, generator=gen) * scale**0.5).to(DEVICE, dtype),
        "v": (torch.randn(B, N, Hkv, D, generator=gen) * scale).to(DEVICE, dtype),
        # slopes of both signs; offsets into the erf tail; |γ| away from 0 (the output
        # does not depend on γ beyond the 1e-8, so dγ is rounding noise scaled by 1/γ)
        "derf_alpha": (alpha_scale * torch.randn(H, generator=gen)).to(DEVICE),
        "derf_bias": (torch.randn(H, generator=gen) - 0.5).to(DEVICE),
        "derf_gamma": ((0.5 + 1.5 * torch.rand(H, generator=gen))
                       * torch.where(torch.rand(H, generator=gen) < 0.25, -1.0, 1.0)).to(DEVICE),
    }
    if masked:
        keep = keep_mask(B, N, gen)
        keep[-1, : int(torch.randint(0, N, (), generator=gen))] = False  # left padding on the last row
        inp["attention_mask"] = keep
    return inp


heads = st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)])


def _resolvable_rows(inp) -> torch.Tensor:
    """[B, S, H] bool: query rows whose gradients fp32 can resolve (fp32 tests only).

    When one key carries all of a row's weight (a lone visible key, or the others
    deep in the erf tail), the gradients of q, k, α, b through that row are
    1e-8 effects: dw_ij = (dout_i·v_j − dout_i·out_i)/(den_i + 1e-8) with v_j ≈ out_i,
    whose relative rounding error is about ε/(1 − max_j w_ij/den_i). The fp32
    reference and the kernels (which use the flash-attention delta_i = dout_i·out_i)
    round it differently, so such rows say nothing about the kernels at fp32's
    tolerances. In 16 bits they are compared like every other row (the kernels' δ
    and weights are fp32-consistent there, and 16-bit tolerances are 1e4·ε_fp32 wide):
    ``test_attention_16bit_matches_reference_on_every_row``."""
    with torch.no_grad():
        wide = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                for k, v in inp.items()}
        q, k, mask = wide["q"], wide["k"], wide.get("attention_mask")
        B, S, H, D = q.shape
        N, group = k.shape[1], H // k.shape[2]
        scores = torch.einsum("bshd,bnhd->bhsn", q, k.repeat_interleave(group, 2)) / D**0.5
        z = wide["derf_alpha"].view(1, H, 1, 1) * scores + wide["derf_bias"].view(1, H, 1, 1)
        w = torch.special.erfc(-z).abs()  # γ·erfc(−z)/2 up to the per-head factor, which cancels below
        visible = torch.ones(S, N, dtype=torch.bool, device=q.device).tril(N - S)[None, None]
        if mask is not None:
            visible = visible & mask.bool()[:, None, None, :]
        w = torch.where(visible, w, 0.0)
        den = w.sum(-1) + 2e-8 / wide["derf_gamma"].abs().view(1, H, 1)
        concentration = w.amax(-1) / den
        return (concentration < 1 - 1e-3).transpose(1, 2)


def _through_rows(fn, rows):
    """fn's output, with the gradients of q, k, α, b, γ flowing back only through the
    given rows. dV flows through every row: it is O(1) and well resolved even where a
    row's other gradients are not (a row with one visible key gives its key's value
    the whole upstream gradient), so discarding those rows would hide a dV bug."""
    def wrapped(**inputs):
        out = fn(**inputs)
        v_only = fn(**{k: (t.detach() if k != "v" and isinstance(t, torch.Tensor) else t)
                       for k, t in inputs.items()})
        return torch.where(rows[..., None], out, v_only)
    return wrapped


def assert_attention_parity(inp):
    rows = _resolvable_rows(inp)
    return assert_parity(_through_rows(derf_attention, rows), _through_rows(derf_attention_reference, rows),
                         inp, ATTN_GRADS)


@given(B=st.integers(1, 2), S=st.integers(1, 40), extra=st.integers(0, 20), heads=heads,
       D=st.sampled_from([4, 16, 24, 32, 64]), masked=st.booleans(), scale=scales,
       alpha_scale=st.sampled_from([0.5, 1.0, 4.0]), seed=seeds)
def test_attention_matches_reference_fp32(B, S, extra, heads, D, masked, scale, alpha_scale, seed):
    inp = _attn_inputs(B, S, extra, *heads, D, masked, scale, alpha_scale, seed)
    assert_attention_parity(inp)


@pytest.mark.parametrize("D", [100, 128, 256])
def test_attention_wide_heads_fp32(D):
    inp = _attn_inputs(1, 19, 14, 2, 1, D, True, 1.0, 1.0, seed=D)
    assert_attention_parity(inp)


@pytest.mark.parametrize("S, extra", [(40, 1), (37, 27), (70, 3)])
def test_attention_key_blocks_starting_inside_query_blocks(S, extra):
    # several key blocks whose first key falls at different offsets of a query
    # block (the dK/dV kernel's first query block is rounded down to BLOCK_M)
    inp = _attn_inputs(1, S, extra, 2, 1, 16, False, 1.0, 1.0, seed=S)
    assert_attention_parity(inp)


@pytest.mark.parametrize("v_layout", ["slice", "heads_first"])
def test_attention_reads_strided_views_and_broadcast_gradients(v_layout):
    gen = torch.Generator().manual_seed(11)
    B, S, N, H, Hkv, D = 2, 9, 13, 4, 2, 16
    q = torch.randn(B, H, S, D, generator=gen).to(DEVICE).transpose(1, 2)        # non-contiguous
    buf = torch.randn(B, 20, Hkv, 2 * D, generator=gen).to(DEVICE)
    k, v = buf[:, :N, :, :D], buf[:, :N, :, D:]                                   # cache-like slices
    if v_layout == "heads_first":   # v's key stride (D) differs from k's (2·Hkv·D)
        v = torch.randn(B, Hkv, N, D, generator=gen).to(DEVICE).transpose(1, 2)
    params = [torch.randn(H, generator=gen).to(DEVICE) for _ in range(3)]
    mask = (torch.rand(B, N, generator=gen) > 0.2).to(torch.uint8).to(DEVICE)     # 0/1 integers
    results = []
    for fn in (derf_attention, derf_attention_reference):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, *params)]
        out = fn(*leaves, mask)
        out.sum().backward()  # upstream gradient with stride 0
        results.append((out, [t.grad for t in leaves]))
    torch.testing.assert_close(results[0][0], results[1][0], atol=2e-5, rtol=2e-4)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


# ((B, S, extra, H, Hkv, D, masked, scale, alpha_scale, seed), dtype): in bf16 rows that
# nearly see one key (erf tails, |α| = 4, left padding) and cached keys; in fp16 rows
# whose every weight lies below fp16's normal range (6e-5)
STRESS_16BIT = [((1, 22, 16, 3, 3, 16, True, 4.0, 4.0, 4525), torch.bfloat16),
                ((2, 37, 0, 3, 3, 32, False, 1.0, 4.0, 23368), torch.bfloat16),
                ((1, 33, 0, 4, 2, 16, False, 4.0, 1.0, 19262), torch.float16),
                ((2, 27, 0, 4, 2, 32, True, 1.0, 1.0, 46930), torch.float16)]


@pytest.mark.parametrize("case, dtype", STRESS_16BIT, ids=[f"{i}-{str(d)[6:]}" for i, (_, d) in enumerate(STRESS_16BIT)])
def test_attention_16bit_matches_reference_on_every_row(case, dtype):
    # No row is left out, and the truth is float64: 16-bit weights relative to the
    # row's max (exactly 1 for a lone key; fp16's range), the normaliser summing the
    # rounded weights P·V multiplies, δ from the fp32 output and ∂γ from its closed
    # form leave every output and gradient within two ulps RMS (measured ≤ 0.5).
    result = parity_float64(derf_attention, derf_attention_reference, _attn_inputs(*case, dtype=dtype), ATTN_GRADS)
    assert result.ok, result.report()


def test_fully_masked_rows_are_zero_with_finite_gradients():
    inp = _attn_inputs(2, 6, 0, 2, 1, 16, True, 1.0, 1.0, seed=5)
    inp["attention_mask"][0] = False
    assert_attention_parity(inp)
    out = derf_attention(**inp)
    assert torch.equal(out[0], torch.zeros_like(out[0]))


@given(rows=st.integers(1, 70), feats=st.integers(1, 300), lead=st.sampled_from([(), (2,), (3, 1)]),
       scale=scales, logit_scale=st.sampled_from([0.3, 1.0, 5.0]), bias_shift=st.sampled_from([-4.0, 0.0, 1.0]),
       seed=seeds)
def test_context_gate_matches_reference_fp32(rows, feats, lead, scale, logit_scale, bias_shift, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = (*lead, rows, feats)
    inp = {
        "retrieved": (torch.randn(shape, generator=gen) * scale).to(DEVICE),
        "logits": (torch.randn(shape, generator=gen) * logit_scale).to(DEVICE),
        "alpha": (2.0 * torch.randn(feats, generator=gen)).to(DEVICE),
        "bias": (bias_shift + torch.randn(feats, generator=gen)).to(DEVICE),
        "gamma": torch.randn(feats, generator=gen).to(DEVICE),
    }
    assert_parity(derf_context_gate, derf_context_gate_reference, inp, GATE_GRADS)


# ----------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------


def _randomised_attention(H, Hkv, D, backend):
    m = DERFAttention(H, Hkv, D, backend=backend).to(DEVICE)
    with torch.no_grad():
        m.derf_alpha.uniform_(-2, 2)
        m.derf_bias.normal_()
        m.derf_gamma.uniform_(0.5, 1.5)
    return m


def test_module_backends_agree_including_parameter_grads():
    torch.manual_seed(0)
    B, T, H, Hkv, D = 2, 21, 4, 2, 24
    m = _randomised_attention(H, Hkv, D, "reference")
    q = torch.randn(B, T, H, D, device=DEVICE, requires_grad=True)
    k = torch.randn(B, T, Hkv, D, device=DEVICE, requires_grad=True)
    v = torch.randn(B, T, Hkv, D, device=DEVICE, requires_grad=True)
    mask = (torch.rand(B, T) > 0.2).to(DEVICE)
    g = torch.randn(B, T, H, D, device=DEVICE)
    res = []
    for backend in ("reference", "triton"):
        m.backend = backend
        out, _ = m(q, k, v, mask)
        res.append((out, torch.autograd.grad(out, [q, k, v, *m.parameters()], g)))
    torch.testing.assert_close(res[1][0], res[0][0], atol=2e-5, rtol=2e-4)
    for a, b in zip(res[1][1], res[0][1]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


class _TinyDERFModel(nn.Module):
    """Embedding, q/kv projections, DERF attention, output projection, LM head."""

    def __init__(self, vocab=32, dim=32, heads=4, kv_heads=2, head_dim=16):
        super().__init__()
        torch.manual_seed(0)
        self.shape = (heads, kv_heads, head_dim)
        self.embed, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)
        self.q, self.kv = nn.Linear(dim, heads * head_dim), nn.Linear(dim, 2 * kv_heads * head_dim)
        self.o = nn.Linear(heads * head_dim, dim)
        self.core = DERFAttention(heads, kv_heads, head_dim)
        with torch.no_grad():
            self.core.derf_bias.fill_(-2.0)     # weights from the erf's lower half, as training drives some heads

    def forward(self, tokens, mask):
        heads, kv_heads, head_dim = self.shape
        x = self.embed(tokens)
        q = self.q(x).unflatten(-1, (heads, head_dim))
        k, v = self.kv(x).unflatten(-1, (2, kv_heads, head_dim)).unbind(2)
        y, _ = self.core(q, k, v, mask)
        return self.head(x + self.o(y.flatten(2)))


def test_small_model_parameter_gradients_under_bf16_autocast_are_the_truth():
    """Under CPU bf16 autocast both backends' DERF parameter gradients are within 5 % of
    the model's float64 gradients (measured: 0.5–1.8 %; the kernels before their
    16-bit normaliser and δ were made consistent: ∂b 14 % off, ∂γ 600×)."""
    model = _TinyDERFModel().to(DEVICE)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 32, (4, 8), generator=gen).to(DEVICE)
    mask = torch.ones(4, 8, dtype=torch.bool)
    for b in range(4):
        mask[b, : 3 * b % 8] = False         # left padding: the first kept query of each row sees one key
    mask = mask.to(DEVICE)

    def derf_grads(m, backend, autocast):
        m.core.backend = backend
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=autocast):
            logits = m(tokens, mask)
        loss = F.cross_entropy(logits[:, :-1][mask[:, 1:]].float(), tokens[:, 1:][mask[:, 1:]])
        return torch.autograd.grad(loss, [m.core.derf_alpha, m.core.derf_bias, m.core.derf_gamma])

    truth = derf_grads(copy.deepcopy(model).double(), "reference", False)
    for backend in ("reference", "triton"):
        for name, g, t in zip(("derf_alpha", "derf_bias", "derf_gamma"), derf_grads(model, backend, True), truth):
            rel = float((g.double() - t).norm() / t.norm())
            assert rel <= 0.05, f"{backend} {name}: {rel:.1%} off the float64 gradient"


@pytest.mark.parametrize("with_mask", [False, True])
def test_module_decode_with_triton_equals_full_forward(with_mask):
    torch.manual_seed(1)
    B, T, H, Hkv, D = 2, 12, 4, 2, 16
    m = _randomised_attention(H, Hkv, D, "triton")
    q = torch.randn(B, T, H, D, device=DEVICE)
    k, v = torch.randn(B, T, Hkv, D, device=DEVICE), torch.randn(B, T, Hkv, D, device=DEVICE)
    mask = None
    if with_mask:
        mask = (torch.rand(B, T) > 0.25).to(DEVICE)
        mask[0, :4] = False
    with torch.no_grad():
        full, _ = m(q, k, v, mask)
        ref = derf_attention_reference(q, k, v, m.derf_alpha, m.derf_bias, m.derf_gamma, mask)
        steps, _ = prefill_then_decode(m, q, k, v, cache=m.empty_cache(B), chunks=(6, 2, 1, 1, 1, 1),
                                       attention_mask=mask)
    torch.testing.assert_close(steps, full, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(full, ref, atol=2e-5, rtol=2e-4)


def test_context_gate_module_backends_agree():
    torch.manual_seed(2)
    gate = DERFContextGate(40, init_bias=-1.0).to(DEVICE)
    r = torch.randn(3, 7, 40, device=DEVICE, requires_grad=True)
    x = torch.randn(3, 7, 40, device=DEVICE, requires_grad=True)
    g = torch.randn(3, 7, 40, device=DEVICE)
    res = []
    for backend in ("reference", "triton"):
        gate.backend = backend
        y = gate(x, retrieved=r)
        res.append((y, torch.autograd.grad(y, [r, x, *gate.parameters()], g)))
    torch.testing.assert_close(res[1][0], res[0][0], atol=2e-5, rtol=2e-4)
    for a, b in zip(res[1][1], res[0][1]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


# ----------------------------------------------------------------------------
# Limits, registration, launch configurations
# ----------------------------------------------------------------------------


def test_triton_rejects_float64_and_wide_heads():
    q = torch.randn(1, 2, 1, 8, dtype=torch.float64, device=DEVICE)
    k = torch.randn(1, 2, 1, 8, dtype=torch.float64, device=DEVICE)
    p = torch.ones(1, device=DEVICE)
    with pytest.raises(DTypeError):
        derf_attention(q, k, k, p, p, p)
    wide = torch.randn(1, 2, 1, 272, device=DEVICE)
    with pytest.raises(ShapeError, match="head_dim <= 256"):
        derf_attention(wide, wide, wide, p, p, p)
    with pytest.raises(DTypeError):
        derf_context_gate(q, q, p, p, p)


def test_triton_backend_on_cpu_without_interpreter_raises(monkeypatch):
    if DEVICE.type == "cuda":
        pytest.skip("CPU-only behaviour")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    m = DERFAttention(2, 1, 8, backend="triton")
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET"):
        m(torch.randn(1, 3, 2, 8), torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8))


def _op_args(device, B=2, S=5, N=7, H=4, Hkv=2, D=16):
    q = torch.randn(B, S, H, D, device=device, requires_grad=True)
    k = torch.randn(B, N, Hkv, D, device=device, requires_grad=True)
    v = torch.randn(B, N, Hkv, D, device=device, requires_grad=True)
    params = [torch.rand(H, device=device, requires_grad=True) + 0.5 for _ in range(3)]
    params = [p.detach().requires_grad_(True) for p in params]
    mask = (torch.rand(B, N, device=device) > 0.2).to(torch.uint8)
    return (q, k, v, *params, mask)


def _gate_args(device, rows=9, feats=33):
    return tuple(torch.randn(*shape, device=device, requires_grad=True)
                 for shape in ((rows, feats), (rows, feats), (feats,), (feats,), (feats,)))


def test_opcheck_schema_and_autograd_registration():
    # The fake-tensor and AOT checks would execute the interpreter on meta tensors;
    # they run in the GPU-marked test below.
    utils = ("test_schema", "test_autograd_registration")
    torch.library.opcheck(derf_attention_op, _op_args(DEVICE), test_utils=utils)
    torch.library.opcheck(derf_context_gate_op, _gate_args(DEVICE), test_utils=utils)


def test_static_cases_name_every_kernel_parameter_in_order():
    cases = list(static_cases())
    assert {c.name for c in cases} == {"derf_fwd", "derf_bwd_delta", "derf_bwd_dkdv", "derf_bwd_dq", "derf_gate_fwd",
                                       "derf_gate_bwd"}
    for case in cases:
        names = list(case.signature) + list(case.constexprs)
        assert names == list(case.kernel.arg_names), case.name
        assert case.constexprs.get("BLOCK_M", 16) >= 16 and case.constexprs.get("BLOCK_N", 16) >= 16


# ----------------------------------------------------------------------------
# GPU only
# ----------------------------------------------------------------------------


@pytest.mark.gpu
def test_opcheck_full_gpu():
    torch.library.opcheck(derf_attention_op, _op_args("cuda", B=2, S=70, N=90, H=4, Hkv=2, D=64))
    torch.library.opcheck(derf_context_gate_op, _gate_args("cuda", rows=300, feats=200))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_attention_matches_reference_low_precision(dtype, D):
    inp = _attn_inputs(2, 200, 57, 8, 2, D, True, 1.0, 1.0, seed=D, dtype=dtype)
    assert_parity(derf_attention, derf_attention_reference, inp, ATTN_GRADS, dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_context_gate_matches_reference_low_precision(dtype):
    gen = torch.Generator().manual_seed(0)
    inp = {
        "retrieved": torch.randn(513, 1000, generator=gen).to("cuda", dtype),
        "logits": (2 * torch.randn(513, 1000, generator=gen)).to("cuda", dtype),
        "alpha": torch.randn(1000, generator=gen).cuda(),
        "bias": (torch.randn(1000, generator=gen) - 1).cuda(),
        "gamma": torch.randn(1000, generator=gen).cuda(),
    }
    assert_parity(derf_context_gate, derf_context_gate_reference, inp, GATE_GRADS, dtype=dtype)


@pytest.mark.gpu
def test_compile_fullgraph_smoke():
    attn = _randomised_attention(8, 2, 64, "auto")
    q = torch.randn(2, 128, 8, 64, device="cuda", requires_grad=True)
    k = torch.randn(2, 128, 2, 64, device="cuda", requires_grad=True)
    v = torch.randn(2, 128, 2, 64, device="cuda", requires_grad=True)
    mask = torch.ones(2, 128, dtype=torch.bool, device="cuda")
    compiled = torch.compile(attn, fullgraph=True)
    out, _ = compiled(q, k, v, mask)
    out.sum().backward()
    torch.testing.assert_close(out, attn(q, k, v, mask)[0])

    gate = DERFContextGate(256).cuda()
    r = torch.randn(4, 64, 256, device="cuda", requires_grad=True)
    x = torch.randn(4, 64, 256, device="cuda", requires_grad=True)
    y = torch.compile(gate, fullgraph=True)(x, retrieved=r)
    y.sum().backward()
    torch.testing.assert_close(y, gate(x, retrieved=r))


# Every launch configuration the CUDA path can pick, derived from static_cases(): one call
# of the op per (dtype, head-dim tile, key mask) launches the forward, δ, dQ and dK/dV
# kernels of that configuration, and the gate's dtypes run its two kernels. The tiles
# come from the op's own lookup (_block_d, _tiles, _split), checked against the static
# case. S spans two query and key tiles of every kernel plus a ragged last one, with
# cached keys (N > S); masked runs hold a full head dim and left padding, unmasked ones a
# ragged head dim (the BLOCK_D tile's last columns masked); GQA in bf16 masked, fp16 and
# fp32 unmasked. Tolerances: test_launch_configurations' table (float64 truth).
def _bias_grad_magnitude(inp, upstream):
    """[H] float64: the size of the terms whose sum is ∂b, dz_ij = dw_ij·γ/√π·exp(−z_ij²)
    with dw_ij = (dout_i·v_j − δ_i)·rden_i (module docstring of triton_ops/derf.py). They
    cancel (∂b is often far smaller than they are), so its rounding is relative to them:
    each row's terms share δ_i, whose rounding is coherent along the row, and the rows
    round independently, so Σ_j over a row by magnitude (|dout_i·v_j| + |δ_i|), then the
    root of the sum of squares over the rows."""
    t = {n: (x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x) for n, x in inp.items()}
    q, k, v = t["q"], t["k"], t["v"]
    B, S, H, D = q.shape
    N, group = k.shape[1], H // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    alpha, bias, gamma = (t[n].view(1, H, 1, 1) for n in ("derf_alpha", "derf_bias", "derf_gamma"))
    z = alpha * torch.einsum("bshd,bnhd->bhsn", q, k) / D**0.5 + bias
    visible = torch.ones(S, N, dtype=torch.bool, device=q.device).tril(N - S)[None, None]
    if t.get("attention_mask") is not None:
        visible = visible & t["attention_mask"].bool()[:, None, None, :]
    w = torch.where(visible, gamma * torch.special.erfc(-z) / 2, 0.0)
    den = w.sum(-1, keepdim=True) + 1e-8
    dout = upstream.double().transpose(1, 2)
    delta = (dout * torch.einsum("bhsn,bnhd->bhsd", w, v) / den).sum(-1, keepdim=True)
    dw = torch.where(visible, (torch.einsum("bhsd,bnhd->bhsn", dout, v).abs() + delta.abs()) / den, 0.0)
    rows = (dw * gamma.abs() * torch.exp(-z * z) / math.pi**0.5).sum(-1)
    return rows.pow(2).sum(dim=(0, 2)).sqrt()


def _attention_runs():
    return sorted({(c.tags["dtype"], c.constexprs["BLOCK_D"], c.constexprs["HAS_MASK"])
                   for c in static_cases() if c.name == "derf_fwd"})


ATTENTION_RUNS = _attention_runs()
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize("dtype, block_d, masked", ATTENTION_RUNS,
                         ids=[f"{dt}-D{bd}-{'mask' if m else 'nomask'}" for dt, bd, m in ATTENTION_RUNS])
def test_attention_every_launch_configuration_against_float64(dtype, block_d, masked):
    from laminae.triton_ops.derf import _block_d, _split, _tiles

    torch_dtype = _DTYPES[dtype]
    D = block_d if masked else block_d * 3 // 4
    assert _block_d(D) == block_d
    kinds = {"derf_fwd": "fwd", "derf_bwd_dq": "dq", "derf_bwd_dkdv": "dkdv"}
    for case in static_cases():
        if (case.name in kinds and case.tags["dtype"] == dtype and case.constexprs["BLOCK_D"] == block_d
                and case.constexprs["HAS_MASK"] == masked):
            kind = kinds[case.name]
            assert _tiles(kind, torch_dtype, block_d)[:2] == (case.constexprs["BLOCK_M"], case.constexprs["BLOCK_N"])
            assert _split(kind, torch_dtype, block_d) == case.constexprs["SPLIT"]
    widest = max(max(_tiles(kind, torch_dtype, block_d)[:2]) for kind in kinds.values())
    S = 2 * widest + 5
    heads = (2, 1) if masked == (dtype == "bf16") else (1, 1)
    inp = _attn_inputs(1, S, 3, *heads, D, masked, 1.0, 1.0, seed=D + S, dtype=torch_dtype)
    _check(derf_attention, derf_attention_reference, inp, ATTN_GRADS, torch_dtype, names=["out"],
           floors={"dderf_bias": lambda up: _bias_grad_magnitude(inp, up[0])})


GATE_DTYPES = sorted({c.tags["dtype"] for c in static_cases() if c.name == "derf_gate_fwd"})


@pytest.mark.parametrize("dtype", GATE_DTYPES)
def test_context_gate_every_launch_configuration_against_float64(dtype):
    from laminae.triton_ops.derf import GATE_BLOCK_F, GATE_BLOCK_R


    # five row tiles (the backward's four CPU programs: one walks two), ragged; two
    # feature tiles and a ragged one
    rows, feats = 4 * GATE_BLOCK_R + 3, 2 * GATE_BLOCK_F + 5
    gen = torch.Generator().manual_seed(9)
    inp = {
        "retrieved": torch.randn(rows, feats, generator=gen).to(DEVICE, _DTYPES[dtype]),
        "logits": (2.0 * torch.randn(rows, feats, generator=gen)).to(DEVICE, _DTYPES[dtype]),
        "alpha": (1.0 + 0.3 * torch.randn(feats, generator=gen)).to(DEVICE),
        "bias": (torch.randn(feats, generator=gen) - 1.0).to(DEVICE),
        "gamma": (1.0 + 0.2 * torch.randn(feats, generator=gen)).to(DEVICE),
    }
    _check(derf_context_gate, derf_context_gate_reference, inp, GATE_GRADS, _DTYPES[dtype])
