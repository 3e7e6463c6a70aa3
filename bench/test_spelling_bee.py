import pytest
import torch

from laminae.primitives.spelling_bee import byte_table_from_strings, spelling_bee_reference
from laminae.triton_ops.spelling_bee import spelling_bee

from ._harness import DEVICE, MODES, PROVIDERS, by_mode, run_benchmark

# NeoLLM's vocabulary 64402; (batch, seq, hidden): NeoLLM's hidden 512, and the goal shape
# of the kernel estimates (8 × 2048 tokens, hidden 1024)
VOCAB = 64402
SHAPES = [(4, 512, 512), (8, 2048, 512), (16, 4096, 512), (8, 2048, 1024)]
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
GRADS = ["token_embeddings", "byte_embed"]


def _byte_table():
    # token lengths 1–18 bytes (mean ≈ 6, as in a BPE vocabulary), a few longer than 16
    gen = torch.Generator().manual_seed(0)
    lengths = (torch.randint(1, 8, (VOCAB,), generator=gen) + torch.randint(0, 12, (VOCAB,), generator=gen) // 2)
    letters = torch.randint(32, 127, (VOCAB, 18), generator=gen)
    words = [bytes(letters[v, : int(lengths[v])].tolist()) for v in range(VOCAB)]
    return byte_table_from_strings(words)


def _inputs(batch, seq, hidden):
    byte_ids, byte_len = _byte_table()
    return {
        "input_ids": torch.randint(0, VOCAB, (batch, seq), device=DEVICE),
        "token_embeddings": torch.randn(batch, seq, hidden, device=DEVICE, dtype=DTYPE),
        "byte_embed": 0.02 * torch.randn(256, hidden, device=DEVICE, dtype=DTYPE),
        "byte_ids": byte_ids.to(DEVICE),
        "byte_len": byte_len.to(DEVICE),
    }


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"B{s[0]}-S{s[1]}-d{s[2]}")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_spelling_bee(benchmark, provider, mode, shape):
    batch, seq, hidden = shape
    n = batch * seq
    elt = 2 if DTYPE != torch.float32 else 4
    # Memory-bound, no matmul: compulsory bytes only. Forward: ids, 16 byte codes per token,
    # e_tok and the output (byte_embed stays in L2). Backward: ids and codes again, g read,
    # d e_tok and d byte_embed written. The backward kernel does ~5 FLOPs per live (token,
    # slot) and column (docs/benchmarks.md), far below any matmul rate.
    fwd = n * (8 + 16 * 2 + 2 * hidden * elt)
    bwd = n * (8 + 16 * 2 + 2 * hidden * elt) + 256 * hidden * elt
    run_benchmark(benchmark, name="spelling_bee", provider=provider, mode=mode, op=spelling_bee,
                  reference=spelling_bee_reference, inputs=_inputs(batch, seq, hidden), grad_names=GRADS,
                  shape=f"V={VOCAB},d={hidden},B={batch},S={seq}", bytes_moved=by_mode(fwd, fwd + bwd))
