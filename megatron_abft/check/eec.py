"""Verify, locate and correct one checked GEMM output in place (EEC-ABFT, docs/abft.md §1-4).

``verify_and_correct(c, col, row)`` compares the reference checksums of C (from the inputs, see
megatron_abft.check.checksum) with sums recomputed from C (both sides in one read of C by the
compiled kernels of megatron_abft.ops.compiled where they are built), then for every flagged vector:

1. locates the bad element: from the other side's flags when exactly one crossing vector is
   flagged (exact for any 0D error), else from the weighted checksum, loc = round(d2/d1) - 1, when
   the rounding bound makes that unambiguous, else as the single extreme element (NaN, INF or
   |x| > near_inf) when the differences themselves are not finite;
2. rebuilds it: x[loc] = c0 - sum_{i != loc} x_i from the checksum, or, when the GEMM's operands
   are given, recomputes it from them (as exact as the GEMM). With the operands, a recomputed
   element is kept only if its vector then checks clean; a vector not located tries the weighted
   location however noisy, then the most suspect crossing vector; and a vector that no single
   element makes clean, or that several flagged vectors cross (several errors, more perhaps too
   small to flag), has its whole block recomputed. The vectors one side wrote into are then
   revisited on the other side (columns, rows, then the columns the rows wrote into): a partial
   correction can expose errors that cancelled below their threshold;
3. re-verifies both sides: a matrix with any vector still inconsistent is uncorrectable, and is
   put back exactly as the GEMM produced it.

One side's comparison lives in megatron_abft.check.sides, steps 1 and 2 in
megatron_abft.check.correction.

Results are device tensors. Where the compiled kernels are built and the GEMM's operands are
given, a check is one op (``compiled.verify_correct``, csrc/kernels/abft_correct.h): it screens C,
then takes steps 1 to 3 on the device for each flagged matrix, and puts back bit for bit a matrix it
cannot settle. Where reading the device costs no sync (CPU, or ``sync_free=False``) such a
matrix goes on to the PyTorch path below, so the result is that path's; with ``sync_free`` on a
GPU it is reported uncorrectable, for the caller's policy. Without the kernels or the operands,
by default nothing is read on the host on CUDA (``sync_free``), so the PyTorch correction path
runs on every call there; on CPU it is skipped when nothing was flagged, which costs no sync
there, and ``sync_free=False`` does the same on any device for one sync (the clean path is then
one op of the kernels, megatron_abft.check.sides.screen).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from megatron_abft.check.checksum import (
    FLOATING,
    Checksums,
    GemmOperands,
    broadcast_shapes,
    nblocks,
)
from megatron_abft.check.correction import (
    correct_side,
    crossing_flags,
    sum_into,
    vectors_to_correct,
)
from megatron_abft.check.ledger import Ledger
from megatron_abft.check.sides import Check, Side, inspect_sides, kernel_sides, screen
from megatron_abft.check.tolerance import gemm_rounding
from megatron_abft.config import CLEAN, CORRECTED, KINDS, OUTCOMES, UNCORRECTABLE
from megatron_abft.ops import compiled


@dataclass(frozen=True)
class EECResult:
    """What one ``verify_and_correct`` call found, as device tensors.

    Per matrix of the batch: ``status`` (CLEAN, CORRECTED or UNCORRECTABLE), ``kind`` (index
    into KINDS), the ``row`` and ``col`` of the most wrong flagged row and column (-1 where none
    is) and ``magnitude``, the largest checksum difference |d1| seen (the size of the error).
    ``known_clean`` says, without reading the device, that nothing was found. ``tallied``: where
    the check was given a ledger and the kernels settled it sync-free and tallied it there,
    whether a matrix is uncorrectable (a bool tensor), as Ledger.tally returns it.
    """

    status: Tensor
    kind: Tensor
    row: Tensor
    col: Tensor
    magnitude: Tensor
    known_clean: bool = False
    tallied: Tensor | None = None

    @property
    def fields(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """status, kind, row, col and magnitude, in that order."""
        return self.status, self.kind, self.row, self.col, self.magnitude

    @property
    def counts(self) -> Tensor:
        """``counts[o, k]``: matrices with outcome ``OUTCOMES[o]`` and kind ``KINDS[k]``
        (int64, on the device; computed on each access)."""
        outcome = torch.stack(
            [self.status != CLEAN, self.status == CORRECTED, self.status == UNCORRECTABLE]
        )
        one_hot = torch.nn.functional.one_hot(self.kind.reshape(-1).long(), len(KINDS))
        return (outcome.reshape(3, -1).unsqueeze(-1).long() * one_hot).sum(1)


def report(result: EECResult) -> dict[str, dict[str, int]]:
    """The counters as plain Python numbers (one host synchronisation)."""
    counts = result.counts.tolist()
    return {o: dict(zip(KINDS, counts[i], strict=True)) for i, o in enumerate(OUTCOMES)}


@dataclass(frozen=True)
class Residuals:
    """Per checked vector ``[..., nblocks, n]``: the differences between reference and recomputed
    sums (plain ``d1``, weighted ``d2``), their thresholds and whether the vector is flagged."""

    d1: Tensor
    d2: Tensor
    tau: Tensor
    tau_w: Tensor
    flagged: Tensor


@torch.no_grad()
def residuals(
    c: Tensor, ref: Checksums, *, side: str = "col", threshold_scale: float = 1.0
) -> Residuals:
    """Compare one side of ``c`` (``"col"`` or ``"row"``) with its reference checksums, without
    correcting anything."""
    if side not in ("col", "row"):
        raise ValueError(f"side must be 'col' or 'row', got {side!r}")
    _check_inputs(c, ref if side == "col" else None, ref if side == "row" else None)
    check = Check(gemm_rounding(c.dtype, c.device), threshold_scale, 0.0, 0, None)
    found = inspect_sides(c, {side: ref}, check)[side]
    return Residuals(found.d1, found.d2, found.tau, found.tau_w, found.flagged)


@torch.no_grad()
def verify_and_correct(
    c: Tensor,
    col: Checksums | None = None,
    row: Checksums | None = None,
    *,
    operands: GemmOperands | None = None,
    threshold_scale: float = 1.0,
    near_inf: float = 1e10,
    max_corrections: int | None = None,
    check_references: bool = True,
    sync_free: bool = True,
    ledger: Ledger | None = None,
) -> EECResult:
    """Check ``c [..., m, n]`` against its column and/or row checksums and correct it in place.

    ``operands`` (the GEMM's inputs) make corrections as exact as the GEMM; without them the bad
    element is rebuilt from the checksum. At most ``max_corrections`` (default max(m, n)) vectors
    per side are corrected in one call, enough for one 1D fault; the rest are uncorrectable. Whole
    blocks recomputed from the operands are limited to as many elements per side and pass.
    ``check_references`` rejects non-finite reference checksums with a ValueError, at the cost of
    one host synchronisation; the protected layers turn it off and count such matrices as
    uncorrectable instead. ``sync_free=False`` lets a device other than the CPU read whether
    anything was flagged (one host synchronisation) and skip the correction path when nothing was,
    as the CPU always does. ``ledger`` (a guard's, megatron_abft.check.ledger): where the check
    stays sync-free on a device other than the CPU and the kernels run it, they also tally its
    outcomes into the ledger in the same op (one launch), and the result's ``tallied`` says so;
    elsewhere the tally is left to the caller.
    """
    _check_inputs(c, col, row)
    if operands is not None:
        _check_operands_fit(c, operands)
    if check_references:
        _check_references_finite(col, row)
    if c.numel() == 0:  # an empty output: nothing to check
        return _clean_result(c)
    capacity = max_corrections if max_corrections is not None else max(c.shape[-2:])
    check = Check(gemm_rounding(c.dtype, c.device), threshold_scale, near_inf, capacity, operands)
    refs = {name: ref for name, ref in (("col", col), ("row", row)) if ref is not None}
    # reading the flags costs no sync; traced (torch.compile), nothing is read, as on a GPU
    may_skip = (c.device.type == "cpu" or not sync_free) and not torch.compiler.is_compiling()
    ledger = None if may_skip else ledger  # else the PyTorch path may change what was found
    found = _kernel_check(c, refs, check, ledger) if operands is not None else None
    if found is not None:
        if not may_skip:  # a matrix the kernels could not settle is uncorrectable, as it was
            return EECResult(*found[:5], tallied=None if ledger is None else found[5])
        worst = int(found[0].max()) if found[0].numel() else CLEAN
        if worst != UNCORRECTABLE:
            return EECResult(*found, known_clean=worst == CLEAN)
    if c.dim() == 2:  # one matrix: the PyTorch path indexes a batch dim
        batched = {name: _batched(ref) for name, ref in refs.items()}
        kernels = None if found is None else tuple(t.unsqueeze(0) for t in found)
        result = _rest(c.unsqueeze(0), batched, check, may_skip, kernels)
        return EECResult(*(t[0] for t in result.fields), known_clean=result.known_clean)
    return _rest(c, refs, check, may_skip, found)


def _rest(
    c: Tensor,
    refs: dict[str, Checksums],
    check: Check,
    may_skip: bool,
    found: tuple[Tensor, ...] | None,
) -> EECResult:
    """The PyTorch path: for the matrices the kernels ``found`` UNCORRECTABLE (and put back as
    they were), or for all of them where the kernels did not run (``found`` None)."""
    if found is not None:
        fixed = found[0] == CORRECTED
        rest = _torch_path(c, refs, check, may_skip)
        merged = [
            torch.where(fixed, k, t)
            for k, t in zip(
                found, (rest.status, rest.kind, rest.row, rest.col, rest.magnitude), strict=True
            )
        ]
        return _result(*merged)
    if may_skip:
        flagged = screen(c, refs, check)  # one op of the compiled kernels
        if flagged is not None and not bool(flagged.any()):
            return _clean_result(c)
    return _torch_path(c, refs, check, may_skip)


def _kernel_check(
    c: Tensor,
    refs: dict[str, Checksums],
    check: Check,
    ledger: Ledger | None = None,
) -> tuple[Tensor, ...] | None:
    """The compiled kernels' verify-and-correct of ``c`` in place (one op): per matrix status,
    kind, row, col and magnitude, a status of UNCORRECTABLE for a matrix they could not settle
    and put back as it was; with a ``ledger``, then failed, tallied into it (compiled.tally). None
    where the kernels do not apply."""
    sides = kernel_sides(c, refs, check)
    if sides is None:
        return None
    operands = check.operands  # read under no_grad: nothing to detach
    return compiled.verify_correct(
        c,
        sides,
        (operands.a, operands.b, float(operands.alpha), operands.bias),
        check.near_inf,
        check.capacity,
        ledger,
    )


def _torch_path(c: Tensor, refs: dict[str, Checksums], check: Check, may_skip: bool) -> EECResult:
    """Steps 1 to 3 of the module docstring in PyTorch: the reference."""
    operands, near_inf = check.operands, check.near_inf
    sides = inspect_sides(c, refs, check)
    if may_skip and not any(bool(s.flagged.any()) for s in sides.values()):
        return _clean_result(c)
    detected = _any_flagged(sides.values(), c.shape[:-2])
    kind = torch.stack([_kind(s, near_inf).amax((-2, -1)) for s in sides.values()]).amax(0)
    row, col, magnitude = _where(sides, c.shape[:-2])

    corrections, slack, touched = [], {}, {}
    # with the operands the column side goes again, for the columns the row side wrote into
    order = ["col", "row", "col"] if operands is not None and len(sides) == 2 else list(sides)
    for i, name in enumerate(order):
        side, other_name = sides[name], "row" if name == "col" else "col"
        again = name in order[:i]
        if c.device.type == "cpu" and not bool(
            vectors_to_correct(side, touched.get(name), again).any()
        ):
            continue  # nothing to correct on this side, which costs no sync to know on CPU
        other = sides.get(other_name)
        crossing = crossing_flags(other, side) if other else None
        written = correct_side(side, crossing, check, touched.get(name), again)
        corrections += written
        if other and operands is None:  # rebuilt values carry this side's rounding noise
            slack[other_name] = sum_into(other, written, [w.error_bound for w in written])
        elif other:
            touched[other_name] = sum_into(other, written, [w.done for w in written]) > 0
        if c.device.type == "cpu" and i + 1 < len(order):  # stop once C checks clean
            rechecked = inspect_sides(c, refs, check, slack).values()
            if not any(bool(s.flagged.any()) for s in rechecked):
                break
    else:
        rechecked = inspect_sides(c, refs, check, slack).values()
    unresolved = _any_flagged(rechecked, c.shape[:-2])
    for correction in reversed(corrections):  # an uncorrectable matrix is left as it was
        correction.undo_where(unresolved)

    status = torch.where(unresolved, UNCORRECTABLE, torch.where(detected, CORRECTED, CLEAN))
    return _result(status, kind, row, col, magnitude)


def _result(status: Tensor, kind: Tensor, row: Tensor, col: Tensor, magnitude: Tensor) -> EECResult:
    """An EECResult from per-matrix fields of any integer dtypes."""
    return EECResult(status.to(torch.int8), kind.to(torch.int8), row, col, magnitude)


def _clean_result(c: Tensor) -> EECResult:
    """The result of a check of ``c`` that found nothing (three allocations: on a GPU, kernels)."""
    batch = c.shape[:-2]
    row, col = torch.full((2, *batch), -1, dtype=torch.long, device=c.device).unbind()
    status, kind = torch.zeros((2, *batch), dtype=torch.int8, device=c.device).unbind()
    dtype = torch.float64 if c.dtype == torch.float64 else torch.float32  # as a check's |d1|
    magnitude = torch.zeros(batch, dtype=dtype, device=c.device)
    return EECResult(status, kind, row, col, magnitude, known_clean=True)


def _kind(side: Side, near_inf: float) -> Tensor:
    """Per vector: index into KINDS of its checksum difference (0 where not flagged). A difference
    of at least near_inf / 2 is near-INF: an injected |x| = near_inf minus the true value."""
    d1 = side.d1
    kind = torch.where(d1.abs() >= near_inf / 2, 1, 0)
    kind = torch.where(torch.isinf(d1), 2, kind)
    kind = torch.where(torch.isnan(d1) | torch.isnan(side.d2), 3, kind)
    return torch.where(side.flagged, kind, 0)


def _where(sides: dict[str, Side], batch_shape) -> tuple[Tensor, Tensor, Tensor]:
    """Per matrix: the most wrong flagged row (from the row side) and column (from the column
    side), -1 where that side flagged nothing or is not checked, and the largest |d1|."""
    index, magnitude = {}, []
    for name, side in sides.items():
        error = torch.where(side.flagged, side.d1.abs().nan_to_num(torch.inf), -1.0)
        worst, flat = error.flatten(-2).max(-1)  # over blocks and vectors
        vector = flat % side.d1.shape[-1]
        index[name] = torch.where(worst >= 0, vector, -1).expand(batch_shape)
        magnitude.append(
            torch.where(side.flagged, side.d1.abs(), 0).flatten(-2).amax(-1).expand(batch_shape)
        )
    missing = torch.full(batch_shape, -1, dtype=torch.long, device=magnitude[0].device)
    return index.get("row", missing), index.get("col", missing), torch.stack(magnitude).amax(0)


def _any_flagged(sides, batch_shape) -> Tensor:
    flags = [s.flagged.flatten(-2).any(-1).expand(batch_shape) for s in sides]
    return torch.stack(flags).any(0)


# --- input checks -----------------------------------------------------------------------------


def _batched(ref: Checksums | None) -> Checksums | None:
    if ref is None:
        return None
    bias = ref.bias_magnitude
    return replace(
        ref,
        sums=ref.sums.unsqueeze(0),
        magnitude=ref.magnitude.unsqueeze(0),
        bias_magnitude=None if bias is None else bias.unsqueeze(0),
    )


def _check_inputs(c: Tensor, col: Checksums | None, row: Checksums | None) -> None:
    if not isinstance(c, Tensor):
        raise TypeError(f"c must be a torch.Tensor, got {type(c).__name__}")
    if c.dtype not in FLOATING:
        raise TypeError(f"c must be fp64, fp32, bf16 or fp16; got {c.dtype}")
    if c.dim() < 2:
        raise ValueError(f"c must have at least 2 dims [..., m, n]; got {tuple(c.shape)}")
    if col is None and row is None:
        raise ValueError("give at least one side's checksums (col=..., row=...)")
    m, n = c.shape[-2:]
    for name, ref, checked, across in (("col", col, m, n), ("row", row, n, m)):
        if ref is None:
            continue
        if not isinstance(ref, Checksums):
            raise TypeError(f"{name} must be Checksums, got {type(ref).__name__}")
        if ref.sums.device != c.device:
            raise ValueError(f"{name} checksums are on {ref.sums.device} but c is on {c.device}")
        expected = (nblocks(checked, ref.block), 2, across)
        try:
            fits = broadcast_shapes(ref.sums.shape[:-3], c.shape[:-2]) == c.shape[:-2]
        except RuntimeError:
            fits = False
        if ref.length != checked or tuple(ref.sums.shape[-3:]) != expected or not fits:
            raise ValueError(
                f"{name} checksums of shape {tuple(ref.sums.shape)} (length {ref.length}) do not "
                f"fit c of shape {tuple(c.shape)}: expected [..., {expected[0]}, 2, {across}] "
                f"summing {checked} entries; encode them from the same GEMM"
            )


def _check_operands_fit(c: Tensor, operands: GemmOperands) -> None:
    if not isinstance(operands, GemmOperands):
        raise TypeError(f"operands must be GemmOperands, got {type(operands).__name__}")
    a, b = operands.a, operands.b
    m, n = c.shape[-2:]
    if (
        a.dim() < 2
        or b.dim() < 2
        or a.shape[-2] != m
        or b.shape[-1] != n
        or a.shape[-1] != b.shape[-2]
    ):
        raise ValueError(
            f"operands a {tuple(a.shape)} and b {tuple(b.shape)} do not produce c of shape "
            f"{tuple(c.shape)}: need a [..., {m}, k] and b [..., k, {n}]"
        )
    if a.device != c.device or b.device != c.device:
        raise ValueError(f"operands are on {a.device}/{b.device} but c is on {c.device}")


def _check_references_finite(col: Checksums | None, row: Checksums | None) -> None:
    for name, ref in (("col", col), ("row", row)):
        if ref is not None and not bool(
            torch.isfinite(ref.sums).all() & torch.isfinite(ref.magnitude).all()
        ):
            raise ValueError(
                f"{name} reference checksums contain NaN or INF: the GEMM's inputs are already "
                "corrupted, so this output cannot be checked; protect the producer of the inputs"
            )
