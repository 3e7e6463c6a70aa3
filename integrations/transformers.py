"""laminae attention cores inside Hugging Face ``transformers`` models (``pip install laminae[transformers]``).

Importing this module registers, with transformers' ``AttentionInterface``, one
attention function per core whose math is a function of (q, K, V), each running the
laminae module that :func:`convert` gives every attention module:

- ``laminae_derf``: :class:`~laminae.primitives.DERFAttention` (``derf_alpha``,
  ``derf_bias``, ``derf_gamma`` [H]; with ``context_gate=True`` also a
  :class:`~laminae.primitives.DERFContextGate` on the attention read);
- ``laminae_elo``: :class:`~laminae.primitives.EloAttention` (``elo_log_k``, ``elo_gain`` [H]);
- ``laminae_affine``: :class:`~laminae.primitives.AffineScaledAttention` (``alpha_proj``
  [H, hidden], buffer ``alpha_ma`` [H]);
- ``laminae_lucid``: :class:`~laminae.primitives.LucidAttention` (no parameter);
- ``laminae_xsa``: softmax attention + :class:`~laminae.primitives.ExclusiveSelfAttention`
  (no parameter).

``convert(model, "derf", **options)`` gives every attention module of ``model`` its core
(``self_attn.laminae_core``, the laminae module itself: its init, parameter names and
``backend``), selects the implementation and records the choice in
``model.config.laminae``; ``save_pretrained`` then writes the new parameters with the
rest, and :func:`load_pretrained` reads that field back, converts, and loads them
strictly. Each mask form transformers passes is read explicitly
(:mod:`laminae.integrations._hf_masks`); what a core cannot honour is refused with a
named error (ConfigError, ShapeError, DTypeError).

Example::

    model = convert(LlamaForCausalLM(config), "derf")
    tokens = model.generate(input_ids, max_new_tokens=8, do_sample=False)
    model.save_pretrained(folder)
    again = load_pretrained(LlamaForCausalLM, folder)
"""
from __future__ import annotations

import functools
import glob
import os
from typing import Any

import torch
import transformers
from packaging.specifiers import SpecifierSet
from torch import nn

from laminae.primitives import BACKENDS, BackendUnavailableError, ConfigError, ShapeError

from ._hf_cores import CORES, OPTIONS, attend, build_core
from ._hf_masks import keep_mask_from_hf

__all__ = ["CORES", "IMPLEMENTATIONS", "SUPPORTED_TRANSFORMERS", "convert", "load_pretrained", "register"]

# The transformers releases this module is tested with (the `transformers` extra pins the same range).
SUPPORTED_TRANSFORMERS = ">=5.24,<5.25"
IMPLEMENTATIONS = {kind: f"laminae_{kind}" for kind in CORES}


def _check_version() -> None:
    installed = transformers.__version__
    if not SpecifierSet(SUPPORTED_TRANSFORMERS).contains(installed, prereleases=True):
        raise BackendUnavailableError(
            f"laminae.integrations.transformers supports transformers{SUPPORTED_TRANSFORMERS}, but "
            f"transformers {installed} is installed; install a supported one with "
            "`pip install 'laminae[transformers]'`")


def _supported() -> bool:
    try:
        _check_version()
    except BackendUnavailableError:
        return False
    return True


def register() -> None:
    """Register every ``laminae_<core>`` name with transformers' ``AttentionInterface``,
    and ``sdpa_mask`` (a 4-D bool mask, or None for plain causal) as its mask function,
    so the attention functions receive a mask form read exactly. Done on import; safe
    to repeat."""
    _check_version()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    for kind, name in IMPLEMENTATIONS.items():
        AttentionInterface.register(name, functools.partial(_attention, kind))
        AttentionMaskInterface.register(name, sdpa_mask)


# ----------------------------------------------------------------------------
# The attention function
# ----------------------------------------------------------------------------

# (keyword, what its presence means): each one a core cannot honour
_REFUSED = (
    ("sliding_window", "a sliding window"),
    ("softcap", "logit soft-capping"),
    ("s_aux", "attention sinks"),
    ("cu_seq_lens_q", "packed (varlen) sequences"),
    ("cu_seq_lens_k", "packed (varlen) sequences"),
)


