"""A ShellElastic decoder wired from SharedMatrix/Readout, for the seed-parity tests.

Not a recipe: the smallest assembly that proves the modules reproduce seed 003's
numbers (per-tier logits, loss and gradients) and that ``extract_tier`` gives a
dense model with the same logits. The module names are the seed's, so its
checkpoint loads with ``strict=True``. One decoder function serves both the
elastic model and the dense one; only the way a weight is applied differs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from laminae.primitives.shared_matrix import ElasticTiers


def rms_norm(x, gain, eps, group=None):
    h = x.float()
    if group is not None:
        h = h.unflatten(-1, (-1, group))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h.flatten(-2).to(x.dtype) * gain if group is not None else h.to(x.dtype) * gain


def rotary(length, head_dim, theta, precision, dtype):
    freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    pos = torch.arange(length, dtype=torch.float32)
    if precision == "bfloat16":
        ang = torch.outer(pos.bfloat16().float(), freq.bfloat16().float()).bfloat16().float()
        ang = torch.cat([ang, ang], -1)
        return ang.cos().bfloat16().to(dtype), ang.sin().bfloat16().to(dtype)
    ang = torch.cat([torch.outer(pos, freq)] * 2, -1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos[None, :, None] + torch.cat((-x[..., half:], x[..., :half]), -1) * sin[None, :, None]


def decoder(ids, *, width, head_dim, eps, theta, rope_precision, num_layers, embed, gain, linear, readout):
    """The seed's decoder; ``linear(name, x)`` applies layer matrix ``name``, ``gain(name)``
    gives a norm gain cut to ``width``, ``readout(h)`` the fp32 logits."""
    x = embed(ids)
    batch, length, _ = x.shape
    cos, sin = rotary(length, head_dim, theta, rope_precision, x.dtype)
    shape = (batch, length, width // head_dim, head_dim)
    for i in range(num_layers):
        p = f"layers.{i}."
        h = rms_norm(x, gain(p + "attn_norm"), eps)
        gate = linear(p + "attn.gate_proj", h).view(shape)
        q = rms_norm(linear(p + "attn.q_proj", h), gain(p + "attn.q_norm"), eps, head_dim).view(shape)
        k = rms_norm(linear(p + "attn.k_proj", h), gain(p + "attn.k_norm"), eps, head_dim).view(shape)
        v = linear(p + "attn.v_proj", h).view(shape)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=length > 1, scale=head_dim ** -0.5).transpose(1, 2)
        x = x + linear(p + "attn.o_proj", (a * torch.sigmoid(gate)).reshape(batch, length, width))
        h = rms_norm(x, gain(p + "mlp_norm"), eps)
        up = F.silu(linear(p + "mlp.gate_proj", h)) * linear(p + "mlp.up_proj", h)
        x = x + linear(p + "mlp.down_proj", up)
    return readout(rms_norm(x, gain("norm"), eps))


class Gain(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))


class ElasticDecoder(nn.Module):
    """Seed 003's ElasticForCausalLM, assembled from the toolkit's modules."""

    def __init__(self, config: dict, backend: str = "reference"):
        super().__init__()
        self.config, self.tiers = config, ElasticTiers.from_seed_config(config)
        d, v, t = config["hidden_size"], config["vocab_size"], self.tiers
        kw = dict(init_trainable=True, backend=backend)  # the seed trains init too
        self.embed_tokens = nn.Embedding(v, d)
        self.layers = nn.ModuleList()
        for _ in range(config["num_hidden_layers"]):
            layer = nn.Module()
            layer.attn_norm = Gain(d)
            layer.attn = nn.Module()
            for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "o_proj"):
                setattr(layer.attn, name, t.shared_matrix(f"attn.{name}", **kw))
            layer.attn.q_norm, layer.attn.k_norm = Gain(d), Gain(d)
            layer.mlp_norm = Gain(d)
            layer.mlp = nn.Module()
            for name in ("gate_proj", "up_proj", "down_proj"):
                setattr(layer.mlp, name, t.shared_matrix(f"mlp.{name}", **kw))
            self.layers.append(layer)
        self.norm = Gain(d)
        self.lm_head = t.shared_matrix("lm_head", vocab_size=v, **kw)

    def forward(self, ids, tier=None):
        t, cfg = self.tiers, self.config
        tier = t.resolve(tier)
        n = t.width(tier)
        modules = dict(self.named_modules())

        def linear(name, x):
            kind = name.split(".", 2)[2]
            rows, _ = t.block_shape(kind, tier)
            return modules[name](x, rows=rows, ratio=t.fan_in_ratio(kind, tier), output_divisor=t.output_divisor(kind))

        return decoder(
            ids, width=n, head_dim=t.head_dim, eps=cfg["rms_norm_eps"], theta=cfg["rope_theta"],
            rope_precision=cfg["rope_precision"], num_layers=cfg["num_hidden_layers"],
            embed=lambda i: self.embed_tokens(i)[..., :n], gain=lambda name: modules[name].weight[:n],
            linear=linear,
            readout=lambda h: self.lm_head(h, ratio=t.fan_in_ratio("lm_head", tier),
                                           scale_index=t.logit_scale_index(tier)))


def dense_logits(state: dict, dense_config: dict, ids):
    """A plain dense decoder (no tiers, no multipliers) reading ``extract_tier``'s state dict."""
    return decoder(
        ids, width=dense_config["hidden_size"], head_dim=dense_config["head_dim"], eps=dense_config["rms_norm_eps"],
        theta=dense_config["rope_theta"], rope_precision=dense_config["rope_precision"],
        num_layers=dense_config["num_hidden_layers"], embed=lambda i: F.embedding(i, state["embed_tokens.weight"]),
        gain=lambda name: state[name + ".weight"], linear=lambda name, x: F.linear(x, state[name + ".weight"]),
        readout=lambda h: F.linear(h, state["lm_head.weight"]).float())
