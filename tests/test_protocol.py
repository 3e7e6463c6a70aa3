"""One protocol for every block (docs/protocol.md): caches, masks, backend switching,
autocast, named errors, exports. Each test guards a silent wrong result or a
convention a new user relies on; shapes are tiny, reference backend unless the
kernel path is the point."""
import copy
import importlib
import inspect
import math
import typing

import pytest
import torch

from laminae.primitives import (AppendBuffer, BackendUnavailableError, ConfigError, DecodingCache, DERFAttention,
                                DTypeError, EngramModule, ExclusiveSelfAttention, HRMRefinementBlock, LAuReL,
                                MoMRead, MoSRAH, ShapeError, SharedMatrix, SpellingBeeEmbedding, StackMemory, set_backend,
                                use_backend)
from laminae.primitives import _mechanisms as mechanisms
from laminae.primitives._errors import DeviceError
from laminae.primitives.leviathan import LeviathanGenerator
from laminae.primitives.laurel import laurel_reference

from ._blocks import BLOCKS, BY_NAME, HIDDEN
from ._helpers import host_reads
from ._mechanisms import CASES

MASKED = [b for b in BLOCKS if b.masked]


def _x(B=2, T=7, seed=0):
    return torch.randn(B, T, HIDDEN, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------
# One return convention: [0] the output, [1] the cache
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.name)
def test_forward_returns_output_then_cache(block):
    """``forward(..., cache=None) -> (output, cache, ...)``: a block that put anything
    else at ``[1]`` (MoSRAH's load-balance loss, StackMemory's depth state) fails here.
    ``[1]`` of an uncached call is a cache built from it, or None for the documented
    blocks whose cache is storage only decoding needs; a cached call always returns
    a new cache holding its tokens too."""
    m = block.build("reference")
    x = _x(T=5)
    with torch.no_grad():
        first = block.call(m, x, None, None)
        assert isinstance(first, tuple) and len(first) >= 2
        if hasattr(first, "_fields"):
            assert first._fields[:2] == ("output", "cache")
        assert torch.is_tensor(first[0]) and first[0].shape[:2] == (2, 5)
        if block.start is None:
            assert isinstance(first[1], DecodingCache) and first[1].length == 5
            cache = first[1]
        else:
            assert first[1] is None
            cache = block.call(m, x, None, block.start(m, x))[1]
            assert isinstance(cache, DecodingCache) and cache.length == 5
        step = block.call(m, x[:, :1], None, cache)
    assert type(step) is type(first) and torch.is_tensor(step[0]) and step[0].shape[:2] == (2, 1)
    assert isinstance(step[1], DecodingCache) and step[1] is not cache and step[1].length == 6
    assert cache.length == 5


# The contract table of docs/protocol.md, per kind of module: the positional
# parameters after ``self`` (every other one keyword-only), and the fields a NamedTuple
# return starts with (None: a bare tensor is the only return)
POSITIONAL_RULES = {
    mechanisms.CORE: [("q", "k", "v", "attention_mask", "cache")],
    mechanisms.SEQUENCE: [("x", "attention_mask", "cache")],
    mechanisms.TOKEN: [("input_ids",), ("input_ids", "attention_mask")],
    mechanisms.POSITION_WISE: [(None,), (None, "attention_mask")],      # None: the activation, any name
    mechanisms.STREAMS: [("x", "y")],
}
RETURN_FIELDS = {mechanisms.CORE: ("output", "cache"), mechanisms.SEQUENCE: ("output", "cache"),
                 mechanisms.TOKEN: None, mechanisms.POSITION_WISE: ("output",), mechanisms.STREAMS: ("x", "y")}
# a routing decision, not an activation: MoSRAH's router returns Routing(indices, weights, ...)
RETURN_EXCEPTIONS = {"MoSRAHRouter"}
DECLARED_MODULES = [(f"laminae.primitives.{m.stem}", name, kind) for m in mechanisms.MECHANISMS
                    for name, kind in m.modules.items()]
