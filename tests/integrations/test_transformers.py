"""laminae cores inside real transformers models (Llama, and Qwen3 with its QK-norm),
built from tiny configs with grouped-query attention (4 query heads, 2 key/value heads):
equality with laminae's own attention block, training, generate(), save/load, padding."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from laminae.integrations.transformers import CORES, load_pretrained  # noqa: E402

from ._tiny_hf import (DEVICE, FAMILIES, core_parameters, gqa_twin, greedy, left_padding, model_class,  # noqa: E402
                       run_gqa, run_hf_attention, tiny_model, token_ids)


@pytest.fixture(scope="module")
def models():
    """One converted model per (family, core) on the reference backend, built on first use."""
    built: dict = {}

    def get(family: str, core: str):
        if (family, core) not in built:
            built[family, core] = tiny_model(family, core).eval()
        return built[family, core]

    return get


# ----------------------------------------------------------------------------
# (1) the transformers attention module with a core == GroupedQueryAttention with it
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("family", FAMILIES)
def test_attention_module_equals_laminae_block(family, core, backend):
    model = tiny_model(family, core, backend=backend, layers=1).eval()
    attn = model.model.layers[0].self_attn
    assert attn.laminae_core.backend == backend
    with torch.no_grad():
        for p in core_parameters(model).values():   # away from the init, where some cores are plain softmax
            p.add_(0.3 * torch.randn_like(p))
    gqa = gqa_twin(attn, model.config, core, backend)
    x = torch.randn(2, 4, model.config.hidden_size, device=DEVICE)
    positions = torch.arange(4, device=DEVICE)[None]
    padding = left_padding(2, 4, left=1)
    with torch.no_grad():
        ours = run_hf_attention(model, attn, x, positions, padding.bool())
        theirs = run_gqa(gqa, x, positions, padding.bool())
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_derf_context_gate_gates_the_attention_read_by_the_hidden_state():
    model = tiny_model("llama", "derf", layers=1, context_gate=True, gate_init_bias=1.0).eval()
    attn = model.model.layers[0].self_attn
    gqa = gqa_twin(attn, model.config, "derf", "reference")
    with torch.no_grad():
        gqa.o_proj.weight.copy_(torch.eye(model.config.hidden_size))   # the twin returns the attention read
    x = torch.randn(2, 4, model.config.hidden_size, device=DEVICE)
    positions, padding = torch.arange(4, device=DEVICE)[None], left_padding(2, 4, left=1).bool()
    with torch.no_grad():
        ours = run_hf_attention(model, attn, x, positions, padding)
        theirs = attn.o_proj(attn.laminae_gate(x, retrieved=run_gqa(gqa, x, positions, padding)))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------
# (2) training
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("core", CORES)
def test_adamw_steps_lower_the_loss_and_reach_the_core_parameters(core, backend):
    model = tiny_model("llama", core, backend=backend, layers=1, **({"context_gate": True} if core == "derf" else {}))
    ids = token_ids(1, 5, seed=1)
    new, attn = core_parameters(model), model.model.layers[0].self_attn
    assert (len(new) > 0) == (core in ("derf", "elo", "affine"))   # LUCID and XSA add no parameter
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    largest = dict.fromkeys(new, 0.0)
    first = None
    for _ in range(2):
        loss = model(ids, labels=ids).loss
        first = loss.item() if first is None else first
        optimizer.zero_grad()
        loss.backward()
        for name, p in new.items():
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
            largest[name] = max(largest[name], p.grad.abs().max().item())
        for proj in (attn.q_proj, attn.k_proj):   # through the core to the queries and keys
            assert proj.weight.grad is not None and proj.weight.grad.abs().max() > 0
        optimizer.step()
    assert model(ids, labels=ids).loss.item() < first
    # Elo's K-factor gets a gradient once its gain has left 0 (after the first step)
    assert all(g > 0 for g in largest.values()), largest


# ----------------------------------------------------------------------------
# (3) generate() with transformers' DynamicCache == greedy over full forwards
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("family", FAMILIES)
def test_generate_equals_full_forward_greedy(models, family, core):
    model = models(family, core)
    ids = token_ids(2, 5, seed=2)
    padding = torch.ones_like(ids)
    out = model.generate(ids, attention_mask=padding, max_new_tokens=4, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    tokens, logits = greedy(model, ids, padding, 4)
    assert torch.equal(out.sequences, tokens)
    worst = max((a - b).abs().max().item() for a, b in zip(out.logits, logits))
    assert worst <= 1e-5, worst


# ----------------------------------------------------------------------------
# (4) save_pretrained / load_pretrained
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("core", CORES)
def test_save_and_load_restore_the_logits_exactly(tmp_path, core):
    options = {"context_gate": True} if core == "derf" else {}
    model = tiny_model("qwen3", core, **options).eval()
    with torch.no_grad():
        for p in core_parameters(model).values():
            p.add_(torch.randn_like(p))
        for name, buffer in model.named_buffers():
            if ".laminae_" in name:
                buffer.uniform_(0.2, 0.8)   # affine's running mean α_ma
    model.save_pretrained(tmp_path)
    again = load_pretrained(model_class("qwen3"), str(tmp_path)).eval()
    assert again.config.laminae == model.config.laminae
    ids = token_ids(2, 6, seed=3)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


# ----------------------------------------------------------------------------
# (5) a left-padded batch generates what each row generates alone
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("family", FAMILIES)
def test_left_padded_batch_generates_the_rows_alone(models, family, core):
    model = models(family, core)
    ids = token_ids(2, 6, seed=4)
    padding = left_padding(2, 6, left=2)
    ids[-1, :2] = 0
    kw = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    batch = model.generate(ids, attention_mask=padding, **kw)
    for row in range(2):
        kept = ids[row:row + 1, padding[row].bool()]
        alone = model.generate(kept, attention_mask=torch.ones_like(kept), **kw)
        assert torch.equal(batch.sequences[row, -4:], alone.sequences[0, -4:])
        worst = max((a[row] - b[0]).abs().max().item() for a, b in zip(batch.logits, alone.logits))
        assert worst <= 1e-5, worst
