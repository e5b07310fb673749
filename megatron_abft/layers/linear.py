"""Protected tensor-parallel linear layers for the attention block (docs/megatron.md, "What is
checked").

Both override only ``_forward_impl``, Megatron's rank-local GEMM, so each rank checks its own
shard with no extra communication:

- ProtectedColumnParallelLinear (``linear_qkv``, section ``qkv``): Y = X W_r^T + b, checked over
  tokens and over features; catches errors in Q, K and V before RoPE and the attention GEMMs;
- ProtectedRowParallelLinear (``linear_proj``, section ``proj``): the partial product
  O_r = C_r W_r^T is checked before the all-reduce or reduce-scatter; the bias is added after it.

With sequence parallelism the QKV projection gathers the sequence before its GEMM, so that the
check sees the GEMM's whole input; the output projection's reduce-scatter follows its check.

With ``ABFTConfig.checked_gemm`` the GEMM itself checks its output (megatron_abft.ops.checked_gemm)
where it serves: ``_CheckedLinear`` is Megatron's linear autograd function with that GEMM in its
forward and Megatron's backward as is.
"""

from __future__ import annotations

import logging

import torch
from megatron.core.tensor_parallel import layers as mcore_layers
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    LinearWithGradAccumulationAndAsyncCommunication,
    RowParallelLinear,
)
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_abft.check.eec import GemmOperands
from megatron_abft.config import ABFTConfig
from megatron_abft.ops import checked_gemm
from megatron_abft.runtime.guard import SectionGuard, View
from megatron_abft.runtime.model_runtime import runtime_of

_log = logging.getLogger(__name__)


def qkv_part_views(config: TransformerConfig, tp_rank: int, width: int) -> dict[str, View]:
    """Views of this rank's fused QKV output ``[s, b, width]`` as the query, key and value
    matrices ``[..., tokens, features]``. Megatron interleaves the columns per KV group as
    [q heads of the group, k, v]; a rank holds whole groups, or, with fewer KV groups than ranks,
    a slice of one group, where a part may be absent."""
    heads = config.num_attention_heads
    groups = config.num_query_groups or heads
    hn = config.kv_channels
    rep = heads // groups
    group_width = (rep + 2) * hn
    parts = {
        "q": (0, rep * hn),
        "k": (rep * hn, (rep + 1) * hn),
        "v": ((rep + 1) * hn, group_width),
    }
    start = tp_rank * width
    views: dict[str, View] = {"qkv": lambda y: y.view(-1, width)}
    if width % group_width == 0:  # whole groups: a batch of one matrix per group
        n = width // group_width
        for part, (lo, hi) in parts.items():
            views[part] = lambda y, lo=lo, hi=hi, n=n: y.view(-1, n, group_width)[
                :, :, lo:hi
            ].transpose(0, 1)
        return views
    offset = start % group_width
    for part, (lo, hi) in parts.items():
        lo, hi = max(lo, offset), min(hi, offset + width)
        if lo < hi:
            views[part] = lambda y, lo=lo - offset, hi=hi - offset: y.view(-1, width)[:, lo:hi]
    return views


class _CheckedLinear(LinearWithGradAccumulationAndAsyncCommunication):
    """Megatron's linear autograd function, its backward as is (input, weight and bias
    gradients, gradient-accumulation fusion, the async all-reduce of the input's gradient),
    whose forward is the checked GEMM: returns the output and its tiles' codes. The sequence is
    whole (gathered before, as _CheckedLocalGemm does)."""

    @staticmethod
    @mcore_layers.custom_fwd
    def forward(
        ctx, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
        grad_output_buffer, wgrad_deferral_limit, tp_group, sums, threshold_scale, near_inf,
    ):  # fmt: skip
        ctx.save_for_backward(input, weight)
        fused = gradient_accumulation_fusion and hasattr(weight, "main_grad")
        ctx.main_grad = weight.main_grad if fused else None
        ctx.use_bias = bias is not None
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.sequence_parallel = False
        ctx.wgrad_deferral_limit = wgrad_deferral_limit
        ctx.grad_output_buffer = grad_output_buffer
        ctx.tp_group = tp_group
        ctx.gtp_remat_size = 1
        output, codes = checked_gemm.checked_linear(
            input, weight, bias, sums=sums, threshold_scale=threshold_scale, near_inf=near_inf
        )
        ctx.mark_non_differentiable(codes)
        ctx.set_materialize_grads(False)  # no zeros made for the codes' gradient
        return output, codes

    @staticmethod
    @mcore_layers.custom_bwd
    def backward(ctx, grad_output, _codes):
        if grad_output is None:  # the output not used
            return (None,) * 11
        megatron_backward = LinearWithGradAccumulationAndAsyncCommunication.backward.__wrapped__
        grad_input, grad_weight, grad_bias, *_ = megatron_backward(ctx, grad_output)
        return grad_input, grad_weight, grad_bias, *([None] * 8)


