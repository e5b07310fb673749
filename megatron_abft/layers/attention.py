"""ProtectedDotProductAttention: Megatron-core's DotProductAttention with the ``scores`` and
``context`` GEMMs checked and corrected on each tensor-parallel rank (docs/megatron.md, "What
is checked").

- scores: S = scale * Q K^T per (batch, head), checked on both sides from checksums of Q and K
  taken after RoPE; under GQA, K is reduced once per KV group and shared by the group's heads;
- context: C = P V, checked on both sides, the column sums of P taken after softmax and dropout,
  V reduced once per KV group.

Softmax and dropout are elementwise and outside the GEMM checksums: a fault in P itself (the
``probs`` fault section) is consistent with P's own checksums and is not detected (docs/abft.md).
"""

from __future__ import annotations

import logging

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnBackend, AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from megatron_abft.check.eec import GemmOperands
from megatron_abft.config import ABFTConfig
from megatron_abft.layers import checked_attention
from megatron_abft.ops import checked_gemm, fused_softmax
from megatron_abft.runtime import guard
from megatron_abft.runtime.guard import SectionGuard
from megatron_abft.runtime.model_runtime import runtime_of

_log = logging.getLogger(__name__)


def reject_unsupported(config: TransformerConfig, where: str, flash: bool = False) -> None:
    """Fail at construction, with what to use instead, for what the protected layers lack.
    ``flash``: for the flash attention (megatron_abft.layers.flash_attention), which takes
    Megatron's flash backend where the unfused attention cannot."""
    if config.context_parallel_size != 1:
        raise ValueError(
            f"{where}: context parallelism (context_parallel_size="
            f"{config.context_parallel_size}) is not supported: its ring attention exchanges "
            "partial results the checks do not cover; use context_parallel_size=1"
        )
    if getattr(config, "fp8", None):
        raise ValueError(
            f"{where}: FP8 (fp8={config.fp8}) is not supported: the checks bound bf16, fp16 and "
            "fp32 rounding; use fp8=None"
        )
    graphs = getattr(config, "cuda_graph_impl", "none")
    if graphs != "none" or getattr(config, "enable_cuda_graph", False):
        raise ValueError(
            f"{where}: CUDA graphs (cuda_graph_impl={graphs}) are not supported: a guard decides "
            "on the host, every step, which checks are due and hands an uncorrectable fault to "
            "the step's policy (finish_step), and a replayed graph would repeat the captured "
            "step's decisions and lose its faults; use cuda_graph_impl=none"
        )
    if flash:
        refused, use = (AttnBackend.fused, AttnBackend.unfused), "flash, local or auto"
        why = "the protected flash attention is the core attention of this spec"
    else:
        refused, use = (AttnBackend.flash, AttnBackend.fused), "local or auto"
        why = (
            "fused kernels never materialise the scores these checks read; for flash, build "
            "the spec with attention='flash'"
        )
    if config.attention_backend in refused:
        raise ValueError(
            f"{where}: attention_backend={config.attention_backend.name} is not supported: "
            f"{why}; use attention_backend={use}"
        )


