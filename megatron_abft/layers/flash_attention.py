"""ProtectedFlashAttention: Megatron-core's core attention on the protected flash kernels
(megatron_abft.flash). DotProductAttention's contract, query [sq, b, np, hn] and key, value
[sk, b, ng, hn] in, context [sq, b, np * hn] out; the scores never leave the kernels, which
check and correct every tile GEMM of the forward and the backward on each tensor-parallel
rank's own heads (docs/abft.md, "The flash path").
"""

from __future__ import annotations

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from megatron_abft.config import FLASH_SECTIONS, ABFTConfig
from megatron_abft.faults import landed
from megatron_abft.flash import FlashFault, FlashLedger, flash_attention, launch
from megatron_abft.flash.attention import FORWARD
from megatron_abft.layers.attention import reject_unsupported
from megatron_abft.runtime.guard import KernelGuard
from megatron_abft.runtime.model_runtime import runtime_of

MASKS = (AttnMaskType.causal, AttnMaskType.no_mask)
"""The attention masks the kernels apply: causal (top-left) and none."""


def kernels_compile_here() -> bool:
    """Whether the flash kernels compile for this machine's GPU (Triton: sm_80 and later)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


DKDV_SECTIONS = tuple(FLASH_SECTIONS[s.value] for s in launch.KERNEL_SECTIONS["dkdv"])
"""The sections the backward's dK/dV kernel checks, by name."""


def flash_refusal(
    config: TransformerConfig,
    attn_mask_type: AttnMaskType,
    attention_dropout: float | None,
    abft_config: ABFTConfig | None = None,
) -> tuple[str, str] | None:
    """Why the flash kernels cannot run this attention, and what to do instead; None where they
    can. Beside reject_unsupported's refusals, which hold for every protected attention. On a
    GPU, ``abft_config`` may not check ``grad_v`` on a step without the other dK/dV sections:
    that kernel hit an illegal memory access on an H200 (docs/benchmarks.md, 2026-11-30)."""
    if torch.cuda.is_available() and abft_config is not None:
        if refusal := _grad_v_alone(abft_config):
            return refusal
    dropout = config.attention_dropout if attention_dropout is None else attention_dropout
    if dropout:
        return (
            f"attention dropout ({dropout}) is not supported by the flash kernels",
            "set attention_dropout=0 (--attention-dropout 0) or use attention='unfused'",
        )
    if attn_mask_type not in MASKS:
        return (
            f"attn_mask_type={attn_mask_type.name} is not supported: the kernels apply a causal "
            "mask or none",
            "for padding or arbitrary masks use attention='unfused'",
        )
    if config.softmax_type != "vanilla":
        return (f"softmax_type={config.softmax_type} is not supported", "use vanilla")
    half = config.bf16 or config.fp16 or config.params_dtype != torch.float32
    if torch.cuda.is_available() and not half:
        return (
            "fp32 attention on a GPU is not supported by the flash kernels (they take bf16 and "
            "fp16, accumulating in fp32)",
            "train in bf16 (--bf16) or use attention='unfused'",
        )
    if config.window_size is not None:
        return (
            f"sliding-window attention (window_size={config.window_size}) is not supported",
            "use window_size=None",
        )
    return None


def _grad_v_alone(abft: ABFTConfig) -> tuple[str, str] | None:
    """The refusal of a config that checks ``grad_v`` on a step where another of dK/dV's
    sections is not checked (a section is due on the steps its interval divides)."""
    if not abft.enabled or "grad_v" not in abft.sections:
        return None
    every = abft.interval("grad_v")
    missing = [s for s in DKDV_SECTIONS if s not in abft.sections or every % abft.interval(s) != 0]
    if not missing:
        return None
    return (
        f"checking grad_v on a step without {', '.join(missing)} crashed the flash kernels on a "
        "GPU (a known issue, not fixed yet)",
        f"check {', '.join(DKDV_SECTIONS)} together, each on an interval that divides grad_v's, "
        "leave grad_v out, or use attention='unfused'",
    )


class ProtectedFlashAttention(DotProductAttention):
    """Drop-in for DotProductAttention on the protected flash kernels. ``abft_config`` comes
    through the layer spec's params. Refuses at construction what the kernels do not do
    (flash_refusal): attention dropout, masks other than causal or none, sliding windows,
    softmax offsets."""

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
        where = "ProtectedFlashAttention"
        reject_unsupported(config, where, flash=True)
        abft_config = abft_config if abft_config is not None else ABFTConfig()
        if refusal := flash_refusal(config, attn_mask_type, attention_dropout, abft_config):
            raise ValueError(f"{where}: {refusal[0]}; {refusal[1]}")
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
        self.abft_config = abft_config
        rank = self.tp_group.rank()
        self.abft_guards = tuple(KernelGuard(s, self.abft_config, rank) for s in FLASH_SECTIONS)
        runtime_of(self.abft_config).attach(self)
        self.flash_ledger: FlashLedger | None = None

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
        """query [sq, b, np, hn], key and value [sk, b, ng, hn] -> context [sq, b, np * hn].
        ``attention_mask`` is not read: the mask type says causal or none, as Megatron's fused
        causal softmax does."""
        if packed_seq_params is not None:
            raise NotImplementedError(
                "ProtectedFlashAttention does not support packed sequences (THD); pass padded "
                "batches"
            )
        if attention_bias is not None:
            raise NotImplementedError("ProtectedFlashAttention does not support attention_bias")
        mask = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if mask not in MASKS:
            raise NotImplementedError(
                f"ProtectedFlashAttention: attn_mask_type={mask.name} is not supported; the "
                "kernels apply a causal mask or none"
            )
        sq, b, heads, _ = query.shape
        groups = key.shape[2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        ledger = self._ledger(q.device, (b, groups, heads // groups))
        due = [g.section for g in self.abft_guards if g.due]
        context = flash_attention(
            q,
            k,
            v,
            causal=mask == AttnMaskType.causal,
            # Megatron's query-key layer scaling divides the scale by a coefficient that its
            # softmax multiplies back
            softmax_scale=self.softmax_scale * (self.scale_mask_softmax.scale or 1.0),
            sections=due,
            threshold_scale=self.abft_config.threshold_scale,
            near_inf=self.abft_config.near_inf,
            ledger=ledger,
            faults=self._land(q, k),
        )
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _ledger(self, device: torch.device, batch_shape: tuple[int, ...]) -> FlashLedger:
        """The layer's ledger, made on ``device`` at its first call; each guard reads its
        section of it."""
        if self.flash_ledger is None:
            self.flash_ledger = FlashLedger.on(device, self.abft_guards[0].step)
            for guard in self.abft_guards:
                guard.attach(self.flash_ledger.section(guard.section))
        for guard in self.abft_guards:
            guard.batch_shape = batch_shape
        return self.flash_ledger

    def _land(self, q: Tensor, k: Tensor) -> list[FlashFault]:
        """The armed faults due in this call: the first of the forward's sections and the first
        of the backward's (the others wait for a later call), logged where they land."""
        chosen: dict[bool, FlashFault] = {}
        for guard in self.abft_guards:
            forward = guard.section in FORWARD
            for armed in list(guard.faults):
                fault = armed.fault
                if forward in chosen or fault.step not in (None, guard.step):
                    continue
                chosen[forward] = FlashFault(guard.section, fault.tensor_fault(), fault.persistent)
                batch, heads, n_q, dim = q.shape
                landed(armed, guard, chosen[forward].landing(batch * heads, n_q, k.shape[2], dim))
                guard.faults.remove(armed)
        return list(chosen.values())
