"""The new-user walk-through: each block dropped into a small GPT written the way
another codebase would write it (token embedding, pre-norm layers, LM head),
trained a step on both backends under CPU autocast, switched with ``set_backend``,
and decoded with beam-search-style branching. Small shapes, CPU, both backends.
Every declared mechanism (``primitives/_mechanisms.py``) runs here, and every decoding
one decodes: a declared stem the model does not wire fails its tests."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from laminae.primitives import (AffineScaledAttention, DERFAttention, EloAttention, EngramModule,
                                ExclusiveSelfAttention, HRMRefinementBlock, LAuReL, LeviathanGenerator, LucidAttention,
                                MemoryCacheBranch, MoMRead, MoSRAH, SharedMatrix, SiameseNormFinal, SiameseNormLayer,
                                SpellingBeeEmbedding, StackMemory, set_backend, siamese_start)
from laminae.primitives._mechanisms import DECODING, STEMS

VOCAB, D, H, HKV, HD, B, T = 32, 16, 2, 1, 8, 2, 6
CORES = {
    "derf": lambda: DERFAttention(H, HKV, HD),
    "elo_attention": lambda: EloAttention(H, HKV, HD),
    "lucid_attention": lambda: LucidAttention(H, HKV, HD),
}
# blocks that transform each position (or token) alone; the model's SDPA mixes tokens
POSITION_WISE = ["hrm_refinement", "spelling_bee", "leviathan", "shared_matrix"]
# the decoding blocks that are this model's only token mixing (in place of its attention)
MEMORIES = {"engram": "engram", "mom_read": "mom", "memory_caching": "memory", "stack_memory": "stack",
            "mosrah": "mosrah"}
WIRED = {"laurel", "siamese_norm", "xsa", "affine_scaled_attention", *CORES, *POSITION_WISE, *MEMORIES}


class Attention(nn.Module):
    """The foreign codebase's attention layer; ``core`` is a laminae block or SDPA."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.q, self.kv, self.o = nn.Linear(D, H * HD), nn.Linear(D, 2 * HKV * HD), nn.Linear(H * HD, D)
        if kind in CORES:
            self.core = CORES[kind]()
        elif kind == "affine_scaled_attention":
            self.core = AffineScaledAttention(D, H, HKV, HD, initializer_range=0.3)
        elif kind == "xsa":
            self.xsa = ExclusiveSelfAttention(H, HKV, HD)

    def forward(self, h, mask=None, cache=None):
        q = self.q(h).view(*h.shape[:2], H, HD)
        k, v = self.kv(h).view(*h.shape[:2], 2, HKV, HD).unbind(2)
        if self.kind == "affine_scaled_attention":
            y, cache = self.core(q, k, v, mask, cache, x=h)
        elif hasattr(self, "core"):
            y, cache = self.core(q, k, v, mask, cache)
        else:
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.repeat_interleave(H // HKV, 2).transpose(1, 2),
                                               v.repeat_interleave(H // HKV, 2).transpose(1, 2),
                                               is_causal=True).transpose(1, 2)
            if self.kind == "xsa":
                y = self.xsa(y, v=v)
        return self.o(y.flatten(2)), cache


class TinyGPT(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        assert kind in WIRED, f"declared mechanism {kind!r}: wire it into the walk-through's TinyGPT"
        torch.manual_seed(0)
        self.kind = kind
        self.embed, self.head = nn.Embedding(VOCAB, D), nn.Linear(D, VOCAB)
        self.norm1, self.norm2 = nn.RMSNorm(D), nn.RMSNorm(D)
        self.attn = Attention(kind)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        if kind == "laurel":
            self.residual = LAuReL(D, use_rw=True, use_lr=True, lr_rank=4)
        elif kind == "siamese_norm":
            self.layer = SiameseNormLayer(D, 0, lambda h: self.attn(h)[0], self.mlp)
            self.final = SiameseNormFinal(D)
        elif kind == "memory_caching":
            self.memory = MemoryCacheBranch(D, 2, 4, segment_len=3, gate_dim=4)
        elif kind == "mom_read":
            self.bank = nn.Parameter(MoMRead.init_bank(4, 2, D, std=0.5))
            self.mom = MoMRead(D, 2, 8, 2, 2, 4, initializer_range=0.3)
            nn.init.ones_(self.mom.mom_scale)
        elif kind == "engram":
            self.engram = EngramModule(D, 8, num_heads=2, table_size=31, gate_init_bias=0.5)
        elif kind == "stack_memory":
            self.stack = StackMemory(D, stack_d_model=8, num_mem_heads=2, stack_slots=4, mode="temporal")
        elif kind == "mosrah":
            self.mosrah = MoSRAH(D, num_mosrah_heads=4, num_selected_heads=2, head_dim=HD, training_sequence_length=32)
        elif kind == "leviathan":
            self.embed = LeviathanGenerator(vocab_size=VOCAB, hidden_size=D, seed_dim=8, num_modes=2, num_knots=4,
                                            rank=4)
        elif kind == "spelling_bee":
            self.bee = SpellingBeeEmbedding(VOCAB, D)
            self.bee.set_byte_table_from_strings([f"w{i}" for i in range(VOCAB)])
        elif kind == "hrm_refinement":
            self.refine = HRMRefinementBlock(D, 8, 2)
            nn.init.normal_(self.refine.up.weight, std=0.2)
        elif kind == "shared_matrix":     # the MLP at a half-width tier of nested matrices
            self.up, self.down = SharedMatrix(4 * D, D, base_fan_in=D), SharedMatrix(D, 4 * D, base_fan_in=2 * D)
            nn.init.normal_(self.down.delta, std=0.1)

    def empty_cache(self, batch):
        """Where decoding starts: the empty cache of this model's one token-mixing block
        (a memory block or the attention core)."""
        memory = MEMORIES.get(self.kind)
        if memory:
            return getattr(self, memory).empty_cache(batch)
        return self.attn.core.empty_cache(batch) if hasattr(self.attn, "core") else None

    def forward(self, tokens, mask=None, cache=None):
        x = self.embed(tokens)
        if self.kind == "spelling_bee":
            x = self.bee(tokens, token_embeddings=x)
        if self.kind == "siamese_norm":
            return self.head(self.final(*self.layer(*siamese_start(x)))), None
        if self.kind == "engram":
            read, cache, _ = self.engram(x, mask, cache)
            x = x + read
        elif self.kind == "mom_read":
            read, cache = self.mom(self.norm1(x), mask, cache, M_blocks=self.bank)
            x = x + read
        elif self.kind == "memory_caching":
            read, cache = self.memory(self.norm1(x), mask, cache)
            x = x + read
        elif self.kind == "mosrah":
            read, cache = self.mosrah(self.norm1(x), mask, cache)[:2]
            x = x + read
        elif self.kind == "stack_memory":      # its output is the augmented stream
            x, cache = self.stack(x, mask, cache)[:2]
        if self.kind in CORES or self.kind in ("affine_scaled_attention", "xsa", "laurel", *POSITION_WISE):
            # (the memory blocks above are this model's only token mixing, so they decode alone)
            a, cache = self.attn(self.norm1(x), mask, cache=cache)
            x = x + a
        if self.kind == "shared_matrix":
            h = F.gelu(self.up(self.norm2(x), mask, rows=2 * D, ratio=0.5))
            m = self.down(h, mask, rows=D, ratio=0.5)
        else:
            m = self.mlp(self.norm2(x))
        x = self.residual(x, sublayer_output=m) if self.kind == "laurel" else x + m
        if self.kind == "hrm_refinement":
            x = self.refine(x).output
        return self.head(x), cache


def _tokens(seed=0, length=T):
    return torch.randint(0, VOCAB, (B, length), generator=torch.Generator().manual_seed(seed))


def _loss_and_grads(model, tokens, mask):
    logits, _ = model(tokens, mask)
    keep = torch.ones_like(tokens, dtype=torch.bool) if mask is None else mask.bool()
    loss = F.cross_entropy(logits[:, :-1][keep[:, 1:]].float(), tokens[:, 1:][keep[:, 1:]])
    grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad], allow_unused=True)
    return loss, grads


