"""SequenceParallelTorchNorm: Megatron-core's torch norm (``WrappedTorchNorm``, what the local
spec takes where neither Apex nor Transformer Engine is installed) with sequence parallelism.

Under sequence parallelism each tensor-parallel rank normalises its own part of the sequence, so
the norm's weight and bias gradients are partial sums. Megatron's fused norms mark their
parameters ``sequence_parallel`` and ``finalize_model_grads`` sums those gradients over the
tensor-parallel ranks; ``WrappedTorchNorm`` refuses sequence parallelism instead. This builds the
same torch module and marks its parameters the same way.
"""

from __future__ import annotations

import copy

import torch
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig


class SequenceParallelTorchNorm:
    """Builds ``WrappedTorchNorm``'s module (torch's LayerNorm or RMSNorm); with
    ``config.sequence_parallel`` its parameters are marked for Megatron's gradient sum over the
    tensor-parallel ranks. Constructing it returns the torch module."""

    def __new__(
        cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **kwargs
    ) -> torch.nn.Module:
        if not config.sequence_parallel:
            return WrappedTorchNorm(config, hidden_size, eps, **kwargs)
        local = copy.copy(config)  # WrappedTorchNorm reads the flag only to refuse it
        local.sequence_parallel = False
        norm = WrappedTorchNorm(local, hidden_size, eps, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm


def with_sequence_parallel_norms(spec: ModuleSpec) -> ModuleSpec:
    """A copy of a transformer-layer spec whose torch norms (``WrappedTorchNorm``, as a module
    or a ModuleSpec) are SequenceParallelTorchNorm; other norms stay."""
    spec = copy.copy(spec)
    spec.submodules = copy.copy(spec.submodules)
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        entry = getattr(spec.submodules, name, None)
        module = entry.module if isinstance(entry, ModuleSpec) else entry
        if module is WrappedTorchNorm:
            params = entry.params if isinstance(entry, ModuleSpec) else {}
            setattr(spec.submodules, name, ModuleSpec(SequenceParallelTorchNorm, params=params))
    return spec
