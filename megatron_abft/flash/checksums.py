"""The flash kernels' checksum vectors, made by Triton launches before a kernel runs: one for
K and V before the forward, and before the backward the launch that computes Delta, for Q and
dO and for dQ's of K and V.

A tile check compares ``C e`` with ``A (B e)``. The kernels take ``B e`` as the second operand
of a small MMA, ``A @ W`` with ``W [k, 16]``, so that the reference runs on the tensor cores
from operands already in place, with no fp32 copy of a tile in registers. ``B e`` is an fp32
vector; W holds it split into three parts of the input dtype (columns 0 to 2, the rest zero),
``w = (w0 + w1 + w2) * scale``: each part takes the next ~8 (bf16) or ~11 (fp16) bits, so the
sum keeps fp32's 24, and the product of two input-dtype values is exact in the MMA's fp32
accumulator. ``scale`` is a power of two that keeps fp16's parts in range (1 for bf16 and fp32):
for the row sums, one a head, so that the kernels accumulate a reference over the head's tiles
in the MMA and scale it once, after their loops. The tile launch writes fp16's row sums in fp32
with each tile's peak, and the launch's last program of each head, which adds up the column
sums, splits them at the head's scale (``_running``).
A row far below its head's peak may have parts in fp16's subnormals, a loss of at most
PART_LOSS a part set; the rows' absolute sums, the masses of the accumulated checks, are
widened to cover it (``slack``).

Two kinds of vectors, per tile of ``block`` rows of a [batch, heads, seq, dim] tensor X, both
from one read of it:

- ``columns``: the tile's rows summed, ``sum_r X[r, :]`` (a [dim] vector), for a tile GEMM
  whose other operand meets X's tile as rows (S = Q K^T: K's tile summed);
- ``rows``: each row summed over dim, ``sum_d X[r, d]`` (a [block] vector), for a GEMM that
  reduces over X's rows (P~V: V's row sums); beside them, in columns 3 to 5, the rows' absolute
  sums ``sum_d |X[r, d]|``, so that where the GEMM's other operand is non-negative (P~) the same
  MMA gives the bound's mass ``|A| (|X| e)``; and a column of ones (tiles.ONES), so that it
  also gives ``A e``, the other operand's row sums (dQ's ``sum dS~ = 0``).

With each, the masses the bound needs: the L2 norm of the tile's absolute rows summed
(columns) or its largest absolute row sum (rows), and its largest row's L2 norm.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from megatron_abft.flash import build
from megatron_abft.flash.tiles import ONES, WIDTH

ROWS = 128
"""The LSE's and Delta's rows a head are padded to a multiple of this (every query tile
divides it), so that the kernels read them past the end with no mask."""
HEADROOM = {torch.float16: 13}
"""log2 of the largest scaled part, by dtype: fp16's parts stay below its 65504 (0: no
scaling, for bf16 and fp32, whose range is fp32's)."""
PART_LOSS = 2.0**-25
"""The most a value's three fp16 parts lose to subnormals, in units of their scale: half of
fp16's smallest subnormal (the last nonzero part rounds to that grid; a value whose parts stay
normal loses about 2**-33 of itself, fp32's rounding covers it)."""
ONES_COLUMN = tl.constexpr(ONES)
SCAN = tl.constexpr(1024)
"""Column-sum values (tiles x head dim) the running sums (_prefix_sums) add up in one step."""
CHUNK = tl.constexpr(256)
"""Rows the split of fp16's row sums takes at a time (a multiple of any tile's)."""
RAW_VALUES = tl.constexpr(5)
"""fp32 values a query row that fp16's backward keeps for its split: dO's sum, absolute sum and
L2 norm, Q's sum and absolute sum."""


@functools.cache
def placeholder(dtype: torch.dtype, device: torch.device) -> Tensor:
    """An empty tensor for a kernel argument that a launch does not read: one a dtype and device
    for every call, so that a call makes only the tensors it uses."""
    return torch.empty(0, dtype=dtype, device=device)


@dataclass
class Sums:
    """One kind of checksum vector of a tensor, per tile, as the kernels read them."""

    parts: Tensor
    """The vectors split for the MMA, in the input dtype: ``[batch * heads, tiles, width,
    WIDTH]`` for column sums, ``[batch * heads, tiles * block, WIDTH]`` for row sums (columns
    0-2, their absolute values' in 3-5, and ones in tiles.ONES)."""
    stats: Tensor
    """``[batch * heads, tiles, 3]`` fp32: the scale, then the masses. Column sums (a prefix):
    the L2 norms of the tiles' absolute rows summed, added over the prefix, and the tile's
    largest row's L2 norm. Row sums: the largest absolute row sum, the largest row's L2
    norm."""


