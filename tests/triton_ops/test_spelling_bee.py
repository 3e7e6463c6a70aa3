from importlib import import_module

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from laminae.primitives import BackendUnavailableError, DTypeError, TokenIdError
from laminae.primitives.spelling_bee import (SpellingBeeEmbedding, byte_table_from_strings, spelling_bee_reference,
                                             spelling_bee_rotary)
from laminae.triton_ops.spelling_bee import _mode_code, spelling_bee, spelling_bee_op

from .._helpers import DEVICE, assert_parity, scales, seeds

GRADS = ["token_embeddings", "byte_embed"]
VARIANTS = [("embed", "mean"), ("zero", "mean"), ("embed", "masked_sqrt")]


def _table(vocab, gen, max_len=20, alphabet=256):
    words = [bytes(torch.randint(0, alphabet, (int(k),), generator=gen).tolist())
             for k in torch.randint(0, max_len + 1, (vocab,), generator=gen)]
    return byte_table_from_strings(words)


def _inputs(shape, vocab, d, scale, seed, dtype=torch.float32, alphabet=256):
    gen = torch.Generator().manual_seed(seed)
    byte_ids, byte_len = _table(vocab, gen, alphabet=alphabet)
    return {
        "input_ids": torch.randint(0, vocab, shape, generator=gen).to(DEVICE),
        "token_embeddings": (torch.randn(*shape, d, generator=gen) * scale).to(DEVICE, dtype),
        "byte_embed": (torch.randn(256, d, generator=gen) * scale).to(DEVICE, dtype),
        "byte_ids": byte_ids.to(DEVICE),
        "byte_len": byte_len.to(DEVICE),
    }


def _with(fn, **options):
    return lambda **kw: fn(**kw, **options)


@given(batch=st.integers(1, 3), seq=st.integers(1, 40), vocab=st.integers(1, 300), half=st.integers(1, 70),
       variant=st.sampled_from(VARIANTS), offset=st.sampled_from([0, 1]), alphabet=st.sampled_from([3, 256]),
       scale=scales, seed=seeds)
def test_kernel_matches_reference_fp32(batch, seq, vocab, half, variant, offset, alphabet, scale, seed):
    # alphabet 3: almost every slot hits the same few bytes (the contention case for a scatter)
    pad_mode, mode = variant
    inp = _inputs((batch, seq), vocab, 2 * half, scale, seed, alphabet=alphabet)
    opts = dict(pad_mode=pad_mode, mode=mode, byte_position_offset=offset)
    assert_parity(_with(spelling_bee, **opts), _with(spelling_bee_reference, **opts), inp, GRADS)


def test_spec_worked_example_on_the_kernel():
    byte_embed = torch.zeros(256, 4, device=DEVICE)
    byte_embed[0x61, 0] = 1.0
    byte_embed[0x62, 1] = 1.0
    byte_ids, byte_len = byte_table_from_strings([b"ab"])
    e_tok = torch.tensor([[0.2, -0.4, 0.0, 1.0]], device=DEVICE)
    out = spelling_bee(torch.tensor([0], device=DEVICE), e_tok, byte_embed, byte_ids.to(DEVICE), byte_len.to(DEVICE))
    torch.testing.assert_close(out.cpu(), torch.tensor([[0.13125, -0.1687516, 0.0, 0.5003125]]), atol=1e-7, rtol=0)


def test_many_slices_and_long_rows(monkeypatch):
    """Several backward token slices (partials summed in torch) and d/2 over one column block."""
    bee_ops = import_module("laminae.triton_ops.spelling_bee")  # the package attribute is the function

    monkeypatch.setattr(bee_ops, "BWD_ROWS_PER_SLICE", 64)
    inp = _inputs((1, 150), 40, 2 * 70, 1.0, 7)
    assert_parity(spelling_bee, spelling_bee_reference, inp, GRADS)


