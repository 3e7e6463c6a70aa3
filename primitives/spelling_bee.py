"""Spelling Bee embeddings (Rabe, Clymo & Dong 2026; NeoLLM ``use_spelling_bee_embeddings``).

Each vocabulary entry's UTF-8 bytes (first 16, padded with byte 0) are embedded with a
shared [256, d] table, rotated by their slot inside the token (rotate-half RoPE,
θ = 10000, full width) and averaged over the 16 slots; the result is averaged with the
token embedding:

    s(v)   = (1/16) · Σ_{i=0..15} R_{p_i} · byte_embed[byte_ids[v, i]]
    e_bee  = ½ · (e_tok + s(input_ids))                 e_tok: the token embeddings

``s`` depends only on the token id, so it can be baked into a [V, d] table for
inference. Open points of the spec are arguments: ``byte_position_offset`` (p_i = i or
i + 1), ``pad_mode`` ("embed": pads use byte_embed[0]; "zero": pads contribute 0, still
divided by 16) and ``mode`` ("mean", or "masked_sqrt": 1/√n over the n real bytes).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ._backend import Backend, check_backend, resolve_backend
from ._errors import ConfigError, DTypeError, ShapeError
from ._token_ids import check_token_ids, ids_in_range, nan_rows, safe_ids
from ._validation import (check_choice, check_has_tokens, check_param_dtype, check_positive_float,
                          check_positive_int, check_same_device, check_tensor, without_autocast)

__all__ = [
    "SLOTS", "SpellingBeeEmbedding", "spelling_bee_reference", "spelling_bee_rotary", "spelling_vectors",
    "byte_table_from_strings", "byte_level_token_bytes", "sentencepiece_piece_bytes", "check_byte_table",
    "parameter_count",
]

SLOTS = 16
PAD_MODES = ("embed", "zero")
MODES = ("mean", "masked_sqrt")
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def spelling_bee_rotary(hidden_size: int, theta: float = 10000.0, byte_position_offset: int = 0,
                        slots: int = SLOTS, device=None,
                        dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [slots, d/2] for p_i = i + offset and ω_j = θ^(−2j/d), computed in
    fp64 and rounded once to ``dtype`` (fp32 for the kernels, fp64 for an fp64 reference)."""
    half = hidden_size // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float64) * 2.0 / hidden_size)
    angles = (torch.arange(slots, dtype=torch.float64) + byte_position_offset)[:, None] * inv_freq[None, :]
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