@dataclass
class KeyValueWork:
    """What ``key_value_sums`` makes and the arguments of the launch that makes it, for its own
    launch or as a part of the backward's first (``backward``'s ``keys``)."""

    made: tuple[Sums | None, Sums | None, Sums | None]
    """K's column sums, K's row sums, V's row sums (None for a kind not asked for)."""
    args: tuple
    """_key_value_tile's tensors and runtime values, in its order (placeholders where nothing
    is made)."""
    constants: dict
    """Its constexprs but HEAD_DIM and HEADROOM."""
    tiles: int
    matrices: int

    @property
    def due(self) -> bool:
        """Whether it makes anything."""
        return any(self.made)


def key_value_work(
    k: Tensor, v: Tensor, block: int, width: int, columns: bool, k_rows: bool, v_rows: bool,
    slack: float = 0.0, done: Tensor | None = None,
) -> KeyValueWork:  # fmt: skip
    """The buffers and launch arguments of ``key_value_sums`` (its arguments), not launched."""
    b, h, n, d = k.shape
    tiles = -(-n // block)
    matrices = b * h

    def empty(*shape, dtype=k.dtype):
        return torch.empty(*shape, dtype=dtype, device=k.device)

    def row_sums():
        return Sums(
            empty(matrices, tiles * block, WIDTH), empty(matrices, tiles, 3, dtype=torch.float32)
        )

    made = (
        Sums(empty(matrices, tiles, width, WIDTH), empty(matrices, tiles, 3, dtype=torch.float32))
        if columns
        else None,
        row_sums() if k_rows else None,
        row_sums() if v_rows else None,
    )
    # a program takes a tile of K (V where nothing of K's is asked for), then V's row sums; a
    # kind not asked for writes nowhere (placeholders; all of them where nothing is asked for)
    nothing = Sums(placeholder(k.dtype, k.device), placeholder(torch.float32, k.device))
    of_k = columns or k_rows
    x, x_rows = (k, made[1]) if of_k else (v, made[2])
    both = of_k and v_rows
    col, row = made[0] or nothing, x_rows or nothing
    y = made[2] if both else nothing
    column_sums = empty(matrices, tiles, width, dtype=torch.float32) if columns else col.stats
    rows = x_rows is not None
    headroom = HEADROOM.get(k.dtype, 0)
    # fp16: each row's sum and absolute sum in fp32, split after at the head's scale
    x_raw, y_raw = (
        empty(matrices, tiles * block, 2, dtype=torch.float32) if headroom and wanted else col.stats
        for wanted in (rows, both)
    )
    split = headroom != 0 and (rows or both)
    if done is None:
        done = _counters(matrices, columns or split, k.device)
    args = (
        x, column_sums, col.parts, col.stats, row.parts, row.stats, x_raw, *x.stride(), v,
        y.parts, y.stats, y_raw, *v.stride(), done, h, n, d, slack,
    )  # fmt: skip
    constants = dict(BLOCK=block, COLUMNS=columns, ROWS=rows, Y_ROWS=both, SPLIT=split)
    return KeyValueWork(made, args, constants, tiles, matrices)


def key_value_sums(
    k: Tensor, v: Tensor, block: int, width: int, columns: bool, k_rows: bool, v_rows: bool,
    slack: float = 0.0, done: Tensor | None = None,
) -> tuple[Sums | None, Sums | None, Sums | None]:  # fmt: skip
    """K's column sums (each over the tiles from the first to it, a prefix) and row sums, and
    V's row sums, of ``block``-row tiles padded to ``width`` columns (None for a kind not asked
    for): one launch over K and V, whose last program of each head adds up the prefix sums and
    splits fp16's row sums. ``slack``: each row's absolute sum is widened by ``slack * scale``
    (the tiles' bound per unit of mass times it covers PART_LOSS). ``done``: a zeroed int32
    counter a (batch, head) of K, where the prefix sums or fp16's split are due (made here,
    one launch more, when not given)."""
    if not (columns or k_rows or v_rows):  # an unchecked forward: nothing to make
        return None, None, None
    work = key_value_work(k, v, block, width, columns, k_rows, v_rows, slack, done)
    if work.due:
        module = build.for_device(sys.modules[__name__], k.device)
        module._sums_kernel[(work.tiles, work.matrices)](
            *work.args, HEAD_DIM=width, HEADROOM=HEADROOM.get(k.dtype, 0), **work.constants,
            num_warps=4, num_stages=1,
        )  # fmt: skip
    return work.made


def _counters(matrices: int, counted: bool, device: torch.device) -> Tensor:
    """Zeroed counters a (batch, head) for _head_done where a launch's last programs add up its
    heads (one launch), a placeholder where they do not."""
    if not counted:
        return placeholder(torch.int32, device)
    return torch.zeros(matrices, dtype=torch.int32, device=device)


@triton.jit
def _head_done(DONE, programs):
    """Whether this program is the last of its head's ``programs`` to get here: each counts
    itself in DONE (zeroed before the launch) after a barrier, so that the last one's loads come
    after every other program's stores (acquire-release). The kernels module has its own
    (``_last``): each build of a module resolves only its own helpers."""
    tl.debug_barrier()
    return tl.atomic_add(DONE, 1, sem="acq_rel") == programs - 1


@triton.jit
def _scale(peak, HEADROOM: tl.constexpr):
    """A power of two that brings ``peak`` below 2**HEADROOM (HEADROOM 0: 1)."""
    if HEADROOM == 0:
        return 1.0
    exponent = (peak.to(tl.int32, bitcast=True) >> 23) & 0xFF  # frexp's exponent + 126
    power = tl.maximum(exponent - 126 - HEADROOM, -126)
    return ((power + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _head_scale(PEAKS, stride, tiles, HEADROOM: tl.constexpr):
    """The scale of a head's rows: ``_scale`` of the largest of its tiles' peaks, ``PEAKS[t *
    stride]`` for tile t."""
    top = tl.zeros([128], tl.float32)
    for first in range(0, tiles, 128):
        t = first + tl.arange(0, 128)
        top = tl.maximum(top, tl.load(PEAKS + t * stride, mask=t < tiles, other=0.0))
    return _scale(tl.max(top, 0), HEADROOM)


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
    X, CF, CP, CS, RP, RS, XR, sxb, sxh, sxn, sxd, Y, YP, YS, YR, syb, syh, syn, syd, DONE, H,
    N, D, slack, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, COLUMNS: tl.constexpr,
    ROWS: tl.constexpr, Y_ROWS: tl.constexpr, SPLIT: tl.constexpr, HEADROOM: tl.constexpr,
):  # fmt: skip
    """One tile of one (batch, head) of key_value_sums (_key_value_tile)."""
    _key_value_tile(X, CF, CP, CS, RP, RS, XR, sxb, sxh, sxn, sxd, Y, YP, YS, YR, syb, syh,
                    syn, syd, DONE, H, N, D, slack, tl.program_id(0), tl.program_id(1),
                    tl.num_programs(0), BLOCK, HEAD_DIM, COLUMNS, ROWS, Y_ROWS, SPLIT,
                    HEADROOM)  # fmt: skip


@triton.jit
def _key_value_tile(
    X, CF, CP, CS, RP, RS, XR, sxb, sxh, sxn, sxd, Y, YP, YS, YR, syb, syh, syn, syd, DONE, H,
    N, D, slack, tile, bh, tiles, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
    COLUMNS: tl.constexpr, ROWS: tl.constexpr, Y_ROWS: tl.constexpr, SPLIT: tl.constexpr,
    HEADROOM: tl.constexpr,
):  # fmt: skip
    """Tile ``tile`` of (batch, head) ``bh``, of ``tiles`` a head: X's column sums (CF, fp32,
    and their masses in CS) and row sums (RP, RS), and with Y_ROWS Y's row sums (YP, YS), as
    Sums lays them out; with SPLIT, the row sums in fp32 (XR, YR: a row's sum and absolute sum)
    instead. The head's last program then adds up the column sums into their parts (CP) and
    splits the row sums at the head's scale (_running)."""
    _tile_sums(X, CF, CS, RP, RS, XR, sxb, sxh, sxn, sxd, H, N, D, slack, tile, bh, tiles,
               BLOCK, HEAD_DIM, COLUMNS, ROWS, HEADROOM)  # fmt: skip
    if Y_ROWS:
        _tile_sums(Y, CF, CS, YP, YS, YR, syb, syh, syn, syd, H, N, D, slack, tile, bh, tiles,
                   BLOCK, HEAD_DIM, False, True, HEADROOM)  # fmt: skip
    if COLUMNS or SPLIT:
        if _head_done(DONE + bh, tiles):
            _running(CF, CP, CS, tiles, XR, RP, RS, YR, YP, YS, bh.to(tl.int64), slack,
                     HEAD_DIM, HEADROOM, BLOCK, COLUMNS, SPLIT and ROWS,
                     SPLIT and Y_ROWS)  # fmt: skip


@triton.jit
def _tile_sums(
    X, CF, CS, RP, RS, XR, sxb, sxh, sxn, sxd, H, N, D, slack, tile, bh, tiles,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, COLUMNS: tl.constexpr, ROWS: tl.constexpr,
    HEADROOM: tl.constexpr,
):  # fmt: skip
    rows = tile * BLOCK + tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    at = (bh // H).to(tl.int64) * sxb + (bh % H).to(tl.int64) * sxh
    mask = (rows < N)[:, None] & (dims < D)[None, :]
    x = tl.load(X + at + rows[:, None] * sxn + dims[None, :] * sxd, mask=mask, other=0.0)
    x = x.to(tl.float32)
    base = (bh * tiles + tile).to(tl.int64)
    largest_row = tl.max(tl.sqrt(tl.sum(x * x, 1)), 0)
    if COLUMNS:  # fp32, for _running
        tl.store(CF + base * HEAD_DIM + dims, tl.sum(x, 0))
        absolute = tl.sum(tl.abs(x), 0)
        tl.store(CS + base * 3 + 1, tl.sqrt(tl.sum(absolute * absolute, 0)))
        tl.store(CS + base * 3 + 2, largest_row)
    if ROWS:
        r = tl.sum(x, 1)
        a = tl.sum(tl.abs(x), 1)
        at_rows = base * BLOCK + tl.arange(0, BLOCK)
        if HEADROOM == 0:
            _store_parts(RP, at_rows, r, a, 1.0, slack, at_rows >= 0)
            tl.store(RS + base * 3, 1.0)
        else:  # split at the head's scale by _running
            tl.store(XR + at_rows * 2, r)
            tl.store(XR + at_rows * 2 + 1, a)
        tl.store(RS + base * 3 + 1, tl.max(a, 0))
        tl.store(RS + base * 3 + 2, largest_row)


@triton.jit
def _store_parts(RP, at_rows, r, a, scale, slack, ok):
    """Rows ``at_rows`` of RP (those ``ok``): the parts of ``r`` and of ``a`` widened by
    ``slack`` (columns 0-2 and 3-5), at ``scale``, and ones in column ONES."""
    dtype = RP.dtype.element_ty
    parts = _split(r / scale, 0, dtype) + _split(a / scale + slack, 3, dtype)
    column = tl.arange(0, 16)[None, :]
    parts = tl.where(column == ONES_COLUMN, 1.0, parts)
    at = RP + at_rows[:, None] * 16 + column
    tl.store(at, parts.to(dtype), mask=ok[:, None])


@triton.jit
def _head_rows(XR, RP, RS, bh, TILES, slack, BLOCK: tl.constexpr, HEADROOM: tl.constexpr):
    """A head's row sums (XR: each row's sum and absolute sum, fp32; RS slot 1: each tile's
    peak) split at the head's scale into RP, CHUNK rows at a time, the scale into each tile's RS
    slot 0."""
    scale = _head_scale(RS + bh * TILES * 3 + 1, 3, TILES, HEADROOM)
    rows = TILES * BLOCK
    for first in range(0, rows, CHUNK):
        offs = first + tl.arange(0, CHUNK)
        ok = offs < rows
        at_rows = bh * rows + offs
        r = tl.load(XR + at_rows * 2, mask=ok, other=0.0)
        a = tl.load(XR + at_rows * 2 + 1, mask=ok, other=0.0)
        _store_parts(RP, at_rows, r, a, scale, slack, ok)
        tiles = first // BLOCK + tl.arange(0, CHUNK // BLOCK)
        at = RS + (bh * TILES + tiles) * 3
        tl.store(at, scale + tl.zeros([CHUNK // BLOCK], tl.float32), mask=tiles < TILES)


@dataclass
class Backward:
    """What the backward's kernels read before their loops, made by ``backward``."""

    delta: Tensor
    """``[batch * heads, rows]`` fp32: Delta = rowsum(dO * O), ``rows`` the sequence padded to
    ROWS (0 past its end)."""
    odo: Tensor
    """``sum |dO| |O|`` a row, the rounding of the stored O in Delta (``delta`` when not made)."""
    rows: Tensor
    """``[batch * heads, tiles * 2 * block, WIDTH]``: two tiles a query block, stacked, that one
    MMA of ``[P^T | dS^T]`` takes. The first, for P^T (dV's reference, dV's and dK's masses),
    dO's: parts of ``dO e`` in columns 0-2, ``|dO| e`` in 3-5, ``||dO_m|| (|Q| e)_m`` in 9-11
    and ``|Delta_m| (|Q| e)_m`` in 12-14; the second, for dS^T (dK's reference), Q's: parts of
    ``Q e`` in 6-8. Each is zero in the other's columns (and wholly, where not asked for)."""
    columns: Tensor
    """``[batch * heads, tiles, width, WIDTH]``: the column sums of Q (columns 0-2) and of dO
    (3-5) over the tiles from each one to the last, for the per-head checks of S^T and dP^T."""
    stats: Tensor
    """``[batch * heads, tiles, 8]`` fp32: the scales of rows' dO columns and of its Q columns
    (the head's), and of columns, the Cauchy-Schwarz masses of Q's and dO's column sums from the
    tile to the last, and the tile's sums of rows' columns 9-11 and 12-14 (unsplit)."""


def backward(
    o: Tensor, do: Tensor, q: Tensor, block: int, width: int, odo: bool, rows: bool,
    queries: bool, columns: bool, slack: float = 0.0, done: Tensor | None = None,
    keys: KeyValueWork | None = None,
) -> Backward:  # fmt: skip
    """Delta, and the backward's checksum tiles of ``block`` queries (those asked for: ``rows``,
    dO's; ``queries``, Q's; ``columns``, the suffix column sums): one launch over O, dO and Q,
    whose last program of each head adds up the suffix sums and splits fp16's row sums.
    ``slack`` as in key_value_sums, for dO's absolute row sums and Q's (in dK's masses);
    ``done`` as there, a counter a (batch, head) of Q. ``keys``: key_value_sums' work for the
    kernels after (dQ's tiles of K and V), made by programs of the same launch
    (``keys.made``)."""
    b, h, n, d = q.shape
    tiles = -(-n // block)
    matrices = b * h
    padded = -(-n // ROWS) * ROWS

    def empty(*shape, dtype=q.dtype, wanted=True):
        if not wanted:
            return placeholder(dtype, q.device)
        return torch.empty(*shape, dtype=dtype, device=q.device)

    delta = empty(matrices, padded, dtype=torch.float32)
    made = Backward(
        delta,
        empty(matrices, padded, dtype=torch.float32) if odo else delta,
        empty(matrices, tiles * 2 * block, WIDTH, wanted=rows or queries),
        empty(matrices, tiles, width, WIDTH, wanted=columns),
        empty(matrices, tiles, 8, dtype=torch.float32, wanted=rows or queries or columns),
    )
    sums = empty(matrices, tiles, 2, width, dtype=torch.float32, wanted=columns)
    module = build.for_device(sys.modules[__name__], q.device)
    headroom = HEADROOM.get(q.dtype, 0)
    split = headroom != 0 and (rows or queries)
    # fp16: a row's values in fp32 (RAW_VALUES) and each tile's peaks of dO's and Q's
    raw = empty(matrices, tiles * block, RAW_VALUES, dtype=torch.float32, wanted=split)
    peaks = empty(matrices, tiles, 2, dtype=torch.float32, wanted=split)
    programs = padded // block
    if not (odo or rows or queries or columns or (keys and keys.due)):  # Delta alone
        module._delta_kernel[(programs, matrices)](
            o, do, made.delta, *o.stride(), *do.stride(), h, n, d, BLOCK=block, HEAD_DIM=width,
            num_warps=4, num_stages=1,
        )  # fmt: skip
        return made
    if done is None:
        done = _counters(matrices, columns or split, q.device)
    if keys is None:
        keys = key_value_work(q, q, block, width, False, False, False)
    grid = (programs + (keys.tiles if keys.due else 0), matrices)
    module._backward_kernel[grid](
        o, do, q, made.delta, made.odo, made.rows, sums, made.columns, made.stats, raw, peaks,
        done, *o.stride(), *do.stride(), *q.stride(), h, n, d, tiles, slack, programs,
        *keys.args, keys.matrices, BLOCK=block, HEAD_DIM=width, ODO=odo, ROWS=rows,
        QUERIES=queries, COLUMNS=columns, SPLIT=split, HEADROOM=headroom, KEYS=keys.due,
        **{f"K_{name}": value for name, value in keys.constants.items()},
        num_warps=4, num_stages=1,
    )  # fmt: skip
    return made


@triton.jit
def _backward_kernel(
    OUT, DO, Q, DELTA, ABS, RW, CF, CP, ST, RAW, PK, DONE, sob, soh, som, sod, sdob, sdoh, sdom,
    sdod, sqb, sqh, sqm, sqd, H, N, D, TILES, slack, PROGRAMS, KX, KCF, KCP, KCS, KRP, KRS, KXR,
    skxb, skxh, skxn, skxd, KY, KYP, KYS, KYR, skyb, skyh, skyn, skyd, K_DONE, K_H, K_N, K_D,
    k_slack, K_MATRICES, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, ODO: tl.constexpr,
    ROWS: tl.constexpr, QUERIES: tl.constexpr, COLUMNS: tl.constexpr, SPLIT: tl.constexpr,
    HEADROOM: tl.constexpr, KEYS: tl.constexpr, K_BLOCK: tl.constexpr, K_COLUMNS: tl.constexpr,
    K_ROWS: tl.constexpr, K_Y_ROWS: tl.constexpr, K_SPLIT: tl.constexpr,
):  # fmt: skip
    """The first PROGRAMS programs of each (batch, head): its query tiles (_delta_tile); with
    KEYS, the programs after them: the tiles of key_value_sums' work (the K arguments, as
    _key_value_tile takes them) of the first K_MATRICES."""
    if tl.program_id(0) < PROGRAMS:
        _delta_tile(OUT, DO, Q, DELTA, ABS, RW, CF, CP, ST, RAW, PK, DONE, sob, soh, som, sod,
                    sdob, sdoh, sdom, sdod, sqb, sqh, sqm, sqd, H, N, D, TILES, slack, PROGRAMS,
                    BLOCK, HEAD_DIM, ODO, ROWS, QUERIES, COLUMNS, SPLIT, HEADROOM)  # fmt: skip
    elif KEYS:
        if tl.program_id(1) < K_MATRICES:
            _key_value_tile(KX, KCF, KCP, KCS, KRP, KRS, KXR, skxb, skxh, skxn, skxd, KY, KYP,
                            KYS, KYR, skyb, skyh, skyn, skyd, K_DONE, K_H, K_N, K_D, k_slack,
                            tl.program_id(0) - PROGRAMS, tl.program_id(1),
                            tl.num_programs(0) - PROGRAMS, K_BLOCK, HEAD_DIM, K_COLUMNS, K_ROWS,
                            K_Y_ROWS, K_SPLIT, HEADROOM)  # fmt: skip


@triton.jit
def _delta_kernel(
    OUT, DO, DELTA, sob, soh, som, sod, sdob, sdoh, sdom, sdod, H, N, D, BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """One query tile of one (batch, head): Delta alone (_delta_tile with nothing else asked
    for), for a call that checks nothing of the backward's: a launch of few arguments."""
    _delta_tile(OUT, DO, OUT, DELTA, DELTA, DO, DELTA, DO, DELTA, DELTA, DELTA, DELTA, sob, soh,
                som, sod, sdob, sdoh, sdom, sdod, 0, 0, 0, 0, H, N, D, 0, 0.0, tl.num_programs(0),
                BLOCK, HEAD_DIM, False, False, False, False, False, 0)  # fmt: skip


@triton.jit
def _delta_tile(
    OUT, DO, Q, DELTA, ABS, RW, CF, CP, ST, RAW, PK, DONE, sob, soh, som, sod, sdob, sdoh, sdom,
    sdod, sqb, sqh, sqm, sqd, H, N, D, TILES, slack, PROGRAMS, BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr, ODO: tl.constexpr, ROWS: tl.constexpr, QUERIES: tl.constexpr,
    COLUMNS: tl.constexpr, SPLIT: tl.constexpr, HEADROOM: tl.constexpr,
):  # fmt: skip
    """One query tile of one (batch, head), of PROGRAMS a head: Delta (and with ODO its
    rounding, in ABS) for its rows, those past N (up to the padded rows, as the LSE) zero; and
    for the first TILES tiles the checksum tiles Backward describes (CF: the tile's column sums
    of Q and dO, fp32); with SPLIT, the rows' values in fp32 (RAW, RAW_VALUES a row) and the
    tile's peaks of dO's and Q's rows (PK) instead. The head's last program then adds up the
    column sums into their parts (CP) and splits the row sums at the head's scales
    (_backward_running)."""
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    tiles = TILES
    padded = PROGRAMS * BLOCK
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = tile * BLOCK + tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    mask = (rows < N)[:, None] & (dims < D)[None, :]
    o = tl.load(OUT + b * sob + h * soh + rows[:, None] * som + dims[None, :] * sod, mask=mask,
                other=0.0).to(tl.float32)  # fmt: skip
    do = tl.load(DO + b * sdob + h * sdoh + rows[:, None] * sdom + dims[None, :] * sdod,
                 mask=mask, other=0.0).to(tl.float32)  # fmt: skip
    at = bh.to(tl.int64) * padded + rows
    delta = tl.sum(o * do, 1)
    tl.store(DELTA + at, delta)
    if ODO:
        tl.store(ABS + at, tl.sum(tl.abs(o) * tl.abs(do), 1))
    if ROWS or QUERIES or COLUMNS:
        if tile < TILES:
            q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + dims[None, :] * sqd,
                        mask=mask, other=0.0).to(tl.float32)  # fmt: skip
            base = (bh * tiles + tile).to(tl.int64)
            at_rows = base * BLOCK + tl.arange(0, BLOCK)
            r, a, dn = tl.sum(do, 1), tl.sum(tl.abs(do), 1), tl.sqrt(tl.sum(do * do, 1))
            rq, qa = tl.sum(q, 1), tl.sum(tl.abs(q), 1)
            if (ROWS or QUERIES) and HEADROOM == 0:
                _backward_parts(RW, ST, base, base + 1, at_rows, r, a, dn, delta, rq, qa,
                                at_rows >= 0, 1.0, 1.0, slack, BLOCK, ROWS, QUERIES)  # fmt: skip
            elif ROWS or QUERIES:  # dO's parts hold by_norm and by_delta too
                peak = tl.maximum(tl.max(a, 0), tl.max(dn * qa, 0))
                tl.store(PK + base * 2, tl.maximum(peak, tl.max(tl.abs(delta) * qa, 0)))
                tl.store(PK + base * 2 + 1, tl.max(qa, 0))
                tl.store(RAW + at_rows * RAW_VALUES, r)
                tl.store(RAW + at_rows * RAW_VALUES + 1, a)
                tl.store(RAW + at_rows * RAW_VALUES + 2, dn)
                tl.store(RAW + at_rows * RAW_VALUES + 3, rq)
                tl.store(RAW + at_rows * RAW_VALUES + 4, qa)
            if COLUMNS:
                tl.store(CF + (base * 2) * HEAD_DIM + dims, tl.sum(q, 0))
                tl.store(CF + (base * 2 + 1) * HEAD_DIM + dims, tl.sum(do, 0))
                q_abs = tl.sum(tl.abs(q), 0)
                do_abs = tl.sum(tl.abs(do), 0)
                tl.store(ST + base * 8 + 3, tl.sqrt(tl.sum(q_abs * q_abs, 0)))
                tl.store(ST + base * 8 + 4, tl.sqrt(tl.sum(do_abs * do_abs, 0)))
    if COLUMNS or SPLIT:
        if _head_done(DONE + bh, PROGRAMS):
            _backward_running(CF, CP, ST, TILES, RAW, PK, DELTA, RW, padded, slack,
                              bh.to(tl.int64), HEAD_DIM, HEADROOM, BLOCK, COLUMNS,
                              SPLIT and ROWS, SPLIT and QUERIES)  # fmt: skip


@triton.jit
def _backward_parts(
    RW, ST, base, end, at_rows, r, a, dn, delta, rq, qa, ok, scale_do, scale_q, slack,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, QUERIES: tl.constexpr,
):  # fmt: skip
    """The checksum tiles of dO's and Q's rows (Backward.rows) of whole tiles, from tile
    ``base`` (of the stats; tiles from ``end`` on left alone) for the rows ``at_rows`` (a row's
    place in tiles of ``BLOCK``; stacked, dO's tile and then Q's take twice that) that are
    ``ok``, from each row's values: dO's sum ``r``, absolute sum ``a`` and L2 norm ``dn``,
    ``delta``, Q's sum ``rq`` and absolute sum ``qa``, at the heads' scales; the tiles' scales
    and sums into ST."""
    dtype = RW.dtype.element_ty
    n: tl.constexpr = r.shape[0] // BLOCK  # tiles
    tiles = base + tl.arange(0, n)
    stats = ST + tiles * 8
    inside = tiles < end
    zeros = tl.zeros([n], tl.float32)
    parts = tl.zeros([r.shape[0], 16], tl.float32)
    if ROWS:
        qa_mass = qa
        if QUERIES:  # Q's parts' loss, in dK's mass
            qa_mass = qa + slack * scale_q
        by_norm = dn * qa_mass
        by_delta = tl.abs(delta) * qa_mass
        parts += _split(r / scale_do, 0, dtype) + _split(a / scale_do + slack, 3, dtype)
        parts += _split(by_norm / scale_do, 9, dtype)
        parts += _split(by_delta / scale_do, 12, dtype)
        tl.store(stats, scale_do + zeros, mask=inside)
        # for fp16's subnormal P~, each tile's sums
        tl.store(stats + 5, tl.sum(tl.reshape(by_norm, [n, BLOCK]), 1), mask=inside)
        tl.store(stats + 6, tl.sum(tl.reshape(by_delta, [n, BLOCK]), 1), mask=inside)
    if QUERIES:
        parts += _split(rq / scale_q, 6, dtype)
        tl.store(stats + 1, scale_q + zeros, mask=inside)
    column = tl.arange(0, 16)[None, :]
    of_q = (column >= 6) & (column < 9)
    at = RW + (at_rows + at_rows // BLOCK * BLOCK)[:, None] * 16 + column  # dO's tile
    tl.store(at, tl.where(of_q, 0.0, parts).to(dtype), mask=ok[:, None])
    tl.store(at + BLOCK * 16, tl.where(of_q, parts, 0.0).to(dtype), mask=ok[:, None])


@triton.jit
def _backward_running(
    CF, CP, ST, TILES, RAW, PK, DELTA, RW, PADDED, slack, bh, HEAD_DIM: tl.constexpr,
    HEADROOM: tl.constexpr, BLOCK: tl.constexpr, COLUMNS: tl.constexpr, ROWS: tl.constexpr,
    QUERIES: tl.constexpr,
):  # fmt: skip
    """One (batch, head) of the backward's checksum tiles: Q's and dO's column sums added up
    from the last tile to each (COLUMNS, _prefix_sums), and fp16's row sums (ROWS, QUERIES:
    _delta_tile's RAW) split at the head's scales (from its tiles' peaks, PK)."""
    if COLUMNS:
        _prefix_sums(CF, CP, ST, bh, TILES, HEAD_DIM, 2, 8, True, HEADROOM)
    if ROWS or QUERIES:
        head = PK + bh * TILES * 2
        scale_do = _head_scale(head, 2, TILES, HEADROOM)
        scale_q = _head_scale(head + 1, 2, TILES, HEADROOM)
        rows = TILES * BLOCK
        for first in range(0, rows, CHUNK):  # CHUNK rows, whole tiles, at a time
            offs = first + tl.arange(0, CHUNK)
            ok = offs < rows
            at_rows = bh * rows + offs
            delta = tl.load(DELTA + bh * PADDED + offs, mask=ok, other=0.0)
            r = tl.load(RAW + at_rows * RAW_VALUES, mask=ok, other=0.0)
            a = tl.load(RAW + at_rows * RAW_VALUES + 1, mask=ok, other=0.0)
            dn = tl.load(RAW + at_rows * RAW_VALUES + 2, mask=ok, other=0.0)
            rq = tl.load(RAW + at_rows * RAW_VALUES + 3, mask=ok, other=0.0)
            qa = tl.load(RAW + at_rows * RAW_VALUES + 4, mask=ok, other=0.0)
            _backward_parts(RW, ST, bh * TILES + first // BLOCK, (bh + 1) * TILES, at_rows, r,
                            a, dn, delta, rq, qa, ok, scale_do, scale_q, slack, BLOCK, ROWS,
                            QUERIES)  # fmt: skip


@triton.jit
def _running(
    CF, CP, ST, TILES, XR, RP, RS, YR, YP, YS, bh, slack, HEAD_DIM: tl.constexpr,
    HEADROOM: tl.constexpr, BLOCK: tl.constexpr, COLUMNS: tl.constexpr, ROWS: tl.constexpr,
    ROWS_Y: tl.constexpr,
):  # fmt: skip
    """One (batch, head) of K's and V's checksum tiles: K's column sums added up (COLUMNS,
    _prefix_sums), and fp16's row sums of X and Y (ROWS, ROWS_Y: _sums_kernel's XR and YR)
    split at the head's scale."""
    if COLUMNS:
        _prefix_sums(CF, CP, ST, bh, TILES, HEAD_DIM, 1, 3, False, HEADROOM)
    if ROWS:
        _head_rows(XR, RP, RS, bh, TILES, slack, BLOCK, HEADROOM)
    if ROWS_Y:
        _head_rows(YR, YP, YS, bh, TILES, slack, BLOCK, HEADROOM)


@triton.jit
def _carried(x, carry, last):
    """The running sums of ``x`` along axis 0 from ``carry`` on, and their row ``last`` (a mask
    of it): the next step's carry."""
    sums = tl.cumsum(x, 0) + carry
    return sums, tl.sum(tl.where(last, sums, 0.0), 0)


@triton.jit
def _prefix_sums(
    CF, CP, ST, bh, TILES, HEAD_DIM: tl.constexpr, VECTORS: tl.constexpr, STATS: tl.constexpr,
    REVERSE: tl.constexpr, HEADROOM: tl.constexpr,
):  # fmt: skip
    """One head's tiles' column sums (CF, fp32, VECTORS of them a tile) and their masses (ST,
    slots 1 and 2 of a tile's STATS) added up from the first tile to each (a prefix; from the
    last with REVERSE: a suffix), split for the MMA into CP (vector v's parts in columns 3v to
    3v + 2) with their scale in ST slot 0 (VECTORS 1) or 2 (VECTORS 2). SCAN values a step: a
    scan of the step's tiles and a carry between steps, so that the head's chain of dependent
    steps is TILES / (SCAN / HEAD_DIM) long, not TILES."""
    STEP: tl.constexpr = SCAN // HEAD_DIM
    steps = tl.arange(0, STEP)
    dims = tl.arange(0, HEAD_DIM)
    column = tl.arange(0, 16)[None, :]
    last = steps == STEP - 1
    carry_first = tl.zeros([HEAD_DIM], tl.float32)
    carry_second = tl.zeros([HEAD_DIM], tl.float32)
    mass_first = 0.0
    mass_second = 0.0
    slot: tl.constexpr = 0 if VECTORS == 1 else 2
    mass: tl.constexpr = 1 if VECTORS == 1 else 3
    dtype = CP.dtype.element_ty
    for start in range(0, TILES, STEP):
        i = start + steps
        ok = i < TILES
        base = bh * TILES + (TILES - 1 - i if REVERSE else i)
        at = (base * VECTORS)[:, None] * HEAD_DIM + dims[None, :]
        rows_ok, at_mass = ok[:, None], ST + base * STATS + mass
        first, carry_first = _carried(
            tl.load(CF + at, mask=rows_ok, other=0.0), carry_first[None, :], last[:, None]
        )
        masses, mass_first = _carried(tl.load(at_mass, mask=ok, other=0.0), mass_first, last)
        tl.store(at_mass, masses, mask=ok)
        peak = tl.max(tl.abs(first), 1)
        if VECTORS == 2:
            second, carry_second = _carried(
                tl.load(CF + at + HEAD_DIM, mask=rows_ok, other=0.0), carry_second[None, :],
                last[:, None],
            )  # fmt: skip
            masses, mass_second = _carried(
                tl.load(at_mass + 1, mask=ok, other=0.0), mass_second, last
            )
            tl.store(at_mass + 1, masses, mask=ok)
            peak = tl.maximum(peak, tl.max(tl.abs(second), 1))
        scale = tl.full([STEP], 1.0, tl.float32)
        if HEADROOM != 0:
            scale = _scale(peak, HEADROOM)
        parts = _split(tl.reshape(first / scale[:, None], [STEP * HEAD_DIM]), 0, dtype)
        if VECTORS == 2:
            parts += _split(tl.reshape(second / scale[:, None], [STEP * HEAD_DIM]), 3, dtype)
        rows = tl.reshape(base[:, None] * HEAD_DIM + dims[None, :], [STEP * HEAD_DIM])
        inside = tl.reshape(tl.broadcast_to(ok[:, None], [STEP, HEAD_DIM]), [STEP * HEAD_DIM])
        tl.store(CP + rows[:, None] * 16 + column, parts.to(dtype), mask=inside[:, None])
        tl.store(ST + base * STATS + slot, scale, mask=ok)
