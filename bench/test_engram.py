import pytest
import torch

from laminae.primitives.engram import MultiHeadHashLookup, engram_fusion_gate_reference, engram_lookup_reference
from laminae.triton_ops.engram import engram_fusion_gate, engram_lookup

from ._harness import DEVICE, MODES, PROVIDERS, run_benchmark

DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
# (batch, seq, heads, table_size, compress_dim, out_dim, max_ngram)
LOOKUP_SHAPES = [(4, 512, 4, 4093, 64, 512, 3), (4, 2048, 4, 16381, 64, 1024, 3)]
GATE_SHAPES = [(4 * 512, 256), (4 * 2048, 512)]


@pytest.mark.parametrize("shape", LOOKUP_SHAPES, ids=lambda s: "B{}-S{}-H{}-T{}-C{}-D{}-N{}".format(*s))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_engram_lookup(benchmark, provider, mode, shape):
    b, s, h, t, c, d, n = shape
    lookup = MultiHeadHashLookup(num_heads=h, table_size=t, compress_dim=c, out_dim=d, max_ngram=n)
    comp = torch.randn(b, s, c, device=DEVICE)
    inputs = {"compressed": (comp / comp.norm(dim=-1, keepdim=True)).to(DTYPE),
              "hash_projs": lookup.hash_projs().to(DEVICE), "bit_weights": lookup.bit_weights.to(DEVICE),
              "tables": torch.randn(h, t, d, device=DEVICE)}
    run_benchmark(benchmark, name="engram_lookup", provider=provider, mode=mode, op=engram_lookup,
                  reference=engram_lookup_reference, inputs=inputs, grad_names=["tables"],
                  shape="B={},S={},H={},T={},C={},D={},N={}".format(*shape))


@pytest.mark.parametrize("shape", GATE_SHAPES, ids=lambda s: f"N{s[0]}-F{s[1]}")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_engram_fusion_gate(benchmark, provider, mode, shape):
    rows, f = shape
    inputs = {k: torch.randn(rows, f, device=DEVICE, dtype=DTYPE) for k in ("hidden_low", "key_low", "value")}
    inputs.update(hidden_norm_weight=torch.ones(f, device=DEVICE), ngram_norm_weight=torch.ones(f, device=DEVICE))
    run_benchmark(benchmark, name="engram_fusion_gate", provider=provider, mode=mode, op=engram_fusion_gate,
                  reference=engram_fusion_gate_reference, inputs=inputs, grad_names=list(inputs),
                  shape=f"N={rows},F={f}", bytes_moved=4 * rows * f * inputs["value"].element_size())