class _CheckedLocalGemm:
    """Mixin for a Megatron parallel linear layer: checks the rank-local GEMM that its
    ``_forward_impl`` computes, ``output = input @ weight^T (+ bias)``, tokens flattened."""

    abft_config: ABFTConfig
    abft_guard: SectionGuard
    fault_views: dict[str, View]
    _weight_sums: tuple[tuple, torch.Tensor] | None = None
    _told_dtype = False  # the checked GEMM does not take this dtype here: said once

    def _forward_impl(self, input, weight, *args, **kwargs):
        if kwargs.get("sequence_parallel"):
            # Megatron gathers the sequence inside its GEMM, out of the check's sight: gather it
            # here (the backward reduce-scatters the input's gradient, as Megatron's does) and
            # run the same rank-local GEMM on the whole sequence.
            input = gather_from_sequence_parallel_region(input, group=self.tp_group)
            kwargs = {**kwargs, "sequence_parallel": False}
        due, faults = self.abft_guard.due, self.abft_guard.faults
        if due and not faults and self._checked_gemm_serves(input, weight, args, kwargs):
            return self._checked_gemm(input, weight, kwargs)
        output = super()._forward_impl(input, weight, *args, **kwargs)
        if not (self.abft_guard.due or self.abft_guard.faults):
            return output
        width = output.shape[-1]
        flat = output.view(-1, width)
        checked = self.abft_guard.check(
            flat,
            GemmOperands(input.reshape(-1, input.shape[-1]), weight.t(), 1.0, kwargs.get("bias")),
            views=self.fault_views,
            recompute=lambda: (
                super(_CheckedLocalGemm, self)
                ._forward_impl(input, weight, *args, **kwargs)
                .view(-1, width)
            ),
        )
        # corrected in place: the output itself (a view of the view costs autograd a node)
        return output if checked is flat else checked.view(output.shape)

    def _checked_gemm_serves(self, input, weight, args: tuple, kwargs: dict) -> bool:
        """Whether the checked GEMM computes this call (ABFTConfig.checked_gemm): a trainable
        weight of the input's dtype, on a GPU in bf16 or fp16 or on the CPU, Megatron's own
        arguments (no GTP sharding), and no torch.compile trace (it would trace the launch)."""
        if not self.abft_config.checked_gemm or args or torch.compiler.is_compiling():
            return False
        if not weight.requires_grad or kwargs.get("gtp_remat_size", 1) != 1:
            return False
        if input.dtype != weight.dtype or input.device != weight.device:
            return False
        if checked_gemm.takes(input):
            return True
        if input.device.type == "cuda" and not self._told_dtype:
            self._told_dtype = True
            _log.warning(
                "[abft] checked_gemm: the checked GEMM takes bf16 and fp16 on GPUs; the %s "
                "projection's %s GEMM is Megatron's, checked after it",
                self.abft_guard.section,
                input.dtype,
            )
        return False

    def _checked_gemm(self, input, weight, kwargs: dict) -> torch.Tensor:
        """The rank-local GEMM by the checked GEMM, its tiles' outcome tallied into the guard's
        ledger and an uncorrectable tile left pending for the policy, on the device: the kernel
        already computed it twice."""
        config, guard = self.abft_config, self.abft_guard
        output, codes = _CheckedLinear.apply(
            input,
            weight,
            kwargs.get("bias"),
            kwargs["gradient_accumulation_fusion"],
            kwargs["allreduce_dgrad"],
            kwargs.get("grad_output_buffer"),
            kwargs.get("wgrad_deferral_limit"),
            kwargs.get("tp_group") or self.tp_group,
            self._sums_of(weight),
            config.threshold_scale,
            config.near_inf,
        )
        tile, ledger = checked_gemm.tiles_for(output.device), guard.ledger_on(output.device)
        guard.keep_pending(checked_gemm.tally(codes, output.shape[-1], tile, ledger))
        return output

    def _sums_of(self, weight) -> torch.Tensor:
        """The checked GEMM's weight sums, made again at each training step and each in-place
        change of the weight that its version counter sees; at every call where the step is not
        known (an optimizer may write the weight through ``.data``, which that counter misses)."""
        step = runtime_of(self.abft_config).step
        key = (step, weight.data_ptr(), weight._version, weight.dtype)
        if step is None or self._weight_sums is None or self._weight_sums[0] != key:
            block = checked_gemm.tiles_for(weight.device).block_n
            self._weight_sums = (key, checked_gemm.weight_sums(weight, block))
        return self._weight_sums[1]


class ProtectedColumnParallelLinear(_CheckedLocalGemm, ColumnParallelLinear):
    """ColumnParallelLinear whose local GEMM (with its bias) is checked as section ``qkv``."""

    def __init__(self, *args, abft_config: ABFTConfig | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.abft_config = abft_config if abft_config is not None else ABFTConfig()
        rank = self.tp_group.rank()
        self.fault_views = qkv_part_views(self.config, rank, self.output_size_per_partition)
        self.abft_guard = SectionGuard("qkv", self.abft_config, rank, self.fault_views)
        self.abft_guards = (self.abft_guard,)
        runtime_of(self.abft_config).attach(self)


class ProtectedRowParallelLinear(_CheckedLocalGemm, RowParallelLinear):
    """RowParallelLinear whose partial product is checked as section ``proj`` before the
    reduction over tensor-parallel ranks."""

    def __init__(self, *args, abft_config: ABFTConfig | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.abft_config = abft_config if abft_config is not None else ABFTConfig()
        self.abft_guard = SectionGuard("proj", self.abft_config, self.tp_group.rank())
        self.abft_guards = (self.abft_guard,)
        runtime_of(self.abft_config).attach(self)
        width = self.output_size
        self.fault_views = {"proj": lambda y: y.view(-1, width)}
