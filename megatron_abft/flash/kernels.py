"""Triton kernels of the protected flash attention: the forward, and the backward as two kernels
(dK/dV, a program per key block; dQ, a program per query block), FA2-style.

Loops. Each program runs its interior tiles, where every key is visible and every row in range,
without masks, and only the tiles on the causal diagonal or at a ragged end with them
(``MASKED``); rows past the end and padded head dims read as zeros (``_tiles``).
Tile pointers are a base that moves a tile a step and offsets made once.

Checks (docs/abft.md, "The flash path"). For ``C = A B`` a check compares ``C e`` with
``A (B e)``, the reference an MMA of A against a checksum tile ``W [k, 16]`` that holds ``B e``
split into input-dtype parts (megatron_abft.flash.checksums, made before the launch), under
``tol * mass + FLOOR``; the mass bounds ``|A| (|B| e)`` from the operands only, so a corrupted
output never widens its own bound, and the comparison is written so that NaN flags.

- Tile GEMMs (S, S^T, dP^T): the rows' sums over the block's tiles, started from minus one
  reference MMA made before the loop (the block's rows against the other operand's column sums
  over those tiles), so that the loop adds each element once, into partial sums that stay in
  the thread (``_partial_sums``), and the residual is compared after it under the tiles'
  Cauchy-Schwarz masses summed.
- Accumulating GEMMs (the context P~V, dV, dK, dQ): the reference accumulates beside the output
  (an MMA of the same A against each tile's W, rescaled with the output in the forward) and the
  output's row sums are compared once, after the loop, under the summed masses grown by
  ``sqrt(tiles / 16)``. Where A is non-negative (P~ for the context, P for dV) W's columns 3 to 5
  hold ``|B| e`` and the same MMA gives the mass exactly; for dQ a second MMA, of ``|dS|``,
  gives it.
- Identities over whole rows: ``1 <= l <= #keys`` in the forward, ``sum P = 1`` and
  ``sum dS = 0`` in the dQ kernel, which checks its S and dP through them (a fault there moves
  P or dS, or does not matter to dQ), and its dS K through the accumulated reference.

The loops only add and accumulate, with no branch and no reduction across threads. A program
that flagged anything computes its whole block again, once, after its loop (its query block, or
in dK/dV its key block over every query head of its group): a transient fault is gone the
second time, and what is flagged again is uncorrectable.

Outcomes go to the call's findings buffer ``FOUND`` (launch.Findings): ``CODES [sections, batch
* heads]`` (int32, atomic max of ``outcome << 2 | kind``: outcome 1 corrected, 2 uncorrectable;
kind as megatron_abft.config.KINDS), then the first flagged row and column, ``ROWS`` and
``COLS`` of the same shape (as ``NO_ROW - row``, atomic max, so that a zeroed buffer says none):
one matrix a section, on the device, no host synchronisation. A call's last launch
(``RECORD``: the forward's second, the backward's last second one) ends with its last program
folding them into the layer's ledger (``_record``), so that the ledger takes no launch of its
own.

Constexpr switches compile out what a launch does not need: ``DUE`` (the sections checked, bit
i as FLASH_SECTIONS[i]; 0 compiles every check out), ``INJECT`` (fault injection,
megatron_abft.flash.faults), ``CALIBRATE`` (the largest finite ``|residual| / (u * mass)`` of
the checks, for threshold calibration on a GPU) and ``SCALED`` (checksum parts carry a scale,
fp16: an accumulated reference is scaled after its loop, by its head's). ``INTERPRETER`` is True
in the copy that Triton's interpreter runs (megatron_abft.flash.build): its tl.dot on bf16 is
wrong, so tl.dot takes fp32 operands there (exact: a product of two bf16 values fits fp32), and
its fp32 -> bf16 cast truncates, so ``_lo`` rounds on the bits (to nearest even, as a GPU does)
and keeps the value in fp32.
"""

import triton
import triton.language as tl

from megatron_abft.flash.tiles import ONES

INTERPRETER = tl.constexpr(False)

# Section codes: rows of CODES, bits of DUE. Order as megatron_abft.config.FLASH_SECTIONS.
SCORES = tl.constexpr(0)
CONTEXT = tl.constexpr(1)
BWD_SCORES = tl.constexpr(2)
GRAD_PROBS = tl.constexpr(3)
GRAD_V = tl.constexpr(4)
GRAD_K = tl.constexpr(5)
GRAD_Q = tl.constexpr(6)
N_SECTIONS = tl.constexpr(7)

U32 = tl.constexpr(5.9604644775390625e-08)  # 2**-24: the unit roundoff of fp32 accumulation
FLOOR = tl.constexpr(2.0**-120)
"""Every bound's absolute floor: products that underflow to fp32's subnormals round to an
absolute grid (2**-149), not a relative one, so that a bound relative to the data alone would
flag their rounding (measured: fp32 rows whose P~ underflowed); no fault that matters is this
small."""
NO_ROW = tl.constexpr(2147483647)
RECORD_BLOCK = tl.constexpr(128)
"""Matrices _record reads at a time."""
INF = tl.constexpr(float("inf"))
W = tl.constexpr(16)
"""Columns of a checksum tile (checksums.WIDTH): parts of ``B e`` in 0 to 2, of ``|B| e`` in 3
to 5 (row sums only)."""
ONES_COLUMN = tl.constexpr(ONES)
"""The column of a row-sum tile that holds ones (tiles.ONES)."""

# Injection parameters, one int32 each in INJ (megatron_abft.flash.faults.kernel_args).
I_SECTION = tl.constexpr(0)
I_BH = tl.constexpr(1)
I_R0 = tl.constexpr(2)
I_R1 = tl.constexpr(3)
I_C0 = tl.constexpr(4)
I_C1 = tl.constexpr(5)
I_XOR = tl.constexpr(6)
I_VALUE = tl.constexpr(7)  # the fp32 value's bits
I_PERSISTENT = tl.constexpr(8)


# --- shared pieces --------------------------------------------------------------------------


@triton.jit
def _mma(a, b, acc):
    """``acc + a @ b`` accumulated in fp32 (``acc`` None: ``a @ b``)."""
    if INTERPRETER:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def _lo(x, dtype: tl.constexpr):
    """``x`` (fp32) rounded to ``dtype``, to nearest even (in the interpreter, bf16 as the fp32
    value of that bf16)."""
    if INTERPRETER:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _abs16(x):
    """``|x|`` of a 16-bit float tile, two elements a 32-bit AND (ptxas splits fp16's abs into
    halves and repacks them)."""
    if INTERPRETER:
        return tl.abs(x)
    return tl.inline_asm_elementwise(
        "and.b32 $0, $1, 0x7FFF7FFF;", "=r,r", [x], dtype=x.dtype, is_pure=True, pack=2
    )


@triton.jit
def _corrupt(x, rows, cols, bh, section: tl.constexpr, fresh, INJ):
    """``x`` with the armed fault landed where it hits: tile elements whose logical ``rows`` and
    ``cols`` (2-d, broadcastable) lie in its region, in its section and (batch, head). A
    transient fault hits the first computation of an element only (``fresh``), a persistent one
    every computation, the second pass's included."""
    persistent = tl.load(INJ + I_PERSISTENT) != 0
    hit = (tl.load(INJ + I_SECTION) == section) & (tl.load(INJ + I_BH) == bh)
    if hit & (fresh | persistent):
        inside = (rows >= tl.load(INJ + I_R0)) & (rows < tl.load(INJ + I_R1))
        inside = inside & (cols >= tl.load(INJ + I_C0)) & (cols < tl.load(INJ + I_C1))
        flip = tl.load(INJ + I_XOR)
        value = tl.load(INJ + I_VALUE).to(tl.float32, bitcast=True)
        flipped = (x.to(tl.int32, bitcast=True) ^ flip).to(tl.float32, bitcast=True)
        x = tl.where(inside, tl.where(flip != 0, flipped, value), x)
    return x


