"""A known-answer test of the compiled kernels on one device against the PyTorch path.

megatron_abft.ops.compiled runs it once per CUDA device before its kernels serve that device (this
module registers it there on import; the package imports it): a kernel that got a check wrong would
let a fault through unseen, so a device whose kernels disagree with the reference keeps the PyTorch
path (with a warning) instead. On CPU the test suite covers the same ground; ``mismatches`` runs
there too.
"""

from __future__ import annotations

import torch

from megatron_abft.check.checksum import encode
from megatron_abft.check.eec import (
    KINDS,
    EECResult,
    GemmOperands,
    _kernel_check,
    verify_and_correct,
)
from megatron_abft.check.ledger import Ledger
from megatron_abft.check.sides import Check, _block_sums, inspect_sides, kernel_sides, screen
from megatron_abft.check.tolerance import gemm_rounding
from megatron_abft.ops import compiled

BLOCK = 32
WIDE_BLOCK = 128
"""Blocks of S's screen that the CUDA softmax kernel holding a row in registers
(softmax_rows_kernel) takes: its row blocks are whole slots of 128 columns."""


def mismatches(device: torch.device) -> list[str]:
    """What the kernels get wrong on ``device``: encode_pair, add_bias, block_sums, screen,
    verify_correct, softmax_check and softmax_correct_tally on a small batched GEMM in fp32 and
    bf16, clean and with faults, and tally, against the PyTorch path. Empty when they agree."""
    module, reason = compiled._load()
    if module is None:
        return [reason]
    wrong = []
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(2, 3, 96, 24, generator=g).to(device=device, dtype=dtype)
        b = torch.randn(2, 1, 24, 80, generator=g).to(device=device, dtype=dtype)
        c = a @ b
        with compiled.disabled():
            col, row = encode(a, b, block=BLOCK)
        got = torch.ops.megatron_abft.encode_pair(a, b, 1.0, BLOCK)
        want = (col.sums, col.magnitude, row.sums, row.magnitude)
        if not all(_close(x, y) for x, y in zip(got, want, strict=True)):
            wrong.append(f"encode_pair ({dtype})")
        # b of every matrix its own, read as b^T column by column: on a GPU the two operands'
        # products (one by rows, one by columns) in one launch
        own = torch.randn(2, 3, 24, 80, generator=g).to(device=device, dtype=dtype)
        with compiled.disabled():
            own_col, own_row = encode(a, own, alpha=-0.5, block=BLOCK)
        got = torch.ops.megatron_abft.encode_pair(a, own, -0.5, BLOCK)
        want_own = (own_col.sums, own_col.magnitude, own_row.sums, own_row.magnitude)
        if not all(_close(x, y) for x, y in zip(got, want_own, strict=True)):
            wrong.append(f"encode_pair, b unshared ({dtype})")
        bias = torch.randn(80, generator=g).to(device=device, dtype=dtype)
        with compiled.disabled():
            col_b, row_b = encode(a, b, bias=bias, block=BLOCK)
        biased = torch.ops.megatron_abft.add_bias(*want, bias, 96, BLOCK)
        want_b = (col_b.sums, col_b.magnitude, row_b.sums, row_b.magnitude)
        want_b += (col_b.bias_magnitude, row_b.bias_magnitude)
        if not all(_close(x, y) for x, y in zip(biased, want_b, strict=True)):
            wrong.append(f"add_bias ({dtype})")
        refs = {"col": col, "row": row}
        check = Check(gemm_rounding(dtype, device), 1.0, 1e10, 0, None)
        faulty = c.clone()
        faulty[1, 2, 5, 7] += 1e3
        for name, matrix in (("clean", c), ("one fault", faulty)):
            with compiled.disabled():
                sides = inspect_sides(matrix, refs, check).values()
            expected = sum(s.flagged.flatten(-2).sum(-1).expand(c.shape[:-2]) for s in sides)
            flagged = screen(matrix, refs, check)
            if flagged is None or not torch.equal(flagged.long(), expected):
                wrong.append(f"screen, {name} ({dtype})")
        wrong += _correction_mismatches(a, b, c, refs, check, dtype)
        sums = torch.ops.megatron_abft.block_sums(c, BLOCK, BLOCK)
        with compiled.disabled():
            reference = _block_sums(c, refs)
        for side, (plain, sizes) in reference.items():
            got = sums[:2] if side == "col" else sums[2:]
            if not (_close(got[0], plain) and _close(got[1], sizes)):
                wrong.append(f"block_sums, {side} side ({dtype})")
        wrong += _softmax_mismatches(c, faulty, refs, check, b, dtype)
        with compiled.disabled():
            wide = dict(zip(("col", "row"), encode(a, b, block=WIDE_BLOCK), strict=True))
        wrong += _softmax_screen_mismatches(c, faulty, wide, check, dtype, WIDE_BLOCK)
        wrong += _softmax_correction_mismatches(a, b, c, faulty, refs, check, dtype)
    return wrong + _tally_mismatches(device)


def _softmax_mismatches(c, faulty, refs, check, v, dtype) -> list[str]:
    """softmax_check against the PyTorch path: P against a causally masked torch softmax, its
    flags against the screen, P's pass against operand_pass."""
    wrong = _softmax_screen_mismatches(c, faulty, refs, check, dtype, BLOCK)
    square = c[..., :80, :].contiguous()  # for the causal mask
    u, z = torch.ops.megatron_abft.pair_vectors(square, v.mT, BLOCK)
    p, _, *found = torch.ops.megatron_abft.softmax_check(
        square, 0, 0, [], [], [], [], None, True, 0.5, BLOCK, u, z
    )
    causal = torch.ones(80, 80, dtype=torch.bool, device=c.device).triu(1)
    want = torch.softmax((square.float() * 0.5).masked_fill(causal, -10000.0), -1).to(dtype)
    if not _close(p, want):
        wrong.append(f"softmax_check, probabilities ({dtype})")
    direct = torch.ops.megatron_abft.operand_pass(p, BLOCK, u, z, 1.0)
    if not all(_close(x, y) for x, y in zip(found, direct, strict=True)):
        wrong.append(f"softmax_check, P's pass ({dtype})")
    return wrong


