"""Layer specs with protected attention: ``get_gpt_layer_abft_spec`` and ``apply_abft``.

The ABFT config reaches the protected modules through the spec's ``params``, so Megatron builds
them with ``build_module`` as usual; nothing in Megatron is patched.
"""

from __future__ import annotations

import copy

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_abft.attention import ProtectedDotProductAttention
from megatron_abft.config import ABFTConfig
from megatron_abft.linear import ProtectedColumnParallelLinear, ProtectedRowParallelLinear

_SWAPS = {
    "linear_qkv": (ColumnParallelLinear, ProtectedColumnParallelLinear),
    "core_attention": (DotProductAttention, ProtectedDotProductAttention),
    "linear_proj": (RowParallelLinear, ProtectedRowParallelLinear),
}


def _module_of(entry) -> type:
    return entry.module if isinstance(entry, ModuleSpec) else entry


def apply_abft(spec: ModuleSpec, abft_config: ABFTConfig | None = None) -> ModuleSpec:
    """A copy of a transformer-layer spec whose self-attention (QKV projection, core attention,
    output projection) is protected. The spec must use Megatron-core's local modules."""
    config = abft_config if abft_config is not None else ABFTConfig()
    if not isinstance(config, ABFTConfig):
        raise TypeError(f"abft_config must be an ABFTConfig, got {type(config).__name__}")
    spec = copy.copy(spec)
    spec.submodules = copy.copy(spec.submodules)
    attention = getattr(spec.submodules, "self_attention", None)
    if not isinstance(attention, ModuleSpec) or not issubclass(attention.module, SelfAttention):
        raise ValueError(
            "apply_abft protects SelfAttention layers; this spec's self_attention is "
            f"{getattr(attention, 'module', attention)!r} (multi-latent and cross attention are "
            "not supported)"
        )
    attention = copy.copy(attention)
    attention.submodules = copy.copy(attention.submodules)
    for name, (stock, protected) in _SWAPS.items():
        entry = getattr(attention.submodules, name)
        module = _module_of(entry)
        if not (isinstance(module, type) and issubclass(module, stock)):
            raise ValueError(
                f"apply_abft: self_attention.{name} is {module!r}, not Megatron-core's "
                f"{stock.__name__}; Transformer Engine and fused backends are not supported, "
                "build the layer with get_gpt_layer_abft_spec (the local spec)"
            )
        params = dict(entry.params) if isinstance(entry, ModuleSpec) else {}
        setattr(
            attention.submodules,
            name,
            ModuleSpec(module=protected, params={**params, "abft_config": config}),
        )
    spec.submodules.self_attention = attention
    return spec


def get_gpt_layer_abft_spec(abft_config: ABFTConfig | None = None, **kwargs) -> ModuleSpec:
    """Megatron-core's ``get_gpt_layer_local_spec(**kwargs)`` with protected attention.

    Megatron-LM's ``--spec megatron_abft.spec get_gpt_layer_abft_spec`` calls this with its model
    config in place of an ABFTConfig; the ABFT config then comes from its ``--abft*`` flags
    (megatron_abft.megatron_lm.add_abft_args)."""
    if abft_config is not None and not isinstance(abft_config, ABFTConfig):
        from megatron_abft import megatron_lm

        return megatron_lm.get_gpt_layer_abft_spec(abft_config, **kwargs)
    if kwargs.get("multi_latent_attention"):
        raise ValueError(
            "ABFT does not support multi-latent attention; drop multi_latent_attention"
        )
    return apply_abft(get_gpt_layer_local_spec(**kwargs), abft_config)
