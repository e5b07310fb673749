"""Triton kernels of the protected flash attention: the forward, and the backward as two kernels
(dK/dV, a program per key block; dQ, a program per query block), FA2-style.

Every tile GEMM is checked against a row checksum taken from its inputs (docs/abft.md, "The
flash path"): for ``C = A B`` the kernel compares ``C e`` with ``A (B e)``, the reference a
16-wide MMA of A against ``B e`` split into input-dtype parts (megatron_abft.flash.checksums,
made before the launch), under the bound ``tol * mass``; the mass, a Cauchy-Schwarz or max-norm
bound of ``|A| (|B| e)``, comes from the operands only, so that a corrupted output never widens
its own threshold, and the comparison is written so that NaN flags. Identities over whole rows
cover what the tile checks cannot see: a running checksum of the output and
``1 <= l <= #keys`` in the forward, ``sum P = 1`` and ``sum dS = 0`` in the dQ kernel.

The hot loop only accumulates per-row flags, with no branch and no reduction across warps, so
that it pipelines as the unchecked loop does and keeps its registers. A program that flagged
anything computes its whole block again, once (its query block, or in dK/dV its key block over
every query head of its group): a transient fault is gone the second time, and what is flagged
again is uncorrectable.

Outcomes go to ``CODES [sections, batch * heads]`` (int32, atomic max of ``outcome << 2 | kind``:
outcome 1 corrected, 2 uncorrectable; kind as megatron_abft.check.eec.KINDS), and the first flagged
row and column to ``ROWS``/``COLS`` (as ``NO_ROW - row``, atomic max, so that a zeroed buffer says
none): one matrix a section, on the device, no host synchronisation; a program reports what its
first pass flagged as corrected and what its second flagged as uncorrectable, which the atomic max
lets win.

Constexpr switches compile out what production does not need: ``CHECK`` (all checks),
``INJECT`` (fault injection, megatron_abft.flash.faults) and ``CALIBRATE`` (the largest finite
``|residual| / (u * mass)`` of the checks, for threshold calibration on a GPU). ``UPCAST``
works around Triton's interpreter for bf16: its tl.dot on bf16 is wrong, so tl.dot takes fp32
operands (exact: a product of two bf16 values fits fp32); its fp32 -> bf16 cast truncates, so
the kernels round on the bits (to nearest even, as a GPU does) and keep the value in fp32.
"""

import triton
import triton.language as tl

# Section codes: rows of CODES, bits of ``due``. Order as megatron_abft.config.FLASH_SECTIONS.
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
INF = tl.constexpr(float("inf"))

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
def _mm(a, b, UPCAST: tl.constexpr):
    """a @ b accumulated in fp32 (fp32 operands: in the interpreter only, IEEE there)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _lo(x, dtype: tl.constexpr, UPCAST: tl.constexpr):
    """``x`` (fp32) rounded to ``dtype``, to nearest even: in ``dtype``, or under UPCAST
    (bf16 in the interpreter) as the fp32 value of that bf16."""
    if UPCAST:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


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
def _kind(got, ref, near_inf):
    """Per row: 1 + the fault kind of a residual (megatron_abft.check.eec.KINDS)."""
    r = tl.abs(got - ref)
    return tl.where(r != r, 4, tl.where(r == INF, 3, tl.where(r > near_inf, 2, 1)))


@triton.jit
def _check(got, ref, bound, state, near_inf):
    """Fold a row check into the rows' ``state``: 0 clean, else 1 + the worst fault kind seen.
    Flags where ``|got - ref| <= bound + FLOOR`` fails, NaN included."""
    flagged = ~(tl.abs(got - ref) <= bound + FLOOR)
    return tl.maximum(state, tl.where(flagged, _kind(got, ref, near_inf), 0))


@triton.jit
def _ratio(got, ref, mass, ratio):
    """The rows' largest ``(|got - ref| - FLOOR) / (u * mass)`` so far: the least c each bound
    needed (calibration runs)."""
    needed = tl.maximum(tl.abs(got - ref) - FLOOR, 0.0) / (U32 * tl.maximum(mass, 1e-30))
    return tl.maximum(ratio, needed)


@triton.jit
def _tile_check(tile, ref, mass, tol, state, ratio, near_inf, CALIBRATE: tl.constexpr):
    """A tile GEMM's row check: its row sums against ``ref`` under ``tol * mass``, folded into
    the rows' ``state`` and, in calibration runs, their ``ratio``."""
    got = tl.sum(tile, 1)
    state = _check(got, ref, tol * mass, state, near_inf)
    if CALIBRATE:
        ratio = _ratio(got, ref, mass, ratio)
    return state, ratio


