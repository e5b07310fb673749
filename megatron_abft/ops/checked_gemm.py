"""A GEMM that checks itself: ``Y = X W^T (+ bias)`` (``checked_linear``: the projections) or
``alpha X W^T`` over a batch of matrices (``checked_matmul``: the attention's scores and context)
in a Triton kernel whose epilogue verifies each output tile from the kernel's own fp32
accumulators, so that the check reads nothing again (docs/abft.md, "The checked GEMM").

A check that runs after a cuBLAS GEMM must read Y once more to sum it, which costs about
``(matmul rate / bandwidth) / k`` of the GEMM (``k`` its inner dimension; 15% at k = 1024 on an
H200) however fast its kernels are. Here each program sums its tile's rows over the tile's
columns while they are still in registers, against a reference it accumulates beside the MMA on
the CUDA cores from the X tile it already holds:

    sum_j Y_ij (j in the tile's columns)  =  X_i . c + sum_j b_j,    c_k = sum_j W_jk

under ``g * (|X_i| . a + sum_j |b_j|)``, ``a_k = sum_j |W_jk|`` (``weight_sums``: both vectors a
column block, fp32 from float64, made once a weight version by the caller), with ``g`` the
unfused checks' rounding factor (megatron_abft.check.tolerance: ``2 (k + block_n + 2) u``). The
comparison is written so that NaN flags. A program that flags computes its tile once more:
a transient fault is gone the second time (outcome corrected), one flagged again is
uncorrectable. Each program writes its tile's code (``outcome << 2 | kind``, 0 clean; kinds as
megatron_abft.config.KINDS), so the codes need no zero fill and the host reads nothing;
``tally`` folds them into a guard's ledger, a matrix by its worst tile.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from megatron_abft.check.ledger import EVENT_FIELDS, Ledger

INTERPRETER = tl.constexpr(False)
"""True in the copy Triton's interpreter runs (megatron_abft.flash.build), which has no inline
assembly."""
FLOOR = tl.constexpr(2.0**-120)
"""The bound's absolute floor, for products that round on fp32's subnormal grid."""
INF = tl.constexpr(float("inf"))


@dataclass(frozen=True)
class Tiles:
    """One launch's tile shape and options."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    """Row blocks a group of programs walks before the next column block (L2 reuse)."""


GPU_TILES = {True: Tiles(128, 128, 64, 8, 4), False: Tiles(128, 128, 64, 8, 3)}
"""Hopper's tiles, checked and not: wgmma of 64 x 128 a warpgroup. At 128 x 256 ptxas
serialises the wgmma (C7515), unchecked too; the checked kernel holds a stage fewer in shared
memory than it is given (its X tile is also read into registers), hence 4 (``python -m
tools.checked_gemm_sass``)."""
INTERPRETED = Tiles(32, 32, 32, 4, 1)
"""CPU tensors' tile (Triton's interpreter, where small tiles run faster)."""
GPU_DTYPES = (torch.bfloat16, torch.float16)
DTYPES = (torch.float32, *GPU_DTYPES)


def takes(t: Tensor) -> bool:
    """Whether the kernel runs on ``t``'s device and dtype: bf16 and fp16 compiled on GPUs; fp32
    too on the CPU, in Triton's interpreter."""
    if t.device.type == "cuda":
        return t.dtype in GPU_DTYPES
    return t.device.type == "cpu" and t.dtype in DTYPES


def tiles_for(device: torch.device, check: bool = True) -> Tiles:
    """The tile a launch on ``device`` takes (the checked and unchecked kernels' column blocks
    are the same, so one ``weight_sums`` serves both)."""
    return GPU_TILES[check] if device.type == "cuda" else INTERPRETED


