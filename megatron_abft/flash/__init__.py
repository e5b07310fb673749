"""Protected flash attention: Triton kernels that check and correct every tile GEMM of the
attention's forward and backward (docs/abft.md, "The flash path").

``flash_attention(q, k, v, causal=..., softmax_scale=...)`` is the function;
``ProtectedFlashAttention`` (megatron_abft.layers.flash_attention) is Megatron-core's core attention
on it. Importing this package imports neither Megatron nor Triton: its names load their modules
when first used, so that the tile table (megatron_abft.flash.tiles) reads without them.
"""

import importlib

_HOMES = {
    "FlashFault": "megatron_abft.flash.faults",
    "FlashLedger": "megatron_abft.flash.ledger",
    "default_ledger": "megatron_abft.flash.attention",
    "flash_attention": "megatron_abft.flash.attention",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