# the building blocks and recipe layers the contract table names (RotaryEmbedding is a
# function of positions, not a block: `forward(x, position_ids, start=0)`)
DECLARED_MODULES += [
    ("laminae.primitives.blocks", "GroupedQueryAttention", mechanisms.SEQUENCE),
    ("laminae.primitives.blocks", "SlidingWindowAttention", mechanisms.SEQUENCE),
    ("laminae.recipes.assembly", "HybridAttention", mechanisms.SEQUENCE),
    *[("laminae.primitives.blocks", name, mechanisms.POSITION_WISE)
      for name in ("SparseMoE", "GroupedSwiGLU", "SwiGLU", "RMSNorm", "HCOutputMix")],
]


def _contract_violations(cls, kind) -> list[str]:
    wrong = []
    params = list(inspect.signature(cls.forward).parameters.values())[1:]
    positional = tuple(p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD)
    others = [p for p in params if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if positional != tuple(params[i].name for i in range(len(positional))) or others:
        wrong.append(f"forward{inspect.signature(cls.forward)}: only keyword-only parameters after the positional ones")
    if not any(len(rule) == len(positional) and all(r in (None, p) for r, p in zip(rule, positional))
               for rule in POSITIONAL_RULES[kind]):
        wrong.append(f"positional {positional}, the rule is one of {POSITIONAL_RULES[kind]}")
    for p in params:
        if p.name in ("attention_mask", "cache") and p.default is not None:
            wrong.append(f"`{p.name}` defaults to {p.default!r}, not None")
    decodes = kind in mechanisms.DECODING_KINDS
    if ("cache" in [p.name for p in params]) != decodes or hasattr(cls, "empty_cache") != decodes:
        wrong.append("a cache parameter and empty_cache exactly when the kind decodes")
    if decodes:
        start = list(inspect.signature(cls.empty_cache).parameters.values())[1:]
        if [(p.name, p.kind, p.default) for p in start] != [
                ("batch", inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty),
                ("dtype", inspect.Parameter.KEYWORD_ONLY, None), ("device", inspect.Parameter.KEYWORD_ONLY, None)]:
            wrong.append(f"empty_cache{inspect.signature(cls.empty_cache)}, not (batch, *, dtype=None, device=None)")
    returns = typing.get_type_hints(cls.forward).get("return")
    fields = RETURN_FIELDS[kind]
    if cls.__name__ not in RETURN_EXCEPTIONS and returns is not torch.Tensor and (
            fields is None or getattr(returns, "_fields", ())[:len(fields)] != fields):
        wrong.append(f"returns {returns}, not a NamedTuple starting with {fields}"
                     + ("" if decodes else " or a tensor"))
    return wrong


@pytest.mark.parametrize("package, name, kind", DECLARED_MODULES, ids=[n for _, n, _ in DECLARED_MODULES])
def test_every_declared_module_follows_the_contract_of_its_kind(package, name, kind):
    """docs/protocol.md's contract table, read from the signatures: one argument order
    per kind of block, keyword-only side inputs, ``empty_cache(batch, *, dtype=None,
    device=None)`` exactly on the decoding blocks, ``output`` (and ``cache``) first."""
    cls = getattr(importlib.import_module(package), name)
    assert not _contract_violations(cls, kind), _contract_violations(cls, kind)


def _takes_cache(cls) -> bool:
    return isinstance(cls, type) and issubclass(cls, torch.nn.Module) and \
        "cache" in inspect.signature(cls.forward).parameters


# decoding modules outside tests/_blocks.py and why; a new one must join BLOCKS or this list
NOT_IN_BLOCKS = {
    "GroupedQueryAttention": "AttentionOutput(output, cache, depth_entry); its cores are blocks",
    "DecoderModel": "a model: DecoderOutput(hidden, cache, ...), read by name",
    "CausalLM": "a model: LMOutput(logits, ...), read by name",
    "ElasticCausalLM": "a model: LMOutput",
    "StreamDecoderModel": "a model: DecoderOutput",
}


def test_every_decoding_block_is_checked():
    decoding = set()
    for package in ("laminae.primitives", "laminae.recipes.assembly"):
        module = importlib.import_module(package)
        decoding |= {name for name in module.__all__ if _takes_cache(getattr(module, name))}
    covered = {type(block.build("reference")).__name__ for block in BLOCKS}
    assert decoding - covered == set(NOT_IN_BLOCKS), "add the block to tests/_blocks.py"


# ----------------------------------------------------------------------------
# Caches: branching, never mutated, O(1) appends
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.name)
def test_two_next_steps_from_one_cache_are_both_right(block):
    """Beam search: continue one prefix cache with two different tokens, then each
    branch further, interleaved; every output equals the full forward of its own
    sequence (DERF was 0.77 off when caches were updated in place)."""
    m = block.build("reference")
    x = _x(T=9)
    a = x.clone()
    b = x.clone()
    b[:, 5:] = _x(T=4, seed=1)                       # branch b differs from token 5 on
    with torch.no_grad():
        full_a, _ = block.run(m, a, None, None)
        full_b, _ = block.run(m, b, None, None)
        _, prefix = block.run(m, a[:, :4], None, None)
        _, prefix = block.run(m, a[:, 4:5], None, prefix)   # the prefix's storage now has spare room,
        length = prefix.length                              # so both branches could write into it
        outs = {"a": [], "b": []}
        caches = {"a": prefix, "b": prefix}
        for t in range(5, 9):
            for name, seq in (("a", a), ("b", b)):       # interleaved: a steps, then b from its own cache
                out, caches[name] = block.run(m, seq[:, t:t + 1], None, caches[name])
                outs[name].append(out)
        assert prefix.length == length == 5                  # the prefix cache was never changed
        out_a2, _ = block.run(m, a[:, 5:6], None, prefix)    # and still continues correctly
    torch.testing.assert_close(torch.cat(outs["a"], 1), full_a[:, 5:], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(torch.cat(outs["b"], 1), full_b[:, 5:], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out_a2, full_a[:, 5:6], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.name)
def test_cache_reset_starts_a_new_sequence(block):
    m = block.build("reference")
    x = _x(T=4)
    with torch.no_grad():
        full, _ = block.run(m, x, None, None)
        _, cache = block.run(m, _x(T=6, seed=3), None, None)
        cache.reset()
        assert cache.length == 0
        out, cache = block.run(m, x, None, cache)
    torch.testing.assert_close(out, full, atol=2e-5, rtol=1e-4)
    assert cache.length == 4


@pytest.mark.parametrize("name", [b.name for b in BLOCKS])
def test_empty_cache_records_batch_dtype_device_and_clones(name):
    """``empty_cache(batch, *, dtype, device)`` is the one way to start decoding; the
    cache answers ``length``/``batch``/``dtype``/``device``/``config``, a clone
    continues like the original, and a cache of another batch or device is refused."""
    block = BY_NAME[name]
    m = block.build("reference")
    cache = m.empty_cache(3)
    assert (cache.length, cache.batch, cache.dtype, cache.device) == (0, 3, torch.float32, torch.device("cpu"))
    assert cache.config and isinstance(cache.config, dict)
    x = _x(B=3, T=4)
    with torch.no_grad():
        _, filled = block.run(m, x, None, cache)
        twin = filled.clone()
        out_a, _ = block.run(m, x[:, :1], None, filled)
        out_b, _ = block.run(m, x[:, :1], None, twin)
    assert twin is not filled and twin.length == filled.length == 4 and cache.length == 0
    torch.testing.assert_close(out_b, out_a, atol=0, rtol=0)
    with pytest.raises(ShapeError, match="batch"):
        block.run(m, _x(B=2, T=1), None, filled)
    with pytest.raises(DeviceError, match="cache"):
        block.run(m, x, None, m.empty_cache(3, device="meta"))


def test_linear_appends_reuse_storage_and_double_capacity():
    buf = AppendBuffer()
    reallocations = 0
    for t in range(200):
        previous = buf._storage
        buf = buf.append(key=torch.full((1, 1, 2), float(t)))
        reallocations += buf._storage is not previous
    # capacity doubling: 16, 32, ..., 256 — a handful of reallocations, never one per token
    assert reallocations == math.ceil(math.log2(200 / 16)) + 1 and buf.capacity == 256
    assert buf.get("key")[0, :, 0].tolist() == [float(t) for t in range(200)]
    branch = AppendBuffer(buf._storage, 100).append(key=torch.full((1, 1, 2), -1.0))   # copy-on-branch
    assert branch.get("key")[0, 100, 0] == -1 and buf.get("key")[0, 100, 0] == 100


def test_cache_of_another_configuration_is_refused():
    q, k, v = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8)
    derf = DERFAttention(2, 1, 8, backend="reference")
    _, cache = derf(q, k, v, cache=derf.empty_cache(1))
    with pytest.raises(ConfigError, match="num_kv_heads"):
        DERFAttention(2, 2, 8, backend="reference")(q, torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 8),
                                                     cache=cache)
    with pytest.raises(TypeError, match="DERFCache"):
        BY_NAME["elo_attention"].run(BY_NAME["elo_attention"].build("reference"), _x(T=3), None, cache)
    with pytest.raises(DTypeError, match="cache"):
        DERFAttention(2, 1, 8, backend="reference")(q.double(), k.double(), v.double(), cache=cache)