def test_unchecked_out_of_range_ids_give_the_reference_nan_rows():
    """With the id check off (the default) an id outside [0, V) gives a NaN row on the
    kernel as on the reference; the kernel never reads the tables at it, and both
    gradients (½·g for e_tok, nothing for the byte table) match the reference."""
    inp = _inputs((6,), 5, 8, 1.0, 0)
    inp["input_ids"] = torch.tensor([-1, 5, 2, 70000, 4, -2**40], device=DEVICE)
    valid = torch.tensor([False, False, True, False, True, False], device=DEVICE)
    g = torch.randn(6, 8, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    res = []
    for fn in (spelling_bee, spelling_bee_reference):
        e_tok, emb = inp["token_embeddings"].clone().requires_grad_(), inp["byte_embed"].clone().requires_grad_()
        out = fn(inp["input_ids"], e_tok, emb, inp["byte_ids"], inp["byte_len"])
        res.append((out, *torch.autograd.grad(out, [e_tok, emb], g)))
    (out, d_etok, d_emb), (ref, *ref_grads) = res
    assert torch.equal(out.isnan().all(-1), ~valid) and not out[valid].isnan().any()
    torch.testing.assert_close(out, ref, equal_nan=True)
    for got, want in zip((d_etok, d_emb), ref_grads):
        assert got.isfinite().all()
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_module_checked_ids_raise_token_id_error(backend):
    bee = SpellingBeeEmbedding(4, 8, backend=backend, validate_ids=True).to(DEVICE)
    bee.set_byte_table_from_strings([b"a"])
    with pytest.raises(TokenIdError, match=r"\[0, vocab_size=4\), got 4"):
        bee(torch.tensor([0, 4], device=DEVICE), token_embeddings=torch.zeros(2, 8, device=DEVICE))


def test_backward_is_bitwise_deterministic():
    inp = _inputs((2, 50), 20, 48, 1.0, 3, alphabet=4)
    grads = []
    for _ in range(2):
        w = inp["byte_embed"].clone().requires_grad_()
        out = spelling_bee(inp["input_ids"], inp["token_embeddings"], w, inp["byte_ids"], inp["byte_len"])
        grads.append(torch.autograd.grad(out, w, torch.ones_like(out))[0])
    assert torch.equal(grads[0], grads[1])


def test_module_backends_agree_and_bake():
    torch.manual_seed(0)
    bee = SpellingBeeEmbedding(30, 24).to(DEVICE)
    gen = torch.Generator().manual_seed(1)
    bee.set_byte_table(*_table(30, gen))
    ids = torch.randint(0, 30, (3, 11), device=DEVICE)
    e_tok = torch.randn(3, 11, 24, device=DEVICE, requires_grad=True)
    g = torch.randn(3, 11, 24, device=DEVICE)
    res = []
    for backend in ("reference", "triton"):
        bee.backend = backend
        out = bee(ids, token_embeddings=e_tok)
        res.append((out, torch.autograd.grad(out, [e_tok, bee.byte_embed.weight], g)))
    torch.testing.assert_close(res[0][0], res[1][0])
    for a, b in zip(res[0][1], res[1][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    bee.eval().bake_inference_table()
    torch.testing.assert_close(bee(ids, token_embeddings=e_tok), res[1][0])


def test_module_triton_backend_runs_under_cpu_autocast():
    bee = SpellingBeeEmbedding(10, 8, backend="triton").to(DEVICE)
    bee.set_byte_table_from_strings([b"ab", b"c"])
    e_tok = torch.randn(2, 8, device=DEVICE, requires_grad=True)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        out = bee(torch.tensor([0, 1], device=DEVICE), token_embeddings=e_tok)
    out.sum().backward()
    assert out.dtype == e_tok.dtype and bee.byte_embed.weight.grad is not None


def test_triton_rejects_float64():
    inp = _inputs((2,), 4, 8, 1.0, 0, dtype=torch.float64)
    with pytest.raises(DTypeError):
        spelling_bee(**inp)
    bee = SpellingBeeEmbedding(4, 8, backend="triton").double()
    bee.set_byte_table_from_strings([b"a"])
    with pytest.raises(DTypeError, match="float64"):
        bee(torch.tensor([0]), token_embeddings=torch.zeros(1, 8, dtype=torch.float64))


def test_triton_backend_on_cpu_without_interpreter_raises(monkeypatch):
    if DEVICE.type == "cuda":
        pytest.skip("CPU-only behaviour")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    bee = SpellingBeeEmbedding(4, 8, backend="triton")
    bee.set_byte_table_from_strings([b"a"])
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET"):
        bee(torch.tensor([0]), token_embeddings=torch.zeros(1, 8))


def _op_args(n=9, d=12, vocab=7):
    inp = _inputs((n,), vocab, d, 1.0, 2)
    cos, sin = spelling_bee_rotary(d, device=DEVICE)
    return (inp["input_ids"], inp["token_embeddings"].requires_grad_(), inp["byte_embed"].requires_grad_(),
            inp["byte_ids"], inp["byte_len"], cos, sin, _mode_code("embed", "mean"))


def test_opcheck_schema_and_autograd_registration():
    # The fake-tensor and AOT checks would execute the interpreter on meta tensors;
    # they run in the GPU-marked test below.
    torch.library.opcheck(spelling_bee_op, _op_args(), test_utils=("test_schema", "test_autograd_registration"))


@pytest.mark.gpu
def test_opcheck_full_gpu():
    torch.library.opcheck(spelling_bee_op, _op_args(300, 128, 500))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_matches_reference_low_precision(dtype):
    inp = _inputs((4, 700), 64402, 512, 1.0, 0, dtype=dtype)
    assert_parity(spelling_bee, spelling_bee_reference, inp, GRADS, dtype=dtype)


@pytest.mark.gpu
def test_compile_fullgraph_smoke():
    bee = SpellingBeeEmbedding(1000, 256).cuda()
    gen = torch.Generator().manual_seed(0)
    bee.set_byte_table(*_table(1000, gen))
    ids = torch.randint(0, 1000, (4, 64), device="cuda")
    e_tok = torch.randn(4, 64, 256, device="cuda", requires_grad=True)
    compiled = torch.compile(bee, fullgraph=True)
    out = compiled(ids, token_embeddings=e_tok)
    out.sum().backward()
    torch.testing.assert_close(out, bee(ids, token_embeddings=e_tok))
