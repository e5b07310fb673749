"""Triton kernels of the protected flash attention: the forward, and the backward as two kernels
(dK/dV, a program per key block; dQ, a program per query block), FA2-style.

Every tile GEMM is checked against a row checksum taken from its inputs (docs/abft.md, "The
flash path"): for ``C = A B`` the kernel compares ``C e`` with ``A (B e)`` under the bound
``tol * mass``, the mass a Cauchy-Schwarz or max-norm bound of ``|A| (|B| e)`` taken from the
operands only, so that a corrupted output never widens its own threshold; the comparison is
written so that NaN flags. A flagged tile is recomputed with its reference; one still flagged is
uncorrectable. Identities over whole rows cover what the tile checks cannot see: a running
checksum of the output and ``1 <= l <= #keys`` in the forward, ``sum P = 1`` and ``sum dS = 0``
in the dQ kernel; a row that breaks one is recomputed whole (the row block), once.

Outcomes go to ``CODES [sections, batch * heads]`` (int32, atomic max of
``outcome << 2 | kind``: outcome 1 corrected, 2 uncorrectable; kind as megatron_abft.eec.KINDS),
and the first flagged row and column to ``ROWS``/``COLS`` (atomic min): one matrix a section, on
the device, no host synchronisation. Constexpr switches compile out what production does not
need: ``CHECK`` (all checks), ``INJECT`` (fault injection, megatron_abft.flash.faults) and
``CALIBRATE`` (the largest ``|residual| / (u * mass)`` of clean checks, for threshold
calibration on a GPU). ``UPCAST`` makes tl.dot take fp32 operands, for Triton's interpreter,
whose bf16 tl.dot is wrong (exact: a product of two bf16 values fits fp32).
"""

import triton
import triton.language as tl

# fmt: off  (kernel arguments stay grouped by role, a line a group)

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
    """a @ b accumulated in fp32; fp32 operands in IEEE fp32, not TF32, so that the checks'
    fp32 rounding bound holds."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _corrupt(x, rows, cols, bh, section: tl.constexpr, fresh, INJ):
    """``x`` with the armed fault landed where it hits: tile elements whose logical ``rows`` and
    ``cols`` (2-d, broadcastable) lie in its region, in its section and (batch, head). A
    transient fault hits the first computation of an element only (``fresh``), a persistent one
    every computation, recomputations included."""
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
def _flags(got, ref, bound):
    """Per row: whether ``got`` is outside ``ref +- bound``. NaN anywhere flags."""
    return ~(tl.abs(got - ref) <= bound)


@triton.jit
def _kind(got, ref, near_inf):
    """Per row: the fault kind of a residual (index into megatron_abft.eec.KINDS)."""
    r = tl.abs(got - ref)
    return tl.where(r != r, 3, tl.where(r == INF, 2, tl.where(r > near_inf, 1, 0)))


@triton.jit
def _outcome(bad, kinds, still_bad, rows, code, first):
    """Fold one check's result into a program's running ``code`` and first flagged row: the
    rows ``bad`` flagged with ``kinds``, of which ``still_bad`` survived the recompute."""
    kind = tl.max(tl.where(bad, kinds, 0))
    outcome = tl.where(tl.max(still_bad.to(tl.int32)) > 0, 2, 1)
    code = tl.maximum(code, (outcome << 2) | kind)
    first = tl.minimum(first, tl.min(tl.where(bad, rows, NO_ROW)))
    return code, first


@triton.jit
def _report(CODES, ROWS, COLS, section: tl.constexpr, bh, BH, code, row, col):
    """Publish a program's outcome for one section (nothing when it found nothing)."""
    if code > 0:
        tl.atomic_max(CODES + section * BH + bh, code)
        tl.atomic_min(ROWS + section * BH + bh, row)
        tl.atomic_min(COLS + section * BH + bh, col)


