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
"""

from __future__ import annotations

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_abft.check.eec import GemmOperands
from megatron_abft.config import ABFTConfig
from megatron_abft.runtime.guard import SectionGuard, View
from megatron_abft.runtime.model_runtime import runtime_of


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


class _CheckedLocalGemm:
    """Mixin for a Megatron parallel linear layer: checks the rank-local GEMM that its
    ``_forward_impl`` computes, ``output = input @ weight^T (+ bias)``, tokens flattened."""

    abft_config: ABFTConfig
    abft_guard: SectionGuard
    fault_views: dict[str, View]

    def _forward_impl(self, input, weight, *args, **kwargs):
        if kwargs.get("sequence_parallel"):
            # Megatron gathers the sequence inside its GEMM, out of the check's sight: gather it
            # here (the backward reduce-scatters the input's gradient, as Megatron's does) and
            # run the same rank-local GEMM on the whole sequence.
            input = gather_from_sequence_parallel_region(input, group=self.tp_group)
            kwargs = {**kwargs, "sequence_parallel": False}
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