def _attention(kind: str, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention function registered as ``laminae_<kind>``: transformers' call
    convention in, ``(output [B, S, H, D], None)`` out (no attention weights)."""
    installed = getattr(module, "_laminae_kind", None)
    if installed != kind:
        raise ConfigError(f"attention implementation {IMPLEMENTATIONS[kind]!r} on a module "
                          + ("that was not converted" if installed is None else f"converted to {installed!r}")
                          + f": call laminae.integrations.transformers.convert(model, {kind!r}) first")
    if kwargs.get("output_attentions"):
        raise ConfigError("output_attentions=True: laminae cores never form the attention weights; "
                          "run the model with output_attentions=False")
    if dropout:
        raise ConfigError(f"attention dropout {dropout} (config.attention_dropout): laminae cores have no "
                          "dropout; set it to 0")
    for name, what in _REFUSED:
        if kwargs.get(name) is not None:
            raise ConfigError(f"the attention module passed `{name}` ({what}), which laminae cores do not support")
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise ConfigError("a non-causal attention call: laminae cores are causal")
    batch, q_len, kv_len = query.shape[0], query.shape[2], key.shape[2]
    keep = keep_mask_from_hf(attention_mask, batch, q_len, kv_len, query.device)
    out = attend(kind, module, query, key, value, keep, scaling, kwargs.get("laminae_hidden"),
                 kwargs.get("laminae_cache"))
    return out, None


def _pass_hidden_and_cache(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook of a converted attention module: its input hidden state (affine's
    α, DERF's gate) and its cache (Elo/LUCID decoding state) reach the attention
    function through the keyword arguments transformers forwards to it."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    cache = next((kwargs[n] for n in ("cache", "past_key_values", "past_key_value") if kwargs.get(n) is not None),
                 None)
    return args, {**kwargs, "laminae_hidden": hidden, "laminae_cache": cache}


# ----------------------------------------------------------------------------
# convert / load_pretrained
# ----------------------------------------------------------------------------


def _is_attention(module: nn.Module) -> bool:
    return all(isinstance(getattr(module, p, None), nn.Linear) for p in ("q_proj", "k_proj", "v_proj", "o_proj")) \
        and hasattr(module, "layer_idx") and isinstance(getattr(module, "head_dim", None), int)


def _geometry(name: str, module: nn.Module) -> dict[str, int]:
    """hidden_size, num_heads, num_kv_heads, head_dim of one attention module, refusing
    what the cores cannot take."""
    D = module.head_dim
    q_out, k_out, v_out = (getattr(module, p).out_features for p in ("q_proj", "k_proj", "v_proj"))
    if q_out % D or k_out % D or v_out != k_out:
        raise ShapeError(f"{name}: laminae cores need one head dim D={D} for queries, keys and values, got "
                         f"projections of {q_out}, {k_out} and {v_out} features")
    H, Hkv = q_out // D, k_out // D
    if H % Hkv:
        raise ShapeError(f"{name}: {Hkv} key/value heads must divide {H} query heads")
    return dict(hidden_size=module.q_proj.in_features, num_heads=H, num_kv_heads=Hkv, head_dim=D)


def _check_model(model: nn.Module, modules: list[tuple[str, nn.Module]]) -> None:
    config = model.config
    if not type(model)._can_set_attn_implementation():
        raise ConfigError(f"{type(model).__name__} does not call transformers' AttentionInterface, so no "
                          "registered attention function can run in it")
    if not modules:
        raise ConfigError(f"found no attention module (q_proj/k_proj/v_proj/o_proj, head_dim, layer_idx) in "
                          f"{type(model).__name__}")
    if getattr(config, "attention_dropout", 0.0):
        raise ConfigError(f"config.attention_dropout={config.attention_dropout}: laminae cores have no dropout; "
                          "set it to 0")
    sliding = "sliding_attention" in (getattr(config, "layer_types", None) or ()) or (
        getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True))
    if sliding:
        raise ConfigError(f"config.sliding_window={config.sliding_window}: laminae cores attend to every earlier "
                          "key; set sliding_window=None (or use_sliding_window=False)")
    for name, module in modules:
        if hasattr(module, "_laminae_kind"):
            raise ConfigError(f"{name} is already converted (to {module._laminae_kind!r}); convert a fresh model")
        if getattr(module, "sliding_window", None) is not None:
            raise ConfigError(f"{name} attends through a sliding window ({module.sliding_window}), which laminae "
                              "cores do not support")


def convert(model: nn.Module, core: str, *, backend: str = "auto", **options: Any) -> nn.Module:
    """Give every attention module of ``model`` (a transformers ``PreTrainedModel``) the
    laminae ``core`` and select it; returns ``model``.

    Args:
        model: a decoder whose attention modules call transformers' AttentionInterface
            (Llama, Mistral, Qwen2/3, ...), without sliding window or attention dropout.
        core: "derf", "elo", "affine", "lucid" or "xsa" (softmax attention + XSA).
        backend: "auto" | "triton" | "reference" of the cores (``set_backend`` changes it later).
        options: the core's own options — derf: ``context_gate`` (False), ``gate_init_bias``;
            elo: ``elo_k_init``; affine: ``affine_momentum``, ``alpha_ma_init``, ``activation``,
            ``initializer_range``; lucid: ``lucid_attention_eps``, ``unit_diagonal``;
            xsa: ``mode``, ``eps``.

    The new modules (``self_attn.laminae_core``, ``self_attn.laminae_gate``) are created
    with the laminae init on the attention module's device, their parameters in its dtype.
    """
    register()
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(f"`model` must be a transformers PreTrainedModel, got {type(model).__name__}")
    if core not in CORES:
        raise ConfigError(f"`core` must be one of {list(CORES)}, got {core!r}")
    if backend not in BACKENDS:
        raise ConfigError(f"`backend` must be one of {list(BACKENDS)}, got {backend!r}")
    unknown = sorted(set(options) - set(OPTIONS[core]))
    if unknown:
        raise ConfigError(f"unknown option(s) {unknown} for core {core!r}; it takes {list(OPTIONS[core])}")
    modules = [(name, m) for name, m in model.named_modules() if _is_attention(m)]
    _check_model(model, modules)
    # build everything before changing anything: a refused option leaves the model as it was
    plans = [(m, build_core(core, **_geometry(name, m), backend=backend, options=options)) for name, m in modules]
    for module, built in plans:
        weight = module.q_proj.weight
        for attr, sub in built.items():
            sub.to(device=weight.device)
            for param in sub.parameters():
                param.data = param.data.to(weight.dtype)
            module.add_module(attr, sub)
        module._laminae_kind = core
        module.register_forward_pre_hook(_pass_hidden_and_cache, with_kwargs=True)
    model.set_attn_implementation(IMPLEMENTATIONS[core])
    model.config.laminae = {"core": core, "options": dict(options)}
    return model


def _laminae_tensors(folder: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ConfigError(f"no .safetensors file in {folder!r} (save with save_pretrained, safe_serialization on)")
    found: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(path, framework="pt") as handle:
            found.update({key: handle.get_tensor(key) for key in handle.keys() if ".laminae_" in key})
    return found


def _from_pretrained_quietly(model_class: type, folder: str, kwargs: dict[str, Any]):
    """``model_class.from_pretrained`` without listing the laminae tensors as unexpected in
    its load report: they are loaded (strictly) right after. transformers reads the
    pattern list from the class when it builds the model, so it is extended for that call."""
    own = "_keys_to_ignore_on_load_unexpected" in model_class.__dict__
    previous = model_class.__dict__.get("_keys_to_ignore_on_load_unexpected")
    inherited = getattr(model_class, "_keys_to_ignore_on_load_unexpected", None) or ()
    model_class._keys_to_ignore_on_load_unexpected = [*inherited, r"\.laminae_"]
    try:
        return model_class.from_pretrained(folder, **kwargs)
    finally:
        if own:
            model_class._keys_to_ignore_on_load_unexpected = previous
        else:
            del model_class._keys_to_ignore_on_load_unexpected


def load_pretrained(model_class: type, folder: str, *, backend: str = "auto", **from_pretrained_kwargs: Any):
    """``model_class.from_pretrained(folder)`` of a converted model saved with
    ``save_pretrained``, converted again as ``config.laminae`` records, with the core
    parameters and buffers loaded strictly (every one present, none left over, same shapes).

    Example::

        model.save_pretrained(folder)
        again = load_pretrained(LlamaForCausalLM, folder)
    """
    if not os.path.isdir(folder):
        raise ConfigError(f"`folder` must be a local folder written by save_pretrained, got {folder!r}")
    _check_version()
    model = _from_pretrained_quietly(model_class, folder, from_pretrained_kwargs)
    spec = getattr(model.config, "laminae", None)
    if not isinstance(spec, dict) or spec.get("core") not in CORES:
        raise ConfigError(f"{folder!r} holds no laminae conversion (config.json has no valid `laminae` field: "
                          f"{spec!r}); it was not saved from a converted model")
    convert(model, spec["core"], backend=backend, **spec.get("options", {}))
    saved = _laminae_tensors(folder)
    own = {key: t for key, t in model.state_dict().items() if ".laminae_" in key}
    missing, unexpected = sorted(own.keys() - saved.keys()), sorted(saved.keys() - own.keys())
    if missing or unexpected:
        raise ConfigError(f"the laminae tensors in {folder!r} do not match a {spec['core']!r} conversion of "
                          f"{model_class.__name__}: missing {missing}, unexpected {unexpected}")
    for key, tensor in own.items():
        if saved[key].shape != tensor.shape:
            raise ShapeError(f"`{key}` is {tuple(saved[key].shape)} in {folder!r}, the model has {tuple(tensor.shape)}")
    with torch.no_grad():
        for key, tensor in own.items():
            tensor.copy_(saved[key])
    return model


if _supported():
    register()