# ----------------------------------------------------------------------------
# Masks and padding
# ----------------------------------------------------------------------------


FLOAT_MASKS = {
    "all-zero additive (an unpadded batch)": torch.zeros(2, 5),
    "additive": torch.zeros(2, 5).index_fill_(1, torch.tensor([0, 1]), float("-inf")),
    "0./1. keep": torch.ones(2, 5),
}


@pytest.mark.parametrize("block", MASKED, ids=lambda b: b.name)
def test_floating_mask_is_refused_by_dtype(block):
    """A floating mask is refused whatever its values, with the sentence that converts
    it: the additive mask of an unpadded batch is all zeros, which read as a keep mask
    dropped every token (DERF, LUCID, Elo and MoSRAH returned exact zeros)."""
    m = block.build("reference")
    for kind, mask in FLOAT_MASKS.items():
        with pytest.raises(DTypeError, match=r"attention_mask=\(mask == 0\)`; .* `attention_mask=mask.bool\(\)`"):
            block.run(m, _x(T=5), mask, None)


@pytest.mark.parametrize("block", MASKED, ids=lambda b: b.name)
def test_integer_mask_reads_as_nonzero(block):
    """Tokenizers return integer 0/1 masks; they mean what the bool mask means."""
    m = block.build("reference")
    x = _x(T=6)
    mask = _padding("left+hole")
    with torch.no_grad():
        want, _ = block.run(m, x, mask, None)
        got, _ = block.run(m, x, mask.long(), None)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_integer_mask_values_are_checked_only_in_debug_mode(monkeypatch):
    from laminae.primitives._validation import check_keep_mask

    mask = torch.tensor([[1, 0, 2]])
    monkeypatch.delenv("LAMINAE_DEBUG", raising=False)
    assert host_reads(lambda: check_keep_mask("attention_mask", mask, 1, 3)) == 0
    assert check_keep_mask("attention_mask", mask, 1, 3).tolist() == [[True, False, True]]
    monkeypatch.setenv("LAMINAE_DEBUG", "1")
    with pytest.raises(ConfigError, match="only 0 and 1"):
        check_keep_mask("attention_mask", mask, 1, 3)