class ProtectedDotProductAttention(DotProductAttention):
    """Drop-in for DotProductAttention (same constructor and forward contract) that verifies and
    corrects its two GEMMs. ``abft_config`` comes through the layer spec's params."""

    _told_dtype = False  # the checked GEMM does not take this dtype here: said once

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        abft_config: ABFTConfig | None = None,
    ):
        reject_unsupported(config, "ProtectedDotProductAttention")
        super().__init__(
            config,
            layer_number,
            attn_mask_type,
            attention_type,
            attention_dropout,
            softmax_scale,
            cp_comm_type,
            pg_collection,
        )
        self.abft_config = abft_config if abft_config is not None else ABFTConfig()
        rank = self.tp_group.rank()
        self.scores_guard = SectionGuard("scores", self.abft_config, rank)
        self.context_guard = SectionGuard("context", self.abft_config, rank, ("context", "probs"))
        self.abft_guards = (self.scores_guard, self.context_guard)
        runtime_of(self.abft_config).attach(self)
        # P as the context GEMM reads it comes out of the dropout module: injected faults in P
        # land there, from a hook, not from the forward
        self.attention_dropout.register_forward_hook(self._land_probs_faults)

    def _land_probs_faults(self, module: torch.nn.Module, args: tuple, probs: Tensor):
        """Forward hook of the attention's dropout: the armed faults of section ``probs`` land
        in a copy of P (the softmax keeps its own output for backward), which the context GEMM
        then reads. None (P unchanged) where none is armed."""
        if not self._probs_faults():
            return None
        probs = probs.clone()
        self.context_guard.land_faults(probs, {"probs": lambda t: t})
        return probs

    def _probs_faults(self) -> bool:
        """Whether faults of section ``probs`` wait to land in P."""
        return any(f.section == "probs" for f in self.context_guard.faults)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        """query [sq, b, np, hn], key and value [sk, b, ng, hn] -> context [sq, b, np * hn]:
        ``checked_gemm_forward`` where the checked GEMM serves and no fault waits to land, else
        ``protected_forward``; with nothing to check or land, Megatron's own forward (which
        computes the same)."""
        due = self.scores_guard.due or self.context_guard.due
        faults = self.scores_guard.faults or self.context_guard.faults
        if due and not faults and self._checked_gemm_serves(query, key, value):
            forward = self.checked_gemm_forward
        elif due or faults:
            forward = self.protected_forward
        else:
            forward = super().forward
        return forward(
            query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
        )

    def _checked_gemm_serves(self, query: Tensor, key: Tensor, value: Tensor) -> bool:
        """Whether the checked GEMM computes the two GEMMs (ABFTConfig.checked_gemm): operands of
        one dtype it takes on their device, and no torch.compile trace (it would trace the
        launches)."""
        if not self.abft_config.checked_gemm or torch.compiler.is_compiling():
            return False
        if not query.dtype == key.dtype == value.dtype:
            return False
        if checked_gemm.takes(query):
            return True
        if query.device.type == "cuda" and not self._told_dtype:
            self._told_dtype = True
            _log.warning(
                "[abft] checked_gemm: the checked GEMM takes bf16 and fp16 on GPUs; the "
                "attention's %s GEMMs are Megatron's, checked after them",
                query.dtype,
            )
        return False

    def checked_gemm_forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        """Megatron's forward with its scores and context GEMMs by the checked GEMM, each checked
        where its section is due (megatron_abft.layers.checked_attention): keys and values are
        read per KV group, not repeated, and the context is written in its output's layout."""
        _refuse(packed_seq_params, attention_bias)
        scores = checked_attention.scores(
            query, key, self.softmax_scale, self.scores_guard, self.abft_config
        )
        probs = self.scale_mask_softmax(scores, attention_mask, self.softmax_offset)
        if not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = self.attention_dropout(probs)
        else:
            probs = self.attention_dropout(probs)
        return checked_attention.context(probs, value, self.context_guard, self.abft_config)

    def protected_forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        """The forward with the due sections checked and the armed faults landed."""
        _refuse(packed_seq_params, attention_bias)

        sq, b, heads, hn = query.shape
        sk, groups = key.size(0), key.size(2)
        rep = heads // groups
        # the operands grouped by KV group, [b, ng, rep|1, s, hn]: checksums reduce K and V
        # once per group and broadcast over the group's heads
        q5 = query.reshape(sq, b, groups, rep, hn).permute(1, 2, 3, 0, 4)
        k5 = key.permute(1, 2, 0, 3).unsqueeze(2)
        v5 = value.permute(1, 2, 0, 3).unsqueeze(2)
        if rep > 1:  # as DotProductAttention: repeat K and V to the query heads
            key = key.repeat_interleave(rep, dim=2)
            value = value.repeat_interleave(rep, dim=2)

        # raw attention scores [b * np, sq, sk], checked
        query3 = query.reshape(sq, b * heads, hn).transpose(0, 1)
        key3 = key.reshape(sk, b * heads, hn).transpose(0, 1).transpose(1, 2)

        def scores() -> Tensor:
            buffer = parallel_state.get_global_memory_buffer().get_tensor(
                (b * heads, sq, sk), query.dtype, "mpu"
            )
            return torch.baddbmm(buffer, query3, key3, beta=0.0, alpha=self.softmax_scale)

        def recompute_scores() -> Tensor:
            return scores().view(b, groups, rep, sq, sk)

        scores_operands = GemmOperands(q5, k5.mT, alpha=self.softmax_scale)
        # the scores, checked where the softmax reads them (the fused softmax's screen, where it
        # applies)
        matmul_result = recompute_scores()
        reader = self._softmax_reader(matmul_result, v5, attention_mask)
        attention_probs, context_refs = self.scores_guard.check_read(
            matmul_result, scores_operands, reader, recompute=recompute_scores, masked=reader.masked
        )

        # dropout, as DotProductAttention
        if not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                attention_probs = self.attention_dropout(attention_probs)
        else:
            attention_probs = self.attention_dropout(attention_probs)

        # context [b * np, sq, hn], checked
        probs3 = attention_probs.view(b * heads, sq, sk)
        value3 = value.reshape(sk, b * heads, hn).transpose(0, 1)
        p5 = attention_probs.view(b, groups, rep, sq, sk)
        context = self.context_guard.check(
            torch.bmm(probs3, value3).view(b, groups, rep, sq, hn),
            GemmOperands(p5, v5),
            recompute=lambda: torch.bmm(probs3, value3).view(b, groups, rep, sq, hn),
            refs=context_refs,
        )

        # [b, np, sq, hn] --> [sq, b, np * hn]
        context = context.view(b, heads, sq, hn).permute(2, 0, 1, 3).contiguous()
        return context.view(sq, b, self.hidden_size_per_partition)

    def _softmax_reader(
        self, scores: Tensor, v5: Tensor, mask: Tensor | None
    ) -> fused_softmax.SoftmaxReader:
        """The softmax as the reader of the scores (megatron_abft.ops.fused_softmax), with P's
        pass for the context's references where the context is due, P reaches its GEMM as the
        softmax wrote it (no dropout, no fault to land in P), and the context is not checked
        apart (guard.checks_apart)."""
        dropout = self.training and self.attention_dropout.p > 0
        apart = guard.checks_apart(self.abft_config, v5.device)
        values = None
        if self.context_guard.due and not dropout and not self._probs_faults() and not apart:
            values = v5
        return fused_softmax.SoftmaxReader.of(
            self.scale_mask_softmax, scores, mask, self.softmax_offset, values, self.abft_config
        )


def _refuse(packed_seq_params: PackedSeqParams | None, attention_bias: Tensor | None) -> None:
    """Raise for the forward arguments DotProductAttention does not take."""
    if packed_seq_params is not None:
        raise NotImplementedError(
            "ProtectedDotProductAttention does not support packed sequences (THD); pass "
            "padded batches with an attention mask"
        )
    if attention_bias is not None:
        raise NotImplementedError("attention_bias is not supported by DotProductAttention")
