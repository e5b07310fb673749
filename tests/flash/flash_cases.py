"""Shared pieces of the flash attention tests: inputs, the float64 and same-precision PyTorch
references (FlashAttention's rule: an output is as good as the same-precision PyTorch
attention's, within 2x its error against float64), and a run of forward and backward.

The tests run on CPU tensors (Triton's interpreter); ``ABFT_FLASH_DEVICE=cuda`` runs the same
tests on the GPU's compiled kernels (tools/gpu_check.sh)."""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from megatron_abft.config import BACKWARD_SECTIONS, FLASH_SECTIONS
from megatron_abft.flash import FlashLedger, flash_attention
from megatron_abft.flash.attention import FORWARD

DEVICE = torch.device(os.environ.get("ABFT_FLASH_DEVICE", "cpu"))

_FORWARD = [s for s in FLASH_SECTIONS if s in FORWARD]  # in the sections' order
CALLS = list(zip(_FORWARD, BACKWARD_SECTIONS[: len(_FORWARD)], strict=True))
CALLS += [(b,) for b in BACKWARD_SECTIONS[len(_FORWARD) :]]
"""Every flash section once, grouped into calls that each take one transient fault a pass: a
forward section with a backward one, the other backward sections alone. A corrected forward
fault leaves the backward the clean run's inputs, so each fault is judged as if alone."""


def inputs(
    batch: int,
    heads: int,
    kv_heads: int,
    seq: int,
    dim: int,
    dtype: torch.dtype,
    seed: int = 0,
    kv_seq: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """q, k, v and an upstream gradient, standard normal, on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    kv_seq = seq if kv_seq is None else kv_seq

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)

    return (
        randn(batch, heads, seq, dim),
        randn(batch, kv_heads, kv_seq, dim),
        randn(batch, kv_heads, kv_seq, dim),
        randn(batch, heads, seq, dim),
    )


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tensor:
    """softmax(scale q k^T) v by PyTorch ops in the inputs' dtype; K and V repeated to the
    query heads; causal masks key j from query i when j > i."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        n_q, n_k = s.shape[-2:]
        future = torch.ones(n_q, n_k, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, -math.inf)
    return torch.softmax(s, dim=-1) @ v


def outputs(fn, q, k, v, do, dtype=None) -> list[Tensor]:
    """fn(q, k, v) and its gradients for the upstream gradient ``do``, in ``dtype`` (default:
    the inputs')."""
    leaves = [x.detach().to(dtype or x.dtype).requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)
    out.backward(do.to(out.dtype))
    return [t.detach() for t in (out, *(x.grad for x in leaves))]


def run(q, k, v, do, causal=True, **options) -> tuple[list[Tensor], FlashLedger]:
    """The protected flash attention's output and gradients, and what its checks found."""
    ledger = FlashLedger.on(q.device)
    result = outputs(
        lambda a, b, c: flash_attention(a, b, c, causal=causal, ledger=ledger, **options),
        q,
        k,
        v,
        do,
    )
    return result, ledger


def errors(got: list[Tensor], want: list[Tensor]) -> list[float]:
    return [(g.double() - w.double()).abs().max().item() for g, w in zip(got, want, strict=True)]
