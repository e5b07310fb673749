"""The unfused attention's two GEMMs by the checked GEMM (megatron_abft.ops.checked_gemm), for
ProtectedDotProductAttention with ``ABFTConfig.checked_gemm``: each output tile checked in the
GEMM's epilogue and computed again where flagged, so that no check reads the scores again.

Autograd functions whose forward is ``checked_matmul`` on the operands as Megatron holds them
(``[s, b, heads, d]``, keys and values not repeated for grouped-query attention) and whose
backward is the GEMMs' own, as ``baddbmm``'s and ``bmm``'s (unchecked, as Megatron's backward is
on this path).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_abft.config import ABFTConfig
from megatron_abft.ops import checked_gemm
from megatron_abft.runtime.guard import SectionGuard


def _repeated(t: Tensor, rep: int) -> Tensor:
    """``[b, groups, ...]`` as the ``[b, groups * rep, ...]`` heads read it."""
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def _by_group(t: Tensor, rep: int) -> Tensor:
    """A gradient of ``[b, groups * rep, ...]`` heads summed to their ``[b, groups, ...]``."""
    return t if rep == 1 else t.unflatten(1, (-1, rep)).sum(2)


class _Scores(torch.autograd.Function):
    """``alpha Q K^T`` for ``q [b, heads, sq, d]``, ``k [b, groups, sk, d]``: the scores
    ``[b, heads, sq, sk]`` and their tiles' codes."""

    @staticmethod
    def forward(ctx, q, k, alpha, check, threshold_scale, near_inf):
        ctx.save_for_backward(q, k)
        ctx.alpha = alpha
        scores, codes = checked_gemm.checked_matmul(
            q, k, alpha=alpha, check=check, threshold_scale=threshold_scale, near_inf=near_inf
        )
        ctx.mark_non_differentiable(codes)
        ctx.set_materialize_grads(False)  # no zeros made for the codes' gradient
        return scores, codes

    @staticmethod
    def backward(ctx, grad, _codes):
        if grad is None:  # the scores not used
            return (None,) * 6
        q, k = ctx.saved_tensors
        rep = q.shape[1] // k.shape[1]
        grad = grad * ctx.alpha
        grad_q = grad @ _repeated(k, rep)
        grad_k = _by_group(grad.mT @ q, rep)
        return grad_q, grad_k, None, None, None, None


class _Context(torch.autograd.Function):
    """``P V`` for ``p [b, heads, sq, sk]``, ``v [b, groups, sk, d]``: the context, written as
    ``[sq, b, heads, d]`` (returned as its ``[b, heads, sq, d]`` view), and its tiles' codes."""

    @staticmethod
    def forward(ctx, p, v, check, threshold_scale, near_inf):
        ctx.save_for_backward(p, v)
        b, heads, sq = p.shape[:3]
        out = p.new_empty(sq, b, heads, v.shape[-1]).permute(1, 2, 0, 3)
        context, codes = checked_gemm.checked_matmul(
            p, v.mT, out=out, check=check, threshold_scale=threshold_scale, near_inf=near_inf
        )
        ctx.mark_non_differentiable(codes)
        ctx.set_materialize_grads(False)  # no zeros made for the codes' gradient
        return context, codes

    @staticmethod
    def backward(ctx, grad, _codes):
        if grad is None:  # the context not used
            return (None,) * 5
        p, v = ctx.saved_tensors
        rep = p.shape[1] // v.shape[1]
        grad_p = grad @ _repeated(v, rep).mT
        grad_v = _by_group(p.mT @ grad, rep)
        return grad_p, grad_v, None, None, None


def scores(q: Tensor, k: Tensor, alpha: float, guard: SectionGuard, config: ABFTConfig) -> Tensor:
    """The scores ``[b, heads, sq, sk]`` of ``q [sq, b, heads, d]`` and ``k [sk, b, groups, d]``
    (Megatron's layout), checked where ``guard`` is due."""
    out, codes = _Scores.apply(
        q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), alpha, guard.due,
        config.threshold_scale, config.near_inf,
    )  # fmt: skip
    if guard.due:
        _tally(guard, codes, out.shape[-1], k.shape[2])
    return out


def context(p: Tensor, v: Tensor, guard: SectionGuard, config: ABFTConfig) -> Tensor:
    """The context ``[sq, b, heads * d]`` of ``p [b, heads, sq, sk]`` and ``v [sk, b, groups,
    d]``, checked where ``guard`` is due."""
    out, codes = _Context.apply(
        p, v.permute(1, 2, 0, 3), guard.due, config.threshold_scale, config.near_inf
    )
    if guard.due:
        _tally(guard, codes, out.shape[-1], v.shape[2])
    b, heads, sq, d = out.shape
    return out.permute(2, 0, 1, 3).reshape(sq, b, heads * d)  # a view: written in this order


def _tally(guard: SectionGuard, codes: Tensor, n: int, groups: int) -> None:
    """The tiles' ``codes [b, heads, tiles]`` into ``guard``'s ledger, a matrix by its worst
    tile, named as the attention's checks name them (``[b, groups, heads a group]``)."""
    b, heads = codes.shape[:2]
    tile, ledger = checked_gemm.tiles_for(codes.device), guard.ledger_on(codes.device)
    failed = checked_gemm.tally(codes, n, tile, ledger)
    guard.keep_pending(failed, (b, groups, heads // groups))