@triton.jit
def _report(
    CODES, ROWS, COLS, RATIO, section: tl.constexpr, bh, BH, state, rows, ratio, outcome,
    TRANSPOSED: tl.constexpr, CALIBRATE: tl.constexpr,
):
    """Publish one pass's outcome for one section of matrix ``bh``: ``state`` per row (tile
    rows ``rows``, logical columns when TRANSPOSED), as ``outcome`` (1 corrected, 2
    uncorrectable). Returns whether anything was flagged."""
    kind = tl.max(state)
    if kind > 0:
        at = section * BH + bh
        tl.atomic_max(CODES + at, (outcome << 2) | (kind - 1))
        first = NO_ROW - tl.min(tl.where(state > 0, rows, NO_ROW))
        if TRANSPOSED:
            tl.atomic_max(COLS + at, first)
        else:
            tl.atomic_max(ROWS + at, first)
    if CALIBRATE:  # flagged rows too (an alarm shows how far it went), bar non-finite ones
        tl.atomic_max(RATIO + section * BH + bh, tl.max(tl.where(ratio < INF, ratio, 0.0)))
    return kind > 0


@triton.jit
def _col_ref(a, W, ST, bhx, tiles, j, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr):
    """``a [R, HEAD_DIM]`` times tile ``j``'s column sums (checksums.columns): ``A (B e)`` of a
    GEMM whose B is that tile, transposed."""
    base = (bhx * tiles + j).to(tl.int64)
    at = (base * HEAD_DIM + tl.arange(0, HEAD_DIM))[:, None] * 16 + tl.arange(0, 16)[None, :]
    return tl.sum(_mm(a, tl.load(W + at), UPCAST), 1) * tl.load(ST + base * 3)


@triton.jit
def _row_ref(a, W, ST, bhx, tiles, j, BLOCK: tl.constexpr, UPCAST: tl.constexpr):
    """``a [R, BLOCK]`` times the row sums of tile ``j`` (checksums.rows): ``A (B e)`` of a GEMM
    whose B is that tile."""
    base = (bhx * tiles + j).to(tl.int64)
    at = (base * BLOCK + tl.arange(0, BLOCK))[:, None] * 16 + tl.arange(0, 16)[None, :]
    return tl.sum(_mm(a, tl.load(W + at), UPCAST), 1) * tl.load(ST + base * 3)


@triton.jit
def _stat(ST, bhx, tiles, j, which: tl.constexpr):
    """Mass ``which`` (1 or 2) of tile ``j`` (checksums.Sums.stats)."""
    return tl.load(ST + (bhx * tiles + j).to(tl.int64) * 3 + which)


@triton.jit
def _norm(x, axis: tl.constexpr):
    return tl.sqrt(tl.sum(x * x, axis))