def _padding(layout: str) -> torch.Tensor:
    mask = torch.ones(2, 6, dtype=torch.bool)
    if layout == "left+hole":
        mask[0, :2] = False      # left padding
        mask[1, 3] = False       # a hole
    else:                        # right padding: the last positions dropped, ragged
        mask[0, 4:] = False
        mask[1, 5:] = False
    return mask


@pytest.mark.parametrize("layout", ["left+hole", "right"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("block", MASKED, ids=lambda b: b.name)
def test_nan_in_padding_never_reaches_kept_tokens(block, backend, layout):
    """LUCID and Memory Caching multiplied padded contents by 0 (0·NaN = NaN)."""
    m = block.build(backend)
    x = _x(T=6)
    mask = _padding(layout)
    poisoned = torch.where(mask[..., None], x, torch.full_like(x, float("nan")))
    with torch.no_grad():
        clean, _ = block.run(m, torch.where(mask[..., None], x, torch.zeros_like(x)), mask, None)
        out, _ = block.run(m, poisoned, mask, None)
    assert torch.isfinite(out[mask]).all()
    torch.testing.assert_close(out[mask], clean[mask], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------
# Backend switching, autocast, named errors
# ----------------------------------------------------------------------------


def test_set_backend_reaches_every_block_and_use_backend_restores():
    model = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), BY_NAME["engram"].build("auto"),
                                torch.nn.ModuleList([LAuReL(HIDDEN, backend="reference")]))
    engram = model[1]
    with use_backend(model, "triton"):
        assert {engram.lookup.backend, engram.gate.backend, model[2][0].backend, engram.backend} == {"triton"}
    assert (engram.backend, engram.lookup.backend, model[2][0].backend) == ("auto", "auto", "reference")
    set_backend(model, "reference")
    assert engram.lookup.backend == engram.gate.backend == "reference"
    engram.backend = "triton"                       # a parent's setting reaches its children
    assert engram.lookup.backend == engram.gate.backend == "triton"
    with pytest.raises(ConfigError):
        set_backend(model, "cuda")


def _laminae_backends(model):
    return {m.backend for m in model.modules() if hasattr(m, "backend")}


def test_set_backend_reaches_every_mechanism():
    """Every declared mechanism's modules (tests/_mechanisms.py), inside a foreign model."""
    model = torch.nn.Sequential(torch.nn.ModuleList([case.build("auto") for case in CASES]))
    with use_backend(model, "triton"):
        assert _laminae_backends(model) == {"triton"}
    assert _laminae_backends(model) == {"auto"}
    set_backend(model, "reference")
    assert _laminae_backends(model) == {"reference"}


def test_every_mechanism_runs_under_cpu_autocast():
    """Each declared mechanism's module alone, fed what autocast produces (bf16
    activations from a linear layer): finite outputs and gradients (the reference path;
    the walk-through runs both backends under autocast inside a model and compares them)."""
    wrong = []
    for case in CASES:
        module = case.build("reference")
        inputs = [t.requires_grad_() if t.is_floating_point() else t for t in case.inputs(2, 3)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            acts = [torch.nn.functional.linear(t, torch.eye(t.shape[-1])) if t.is_floating_point() else t
                    for t in inputs]
            outs = case.call(module, *acts)
        grads = torch.autograd.grad(sum(o.float().sum() for o in outs),
                                    [t for t in inputs if t.is_floating_point()]
                                    + [p for p in module.parameters() if p.requires_grad],
                                    allow_unused=True)
        if not all(torch.isfinite(o.float()).all() for o in outs) or \
                not all(g is None or torch.isfinite(g).all() for g in grads):
            wrong.append(case.stem)
    assert not wrong, wrong


def test_float64_laurel_reference_computes_in_float64():
    g = torch.Generator().manual_seed(0)
    f, x = torch.randn(3, 4, dtype=torch.float64, generator=g), torch.randn(3, 4, dtype=torch.float64, generator=g)
    a, b = torch.tensor(0.3, dtype=torch.float64), torch.tensor(-1.1, dtype=torch.float64)
    w = torch.softmax(torch.stack([a, b]), 0)
    assert (laurel_reference(x, a, b, sublayer_output=f) - (w[0] * f + w[1] * x)).abs().max() < 1e-15


def test_dtype_mismatch_with_module_parameters_is_a_named_error():
    x = torch.randn(1, 3, HIDDEN, dtype=torch.bfloat16)
    with pytest.raises(DTypeError, match="parameters"):
        MoMRead(HIDDEN, 2, 8, 2, 2, 4)(x, M_blocks=MoMRead.init_bank(4, 2, HIDDEN))
    with pytest.raises(DTypeError, match="parameters"):
        EngramModule(HIDDEN, 8, num_heads=2, table_size=31)(x)


def test_triton_backend_errors_say_what_to_do(monkeypatch):
    xsa = ExclusiveSelfAttention(2, 1, 4, backend="triton")
    y, v = torch.randn(1, 2, 2, 4, device="meta"), torch.randn(1, 2, 1, 4, device="meta")
    with pytest.raises(BackendUnavailableError, match="meta tensors"):
        xsa(y, v=v)
    common = importlib.import_module("laminae.triton_ops._common")
    monkeypatch.setattr(common, "INTERPRET_AT_IMPORT", False)
    with pytest.raises(BackendUnavailableError, match="before the first import"):
        xsa(torch.randn(1, 2, 2, 4), v=torch.randn(1, 2, 1, 4))


def test_functional_ops_on_cpu_without_the_interpreter_say_what_to_do(monkeypatch):
    """Every exported op checks its tensors' device as the modules do: Triton's own
    error was "0 active drivers ([]). There should only be one."."""
    ops = importlib.import_module("laminae.triton_ops")
    exported = [getattr(ops, name) for name in ops._EXPORTS]   # kernel files imported while interpreting
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendUnavailableError, match="on CPU set TRITON_INTERPRET=1 before importing triton"):
        ops.xsa(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 1, 4))
    for op in exported:           # the check comes first, whatever the arguments
        with pytest.raises(BackendUnavailableError, match="needs CUDA tensors"):
            op(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 1, 4))


