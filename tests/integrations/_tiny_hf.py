"""Tiny transformers models (no download) and their laminae twins, for the integration tests."""
from __future__ import annotations

import copy

import torch
import transformers

from laminae.integrations.transformers import convert
from laminae.primitives import GroupedQueryAttention, RotaryEmbedding

FAMILIES = ("llama", "qwen3")
VOCAB = 64
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def token_ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def left_padding(batch: int, length: int, left: int) -> torch.Tensor:
    """All ones but the last row's first ``left`` positions."""
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[-1, :left] = 0
    return mask.to(DEVICE)


def tiny_config(family: str, layers: int = 2):
    shared = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, max_position_embeddings=64,
                  pad_token_id=0, bos_token_id=1, eos_token_id=None, tie_word_embeddings=False)
    if family == "llama":
        return transformers.LlamaConfig(**shared)
    return transformers.Qwen3Config(**shared)


def model_class(family: str):
    return transformers.LlamaForCausalLM if family == "llama" else transformers.Qwen3ForCausalLM


def tiny_model(family: str, core: str, backend: str = "reference", layers: int = 2, seed: int = 0, **options):
    torch.manual_seed(seed)
    model = model_class(family)(tiny_config(family, layers)).to(DEVICE)
    return convert(model, core, backend=backend, **options)


def gqa_twin(attn, config, core: str, backend: str) -> GroupedQueryAttention:
    """laminae's own attention block with the weights of the converted transformers module
    ``attn`` and a copy of its core."""
    D, H, Hkv = attn.head_dim, config.num_attention_heads, config.num_key_value_heads
    qk_norm = hasattr(attn, "q_norm")
    gqa = GroupedQueryAttention(
        config.hidden_size, H, Hkv, D, core="sdpa" if core == "xsa" else copy.deepcopy(attn.laminae_core),
        rope=RotaryEmbedding(D, theta=config.rope_parameters["rope_theta"]), qk_norm=qk_norm,
        norm_eps=config.rms_norm_eps, xsa=core == "xsa", backend=backend)
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj") + (("q_norm", "k_norm") if qk_norm else ()):
            getattr(gqa, name).weight.copy_(getattr(attn, name).weight)
    return gqa.to(DEVICE).eval()


def run_gqa(gqa: GroupedQueryAttention, x, positions, keep):
    """``gqa``'s output for hidden ``x``, positions and keep mask."""
    return gqa(x, keep, position_ids=positions)[0]


def run_hf_attention(model, attn, x, positions, padding):
    """The transformers attention module ``attn`` on hidden ``x``, with the mask and
    rotary tables its model would build for the 2-D ``padding`` mask."""
    from transformers.masking_utils import create_causal_mask

    mask = create_causal_mask(model.config, x, padding, None, positions)
    return attn(x, position_embeddings=model.model.rotary_emb(x, positions), attention_mask=mask)[0]


def greedy(model, ids, padding, steps: int):
    """Greedy decoding by full forwards (no cache): the tokens and each step's last logits."""
    logits = []
    for _ in range(steps):
        with torch.no_grad():
            last = model(ids, attention_mask=padding, use_cache=False).logits[:, -1]
        logits.append(last)
        nxt = last.argmax(-1, keepdim=True)
        ids, padding = torch.cat([ids, nxt], 1), torch.cat([padding, torch.ones_like(nxt)], 1)
    return ids, logits


def core_parameters(model) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if ".laminae_" in n}