@triton.jit
def _scores_tile(
    q, qn, K, V, KC, KCS, INJ, cols, offs_m, offs_d, d_ok, bh, bhk, j, skn, skd, svn, svd, N_K,
    TILES_K, tol, near_inf, check, fresh, state, ratio, section: tl.constexpr,
    HEAD_DIM: tl.constexpr, CHECK: tl.constexpr, INJECT: tl.constexpr, CALIBRATE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """A query block's KV tile ``j`` (the forward's and dQ's): K and V loaded, S = Q K^T with its
    row check, ``S e = Q (K^T e)``, folded into the rows' ``state`` (and ``ratio``)."""
    n_ok = cols < N_K
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(K + cols[:, None] * skn + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
    v = tl.load(V + cols[:, None] * svn + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
    s = _mm(q, tl.trans(k), UPCAST)
    if INJECT:
        s = _corrupt(s, offs_m[:, None], cols[None, :], bh, section, fresh, INJ)
    if CHECK:
        if check:
            ref = _col_ref(q, KC, KCS, bhk, TILES_K, j, HEAD_DIM, UPCAST)
            mass = qn * _stat(KCS, bhk, TILES_K, j, 1)
            state, ratio = _tile_check(s, ref, mass, tol, state, ratio, near_inf, CALIBRATE)
    return k, v, s, n_ok, state, ratio


# --- forward ----------------------------------------------------------------------------------


@triton.jit
def _fwd_pass(
    q, qn, offs_m, m_ok, bh, bhk, K, V, KC, KCS, VR, VRS, INJ, qk_scale, tol, near_inf, due,
    first_pass, skn, skd, svn, svd, N_K, D, TILES_K, hi, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, CHECK: tl.constexpr,
    INJECT: tl.constexpr, CALIBRATE: tl.constexpr, UPCAST: tl.constexpr,
):
    """One pass of a query block over its keys: the online softmax and P~V, the rows' states
    of the checks of S (F1, and 1 <= l <= #keys) and of the context (F2, and F3: the running
    checksum ``cs`` of the output against its row sums), and, calibrating, their ratios."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    d_ok = offs_d < D
    m_i = tl.full([BLOCK_M], -INF, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    cs = tl.zeros([BLOCK_M], tl.float32)
    cmass = tl.zeros([BLOCK_M], tl.float32)
    state_s = tl.zeros([BLOCK_M], tl.int32)
    state_c = tl.zeros([BLOCK_M], tl.int32)
    ratio_s = tl.zeros([BLOCK_M], tl.float32)
    ratio_c = tl.zeros([BLOCK_M], tl.float32)
    check_s = ((due >> SCORES) & 1) != 0
    check_c = ((due >> CONTEXT) & 1) != 0
    for start_n in range(0, hi, BLOCK_N):
        j = start_n // BLOCK_N
        cols = start_n + offs_n
        k, v, s, n_ok, state_s, ratio_s = _scores_tile(  # F1: S e = Q (K^T e)
            q, qn, K, V, KC, KCS, INJ, cols, offs_m, offs_d, d_ok, bh, bhk, j, skn, skd, svn, svd,
            N_K, TILES_K, tol, near_inf, check_s, first_pass, state_s, ratio_s, SCORES,
            HEAD_DIM, CHECK, INJECT, CALIBRATE, UPCAST,
        )
        s = s * qk_scale
        visible = n_ok[None, :]
        if CAUSAL:
            visible = visible & (cols[None, :] <= offs_m[:, None])
        s = tl.where(visible, s, -INF)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        psum = tl.sum(p, 1)
        l_i = l_i * alpha + psum
        p_lo = _lo(p, q.dtype, UPCAST)
        pv = _mm(p_lo, v, UPCAST)
        if INJECT:
            fresh = first_pass & (start_n == 0)
            pv = _corrupt(pv, offs_m[:, None], offs_d[None, :], bh, CONTEXT, fresh, INJ)
        if CHECK:
            if check_c:  # F2: (P~ V) e = P~ (V e), P~ rounded as the GEMM takes it (+1%)
                ref = _row_ref(p_lo, VR, VRS, bhk, TILES_K, j, BLOCK_N, UPCAST)
                mass = 1.01 * psum * _stat(VRS, bhk, TILES_K, j, 1)
                state_c, ratio_c = _tile_check(
                    pv, ref, mass, tol, state_c, ratio_c, near_inf, CALIBRATE
                )
                cs = cs * alpha + ref
                cmass = cmass * alpha + mass
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if CHECK:
        if check_c:  # F3, its bound grown with the tiles summed
            tiles = tl.cdiv(hi, BLOCK_N).to(tl.float32)
            bound = tol * tl.maximum(1.0, tl.sqrt(tiles / 16.0)) * cmass
            state_c = tl.where(m_ok, _check(tl.sum(acc, 1), cs, bound, state_c, near_inf), 0)
        if check_s:  # 1 <= l <= #keys: the row's largest term is exp2(0) = 1
            keys = tl.full([BLOCK_M], N_K, tl.int32)
            if CAUSAL:
                keys = tl.minimum(keys, offs_m + 1)
            inside = tl.minimum(tl.maximum(l_i, 1.0 - 1e-3), keys * (1.0 + 1e-3))
            state_s = tl.where(m_ok, _check(l_i, inside, 0.0, state_s, near_inf), 0)
    # a row flagged in S fails downstream too: it counts once, in S
    return acc, m_i, l_i, state_s, tl.where(state_s > 0, 0, state_c), ratio_s, ratio_c


@triton.jit
def _fwd_kernel(
    Q, K, V, OUT, LSE, KC, KCS, VR, VRS, CODES, ROWS, COLS, RATIO, INJ, qk_scale, tol, near_inf,
    due, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod, H, GROUP,
    N_Q, N_K, D, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr, CHECK: tl.constexpr, INJECT: tl.constexpr, CALIBRATE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """O = softmax(scale Q K^T) V for one query block of one (batch, head); LSE in log2 units.
    KC/KCS: K's column sums, VR/VRS: V's row sums, tiled by BLOCK_N (checksums.py)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    BH = tl.num_programs(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    hk = h // GROUP
    bhk = b * (H // GROUP) + hk
    hk = hk.to(tl.int64)
    h = h.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_ok = offs_m < N_Q
    mask = m_ok[:, None] & (offs_d < D)[None, :]
    q = tl.load(
        Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask=mask, other=0.0
    )
    K += b * skb + hk * skh
    V += b * svb + hk * svh
    qn = _norm(q.to(tl.float32), 1)
    TILES_K = tl.cdiv(N_K, BLOCK_N)
    hi = N_K
    if CAUSAL:
        hi = tl.minimum(N_K, (pid_m + 1) * BLOCK_M)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    m_i = tl.zeros([BLOCK_M], tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    again = N_Q >= 0
    for attempt in range(0, 1 + CHECK):  # the second: the block again, if the first flagged
        if again:
            acc, m_i, l_i, state_s, state_c, ratio_s, ratio_c = _fwd_pass(
                q, qn, offs_m, m_ok, bh, bhk, K, V, KC, KCS, VR, VRS, INJ, qk_scale, tol, near_inf,
                due, attempt == 0, skn, skd, svn, svd, N_K, D, TILES_K, hi, BLOCK_M, BLOCK_N,
                HEAD_DIM, CAUSAL, CHECK, INJECT, CALIBRATE, UPCAST,
            )
            if CHECK:
                again = _report(
                    CODES, ROWS, COLS, RATIO, SCORES, bh, BH, state_s, offs_m, ratio_s, 1 + attempt,
                    False, CALIBRATE,
                )
                again |= _report(
                    CODES, ROWS, COLS, RATIO, CONTEXT, bh, BH, state_c, offs_m, ratio_c,
                    1 + attempt, False, CALIBRATE,
                )
    o = acc / l_i[:, None]
    tl.store(
        OUT + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod,
        _lo(o, OUT.dtype.element_ty, UPCAST).to(OUT.dtype.element_ty),
        mask=mask,
    )
    tl.store(LSE + bh.to(tl.int64) * N_Q + offs_m, m_i + tl.log2(l_i), mask=m_ok)


# --- backward: dK and dV ------------------------------------------------------------------------


@triton.jit
def _dkdv_pass(
    k, v, kn, vn, offs_n, n_ok, b, hk, Q, DO, LSE, DELTA, QC, QCS, QR, QRS, DOC, DOCS, DOR, DORS,
    CODES, ROWS, COLS, RATIO, INJ, qk_scale, tol, near_inf, due, first_pass, outcome, BH, sqb, sqh,
    sqm, sqd, sdob, sdoh, sdom, sdod, H, GROUP, N_Q, D, TILES_Q, lo, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, CHECK: tl.constexpr,
    INJECT: tl.constexpr, CALIBRATE: tl.constexpr, UPCAST: tl.constexpr,
):
    """One pass of a key block over the queries of every head of its group: dK, dV, each
    tile checked; each head's states are reported as ``outcome``. Returns dK (unscaled), dV
    and whether anything was flagged."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_mb = tl.arange(0, BLOCK_M)
    d_ok = offs_d < D
    b64 = b.to(tl.int64)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    flagged = N_Q < 0  # False, as a scalar the loop can carry
    check_s = ((due >> BWD_SCORES) & 1) != 0
    check_p = ((due >> GRAD_PROBS) & 1) != 0
    check_v = ((due >> GRAD_V) & 1) != 0
    check_k = ((due >> GRAD_K) & 1) != 0
    for g in range(0, GROUP):
        h = hk * GROUP + g
        bh = b * H + h.to(tl.int32)
        Qh = Q + b64 * sqb + h * sqh
        DOh = DO + b64 * sdob + h * sdoh
        state_s = tl.zeros([BLOCK_N], tl.int32)
        state_p = tl.zeros([BLOCK_N], tl.int32)
        state_v = tl.zeros([BLOCK_N], tl.int32)
        state_k = tl.zeros([BLOCK_N], tl.int32)
        ratio_s = tl.zeros([BLOCK_N], tl.float32)
        ratio_p = tl.zeros([BLOCK_N], tl.float32)
        ratio_v = tl.zeros([BLOCK_N], tl.float32)
        ratio_k = tl.zeros([BLOCK_N], tl.float32)
        for start_m in range(lo, N_Q, BLOCK_M):
            i = start_m // BLOCK_M
            offs_m = start_m + offs_mb
            m_ok = offs_m < N_Q
            q_mask = m_ok[:, None] & d_ok[None, :]
            q = tl.load(Qh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask=q_mask, other=0.0)
            do = tl.load(
                DOh + offs_m[:, None] * sdom + offs_d[None, :] * sdod, mask=q_mask, other=0.0
            )
            lse = tl.load(LSE + bh.to(tl.int64) * N_Q + offs_m, mask=m_ok, other=0.0)
            delta = tl.load(DELTA + bh.to(tl.int64) * N_Q + offs_m, mask=m_ok, other=0.0)
            fresh = first_pass & (start_m == lo)
            # S^T = K Q^T: S^T e = K (Q^T e)
            st = _mm(k, tl.trans(q), UPCAST)
            if INJECT:
                st = _corrupt(st, offs_m[None, :], offs_n[:, None], bh, BWD_SCORES, first_pass, INJ)
            if CHECK:
                if check_s:
                    ref = _col_ref(k, QC, QCS, bh, TILES_Q, i, HEAD_DIM, UPCAST)
                    mass = kn * _stat(QCS, bh, TILES_Q, i, 1)
                    state_s, ratio_s = _tile_check(
                        st, ref, mass, tol, state_s, ratio_s, near_inf, CALIBRATE
                    )
            visible = n_ok[:, None] & m_ok[None, :]
            if CAUSAL:
                visible = visible & (offs_m[None, :] >= offs_n[:, None])
            pt = tl.where(visible, tl.exp2(st * qk_scale - lse[None, :]), 0.0)
            pt_lo = _lo(pt, q.dtype, UPCAST)
            # dV += P^T dO: (P^T dO) e = P^T (dO e)
            part = _mm(pt_lo, do, UPCAST)
            if INJECT:
                part = _corrupt(part, offs_n[:, None], offs_d[None, :], bh, GRAD_V, fresh, INJ)
            if CHECK:
                if check_v:
                    ref = _row_ref(pt_lo, DOR, DORS, bh, TILES_Q, i, BLOCK_M, UPCAST)
                    mass = 1.01 * tl.sum(pt, 1) * _stat(DORS, bh, TILES_Q, i, 1)
                    state_v, ratio_v = _tile_check(
                        part, ref, mass, tol, state_v, ratio_v, near_inf, CALIBRATE
                    )
            dv += part
            # dP^T = V dO^T: dP^T e = V (dO^T e)
            dpt = _mm(v, tl.trans(do), UPCAST)
            if INJECT:
                dpt = _corrupt(
                    dpt, offs_m[None, :], offs_n[:, None], bh, GRAD_PROBS, first_pass, INJ
                )
            if CHECK:
                if check_p:
                    ref = _col_ref(v, DOC, DOCS, bh, TILES_Q, i, HEAD_DIM, UPCAST)
                    mass = vn * _stat(DOCS, bh, TILES_Q, i, 1)
                    state_p, ratio_p = _tile_check(
                        dpt, ref, mass, tol, state_p, ratio_p, near_inf, CALIBRATE
                    )
            dst = pt * (dpt - delta[None, :])
            dst_lo = _lo(dst, q.dtype, UPCAST)
            # dK += dS^T Q: (dS^T Q) e = dS^T (Q e)
            part = _mm(dst_lo, q, UPCAST)
            if INJECT:
                part = _corrupt(part, offs_n[:, None], offs_d[None, :], bh, GRAD_K, fresh, INJ)
            if CHECK:
                if check_k:
                    ref = _row_ref(dst_lo, QR, QRS, bh, TILES_Q, i, BLOCK_M, UPCAST)
                    mass = 1.01 * tl.sum(tl.abs(dst), 1) * _stat(QRS, bh, TILES_Q, i, 1)
                    state_k, ratio_k = _tile_check(
                        part, ref, mass, tol, state_k, ratio_k, near_inf, CALIBRATE
                    )
            dk += part
        if CHECK:
            # a key row flagged upstream fails downstream too: it counts once, where it began
            state_v = tl.where(state_s > 0, 0, state_v)
            state_k = tl.where((state_s > 0) | (state_p > 0), 0, state_k)
            flagged |= _report(
                CODES, ROWS, COLS, RATIO, BWD_SCORES, bh, BH, state_s, offs_n, ratio_s, outcome,
                True, CALIBRATE,
            )
            flagged |= _report(
                CODES, ROWS, COLS, RATIO, GRAD_PROBS, bh, BH, state_p, offs_n, ratio_p, outcome,
                True, CALIBRATE,
            )
            flagged |= _report(
                CODES, ROWS, COLS, RATIO, GRAD_V, bh, BH, state_v, offs_n, ratio_v, outcome, False,
                CALIBRATE,
            )
            flagged |= _report(
                CODES, ROWS, COLS, RATIO, GRAD_K, bh, BH, state_k, offs_n, ratio_k, outcome, False,
                CALIBRATE,
            )
    return dk, dv, flagged


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, QC, QCS, QR, QRS, DOC, DOCS, DOR, DORS, CODES, ROWS, COLS,
    RATIO, INJ, qk_scale, sm_scale, tol, near_inf, due, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb,
    svh, svn, svd, sdob, sdoh, sdom, sdod, sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd, H, GROUP,
    N_Q, N_K, D, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr, CHECK: tl.constexpr, INJECT: tl.constexpr, CALIBRATE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """dK and dV of one key block of one (batch, KV head), over the query heads of its group:
    S^T = K Q^T, dV += P^T dO, dP^T = V dO^T, dK += dS^T Q, each tile checked. QC/QR and
    DOC/DOR: the column and row sums of Q and dO, tiled by BLOCK_M (checksums.py)."""
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    HKV = H // GROUP
    BH = tl.num_programs(1) * GROUP
    b = bhk // HKV
    hk = (bhk % HKV).to(tl.int64)
    b64 = b.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    n_ok = offs_n < N_K
    kv_mask = n_ok[:, None] & (offs_d < D)[None, :]
    k = tl.load(
        K + b64 * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :] * skd,
        mask=kv_mask,
        other=0.0,
    )
    v = tl.load(
        V + b64 * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :] * svd,
        mask=kv_mask,
        other=0.0,
    )
    kn = _norm(k.to(tl.float32), 1)
    vn = _norm(v.to(tl.float32), 1)
    TILES_Q = tl.cdiv(N_Q, BLOCK_M)
    lo = 0
    if CAUSAL:
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    again = N_Q >= 0
    for attempt in range(0, 1 + CHECK):  # the second: the block again, if the first flagged
        if again:
            dk, dv, again = _dkdv_pass(
                k, v, kn, vn, offs_n, n_ok, b, hk, Q, DO, LSE, DELTA, QC, QCS, QR, QRS, DOC, DOCS,
                DOR, DORS, CODES, ROWS, COLS, RATIO, INJ, qk_scale, tol, near_inf, due,
                attempt == 0, 1 + attempt, BH, sqb, sqh, sqm, sqd, sdob, sdoh, sdom, sdod, H, GROUP,
                N_Q, D, TILES_Q, lo, BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, CHECK, INJECT, CALIBRATE,
                UPCAST,
            )
    tl.store(
        DK + b64 * sdkb + hk * sdkh + offs_n[:, None] * sdkn + offs_d[None, :] * sdkd,
        _lo(dk * sm_scale, DK.dtype.element_ty, UPCAST).to(DK.dtype.element_ty),
        mask=kv_mask,
    )
    tl.store(
        DV + b64 * sdvb + hk * sdvh + offs_n[:, None] * sdvn + offs_d[None, :] * sdvd,
        _lo(dv, DV.dtype.element_ty, UPCAST).to(DV.dtype.element_ty),
        mask=kv_mask,
    )


# --- backward: dQ -------------------------------------------------------------------------------


@triton.jit
def _dq_pass(
    q, do, qn, don, lse, delta, odo, u_out, offs_m, m_ok, bh, bhk, K, V, KC, KCS, KR, KRS, VC, VCS,
    INJ, qk_scale, tol, near_inf, due, first_pass, skn, skd, svn, svd, N_K, D, TILES_K, hi,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
    CHECK: tl.constexpr, INJECT: tl.constexpr, CALIBRATE: tl.constexpr, UPCAST: tl.constexpr,
):
    """One pass of a query block over its keys for dQ: S = Q K^T, dP = dO V^T, dQ += dS K, each
    tile checked, and the row identities sum P = 1 and sum dS = 0 (B2) folded into the states
    of S and dP."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    d_ok = offs_d < D
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    psum = tl.zeros([BLOCK_M], tl.float32)
    dssum = tl.zeros([BLOCK_M], tl.float32)
    kmax = 0.0
    vmax = 0.0
    state_s = tl.zeros([BLOCK_M], tl.int32)
    state_p = tl.zeros([BLOCK_M], tl.int32)
    state_q = tl.zeros([BLOCK_M], tl.int32)
    ratio_s = tl.zeros([BLOCK_M], tl.float32)
    ratio_p = tl.zeros([BLOCK_M], tl.float32)
    ratio_q = tl.zeros([BLOCK_M], tl.float32)
    check_s = ((due >> BWD_SCORES) & 1) != 0
    check_p = ((due >> GRAD_PROBS) & 1) != 0
    check_q = ((due >> GRAD_Q) & 1) != 0
    for start_n in range(0, hi, BLOCK_N):
        j = start_n // BLOCK_N
        cols = start_n + offs_n
        k, v, s, n_ok, state_s, ratio_s = _scores_tile(
            q, qn, K, V, KC, KCS, INJ, cols, offs_m, offs_d, d_ok, bh, bhk, j, skn, skd, svn, svd,
            N_K, TILES_K, tol, near_inf, check_s, False, state_s, ratio_s, BWD_SCORES,
            HEAD_DIM, CHECK, INJECT, CALIBRATE, UPCAST,
        )
        visible = n_ok[None, :] & m_ok[:, None]
        if CAUSAL:
            visible = visible & (cols[None, :] <= offs_m[:, None])
        p = tl.where(visible, tl.exp2(s * qk_scale - lse[:, None]), 0.0)
        dp = _mm(do, tl.trans(v), UPCAST)
        if INJECT:
            dp = _corrupt(dp, offs_m[:, None], cols[None, :], bh, GRAD_PROBS, False, INJ)
        if CHECK:
            if check_p:
                ref = _col_ref(do, VC, VCS, bhk, TILES_K, j, HEAD_DIM, UPCAST)
                mass = don * _stat(VCS, bhk, TILES_K, j, 1)
                state_p, ratio_p = _tile_check(
                    dp, ref, mass, tol, state_p, ratio_p, near_inf, CALIBRATE
                )
        ds = p * (dp - delta[:, None])
        ds_lo = _lo(ds, q.dtype, UPCAST)
        part = _mm(ds_lo, k, UPCAST)
        if INJECT:
            fresh = first_pass & (start_n == 0)
            part = _corrupt(part, offs_m[:, None], offs_d[None, :], bh, GRAD_Q, fresh, INJ)
        if CHECK:
            if check_s | check_p:  # the row identities' sums
                psum += tl.sum(p, 1)
                dssum += tl.sum(ds, 1)
                kmax = tl.maximum(kmax, _stat(KCS, bhk, TILES_K, j, 2))
                if check_p:
                    vmax = tl.maximum(vmax, _stat(VCS, bhk, TILES_K, j, 2))
            if check_q:
                ref = _row_ref(ds_lo, KR, KRS, bhk, TILES_K, j, BLOCK_N, UPCAST)
                mass = 1.01 * tl.sum(tl.abs(ds), 1) * _stat(KRS, bhk, TILES_K, j, 1)
                state_q, ratio_q = _tile_check(
                    part, ref, mass, tol, state_q, ratio_q, near_inf, CALIBRATE
                )
        dq += part
    if CHECK:
        # B2: sum_n P = 1 within the rounding of S, lse and exp2; sum_n dS = 0 within that of
        # dP, Delta (from the stored O) and P
        tiles = tl.cdiv(hi, BLOCK_N).to(tl.float32)
        bound_p = tol * (tiles + 1.0 + tl.abs(lse) + qk_scale * (D + 1.0) * qn * kmax)
        if check_s:
            state_s = tl.where(m_ok, _check(psum, 1.0, bound_p, state_s, near_inf), 0)
        if check_p:
            # |dP_mn| <= ||dO_m|| ||v_n||: the magnitudes of P dP and P Delta, per row
            scale = don * vmax + tl.abs(delta)
            bound_ds = 2.0 * u_out * odo + (tol * psum + bound_p) * scale
            state_p = tl.where(m_ok, _check(dssum, 0.0, bound_ds, state_p, near_inf), 0)
    # a row flagged upstream fails downstream too: it counts once, where it began
    state_p = tl.where(state_s > 0, 0, state_p)
    state_q = tl.where((state_s > 0) | (state_p > 0), 0, state_q)
    return dq, state_s, state_p, state_q, ratio_s, ratio_p, ratio_q


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, ODO, DQ, KC, KCS, KR, KRS, VC, VCS, CODES, ROWS, COLS, RATIO, INJ,
    qk_scale, sm_scale, tol, u_out, near_inf, due, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh,
    svn, svd, sdob, sdoh, sdom, sdod, sdqb, sdqh, sdqm, sdqd, H, GROUP, N_Q, N_K, D,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
    CHECK: tl.constexpr, INJECT: tl.constexpr, CALIBRATE: tl.constexpr, UPCAST: tl.constexpr,
):
    """dQ of one query block of one (batch, head). ``ODO`` holds ``sum |O| |dO|`` a row, the
    rounding of the stored O in Delta. KC/KR: K's column and row sums, VC: V's column sums,
    tiled by BLOCK_N (checksums.py)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    BH = tl.num_programs(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    hk = h // GROUP
    bhk = b * (H // GROUP) + hk
    hk = hk.to(tl.int64)
    h = h.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_ok = offs_m < N_Q
    mask = m_ok[:, None] & (offs_d < D)[None, :]
    q = tl.load(
        Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask=mask, other=0.0
    )
    do = tl.load(
        DO + b * sdob + h * sdoh + offs_m[:, None] * sdom + offs_d[None, :] * sdod,
        mask=mask,
        other=0.0,
    )
    row = bh.to(tl.int64) * N_Q + offs_m
    lse = tl.load(LSE + row, mask=m_ok, other=0.0)
    delta = tl.load(DELTA + row, mask=m_ok, other=0.0)
    odo = tl.load(ODO + row, mask=m_ok, other=0.0)
    K += b * skb + hk * skh
    V += b * svb + hk * svh
    qn = _norm(q.to(tl.float32), 1)
    don = _norm(do.to(tl.float32), 1)
    TILES_K = tl.cdiv(N_K, BLOCK_N)
    hi = N_K
    if CAUSAL:
        hi = tl.minimum(N_K, (pid_m + 1) * BLOCK_M)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    again = N_Q >= 0
    for attempt in range(0, 1 + CHECK):  # the second: the block again, if the first flagged
        if again:
            dq, state_s, state_p, state_q, ratio_s, ratio_p, ratio_q = _dq_pass(
                q, do, qn, don, lse, delta, odo, u_out, offs_m, m_ok, bh, bhk, K, V, KC, KCS, KR,
                KRS, VC, VCS, INJ, qk_scale, tol, near_inf, due, attempt == 0, skn, skd, svn, svd,
                N_K, D, TILES_K, hi, BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, CHECK, INJECT, CALIBRATE,
                UPCAST,
            )
            if CHECK:
                again = _report(
                    CODES, ROWS, COLS, RATIO, BWD_SCORES, bh, BH, state_s, offs_m, ratio_s,
                    1 + attempt, False, CALIBRATE,
                )
                again |= _report(
                    CODES, ROWS, COLS, RATIO, GRAD_PROBS, bh, BH, state_p, offs_m, ratio_p,
                    1 + attempt, False, CALIBRATE,
                )
                again |= _report(
                    CODES, ROWS, COLS, RATIO, GRAD_Q, bh, BH, state_q, offs_m, ratio_q, 1 + attempt,
                    False, CALIBRATE,
                )
    tl.store(
        DQ + b * sdqb + h * sdqh + offs_m[:, None] * sdqm + offs_d[None, :] * sdqd,
        _lo(dq * sm_scale, DQ.dtype.element_ty, UPCAST).to(DQ.dtype.element_ty),
        mask=mask,
    )


# --- backward: Delta ------------------------------------------------------------------------------


@triton.jit
def _delta_kernel(
    OUT, DO, DELTA, ODO, sob, soh, som, sod, sdob, sdoh, sdom, sdod, H, N_Q, D,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, WITH_ODO: tl.constexpr,
):
    """Delta = rowsum(dO * O) for one query block of one (batch, head), and with WITH_ODO
    ``sum |dO| |O|`` a row, the rounding of the stored O in Delta (the dQ kernel's bound of
    sum dS = 0); fp32, ``[batch * heads, seq]``."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_ok = offs_m < N_Q
    mask = m_ok[:, None] & (offs_d < D)[None, :]
    o = tl.load(OUT + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod,
                mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + b * sdob + h * sdoh + offs_m[:, None] * sdom + offs_d[None, :] * sdod,
                 mask=mask, other=0.0).to(tl.float32)
    row = bh.to(tl.int64) * N_Q + offs_m
    tl.store(DELTA + row, tl.sum(o * do, 1), mask=m_ok)
    if WITH_ODO:
        tl.store(ODO + row, tl.sum(tl.abs(o) * tl.abs(do), 1), mask=m_ok)