def test_triton_backend_under_torch_compile_on_cpu_is_refused():
    xsa = ExclusiveSelfAttention(2, 1, 4, backend="triton")
    compiled = torch.compile(xsa, backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="torch.compile needs CUDA"):
        compiled(torch.randn(1, 2, 2, 4), v=torch.randn(1, 2, 1, 4))


def _data_dependent(graph: torch.fx.GraphModule) -> list[str]:
    """Nodes of a captured graph whose value or size depends on tensor data (an
    ``.item()``, a boolean index, a size read from a tensor): a graph break without
    ``fullgraph=True``, an unbacked size inductor cannot lower, a host sync in eager."""
    found = []
    for node in graph.graph.nodes:
        value = node.meta.get("example_value")
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)) or (
                    isinstance(v, torch.Tensor) and not all(isinstance(s, int) for s in v.shape)):
                found.append(node.format_node())
    return found


def _layer_cases():
    """The attention layers around the mechanisms, as (name, build(backend), inputs(batch, seq), call)."""
    from laminae.primitives import GroupedQueryAttention, SlidingWindowAttention

    x = lambda b, s: (torch.randn(b, s, HIDDEN),)                              # noqa: E731
    hybrid = BY_NAME["hybrid_attention"]
    return [
        ("grouped_query_attention", lambda be: GroupedQueryAttention(HIDDEN, 2, 1, 8, core=DERFAttention(2, 1, 8,
                                                                                                     backend=be)),
         x, lambda m, h: m(h, position_ids=torch.arange(h.shape[1])[None])),
        ("sliding_window_attention", lambda be: SlidingWindowAttention(HIDDEN, 2, 8, window_size=3, backend=be),
         x, lambda m, h: m(h)),
        ("hybrid_attention", hybrid.build, x, lambda m, h: hybrid.call(m, h, None, None)),
    ]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_an_input_without_tokens_is_refused_by_every_block(backend):
    """The empty-input rule (docs/protocol.md): a batch or a sequence of size 0 is a
    ShapeError naming the argument, on either backend, before any kernel (four blocks
    refused S = 0 and three returned empty outputs; MoSRAH and Memory Caching crashed
    on a batch of 0)."""
    cases = [(c.stem, c.build, c.inputs, c.call) for c in CASES] + _layer_cases()
    wrong = []
    for name, build, inputs, call in cases:
        module = build(backend)
        for batch, seq in ((2, 0), (0, 3)):
            try:
                call(module, *inputs(batch, seq))
                wrong.append((name, batch, seq, "accepted"))
            except ShapeError as e:
                if "at least one token" not in str(e):
                    wrong.append((name, batch, seq, str(e)))
            except Exception as e:  # noqa: BLE001 (a raw error is what the rule replaces)
                wrong.append((name, batch, seq, f"{type(e).__name__}: {e}"))
    assert not wrong, "\n".join(map(str, wrong))