@triton.jit
def _fold(got, ref, mass, tol, worst, ratio, CALIBRATE: tl.constexpr):
    """Fold a row check into the rows' ``worst`` excess ``|got - ref| - (tol * mass + FLOOR)``
    (NaN kept: a row is flagged where its worst is not <= 0) and, in calibration runs, into
    their ``ratio``: the largest ``(|got - ref| - FLOOR) / (u * mass)``, the least c each bound
    needed."""
    residual = tl.abs(got - ref)
    worst = tl.maximum(worst, residual - (tol * mass + FLOOR), propagate_nan=tl.PropagateNan.ALL)
    if CALIBRATE:
        needed = tl.maximum(residual - FLOOR, 0.0) / (U32 * tl.maximum(mass, 1e-30))
        ratio = tl.maximum(ratio, needed)
    return worst, ratio


@triton.jit
def _kinds(worst, near_inf):
    """Per row: 0 clean, else 1 + the fault kind (megatron_abft.config.KINDS) of its worst
    excess."""
    kind = tl.where(worst > near_inf, 2, tl.where(worst > 0, 1, 0))
    return tl.where(worst != worst, 4, tl.where(worst == INF, 3, kind))


@triton.jit
def _report(
    FOUND, RATIO, section: tl.constexpr, bh, BH, state, rows, ratio, valid, outcome,
    TRANSPOSED: tl.constexpr, CALIBRATE: tl.constexpr,
):
    """Publish one pass's outcome for one section of matrix ``bh``: ``state`` per row (tile
    rows ``rows``, logical columns when TRANSPOSED; ``valid``: those in the matrix), as
    ``outcome`` (1 corrected, 2 uncorrectable), into the findings FOUND (CODES, then ROWS, then
    COLS, ``[N_SECTIONS, BH]`` each: launch.Findings). Returns whether anything was flagged."""
    kind = tl.max(state)
    if kind > 0:
        at = FOUND + section * BH + bh
        tl.atomic_max(at, (outcome << 2) | (kind - 1))
        first = NO_ROW - tl.min(tl.where(state > 0, rows, NO_ROW))
        if TRANSPOSED:
            tl.atomic_max(at + 2 * N_SECTIONS * BH, first)
        else:
            tl.atomic_max(at + N_SECTIONS * BH, first)
    if CALIBRATE:  # flagged rows too (an alarm shows how far it went), bar non-finite ones
        ratio = tl.where(valid & (ratio < INF), ratio, 0.0)
        tl.atomic_max(RATIO + section * BH + bh, tl.max(ratio))
    return kind > 0


@triton.jit
def _last(FOUND, BH):
    """Whether this program is the last of its launch to get here: each counts itself in the
    findings' DONE (zeroed before the call) after a barrier, so that the last one's count comes
    after every other program's findings, all of its threads' (acquire-release)."""
    total = tl.num_programs(0) * tl.num_programs(1)
    tl.debug_barrier()
    return tl.atomic_add(FOUND + 3 * N_SECTIONS * BH, 1, sem="acq_rel") == total - 1


@triton.jit
def _record(FOUND, COUNTS, CLOCK, LOG, LOGGED, BH, CAPACITY, FIELDS):
    """A call's findings into its ledger (megatron_abft.flash.ledger), by the last program of
    its last launch: each section's codes (FOUND, as _report writes them), a matrix once by its
    outcome and kind, into COUNTS [sections, 3, 4] (detected, corrected, uncorrectable), and its
    worst matrix, where it has one, into LOG [sections, CAPACITY, FIELDS] at the section's
    LOGGED slot."""
    kinds = tl.arange(0, 4)
    for s in range(N_SECTIONS):
        detected = tl.zeros([4], tl.int64)
        corrected = tl.zeros([4], tl.int64)
        uncorrectable = tl.zeros([4], tl.int64)
        worst = 0
        at = 0
        for start in range(0, BH, RECORD_BLOCK):
            matrix = start + tl.arange(0, RECORD_BLOCK)
            code = tl.load(FOUND + s * BH + matrix, mask=matrix < BH, other=0, cache_modifier=".cg")
            of_kind = ((code & 3)[:, None] == kinds[None, :]) & (code > 0)[:, None]
            detected += tl.sum(of_kind.to(tl.int64), 0)
            corrected += tl.sum((of_kind & ((code >> 2) == 1)[:, None]).to(tl.int64), 0)
            uncorrectable += tl.sum((of_kind & ((code >> 2) == 2)[:, None]).to(tl.int64), 0)
            top = tl.max(code, 0)
            if top > worst:
                worst = top
                at = start + tl.argmax(code, 0)
        row = COUNTS + s * 12 + kinds
        tl.store(row, tl.load(row) + detected)
        tl.store(row + 4, tl.load(row + 4) + corrected)
        tl.store(row + 8, tl.load(row + 8) + uncorrectable)
        if worst > 0:
            slot = tl.load(LOGGED + s)
            if slot < CAPACITY:
                found = FOUND + s * BH + at
                first_row = tl.load(found + N_SECTIONS * BH, cache_modifier=".cg")
                first_col = tl.load(found + 2 * N_SECTIONS * BH, cache_modifier=".cg")
                entry = LOG + (s * CAPACITY + slot) * FIELDS
                tl.store(entry, tl.load(CLOCK))
                tl.store(entry + 1, (worst >> 2).to(tl.float64))
                tl.store(entry + 2, at.to(tl.float64))
                tl.store(entry + 3, (worst & 3).to(tl.float64))
                tl.store(entry + 4, tl.where(first_row > 0, NO_ROW - first_row, -1).to(tl.float64))
                tl.store(entry + 5, tl.where(first_col > 0, NO_ROW - first_col, -1).to(tl.float64))
                tl.store(entry + 6, float("nan"))
            tl.store(LOGGED + s, slot + 1)


@triton.jit
def _columns(x, first: tl.constexpr):
    """Per row, the sum of ``x``'s columns ``first`` to ``first + 2`` (a split vector's parts)."""
    column = tl.arange(0, W)[None, :]
    return tl.sum(tl.where((column >= first) & (column < first + 3), x, 0.0), 1)


@triton.jit
def _column(x, which: tl.constexpr):
    """Per row, ``x``'s column ``which``."""
    return tl.sum(tl.where(tl.arange(0, W)[None, :] == which, x, 0.0), 1)


@triton.jit
def _column_ref(a, W_tile, ST_tile, SCALED: tl.constexpr):
    """``A (B e)`` of a GEMM ``A B`` whose B is X transposed: ``a [R, HEAD_DIM]`` times X's
    column sums (checksums, ``W_tile [HEAD_DIM, 16]``, their parts the only nonzero columns)."""
    ref = tl.sum(_mma(a, W_tile, None), 1)
    if SCALED:
        ref = ref * tl.load(ST_tile)
    return ref


@triton.jit
def _deferred_check(
    out, ref, first: tl.constexpr, mass, tiles, tol, ratio, CALIBRATE: tl.constexpr, scale=1.0
):
    """An accumulating GEMM's check after its loop: the row sums of ``out`` against the
    reference in ``ref``'s columns ``first`` to ``first + 2`` times ``scale`` (its checksum
    tiles'), under the rows' summed ``mass`` (None: ``ref``'s next three columns, times
    ``scale``) grown by ``sqrt(tiles / 16)`` for the accumulation's own rounding. Returns the
    rows' excess and ratio."""
    want = _columns(ref, first) * scale
    if mass is None:
        mass = _columns(ref, first + 3) * scale
    growth = tl.maximum(1.0, tl.sqrt(tiles / 16.0))
    worst = tl.full(want.shape, -INF, tl.float32)
    return _fold(tl.sum(out, 1), want, mass * growth, tol, worst, ratio, CALIBRATE)