def slot_weights(byte_len: torch.Tensor, pad_mode: str, mode: str, slots: int = SLOTS,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Weight of each slot [..., slots] in ``dtype`` given the real byte counts [...]."""
    n = byte_len.to(dtype)[..., None]
    real = torch.arange(slots, device=byte_len.device) < n
    if mode == "masked_sqrt":
        return torch.where(real, torch.rsqrt(n.clamp_min(1.0)), 0.0)
    if pad_mode == "zero":
        return torch.where(real, 1.0 / slots, 0.0).to(dtype)
    return torch.full(real.shape, 1.0 / slots, dtype=dtype, device=byte_len.device)


def spelling_vectors(input_ids: torch.Tensor, byte_embed: torch.Tensor, byte_ids: torch.Tensor,
                     byte_len: torch.Tensor, *, rope_theta: float = 10000.0, byte_position_offset: int = 0,
                     pad_mode: str = "embed", mode: str = "mean", upcast: bool = True) -> torch.Tensor:
    """s(v) for the given token ids [...] → [..., d] (fp32, or fp64 for fp64 byte_embed, when
    ``upcast``; else byte_embed's dtype). An id outside [0, V) gets a NaN row."""
    d = byte_embed.shape[1]
    compute = torch.promote_types(byte_embed.dtype, torch.float32) if upcast else byte_embed.dtype
    # rotation and slot weights at least as precise as fp32, fp64 for fp64 (fp32 tables cap fp64 at fp32 accuracy)
    table_dtype = torch.promote_types(compute, torch.float32)
    cos, sin = spelling_bee_rotary(d, rope_theta, byte_position_offset, byte_ids.shape[1], byte_embed.device,
                                   table_dtype)
    cos, sin = cos.to(compute), sin.to(compute)
    valid = ids_in_range(input_ids, byte_ids.shape[0])
    input_ids = safe_ids(input_ids, valid)
    u = byte_embed.to(compute)[byte_ids[input_ids].long()]  # [..., 16, d]
    lo, hi = u[..., : d // 2], u[..., d // 2:]
    rotated = torch.cat([lo * cos - hi * sin, hi * cos + lo * sin], dim=-1)
    w = slot_weights(byte_len[input_ids], pad_mode, mode, byte_ids.shape[1], table_dtype).to(compute)
    return nan_rows(torch.einsum("...i,...id->...d", w, rotated), valid)


def spelling_bee_reference(
    input_ids: torch.Tensor,
    token_embeddings: torch.Tensor,
    byte_embed: torch.Tensor,
    byte_ids: torch.Tensor,
    byte_len: torch.Tensor,
    *,
    rope_theta: float = 10000.0,
    byte_position_offset: int = 0,
    pad_mode: str = "embed",
    mode: str = "mean",
    upcast: bool = True,
) -> torch.Tensor:
    """e_bee = ½·(token_embeddings + s(input_ids)).

    Args:
        input_ids: token ids ``[...]`` (e.g. ``[batch, seq]``), integer, in [0, V); an id
            outside gives a NaN row (its token embedding still receives ½ of the gradient).
        token_embeddings: ``[..., d]`` for the same ids (dense row or Leviathan output).
        byte_embed: ``[256, d]`` byte table, d even.
        byte_ids: ``[V, 16]`` integer bytes of every vocabulary entry (pad 0).
        byte_len: ``[V]`` number of real bytes, min(len, 16).
        upcast: fp32 math (the ground truth) vs the same-dtype eager baseline.
    Returns:
        ``[..., d]`` in token_embeddings' dtype.
    """
    s = spelling_vectors(input_ids, byte_embed, byte_ids, byte_len, rope_theta=rope_theta,
                         byte_position_offset=byte_position_offset, pad_mode=pad_mode, mode=mode, upcast=upcast)
    base = token_embeddings.to(s.dtype) if upcast else token_embeddings
    return (0.5 * (base + s.to(base.dtype))).to(token_embeddings.dtype)


# ----------------------------------------------------------------------------
# Byte tables
# ----------------------------------------------------------------------------

def _gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's byte→unicode alphabet used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_UNICODE_TO_BYTE = _gpt2_unicode_to_byte()


def byte_level_token_bytes(token: str) -> bytes:
    """Exact bytes of a byte-level BPE token string (GPT-2/Llama-3/Qwen style), read through
    the byte↔unicode alphabet. Do not use ``tokenizer.decode([id])``: it turns partial
    UTF-8 sequences into U+FFFD and loses bytes."""
    try:
        return bytes(_UNICODE_TO_BYTE[ch] for ch in token)
    except KeyError as exc:
        raise ConfigError(f"`token` {token!r} has a character outside the byte-level alphabet: {exc}") from None


def sentencepiece_piece_bytes(piece: str) -> bytes:
    """Bytes of a SentencePiece piece: ``<0xHH>`` byte-fallback pieces are the byte HH,
    "▁" is a space, anything else is UTF-8."""
    hex_digits = piece[3:5]
    if (len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")
            and all(c in "0123456789abcdefABCDEF" for c in hex_digits)):
        return bytes([int(hex_digits, 16)])
    return piece.replace("\u2581", " ").encode("utf-8")


def byte_table_from_strings(byte_strings: Sequence[bytes | str], vocab_size: int | None = None,
                            slots: int = SLOTS) -> tuple[torch.Tensor, torch.Tensor]:
    """Build ``(byte_ids [V, slots] int16, byte_len [V] int16)`` from one byte string per id.

    ``str`` entries are UTF-8 encoded (use :func:`byte_level_token_bytes` or
    :func:`sentencepiece_piece_bytes` first for tokenizer-internal spellings). Strings
    are truncated to their first ``slots`` bytes and padded with 0. Ids from
    ``len(byte_strings)`` to ``vocab_size`` (a padded vocabulary) are empty.
    """
    count = len(byte_strings)
    vocab_size = count if vocab_size is None else vocab_size
    check_positive_int("vocab_size", vocab_size)
    if count > vocab_size:
        raise ConfigError(f"`byte_strings` has {count} entries, more than vocab_size={vocab_size}")
    byte_ids = torch.zeros(vocab_size, slots, dtype=torch.int16)
    byte_len = torch.zeros(vocab_size, dtype=torch.int16)
    for v, entry in enumerate(byte_strings):
        raw = entry.encode("utf-8") if isinstance(entry, str) else bytes(entry)
        raw = raw[:slots]
        if raw:
            byte_ids[v, : len(raw)] = torch.tensor(list(raw), dtype=torch.int16)
        byte_len[v] = len(raw)
    return byte_ids, byte_len


def check_byte_table(byte_ids: torch.Tensor, byte_len: torch.Tensor, vocab_size: int, slots: int = SLOTS) -> None:
    """A hand-supplied table: shapes [V, slots] and [V], integer, bytes in [0, 255], lengths in [0, slots]."""
    check_tensor("byte_ids", byte_ids, shape=(vocab_size, slots), dtypes=_INT_DTYPES,
                 layout="(vocab_size, 16) UTF-8 bytes per token")
    check_tensor("byte_len", byte_len, shape=(vocab_size,), dtypes=_INT_DTYPES)
    if byte_ids.numel() and (int(byte_ids.min()) < 0 or int(byte_ids.max()) > 255):
        raise ConfigError(f"`byte_ids` must hold bytes in [0, 255], got values in "
                          f"[{int(byte_ids.min())}, {int(byte_ids.max())}]")
    if byte_len.numel() and (int(byte_len.min()) < 0 or int(byte_len.max()) > slots):
        raise ConfigError(f"`byte_len` must be in [0, {slots}], got values in "
                          f"[{int(byte_len.min())}, {int(byte_len.max())}]")


# ----------------------------------------------------------------------------
# Module
# ----------------------------------------------------------------------------

class SpellingBeeEmbedding(nn.Module):
    """Spelling Bee byte-level augmentation of token embeddings:
    ``e_bee = module(input_ids, token_embeddings=e_tok)``.

    Args:
        vocab_size: V (rows of the byte table; ids must be in [0, V)).
        hidden_size: d, even (rotate-half pairing).
        rope_theta: RoPE base θ (10000).
        byte_position_offset: p_i = i + offset, 0 (first byte unrotated; recommended) or 1.
        pad_mode: "embed" (pads use byte_embed[0]; default) or "zero".
        mode: "mean" (fixed 1/16 mean; default) or "masked_sqrt" (1/√n over real bytes).
        initializer_range: std of the byte table init (0.02).
        backend: "auto" | "triton" | "reference".
        validate_ids: read the ids and raise :class:`TokenIdError` for any outside
            [0, V) (on a GPU a device sync per call). ``False`` (default, every device):
            no check, such ids give NaN rows on every backend.

    Parameters: ``byte_embed.weight`` [256, d] (the only one: 256·d). Buffers:
    ``byte_ids`` [V, 16] int16, ``byte_len`` [V] int16, ``table_ready`` (persistent, so a
    checkpoint works without the tokenizer); ``baked`` [V, d] (non-persistent) after
    :meth:`bake_inference_table`.

    Shapes: ``input_ids`` [...] integer, ``token_embeddings`` [..., d] fp32/bf16/fp16 →
    ``[..., d]`` in token_embeddings' dtype. The block reads no mask: every position is
    embedded alone (a padded position's row is as meaningless as its id).

    Example::

        bee = SpellingBeeEmbedding(vocab_size=64402, hidden_size=512)
        bee.set_byte_table_from_strings([tokenizer_bytes(v) for v in range(len(tokenizer))])
        h = bee(input_ids, token_embeddings=embed_tokens(input_ids))
    """

    def __init__(self, vocab_size: int, hidden_size: int, rope_theta: float = 10000.0,
                 byte_position_offset: int = 0, pad_mode: str = "embed", mode: str = "mean",
                 initializer_range: float = 0.02, backend: Backend = "auto", validate_ids: bool = False) -> None:
        super().__init__()
        check_positive_int("vocab_size", vocab_size)
        check_positive_int("hidden_size", hidden_size)
        if hidden_size % 2:
            raise ConfigError(f"`hidden_size` must be even for the rotate-half byte rotary, got {hidden_size}")
        check_positive_float("rope_theta", rope_theta)
        check_choice("byte_position_offset", byte_position_offset, (0, 1))
        check_choice("pad_mode", pad_mode, PAD_MODES)
        check_choice("mode", mode, MODES)
        check_positive_float("initializer_range", initializer_range)
        check_backend(backend)
        check_choice("validate_ids", validate_ids, (True, False))
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.rope_theta, self.byte_position_offset = float(rope_theta), byte_position_offset
        self.pad_mode, self.mode = pad_mode, mode
        self.backend, self.validate_ids = backend, validate_ids
        self.byte_embed = nn.Embedding(256, hidden_size)
        nn.init.normal_(self.byte_embed.weight, std=initializer_range)
        self.register_buffer("byte_ids", torch.zeros(vocab_size, SLOTS, dtype=torch.int16))
        self.register_buffer("byte_len", torch.zeros(vocab_size, dtype=torch.int16))
        self.register_buffer("table_ready", torch.tensor(False))
        # the buffer carries the flag in checkpoints; forward reads this mirror, so it never
        # reads a device tensor (a sync on a GPU, a graph break under torch.compile)
        self._table_ready = False
        self.baked: torch.Tensor | None = None

    def extra_repr(self) -> str:
        return (f"vocab_size={self.vocab_size}, hidden_size={self.hidden_size}, rope_theta={self.rope_theta}, "
                f"byte_position_offset={self.byte_position_offset}, pad_mode={self.pad_mode!r}, "
                f"mode={self.mode!r}, backend={self.backend!r}")

    def _options(self) -> dict:
        return dict(rope_theta=self.rope_theta, byte_position_offset=self.byte_position_offset,
                    pad_mode=self.pad_mode, mode=self.mode)

    # -- byte table ---------------------------------------------------------
    @torch.no_grad()
    def set_byte_table(self, byte_ids: torch.Tensor, byte_len: torch.Tensor) -> None:
        """Store a prepared table (see :func:`byte_table_from_strings`); drops any bake."""
        check_byte_table(byte_ids, byte_len, self.vocab_size)
        self.byte_ids.copy_(byte_ids.to(torch.int16))
        self.byte_len.copy_(byte_len.to(torch.int16))
        self.table_ready.fill_(True)
        self._table_ready = True
        self.unbake()

    def set_byte_table_from_strings(self, byte_strings: Sequence[bytes | str]) -> None:
        """One byte string per token id (fewer than V: the remaining ids are empty)."""
        self.set_byte_table(*byte_table_from_strings(byte_strings, self.vocab_size))

    # -- baked inference ----------------------------------------------------
    @torch.no_grad()
    def bake_inference_table(self) -> torch.Tensor:
        """Precompute S = [s(v) for all v] ([V, d], fp32 math (fp64 for fp64), stored in byte_embed's dtype);
        forward becomes ½·(e_tok + S[ids]). Only in eval mode; ``train()`` drops it."""
        self._require_table()
        weight = self.byte_embed.weight
        ids = torch.arange(self.vocab_size, device=weight.device)
        self.baked = spelling_vectors(ids, weight, self.byte_ids, self.byte_len, **self._options()).to(weight.dtype)
        return self.baked

    @torch.no_grad()
    def fold_into_embedding(self, embedding_weight: torch.Tensor) -> torch.Tensor:
        """For a dense token table E [V, d]: return E' = ½·(E + S), so inference is one
        lookup ``E'[ids]`` and this module can be dropped from the inference graph."""
        check_tensor("embedding_weight", embedding_weight, shape=(self.vocab_size, self.hidden_size))
        baked = self.baked if self.baked is not None else self.bake_inference_table()
        work = torch.promote_types(embedding_weight.dtype, torch.float32)
        return (0.5 * (embedding_weight.to(work) + baked.to(work))).to(embedding_weight.dtype)

    def unbake(self) -> None:
        self.baked = None

    def train(self, mode: bool = True):
        if mode:
            self.unbake()  # a parameter update would make the bake stale
        return super().train(mode)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        flag = state_dict.get(prefix + "table_ready")
        if isinstance(flag, torch.Tensor) and flag.device.type != "meta":
            self._table_ready = bool(flag)
            self.unbake()

    def _require_table(self) -> None:
        if not self._table_ready:
            raise RuntimeError("SpellingBeeEmbedding: the byte table is not set; call set_byte_table(...) or "
                               "set_byte_table_from_strings(...) once after construction")

    # -- forward ------------------------------------------------------------
    def _check(self, ids: torch.Tensor, e_tok: torch.Tensor) -> None:
        check_tensor("input_ids", ids, dtypes=(torch.int64, torch.int32))
        check_tensor("token_embeddings", e_tok, dtypes=(torch.float32, torch.float16, torch.bfloat16, torch.float64))
        check_has_tokens("input_ids", ids, ids.dim())
        if tuple(e_tok.shape) != (*ids.shape, self.hidden_size):
            raise ShapeError(f"`token_embeddings` must have shape input_ids.shape + (hidden_size,) = "
                             f"{(*ids.shape, self.hidden_size)}, got {tuple(e_tok.shape)}")
        check_same_device(input_ids=ids, token_embeddings=e_tok, byte_embed=self.byte_embed.weight)
        check_param_dtype("token_embeddings", e_tok, self.byte_embed.weight)
        if self.validate_ids:
            check_token_ids("input_ids", ids, self.vocab_size)

    def forward(self, input_ids: torch.Tensor, *, token_embeddings: torch.Tensor) -> torch.Tensor:
        ids, e_tok = input_ids, token_embeddings
        self._check(ids, e_tok)
        self._require_table()
        if self.baked is not None:
            if self.training:
                raise RuntimeError("SpellingBeeEmbedding is baked but in training mode; call unbake() first")
            work = torch.promote_types(e_tok.dtype, torch.float32)
            valid = ids_in_range(ids, self.vocab_size)
            s = nan_rows(self.baked[safe_ids(ids, valid)].to(work), valid)
            return (0.5 * (e_tok.to(work) + s)).to(e_tok.dtype)
        args = (ids, e_tok, self.byte_embed.weight, self.byte_ids, self.byte_len)
        with without_autocast(e_tok.device.type):
            if resolve_backend(self.backend, e_tok) == "triton":
                from laminae.triton_ops.spelling_bee import spelling_bee

                if e_tok.dtype == torch.float64:
                    raise DTypeError("the Triton Spelling Bee supports fp32/bf16/fp16, got float64; "
                                     "use backend='reference'")
                return spelling_bee(*args, **self._options())
            return spelling_bee_reference(*args, **self._options())


def parameter_count(hidden_size: int) -> int:
    """Extra parameters Spelling Bee adds to a model: the byte table, 256·d."""
    return 256 * hidden_size

