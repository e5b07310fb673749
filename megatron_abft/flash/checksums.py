"""The flash kernels' checksum vectors, made by one Triton launch a tensor before a kernel runs.

A tile check compares ``C e`` with ``A (B e)``. The kernels take ``B e`` as the second operand
of a small MMA, ``A @ W`` with ``W [k, 16]``, so that the reference runs on the tensor cores
from operands already in place, with no fp32 copy of a tile in registers. ``B e`` is an fp32
vector; W holds it split into three parts of the input dtype (columns 0 to 2, the rest zero),
``w = (w0 + w1 + w2) * scale``: each part takes the next ~8 (bf16) or ~11 (fp16) bits, so the
sum keeps fp32's 24, and the product of two input-dtype values is exact in the MMA's fp32
accumulator. ``scale`` is a power of two that keeps fp16's parts in range (1 for bf16 and fp32).

Two kinds of vectors, per tile of ``block`` rows of a [batch, heads, seq, dim] tensor X, both
from one read of it:

- ``columns``: the tile's rows summed, ``sum_r X[r, :]`` (a [dim] vector), for a tile GEMM
  whose other operand meets X's tile as rows (S = Q K^T: K's tile summed);
- ``rows``: each row summed over dim, ``sum_d X[r, d]`` (a [block] vector), for a GEMM that
  reduces over X's rows (P~V: V's row sums); beside them, in columns 3 to 5, the rows' absolute
  sums ``sum_d |X[r, d]|``, so that where the GEMM's other operand is non-negative (P~) the same
  MMA gives the bound's mass ``|A| (|X| e)``.

With each, the masses the bound needs: the L2 norm of the tile's absolute rows summed
(columns) or its largest absolute row sum (rows), and its largest row's L2 norm.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from megatron_abft.flash import build

WIDTH = 16
"""Columns of W: tl.dot's smallest N."""
HEADROOM = {torch.float16: 13}
"""log2 of the largest scaled part, by dtype: fp16's parts stay below its 65504 (0: no
scaling, for bf16 and fp32, whose range is fp32's)."""


@dataclass
class Sums:
    """One kind of checksum vector of a tensor, per tile, as the kernels read them."""

    parts: Tensor
    """The vectors split for the MMA, in the input dtype: ``[batch * heads, tiles, width,
    WIDTH]`` for column sums, ``[batch * heads, tiles * block, WIDTH]`` for row sums."""
    stats: Tensor
    """``[batch * heads, tiles, 3]`` fp32: the scale, then the masses. Column sums: the L2 norm
    of the tile's absolute rows summed, the largest row's L2 norm. Row sums: the largest
    absolute row sum, the largest row's L2 norm."""


def sums(
    x: Tensor, block: int, width: int, columns: bool, rows: bool
) -> tuple[Sums | None, Sums | None]:
    """The column and row sums of each ``block``-row tile of ``x [b, h, n, d]``, padded to
    ``width`` columns (None for a kind not asked for): one launch, one read of ``x``."""
    b, h, n, d = x.shape
    tiles = triton.cdiv(n, block)
    matrices = b * h

    def empty(*shape, dtype=x.dtype):
        return torch.empty(*shape, dtype=dtype, device=x.device)

    made = (
        Sums(empty(matrices, tiles, width, WIDTH), empty(matrices, tiles, 3, dtype=torch.float32))
        if columns
        else None,
        Sums(empty(matrices, tiles * block, WIDTH), empty(matrices, tiles, 3, dtype=torch.float32))
        if rows
        else None,
    )
    placeholder = made[0] or made[1]
    col, row = (s or placeholder for s in made)
    build.for_device(sys.modules[__name__], x.device)._sums_kernel[(tiles, matrices)](
        x, col.parts, col.stats, row.parts, row.stats, *x.stride(), h, n, d,
        BLOCK=block, HEAD_DIM=width, COLUMNS=columns, ROWS=rows,
        HEADROOM=HEADROOM.get(x.dtype, 0), num_warps=4, num_stages=1,
    )  # fmt: skip
    return made


@triton.jit
def _scale(peak, HEADROOM: tl.constexpr):
    """A power of two that brings ``peak`` below 2**HEADROOM (HEADROOM 0: 1)."""
    if HEADROOM == 0:
        return 1.0
    exponent = (peak.to(tl.int32, bitcast=True) >> 23) & 0xFF  # frexp's exponent + 126
    power = tl.maximum(exponent - 126 - HEADROOM, -126)
    return ((power + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _split(w, first: tl.constexpr, dtype: tl.constexpr):
    """``w [n]`` (fp32) as ``[n, 16]`` fp32: three parts of ``dtype`` in columns ``first`` to
    ``first + 2``, each the rest of the ones before, so that they sum to ``w`` within fp32's
    rounding; zeros elsewhere."""
    p0 = w.to(dtype).to(tl.float32)
    rest = w - p0
    p1 = rest.to(dtype).to(tl.float32)
    p2 = (rest - p1).to(dtype).to(tl.float32)
    column = tl.arange(0, 16)[None, :] - first
    parts = tl.where(column == 0, p0[:, None], tl.where(column == 1, p1[:, None], 0.0))
    return tl.where(column == 2, p2[:, None], parts)


@triton.jit
def _sums_kernel(
    X, CP, CS, RP, RS, sxb, sxh, sxn, sxd, H, N, D,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, COLUMNS: tl.constexpr, ROWS: tl.constexpr,
    HEADROOM: tl.constexpr,
):  # fmt: skip
    """One tile of one (batch, head) of X: its column sums (CP, CS) and its row sums (RP, RS),
    as Sums lays them out."""
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    tiles = tl.num_programs(0)
    rows = tile * BLOCK + tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    at = (bh // H).to(tl.int64) * sxb + (bh % H).to(tl.int64) * sxh
    mask = (rows < N)[:, None] & (dims < D)[None, :]
    x = tl.load(X + at + rows[:, None] * sxn + dims[None, :] * sxd, mask=mask, other=0.0)
    x = x.to(tl.float32)
    base = (bh * tiles + tile).to(tl.int64)
    column = tl.arange(0, 16)[None, :]
    largest_row = tl.max(tl.sqrt(tl.sum(x * x, 1)), 0)
    if COLUMNS:
        w = tl.sum(x, 0)
        scale = _scale(tl.max(tl.abs(w), 0), HEADROOM)
        parts = _split(w / scale, 0, CP.dtype.element_ty).to(CP.dtype.element_ty)
        tl.store(CP + (base * HEAD_DIM + dims)[:, None] * 16 + column, parts)
        absolute = tl.sum(tl.abs(x), 0)
        tl.store(CS + base * 3, scale)
        tl.store(CS + base * 3 + 1, tl.sqrt(tl.sum(absolute * absolute, 0)))
        tl.store(CS + base * 3 + 2, largest_row)
    if ROWS:
        r = tl.sum(x, 1)
        a = tl.sum(tl.abs(x), 1)
        scale = _scale(tl.max(a, 0), HEADROOM)
        parts = _split(r / scale, 0, RP.dtype.element_ty) + _split(
            a / scale, 3, RP.dtype.element_ty
        )
        tl.store(
            RP + (base * BLOCK + tl.arange(0, BLOCK))[:, None] * 16 + column,
            parts.to(RP.dtype.element_ty),
        )
        tl.store(RS + base * 3, scale)
        tl.store(RS + base * 3 + 1, tl.max(a, 0))
        tl.store(RS + base * 3 + 2, largest_row)
