"""The fused softmax in the attention: Megatron's scale-mask-softmax, the scores' screen and the
context operand's checksum pass in one read of the scores S (csrc/bindings/abft_softmax.cpp).

Unfused, a protected attention reads S three times besides the softmax's own pass: the scores'
verification reads S, the context's encoding reads P for its block sums and its products with
V's checksums. Here the softmax's pass does both: it screens S against the references from Q and
K and gives P's checksum pass, from which the context's references follow by small GEMMs. Where
the check may read the host (the CPU), a matrix the screen flags goes to the full path: S is
verified and corrected from its operands as before, and P recomputed by Megatron's softmax from
the corrected S. Where it may not (a sync-free check on a GPU), a ``KernelCorrection`` has the
same op correct the flagged matrices of S, redo their P and P's pass, and tally the outcome into
the guard's ledger on the device (softmax_correct_tally): no second read of S.

``softmax`` is the differentiable op; ``fusable`` says where it reproduces Megatron's module;
``SoftmaxReader`` is the attention's softmax as the scores' guard reads S through it
(runtime.guard.SectionGuard.check_read), which makes the choices above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import attention_mask_func
from torch import Tensor

from megatron_abft.check.checker import KernelCorrection
from megatron_abft.check.checksum import Checksums, _constant, encode_from_pass
from megatron_abft.config import ABFTConfig
from megatron_abft.ops import compiled


def fusable(
    module: FusedScaleMaskSoftmax, scores: Tensor, mask: Tensor | None, offset: Tensor | None
) -> bool:
    """Whether ``softmax`` computes what ``module(scores, mask, offset)`` does, for scores
    ``[b, np, sq, sk]``: Megatron's masked_fill mask function, a bool mask of 4 dims or a causal
    (or no) mask, no sliding window, no softmax offset, and a device the kernels serve."""
    if offset is not None or module.window_size is not None:
        return False
    if module.mask_func is not attention_mask_func or scores.dim() != 4:
        return False
    if mask is not None and (mask.dtype != torch.bool or mask.dim() != 4):
        return False
    if mask is None and causal(module, scores) and scores.shape[-2] != scores.shape[-1]:
        return False  # Megatron asserts; leave it to say so
    return compiled.available() and compiled._serves(scores)


def causal(module: FusedScaleMaskSoftmax, scores: Tensor) -> bool:
    """Whether ``module`` masks ``scores`` causally when given no mask (Megatron: for sq > 1)."""
    return module.attn_mask_type == AttnMaskType.causal and scores.shape[-2] > 1


def masked_positions(
    module: FusedScaleMaskSoftmax, scores: Tensor, mask: Tensor | None, offset: Tensor | None
) -> Tensor | None:
    """Where ``module(scores, mask, offset)`` overwrites scores ``[b, ng, rep, sq, sk]``
    whatever they hold (True there; broadcastable): Megatron's masked_fill mask function writes
    its fill value there. Under a causal mask type both the causal mask (Megatron's fused
    kernel's) and the given one (its PyTorch path's) must mask a position. None where it masks
    nothing, or where what it reads is not known (another mask function, a sliding window, a
    softmax offset)."""
    if offset is not None or module.window_size is not None:
        return None
    if module.mask_func is not attention_mask_func:
        return None
    b, groups, rep, sq, sk = scores.shape
    given = None
    if mask is not None and mask.dtype == torch.bool and mask.dim() == 4:
        given = _grouped(mask, groups, rep)
    elif mask is not None:
        return None
    if module.attn_mask_type != AttnMaskType.causal or sq == 1:
        return given
    if sq != sk:
        return None
    causal_mask = _causal_mask(sq, sk, scores.device)
    return causal_mask if given is None else causal_mask & given


def _causal_mask(sq: int, sk: int, device: torch.device) -> Tensor:
    return _constant(
        ("causal", sq, sk, device),
        lambda: torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1),
    )


class _ScaleMaskSoftmax(torch.autograd.Function):
    """P = softmax(mask(scale S)) by softmax_check (or softmax_correct_tally, which may correct S
    in place first), with Megatron's gradient: the softmax's backward from P, zero where masked,
    times the scale."""

    @staticmethod
    def forward(ctx, scores, mask, is_causal, scale, sides, block, vectors, correction):
        if correction is None:
            u, z = vectors if vectors is not None else (None, None)
            found = torch.ops.megatron_abft.softmax_check(
                scores, *sides, mask, is_causal, scale, block, u, z
            )
        else:
            found = compiled.softmax_correct_tally(
                scores,
                sides,
                mask,
                is_causal,
                scale,
                block,
                vectors,
                correction.operands,
                correction.near_inf,
                correction.capacity,
                correction.ledger,
            )
        probs = found[0]
        ctx.mark_non_differentiable(*found[1:])
        ctx.set_materialize_grads(False)  # no zeros made for the findings' gradients
        ctx.save_for_backward(probs, mask)
        ctx.is_causal, ctx.scale = is_causal, scale
        return found

    @staticmethod
    def backward(ctx, grad, *_):
        if grad is None:  # P not used
            return (None,) * 8
        probs, mask = ctx.saved_tensors
        dtype = probs.dtype
        if dtype in (torch.bfloat16, torch.float16):  # in fp32, as Megatron's softmax_in_fp32
            grad, probs = grad.float(), probs.float()
        grad = torch._softmax_backward_data(grad, probs, -1, probs.dtype)  # a new tensor: ours
        if ctx.is_causal:
            mask = _causal_mask(*grad.shape[-2:], grad.device)
        if mask is not None:
            grad.masked_fill_(mask, 0.0)
        if ctx.scale != 1.0:
            grad.mul_(ctx.scale)
        return grad.to(dtype), None, None, None, None, None, None, None


def softmax(
    module: FusedScaleMaskSoftmax,
    scores: Tensor,
    mask: Tensor | None,
    sides: tuple,
    block: int,
    vectors: tuple[Tensor, Tensor] | None,
    correction: KernelCorrection | None = None,
) -> tuple[Tensor, ...]:
    """``module``'s softmax of ``scores [..., sq, sk]`` (``fusable``; ``mask`` broadcast to
    ``scores``) by softmax_check, differentiable in ``scores``: P, the screen's flagged counts
    per matrix, and P's checksum pass (see compiled.softmax_check). With a ``correction`` (and a
    screen), softmax_correct_tally instead: the flagged matrices corrected in place and tallied,
    and whether a matrix stayed uncorrectable in place of the flagged counts. The caller has
    checked that the kernels take these inputs (compiled.softmax_check_applies)."""
    is_causal = mask is None and causal(module, scores)
    scale = 1.0 if module.scale is None else float(module.scale)
    return _ScaleMaskSoftmax.apply(
        scores, mask, is_causal, scale, sides, block, vectors, correction
    )


@dataclass(frozen=True)
class SoftmaxReader:
    """The attention's softmax of the scores S ``[b, ng, rep, sq, sk]`` (a Reader of
    megatron_abft.check.checker): Megatron's ``module`` (``plain``), or the fused softmax where it
    computes the same (``read``), which screens S as it reads it and, with ``values`` V
    ``[b, ng, 1, sk, hn]``, gives the context's references from P's pass. Both return P as
    ``[b, np, sq, sk]`` and the context's references, or None where they are left to the
    context's own check."""

    module: FusedScaleMaskSoftmax
    mask: Tensor | None  # as the module takes it, [b|1, np|1, sq|1, sk]
    offset: Tensor | None
    block: int
    fused: bool  # whether the fused softmax computes the module's softmax of these scores
    grouped: Tensor | None  # the mask with its heads split as the scores' KV groups
    values: Tensor | None  # V, where the context's references come from P's pass
    vectors: tuple[Tensor, Tensor] | None  # V's for that pass (compiled.pair_vectors)

    @classmethod
    def of(
        cls,
        module: FusedScaleMaskSoftmax,
        scores: Tensor,
        mask: Tensor | None,
        offset: Tensor | None,
        values: Tensor | None,
        config: ABFTConfig,
    ) -> SoftmaxReader:
        """The reader of ``scores`` ``[b, ng, rep, sq, sk]``, with P's pass for the context's
        references where ``values`` are given."""
        b, groups, rep, sq, sk = scores.shape
        block, grouped, vectors = config.block_size, None, None
        fused = config.fused_softmax and fusable(
            module, scores.view(b, groups * rep, sq, sk), mask, offset
        )
        if fused:
            grouped = None if mask is None else _grouped(mask, groups, rep)
            if values is not None:
                vectors = compiled.pair_vectors(scores, values, block)
            fused = compiled.softmax_check_applies(scores, grouped, vectors)
        values = values if vectors is not None else None
        return cls(module, mask, offset, block, fused, grouped, values, vectors)

    def masked(self, scores: Tensor) -> Tensor | None:
        """Where the softmax overwrites ``scores`` ``[b, ng, rep, sq, sk]`` whatever they hold
        (``masked_positions``)."""
        return masked_positions(self.module, scores, self.mask, self.offset)

    def fuses(self, screen: bool) -> bool:
        """Whether the fused softmax reads S: where it computes the module's softmax, and has a
        ``screen`` or P's pass to do."""
        return self.fused and (screen or self.vectors is not None)

    def plain(self, scores: Tensor) -> tuple[Tensor, None]:
        b, groups, rep, sq, sk = scores.shape
        return self.module(scores.view(b, groups * rep, sq, sk), self.mask, self.offset), None

    def read(
        self, scores: Tensor, sides: tuple, correction: KernelCorrection | None = None
    ) -> tuple[Tensor, Tensor, tuple[Checksums, Checksums] | None]:
        """The fused softmax's P, the screen's finding (see ``softmax``) and the context's
        references."""
        b, groups, rep, sq, sk = scores.shape
        probs, found, *passed = softmax(
            self.module, scores, self.grouped, sides, self.block, self.vectors, correction
        )
        refs = None
        if self.values is not None:
            refs = encode_from_pass(probs, self.values, self.block, tuple(passed))
        return probs.view(b, groups * rep, sq, sk), found, refs


def _grouped(mask: Tensor, groups: int, rep: int) -> Tensor:
    """An attention mask ``[b|1, np|1, sq|1, sk]`` with its head dim split as the scores' KV
    groups, ``[b|1, ng|1, rep|1, sq|1, sk]``."""
    if mask.shape[1] == 1:
        return mask.unsqueeze(2)
    return mask.unflatten(1, (groups, rep))