@triton.jit
def _accumulate(
    X, W, SUMS, INJ, z, offs_m, offs_n, rm, rn, K, sxm, sxk, swn, swk, fresh,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    CHECK: tl.constexpr, INJECT: tl.constexpr,
):  # fmt: skip
    """The tile's ``X W^T`` in fp32 and, when checking, its rows' references ``X_i . c`` and
    masses ``|X_i| . a`` (``SUMS``: c then a, K values each). ``fresh``: the first pass, where a
    transient injected fault lands; ``z`` the matrix, where an injected fault names one."""
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = X + rm.to(tl.int64)[:, None] * sxm + offs_k[None, :] * sxk
    w_ptrs = W + rn.to(tl.int64)[None, :] * swn + offs_k[:, None] * swk
    s_ptrs = SUMS + offs_k
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    ref = tl.zeros([BLOCK_M, BLOCK_K // 8], tl.float32)
    mass = tl.zeros([BLOCK_M, BLOCK_K // 8], tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            left = K - k * BLOCK_K
            x = tl.load(x_ptrs, mask=offs_k[None, :] < left, other=0.0)
            w = tl.load(w_ptrs, mask=offs_k[:, None] < left, other=0.0)
        acc = tl.dot(x, w, acc)
        if CHECK:
            if EVEN_K:
                c = tl.load(s_ptrs)
                a = tl.load(s_ptrs + K)
            else:
                c = tl.load(s_ptrs, mask=offs_k < left, other=0.0)
                a = tl.load(s_ptrs + K, mask=offs_k < left, other=0.0)
            xf = _widen(x)
            ref += _eighths(xf * c[None, :])
            mass += _eighths(tl.abs(xf) * a[None, :])
        x_ptrs += BLOCK_K * sxk
        w_ptrs += BLOCK_K * swk
        s_ptrs += BLOCK_K
    if INJECT:  # INJ: matrix, row, column, value, persistent (fp32)
        hit = (offs_m[:, None] == tl.load(INJ + 1).to(tl.int32)) & (
            offs_n[None, :] == tl.load(INJ + 2).to(tl.int32)
        )
        landed = (fresh | (tl.load(INJ + 4) != 0)) & (z == tl.load(INJ).to(tl.int32))
        acc = tl.where(hit & landed, tl.load(INJ + 3), acc)
    return acc, tl.sum(ref, 1), tl.sum(mass, 1)


@triton.jit
def _widen(x):
    """A 16-bit tile in fp32. bf16 two elements in two instructions (a shift and a mask of the
    register holding both), where the compiler's conversion takes three."""
    if INTERPRETER or x.dtype != tl.bfloat16:
        return x.to(tl.float32)
    return tl.inline_asm_elementwise(
        "{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xffff0000; }", "=r,=r,r", [x],
        dtype=tl.float32, is_pure=True, pack=2,
    )  # fmt: skip


@triton.jit
def _eighths(x):
    """``x [R, C]``'s sums over its runs of 8 columns, ``[R, C / 8]``: a thread's 8 contiguous
    elements of a loaded tile, so the loop adds inside the thread (no shuffle) and the rows'
    sums finish once, after it."""
    return tl.sum(tl.reshape(x, [x.shape[0], x.shape[1] // 8, 8]), 2)


@triton.jit
def _verify(acc, ref, mass, bias_sum, bias_mass, row_ok, col_ok, g, near_inf):
    """Per row: 0 clean (or past the end), else 1 + the fault kind (config.KINDS) of its
    residual: near-INF where it exceeds its bound by more than ``near_inf``."""
    got = tl.sum(tl.where(col_ok[None, :], acc, 0.0), 1)
    residual = tl.abs(got - (ref + bias_sum))
    excess = residual - (g * (mass + bias_mass) + FLOOR)
    kind = tl.where(excess > near_inf, 2, tl.where(excess > 0, 1, 0))
    kind = tl.where(residual != residual, 4, tl.where(residual == INF, 3, kind))
    return tl.where(row_ok, kind, 0)


@triton.jit
def _checked_gemm_kernel(
    X, W, BIAS, Y, SUMS, CODES, INJ, M, N, K, HEADS, REP, sxb, sxh, sxm, sxk, swb, swh, swn, swk,
    syb, syh, sym, syn, alpha, g, near_inf,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, CHECK: tl.constexpr, INJECT: tl.constexpr,
    SCALE: tl.constexpr, BATCHED: tl.constexpr,
):  # fmt: skip
    """One ``BLOCK_M x BLOCK_N`` tile of matrix ``pid 1`` of ``Y [B, HEADS, M, N] = alpha X
    [B, HEADS, M, K] W[B, HEADS / REP, N, K]^T (+ BIAS)``, checked (CHECK) against ``SUMS``
    [B, HEADS / REP, column blocks, 2, K] before the scaling and computed again once if
    flagged; its code into ``CODES`` [B, HEADS, row blocks, column blocks]. Head ``h`` reads
    W's ``h // REP`` (grouped-query attention's shared keys and values)."""
    pid = tl.program_id(0)
    z = tl.program_id(1)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    sums = SUMS + pid_n.to(tl.int64) * 2 * K
    if BATCHED:  # one matrix needs no offsets (its loop then keeps the kernel parameters' bases)
        batch = (z // HEADS).to(tl.int64)
        head = (z % HEADS).to(tl.int64)
        group = head // REP
        X += batch * sxb + head * sxh
        W += batch * swb + group * swh
        Y += batch * syb + head * syh
        sums += (batch * (HEADS // REP) + group) * grid_n * 2 * K
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = offs_m % M  # rows and columns past the end read again, and are not stored
    rn = offs_n % N
    acc, ref, mass = _accumulate(
        X, W, sums, INJ, z, offs_m, offs_n, rm, rn, K, sxm, sxk, swn, swk, True, BLOCK_M,
        BLOCK_N, BLOCK_K, EVEN_K, CHECK, INJECT,
    )  # fmt: skip
    col_ok = offs_n < N
    bias_sum = 0.0
    bias_mass = 0.0
    if HAS_BIAS:
        bias = tl.load(BIAS + offs_n, mask=col_ok, other=0.0).to(tl.float32)
        acc += bias[None, :]
        bias_sum = tl.sum(bias, 0)
        bias_mass = tl.sum(tl.abs(bias), 0)
    if CHECK:
        row_ok = offs_m < M
        state = _verify(acc, ref, mass, bias_sum, bias_mass, row_ok, col_ok, g, near_inf)
        kind = tl.max(state, 0)
        code = 0
        if kind > 0:  # once more: a transient fault is gone the second time
            acc, ref, mass = _accumulate(
                X, W, sums, INJ, z, offs_m, offs_n, rm, rn, K, sxm, sxk, swn, swk, False,
                BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, CHECK, INJECT,
            )  # fmt: skip
            if HAS_BIAS:
                acc += bias[None, :]
            again = _verify(acc, ref, mass, bias_sum, bias_mass, row_ok, col_ok, g, near_inf)
            outcome = tl.where(tl.max(again, 0) > 0, 2, 1)
            code = (outcome << 2) | (kind - 1)
        tl.store(CODES + (z * grid_m + pid_m) * grid_n + pid_n, code)
    if SCALE:
        acc = acc * alpha
    y_ptrs = Y + offs_m[:, None].to(tl.int64) * sym + offs_n[None, :] * syn
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=(offs_m < M)[:, None] & col_ok[None, :])


# --- launch -------------------------------------------------------------------------------------


def weight_sums(weight: Tensor, block_n: int) -> Tensor:
    """For ``weight [n, k]``, ``[column blocks, 2, k]`` fp32; for a batch of them ``[B, G, n,
    k]`` (checked_matmul's), ``[B, G, column blocks, 2, k]``: per block of ``block_n`` of a
    matrix's rows (a tile's columns of Y), their sum and their absolute sum, summed in float64
    (exact for 16-bit weights). One launch; make it once a weight version
    (tiles_for(device).block_n) and pass it to every call."""
    w = weight if weight.dim() == 4 else weight[None, None]
    b, groups, n, k = w.shape
    blocks = triton.cdiv(n, block_n)
    sums = torch.empty(b, groups, blocks, 2, k, dtype=torch.float32, device=weight.device)
    grid = (blocks, triton.cdiv(k, SUMS_BLOCK_K), b * groups)
    if sums.numel():
        _built(weight.device)._weight_sums_kernel[grid](
            w, sums, n, k, groups, *w.stride(), BLOCK_N=block_n, BLOCK_K=SUMS_BLOCK_K,
            num_warps=4,
        )  # fmt: skip
    return sums if weight.dim() == 4 else sums[0, 0]


SUMS_BLOCK_K = 32
"""Columns of the weight a program of _weight_sums_kernel sums."""


@triton.jit
def _weight_sums_kernel(
    W, SUMS, N, K, GROUPS, swb, swg, swn, swk, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):  # fmt: skip
    """Rows ``[pid 0 * BLOCK_N, + BLOCK_N)`` of matrix ``pid 2`` of ``W [B, GROUPS, N, K]``,
    columns of block ``pid 1``: their sum and absolute sum, in float64, into ``SUMS [B, GROUPS,
    blocks, 2, K]`` (fp32)."""
    z = tl.program_id(2)
    W += (z // GROUPS).to(tl.int64) * swb + (z % GROUPS).to(tl.int64) * swg
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    inside = (rows < N)[:, None] & (cols < K)[None, :]
    w = tl.load(W + rows.to(tl.int64)[:, None] * swn + cols[None, :] * swk, mask=inside, other=0.0)
    w = w.to(tl.float64)
    block = z.to(tl.int64) * tl.num_programs(0) + tl.program_id(0)
    out = SUMS + block * 2 * K + cols
    tl.store(out, tl.sum(w, 0).to(tl.float32), mask=cols < K)
    tl.store(out + K, tl.sum(tl.abs(w), 0).to(tl.float32), mask=cols < K)


def rounding_factor(k: int, block_n: int, threshold_scale: float = 1.0) -> float:
    """g of the module docstring: the bound a unit of mass, for inner dimension ``k``."""
    return threshold_scale * 2 * (k + block_n + 2) * 2.0**-24


def checked_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    sums: Tensor | None = None,
    check: bool = True,
    threshold_scale: float = 1.0,
    near_inf: float = 1e10,
    fault: tuple[int, int, float, bool] | None = None,
    tile: Tiles | None = None,
) -> tuple[Tensor, Tensor]:
    """``x @ weight.T + bias`` for ``x [..., k]``, ``weight [n, k]``, each output tile checked in
    the kernel and computed again once where flagged. Returns the output and the tiles' codes,
    on the device, with no host synchronisation: int32, one a tile (its row block times the
    column blocks plus its column block), 0 clean, else ``outcome << 2 | kind`` (outcome 1
    corrected, 2 uncorrectable); empty when ``check`` is off. ``sums``:
    ``weight_sums(weight, tiles_for(x.device).block_n)``, made here when None. ``fault``: (row,
    column, value, persistent), a value written into the accumulator before the check, and
    ``tile``, another tile than ``tiles_for(x.device, check)`` (``sums`` then made for it), for
    tests and tools. CUDA tensors run compiled (bf16 or fp16); CPU tensors run in Triton's
    interpreter (fp32, bf16 computed in fp32, fp16), slowly."""
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"checked_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not "
            "multiply as x @ weight.T"
        )
    _validate("checked_linear", x, weight, bias)
    k, n = x.shape[-1], weight.shape[0]
    flat = x.reshape(-1, k)
    y, codes = _launch(
        flat[None, None], weight[None, None], bias, None, sums, 1.0, check, threshold_scale,
        near_inf, None if fault is None else (0, *fault), tile,
    )  # fmt: skip
    return y.view(*x.shape[:-1], n), codes.view(-1)


def checked_matmul(
    x: Tensor,
    w: Tensor,
    *,
    alpha: float = 1.0,
    out: Tensor | None = None,
    sums: Tensor | None = None,
    check: bool = True,
    threshold_scale: float = 1.0,
    near_inf: float = 1e10,
    fault: tuple[int, int, int, float, bool] | None = None,
    tile: Tiles | None = None,
) -> tuple[Tensor, Tensor]:
    """``alpha * x @ w^T`` matrix by matrix, for ``x [B, H, m, k]`` and ``w [B, G, n, k]``, any
    strides, head ``h`` reading ``w``'s ``h // (H / G)`` (grouped-query attention's shared keys
    and values): the attention's scores ``Q K^T`` and, with ``w`` = V^T, its context ``P V``.
    Each tile is checked before the scaling, as checked_linear's. Returns the output ``[B, H,
    m, n]`` (written into ``out`` where given) and the codes ``[B, H, tiles]``. ``sums``:
    ``weight_sums(w, tiles_for(x.device).block_n)``. ``fault``: (matrix of ``B * H``, row,
    column, value, persistent) and ``tile``, as checked_linear's."""
    if x.dim() != 4 or w.dim() != 4 or x.shape[0] != w.shape[0] or x.shape[3] != w.shape[3]:
        raise ValueError(
            f"checked_matmul: x {tuple(x.shape)} [B, H, m, k] and w {tuple(w.shape)} "
            "[B, G, n, k] do not multiply as x @ w^T"
        )
    if w.shape[1] == 0 or x.shape[1] % w.shape[1]:
        raise ValueError(
            f"checked_matmul: x's {x.shape[1]} heads are not a multiple of w's {w.shape[1]} groups"
        )
    _validate("checked_matmul", x, w, None)
    shape = (*x.shape[:3], w.shape[2])
    if out is not None and (tuple(out.shape) != shape or out.dtype != x.dtype):
        raise ValueError(
            f"checked_matmul: out {tuple(out.shape)} {out.dtype}, expected {shape} {x.dtype}"
        )
    return _launch(x, w, None, out, sums, alpha, check, threshold_scale, near_inf, fault, tile)


def _launch(
    x: Tensor,
    w: Tensor,
    bias: Tensor | None,
    out: Tensor | None,
    sums: Tensor | None,
    alpha: float,
    check: bool,
    threshold_scale: float,
    near_inf: float,
    fault: tuple | None,
    tile: Tiles | None,
) -> tuple[Tensor, Tensor]:
    """One launch over the matrices of ``x [B, H, m, k]`` and ``w [B, G, n, k]``: the output
    (``out`` where given) and the codes ``[B, H, tiles]``."""
    (b, heads, m, k), (groups, n) = x.shape, w.shape[1:3]
    tile = tile or tiles_for(x.device, check)
    out_dtype = x.dtype
    if x.device.type == "cpu" and x.dtype == torch.bfloat16:
        # the interpreter's tl.dot multiplies bf16 bit patterns; fp32 holds bf16's products exactly
        x, w = x.float(), w.float()
        bias = bias.float() if bias is not None else None
    y = out if out is not None and out.dtype == x.dtype else x.new_empty(b, heads, m, n)
    programs = _programs(m, n, tile)
    codes = torch.empty(b, heads, programs if check else 0, dtype=torch.int32, device=x.device)
    if check:
        if sums is None:
            sums = weight_sums(w, tile.block_n)
        sums = sums.view(1, 1, *sums.shape) if sums.dim() == 3 and w.shape[:2] == (1, 1) else sums
        expected = (b, groups, triton.cdiv(n, tile.block_n), 2, k)
        if tuple(sums.shape) != expected or sums.dtype != torch.float32:
            raise ValueError(
                f"checked GEMM: sums {tuple(sums.shape)} {sums.dtype}, expected {expected} "
                f"float32 (weight_sums(w, {tile.block_n}))"
            )
    inject = None
    if fault is not None:
        matrix, row, col, value, persistent = fault
        inject = torch.tensor(
            [matrix, row, col, value, float(persistent)], dtype=torch.float32, device=x.device
        )
    if m and n and b * heads:
        args, options = arguments(
            x, w, bias, y, sums, codes, inject, tile, threshold_scale, near_inf, check, alpha
        )
        kernel = _built(x.device)._checked_gemm_kernel
        kernel[(programs, b * heads)](*args, **options)
    if y.dtype != out_dtype:
        y = out.copy_(y) if out is not None else y.to(out_dtype)
    return y, codes


def tally(codes: Tensor, n: int, tile: Tiles, ledger: Ledger) -> Tensor:
    """Fold one checked output's tile ``codes`` (checked_linear's ``[tiles]``, checked_matmul's
    ``[*batch, tiles]``; ``n`` its columns, ``tile`` the launch's) into a guard's ``ledger`` as
    Ledger.tally folds a check's result: each matrix counted once, by the outcome and kind of
    its worst tile (an uncorrectable tile before a corrected one; the first of equals); the
    worst matrix (the first uncorrectable, else the first corrected) logged with its worst
    tile's first row and column in it and no magnitude (the kernel keeps none: NaN). Returns
    whether a matrix is uncorrectable, a bool tensor. One launch, no host read."""
    matrices = codes.reshape(-1, codes.shape[-1])
    failed = torch.empty((), dtype=torch.int8, device=codes.device)
    _built(codes.device)._tally_kernel[(1,)](
        matrices, matrices.shape[0], matrices.shape[1], triton.cdiv(n, tile.block_n),
        tile.block_m, tile.block_n, ledger.counts, ledger.clock, ledger.log, ledger.logged, failed,
        ledger.capacity, len(EVENT_FIELDS),
        BLOCK_Z=TALLY_BLOCK[0], BLOCK_T=TALLY_BLOCK[1], num_warps=4,
    )  # fmt: skip
    return failed.view(torch.bool)


TALLY_BLOCK = (8, 256)
"""Matrices and tiles _tally_kernel reads at a time: one shape, so that one build serves every
call."""


@triton.jit
def _tally_kernel(
    CODES, MATRICES, TILES, GRID_N, TILE_M, TILE_N, COUNTS, CLOCK, LOG, LOGGED, FAILED, CAPACITY,
    FIELDS, BLOCK_Z: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """``CODES [MATRICES, TILES]`` into a ledger: COUNTS [3, 4] (detected, corrected,
    uncorrectable by kind, a matrix by its worst tile), the worst matrix's record into LOG at
    slot LOGGED (EVENT_FIELDS: step, outcome, matrix, kind, row, col, magnitude) where it has
    room, LOGGED counting it either way, and FAILED, whether a matrix is uncorrectable."""
    kinds = tl.arange(0, 4)
    detected = tl.zeros([4], tl.int64)
    corrected = tl.zeros([4], tl.int64)
    uncorrectable = tl.zeros([4], tl.int64)
    top = 0  # the worst matrix's code, the matrix and its worst tile
    top_matrix = 0
    top_tile = 0
    for z0 in range(0, MATRICES, BLOCK_Z):
        zs = z0 + tl.arange(0, BLOCK_Z)
        worst = tl.zeros([BLOCK_Z], tl.int32)
        at = tl.zeros([BLOCK_Z], tl.int32)
        for t0 in range(0, TILES, BLOCK_T):
            ts = t0 + tl.arange(0, BLOCK_T)
            inside = (zs < MATRICES)[:, None] & (ts < TILES)[None, :]
            code = tl.load(CODES + zs.to(tl.int64)[:, None] * TILES + ts[None, :], inside, other=0)
            block_top = tl.max(code, 1)
            better = block_top > worst
            at = tl.where(better, t0 + tl.argmax(code, 1), at)
            worst = tl.where(better, block_top, worst)
        of_kind = ((worst & 3)[:, None] == kinds[None, :]) & (worst > 0)[:, None]
        detected += tl.sum(of_kind.to(tl.int64), 0)
        corrected += tl.sum((of_kind & ((worst >> 2) == 1)[:, None]).to(tl.int64), 0)
        uncorrectable += tl.sum((of_kind & ((worst >> 2) == 2)[:, None]).to(tl.int64), 0)
        outcome = worst >> 2
        block_top = tl.max(outcome, 0)
        if block_top > (top >> 2):
            first = tl.argmax(outcome, 0)
            top_matrix = z0 + first
            top = tl.max(tl.where(zs == top_matrix, worst, 0), 0)
            top_tile = tl.max(tl.where(zs == top_matrix, at, 0), 0)
    tl.store(COUNTS + kinds, tl.load(COUNTS + kinds) + detected)
    tl.store(COUNTS + 4 + kinds, tl.load(COUNTS + 4 + kinds) + corrected)
    tl.store(COUNTS + 8 + kinds, tl.load(COUNTS + 8 + kinds) + uncorrectable)
    tl.store(FAILED, ((top >> 2) == 2).to(tl.int8))
    if top > 0:
        slot = tl.load(LOGGED)
        if slot < CAPACITY:
            entry = LOG + slot * FIELDS
            tl.store(entry, tl.load(CLOCK))
            tl.store(entry + 1, (top >> 2).to(tl.float64))
            tl.store(entry + 2, top_matrix.to(tl.float64))
            tl.store(entry + 3, (top & 3).to(tl.float64))
            tl.store(entry + 4, (top_tile // GRID_N * TILE_M).to(tl.float64))
            tl.store(entry + 5, (top_tile % GRID_N * TILE_N).to(tl.float64))
            tl.store(entry + 6, float("nan"))
        tl.store(LOGGED, slot + 1)


def _built(device: torch.device):
    """This module's kernels for ``device``: compiled on CUDA, interpreted on CPU."""
    from megatron_abft.flash import build

    return build.for_device(sys.modules[__name__], device)


def _programs(m: int, n: int, tile: Tiles) -> int:
    return triton.cdiv(m, tile.block_m) * triton.cdiv(n, tile.block_n)


def arguments(
    x: Tensor,
    w: Tensor,
    bias: Tensor | None,
    y: Tensor,
    sums: Tensor | None,
    codes: Tensor,
    inject: Tensor | None,
    tile: Tiles,
    threshold_scale: float,
    near_inf: float,
    check: bool,
    alpha: float = 1.0,
) -> tuple[tuple, dict]:
    """The kernel's arguments and constexprs for ``y = alpha x @ w^T (+ bias)`` (``x [B, H, m,
    k]``, ``w [B, G, n, k]``, ``y [B, H, m, n]``), as checked_linear and checked_matmul launch
    it (and the static gate builds it)."""
    (_, heads, m, k), (groups, n) = x.shape, w.shape[1:3]
    placeholder = codes if codes.numel() else y
    args = (
        x, w, bias if bias is not None else placeholder, y,
        sums if check else placeholder, codes if check else placeholder,
        inject if inject is not None else placeholder,
        m, n, k, heads, heads // groups, *x.stride(), *w.stride(), *y.stride(), alpha,
        rounding_factor(k, tile.block_n, threshold_scale), near_inf,
    )  # fmt: skip
    options = {
        "BLOCK_M": tile.block_m,
        "BLOCK_N": tile.block_n,
        "BLOCK_K": tile.block_k,
        "GROUP_M": tile.group_m,
        "EVEN_K": k % tile.block_k == 0,
        "HAS_BIAS": bias is not None,
        "CHECK": check,
        "INJECT": inject is not None,
        "SCALE": alpha != 1.0,
        "BATCHED": x.shape[0] * heads > 1,
        "num_warps": tile.num_warps,
        "num_stages": tile.num_stages,
    }
    return args, options


def _validate(where: str, x: Tensor, weight: Tensor, bias: Tensor | None) -> None:
    """Raise, naming the bad value, for dtypes, devices and biases the kernel does not take."""
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise ValueError(
            f"{where}: x and weight must share one dtype of float32, bfloat16, float16; "
            f"got {x.dtype}, {weight.dtype}"
        )
    if x.device != weight.device or x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{where}: x on {x.device}, weight on {weight.device}")
    if x.device.type == "cuda" and x.dtype not in GPU_DTYPES:
        raise ValueError(f"{where}: on a GPU the kernel takes bf16 or fp16, not {x.dtype}")
    if bias is not None and (
        bias.shape != (weight.shape[0],) or bias.dtype != x.dtype or bias.device != x.device
    ):
        raise ValueError(
            f"{where}: bias {tuple(bias.shape)} {bias.dtype} on {bias.device}, expected "
            f"({weight.shape[0]},) {x.dtype} on {x.device}"
        )
