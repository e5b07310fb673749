"""Layer specs with protected attention: ``get_gpt_layer_abft_spec`` and ``apply_abft``.

The ABFT config reaches the protected modules through the spec's ``params``, so Megatron builds
them with ``build_module`` as usual; nothing in Megatron is patched. The core attention is the
protected flash attention (megatron_abft.layers.flash_attention) or the protected unfused one
(megatron_abft.layers.attention): ``attention="flash"``, ``"unfused"``, or ``"auto"``, flash where
the flash kernels compile for this machine's GPU and can run the layer, unfused elsewhere.
"""

from __future__ import annotations

import copy
import logging

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_abft.config import ATTENTIONS, ABFTConfig
from megatron_abft.layers.attention import ProtectedDotProductAttention
from megatron_abft.layers.flash_attention import (
    ProtectedFlashAttention,
    flash_refusal,
    kernels_compile_here,
)
from megatron_abft.layers.linear import ProtectedColumnParallelLinear, ProtectedRowParallelLinear
from megatron_abft.layers.norm import with_sequence_parallel_norms
from megatron_abft.runtime.telemetry import say_once

_log = logging.getLogger(__name__)

_LINEARS = {
    "linear_qkv": (ColumnParallelLinear, ProtectedColumnParallelLinear),
    "linear_proj": (RowParallelLinear, ProtectedRowParallelLinear),
}


def _module_of(entry) -> type:
    return entry.module if isinstance(entry, ModuleSpec) else entry


class AutoProtectedAttention:
    """``attention="auto"``, settled when Megatron builds each layer, from the layer's config:
    the protected flash attention where its kernels compile for this machine's GPU and can run
    the layer (flash_refusal: no attention dropout, a causal mask or none, ...), else the
    protected unfused attention. Says once, on the first rank, which it chose and why.
    Constructing it returns the chosen attention."""

    def __new__(
        cls,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        **kwargs,
    ):
        if not kernels_compile_here():
            chosen, why = ProtectedDotProductAttention, "no GPU here compiles the flash kernels"
        elif refusal := flash_refusal(
            config, attn_mask_type, attention_dropout, kwargs.get("abft_config")
        ):
            chosen, why = ProtectedDotProductAttention, refusal[0]
        else:
            chosen, why = ProtectedFlashAttention, "the flash kernels compile for this GPU"
        say_once(_log, f"[abft] attention=auto: {chosen.__name__}, since {why}")
        return chosen(
            config=config,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            attention_type=attention_type,
            attention_dropout=attention_dropout,
            **kwargs,
        )


def core_attention(attention: str) -> type:
    """The protected core attention ``attention`` names (one of ATTENTIONS)."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention={attention!r}: choose from {', '.join(ATTENTIONS)}")
    return {
        "auto": AutoProtectedAttention,
        "flash": ProtectedFlashAttention,
        "unfused": ProtectedDotProductAttention,
    }[attention]


def apply_abft(
    spec: ModuleSpec, abft_config: ABFTConfig | None = None, attention: str = "auto"
) -> ModuleSpec:
    """A copy of a transformer-layer spec whose self-attention (QKV projection, core attention,
    output projection) is protected, the core attention as ``attention`` says (ATTENTIONS). The
    spec must use Megatron-core's local modules; its torch norms, if any, become
    SequenceParallelTorchNorm, which also takes sequence parallelism."""
    config = abft_config if abft_config is not None else ABFTConfig()
    if not isinstance(config, ABFTConfig):
        raise TypeError(f"abft_config must be an ABFTConfig, got {type(config).__name__}")
    # a spec protected before may be again (AutoProtectedAttention is no DotProductAttention)
    cores = (DotProductAttention, AutoProtectedAttention)
    swaps = {**_LINEARS, "core_attention": (cores, core_attention(attention))}
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
    for name, (stock, protected) in swaps.items():
        entry = getattr(attention.submodules, name)
        module = _module_of(entry)
        if not (isinstance(module, type) and issubclass(module, stock)):
            expected = stock[0] if isinstance(stock, tuple) else stock
            raise ValueError(
                f"apply_abft: self_attention.{name} is {module!r}, not Megatron-core's "
                f"{expected.__name__}; Transformer Engine and fused backends are not supported, "
                "build the layer with get_gpt_layer_abft_spec (the local spec)"
            )
        params = dict(entry.params) if isinstance(entry, ModuleSpec) else {}
        setattr(
            attention.submodules,
            name,
            ModuleSpec(module=protected, params={**params, "abft_config": config}),
        )
    spec.submodules.self_attention = attention
    return with_sequence_parallel_norms(spec)


def get_gpt_layer_abft_spec(
    abft_config: ABFTConfig | None = None, attention: str = "auto", **kwargs
) -> ModuleSpec:
    """Megatron-core's ``get_gpt_layer_local_spec(**kwargs)`` with protected attention, the core
    attention as ``attention`` says: "flash", "unfused" or "auto" (AutoProtectedAttention: flash
    where the flash kernels compile for this machine's GPU and can run the layer, for instance
    with no attention dropout).

    Megatron-LM's ``--spec megatron_abft.spec get_gpt_layer_abft_spec`` calls this with its model
    config in place of an ABFTConfig; the ABFT config then comes from its ``--abft*`` flags
    (megatron_abft.megatron_lm.add_abft_args)."""
    if abft_config is not None and not isinstance(abft_config, ABFTConfig):
        from megatron_abft.megatron_lm import abft_from_megatron_lm

        abft_config, attention, kwargs = abft_from_megatron_lm()
        if abft_config is None:
            return get_gpt_layer_local_spec(**kwargs)
    if kwargs.get("multi_latent_attention"):
        raise ValueError(
            "ABFT does not support multi-latent attention; drop multi_latent_attention"
        )
    return apply_abft(get_gpt_layer_local_spec(**kwargs), abft_config, attention)
