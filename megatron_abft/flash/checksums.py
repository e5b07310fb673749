"""The flash kernels' checksum vectors, made in one pass over Q, K, V or dO before a launch.

A tile check compares ``C e`` with ``A (B e)``. The kernels take ``B e`` as the second operand
of a small MMA, ``A @ W`` with ``W [k, 16]``, so that the reference runs on the tensor cores
from operands already in place, with no fp32 copy of a tile in registers. ``B e`` is an fp32
vector; W holds it split into three parts of the input dtype (columns 0 to 2, the rest zero),
``w = (w0 + w1 + w2) * scale``: each part takes the next ~8 (bf16) or ~11 (fp16) bits, so the
sum keeps fp32's 24, and the product of two input-dtype values is exact in the MMA's fp32
accumulator. ``scale`` is a power of two that keeps fp16's parts in range.

Two kinds of vectors, per tile of ``block`` rows of a [batch, heads, seq, dim] tensor X:

- ``columns``: the tile's rows summed, ``sum_r X[r, :]`` (a [dim] vector), for a tile GEMM
  whose other operand's rows meet X's tile as rows (S = Q K^T: K's tile summed);
- ``rows``: each row summed over dim, ``sum_d X[r, d]`` (a [block] vector), for a GEMM that
  reduces over X's rows (P~V: V's row sums).

With each, the magnitudes the bound needs (``mass``): the L2 norm of the tile's absolute rows
summed and its largest row norm (columns), the largest absolute row sum (rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

PARTS = 3
WIDTH = 16
"""Columns of W: tl.dot's smallest N."""
_HEADROOM = {torch.float16: 13}
"""log2 of the largest scaled part, by dtype: fp16's parts stay below its 65504."""


def split(w: Tensor, dtype: torch.dtype, scale_dims: int) -> tuple[Tensor, Tensor]:
    """``w [..., n]`` (fp32) as ``[..., n, WIDTH]`` parts of ``dtype`` and the fp32 scale of
    each vector of the last ``scale_dims`` dims: ``w = sum(parts) * scale``."""
    peak = w.abs().amax(dim=tuple(range(-scale_dims, 0)), keepdim=True)
    if dtype in _HEADROOM:
        _, exponent = torch.frexp(peak)
        scale = torch.ldexp(torch.ones_like(peak), exponent - _HEADROOM[dtype])
    else:
        scale = torch.ones_like(peak)
    rest = w / scale
    parts = torch.zeros(*w.shape, WIDTH, dtype=dtype, device=w.device)
    for i in range(PARTS):
        parts[..., i] = rest.to(dtype)
        rest = rest - parts[..., i].float()
    return parts, scale.reshape(scale.shape[: w.dim() - scale_dims])


@dataclass
class Sums:
    """One kind of checksum vector of a tensor, per tile, as the kernels read them."""

    parts: Tensor
    """The vectors split for the MMA, in the input dtype: ``[batch * heads, tiles, width,
    WIDTH]`` for column sums, ``[batch * heads, tiles * block, WIDTH]`` for row sums."""
    stats: Tensor
    """``[batch * heads, tiles, 3]`` fp32: the scale, then the masses. Column sums: the L2 norm
    of the tile's absolute rows summed, the largest row's L2 norm. Row sums: the largest
    absolute row sum, and 0."""


def _tiles(x: Tensor, block: int, width: int) -> Tensor:
    """``x [b, h, n, d]`` as fp32 ``[b * h, tiles, block, width]``, zero-padded."""
    b, h, n, d = x.shape
    tiles = -(-n // block)
    padded = torch.zeros(b * h, tiles * block, width, dtype=torch.float32, device=x.device)
    padded[:, :n, :d] = x.reshape(b * h, n, d)
    return padded.view(b * h, tiles, block, width)


def columns(x: Tensor, block: int, width: int) -> Sums:
    """Column sums of each ``block``-row tile of ``x``, padded to ``width`` columns."""
    tiles = _tiles(x, block, width)
    parts, scale = split(tiles.sum(2), x.dtype, 1)
    norm = torch.linalg.vector_norm(tiles.abs().sum(2), dim=-1)
    peak = torch.linalg.vector_norm(tiles, dim=-1).amax(-1)
    return Sums(parts, torch.stack([scale, norm, peak], -1))


def rows(x: Tensor, block: int, width: int) -> Sums:
    """Row sums of ``x`` over dim, scaled per ``block``-row tile."""
    tiles = _tiles(x, block, width)
    parts, scale = split(tiles.sum(3), x.dtype, 1)
    peak = tiles.abs().sum(3).amax(-1)
    return Sums(parts.flatten(1, 2), torch.stack([scale, peak, torch.zeros_like(peak)], -1))