@triton.jit
def _stat_max(ST, first, count, which: tl.constexpr, STRIDE: tl.constexpr = 3):
    """The largest stat ``which`` (checksums' stats, STRIDE a tile) of tiles ``[first, first +
    count)``, read outside a loop: a load in the loop would hold registers through its
    pipeline."""
    best = 0.0
    for start in range(0, count, 64):
        at = start + tl.arange(0, 64)
        stat = tl.load(ST + (first + at) * STRIDE + which, mask=at < count, other=0.0)
        best = tl.maximum(best, tl.max(stat, 0))
    return best


@triton.jit
def _stat_sum(ST, first, count, which: tl.constexpr, STRIDE: tl.constexpr):
    """The sum of stat ``which`` of tiles ``[first, first + count)``, as _stat_max reads."""
    total = 0.0
    for start in range(0, count, 64):
        at = start + tl.arange(0, 64)
        stat = tl.load(ST + (first + at) * STRIDE + which, mask=at < count, other=0.0)
        total += tl.sum(stat, 0)
    return total


@triton.jit
def _partial_sums(x, acc):
    """``acc [R, 8] + `` the row sums of ``x [R, C]`` over its columns 8 apart: on a GPU a
    thread's columns of an MMA fragment are 8 apart, so the sums stay in the thread (no
    shuffle, twice the rows' registers); ``tl.sum(acc, 1)`` finishes them once, after the
    loop."""
    return acc + tl.sum(tl.reshape(x, [x.shape[0], x.shape[1] // 8, 8]), 1)


@triton.jit
def _norm(x, axis: tl.constexpr):
    return tl.sqrt(tl.sum(x * x, axis))


@triton.jit
def _row_norms(X, start, rows, cols, stride, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The L2 norms of the ``BLOCK`` rows of X from row ``start`` (rows past ``rows`` and columns
    past ``cols`` as zeros), read again 32 columns at a time: after a loop, where the tile whole
    in registers would spill what the loop's accumulators hold."""
    r = start + tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], tl.float32)
    for c0 in tl.static_range(0, HEAD_DIM, 32):
        c = c0 + tl.arange(0, 32)
        at = X + r[:, None].to(tl.int64) * stride + c[None, :]
        x = tl.load(at, mask=(r < rows)[:, None] & (c < cols)[None, :], other=0.0)
        x = x.to(tl.float32)
        total += tl.sum(x * x, 1)
    return tl.sqrt(total)


@triton.jit
def _tiles(X, rows, cols, stride, BLOCK: tl.constexpr, WIDTH: tl.constexpr, TMA: tl.constexpr):
    """Where ``[BLOCK, WIDTH]`` tiles of the ``[rows, cols]`` matrix at X (rows ``stride`` apart,
    columns contiguous) are read from: a TMA descriptor (Hopper: no address registers, and rows
    and columns past the end read as zeros), or X itself."""
    if TMA:
        source = tl.make_tensor_descriptor(X, [rows, cols], [stride, 1], [BLOCK, WIDTH])
    else:
        source = X
    return source


@triton.jit
def _read(
    source, row, rows, cols, stride, BLOCK: tl.constexpr, WIDTH: tl.constexpr, TMA: tl.constexpr
):
    """The tile of ``source`` (``_tiles``) from row ``row``: rows past ``rows`` and columns past
    ``cols`` read as zeros."""
    if TMA:
        tile = source.load([row, 0])
    else:
        r = tl.arange(0, BLOCK)
        c = tl.arange(0, WIDTH)
        mask = (row + r < rows)[:, None] & (c < cols)[None, :]
        at = source + tl.cast(row, tl.int64) * stride + (r[:, None] * stride + c[None, :])
        tile = tl.load(at, mask=mask, other=0.0)
    return tile


@triton.jit
def _write(
    X, row, tile, rows, cols, stride, BLOCK: tl.constexpr, WIDTH: tl.constexpr,
    TMA: tl.constexpr,
):  # fmt: skip
    """``tile`` into the ``[rows, cols]`` matrix at X from row ``row``, none past the end."""
    if TMA:
        _tiles(X, rows, cols, stride, BLOCK, WIDTH, TMA).store([row, 0], tile)
    else:
        r = tl.arange(0, BLOCK)
        c = tl.arange(0, WIDTH)
        mask = (row + r < rows)[:, None] & (c < cols)[None, :]
        at = X + tl.cast(row, tl.int64) * stride + (r[:, None] * stride + c[None, :])
        tl.store(at, tile, mask=mask)


# --- forward ----------------------------------------------------------------------------------


@triton.jit
def _fwd_tiles(
    acc, m_i, l_i, cref, srow, q, offs_m, k_src, v_src, vr_src, INJ, qk_scale, bh, N_K, D, skn,
    svn, lo, hi, first_pass, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
    CAUSAL: tl.constexpr, CHECK_S: tl.constexpr, CHECK_C: tl.constexpr, INJECT: tl.constexpr,
    TMA: tl.constexpr,
):
    """The query block's key tiles ``[lo, hi)``: the online softmax and P~V (FA2), with S's row
    sums and the context's reference accumulated beside them."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        # keys past the end and padded head dims read as zeros
        k = _read(k_src, start_n, N_K, D, skn, BLOCK_N, HEAD_DIM, TMA)
        v = _read(v_src, start_n, N_K, D, svn, BLOCK_N, HEAD_DIM, TMA)
        s = _mma(q, tl.trans(k), None)
        if INJECT:
            s = _corrupt(s, offs_m[:, None], cols[None, :], bh, SCORES, first_pass, INJ)
        if CHECK_S:  # S e, from minus Q (K^T e) over the keys
            srow = _partial_sums(s, srow)
        if MASKED:
            visible = cols[None, :] < N_K
            if CAUSAL:
                visible = visible & (cols[None, :] <= offs_m[:, None])
            s = tl.where(visible, s * qk_scale, -INF)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
        else:  # qk_scale > 0: the scaled row max is the row max scaled, and the exponent one
            # FMA (as the compiler would contract it): the max's own term is exp2 of m's rounding
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.exp2(tl.fma(s, qk_scale, -m_new[:, None]))
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        p_lo = _lo(p, q.dtype)
        if CHECK_C:  # (P~ V) e = P~ (V e), and the mass P~ (|V| e)
            w = _read(vr_src, start_n, N_K, W, W, BLOCK_N, W, TMA)
            cref = _mma(p_lo, w, cref * alpha[:, None])
        acc = _mma(p_lo, v, acc * alpha[:, None])
        if INJECT:  # the first tile's P~V: the accumulator holds it alone
            fresh = first_pass & (start_n == 0)
            offs_d = tl.arange(0, HEAD_DIM)
            acc = _corrupt(acc, offs_m[:, None], offs_d[None, :], bh, CONTEXT, fresh, INJ)
        m_i = m_new
    return acc, m_i, l_i, cref, srow


@triton.jit
def _fwd_pass(
    q, offs_m, m_ok, k_src, v_src, KC, KCS, vr_src, VRS, INJ, qk_scale, tol, near_inf, bh, N_K, D,
    skn, svn, first_pass, interior, hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, CHECK_S: tl.constexpr, CHECK_C: tl.constexpr,
    SCALED: tl.constexpr, INJECT: tl.constexpr, CALIBRATE: tl.constexpr, TMA: tl.constexpr,
):
    """One pass of a query block over its keys: the interior tiles, then the masked ones; the
    rows' fault kinds in S (its row sums against one MMA with the prefix of K's column sums over
    the block's keys, under the tiles' masses summed; and 1 <= l <= #keys) and in the context,
    and their ratios."""
    tiles = tl.cdiv(hi, BLOCK_N)
    srow = tl.zeros([BLOCK_M], tl.float32)
    mass = tl.zeros([BLOCK_M], tl.float32)
    if CHECK_S:  # S e = Q (K^T e) over the keys [0, hi), Cauchy-Schwarz masses summed, from Q
        # before the loop (after it, Q in registers would be held through the loop): the row
        # sums start from minus the reference and end as the residual
        last = tiles - 1
        offs = tl.arange(0, HEAD_DIM)[:, None] * W + tl.arange(0, W)[None, :]
        w = tl.load(KC + last.to(tl.int64) * (HEAD_DIM * W) + offs)
        srow = -_column_ref(q, w, KCS + last * 3, SCALED)
        mass = _norm(q.to(tl.float32), 1) * tl.load(KCS + last * 3 + 1)
    scale = tl.load(VRS) if SCALED and CHECK_C else 1.0  # V's row sums at its head's scale
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    m_i = tl.full([BLOCK_M], -INF, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    cref = tl.zeros([BLOCK_M, W], tl.float32)
    srow = tl.where(tl.arange(0, 8)[None, :] == 0, srow[:, None], 0.0)  # as _partial_sums add
    acc, m_i, l_i, cref, srow = _fwd_tiles(
        acc, m_i, l_i, cref, srow, q, offs_m, k_src, v_src, vr_src, INJ, qk_scale, bh, N_K, D,
        skn, svn, 0, interior, first_pass, BLOCK_N, HEAD_DIM, False, CAUSAL, CHECK_S, CHECK_C,
        INJECT, TMA,
    )
    acc, m_i, l_i, cref, srow = _fwd_tiles(
        acc, m_i, l_i, cref, srow, q, offs_m, k_src, v_src, vr_src, INJ, qk_scale, bh, N_K, D,
        skn, svn, interior, hi, first_pass, BLOCK_N, HEAD_DIM, True, CAUSAL, CHECK_S, CHECK_C,
        INJECT, TMA,
    )
    state_s = tl.zeros([BLOCK_M], tl.int32)
    state_c = tl.zeros([BLOCK_M], tl.int32)
    ratio_s = tl.zeros([BLOCK_M], tl.float32)
    ratio_c = tl.zeros([BLOCK_M], tl.float32)
    if CHECK_S:
        none = tl.full([BLOCK_M], -INF, tl.float32)
        worst_s, ratio_s = _fold(tl.sum(srow, 1), 0.0, mass, tol, none, ratio_s, CALIBRATE)
        # 1 <= l <= #keys: the row's largest term is exp2(0) = 1, but for the rounding of the
        # row max m to fp32 in its exponent (exp2(-d) >= 1 - d, |d| <= u |m|; bf16's outlier
        # rows reach |m| ~ 5e4, where exp2(-u |m|) is below 1 - 1e-3)
        keys = tl.full([BLOCK_M], N_K, tl.int32)
        if CAUSAL:
            keys = tl.minimum(keys, offs_m + 1)
        least = 1.0 - 1e-3 - 2.0 * U32 * tl.abs(m_i)
        excess = tl.maximum(least - l_i, l_i - keys * (1.0 + 1e-3))
        worst_s = tl.maximum(worst_s, excess, propagate_nan=tl.PropagateNan.ALL)
        state_s = tl.where(m_ok, _kinds(worst_s, near_inf), 0)
    if CHECK_C:  # every tile's P~V, the rescales and the sum, at once
        worst_c, ratio_c = _deferred_check(
            acc, cref, 0, None, tiles.to(tl.float32), tol, ratio_c, CALIBRATE, scale
        )
        # a row flagged in S fails downstream too: it counts once, in S
        state_c = tl.where(m_ok & (state_s == 0), _kinds(worst_c, near_inf), 0)
    return acc, m_i, l_i, state_s, state_c, ratio_s, ratio_c


@triton.jit
def _fwd_block(
    Q, K, V, OUT, LSE, KC, KCS, VR, VRS, FOUND, RATIO, INJ, qk_scale, tol, near_inf,
    sqm, skn, svn, som, bh, BH, N_Q, N_K, D, ROWS_Q, start, interior, hi, outcome: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
    CHECK_S: tl.constexpr, CHECK_C: tl.constexpr, SCALED: tl.constexpr, INJECT: tl.constexpr,
    CALIBRATE: tl.constexpr, TMA: tl.constexpr,
):
    """One pass of the query block from row ``start``: Q read, its keys, the checks' outcomes
    reported as ``outcome`` (1: the first pass's, 2: the second's), O and LSE written. Returns
    whether a check flagged. Rows past the end and padded head dims read as zeros and are not
    written (``_tiles``)."""
    k_src = _tiles(K, N_K, D, skn, BLOCK_N, HEAD_DIM, TMA)
    v_src = _tiles(V, N_K, D, svn, BLOCK_N, HEAD_DIM, TMA)
    vr_src = _tiles(VR, N_K, W, W, BLOCK_N, W, TMA)  # V's row-sum tiles, as V's
    offs_m = start + tl.arange(0, BLOCK_M)
    m_ok = offs_m < N_Q
    q = _read(_tiles(Q, N_Q, D, sqm, BLOCK_M, HEAD_DIM, TMA), start, N_Q, D, sqm, BLOCK_M,
              HEAD_DIM, TMA)  # fmt: skip
    acc, m_i, l_i, state_s, state_c, ratio_s, ratio_c = _fwd_pass(
        q, offs_m, m_ok, k_src, v_src, KC, KCS, vr_src, VRS, INJ, qk_scale, tol, near_inf, bh, N_K,
        D, skn, svn, outcome == 1, interior, hi, BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, CHECK_S,
        CHECK_C, SCALED, INJECT, CALIBRATE, TMA,
    )
    flagged = N_Q < 0  # False, as a scalar
    if CHECK_S:
        flagged |= _report(
            FOUND, RATIO, SCORES, bh, BH, state_s, offs_m, ratio_s, m_ok, outcome,
            False, CALIBRATE,
        )
    if CHECK_C:
        flagged |= _report(
            FOUND, RATIO, CONTEXT, bh, BH, state_c, offs_m, ratio_c, m_ok, outcome,
            False, CALIBRATE,
        )
    o = _lo(acc / l_i[:, None], OUT.dtype.element_ty).to(OUT.dtype.element_ty)
    _write(OUT, start, o, N_Q, D, som, BLOCK_M, HEAD_DIM, TMA)
    tl.store(LSE + bh.to(tl.int64) * ROWS_Q + offs_m, m_i + tl.log2(l_i))  # rows past the end too
    return flagged


@triton.jit
def _fwd_kernel(
    Q, K, V, OUT, LSE, KC, KCS, VR, VRS, FOUND, RATIO, INJ, AGAIN, COUNTS, CLOCK, LOG, LOGGED,
    CAPACITY, FIELDS, qk_scale, tol, near_inf, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob,
    soh, som, H, GROUP, N_Q, N_K, D, ROWS_Q, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, DUE: tl.constexpr,
    SCALED: tl.constexpr, INJECT: tl.constexpr, CALIBRATE: tl.constexpr, RETRY: tl.constexpr,
    RECORD: tl.constexpr, TMA: tl.constexpr,
):
    """O = softmax(scale Q K^T) V for one query block of one (batch, head); LSE in log2 units,
    ROWS_Q (>= N_Q) a head, those past the end finite.
    KC/KCS: K's column sums, VR/VRS: V's row sums, tiled by BLOCK_N (checksums.py). A checked
    launch sets ``AGAIN[program]`` where a check flagged; the RETRY launch computes those
    blocks again, whole, and reports what they flag as uncorrectable. The tensors' last dims
    are contiguous (launch.tma_ready), so that each takes its batch, head and row strides only
    (as in the kernels below)."""
    CHECK_S: tl.constexpr = (tl.constexpr(DUE) >> SCORES) & 1 != 0
    CHECK_C: tl.constexpr = (tl.constexpr(DUE) >> CONTEXT) & 1 != 0
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    BH = tl.num_programs(1)
    program = bh * tl.num_programs(0) + pid_m
    if RETRY:
        if tl.load(AGAIN + program) == 0:
            if RECORD:
                if _last(FOUND, BH):
                    _record(FOUND, COUNTS, CLOCK, LOG, LOGGED, BH, CAPACITY, FIELDS)
            return
    b = bh // H
    h = bh % H
    hk = h // GROUP
    bhk = b * (H // GROUP) + hk
    Q += b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
    OUT += b.to(tl.int64) * sob + h.to(tl.int64) * soh
    K += b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    V += b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    TILES_K = tl.cdiv(N_K, BLOCK_N)
    KC += bhk.to(tl.int64) * TILES_K * (HEAD_DIM * W)
    KCS += bhk.to(tl.int64) * TILES_K * 3
    VR += bhk.to(tl.int64) * TILES_K * (BLOCK_N * W)
    VRS += bhk.to(tl.int64) * TILES_K * 3
    hi = N_K
    interior = (N_K // BLOCK_N) * BLOCK_N
    if CAUSAL:
        hi = tl.minimum(N_K, (pid_m + 1) * BLOCK_M)
        interior = tl.minimum(interior, pid_m * BLOCK_M)
    again = _fwd_block(
        Q, K, V, OUT, LSE, KC, KCS, VR, VRS, FOUND, RATIO, INJ, qk_scale, tol,
        near_inf, sqm, skn, svn, som, bh, BH, N_Q, N_K, D, ROWS_Q, pid_m * BLOCK_M, interior, hi,
        1 + RETRY, BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, CHECK_S, CHECK_C, SCALED, INJECT,
        CALIBRATE, TMA,
    )
    if (CHECK_S or CHECK_C) and not RETRY:
        tl.store(AGAIN + program, again.to(tl.int32))
    if RECORD:  # the last launch of a call: its last program folds the call into the ledger
        if _last(FOUND, BH):
            _record(FOUND, COUNTS, CLOCK, LOG, LOGGED, BH, CAPACITY, FIELDS)


# --- backward: dK and dV ------------------------------------------------------------------------


@triton.jit
def _dkdv_tiles(
    dk, dv, ref, srow, prow, k, v, offs_n, q_src, do_src, RW, LSE, DELTA, INJ, D, sqm,
    sdom, qk_scale, bh, N_Q, lo, hi, first, first_pass, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    CHECK_S: tl.constexpr, CHECK_P: tl.constexpr, CHECK_V: tl.constexpr, CHECK_K: tl.constexpr,
    INJECT: tl.constexpr, TMA: tl.constexpr,
):
    """The key block's query tiles ``[lo, hi)`` of its head: S^T = K Q^T and dP^T = V dO^T
    with their row sums accumulated (checked per head), dV += P^T dO and dK += dS^T Q with their
    references and masses accumulated beside them in ``ref``: one MMA of ``[P^T | dS^T]``
    against the query tile's checksum tiles of dO and Q stacked (checksums.Backward.rows, each
    zero in the other's columns), one accumulator where two spilled at head dim 128.
    ``first``: the head's first query tile, whose products a transient fault in dV or dK
    hits."""
    offs_mb = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    lse_tile = LSE + lo  # scalar loads in the loop only through stepped pointers
    delta_tile = DELTA + lo
    # the checksum tiles through a pointer stepped a tile at a time: a third TMA load in the loop
    # took its stage indices off the uniform datapath (about 30 instructions a tile)
    w_tile = RW + (2 * lo + tl.arange(0, 2 * BLOCK_M))[:, None] * W + tl.arange(0, W)[None, :]
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + offs_mb
        # queries past the end and padded head dims read as zeros
        q = _read(q_src, start_m, N_Q, D, sqm, BLOCK_M, HEAD_DIM, TMA)
        do = _read(do_src, start_m, N_Q, D, sdom, BLOCK_M, HEAD_DIM, TMA)
        st = _mma(k, tl.trans(q), None)
        if INJECT:
            st = _corrupt(st, offs_m[None, :], offs_n[:, None], bh, BWD_SCORES, first_pass, INJ)
        if CHECK_S:  # S^T e, from minus K (Q^T e) over the head's tiles
            srow = _partial_sums(st, srow)
        # LSE and Delta read where they are used (padded: finite past the end): read at the
        # top, the pipeline held the next tile's in registers across the loop
        lse = tl.load(lse_tile + offs_mb)
        pt = tl.exp2(st * qk_scale - lse[None, :])
        if MASKED and CAUSAL:
            pt = tl.where(offs_m[None, :] >= offs_n[:, None], pt, 0.0)
        pt_lo = _lo(pt, q.dtype)
        dv = _mma(pt_lo, do, dv)
        fresh = first_pass & (start_m == first)
        if INJECT:
            dv = _corrupt(dv, offs_n[:, None], offs_d[None, :], bh, GRAD_V, fresh, INJ)
        dpt = _mma(v, tl.trans(do), None)
        if INJECT:
            dpt = _corrupt(dpt, offs_m[None, :], offs_n[:, None], bh, GRAD_PROBS, first_pass, INJ)
        if CHECK_P:  # dP^T e, from minus V (dO^T e)
            prow = _partial_sums(dpt, prow)
        delta = tl.load(delta_tile + offs_mb)
        dst = pt * (dpt - delta[None, :])
        dst_lo = _lo(dst, q.dtype)
        dk = _mma(dst_lo, q, dk)
        if INJECT:
            dk = _corrupt(dk, offs_n[:, None], offs_d[None, :], bh, GRAD_K, fresh, INJ)
        if CHECK_V or CHECK_K:  # P^T (dO e), P^T (|dO| e), dK's masses and dS^T (Q e)
            both = tl.reshape(tl.permute(tl.join(pt_lo, dst_lo), (0, 2, 1)), [BLOCK_N, 2 * BLOCK_M])
            ref = _mma(both, tl.load(w_tile), ref)
        lse_tile += BLOCK_M
        delta_tile += BLOCK_M
        w_tile += 2 * BLOCK_M * W
    return dk, dv, ref, srow, prow


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, RW, CP, ST, FOUND, RATIO, INJ, AGAIN, COUNTS, CLOCK, LOG,
    LOGGED, CAPACITY, FIELDS, qk_scale, sm_scale, tol, near_inf, sqb, sqh, sqm, skb, skh, skn,
    svb, svh, svn, sdob, sdoh, sdom, sdkb, sdkh, sdkn, sdvb, sdvh, sdvn, H, GROUP, N_Q, N_K, D,
    ROWS_Q, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, DUE: tl.constexpr, SCALED: tl.constexpr,
    INJECT: tl.constexpr, CALIBRATE: tl.constexpr, RETRY: tl.constexpr, RECORD: tl.constexpr,
    TMA: tl.constexpr,
):
    """dK and dV of one key block of one (batch, query head): with grouped-query attention
    each query head's share, into DK and DV of that head (the launch sums a group's). LSE and
    DELTA hold ROWS_Q (>= N_Q) values a head, so that queries past the end read finite values:
    their Q and dO read as zeros and they add nothing, with no mask. RW, CP, ST: the checksum
    tiles of dO and Q of BLOCK_M queries (checksums.Backward).

    The query tiles run in two loops: the causal diagonal's (masked), then the interior's (and
    without a causal mask the first tile in the masked loop: with the interior loop first,
    ptxas serialised its wgmma, C7515). After them, S^T and dP^T: each row's sum from minus one
    MMA with the column sums of Q and dO over those tiles, under the tiles' masses summed; dV
    and dK against their references. AGAIN and RETRY as in _fwd_kernel."""
    CHECK_S: tl.constexpr = (tl.constexpr(DUE) >> BWD_SCORES) & 1 != 0
    CHECK_P: tl.constexpr = (tl.constexpr(DUE) >> GRAD_PROBS) & 1 != 0
    CHECK_V: tl.constexpr = (tl.constexpr(DUE) >> GRAD_V) & 1 != 0
    CHECK_K: tl.constexpr = (tl.constexpr(DUE) >> GRAD_K) & 1 != 0
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    BH = tl.num_programs(1)
    program = bh * tl.num_programs(0) + pid_n
    if RETRY:
        if tl.load(AGAIN + program) == 0:
            if RECORD:
                if _last(FOUND, BH):
                    _record(FOUND, COUNTS, CLOCK, LOG, LOGGED, BH, CAPACITY, FIELDS)
            return
    b = bh // H
    h = bh % H
    hk = h // GROUP
    start = pid_n * BLOCK_N
    offs_n = start + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N_K
    K += b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    V += b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    k = _read(_tiles(K, N_K, D, skn, BLOCK_N, HEAD_DIM, TMA), start, N_K, D, skn, BLOCK_N,
              HEAD_DIM, TMA)  # fmt: skip
    v = _read(_tiles(V, N_K, D, svn, BLOCK_N, HEAD_DIM, TMA), start, N_K, D, svn, BLOCK_N,
              HEAD_DIM, TMA)  # fmt: skip
    Q += b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
    DO += b.to(tl.int64) * sdob + h.to(tl.int64) * sdoh
    q_src = _tiles(Q, N_Q, D, sqm, BLOCK_M, HEAD_DIM, TMA)
    do_src = _tiles(DO, N_Q, D, sdom, BLOCK_M, HEAD_DIM, TMA)
    TILES_Q = tl.cdiv(N_Q, BLOCK_M)
    RW += bh.to(tl.int64) * TILES_Q * (2 * BLOCK_M * W)  # dO's and Q's checksum tiles
    ST += bh.to(tl.int64) * TILES_Q * 8
    LSE += bh.to(tl.int64) * ROWS_Q
    DELTA += bh.to(tl.int64) * ROWS_Q
    interior = TILES_Q * BLOCK_M
    lo = 0
    diagonal = tl.minimum(BLOCK_M, interior)
    if CAUSAL:  # queries before the block see none of it; the block's own rows, some
        lo = tl.minimum(start, interior)
        diagonal = tl.minimum(start + BLOCK_N, interior)
    first_pass: tl.constexpr = not RETRY
    outcome: tl.constexpr = 1 + RETRY
    # S^T e = K (Q^T e) and dP^T e = V (dO^T e) over the head's tiles, against one MMA with the
    # column sums of Q and dO from its first tile on, made before the loop: the row sums start
    # from minus their references and end as the residuals, under Cauchy-Schwarz masses summed
    srow = tl.zeros([BLOCK_N], tl.float32)
    prow = tl.zeros([BLOCK_N], tl.float32)
    if CHECK_S or CHECK_P:
        first_tile = lo // BLOCK_M
        some = first_tile < TILES_Q  # (a key block that no query sees: none, zeros)
        offs = tl.arange(0, HEAD_DIM)[:, None] * W + tl.arange(0, W)[None, :]
        at = (bh.to(tl.int64) * TILES_Q + first_tile) * (HEAD_DIM * W)
        w = tl.load(CP + at + offs, mask=some, other=0.0)
        stats = ST + first_tile * 8
        scale = tl.load(stats + 2, mask=some, other=1.0) if SCALED else 1.0
        if CHECK_S:
            srow = -_columns(_mma(k, w, None), 0) * scale
        if CHECK_P:
            prow = -_columns(_mma(v, w, None), 3) * scale
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    ref = tl.zeros([BLOCK_N, W], tl.float32)
    first_column = tl.arange(0, 8)[None, :] == 0
    srow = tl.where(first_column, srow[:, None], 0.0)  # as _partial_sums accumulate
    prow = tl.where(first_column, prow[:, None], 0.0)
    dk, dv, ref, srow, prow = _dkdv_tiles(
        dk, dv, ref, srow, prow, k, v, offs_n, q_src, do_src, RW, LSE, DELTA, INJ, D, sqm, sdom,
        qk_scale, bh, N_Q, lo, diagonal, lo, first_pass, BLOCK_M, BLOCK_N, HEAD_DIM, True,
        CAUSAL, CHECK_S, CHECK_P, CHECK_V, CHECK_K, INJECT, TMA,
    )
    dk, dv, ref, srow, prow = _dkdv_tiles(
        dk, dv, ref, srow, prow, k, v, offs_n, q_src, do_src, RW, LSE, DELTA, INJ, D, sqm, sdom,
        qk_scale, bh, N_Q, diagonal, interior, lo, first_pass, BLOCK_M, BLOCK_N, HEAD_DIM,
        False, CAUSAL, CHECK_S, CHECK_P, CHECK_V, CHECK_K, INJECT, TMA,
    )
    if CHECK_S or CHECK_P or CHECK_V or CHECK_K:
        if SCALED:  # dO's and Q's row sums at their head's scales (Q's in columns 6-8)
            of_q = (tl.arange(0, W) >= 6) & (tl.arange(0, W) < 9)
            ref = ref * tl.where(of_q, tl.load(ST + 1), tl.load(ST))[None, :]
        tiles = tl.cdiv(N_Q - lo, BLOCK_M)
        state_s = tl.zeros([BLOCK_N], tl.int32)
        state_p = tl.zeros([BLOCK_N], tl.int32)
        none = tl.full([BLOCK_N], -INF, tl.float32)
        flagged = N_Q < 0  # False, as a scalar
        # the rows' norms for the masses, read again after the loop, which then holds neither
        vn = tl.zeros([BLOCK_N], tl.float32)
        if CHECK_P or CHECK_K:
            vn = _row_norms(V, start, N_K, D, svn, BLOCK_N, HEAD_DIM)
        if CHECK_S:
            kn = _row_norms(K, start, N_K, D, skn, BLOCK_N, HEAD_DIM)
            mass_s = kn * tl.load(stats + 3, mask=some, other=0.0)
            ratio_s = tl.zeros([BLOCK_N], tl.float32)
            worst, ratio_s = _fold(tl.sum(srow, 1), 0.0, mass_s, tol, none, ratio_s, CALIBRATE)
            state_s = tl.where(n_ok, _kinds(worst, near_inf), 0)
            flagged |= _report(
                FOUND, RATIO, BWD_SCORES, bh, BH, state_s, offs_n, ratio_s, n_ok,
                outcome, True, CALIBRATE,
            )
        if CHECK_P:
            ratio_p = tl.zeros([BLOCK_N], tl.float32)
            mass_p = vn * tl.load(stats + 4, mask=some, other=0.0)
            worst, ratio_p = _fold(tl.sum(prow, 1), 0.0, mass_p, tol, none, ratio_p, CALIBRATE)
            state_p = tl.where(n_ok & (state_s == 0), _kinds(worst, near_inf), 0)
            flagged |= _report(
                FOUND, RATIO, GRAD_PROBS, bh, BH, state_p, offs_n, ratio_p, n_ok,
                outcome, True, CALIBRATE,
            )
        # a key row flagged upstream fails downstream too: it counts once, where it began (dV's
        # reference shares dS^T's MMA, where a non-finite dP^T times Q's tile's zeros is NaN)
        upstream = (state_s > 0) | (state_p > 0)
        if CHECK_V:  # (P^T dO) e = P^T (dO e), the mass P^T (|dO| e)
            ratio_v = tl.zeros([BLOCK_N], tl.float32)
            worst_v, ratio_v = _deferred_check(dv, ref, 0, None, tiles, tol, ratio_v, CALIBRATE)
            state_v = tl.where(n_ok & ~upstream, _kinds(worst_v, near_inf), 0)
            flagged |= _report(
                FOUND, RATIO, GRAD_V, bh, BH, state_v, offs_n, ratio_v, n_ok, outcome,
                False, CALIBRATE,
            )
        if CHECK_K:  # (dS^T Q) e = dS^T (Q e), the mass of |dS^T| <= P^T (|dP^T| + |Delta|)
            # with |dP_nm| <= ||v_n|| ||dO_m||, 1% for dS^T's and P^T's rounding
            mass = 1.01 * (vn * _columns(ref, 9) + _columns(ref, 12))
            if SCALED:  # fp16: P~ as the MMA takes it may be a subnormal flushed (2**-25 off)
                first_tile = lo // BLOCK_M
                by_norm = _stat_sum(ST, first_tile, tiles, 5, 8)
                by_delta = _stat_sum(ST, first_tile, tiles, 6, 8)
                mass += 2.0**-25 * (vn * by_norm + by_delta)
            ratio_k = tl.zeros([BLOCK_N], tl.float32)
            worst_k, ratio_k = _deferred_check(dk, ref, 6, mass, tiles, tol, ratio_k, CALIBRATE)
            state_k = tl.where(n_ok & ~upstream, _kinds(worst_k, near_inf), 0)
            flagged |= _report(
                FOUND, RATIO, GRAD_K, bh, BH, state_k, offs_n, ratio_k, n_ok, outcome,
                False, CALIBRATE,
            )
        if not RETRY:
            tl.store(AGAIN + program, flagged.to(tl.int32))
    dk = _lo(dk * sm_scale, DK.dtype.element_ty).to(DK.dtype.element_ty)
    dv = _lo(dv, DV.dtype.element_ty).to(DV.dtype.element_ty)
    DK += b.to(tl.int64) * sdkb + h.to(tl.int64) * sdkh
    DV += b.to(tl.int64) * sdvb + h.to(tl.int64) * sdvh
    _write(DK, start, dk, N_K, D, sdkn, BLOCK_N, HEAD_DIM, TMA)
    _write(DV, start, dv, N_K, D, sdvn, BLOCK_N, HEAD_DIM, TMA)
    if RECORD:  # the last launch of a call: its last program folds the call into the ledger
        if _last(FOUND, BH):
            _record(FOUND, COUNTS, CLOCK, LOG, LOGGED, BH, CAPACITY, FIELDS)


# --- backward: dQ -------------------------------------------------------------------------------


@triton.jit
def _dq_tiles(
    dq, qref, dsabs, psum, q, do, lse, delta, offs_m, k_src, v_src, kr_src, INJ, D, skn, svn,
    qk_scale, bh, N_K, lo, hi, first_pass, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, CHECK_S: tl.constexpr, CHECK_P: tl.constexpr,
    CHECK_Q: tl.constexpr, INJECT: tl.constexpr, TMA: tl.constexpr,
):
    """The query block's key tiles ``[lo, hi)``: S = Q K^T, dP = dO V^T, dQ += dS K, with
    dQ's reference and its mass ``|dS| (|K| e)`` accumulated beside it (and in their column
    ONES_COLUMN the rows' sums of dS~ and |dS~|, dS as the MMA takes it), and the partial sums
    of P's rows."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        # keys past the end and padded head dims read as zeros
        k = _read(k_src, start_n, N_K, D, skn, BLOCK_N, HEAD_DIM, TMA)
        v = _read(v_src, start_n, N_K, D, svn, BLOCK_N, HEAD_DIM, TMA)
        s = _mma(q, tl.trans(k), None)
        if INJECT:  # S and dP are computed first in the dK/dV kernel: persistent faults only
            s = _corrupt(s, offs_m[:, None], cols[None, :], bh, BWD_SCORES, False, INJ)
        p = tl.exp2(s * qk_scale - lse[:, None])
        if MASKED:
            visible = cols[None, :] < N_K
            if CAUSAL:
                visible = visible & (cols[None, :] <= offs_m[:, None])
            p = tl.where(visible, p, 0.0)
        dp = _mma(do, tl.trans(v), None)
        if INJECT:
            dp = _corrupt(dp, offs_m[:, None], cols[None, :], bh, GRAD_PROBS, False, INJ)
        ds = p * (dp - delta[:, None])
        ds_lo = _lo(ds, q.dtype)
        dq = _mma(ds_lo, k, dq)
        if INJECT:  # the first tile's dS K: the accumulator holds it alone
            fresh = first_pass & (start_n == 0)
            dq = _corrupt(dq, offs_m[:, None], offs_d[None, :], bh, GRAD_Q, fresh, INJ)
        if CHECK_S or CHECK_P:
            psum = _partial_sums(p, psum)
        if CHECK_P or CHECK_Q:  # (dS K) e = dS (K e), and the mass |dS| (|K| e), unscaled
            w = _read(kr_src, start_n, N_K, W, W, BLOCK_N, W, TMA)
            qref = _mma(ds_lo, w, qref)
            dsabs += _mma(_abs16(ds_lo), w, None)
    return dq, qref, dsabs, psum


@triton.jit
def _dq_pass(
    q, do, qn, don, lse, delta, odo, u_out, offs_m, m_ok, k_src, v_src, kr_src, KRS, VRS, INJ, skn,
    svn, qk_scale, tol, near_inf, bh, N_K, D, first_pass, interior, hi, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, CHECK_S: tl.constexpr,
    CHECK_P: tl.constexpr, CHECK_Q: tl.constexpr, SCALED: tl.constexpr, INJECT: tl.constexpr,
    CALIBRATE: tl.constexpr, TMA: tl.constexpr,
):
    """One pass of a query block over its keys for dQ, and the rows' fault kinds: S through
    sum P = 1, dP through sum dS = 0 (dS as dQ's MMA takes it, summed by that MMA's reference),
    dS K through its accumulated reference. The identities' bounds are made before the loop,
    which then holds two vectors for them."""
    count = tl.cdiv(hi, BLOCK_N)
    tiles = count.to(tl.float32)
    bound_p = tl.zeros([BLOCK_M], tl.float32)
    bound_ds = tl.zeros([BLOCK_M], tl.float32)
    if CHECK_S or CHECK_P:  # sum_n P = 1 within the rounding of S, lse and exp2, with
        # ||k_n|| at most the largest the rows meet
        kmax = _stat_max(KRS, 0, count, 2)
        bound_p = tol * (tiles + 1.0 + tl.abs(lse) + qk_scale * (D + 1.0) * qn * kmax)
    if CHECK_P:
        # sum_n dS = 0 within the rounding of dP, Delta (from the stored O) and P, with
        # |dP_mn| <= ||dO_m|| ||v_n||: the magnitudes of P dP and P Delta, per row; sum P at
        # most 1 + bound_p where the S check passes (a row it flags counts there)
        scale = don * _stat_max(VRS, 0, count, 2) + tl.abs(delta)
        bound_ds = 2.0 * u_out * odo + (tol * (1.0 + bound_p + FLOOR) + bound_p) * scale
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    qref = tl.zeros([BLOCK_M, W], tl.float32)
    dsabs = tl.zeros([BLOCK_M, W], tl.float32)
    psum = tl.zeros([BLOCK_M, 8], tl.float32)  # as _partial_sums add
    dq, qref, dsabs, psum = _dq_tiles(
        dq, qref, dsabs, psum, q, do, lse, delta, offs_m, k_src, v_src, kr_src, INJ, D, skn,
        svn, qk_scale, bh, N_K, 0, interior, first_pass, BLOCK_N, HEAD_DIM, False, CAUSAL,
        CHECK_S, CHECK_P, CHECK_Q, INJECT, TMA,
    )
    dq, qref, dsabs, psum = _dq_tiles(
        dq, qref, dsabs, psum, q, do, lse, delta, offs_m, k_src, v_src, kr_src, INJ, D, skn,
        svn, qk_scale, bh, N_K, interior, hi, first_pass, BLOCK_N, HEAD_DIM, True, CAUSAL,
        CHECK_S, CHECK_P, CHECK_Q, INJECT, TMA,
    )
    state_s = tl.zeros([BLOCK_M], tl.int32)
    state_p = tl.zeros([BLOCK_M], tl.int32)
    state_q = tl.zeros([BLOCK_M], tl.int32)
    ratio_s = tl.zeros([BLOCK_M], tl.float32)
    ratio_p = tl.zeros([BLOCK_M], tl.float32)
    ratio_q = tl.zeros([BLOCK_M], tl.float32)
    none = tl.full([BLOCK_M], -INF, tl.float32)
    psum = tl.sum(psum, 1)
    if CHECK_S:
        worst, ratio_s = _fold(psum, 1.0, bound_p / tol, tol, none, ratio_s, CALIBRATE)
        state_s = tl.where(m_ok, _kinds(worst, near_inf), 0)
    if CHECK_P:  # sum dS~ from dQ's reference MMA: dS rounded to the input dtype (at most
        # 1.01 u_out of sum |dS~|, and fp16's subnormals 2**-25 an element) and accumulated in
        # fp32 as the reference is (tol sqrt(tiles / 16) of the same)
        dsmass = _column(dsabs, ONES_COLUMN)
        growth = tl.maximum(1.0, tl.sqrt(tiles / 16.0))
        mass = bound_ds / tol + (1.01 * u_out / tol + growth) * dsmass
        if q.dtype == tl.float16:
            mass += hi.to(tl.float32) * (2.0**-25 / tol)
        dssum = _column(qref, ONES_COLUMN)
        worst, ratio_p = _fold(dssum, 0.0, mass, tol, none, ratio_p, CALIBRATE)
        state_p = tl.where(m_ok & (state_s == 0), _kinds(worst, near_inf), 0)
    if CHECK_Q:  # the mass |dS| (|K| e), 1% for dS's rounding
        qmass = 1.01 * _columns(dsabs, 3)
        if SCALED:  # K's row sums at its head's scale
            head = tl.load(KRS)
            qref = qref * head
            qmass = qmass * head
        worst, ratio_q = _deferred_check(dq, qref, 0, qmass, tiles, tol, ratio_q, CALIBRATE)
        # a row flagged upstream fails downstream too: it counts once, where it began
        state_q = tl.where(m_ok & (state_s == 0) & (state_p == 0), _kinds(worst, near_inf), 0)
    return dq, state_s, state_p, state_q, ratio_s, ratio_p, ratio_q


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, ODO, DQ, KR, KRS, VRS, FOUND, RATIO, INJ, AGAIN, COUNTS, CLOCK, LOG,
    LOGGED, CAPACITY, FIELDS, qk_scale, sm_scale, tol, u_out, near_inf, sqb, sqh, sqm, skb, skh,
    skn, svb, svh, svn, sdob, sdoh, sdom, sdqb, sdqh, sdqm, H, GROUP, N_Q, N_K, D, ROWS_Q,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, DUE: tl.constexpr, SCALED: tl.constexpr,
    INJECT: tl.constexpr, CALIBRATE: tl.constexpr, RETRY: tl.constexpr, RECORD: tl.constexpr,
    TMA: tl.constexpr,
):
    """dQ of one query block of one (batch, head). ``ODO`` holds ``sum |O| |dO|`` a row, the
    rounding of the stored O in Delta. KR/KRS: K's row sums, VRS: V's row-sum stats, tiled by
    BLOCK_N (checksums.py). AGAIN and RETRY as in _fwd_kernel."""
    CHECK_S: tl.constexpr = (tl.constexpr(DUE) >> BWD_SCORES) & 1 != 0
    CHECK_P: tl.constexpr = (tl.constexpr(DUE) >> GRAD_PROBS) & 1 != 0
    CHECK_Q: tl.constexpr = (tl.constexpr(DUE) >> GRAD_Q) & 1 != 0
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    BH = tl.num_programs(1)
    program = bh * tl.num_programs(0) + pid_m
    if RETRY:
        if tl.load(AGAIN + program) == 0:
            if RECORD:
                if _last(FOUND, BH):
                    _record(FOUND, COUNTS, CLOCK, LOG, LOGGED, BH, CAPACITY, FIELDS)
            return
    b = bh // H
    h = bh % H
    hk = h // GROUP
    bhk = b * (H // GROUP) + hk
    start = pid_m * BLOCK_M
    offs_m = start + tl.arange(0, BLOCK_M)
    m_ok = offs_m < N_Q
    Q += b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
    DO += b.to(tl.int64) * sdob + h.to(tl.int64) * sdoh
    q = _read(_tiles(Q, N_Q, D, sqm, BLOCK_M, HEAD_DIM, TMA), start, N_Q, D, sqm, BLOCK_M,
              HEAD_DIM, TMA)  # fmt: skip
    do = _read(_tiles(DO, N_Q, D, sdom, BLOCK_M, HEAD_DIM, TMA), start, N_Q, D, sdom, BLOCK_M,
               HEAD_DIM, TMA)  # fmt: skip
    at = bh.to(tl.int64) * ROWS_Q + offs_m  # padded: finite past the end
    lse = tl.load(LSE + at)
    delta = tl.load(DELTA + at)
    qn = tl.zeros([BLOCK_M], tl.float32)
    don = tl.zeros([BLOCK_M], tl.float32)
    odo = tl.zeros([BLOCK_M], tl.float32)
    if CHECK_S or CHECK_P:
        qn = _norm(q.to(tl.float32), 1)
    if CHECK_P:
        don = _norm(do.to(tl.float32), 1)
        odo = tl.load(ODO + at)
    K += b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    V += b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    k_src = _tiles(K, N_K, D, skn, BLOCK_N, HEAD_DIM, TMA)
    v_src = _tiles(V, N_K, D, svn, BLOCK_N, HEAD_DIM, TMA)
    TILES_K = tl.cdiv(N_K, BLOCK_N)
    KR += bhk.to(tl.int64) * TILES_K * (BLOCK_N * W)
    KRS += bhk.to(tl.int64) * TILES_K * 3
    VRS += bhk.to(tl.int64) * TILES_K * 3
    kr_src = _tiles(KR, N_K, W, W, BLOCK_N, W, TMA)  # K's row-sum tiles, as K's
    hi = N_K
    interior = (N_K // BLOCK_N) * BLOCK_N
    if CAUSAL:
        hi = tl.minimum(N_K, (pid_m + 1) * BLOCK_M)
        interior = tl.minimum(interior, pid_m * BLOCK_M)
    dq, state_s, state_p, state_q, ratio_s, ratio_p, ratio_q = _dq_pass(
        q, do, qn, don, lse, delta, odo, u_out, offs_m, m_ok, k_src, v_src, kr_src, KRS, VRS, INJ,
        skn, svn, qk_scale, tol, near_inf, bh, N_K, D, not RETRY, interior, hi, BLOCK_M,
        BLOCK_N, HEAD_DIM, CAUSAL, CHECK_S, CHECK_P, CHECK_Q, SCALED, INJECT, CALIBRATE, TMA,
    )
    if CHECK_S or CHECK_P or CHECK_Q:
        outcome: tl.constexpr = 1 + RETRY
        again = _report(
            FOUND, RATIO, BWD_SCORES, bh, BH, state_s, offs_m, ratio_s, m_ok, outcome,
            False, CALIBRATE,
        )
        again |= _report(
            FOUND, RATIO, GRAD_PROBS, bh, BH, state_p, offs_m, ratio_p, m_ok, outcome,
            False, CALIBRATE,
        )
        again |= _report(
            FOUND, RATIO, GRAD_Q, bh, BH, state_q, offs_m, ratio_q, m_ok, outcome,
            False, CALIBRATE,
        )
        if not RETRY:
            tl.store(AGAIN + program, again.to(tl.int32))
    dq = _lo(dq * sm_scale, DQ.dtype.element_ty).to(DQ.dtype.element_ty)
    DQ += b.to(tl.int64) * sdqb + h.to(tl.int64) * sdqh
    _write(DQ, start, dq, N_Q, D, sdqm, BLOCK_M, HEAD_DIM, TMA)
    if RECORD:  # the last launch of a call: its last program folds the call into the ledger
        if _last(FOUND, BH):
            _record(FOUND, COUNTS, CLOCK, LOG, LOGGED, BH, CAPACITY, FIELDS)
