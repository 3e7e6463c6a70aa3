import pytest
import torch

from laminae.primitives.spelling_bee import byte_table_from_strings, spelling_bee_reference
from laminae.triton_ops.spelling_bee import spelling_bee

from ._harness import DEVICE, MODES, PROVIDERS, run_benchmark

# NeoLLM's defaults: vocabulary 64402, hidden 512; (batch, seq) token grids
VOCAB, HIDDEN = 64402, 512
SHAPES = [(4, 512), (8, 2048), (16, 4096)]
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
GRADS = ["token_embeddings", "byte_embed"]


def _byte_table():
    # token lengths 1–18 bytes (mean ≈ 6, as in a BPE vocabulary), a few longer than 16
    gen = torch.Generator().manual_seed(0)
    lengths = (torch.randint(1, 8, (VOCAB,), generator=gen) + torch.randint(0, 12, (VOCAB,), generator=gen) // 2)
    letters = torch.randint(32, 127, (VOCAB, 18), generator=gen)
    words = [bytes(letters[v, : int(lengths[v])].tolist()) for v in range(VOCAB)]
    return byte_table_from_strings(words)


def _inputs(batch, seq):
    byte_ids, byte_len = _byte_table()
    return {
        "input_ids": torch.randint(0, VOCAB, (batch, seq), device=DEVICE),
        "token_embeddings": torch.randn(batch, seq, HIDDEN, device=DEVICE, dtype=DTYPE),
        "byte_embed": 0.02 * torch.randn(256, HIDDEN, device=DEVICE, dtype=DTYPE),
        "byte_ids": byte_ids.to(DEVICE),
        "byte_len": byte_len.to(DEVICE),
    }


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"B{s[0]}-S{s[1]}")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_spelling_bee(benchmark, provider, mode, shape):
    batch, seq = shape
    n = batch * seq
    elt = 2 if DTYPE != torch.float32 else 4
    # forward: ids, e_tok, out and 16 byte codes per token (byte_embed stays in L2); memory-bound
    bytes_moved = n * (8 + 16 * 2 + 2 * HIDDEN * elt)
    run_benchmark(benchmark, name="spelling_bee", provider=provider, mode=mode, op=spelling_bee,
                  reference=spelling_bee_reference, inputs=_inputs(batch, seq), grad_names=GRADS,
                  shape=f"V={VOCAB},d={HIDDEN},B={batch},S={seq}", bytes_moved=bytes_moved)
