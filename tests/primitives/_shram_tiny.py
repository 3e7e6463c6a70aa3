"""A two-layer SHRAM model assembled in plain PyTorch around :class:`MoSRAH`, enough
to run the seed-parity fixtures (``tests/data/seed_parity/shram_tiny*``, produced by the public
SHRAM implementation): embeddings, pre-norm layers with a sliding-window local path
plus the MoSRAH path, SwiGLU MLP, final norm, LM head, CE + 0.01·Σ LB."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from laminae.primitives.blocks.rotary import rotary_embedding
from laminae.primitives.mosrah import MoSRAH

SPARSE = "attention.sparse_attention."


def build_layers(cfg: dict, weights: dict, backend: str = "reference") -> list[MoSRAH]:
    layers = []
    for i in range(cfg["num_decoder_layers"]):
        prefix = f"model.layers.{i}.{SPARSE}"
        m = MoSRAH(cfg["embedding_width"], cfg["num_mosrah_heads"], cfg["num_selected_heads"], cfg["head_dim"],
                   cfg["rope_mode"], cfg["mosrah_rope_theta"], cfg["training_sequence_length"],
                   cfg.get("inference_sequence_length"), cfg["alpha"], cfg["beta"], backend=backend)
        m.load_state_dict({k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}, strict=True)
        layers.append(m)
    return layers


def _local(a, w, prefix, cfg):
    B, N, _ = a.shape
    heads, u = cfg["num_sliding_window_heads"], cfg["head_dim"]
    q, k, v = ((a @ w[prefix + f"{n}_proj.weight"].t()).view(B, N, heads, u) for n in "qkv")
    inv = 1.0 / (cfg["local_rope_theta"] ** (torch.arange(0, u, 2, dtype=torch.float32) / u))
    pos = torch.arange(N)[None, :, None].expand(B, N, heads)
    q, k = rotary_embedding(q, pos, inv), rotary_embedding(k, pos, inv)
    dist = torch.arange(N)[:, None] - torch.arange(N)[None, :]
    ok = (dist >= 0) & (dist < cfg["window_size"])
    s = torch.einsum("bnhu,bmhu->bhnm", q, k) / math.sqrt(u)
    o = torch.einsum("bhnm,bmhu->bnhu", torch.softmax(s.masked_fill(~ok, float("-inf")), -1), v)
    return o.reshape(B, N, heads * u) @ w[prefix + "o_proj.weight"].t()


def forward(cfg: dict, w: dict, layers: list[MoSRAH], input_ids: torch.Tensor, labels: torch.Tensor):
    """``(logits, loss, Σ LB, max MaxVio)``; ``w`` holds the non-MoSRAH weights."""
    def norm(t, g):
        return F.rms_norm(t, (t.shape[-1],), g, cfg["rms_norm_eps"])

    h = w["embed_tokens.weight"][input_ids]
    lb, vio = 0.0, torch.tensor(float("-inf"))
    for i, mosrah in enumerate(layers):
        p = f"model.layers.{i}."
        a = norm(h, w[p + "attn_norm.weight"])
        out = mosrah(a)
        h = h + _local(a, w, p + "attention.local_attention.", cfg) + out.output
        lb, vio = lb + out.load_balance_loss, torch.maximum(vio, out.max_vio)
        z = norm(h, w[p + "mlp_norm.weight"])
        gate = F.silu(z @ w[p + "mlp.gate_proj.weight"].t())
        h = h + (gate * (z @ w[p + "mlp.up_proj.weight"].t())) @ w[p + "mlp.down_proj.weight"].t()
    logits = norm(h, w["model.norm.weight"]) @ w["lm_head.weight"].t()
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
    return logits, ce + 0.01 * lb, lb, vio