def _softmax_screen_mismatches(c, faulty, refs, check, dtype, block) -> list[str]:
    """softmax_check's flags, with S's screen in blocks of ``block``, against the screen op."""
    wrong = []
    sides = kernel_sides(c, refs, check)
    blocks = "" if block == BLOCK else f", blocks of {block}"
    for name, matrix in (("clean", c), ("one fault", faulty)):
        _, flagged, *_ = torch.ops.megatron_abft.softmax_check(
            matrix, *sides, None, False, 1.0, block, None, None
        )
        if not torch.equal(flagged, torch.ops.megatron_abft.screen(matrix, *sides)):
            wrong.append(f"softmax_check, screen {name}{blocks} ({dtype})")
    return wrong


def _softmax_correction_mismatches(a, b, c, faulty, refs, check, dtype) -> list[str]:
    """softmax_correct_tally on scores with one fault: S corrected, P (and its pass) as from
    the clean scores, one correction tallied."""
    s, ledger = faulty.clone(), Ledger.on(c.device, 0)
    u, z = torch.ops.megatron_abft.pair_vectors(c, b.mT, BLOCK)
    p, failed, *found = torch.ops.megatron_abft.softmax_correct_tally(
        s,
        *kernel_sides(c, refs, check),
        None,
        False,
        1.0,
        BLOCK,
        u,
        z,
        a,
        b,
        1.0,
        1e10,
        96,
        ledger.counts,
        ledger.clock,
        ledger.log,
        ledger.logged,
    )
    want = torch.softmax(c.float(), -1).to(c.dtype)
    direct = torch.ops.megatron_abft.operand_pass(want, BLOCK, u, z, 1.0)
    same = _close(s, c) and _close(p, want) and not bool(failed)
    same = same and all(_close(x, y) for x, y in zip(found, direct, strict=True))
    if not same or int(ledger.counts[1].sum()) != 1 or int(ledger.logged) != 1:
        return [f"softmax_correct_tally ({dtype})"]
    return []


def _correction_mismatches(a, b, c, refs, check, dtype) -> list[str]:
    """verify_correct against the PyTorch path: a 0D fault and a column of NaN corrected (and
    tallied, by verify_correct_tally), and a 2D fault beyond a capacity of 2 put back bit for
    bit."""
    from dataclasses import replace

    operands = GemmOperands(a, b)
    wrong = []
    faulty = c.clone()
    faulty[0, 1, :, 3] = float("nan")
    faulty[1, 0, 7, 9] += 1e3
    settled, tallied = faulty.clone(), faulty.clone()
    found = _kernel_check(settled, refs, replace(check, capacity=96, operands=operands))
    ledger = Ledger.on(c.device, 5)
    both = _kernel_check(tallied, refs, replace(check, capacity=96, operands=operands), ledger)
    with compiled.disabled():
        want = verify_and_correct(faulty, **refs, operands=operands, check_references=False)
    if found is None or not (torch.equal(found[0], want.status) and _close(settled, faulty)):
        wrong.append(f"verify_correct, 0D and 1D ({dtype})")
    if (
        both is None
        or len(both) != 6
        or not (
            torch.equal(both[0], want.status)
            and _close(tallied, faulty)
            and torch.equal(ledger.counts, want.counts)
            and int(ledger.logged) == 1
            and float(ledger.log[0, 1]) == float(want.status.max())
        )
    ):
        wrong.append(f"verify_correct_tally ({dtype})")
    block = c.clone()
    block[1, 2, 10:20, 10:20] = float("nan")
    kept = block.clone()
    found = _kernel_check(block, refs, replace(check, capacity=2, operands=operands))
    put_back = torch.equal(block.isnan(), kept.isnan()) and torch.equal(
        block.nan_to_num(), kept.nan_to_num()
    )
    if found is None or int(found[0][1, 2]) != 2 or not put_back:
        wrong.append(f"verify_correct, put back ({dtype})")
    return wrong


def _tally_mismatches(device: torch.device) -> list[str]:
    """tally against its PyTorch twin (Ledger.tally without the kernels): 300 matrices (more
    than one CUDA thread block takes at once) of every outcome and kind, the worst status on
    many of them, tallied three times into a log that keeps two records."""
    from contextlib import nullcontext

    index = torch.arange(300, device=device)
    status = torch.tensor([0, 1, 2, 1, 2, 0], dtype=torch.int8, device=device).repeat(50)
    found = EECResult(status, (index % len(KINDS)).to(torch.int8), index, 3 * index, index / 7.0)
    got = []
    for kernels in (True, False):
        ledger = Ledger.on(device, 5, capacity=2)
        with nullcontext() if kernels else compiled.disabled():
            failed = [bool(ledger.tally(found)) for _ in range(3)]
        got.append((failed, ledger))
    (failed, ledger), (want_failed, want) = got
    same = failed == want_failed and all(
        torch.equal(getattr(ledger, name), getattr(want, name))
        for name in ("counts", "log", "logged")
    )
    return [] if same else ["tally"]


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    scale = float(want.abs().max()) if want.numel() else 0.0
    return got.shape == want.shape and torch.allclose(
        got.double(), want.double(), rtol=1e-3, atol=1e-3 * scale
    )


compiled.register_selftest(mismatches)