def test_the_tiny_cases_and_blocks_are_the_declared_ones():
    """The cross-cutting lists run over the declarations (primitives/_mechanisms.py): a
    case or a block for a stem nobody declared is a list that drifted."""
    from laminae.primitives._mechanisms import DECODING, STEMS

    from . import _blocks, _mechanisms

    assert [c.stem for c in CASES] == STEMS
    assert set(_mechanisms.BY_STEM) <= set(STEMS), "declare the mechanism in primitives/_mechanisms.py"
    assert set(_blocks._BY_STEM) <= set(DECODING), "declare the decoding mechanism in primitives/_mechanisms.py"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.stem)
def test_every_mechanism_compiles_to_one_static_graph(case):
    """``torch.compile(fullgraph=True)`` of each mechanism's reference path, forward and
    backward through one compiled artefact: one graph with static shapes (MoSRAH's
    packing read the largest head load with ``.item()`` and moved rows by boolean
    indexing), equal to eager."""
    torch._dynamo.reset()
    module = case.build("reference")
    eager = copy.deepcopy(module)           # training mode: the same state updates (affine's EMA) on both
    graphs = []

    def capture(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    compiled = torch.compile(lambda *inputs: case.call(module, *inputs), fullgraph=True, backend=capture)
    inputs = [t.requires_grad_() if t.is_floating_point() else t for t in case.inputs(2, 3)]
    outs = compiled(*inputs)
    sum(o.float().sum() for o in outs).backward()
    assert len(graphs) == 1 and not _data_dependent(graphs[0]), _data_dependent(graphs[0])
    grads = [t.grad for t in inputs if t.is_floating_point()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    with torch.no_grad():
        for got, want in zip(outs, case.call(eager, *inputs)):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------
# Exports
# ----------------------------------------------------------------------------


def test_triton_ops_exports_are_the_functions_even_after_the_files_are_imported():
    ops = importlib.import_module("laminae.triton_ops")
    for name, stem in ops._EXPORTS.items():
        importlib.import_module(f"laminae.triton_ops.{stem}")       # the file binds its name first
        fn = getattr(ops, name)
        assert callable(fn) and not isinstance(fn, type(ops)), name
        exec(f"from laminae.triton_ops import {name} as imported", scope := {})
        assert scope["imported"] is fn


def test_package_metadata():
    import laminae
    from importlib.metadata import requires, version

    assert laminae.__version__ == version("laminae")
    pins = " ".join(requires("laminae"))
    assert "numpy<2.4" in pins.replace(" ", "")


def test_tour_takes_device_and_dtype(capsys):
    from laminae.triton_ops import tour

    with pytest.raises(SystemExit):
        tour.main(["xsa", "--dtype", "bfloat16", "--device", "cpu"])
    assert "needs --device cuda" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            tour.main(["xsa", "--device", "cuda"])
    assert tour.main(["xsa", "--reps", "1", "--device", "cpu", "--dtype", "float32"]) == 0


def test_mom_router_mean_ignores_left_padding_and_decodes():
    """The router's causal mean runs over kept tokens: a left-padded row gives the
    outputs of the same tokens without padding, in a full forward and when decoding."""
    block = BY_NAME["mom_read"]
    m = block.build("reference")
    x = _x(B=1, T=6)
    padded = torch.cat([_x(B=1, T=2, seed=5), x], 1)
    mask = torch.ones(1, 8, dtype=torch.bool)
    mask[:, :2] = False
    with torch.no_grad():
        plain, _ = block.run(m, x, None, None)
        out, _ = block.run(m, padded, mask, None)
        _, cache = block.run(m, padded[:, :5], mask[:, :5], None)
        steps = []
        for t in range(5, 8):
            step, cache = block.run(m, padded[:, t:t + 1], None, cache)
            steps.append(step)
    torch.testing.assert_close(out[:, 2:], plain, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(torch.cat(steps, 1), plain[:, 3:], atol=1e-6, rtol=1e-5)


def test_mosrah_cache_of_another_configuration_is_refused():
    x = _x(B=1, T=3)
    small = MoSRAH(HIDDEN, num_mosrah_heads=2, num_selected_heads=1, head_dim=8, training_sequence_length=32)
    cache = small(x, cache=small.empty_cache(1)).cache
    assert cache.length == 3 and cache.config == {"num_mosrah_heads": 2, "head_dim": 8}
    wide = MoSRAH(HIDDEN, num_mosrah_heads=4, num_selected_heads=2, head_dim=8, training_sequence_length=32)
    with pytest.raises(ConfigError, match="num_mosrah_heads"):
        wide(x, cache=cache)
    with pytest.raises(TypeError, match="MoSRAHCache"):
        wide(x, cache=AppendBuffer())


def test_hybrid_attention_cache_of_another_window_is_refused():
    block = BY_NAME["hybrid_attention"]
    with torch.no_grad():
        _, cache = block.run(block.build("reference"), _x(T=4), None, None)
        assert cache.length == 4 and cache.config["window"] == 3
        other = block.build("reference")
        other.local_attention.window = 5
        with pytest.raises(ConfigError, match="window"):
            block.run(other, _x(T=1), None, cache)
