"""Kernel 3 in the attention: Megatron's scale-mask-softmax, the scores' screen and the context
operand's checksum pass in one read of the scores S (csrc/bindings/abft_softmax.cpp, DESIGN.md
section 5).

Unfused, a protected attention reads S three times besides the softmax's own pass: the scores'
verification reads S, the context's encoding reads P for its block sums and its products with
V's checksums. Here the softmax's pass does both: it screens S against the references from Q and
K and gives P's checksum pass, from which the context's references follow by small GEMMs. Where
the check may read the host (the CPU), a matrix the screen flags goes to the full path: S is
verified and corrected from its operands as before, and P recomputed by Megatron's softmax from
the corrected S. Where it may not (a sync-free check on a GPU), ``ScoresCorrection`` has the same
op correct the flagged matrices of S, redo their P and P's pass, and tally the outcome into the
guard's ledger on the device (softmax_correct_tally): no second read of S.

``softmax`` is the differentiable op; ``fusable`` says where it reproduces Megatron's module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import attention_mask_func
from torch import Tensor

from megatron_abft.check.checksum import _constant
from megatron_abft.check.ledger import Ledger
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


def _causal_mask(sq: int, sk: int, device: torch.device) -> Tensor:
    return _constant(
        ("causal", sq, sk, device),
        lambda: torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1),
    )


@dataclass(frozen=True)
class ScoresCorrection:
    """What ``softmax`` needs to correct the scores it screens, with no host read: the GEMM's
    operands (a, b, alpha: S = alpha a @ b), the check's near-INF bound and vectors per side,
    and the ledger it tallies into."""

    operands: tuple[Tensor, Tensor, float]
    near_inf: float
    capacity: int
    ledger: Ledger


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
        ctx.save_for_backward(probs, mask)
        ctx.is_causal, ctx.scale = is_causal, scale
        return found

    @staticmethod
    def backward(ctx, grad, *_):
        probs, mask = ctx.saved_tensors
        dtype = probs.dtype
        if dtype in (torch.bfloat16, torch.float16):  # in fp32, as Megatron's softmax_in_fp32
            grad, probs = grad.float(), probs.float()
        grad = torch._softmax_backward_data(grad, probs, -1, probs.dtype)
        if ctx.is_causal:
            mask = _causal_mask(*grad.shape[-2:], grad.device)
        if mask is not None:
            grad = grad.masked_fill(mask, 0.0)
        if ctx.scale != 1.0:
            grad = grad * ctx.scale
        return grad.to(dtype), None, None, None, None, None, None, None


def softmax(
    module: FusedScaleMaskSoftmax,
    scores: Tensor,
    mask: Tensor | None,
    sides: tuple,
    block: int,
    vectors: tuple[Tensor, Tensor] | None,
    correction: ScoresCorrection | None = None,
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