@pytest.mark.parametrize("kind", STEMS)
def test_block_trains_on_both_backends_and_under_autocast(kind):
    model = TinyGPT(kind).eval()   # eval: affine's EMA stays put, so both backends see one model
    tokens = _tokens()
    mask = None
    if kind not in ("siamese_norm", "xsa", "laurel", "mom_read"):
        mask = torch.ones(B, T, dtype=torch.bool)
        mask[1, :2] = False                                  # left padding
    results, autocast = {}, {}
    for backend in ("reference", "triton"):
        set_backend(model, backend)
        results[backend] = _loss_and_grads(model, tokens, mask)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast[backend] = _loss_and_grads(model, tokens, mask)
        loss, grads = autocast[backend]
        assert torch.isfinite(loss) and all(g is None or torch.isfinite(g).all() for g in grads)
    (loss_r, grads_r), (loss_t, grads_t) = results["reference"], results["triton"]
    torch.testing.assert_close(loss_t, loss_r, atol=1e-5, rtol=1e-5)
    for gr, gt in zip(grads_r, grads_t):
        if gr is not None:
            torch.testing.assert_close(gt, gr, atol=1e-4, rtol=1e-3)
    # Under autocast both paths round at different points, so they agree to bf16
    # precision, not bitwise: the loss to 2 %, each gradient to 10 % of its norm (plus
    # 2e-3, for gradients that cancel to almost nothing, e.g. a bias feeding a softmax).
    (loss_r, grads_r), (loss_t, grads_t) = autocast["reference"], autocast["triton"]
    torch.testing.assert_close(loss_t, loss_r, atol=0, rtol=2e-2)
    for gr, gt in zip(grads_r, grads_t):
        if gr is not None:
            gr, gt = gr.float(), gt.float()
            assert (gt - gr).norm() <= 0.1 * gr.norm() + 2e-3, ((gt - gr).norm(), gr.norm())


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("kind", DECODING)
def test_block_decodes_with_branching_under_autocast(kind, backend):
    """Greedy prefix, then two beams that share it; each equals its own full forward
    (the shared cache is never changed behind the caller's back)."""
    model = set_backend(TinyGPT(kind).eval(), backend)
    prompt = _tokens(length=4)
    beams = {"a": torch.tensor([[3], [5]]), "b": torch.tensor([[7], [1]])}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind != "lucid_attention"):
        _, shared = model(prompt, cache=model.empty_cache(B))
        seqs, decoded = [], []
        for name, token in beams.items():
            cache, seq, outs = shared, prompt, []
            for step in range(2):
                logits, cache = model(token, cache=cache)
                outs.append(logits)
                seq = torch.cat([seq, token], 1)
                token = logits[:, -1:].argmax(-1)
            seqs.append(seq)
            decoded.append(torch.cat(outs, 1))
        assert shared.length == 4
        # both beams' full forwards in one batch: one (interpreter) run instead of two
        full, _ = model(torch.cat(seqs, 0))
        torch.testing.assert_close(torch.cat(decoded, 0).float(), full[:, 4:].float(), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", STEMS)
def test_block_trains_under_cuda_autocast(kind, dtype):
    model = TinyGPT(kind).cuda().eval()
    tokens = _tokens().cuda()
    with torch.autocast("cuda", dtype=dtype):
        loss, grads = _loss_and_grads(model, tokens, None)
    assert torch.isfinite(loss) and all(g is None or torch.isfinite(g).all() for g in grads)