@triton.jit
def _calibrate(RATIO, section: tl.constexpr, bh, BH, got, ref, mass):
    """Record the largest ``|got - ref| / (u * mass)`` of a clean check (calibration runs)."""
    ratio = tl.abs(got - ref) / (U32 * tl.maximum(mass, 1e-30))
    tl.atomic_max(RATIO + section * BH + bh, tl.max(ratio))


@triton.jit
def _checked_mm(
    a,
    b,
    ref,
    mass,
    r2,
    c2,
    rows,
    bh,
    fresh,
    check,
    code,
    first,
    tol,
    near_inf,
    INJ,
    RATIO,
    BH,
    section: tl.constexpr,
    CHECK: tl.constexpr,
    INJECT: tl.constexpr,
    CALIBRATE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """``a @ b`` (fp32) with its row check against ``ref`` under ``tol * mass``: a flagged tile
    is recomputed once; ``code`` and ``first`` (the first flagged row among ``rows``) fold in
    the outcome. ``r2``/``c2`` are the tile's logical rows and columns, where a fault lands."""
    c = _mm(a, b, UPCAST)
    if INJECT:
        c = _corrupt(c, r2, c2, bh, section, fresh, INJ)
    if CHECK:
        if check:
            got = tl.sum(c, 1)
            bad = _flags(got, ref, tol * mass)
            if tl.max(bad.to(tl.int32)) > 0:
                kinds = _kind(got, ref, near_inf)
                c = _mm(a, b, UPCAST)
                if INJECT:
                    c = _corrupt(c, r2, c2, bh, section, False, INJ)
                still = _flags(tl.sum(c, 1), ref, tol * mass)
                code, first = _outcome(bad, kinds, still, rows, code, first)
            elif CALIBRATE:
                _calibrate(RATIO, section, bh, BH, got, ref, mass)
    return c, code, first


@triton.jit
def _norm(x, axis: tl.constexpr):
    return tl.sqrt(tl.sum(x * x, axis))


# --- forward ----------------------------------------------------------------------------------


@triton.jit
def _fwd_rows(
    q,
    qn,
    offs_m,
    bh,
    K,
    V,
    INJ,
    RATIO,
    BH,
    qk_scale,
    tol,
    near_inf,
    due,
    first_pass,
    skn,
    skd,
    svn,
    svd,
    N_K,
    D,
    hi,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    CHECK: tl.constexpr,
    INJECT: tl.constexpr,
    CALIBRATE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One pass of a query block over its keys: the online softmax and P~V, each tile GEMM
    checked (S: F1; P~V: F2), and the running checksum ``cs`` of the output with its mass (F3)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    d_ok = offs_d < D
    m_i = tl.full([BLOCK_M], -INF, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    cs = tl.zeros([BLOCK_M], tl.float32)
    cmass = tl.zeros([BLOCK_M], tl.float32)
    code_s = 0
    code_c = 0
    row_s = NO_ROW
    row_c = NO_ROW
    check_s = ((due >> SCORES) & 1) != 0
    check_c = ((due >> CONTEXT) & 1) != 0
    q32 = q.to(tl.float32)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        n_ok = cols < N_K
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(K + cols[:, None] * skn + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
        v = tl.load(V + cols[:, None] * svn + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
        # F1: S e = Q (K^T e)
        ref = tl.zeros([BLOCK_M], tl.float32)
        mass = tl.zeros([BLOCK_M], tl.float32)
        if CHECK:
            if check_s:
                k32 = k.to(tl.float32)
                ref = tl.sum(q32 * tl.sum(k32, 0)[None, :], 1)
                mass = qn * _norm(tl.sum(tl.abs(k32), 0), 0)
        s, code_s, row_s = _checked_mm(
            q,
            tl.trans(k),
            ref,
            mass,
            offs_m[:, None],
            cols[None, :],
            offs_m,
            bh,
            first_pass,
            check_s,
            code_s,
            row_s,
            tol,
            near_inf,
            INJ,
            RATIO,
            BH,
            SCORES,
            CHECK,
            INJECT,
            CALIBRATE,
            UPCAST,
        )
        s = s * qk_scale
        visible = n_ok[None, :]
        if CAUSAL:
            visible = visible & (cols[None, :] <= offs_m[:, None])
        s = tl.where(visible, s, -INF)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p_lo = p.to(q.dtype)
        # F2: (P~ V) e = P~ (V e), P~ rounded as the GEMM takes it
        if CHECK:
            if check_c:
                v32 = v.to(tl.float32)
                p32 = p_lo.to(tl.float32)
                ref = tl.sum(p32 * tl.sum(v32, 1)[None, :], 1)
                mass = tl.sum(p32, 1) * tl.max(tl.sum(tl.abs(v32), 1), 0)
        pv, code_c, row_c = _checked_mm(
            p_lo,
            v,
            ref,
            mass,
            offs_m[:, None],
            offs_d[None, :],
            offs_m,
            bh,
            first_pass & (start_n == 0),
            check_c,
            code_c,
            row_c,
            tol,
            near_inf,
            INJ,
            RATIO,
            BH,
            CONTEXT,
            CHECK,
            INJECT,
            CALIBRATE,
            UPCAST,
        )
        cs = cs * alpha + ref
        cmass = cmass * alpha + mass
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i, cs, cmass, code_s, code_c, row_s, row_c


@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    OUT,
    LSE,
    CODES,
    ROWS,
    COLS,
    RATIO,
    INJ,
    qk_scale,
    tol,
    near_inf,
    due,
    sqb,
    sqh,
    sqm,
    sqd,
    skb,
    skh,
    skn,
    skd,
    svb,
    svh,
    svn,
    svd,
    sob,
    soh,
    som,
    sod,
    H,
    GROUP,
    N_Q,
    N_K,
    D,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    CHECK: tl.constexpr,
    INJECT: tl.constexpr,
    CALIBRATE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """O = softmax(scale Q K^T) V for one query block of one (batch, head); LSE in log2 units."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    BH = tl.num_programs(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    hk = (h // GROUP).to(tl.int64)
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
    hi = N_K
    if CAUSAL:
        hi = tl.minimum(N_K, (pid_m + 1) * BLOCK_M)
    acc, m_i, l_i, cs, cmass, code_s, code_c, row_s, row_c = _fwd_rows(
        q,
        qn,
        offs_m,
        bh,
        K,
        V,
        INJ,
        RATIO,
        BH,
        qk_scale,
        tol,
        near_inf,
        due,
        True,
        skn,
        skd,
        svn,
        svd,
        N_K,
        D,
        hi,
        BLOCK_M,
        BLOCK_N,
        HEAD_DIM,
        CAUSAL,
        CHECK,
        INJECT,
        CALIBRATE,
        UPCAST,
    )
    if CHECK:
        # F3: the running checksum against the output's row sums, and 1 <= l <= #keys; a row
        # that breaks either is recomputed whole, once
        tiles = tl.cdiv(hi, BLOCK_N).to(tl.float32)
        check_c = ((due >> CONTEXT) & 1) != 0
        check_s = ((due >> SCORES) & 1) != 0
        keys = tl.full([BLOCK_M], N_K, tl.int32)
        if CAUSAL:
            keys = tl.minimum(keys, offs_m + 1)
        bound3 = tol * tl.maximum(1.0, tl.sqrt(tiles / 16.0)) * cmass
        bad3 = _flags(tl.sum(acc, 1), cs, bound3) & m_ok & check_c
        bad_l = ~((l_i >= 1.0 - 1e-3) & (l_i <= keys * (1.0 + 1e-3))) & m_ok & check_s
        if tl.max((bad3 | bad_l).to(tl.int32)) > 0:
            kinds3 = _kind(tl.sum(acc, 1), cs, near_inf)
            kinds_l = _kind(l_i, 0.0, near_inf)
            acc, m_i, l_i, cs, cmass, code_s2, code_c2, row_s2, row_c2 = _fwd_rows(
                q,
                qn,
                offs_m,
                bh,
                K,
                V,
                INJ,
                RATIO,
                BH,
                qk_scale,
                tol,
                near_inf,
                due,
                False,
                skn,
                skd,
                svn,
                svd,
                N_K,
                D,
                hi,
                BLOCK_M,
                BLOCK_N,
                HEAD_DIM,
                CAUSAL,
                CHECK,
                INJECT,
                CALIBRATE,
                UPCAST,
            )
            still3 = _flags(tl.sum(acc, 1), cs, bound3) & m_ok & check_c
            still_l = ~((l_i >= 1.0 - 1e-3) & (l_i <= keys * (1.0 + 1e-3))) & m_ok & check_s
            code_s = tl.maximum(code_s, code_s2)
            code_c = tl.maximum(code_c, code_c2)
            row_s = tl.minimum(row_s, row_s2)
            row_c = tl.minimum(row_c, row_c2)
            if tl.max(bad3.to(tl.int32)) > 0:
                code_c, row_c = _outcome(bad3, kinds3, still3, offs_m, code_c, row_c)
            if tl.max(bad_l.to(tl.int32)) > 0:
                code_s, row_s = _outcome(bad_l, kinds_l, still_l, offs_m, code_s, row_s)
        _report(CODES, ROWS, COLS, SCORES, bh, BH, code_s, row_s, NO_ROW)
        _report(CODES, ROWS, COLS, CONTEXT, bh, BH, code_c, row_c, NO_ROW)
    o = acc / l_i[:, None]
    tl.store(
        OUT + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod,
        o.to(OUT.dtype.element_ty),
        mask=mask,
    )
    tl.store(LSE + bh.to(tl.int64) * N_Q + offs_m, m_i + tl.log2(l_i), mask=m_ok)


# --- backward: dK and dV ------------------------------------------------------------------------


@triton.jit
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    CODES,
    ROWS,
    COLS,
    RATIO,
    INJ,
    qk_scale,
    sm_scale,
    tol,
    near_inf,
    due,
    sqb,
    sqh,
    sqm,
    sqd,
    skb,
    skh,
    skn,
    skd,
    svb,
    svh,
    svn,
    svd,
    sdob,
    sdoh,
    sdom,
    sdod,
    sdkb,
    sdkh,
    sdkn,
    sdkd,
    sdvb,
    sdvh,
    sdvn,
    sdvd,
    H,
    GROUP,
    N_Q,
    N_K,
    D,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    CHECK: tl.constexpr,
    INJECT: tl.constexpr,
    CALIBRATE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """dK and dV of one key block of one (batch, KV head), over the query heads of its group:
    S^T = K Q^T, dV += P^T dO, dP^T = V dO^T, dK += dS^T Q, each tile checked."""
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    HKV = H // GROUP
    BH = tl.num_programs(1) * GROUP
    b = bhk // HKV
    hk = (bhk % HKV).to(tl.int64)
    b64 = b.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_mb = tl.arange(0, BLOCK_M)
    n_ok = offs_n < N_K
    d_ok = offs_d < D
    kv_mask = n_ok[:, None] & d_ok[None, :]
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
    k32 = k.to(tl.float32)
    v32 = v.to(tl.float32)
    kn = _norm(k32, 1)
    vn = _norm(v32, 1)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    lo = 0
    if CAUSAL:
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
    check_s = ((due >> BWD_SCORES) & 1) != 0
    check_p = ((due >> GRAD_PROBS) & 1) != 0
    check_v = ((due >> GRAD_V) & 1) != 0
    check_k = ((due >> GRAD_K) & 1) != 0
    for g in range(0, GROUP):
        h = hk * GROUP + g
        bh = b * H + h.to(tl.int32)
        Qh = Q + b64 * sqb + h * sqh
        DOh = DO + b64 * sdob + h * sdoh
        code_s = 0
        code_p = 0
        code_v = 0
        code_k = 0
        col_s = NO_ROW
        col_p = NO_ROW
        row_v = NO_ROW
        row_k = NO_ROW
        for start_m in range(lo, N_Q, BLOCK_M):
            offs_m = start_m + offs_mb
            m_ok = offs_m < N_Q
            q_mask = m_ok[:, None] & d_ok[None, :]
            q = tl.load(Qh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask=q_mask, other=0.0)
            do = tl.load(
                DOh + offs_m[:, None] * sdom + offs_d[None, :] * sdod, mask=q_mask, other=0.0
            )
            lse = tl.load(LSE + bh.to(tl.int64) * N_Q + offs_m, mask=m_ok, other=0.0)
            delta = tl.load(DELTA + bh.to(tl.int64) * N_Q + offs_m, mask=m_ok, other=0.0)
            q32 = q.to(tl.float32)
            do32 = do.to(tl.float32)
            fresh = start_m == lo
            ref = tl.zeros([BLOCK_N], tl.float32)
            mass = tl.zeros([BLOCK_N], tl.float32)
            # S^T = K Q^T: S^T e = K (Q^T e)
            if CHECK:
                if check_s:
                    ref = tl.sum(k32 * tl.sum(q32, 0)[None, :], 1)
                    mass = kn * _norm(tl.sum(tl.abs(q32), 0), 0)
            st, code_s, col_s = _checked_mm(
                k,
                tl.trans(q),
                ref,
                mass,
                offs_m[None, :],
                offs_n[:, None],
                offs_n,
                bh,
                True,
                check_s,
                code_s,
                col_s,
                tol,
                near_inf,
                INJ,
                RATIO,
                BH,
                BWD_SCORES,
                CHECK,
                INJECT,
                CALIBRATE,
                UPCAST,
            )
            visible = n_ok[:, None] & m_ok[None, :]
            if CAUSAL:
                visible = visible & (offs_m[None, :] >= offs_n[:, None])
            pt = tl.where(visible, tl.exp2(st * qk_scale - lse[None, :]), 0.0)
            pt_lo = pt.to(q.dtype)
            # dV += P^T dO: (P^T dO) e = P^T (dO e)
            if CHECK:
                if check_v:
                    p32 = pt_lo.to(tl.float32)
                    ref = tl.sum(p32 * tl.sum(do32, 1)[None, :], 1)
                    mass = tl.sum(p32, 1) * tl.max(tl.sum(tl.abs(do32), 1), 0)
            part, code_v, row_v = _checked_mm(
                pt_lo,
                do,
                ref,
                mass,
                offs_n[:, None],
                offs_d[None, :],
                offs_n,
                bh,
                fresh,
                check_v,
                code_v,
                row_v,
                tol,
                near_inf,
                INJ,
                RATIO,
                BH,
                GRAD_V,
                CHECK,
                INJECT,
                CALIBRATE,
                UPCAST,
            )
            dv += part
            # dP^T = V dO^T: dP^T e = V (dO^T e)
            if CHECK:
                if check_p:
                    ref = tl.sum(v32 * tl.sum(do32, 0)[None, :], 1)
                    mass = vn * _norm(tl.sum(tl.abs(do32), 0), 0)
            dpt, code_p, col_p = _checked_mm(
                v,
                tl.trans(do),
                ref,
                mass,
                offs_m[None, :],
                offs_n[:, None],
                offs_n,
                bh,
                True,
                check_p,
                code_p,
                col_p,
                tol,
                near_inf,
                INJ,
                RATIO,
                BH,
                GRAD_PROBS,
                CHECK,
                INJECT,
                CALIBRATE,
                UPCAST,
            )
            dst_lo = (pt * (dpt - delta[None, :])).to(q.dtype)
            # dK += dS^T Q: (dS^T Q) e = dS^T (Q e)
            if CHECK:
                if check_k:
                    ds32 = dst_lo.to(tl.float32)
                    ref = tl.sum(ds32 * tl.sum(q32, 1)[None, :], 1)
                    mass = tl.sum(tl.abs(ds32), 1) * tl.max(tl.sum(tl.abs(q32), 1), 0)
            part, code_k, row_k = _checked_mm(
                dst_lo,
                q,
                ref,
                mass,
                offs_n[:, None],
                offs_d[None, :],
                offs_n,
                bh,
                fresh,
                check_k,
                code_k,
                row_k,
                tol,
                near_inf,
                INJ,
                RATIO,
                BH,
                GRAD_K,
                CHECK,
                INJECT,
                CALIBRATE,
                UPCAST,
            )
            dk += part
        if CHECK:
            _report(CODES, ROWS, COLS, BWD_SCORES, bh, BH, code_s, NO_ROW, col_s)
            _report(CODES, ROWS, COLS, GRAD_PROBS, bh, BH, code_p, NO_ROW, col_p)
            _report(CODES, ROWS, COLS, GRAD_V, bh, BH, code_v, row_v, NO_ROW)
            _report(CODES, ROWS, COLS, GRAD_K, bh, BH, code_k, row_k, NO_ROW)
    tl.store(
        DK + b64 * sdkb + hk * sdkh + offs_n[:, None] * sdkn + offs_d[None, :] * sdkd,
        (dk * sm_scale).to(DK.dtype.element_ty),
        mask=kv_mask,
    )
    tl.store(
        DV + b64 * sdvb + hk * sdvh + offs_n[:, None] * sdvn + offs_d[None, :] * sdvd,
        dv.to(DV.dtype.element_ty),
        mask=kv_mask,
    )


# --- backward: dQ -------------------------------------------------------------------------------


@triton.jit
def _dq_rows(
    q,
    do,
    qn,
    don,
    lse,
    delta,
    offs_m,
    m_ok,
    bh,
    K,
    V,
    INJ,
    RATIO,
    BH,
    qk_scale,
    tol,
    near_inf,
    due,
    first_pass,
    skn,
    skd,
    svn,
    svd,
    N_K,
    D,
    hi,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    CHECK: tl.constexpr,
    INJECT: tl.constexpr,
    CALIBRATE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One pass of a query block over its keys for dQ: S = Q K^T, dP = dO V^T, dQ += dS K, each
    tile checked, and the row sums of P and dS with the magnitudes their bounds need (B2)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    d_ok = offs_d < D
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    psum = tl.zeros([BLOCK_M], tl.float32)
    dssum = tl.zeros([BLOCK_M], tl.float32)
    pabs = tl.zeros([BLOCK_M], tl.float32)
    dpmax = tl.zeros([BLOCK_M], tl.float32)
    kmax = 0.0
    code_s = 0
    code_p = 0
    code_q = 0
    row_s = NO_ROW
    row_p = NO_ROW
    row_q = NO_ROW
    check_s = ((due >> BWD_SCORES) & 1) != 0
    check_p = ((due >> GRAD_PROBS) & 1) != 0
    check_q = ((due >> GRAD_Q) & 1) != 0
    q32 = q.to(tl.float32)
    do32 = do.to(tl.float32)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        n_ok = cols < N_K
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(K + cols[:, None] * skn + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
        v = tl.load(V + cols[:, None] * svn + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
        k32 = k.to(tl.float32)
        ref = tl.zeros([BLOCK_M], tl.float32)
        mass = tl.zeros([BLOCK_M], tl.float32)
        if CHECK:
            if check_s:
                ref = tl.sum(q32 * tl.sum(k32, 0)[None, :], 1)
                mass = qn * _norm(tl.sum(tl.abs(k32), 0), 0)
        s, code_s, row_s = _checked_mm(
            q,
            tl.trans(k),
            ref,
            mass,
            offs_m[:, None],
            cols[None, :],
            offs_m,
            bh,
            False,
            check_s,
            code_s,
            row_s,
            tol,
            near_inf,
            INJ,
            RATIO,
            BH,
            BWD_SCORES,
            CHECK,
            INJECT,
            CALIBRATE,
            UPCAST,
        )
        visible = n_ok[None, :] & m_ok[:, None]
        if CAUSAL:
            visible = visible & (cols[None, :] <= offs_m[:, None])
        p = tl.where(visible, tl.exp2(s * qk_scale - lse[:, None]), 0.0)
        if CHECK:
            if check_p:
                v32 = v.to(tl.float32)
                ref = tl.sum(do32 * tl.sum(v32, 0)[None, :], 1)
                mass = don * _norm(tl.sum(tl.abs(v32), 0), 0)
        dp, code_p, row_p = _checked_mm(
            do,
            tl.trans(v),
            ref,
            mass,
            offs_m[:, None],
            cols[None, :],
            offs_m,
            bh,
            False,
            check_p,
            code_p,
            row_p,
            tol,
            near_inf,
            INJ,
            RATIO,
            BH,
            GRAD_PROBS,
            CHECK,
            INJECT,
            CALIBRATE,
            UPCAST,
        )
        ds = p * (dp - delta[:, None])
        ds_lo = ds.to(q.dtype)
        if CHECK:
            psum += tl.sum(p, 1)
            dssum += tl.sum(ds, 1)
            pabs += tl.sum(p * (tl.abs(dp) + tl.abs(delta)[:, None]), 1)
            dpmax = tl.maximum(dpmax, tl.max(tl.where(visible, tl.abs(dp), 0.0), 1))
            kmax = tl.maximum(kmax, tl.max(_norm(k32, 1), 0))
            if check_q:
                ds32 = ds_lo.to(tl.float32)
                ref = tl.sum(ds32 * tl.sum(k32, 1)[None, :], 1)
                mass = tl.sum(tl.abs(ds32), 1) * tl.max(tl.sum(tl.abs(k32), 1), 0)
        part, code_q, row_q = _checked_mm(
            ds_lo,
            k,
            ref,
            mass,
            offs_m[:, None],
            offs_d[None, :],
            offs_m,
            bh,
            first_pass & (start_n == 0),
            check_q,
            code_q,
            row_q,
            tol,
            near_inf,
            INJ,
            RATIO,
            BH,
            GRAD_Q,
            CHECK,
            INJECT,
            CALIBRATE,
            UPCAST,
        )
        dq += part
    return dq, psum, dssum, pabs, dpmax, kmax, code_s, code_p, code_q, row_s, row_p, row_q


@triton.jit
def _bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    ODO,
    DQ,
    CODES,
    ROWS,
    COLS,
    RATIO,
    INJ,
    qk_scale,
    sm_scale,
    tol,
    u_out,
    near_inf,
    due,
    sqb,
    sqh,
    sqm,
    sqd,
    skb,
    skh,
    skn,
    skd,
    svb,
    svh,
    svn,
    svd,
    sdob,
    sdoh,
    sdom,
    sdod,
    sdqb,
    sdqh,
    sdqm,
    sdqd,
    H,
    GROUP,
    N_Q,
    N_K,
    D,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    CHECK: tl.constexpr,
    INJECT: tl.constexpr,
    CALIBRATE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """dQ of one query block of one (batch, head), with the row identities sum P = 1 and
    sum dS = 0 (B2): a row that breaks one is recomputed whole, once. ``ODO`` holds
    ``sum |O| |dO|`` a row, the rounding of the stored O in Delta."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    BH = tl.num_programs(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    hk = (h // GROUP).to(tl.int64)
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
    K += b * skb + hk * skh
    V += b * svb + hk * svh
    qn = _norm(q.to(tl.float32), 1)
    don = _norm(do.to(tl.float32), 1)
    hi = N_K
    if CAUSAL:
        hi = tl.minimum(N_K, (pid_m + 1) * BLOCK_M)
    dq, psum, dssum, pabs, dpmax, kmax, code_s, code_p, code_q, row_s, row_p, row_q = _dq_rows(
        q,
        do,
        qn,
        don,
        lse,
        delta,
        offs_m,
        m_ok,
        bh,
        K,
        V,
        INJ,
        RATIO,
        BH,
        qk_scale,
        tol,
        near_inf,
        due,
        True,
        skn,
        skd,
        svn,
        svd,
        N_K,
        D,
        hi,
        BLOCK_M,
        BLOCK_N,
        HEAD_DIM,
        CAUSAL,
        CHECK,
        INJECT,
        CALIBRATE,
        UPCAST,
    )
    if CHECK:
        # B2: sum_n P = 1 within the rounding of S, lse and exp2; sum_n dS = 0 within that of
        # dP, Delta (from the stored O) and P
        odo = tl.load(ODO + row, mask=m_ok, other=0.0)
        tiles = tl.cdiv(hi, BLOCK_N).to(tl.float32)
        bound_p = tol * (tiles + 1.0 + tl.abs(lse) + qk_scale * (D + 1.0) * qn * kmax)
        bound_ds = 2.0 * u_out * odo + tol * pabs + bound_p * (dpmax + tl.abs(delta))
        check_s = ((due >> BWD_SCORES) & 1) != 0
        check_p = ((due >> GRAD_PROBS) & 1) != 0
        bad_p = _flags(psum, 1.0, bound_p) & m_ok & check_s
        bad_ds = _flags(dssum, 0.0, bound_ds) & m_ok & check_p
        if tl.max((bad_p | bad_ds).to(tl.int32)) > 0:
            kinds_p = _kind(psum, 1.0, near_inf)
            kinds_ds = _kind(dssum, 0.0, near_inf)
            dq, psum, dssum, pabs, dpmax, kmax, c_s, c_p, c_q, r_s, r_p, r_q = _dq_rows(
                q,
                do,
                qn,
                don,
                lse,
                delta,
                offs_m,
                m_ok,
                bh,
                K,
                V,
                INJ,
                RATIO,
                BH,
                qk_scale,
                tol,
                near_inf,
                due,
                False,
                skn,
                skd,
                svn,
                svd,
                N_K,
                D,
                hi,
                BLOCK_M,
                BLOCK_N,
                HEAD_DIM,
                CAUSAL,
                CHECK,
                INJECT,
                CALIBRATE,
                UPCAST,
            )
            still_p = _flags(psum, 1.0, bound_p) & m_ok & check_s
            still_ds = _flags(dssum, 0.0, bound_ds) & m_ok & check_p
            code_s = tl.maximum(code_s, c_s)
            code_p = tl.maximum(code_p, c_p)
            code_q = tl.maximum(code_q, c_q)
            row_s = tl.minimum(row_s, r_s)
            row_p = tl.minimum(row_p, r_p)
            row_q = tl.minimum(row_q, r_q)
            if tl.max(bad_p.to(tl.int32)) > 0:
                code_s, row_s = _outcome(bad_p, kinds_p, still_p, offs_m, code_s, row_s)
            if tl.max(bad_ds.to(tl.int32)) > 0:
                code_p, row_p = _outcome(bad_ds, kinds_ds, still_ds, offs_m, code_p, row_p)
        _report(CODES, ROWS, COLS, BWD_SCORES, bh, BH, code_s, row_s, NO_ROW)
        _report(CODES, ROWS, COLS, GRAD_PROBS, bh, BH, code_p, row_p, NO_ROW)
        _report(CODES, ROWS, COLS, GRAD_Q, bh, BH, code_q, row_q, NO_ROW)
    tl.store(
        DQ + b * sdqb + h * sdqh + offs_m[:, None] * sdqm + offs_d[None, :] * sdqd,
        (dq * sm_scale).to(DQ.dtype.element_ty),
        mask=mask,
    )
