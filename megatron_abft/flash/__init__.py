"""Protected flash attention: Triton kernels that check and correct every tile GEMM of the
attention's forward and backward (docs/abft.md, "The flash path").

``flash_attention(q, k, v, causal=..., softmax_scale=...)`` is the function;
``ProtectedFlashAttention`` (megatron_abft.layers.flash_attention) is Megatron-core's core attention
on it. Importing this package does not import Megatron.
"""

from megatron_abft.flash.attention import default_ledger, flash_attention
from megatron_abft.flash.faults import FlashFault
from megatron_abft.flash.ledger import FlashLedger

__all__ = ["FlashFault", "FlashLedger", "default_ledger", "flash_attention"]
